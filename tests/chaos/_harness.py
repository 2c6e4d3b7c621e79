"""The chaos run: real processes, real faults, and a ledger that says what really ran.

```
agents (A processes, SIGKILLed, restarted)        IdP (own process, 3 s tokens)
   │ AsyncToolInvoker + ClientCredentials ───────────────▲   ▲ token check
   ▼                                                     │   │
fault proxy (own process, seeded) ──▶ uvicorn --workers 2: BearerAuth ─▶ IdempotencyMiddleware
                                        │ ledger (O_APPEND file)   └─ RedisStore ─▶ redis-server
                                        ▼                           (AOF, appendfsync always;
                                  one line per execution             SIGKILLed, restarted)
```

Every (plan, step, args) is one Idempotency-Key. After the run the harness joins the
agents' results, the ledger and the proxy's fault log, and checks:

1. every key ran at most once on the ledger, the Redis outage included: a handler whose
   lease lapsed while Redis was down leaves its key in doubt (409 ``in_doubt``), never
   free. (``AGENTKEY_CHAOS_STRICT_OUTAGE=0`` lists a duplicate across the outage apart
   instead of failing the run, as before the in-doubt state existed.) Keys the server
   answered ``in_doubt`` are counted and reported: a correct outcome, never a duplicate;
2. every replica of every step ended, with a result or an ``AgentKeyError`` subclass;
3. no untyped exception, and no call took longer than its deadline plus a grace;
4. a successful result names an execution the ledger holds (nothing reported done that did
   not run, and every replica that got a result got the one execution's answer);
5. ``OutcomeUnknown`` only where the client could not know: some request of that call
   (the proxy logs each with its caller) met a fault after which a client cannot tell
   whether the tool ran (reset, lost answer, delay, a 502/503 from the proxy), got no
   answer or one after the read timeout or the call's deadline, or got a 5xx from the
   tool server itself (the store was down), or was told the key is in doubt. A call whose
   every answer was definite (201, a replay, 409 in progress, 4xx) must not end in
   ``OutcomeUnknown``.

A key may run zero times when every replica gave up with a typed error: by design for
steps the tool refuses (``ToolRejected``, before any side effect), else after faults
exhausted the budget or while Redis was down; each zero is classified in the summary.
"""

from __future__ import annotations

import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agentkey import PlanSession
from tests._loopback import free_port
from tests.chaos._proxy import AMBIGUOUS

ROOT = Path(__file__).resolve().parents[2]
CLIENT_ID = "chaos-agent"
CLIENT_SECRET = "chaos-client-secret-7f3a"
TOOLS = ("charge", "provision", "notify")
GRACE = 5.0  # a loaded machine may stall a process this long past a call's deadline


