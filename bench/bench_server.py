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
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench._harness, tests._loopback

from bench._harness import (
    Block,
    Load,
    Server,
    Slot,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few seconds, for CI")
    parser.add_argument("--rounds", type=int, default=10, help="ABBA rounds per block")
    parser.add_argument("--seconds", type=float, default=0.5, help="length of one slot")
    parser.add_argument("--out", type=Path, help="where to write the JSON results")
    parser.add_argument(
        "--before",
        type=Path,
        help="another checkout whose memory and redis configurations run in the same rounds",
    )
    ns = parser.parse_args()
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
