"""A duplicate in flight: how long after the first call ends does the duplicate get the replay?

An agent can send a step again while its first call still runs: a second worker picked
it up, an orchestrator restarted, a read timed out while the tool kept going. The
server answers "in flight" (409 or 423, with ``Retry-After``) until the first call ends;
agentkey's invoker asks again on a short schedule (the server's ``Retry-After``, at most
2 s), bounded by the caller's deadline and not by ``max_attempts``, and returns the
replay. The figure here is the **delay from the end of the first call** (its invoker
returning) **to the duplicate's replay**, per server and step duration.

Servers, each a uvicorn process of its own (one worker, loopback), on one redis-server,
in front of the same tool (it sleeps ``seconds`` from its arguments, counts executions
per key, and ``GET /executions`` shows the counts):

- ``agentkey``: IdempotencyMiddleware on RedisStore; 409 with ``Retry-After: 1``;
- ``agentkey_hold``: the same with ``hold_in_flight=10``: it holds a duplicate up to
  10 s and replays the first call's answer when it ends, then answers 409;
- ``idemkit``: idemkit 1.0.2 (the interop suite's pin) told not to hold duplicates
  (``wait_timeout_seconds=0``): 423 with ``Retry-After: 30`` (its lease) at once;
- ``idemkit_hold``: idemkit with its default: it holds a duplicate up to 10 s and
  replays the first call's answer when it ends, then answers 423 like ``idemkit``.

Each round visits the servers in palindromic order (ABBA), each with every step duration.
A trial starts the first call, then ``--duplicates`` duplicates at random moments while
it runs (seeded), all through one ``ToolInvoker`` with ``RetryPolicy(deadline=30)`` and
the defaults otherwise (``max_attempts=8``). Every trial is checked: one call executed,
the others replayed, one execution on the server. Per case: the median delay, its
interquartile range, min and max, N, and the bound the issue sets: one in-flight wait
(``min(Retry-After, 2 s)``).

    python bench/bench_inflight.py            # about 8 minutes, writes bench/results/inflight.json
    python bench/bench_inflight.py --smoke    # a few seconds, for CI (writes nothing)
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import importlib.util
import os
import random
import shutil
import sys
import time
import uuid
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench._harness, tests._loopback

from agentkey import PlanSession, RetryPolicy, Step, ToolInvoker
from agentkey.client._flow import IN_FLIGHT_CAP
from agentkey.server import ServerOptions
from bench._harness import machine, servers, spread, write_results

APP = "bench.bench_inflight:app"
#: What each server sends in Retry-After while the first call runs.
RETRY_AFTER = {"agentkey": 1.0, "agentkey_hold": 1.0, "idemkit": 30.0, "idemkit_hold": 30.0}
#: How long the servers that hold a duplicate hold it (idemkit's default).
HOLD = 10.0
DEADLINE = 30.0
#: Scheduling and loopback round trips on a loaded 2-core machine: not a backoff interval.
SLACK = 0.25


# --------------------------------------------------------------------------- the server


def app() -> Any:
    """The tool behind the idempotency layer named by ``BENCH_APP`` (uvicorn ``--factory``)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    config = os.environ["BENCH_APP"]
    redis_url = os.environ["BENCH_REDIS"]
    counts: dict[str, int] = {}

    async def work(request: Request) -> Response:
        args = await request.json()
        key = request.headers.get("idempotency-key", "")
        counts[key] = counts.get(key, 0) + 1
        await asyncio.sleep(float(args["seconds"]))
        return JSONResponse({"ended_at": time.monotonic()}, status_code=201)

    async def executions(request: Request) -> Response:
        return JSONResponse(counts)

    routes = [Route("/tools/work", work, methods=["POST"]), Route("/executions", executions)]
    tool: Any = Starlette(routes=routes)
    namespace = f"inflight-{uuid.uuid4().hex[:12]}"
    hold = HOLD if config.endswith("_hold") else 0.0
    if config in ("agentkey", "agentkey_hold"):
        from agentkey.server import IdempotencyMiddleware, RedisStore

        store = RedisStore(redis_url, prefix=namespace)
        return IdempotencyMiddleware(
            tool, store=store, shared_key_space=True, options=ServerOptions(hold_in_flight=hold)
        )
    if config in ("idemkit", "idemkit_hold"):
        import idemkit

        backend = idemkit.RedisBackend.from_url(redis_url, namespace=namespace)
        options = idemkit.HttpConfig(scope_mode="single_tenant", wait_timeout_seconds=hold)
        return idemkit.IdempotencyMiddleware(tool, backend=backend, config=options)
    raise SystemExit(f"BENCH_APP must be one of {', '.join(RETRY_AFTER)}, got {config!r}")


# --------------------------------------------------------------------------- the client


@dataclass(frozen=True)
class Done:
    """One call of a trial: when its invoker returned, and what it said."""

    at: float
    replayed: bool
    attempts: int
    ended_at: float  # when the tool's one execution ended (from the body)


def call(invoker: ToolInvoker, step: Step, start: float) -> Done:
    """Invoke ``step`` at monotonic time ``start``."""
    time.sleep(max(0.0, start - time.monotonic()))
    result = invoker.invoke(step)
    return Done(time.monotonic(), result.replayed, result.attempts, result.body["ended_at"])