@dataclass(frozen=True)
class Profile:
    """The size and the fault mix of one run."""

    steps: int = 2000  # logical steps (plans x steps_per_plan)
    steps_per_plan: int = 5
    agents: int = 4
    concurrency: int = 12  # replicas in flight per agent
    workers: int = 2  # uvicorn worker processes
    fault_rate: float = 0.3
    lease: float = 2.0  # lock_ttl; auto-renewed every third of it
    slow_fraction: float = 0.04  # steps whose handler works 1.2-2x the lease
    reject_fraction: float = 0.02  # steps the tool refuses (402) before any side effect
    multi_fraction: float = 0.2  # plans with 3-8 replicas (the rest have 2)
    kills: int = 3  # agent SIGKILLs
    read_timeout: float = 2.0
    deadline: float = 10.0  # RetryPolicy.deadline of every call
    max_attempts: int = 12
    token_lifetime: float = 3.0
    budget: float = 300.0  # seconds before the run counts as hung
    auto_renew: bool = True
    strict_outage: bool = True  # a duplicate across the Redis outage fails the run too

    @classmethod
    def from_env(cls) -> Profile:
        """``AGENTKEY_CHAOS_STEPS`` sets the size (2,000: the quick profile); a long run
        gets more kills and a budget that scale with it. ``AGENTKEY_CHAOS_AUTO_RENEW=0``
        runs the server without lease renewal; ``AGENTKEY_CHAOS_STRICT_OUTAGE=0`` lists a
        duplicate across the Redis outage apart instead of failing on it."""
        steps = int(os.environ.get("AGENTKEY_CHAOS_STEPS", "2000"))
        flags = {
            "auto_renew": os.environ.get("AGENTKEY_CHAOS_AUTO_RENEW", "1") == "1",
            "strict_outage": os.environ.get("AGENTKEY_CHAOS_STRICT_OUTAGE", "1") == "1",
        }
        if steps <= 5000:
            return cls(steps=steps, **flags)
        return cls(steps=steps, kills=steps // 2500, budget=steps * 0.12 + 600, **flags)


@dataclass
class Run:
    """What happened during the run (times are wall-clock, shared by every process)."""

    seed: str
    profile: Profile
    workdir: Path
    plans: list[dict[str, Any]] = field(default_factory=list)
    keys: dict[tuple[int, int], str] = field(default_factory=dict)
    replicas: dict[int, int] = field(default_factory=dict)
    kills: list[dict[str, Any]] = field(default_factory=list)
    outage: tuple[float, float] | None = None
    hung: list[str] = field(default_factory=list)
    crashed: list[str] = field(default_factory=list)
    wall: float = 0.0
    cpu: float = 0.0
    stopped: float = 0.0  # wall-clock time the agents were done (or stopped)


# What the tool server logged about its store while Redis was down (counted, not asserted:
# the wording belongs to the middleware).
_STORE_FAILURES = {
    "claim refused (503)": r"failed while claiming",
    "outcome not recorded": r"could not record the outcome",
    "renewal failed": r"renewing the lease on \S+ failed",
    "lease lapsed, key taken by another request": r"another request owns the key now",
}


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"{what} did not start on port {port}")
        time.sleep(0.05)


