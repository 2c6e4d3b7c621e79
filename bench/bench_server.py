"""Middleware cost: the tool behind IdempotencyMiddleware against the bare tool and a naive one.

Configurations, each a uvicorn process of its own (one worker, loopback; see
``bench/_apps.py``), all serving the same handler at ``POST /tools/charge``:

- ``bare``: the handler alone (the baseline for the middleware's cost);
- ``memory`` / ``redis``: behind the middleware on MemoryStore / RedisStore;
- ``naive``: the handler with the idempotency most articles show (``SET key "" NX EX``,
  run, ``SET key result``) on the same Redis, through the same client library;
- ``idemkit``: the handler behind idemkit's middleware on the same Redis (another
  library's answer; it must be installed: the interop dependency group pins it).

Each block (fresh keys or one key replayed; 1 or 64 connections) loads every
configuration in palindromic rounds (``bare memory redis naive naive redis memory
bare``: ABBA for each pair), for ``--seconds`` a slot, from a separate load process.
Per row: the median of the per-round throughput ratios (agentkey / baseline) with
IQR, the same for server CPU per request (``/proc/<pid>/stat``), absolute figures,
and how busy the server and the load generator were. The ``loadgen`` block runs the
bare endpoint with one and with two load processes: equal throughput shows one load
process is not the bottleneck. The ``gc`` block loads ``bare`` and ``redis`` again with
the garbage collector's first-generation threshold raised from 700 to
``GC_THRESHOLD`` in both server processes: at 64 connections every request in flight
holds its coroutines across the Redis round trip, so collections run far more often
than for the bare endpoint, which never waits (see docs/performance.md).

    python bench/bench_server.py            # about 4 minutes, writes bench/results/server.json
    python bench/bench_server.py --smoke    # a few seconds, for CI (writes nothing)
    python bench/bench_server.py --before /tmp/old --out /tmp/ab.json
        # also serves memory and redis from another checkout (an older commit) in the
        # same rounds: rows "this tree / --before", a before/after pair on one machine state
    python bench/bench_server.py --instructions [--mode replay] [--repeat 3]
        # instructions per request (cachegrind), in process, no uvicorn: each
        # configuration's app is called as ASGI, one request at a time (about 2 minutes)

The ``--instructions`` mode checks issue 39's middleware targets by a figure that does
not move with the machine's load: instructions per fresh (or replayed) request for
``bare``, ``naive``, ``memory`` and ``redis`` (a real redis-server on loopback; its own
instructions are not counted), their ratios to ``bare`` and ``naive``, the split by
difference (starlette + handler = bare; agentkey = memory - bare; RedisStore and
redis-py = redis - memory), the interpreter's top C functions per request, the
containers allocated per request (tracked objects not from a free list: what runs the
garbage collector, which at 64 connections walks every request in flight) and the
collections per 1,000 requests. Nothing is written unless ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench._harness, tests._loopback

from bench._harness import (
    Block,
    Instructions,
    Load,
    Server,
    Slot,
    instructions,
    load_line,
    loadgen_row,
    machine,
    measure,
    print_row,
    run_block,
    servers,
    write_results,
)
from tests._loopback import redis_server

GC_THRESHOLD = 10_000

ROWS = [
    ("middleware + MemoryStore / bare endpoint", "memory", "bare"),
    ("middleware + RedisStore / bare endpoint", "redis", "bare"),
    ("middleware + RedisStore / naive handler, same Redis", "redis", "naive"),
    ("middleware + RedisStore / idemkit 1.0.2, same Redis", "redis", "idemkit"),
]


INSTRUCTION_CONFIGS = ("bare", "naive", "memory", "redis")


def asgi_requests(arg: str) -> Callable[[int], None]:
    """The ``--instructions`` target: ``arg`` is ``config:mode``; returns ``run(n)``, which
    sends ``n`` requests (fresh keys, or one key replayed) to that configuration's app,
    called in process as ASGI (one at a time, one event loop). Every answer must be a 201,
    replayed or not as the mode says."""
    import asyncio
    import uuid

    from bench._apps import app
    from bench._harness import BODY

    config, _, mode = arg.partition(":")
    os.environ["BENCH_APP"] = config
    asgi = app()
    loop = asyncio.new_event_loop()
    plan = uuid.uuid4().hex[:20]
    suffix = ":" + hashlib.sha256(BODY).hexdigest()
    counter = [0]
    answers: list[tuple[int, bool]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": BODY, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            replayed = any(k == b"idempotent-replayed" for k, _ in message["headers"])
            answers.append((message["status"], replayed))

    async def one(key: str) -> None:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/tools/charge",
            "raw_path": b"/tools/charge",
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"host", b"127.0.0.1"),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(BODY)).encode()),
                (b"idempotency-key", key.encode()),
            ],
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8000),
            "state": {},
        }
        await asgi(scope, receive, send)

    async def requests(n: int) -> None:
        for _ in range(n):
            counter[0] += 1
            step = 0 if mode == "replay" else counter[0]
            await one(f"{plan}:step_{step:03d}{suffix}")

    def run(n: int, *, replays: bool = config != "bare" and mode == "replay") -> None:
        answers.clear()
        loop.run_until_complete(requests(n))
        wrong = [a for a in answers if a[0] != 201 or bool(a[1]) != replays]
        if len(answers) != n or wrong:
            raise RuntimeError(f"{arg}: {len(answers)} answers for {n}, unexpected {wrong[:3]}")

    run(1, replays=False)  # a replayed key is run once here, before anything is counted
    return run


def instruction_rows(mode: str, iterations: int, repeat: int, out: Path | None) -> None:
    """Instructions per request of each configuration (see the module's docstring).

    With ``repeat``, each configuration is measured that many times and the run with the
    median total is kept: on Redis an answer that has not arrived yet when the request
    reads it costs the event loop another turn, so those counts move by a few percent
    with the machine's load (the in-process configurations do not)."""
    at_start = machine()
    env: dict[str, str] = {}
    counts: dict[str, Instructions] = {}
    with ExitStack() as stack:
        configs: list[str] = ["bare", "memory"]
        if shutil.which("redis-server"):
            env["BENCH_REDIS"] = stack.enter_context(redis_server()).url
            configs += ["naive", "redis"]
        else:
            print("redis-server is not on PATH: the Redis configurations are skipped")
        for config in configs:
            runs = sorted(
                (
                    instructions(
                        "bench.bench_server:asgi_requests",
                        iterations,
                        arg=f"{config}:{mode}",
                        env=env,
                    )
                    for _ in range(repeat)
                ),
                key=lambda got: got.total,
            )
            counts[config] = runs[len(runs) // 2]
            if repeat > 1:
                spread = ", ".join(f"{got.total / 1000:.1f}k" for got in runs)
                print(f"  {config}: {spread}")
    print(f"bench_server --instructions: {mode} requests, in process, {iterations} per run")
    for config, got in counts.items():
        print(
            f"  {config:<7} {got.total / 1000:8.1f}k instructions/request  "
            f"{got.containers:6.0f} containers allocated/request  "
            f"{got.gc_collections * 1000:5.1f} GC collections per 1,000 requests"
        )
    bare = counts["bare"].total
    print("  split by difference (instructions per request):")
    print(f"    starlette + handler (bare)          {bare / 1000:8.1f}k")
    print(f"    agentkey middleware (memory - bare) {(counts['memory'].total - bare) / 1000:8.1f}k")
    if "redis" in counts:
        store = counts["redis"].total - counts["memory"].total
        naive = counts["naive"].total - bare
        print(f"    RedisStore + redis-py (redis - memory) {store / 1000:5.1f}k")
        print(f"    naive idempotency (naive - bare)    {naive / 1000:8.1f}k")
    rows = [("memory", "bare"), ("redis", "bare"), ("redis", "naive")]
    for ours, base in rows:
        if ours in counts and base in counts:
            ratio = counts[ours].total / counts[base].total
            print(f"  {ours} / {base}: {ratio:.3f}x by instructions")
    for config, got in counts.items():
        top = list(got.by_function.items())[:8]
        print(f"  {config} top functions: " + ", ".join(f"{n} {v / 1000:.1f}k" for n, v in top))
    print(load_line(at_start))
    if out is not None:
        payload = {
            "method": "instructions per request (cachegrind Ir), in process as ASGI, "
            "difference of two runs",
            "mode": mode,
            "iterations": iterations,
            "repeat": repeat,
            "configs": {
                c: {
                    "instructions": round(g.total),
                    "gc_per_1000": round(g.gc_collections * 1000, 1),
                    "containers": round(g.containers, 1),
                    "top": {n: round(v) for n, v in list(g.by_function.items())[:20]},
                }
                for c, g in counts.items()
            },
        }
        print(f"wrote {write_results('server-instructions', payload, out, at_start)}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="a few seconds, for CI")
    parser.add_argument("--rounds", type=int, default=10, help="ABBA rounds per block")
    parser.add_argument("--seconds", type=float, default=0.5, help="length of one slot")
    parser.add_argument("--out", type=Path, help="where to write the JSON results")
    parser.add_argument(
        "--before",
        type=Path,
        help="another checkout whose memory and redis configurations run in the same rounds",
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="instructions per request by cachegrind, in process (no uvicorn, no timing)",
    )
    parser.add_argument(
        "--mode", choices=("fresh", "replay"), default="fresh", help="with --instructions"
    )
    parser.add_argument(
        "--iterations", type=int, default=300, help="requests per run, with --instructions"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="with --instructions: runs per configuration "
        "(the median is kept; Redis counts move a few percent with the load)",
    )
    ns = parser.parse_args()
    if ns.instructions:
        instruction_rows(ns.mode, ns.iterations, ns.repeat, ns.out)
        return
    at_start = machine()
    rounds, seconds = (1, 0.1) if ns.smoke else (ns.rounds, ns.seconds)

    with ExitStack() as stack:
        env: dict[str, str] = {}
        configs = ["bare", "memory"]
        redis_pid: int | None = None
        if shutil.which("redis-server"):
            redis = stack.enter_context(redis_server())
            env["BENCH_REDIS"] = redis.url
            redis_pid = redis.process.pid
            configs += ["redis", "naive"]
            if importlib.util.find_spec("idemkit") is not None:
                configs.append("idemkit")
            else:
                print("idemkit is not installed (pip install --group interop): its row is skipped")
        else:
            print("redis-server is not on PATH: the Redis rows are skipped")
        running = stack.enter_context(servers(configs, env))
        rows_of = list(ROWS)
        if ns.before is not None:
            for name in [c for c in ("memory", "redis") if c in configs]:
                old = Server(name, env, root=ns.before.resolve())
                old.start()
                stack.callback(old.stop)
                old.wait_ready()
                running[f"{name}@before"] = old
                configs.append(f"{name}@before")
                rows_of.append((f"{name}: this tree / --before tree", name, f"{name}@before"))
        load = Load(processes=2)
        stack.callback(load.close)

        print(
            f"bench_server: {rounds} rounds x {len(configs) * 2} slots of {seconds} s per block; "
            "ratio = agentkey / baseline, median (IQR); load average "
            + " ".join(f"{x:.2f}" for x in os.getloadavg())
        )
        rows: list[dict[str, Any]] = []
        for mode in ("fresh", "replay"):
            for connections in (1, 64):

                def slot(name: str, mode: str = mode, connections: int = connections) -> Slot:
                    watch = (
                        redis_pid if name in ("redis", "naive", "idemkit", "redis@before") else None
                    )
                    return measure(load, running[name], mode, connections, seconds, watch=watch)

                block = run_block(Block(mode, connections), rounds, slot, configs)
                for what, ours, base in rows_of:
                    if ours in configs and base in configs:
                        rows.append(block.row(what, ours, base))
                        print_row(rows[-1])

        rows.append(loadgen_row(load, running["bare"], rounds, seconds))
        print_row(rows[-1])

        if redis_pid is not None:
            gc_env = {**env, "BENCH_GC_THRESHOLD": str(GC_THRESHOLD)}
            tuned = stack.enter_context(servers(["bare", "redis"], gc_env))

            def gc_slot(name: str) -> Slot:
                watch = redis_pid if name == "redis" else None
                return measure(load, tuned[name], "fresh", 64, seconds, watch=watch)

            block = run_block(Block("fresh", 64), rounds, gc_slot, ["bare", "redis"])
            what = f"gc threshold {GC_THRESHOLD:,} on both: middleware + RedisStore / bare"
            rows.append(block.row(what, "redis", "bare"))
            print_row(rows[-1])

    print("load average at the end: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    if not ns.smoke or ns.out:
        path = write_results(
            "server",
            {
                "method": "each configuration in its own uvicorn process (1 worker, loopback); "
                "palindromic (ABBA) rounds; ratio per round = agentkey/baseline; "
                "CPU from /proc/<pid>/stat; load from separate asyncio processes",
                "slot_seconds": seconds,
                "rows": rows,
            },
            ns.out,
            at_start,
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
