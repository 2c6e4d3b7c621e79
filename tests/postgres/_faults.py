"""PostgreSQL faults under racing load: what issue 30 measures, as one reusable run.

A uvicorn server (two workers, ``tests/postgres/_fault_app.py``) serves a plain tool (its
ledger is a file, outside the database) and a transactional tool (its ``fault_charges`` row
commits with the record). Agents run steps in lanes, two racers per step sending the same
key, each resending on 409, 503, any other error and transport failures until it gets a
2xx. Meanwhile PostgreSQL is hit, in turn, by ``pg_ctl restart -m fast``, ``restart -m
immediate``, ``pg_terminate_backend`` on every client connection, a ``LOCK TABLE`` on the
records table and a SIGSTOP of the postmaster.

For each fault the run notes when it began and when the database answered again (a fresh
connection's query on the records table succeeded, or the lock was released, or the
postmaster was continued). The report counts duplicates, orphans, steps never run or
answered differently, 5xx other than 503, server tracebacks, the 503s after the database
answered again, steps stalled after it, and the longest request while a lock was held.

    python -m tests.postgres._faults --reps 2                 # this checkout's agentkey
    python -m tests.postgres._faults --agentkey /tmp/before   # another agentkey, same harness
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg

from agentkey import PlanSession
from tests._loopback import free_port
from tests._postgres import PostgresCluster, postgres_cluster

__all__ = ["FAULTS", "Report", "run"]

FAULTS = ("restart_fast", "restart_immediate", "terminate", "lock", "sigstop")
TABLE = "fault_records"
LANES = 16  # two racers each: up to 32 requests in flight
LOCK_SECONDS = 6.0
STOP_SECONDS = 3.0
GAP_SECONDS = 2.0  # load between two faults
CLIENT_TIMEOUT = 10.0
STEP_DEADLINE = 40.0  # a step not answered by then counts as a hang
RECOVERY = 1.0  # no 503 later than this after the database answers again
STALL = 3.0  # a step still unanswered this long after the database answered is stalled
_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Attempt:
    """One request of one racer: when it left and came back, and what it got."""

    step: int
    sent: float
    received: float
    outcome: int | str  # the status, or the transport error's class name


@dataclass
class Step:
    """One step of one lane, raced by two agents."""

    key: str
    tool: str
    started: float
    ended: float = 0.0
    answers: list[Any] = field(default_factory=list)  # each racer's final JSON, or None


@dataclass
class Fault:
    kind: str
    start: float
    back: float = 0.0


@dataclass
class Report:
    """What the run measured (times are seconds relative to each fault's recovery)."""

    steps: int
    attempts: int
    statuses: dict[str, int]
    duplicates: int
    orphans: int
    never_run: int
    answered_differently: int
    hangs: int
    tracebacks: int
    faults: list[dict[str, Any]]
    stalled: int
    longest_stall: float

    @property
    def late_503s(self) -> int:
        return sum(f["late_503s"] for f in self.faults)

    @property
    def server_errors(self) -> int:
        return sum(n for s, n in self.statuses.items() if s.isdigit() and 500 <= int(s) != 503)

    def as_json(self) -> str:
        return json.dumps(self.__dict__, indent=1, sort_keys=True)


def _retry_after(response: httpx.Response) -> float:
    try:
        return float(response.headers.get("retry-after", "0.2"))
    except ValueError:
        return 0.2


async def _racer(
    client: httpx.AsyncClient, step: int, path: str, key: str, body: bytes, log: list[Attempt]
) -> Any:
    headers = {"idempotency-key": key, "content-type": "application/json"}
    deadline = time.monotonic() + STEP_DEADLINE
    while True:
        sent = time.monotonic()
        response: httpx.Response | None = None
        try:
            response = await client.post(path, headers=headers, content=body)
            outcome: int | str = response.status_code
        except httpx.HTTPError as exc:
            outcome = type(exc).__name__
        log.append(Attempt(step, sent, time.monotonic(), outcome))
        if response is not None and 200 <= response.status_code < 300:
            return response.json()
        if time.monotonic() > deadline:
            return None
        # As the invoker does: Retry-After (capped at 1 s here), else a short backoff.
        wait = min(_retry_after(response), 1.0) if response is not None else 0.2
        await asyncio.sleep(wait * random.uniform(0.5, 1.0))


async def _lane(
    client: httpx.AsyncClient, stop: asyncio.Event, steps: list[Step], log: list[Attempt]
) -> None:
    plan = PlanSession.new()
    i = 0
    while not stop.is_set():
        tool = "plain" if i % 2 == 0 else "charge"
        call = plan.step(i, tool, {"amount": i})
        step = Step(call.idempotency_key, tool, time.monotonic())
        index = len(steps)
        steps.append(step)
        step.answers = list(
            await asyncio.gather(
                *(
                    _racer(client, index, f"/tools/{tool}", call.idempotency_key, call.body, log)
                    for _ in range(2)
                )
            )
        )
        step.ended = time.monotonic()
        i += 1


def _probe(dsn: str) -> float:
    """Wait until a fresh connection runs a query on the records table; return that time."""
    while True:
        try:
            with psycopg.connect(dsn, connect_timeout=1, autocommit=True) as conn:
                conn.execute(f"SELECT 1 FROM {TABLE} LIMIT 1")  # noqa: S608 - a constant
                return time.monotonic()
        except psycopg.Error:  # noqa: PERF203 - a probe: it fails until the database is back
            time.sleep(0.02)


def _inflict(cluster: PostgresCluster, kind: str) -> Fault:
    dsn = cluster.server.dsn
    fault = Fault(kind, time.monotonic())
    if kind in ("restart_fast", "restart_immediate"):
        cluster.restart(kind.split("_")[1])
        fault.back = _probe(dsn)
    elif kind == "terminate":
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
            )
        fault.back = time.monotonic()
    elif kind == "lock":
        with psycopg.connect(dsn) as conn:
            conn.execute(f"LOCK TABLE {TABLE} IN ACCESS EXCLUSIVE MODE")
            fault.start = time.monotonic()
            time.sleep(LOCK_SECONDS)
            conn.commit()
        fault.back = time.monotonic()
    elif kind == "sigstop":
        pid = cluster.postmaster_pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(STOP_SECONDS)
        finally:
            os.kill(pid, signal.SIGCONT)
        fault.back = time.monotonic()
    else:  # pragma: no cover - a typo in a caller
        raise ValueError(kind)
    return fault