def _start_redis(port: int, workdir: Path) -> subprocess.Popen[bytes]:
    """redis-server with the persistence docs/server.md recommends (AOF, fsync always)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not on PATH; the chaos suite needs a real Redis")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "yes", "--appendfsync", "always", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return proc
        except OSError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"redis-server did not start on port {port}")
        time.sleep(0.05)


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _build_plans(run: Run) -> dict[str, list[list[int]]]:
    """Draw the plans from the seed, hand out every step once (the planner), save each
    plan with ``to_json()``, and assign its replicas to agents."""
    prof = run.profile
    rng = random.Random(f"{run.seed}:plans")
    assign: dict[str, list[list[int]]] = {str(a): [] for a in range(prof.agents)}
    for p in range(-(-prof.steps // prof.steps_per_plan)):
        session = PlanSession(id=str(uuid.UUID(int=rng.getrandbits(128), version=4)))
        steps = []
        for s in range(prof.steps_per_plan):
            tool = rng.choice(TOOLS)
            slow = rng.random() < prof.slow_fraction
            work = rng.uniform(1.2, 2.0) * prof.lease if slow else rng.uniform(0.0, 0.02)
            args = {"n": s, "plan": p, "work_ms": round(work * 1000)}
            if rng.random() < prof.reject_fraction:
                args["reject"] = True
            run.keys[p, s] = session.step(s, tool, args).idempotency_key
            steps.append([tool, args])
        run.plans.append({"plan": session.to_json(), "steps": steps})
        replicas = rng.randint(3, 8) if rng.random() < prof.multi_fraction else 2
        run.replicas[p] = replicas
        for r in range(replicas):
            assign[str((p + r) % prof.agents)].append([p, r])
    return assign


class _Progress:
    """Counts result lines as the agents append them."""

    def __init__(self, results: Path) -> None:
        self.results = results
        self.offsets: dict[Path, int] = {}
        self.lines = 0

    def poll(self) -> int:
        for path in self.results.glob("results-*.jsonl"):
            with path.open("rb") as f:
                f.seek(self.offsets.get(path, 0))
                chunk = f.read()
            self.offsets[path] = self.offsets.get(path, 0) + len(chunk)
            self.lines += chunk.count(b"\n")
        return self.lines


@contextmanager
def _services(run: Run) -> Iterator[dict[str, Any]]:
    """Redis, the IdP, the tool server and the proxy; yields their handles."""
    prof = run.profile
    with ExitStack() as stack:
        redis_dir = run.workdir / "redis"
        redis_dir.mkdir()
        redis_port = free_port()
        handles: dict[str, Any] = {"redis_port": redis_port, "redis_dir": redis_dir}
        handles["redis"] = _start_redis(redis_port, redis_dir)
        stack.callback(lambda: _stop(handles["redis"]))

        idp_port = free_port()
        idp_log = (run.workdir / "idp.log").open("wb")
        stack.callback(idp_log.close)
        idp = subprocess.Popen(
            [sys.executable, "-m", "tests.chaos._idp", str(idp_port), str(prof.token_lifetime),
             CLIENT_ID, CLIENT_SECRET],
            cwd=ROOT, stdout=idp_log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        stack.callback(lambda: _stop(idp))
        _wait_port(idp_port, idp, "the identity provider")
        handles["idp_url"] = idp_url = f"http://127.0.0.1:{idp_port}"

        tool_port = free_port()
        env = {
            **os.environ,
            "AGENTKEY_CHAOS_REDIS": f"redis://127.0.0.1:{redis_port}/0",
            "AGENTKEY_CHAOS_PREFIX": f"chaos{run.seed}",
            "AGENTKEY_CHAOS_LEASE": str(prof.lease),
            "AGENTKEY_CHAOS_AUTO_RENEW": "1" if prof.auto_renew else "0",
            "AGENTKEY_CHAOS_LEDGER": str(run.workdir / "ledger.txt"),
            "AGENTKEY_CHAOS_DOUBTS": str(run.workdir / "doubts.txt"),
            "AGENTKEY_CHAOS_IDP": idp_url,
        }
        server_log = (run.workdir / "server.log").open("wb")
        stack.callback(server_log.close)
        server = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "tests.chaos._app:app",
             "--workers", str(prof.workers), "--host", "127.0.0.1", "--port", str(tool_port),
             "--log-level", "warning", "--no-access-log"],
            cwd=ROOT, env=env, stdout=server_log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        stack.callback(lambda: _stop(server))
        _wait_port(tool_port, server, "the tool server")
        deadline = time.monotonic() + 30
        while httpx.get(f"http://127.0.0.1:{tool_port}/health").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the tool server did not answer /health")
            time.sleep(0.1)

        proxy_port = free_port()
        proxy = subprocess.Popen(
            [sys.executable, "-m", "tests.chaos._proxy", str(proxy_port), str(tool_port),
             run.seed, str(prof.fault_rate), str(prof.read_timeout),
             str(run.workdir / "faults.txt")],
            cwd=ROOT, stdout=subprocess.PIPE,
        )  # fmt: skip
        stack.callback(lambda: _stop(proxy))
        assert proxy.stdout is not None
        stack.callback(proxy.stdout.close)
        if proxy.stdout.readline().strip() != b"ready":
            raise RuntimeError("the fault proxy did not start")
        handles["proxy_url"] = f"http://127.0.0.1:{proxy_port}"
        yield handles


def _start_agent(run: Run, config: Path, index: int) -> subprocess.Popen[bytes]:
    log = (run.workdir / f"agent-{index}.log").open("ab")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.chaos._agent", str(config), str(index)],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    finally:
        log.close()


def _restart_redis(run: Run, handles: dict[str, Any]) -> None:
    """Crash Redis (SIGKILL: no shutdown save) and start it again on its AOF."""
    down = time.time()
    _stop(handles["redis"], signal.SIGKILL)
    time.sleep(1.0)
    handles["redis"] = _start_redis(handles["redis_port"], handles["redis_dir"])
    run.outage = (down, time.time())


def _drive(run: Run, handles: dict[str, Any], assign: dict[str, list[list[int]]]) -> None:
    prof = run.profile
    results = run.workdir / "results"
    results.mkdir()
    config = run.workdir / "config.json"
    config.write_text(
        json.dumps(
            {
                "proxy_url": handles["proxy_url"],
                "idp_url": handles["idp_url"],
                "client_id": CLIENT_ID,
                "client_secret": CLIENT_SECRET,
                "results_dir": str(results),
                "deadline": prof.deadline,
                "read_timeout": prof.read_timeout,
                "max_attempts": prof.max_attempts,
                "concurrency": prof.concurrency,
                "plans": run.plans,
                "assign": assign,
            }
        )
    )
    rng = random.Random(f"{run.seed}:schedule")
    kill_at = sorted(rng.uniform(0.1, 0.85) for _ in range(prof.kills))
    restart_at = 0.4
    total = sum(len(v) for v in assign.values()) * prof.steps_per_plan
    progress = _Progress(results)
    agents = {a: _start_agent(run, config, a) for a in range(prof.agents)}
    finished: set[int] = set()
    started = time.monotonic()
    while len(finished) < prof.agents:
        time.sleep(0.1)
        done = progress.poll() / total
        if kill_at and done >= kill_at[0]:
            kill_at.pop(0)
            alive = sorted(set(agents) - finished)
            if alive:
                victim = rng.choice(alive)
                _stop(agents[victim], signal.SIGKILL)
                run.kills.append({"agent": victim, "at": time.time(), "progress": done})
                agents[victim] = _start_agent(run, config, victim)
        if run.outage is None and done >= restart_at:
            _restart_redis(run, handles)
        for a, proc in agents.items():
            code = proc.poll()
            if code is not None and a not in finished:
                finished.add(a)
                if code != 0:
                    log = (run.workdir / f"agent-{a}.log").read_text(errors="replace")
                    run.crashed.append(f"agent {a} exited {code}: {log[-1500:]}")
        if time.monotonic() - started > prof.budget:
            for a in set(agents) - finished:
                _stop(agents[a], signal.SIGKILL)
                run.hung.append(f"agent {a} still running after {prof.budget:.0f} s")
            break
    run.stopped = time.time()


def _cpu_seconds() -> float:
    """CPU of this process and of every child it waited for (their children included)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def run_chaos(profile: Profile, workdir: Path, seed: str | None = None) -> dict[str, Any]:
    """Run one chaos profile in ``workdir``; return the summary (``violations`` empty when
    every assertion held)."""
    seed = seed or os.environ.get("AGENTKEY_CHAOS_SEED")
    seed = seed or str(random.SystemRandom().getrandbits(32))
    print(f"\nchaos: seed {seed} (reproduce with AGENTKEY_CHAOS_SEED={seed} "
          f"AGENTKEY_CHAOS_STEPS={profile.steps})", flush=True)  # fmt: skip
    run = Run(seed=seed, profile=profile, workdir=workdir)
    assign = _build_plans(run)
    wall, cpu = time.monotonic(), _cpu_seconds()
    with _services(run) as handles:
        _drive(run, handles, assign)
    run.wall, run.cpu = time.monotonic() - wall, _cpu_seconds() - cpu
    summary = analyse(run)
    print(format_summary(summary), flush=True)
    report = os.environ.get("AGENTKEY_CHAOS_REPORT")
    if report:
        Path(report).write_text(json.dumps(summary, indent=2, sort_keys=True))
    return summary


