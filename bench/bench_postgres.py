"""PostgresStore cost: the tool bare, on Redis, on PostgreSQL, and an INSERT in one transaction.

Configurations, each a uvicorn process of its own (one worker, loopback; see ``bench/_apps.py``):

- ``bare``, ``redis``, ``postgres``: the charge tool alone, and behind the middleware on
  RedisStore and PostgresStore;
- ``bare_insert`` / ``postgres_insert``: a tool whose side effect is one INSERT, autocommit,
  and behind the middleware on PostgresStore with the INSERT and the record in one
  transaction.

PostgreSQL runs with fsync on (commits are paid for). Blocks (fresh keys, and one key
replayed, each at 1 and 64 connections) load every configuration in palindromic (ABBA)
rounds from a separate load process; see ``bench/_harness.py`` for the method. The
``loadgen`` row loads the bare endpoint from one and from two load processes: the same
throughput shows one was not the bottleneck.
Server CPU per request is the uvicorn process's own (PostgreSQL's backends are not
counted).

    python bench/bench_postgres.py          # about 3.5 minutes, writes bench/results/postgres.json
    python bench/bench_postgres.py --smoke  # a few seconds, for CI (writes nothing)
    python bench/bench_postgres.py --against 094632a  # adds PostgresStore at that commit
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench._harness, tests._*

from bench._harness import (
    ROOT,
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
from tests._postgres import postgres_server

ROWS = [
    ("middleware + PostgresStore / bare endpoint", "postgres", "bare"),
    ("middleware + PostgresStore / RedisStore", "postgres", "redis"),
    ("PostgresStore, INSERT + record in one tx / bare INSERT", "postgres_insert", "bare_insert"),
]
BLOCKS = [("fresh", 1), ("fresh", 64), ("replay", 1), ("replay", 64)]


@contextmanager
def tree_at(rev: str) -> Iterator[Path]:
    """The project's files at git revision ``rev``, in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="agentkey-bench-") as tmp:
        tar = Path(tmp) / "tree.tar"
        git = ["git", "archive", "--format=tar", f"--output={tar}", rev]
        subprocess.run(git, cwd=ROOT, check=True)  # noqa: S603
        subprocess.run(["tar", "-xf", str(tar), "-C", tmp], check=True)  # noqa: S603, S607
        yield Path(tmp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few seconds, for CI")
    parser.add_argument("--rounds", type=int, default=10, help="ABBA rounds per block")
    parser.add_argument("--seconds", type=float, default=0.4, help="length of one slot")
    parser.add_argument("--out", type=Path, help="where to write the JSON results")
    parser.add_argument(
        "--against",
        metavar="REV",
        help="also run PostgresStore from git revision REV, interleaved: a before/after row",
    )
    ns = parser.parse_args()
    at_start = machine()
    rounds, seconds = (1, 0.1) if ns.smoke else (ns.rounds, ns.seconds)

    with ExitStack() as stack:
        pg = stack.enter_context(postgres_server(durable=True))
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE bench_charges (id serial PRIMARY KEY, amount int)")
        env = {"BENCH_PG_DSN": pg.dsn}
        configs = ["bare", "postgres", "bare_insert", "postgres_insert"]
        if shutil.which("redis-server"):
            env["BENCH_REDIS"] = stack.enter_context(redis_server()).url
            configs.insert(1, "redis")
        running = stack.enter_context(servers(configs, env))
        rows_for = list(ROWS)
        if ns.against:
            before = Server("postgres", env, root=stack.enter_context(tree_at(ns.against)))
            stack.callback(before.stop)
            before.start()
            before.wait_ready()
            running["postgres_before"] = before
            configs.append("postgres_before")
            what = f"PostgresStore, this tree / at {ns.against}"
            rows_for.append((what, "postgres", "postgres_before"))
        load = Load(processes=2)
        stack.callback(load.close)

        print(
            f"bench_postgres: {rounds} rounds x {len(configs) * 2} slots of {seconds} s per "
            "block; ratio = agentkey / baseline, median (IQR)"
        )
        rows: list[dict[str, Any]] = []
        for mode, connections in BLOCKS:

            def slot(name: str, mode: str = mode, connections: int = connections) -> Slot:
                return measure(load, running[name], mode, connections, seconds)

            block = run_block(Block(mode, connections), rounds, slot, configs)
            for what, ours, base in rows_for:
                if ours in configs and base in configs:
                    rows.append(block.row(what, ours, base))
                    print_row(rows[-1])

        rows.append(loadgen_row(load, running["bare"], rounds, seconds))
        print_row(rows[-1])

    if not ns.smoke or ns.out:
        path = write_results(
            "postgres",
            {
                "method": "each configuration in its own uvicorn process (1 worker, loopback); "
                "palindromic (ABBA) rounds; ratio per round = agentkey/baseline; "
                "CPU from /proc/<pid>/stat of the uvicorn process; PostgreSQL with fsync on",
                "slot_seconds": seconds,
                "rows": rows,
            },
            ns.out,
            at_start,
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