def _serve(dsn: str, ledger: str, stderr: Any, agentkey: str | None) -> tuple[Any, str]:
    port = free_port()
    path = [str(_ROOT)] if agentkey is None else [agentkey, str(_ROOT)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(path),
        "AGENTKEY_FAULT_DSN": dsn,
        "AGENTKEY_FAULT_TABLE": TABLE,
        "AGENTKEY_FAULT_LEDGER": ledger,
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", "tests.postgres._fault_app:app",
         "--host", "127.0.0.1", "--port", str(port), "--workers", "2",
         "--log-level", "warning", "--no-access-log",
         # Idle keep-alive connections stay open for the whole run: at uvicorn's default
         # (5 s) a lane idle through a fault can send its POST on a connection the server is
         # closing, and httpx reports a ReadError that is the harness's race, not a fault's.
         "--timeout-keep-alive", "120"],
        # The working directory comes first on uvicorn's sys.path: it is the agentkey served.
        cwd=agentkey or _ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(url + "/", timeout=1)
            return process, url
        except httpx.HTTPError:  # noqa: PERF203 - polled until uvicorn listens
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise RuntimeError("the fault suite's uvicorn did not start") from None
            time.sleep(0.1)


async def _load_and_faults(
    cluster: PostgresCluster, url: str, kinds: list[str]
) -> tuple[list[Step], list[Attempt], list[Fault]]:
    steps: list[Step] = []
    log: list[Attempt] = []
    faults: list[Fault] = []
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=2 * LANES + 2, max_keepalive_connections=2 * LANES)
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT, limits=limits) as client:
        lanes = [asyncio.create_task(_lane(client, stop, steps, log)) for _ in range(LANES)]
        try:
            for kind in kinds:
                await asyncio.sleep(GAP_SECONDS)
                faults.append(await asyncio.to_thread(_inflict, cluster, kind))
            await asyncio.sleep(GAP_SECONDS)
        finally:
            stop.set()
            await asyncio.wait(lanes, timeout=STEP_DEADLINE + CLIENT_TIMEOUT)
    return steps, log, faults