def trial(
    invoker: ToolInvoker, url: str, seconds: float, duplicates: int, rng: random.Random
) -> list[Done]:
    """The first call of a step lasting ``seconds``, and ``duplicates`` sent while it runs."""
    step = PlanSession.new().step(0, "work", {"seconds": seconds})
    now = time.monotonic()
    starts = [now] + [now + rng.uniform(0.05, 0.6 * seconds) for _ in range(duplicates)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(starts)) as pool:
        done = list(pool.map(lambda start: call(invoker, step, start), starts))
    ran = [d for d in done if not d.replayed]
    if len(ran) != 1:
        raise RuntimeError(f"{url}: {len(ran)} of {len(done)} calls said they executed")
    if len({d.ended_at for d in done}) != 1:
        raise RuntimeError(f"{url}: the duplicates' answers are not the first call's")
    counts = httpx.get(f"{url}/executions").json()
    if counts.get(step.idempotency_key) != 1:
        raise RuntimeError(f"{url}: the step ran {counts.get(step.idempotency_key)} times")
    return done


@dataclass
class Case:
    """Every duplicate of one (server, step duration): delays, questions asked."""

    server: str
    seconds: float
    delays: list[float]
    questions: list[int]
    first: list[float]  # the first call's own answer: from the tool's end to its return

    def row(self) -> dict[str, Any]:
        bound = min(RETRY_AFTER[self.server], IN_FLIGHT_CAP)
        return {
            "server": self.server,
            "step_seconds": self.seconds,
            "N": len(self.delays),
            "delay_seconds": spread(self.delays),
            "bound_seconds": bound,
            "over_bound": sum(d > bound + SLACK for d in self.delays),
            "questions": spread(self.questions),
            "first_answer_seconds": spread(self.first),
        }


def print_row(row: dict[str, Any]) -> None:
    d = row["delay_seconds"]
    verdict = "within" if row["over_bound"] == 0 else f"{row['over_bound']} OVER"
    print(
        f"  {row['server']:<13} step {row['step_seconds']:>4g} s  delay median {d['median']:.3f} s"
        f" (IQR {d['iqr'][0]:.3f}-{d['iqr'][1]:.3f}, min {d['min']:.3f}, max {d['max']:.3f})"
        f"  bound {row['bound_seconds']:g} s: {verdict}  questions {row['questions']['median']:g}"
        f" (max {row['questions']['max']:g})  N={row['N']}"
    )


def run(
    urls: dict[str, str], durations: Sequence[float], rounds: int, duplicates: int, seed: int
) -> list[Case]:
    rng = random.Random(seed)
    retry = RetryPolicy(deadline=DEADLINE)
    cases = {(s, d): Case(s, d, [], [], []) for s in urls for d in durations}
    with ExitStack() as stack:
        # One invoker per server, as an agent has; honours_keys: the user knows these do.
        options: dict[str, Any] = {"retry": retry, "hooks": (), "honours_keys": True}
        invokers = {
            name: stack.enter_context(ToolInvoker(url, routes={"work": "/tools/work"}, **options))
            for name, url in urls.items()
        }
        for number in range(rounds):  # A B C, then C B A: ABBA over two rounds
            for name in list(urls) if number % 2 == 0 else list(reversed(urls)):
                for seconds in durations:
                    done = trial(invokers[name], urls[name], seconds, duplicates, rng)
                    (first,) = (d for d in done if not d.replayed)
                    case = cases[name, seconds]
                    case.first.append(first.at - first.ended_at)
                    for dup in done:
                        if dup.replayed:
                            case.delays.append(dup.at - first.at)
                            case.questions.append(dup.attempts)
    return list(cases.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few seconds, for CI")
    parser.add_argument("--rounds", type=int, default=6, help="rounds over every case (even: ABBA)")
    parser.add_argument("--duplicates", type=int, default=3, help="duplicates per trial")
    parser.add_argument(
        "--durations", type=float, nargs="+", default=[0.5, 3.0, 10.0], help="step seconds"
    )
    parser.add_argument("--seed", type=int, default=26, help="seeds the duplicates' moments")
    parser.add_argument("--out", type=Path, help="where to write the JSON results")
    ns = parser.parse_args()
    at_start = machine()
    rounds, duplicates, durations = (
        (1, 1, [0.5]) if ns.smoke else (ns.rounds, ns.duplicates, ns.durations)
    )
    if shutil.which("redis-server") is None:
        print("redis-server is not on PATH: bench_inflight needs it, and is skipped")
        return
    from tests._loopback import redis_server

    configs = ["agentkey", "agentkey_hold"]
    if importlib.util.find_spec("idemkit") is not None:
        configs += ["idemkit", "idemkit_hold"]
    else:
        print("idemkit is not installed (pip install --group interop): its rows are skipped")
    with redis_server() as redis:
        env = {"BENCH_REDIS": redis.url}
        with servers(configs, env, app=APP) as running:
            urls = {name: f"http://127.0.0.1:{s.port}" for name, s in running.items()}
            print(
                f"bench_inflight: {rounds} round(s) x {duplicates} duplicate(s) per trial, "
                f"steps of {', '.join(f'{d:g}' for d in durations)} s; delay = duplicate's "
                "replay - first call's end"
            )
            cases = run(urls, durations, rounds, duplicates, ns.seed)
    rows = [case.row() for case in cases]
    for row in rows:
        print_row(row)
    if not ns.smoke or ns.out:
        path = write_results(
            "inflight",
            {
                "method": "each server in its own uvicorn process (1 worker, loopback) on one "
                "redis-server; one ToolInvoker per server, RetryPolicy(deadline=30); the first "
                "call, then duplicates at seeded random moments while it runs; delay = the "
                "duplicate's invoker returning - the first call's invoker returning",
                "rounds": rounds,
                "duplicates_per_trial": duplicates,
                "seed": ns.seed,
                "rows": rows,
            },
            ns.out,
            at_start,
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