def _overlaps(a0: float, a1: float, window: tuple[float, float] | None) -> bool:
    return window is not None and a0 <= window[1] and window[0] <= a1


def analyse(run: Run) -> dict[str, Any]:
    prof = run.profile
    violations: list[str] = []
    ledger: dict[str, list[tuple[str, float, float]]] = defaultdict(list)
    ledger_path = run.workdir / "ledger.txt"
    if ledger_path.exists():
        for line in ledger_path.read_text().splitlines():
            key, exec_id, _pid, t0, t1 = line.split()
            ledger[key].append((exec_id, float(t0), float(t1)))
    sent_by: dict[tuple[str, str], list[tuple[float, float, str, int]]] = defaultdict(list)
    kinds: Counter[str] = Counter()
    for line in (run.workdir / "faults.txt").read_text().splitlines():
        received, over, kind, status, caller, key = line.split()
        kinds[kind] += 1
        sent_by[caller, key].append((float(received), float(over), kind, int(status)))
    in_flight: dict[tuple[int, int, int], float] = {}
    for path in (run.workdir / "results").glob("results-*.started"):
        for line in path.read_text().splitlines():
            plan, replica, index, t0 = line.split()
            in_flight[int(plan), int(replica), int(index)] = float(t0)
    rows: dict[tuple[int, int, int], dict[str, Any]] = {}
    for path in (run.workdir / "results").glob("results-*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows[row["p"], row["r"], row["s"]] = row
    # Outcomes of a call that overlapped the outage, or a handler that ran across it, may
    # legitimately differ: the window covers the lease a renewal could not extend.
    window = None
    if run.outage is not None:
        window = (run.outage[0] - 1.0, run.outage[1] + prof.lease + 1.0)
    server_log = (run.workdir / "server.log").read_text(errors="replace")
    store_failures = {
        kind: len(re.findall(pattern, server_log)) for kind, pattern in _STORE_FAILURES.items()
    }
    logged_keys = set(re.findall(r"[0-9a-f-]{36}:step_[0-9.]+:[0-9a-f]{64}", server_log))
    # Keys the server put in doubt (500: the handler failed after it may have started) and
    # the in_doubt answers it gave (409), from the tool server's decision hook.
    doubted: Counter[str] = Counter()
    doubt_answers = 0
    doubts_path = run.workdir / "doubts.txt"
    if doubts_path.exists():
        for line in doubts_path.read_text().splitlines():
            status, key, _at = line.split()
            doubted[key] += 1
            doubt_answers += status == "409"

    outcomes: Counter[str] = Counter()
    unknown_causes: Counter[str] = Counter()
    zero: Counter[str] = Counter()
    histogram: Counter[int] = Counter()
    outage_duplicates: list[str] = []
    max_elapsed = 0.0
    for (p, s), key in run.keys.items():
        executions = ledger.get(key, [])
        histogram[len(executions)] += 1
        exec_ids = {e[0] for e in executions}
        # The server logs the key of every claim it could not renew or settle.
        across_outage = key in logged_keys and any(
            _overlaps(t0, t1, window) for _, t0, t1 in executions
        )
        if len(executions) > 1:
            if across_outage and not prof.strict_outage:
                outage_duplicates.append(key)
            else:
                violations.append(
                    f"duplicate: {key} ran {len(executions)} times "
                    f"(plan {p} step {s}; executions {sorted(executions)})"
                )
        step_rows = []
        for r in range(run.replicas[p]):
            row = rows.get((p, r, s))
            if row is None:
                since = in_flight.get((p, r, s))
                state = (
                    "never started"
                    if since is None
                    else f"in flight for {run.stopped - since:.1f} s when the run stopped"
                )
                violations.append(f"no outcome: plan {p} replica {r} step {s} ({key}): {state}")
                continue
            step_rows.append(row)
            outcomes[row["res"]] += 1
            elapsed = row["t1"] - row["t0"]
            max_elapsed = max(max_elapsed, elapsed)
            where = f"plan {p} replica {r} step {s} ({key})"
            if row["k"] != key:
                violations.append(f"key changed: {where} sent {row['k']}")
            if not row["typed"]:
                violations.append(f"untyped {row['res']}: {where}: {row['msg']}")
            if elapsed > prof.deadline + GRACE:
                violations.append(f"hang: {where} took {elapsed:.1f} s (deadline {prof.deadline})")
            if row["res"] in ("executed", "replayed") and row.get("exec") not in exec_ids:
                violations.append(
                    f"answer without execution: {where} got {row.get('exec')!r}, "
                    f"ledger has {sorted(exec_ids)}"
                )
            if row["res"] == "OutcomeUnknown" and key in doubted:
                unknown_causes["key in doubt (409 in_doubt)"] += 1
            elif row["res"] == "OutcomeUnknown":
                sent = [
                    req
                    for req in sent_by.get((f"{p}.{r}", key), [])
                    if row["t0"] - 0.1 <= req[0] <= row["t1"] + 0.1
                ]
                cause = _unknowable(sent, row["t1"], prof.read_timeout)
                unknown_causes[cause or "none"] += 1
                if cause is None:
                    violations.append(
                        f"OutcomeUnknown although every answer was definite: {where}: "
                        f"answers {[(kind, status) for _, _, kind, status in sent]}: {row['msg']}"
                    )
        got = {row["exec"] for row in step_rows if row["res"] in ("executed", "replayed")}
        if len(got) > 1 and not across_outage:
            violations.append(f"replicas got different answers for {key}: {sorted(got)}")
        if not executions:
            args = run.plans[p]["steps"][s][1]
            if args.get("reject"):
                zero["refused by the tool (by design)"] += 1
                # (a result here is already an "answer without execution" above)
            elif any(_overlaps(row["t0"], row["t1"], window) for row in step_rows):
                zero["every replica gave up, Redis outage overlapped"] += 1
            else:
                zero["every replica gave up after faults"] += 1
    requests = sum(kinds.values())
    faulted = requests - kinds["pass"]
    summary: dict[str, Any] = {
        "seed": run.seed,
        "profile": asdict(run.profile),
        "steps": len(run.keys),
        "calls": sum(run.replicas[p] for p, _ in run.keys),
        "replicas": dict(sorted(Counter(run.replicas.values()).items())),
        "requests": requests,
        "faulted": faulted,
        "fault_rate": round(faulted / requests, 4) if requests else 0.0,
        "faults_by_kind": {k: v for k, v in sorted(kinds.items()) if k != "pass"},
        "executions_histogram": {str(k): v for k, v in sorted(histogram.items())},
        "zero_executions": dict(zero),
        "duplicates_across_redis_outage": len(outage_duplicates),
        "keys_in_doubt": len(doubted),
        "in_doubt_answers": doubt_answers,
        "keys_in_doubt_list": sorted(doubted)[:50],
        "duplicate_keys_across_redis_outage": outage_duplicates[:50],
        "server_store_failures": store_failures,
        "outcomes": dict(sorted(outcomes.items())),
        "outcome_unknown_causes": dict(sorted(unknown_causes.items())),
        "max_call_seconds": round(max_elapsed, 2),
        "agent_kills": len(run.kills),
        "redis_outage_seconds": round(run.outage[1] - run.outage[0], 2) if run.outage else None,
        "redis_outage": run.outage,
        "kills": run.kills,
        "wall_seconds": round(run.wall, 1),
        "cpu_seconds": round(run.cpu, 1),
        "violations": run.crashed + run.hung + violations,
    }
    if summary["violations"]:
        summary["reproduce"] = (
            f"AGENTKEY_CHAOS_SEED={run.seed} AGENTKEY_CHAOS_STEPS={prof.steps} "
            ".venv/bin/pytest tests/chaos -p no:cacheprovider -s"
        )
    return summary


def _unknowable(
    sent: list[tuple[float, float, str, int]], ended: float, read_timeout: float
) -> str | None:
    """Why a client whose requests met ``sent`` could not know whether its step ran
    (None: every answer it got was definite, so ``OutcomeUnknown`` would be wrong)."""
    for received, over, kind, status in sent:
        if kind in AMBIGUOUS:
            return "proxy fault"
        if status == 0:
            return "no answer"
        if over - received >= read_timeout - 0.1 or over >= ended - 0.05:
            return "answer after the read timeout or the deadline"
        if status in (502, 503, 504):
            return f"tool server {status}"
    if not sent:
        return "no request reached the proxy (cut by the deadline)"
    return None


def format_summary(summary: dict[str, Any]) -> str:
    lines = ["chaos summary:"]
    names = (
        "seed", "steps", "calls", "replicas", "requests", "faulted", "fault_rate",
        "faults_by_kind", "executions_histogram", "zero_executions",
        "duplicates_across_redis_outage", "keys_in_doubt", "in_doubt_answers",
        "server_store_failures", "outcomes",
        "outcome_unknown_causes",
        "max_call_seconds", "agent_kills", "redis_outage_seconds", "wall_seconds", "cpu_seconds",
    )  # fmt: skip
    lines.extend(f"  {name}: {summary[name]}" for name in names)
    lines.append(f"  violations: {len(summary['violations'])}")
    lines.extend(f"    - {v}" for v in summary["violations"][:50])
    if "reproduce" in summary:
        lines.append(f"  reproduce: {summary['reproduce']}")
    return "\n".join(lines)