def _analyse(
    steps: list[Step], log: list[Attempt], faults: list[Fault], ledger: str, dsn: str, stderr: str
) -> Report:
    runs: dict[str, list[str]] = collections.defaultdict(list)
    if os.path.exists(ledger):
        for line in Path(ledger).read_text().splitlines():
            key, run_id = line.split()
            runs[key].append(run_id)
    with psycopg.connect(dsn, autocommit=True) as conn:
        charges: dict[str, list[int]] = collections.defaultdict(list)
        for key, charge_id in conn.execute("SELECT step, id FROM fault_charges").fetchall():
            charges[key].append(charge_id)
        records = {
            k.split(":", 1)[1]: bytes(v)
            for k, v in conn.execute(f"SELECT key, value FROM {TABLE}").fetchall()  # noqa: S608
        }
    done = [s for s in steps if s.ended]
    duplicates = sum(len(v) > 1 for v in runs.values()) + sum(len(v) > 1 for v in charges.values())
    charge_keys = {s.key for s in done if s.tool == "charge"}
    completed = {k for k, v in records.items() if v.startswith(b"C:")}
    orphans = len(set(charges) - completed) + len((charge_keys & completed) - set(charges))
    never_run = differently = hangs = 0
    for s in done:
        if any(a is None for a in s.answers):
            hangs += 1
            continue
        if s.answers[0] != s.answers[1]:
            differently += 1
        named = s.answers[0].get("run") if s.tool == "plain" else s.answers[0].get("charge_id")
        executed = runs.get(s.key, []) if s.tool == "plain" else charges.get(s.key, [])
        if named not in executed:
            never_run += 1

    statuses = collections.Counter(str(a.outcome) for a in log)
    fault_rows = []
    for i, fault in enumerate(faults):
        until = faults[i + 1].start if i + 1 < len(faults) else float("inf")
        unavailable = [a for a in log if a.outcome == 503 and fault.start <= a.received < until]
        during = [a for a in log if a.sent < fault.back and a.received > fault.start]
        fault_rows.append(
            {
                "kind": fault.kind,
                "outage_s": round(fault.back - fault.start, 3),
                "503s": len(unavailable),
                "last_503_after_back_s": round(
                    max((a.received - fault.back for a in unavailable), default=0.0), 3
                ),
                "late_503s": sum(a.received > fault.back + RECOVERY for a in unavailable),
                "longest_request_s": round(
                    max((a.received - a.sent for a in during), default=0.0), 3
                ),
            }
        )
    stalls = []
    for s in done:
        recovered = max(
            [s.started] + [f.back for f in faults if f.start < s.ended and f.back > s.started]
        )
        stalls.append(s.ended - recovered)
    return Report(
        steps=len(done),
        attempts=len(log),
        statuses=dict(sorted(statuses.items())),
        duplicates=duplicates,
        orphans=orphans,
        never_run=never_run,
        answered_differently=differently,
        hangs=hangs + (len(steps) - len(done)),
        tracebacks=stderr.count("Exception in ASGI application") + stderr.count("Traceback"),
        faults=fault_rows,
        stalled=sum(x > STALL for x in stalls),
        longest_stall=round(max(stalls, default=0.0), 3),
    )


def run(
    cluster: PostgresCluster, *, reps: int = 1, agentkey: str | None = None, seed: int = 30
) -> Report:
    """Run every fault ``reps`` times under load; ``agentkey`` serves another checkout's code."""
    random.seed(seed)
    dsn = cluster.server.dsn
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS fault_charges")
        conn.execute(f"DROP TABLE IF EXISTS {TABLE}")
        conn.execute("CREATE TABLE fault_charges (id serial PRIMARY KEY, step text, amount int)")
    kinds = [kind for _ in range(reps) for kind in FAULTS]
    with tempfile.TemporaryDirectory(prefix="agentkey-faults-") as work:
        ledger = os.path.join(work, "ledger")
        errors = os.path.join(work, "server.err")
        with open(errors, "wb") as stderr:
            process, url = _serve(dsn, ledger, stderr, agentkey)
            try:
                warm = PlanSession.new().step(0, "plain", {"amount": 0})  # creates the table
                headers = {"idempotency-key": warm.idempotency_key}
                httpx.post(url + "/tools/plain", headers=headers, content=warm.body, timeout=10)
                steps, log, faults = asyncio.run(_load_and_faults(cluster, url, kinds))
            finally:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        return _analyse(steps, log, faults, ledger, dsn, Path(errors).read_text(errors="replace"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=1, help="times each fault is inflicted")
    parser.add_argument("--agentkey", help="a directory holding another agentkey package")
    ns = parser.parse_args()
    with postgres_cluster(durable=True) as cluster:
        report = run(cluster, reps=ns.reps, agentkey=ns.agentkey)
    print(report.as_json())
    print(f"late 503s {report.late_503s}, 5xx other than 503 {report.server_errors}")


if __name__ == "__main__":
    main()
