"""What one PostgreSQL statement costs the client: PostgresStore, bare psycopg, asyncpg, batches.

In one process, on a throwaway PostgreSQL with fsync on, the process CPU per statement of:

- ``PostgresStore``: ``get`` (a replay's read) and ``claim`` of a new key (a committing
  write), through its pool;
- ``psycopg``: the same rendered statements on plain autocommit connections
  (``connection.execute``), one per task;
- ``asyncpg``: the same statements (``$n`` placeholders), when asyncpg is importable (it is
  not a dependency: ``pip install asyncpg`` to add the column);
- ``psycopg, 16 keys per statement``: what amortising statements across requests could
  save, with a read of 16 keys (``key = ANY(...)``) and an ``INSERT`` of 16 rows from
  ``unnest`` (a simplified claim), per key.

One statement at a time (``c=1``) and 64 tasks at once (``c=64``). Rows are loaded in
palindromic (ABBA) rounds; a row's ratio is its CPU over psycopg's, paired by round.

    python bench/bench_pg_driver.py           # about a minute: writes bench/results/pg_driver.json
    python bench/bench_pg_driver.py --smoke   # a few seconds, for CI (writes nothing)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import secrets
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # agentkey, bench, tests

from agentkey.server._postgres import PostgresStore
from agentkey.server._records import encode_in_progress
from bench._harness import load_line, machine, palindrome, spread, write_results
from tests._postgres import postgres_server

TABLE = "driver_records"
BATCH = 16
Op = Callable[[int, int], Awaitable[Any]]  # (task index, call index) -> one statement


def _asyncpg() -> Any:
    try:
        return importlib.import_module("asyncpg")
    except ImportError:
        return None


async def measure(dsn: str, rounds: int, calls: int) -> list[dict[str, Any]]:
    store = PostgresStore(dsn, table=TABLE, max_size=64)
    await store.create_table()
    value = encode_in_progress(secrets.token_hex(16), 1)
    await store.claim("replayed", b"C:stored", ttl_ms=10**9)
    claim, get = store._sql["claim"].decode(), store._sql["get"].decode()
    conns = [await psycopg.AsyncConnection.connect(dsn, autocommit=True) for _ in range(64)]

    def new_key() -> str:
        return secrets.token_hex(10)

    ops: dict[str, dict[str, Op]] = {"read": {}, "claim": {}}
    ops["read"]["PostgresStore"] = lambda t, i: store.get("replayed")
    ops["claim"]["PostgresStore"] = lambda t, i: store.claim(new_key(), value, ttl_ms=60_000)

    async def psy_read(t: int, i: int) -> Any:
        return await (await conns[t].execute(get, {"k": "replayed"})).fetchall()

    async def psy_claim(t: int, i: int) -> Any:
        params = {"k": new_key(), "v": value, "ttl": 60_000}
        return await (await conns[t].execute(claim, params)).fetchall()

    ops["read"]["psycopg"], ops["claim"]["psycopg"] = psy_read, psy_claim
    keys = [f"b{i}" for i in range(BATCH)]
    for key in keys:
        await store.claim(key, b"C:stored", ttl_ms=10**9)
    many = f"SELECT key, value FROM {TABLE} WHERE key = ANY(%s) AND expires_at > clock_timestamp()"  # noqa: S608
    insert = (
        f"INSERT INTO {TABLE} (key, value, expires_at) "  # noqa: S608
        "SELECT k, v, clock_timestamp() + interval '1 minute' "
        "FROM unnest(%s::text[], %s::bytea[]) AS u(k, v) ON CONFLICT DO NOTHING RETURNING key"
    )

    async def batch_read(t: int, i: int) -> Any:
        return await (await conns[t].execute(many, (keys,))).fetchall()

    async def batch_claim(t: int, i: int) -> Any:
        news = [new_key() for _ in range(BATCH)]
        return await (await conns[t].execute(insert, (news, [value] * BATCH))).fetchall()

    batched = f"psycopg, {BATCH} keys per statement"
    ops["read"][batched], ops["claim"][batched] = batch_read, batch_claim
    apg = _asyncpg()
    aconns: list[Any] = []
    if apg is None:
        print("asyncpg is not importable (pip install asyncpg): its rows are skipped")
    else:
        aconns = [await apg.connect(dsn) for _ in range(64)]
        aget = get.replace("%(k)s", "$1")
        aclaim = claim.replace("%(k)s", "$1").replace("%(v)s", "$2")
        aclaim = aclaim.replace("%(ttl)s", "$3::bigint")
        ops["read"]["asyncpg"] = lambda t, i: aconns[t].fetch(aget, "replayed")
        ops["claim"]["asyncpg"] = lambda t, i: aconns[t].fetch(aclaim, new_key(), value, 60_000)

    async def slot(op: Op, concurrency: int) -> float:
        per_task = calls if concurrency == 1 else max(1, calls * 4 // concurrency)

        async def task(t: int) -> None:
            for i in range(per_task):
                await op(t, i)

        cpu = time.process_time()
        await asyncio.gather(*(task(t) for t in range(concurrency)))
        return (time.process_time() - cpu) / (per_task * concurrency) * 1e6

    print(
        f"bench_pg_driver: {rounds} rounds; process CPU per statement (per key for batches); "
        "baseline: psycopg `execute` on a plain autocommit connection"
    )
    rows: list[dict[str, Any]] = []
    try:
        for kind, sides in ops.items():
            for concurrency in (1, 64):
                for op in sides.values():  # warm-up: connections, prepared statements
                    await slot(op, concurrency)
                got: dict[str, list[float]] = {name: [] for name in sides}
                for _ in range(rounds):
                    for name in palindrome(list(sides)):
                        got[name].append(await slot(sides[name], concurrency))
                base = got["psycopg"]
                for name, values in got.items():
                    if name == batched:
                        values = [v / BATCH for v in values]
                    paired = [
                        (values[2 * r] + values[2 * r + 1]) / (base[2 * r] + base[2 * r + 1])
                        for r in range(rounds)
                    ]
                    print(
                        f"  {kind:<5} c={concurrency:<3} {name:<34} "
                        f"{statistics.median(values):7.1f} us  "
                        f"{statistics.median(paired):.2f}x psycopg "
                        f"({min(paired):.2f}-{max(paired):.2f})"
                    )
                    rows.append(
                        {
                            "what": kind,
                            "concurrency": concurrency,
                            "agentkey": name,
                            "baseline": "psycopg",
                            "N": rounds,
                            "cpu_us": round(statistics.median(values), 1),
                            "cpu_ratio": spread(paired),
                        }
                    )
    finally:
        for conn in conns:
            await conn.close()
        for aconn in aconns:
            await aconn.close()
        await store.aclose()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few seconds, for CI")
    parser.add_argument("--rounds", type=int, default=6, help="ABBA rounds per row")
    parser.add_argument("--out", type=Path, help="where to write the JSON results")
    ns = parser.parse_args()
    at_start = machine()
    rounds, calls = (1, 8) if ns.smoke else (ns.rounds, 300)
    with postgres_server(durable=True) as pg:
        rows = asyncio.run(measure(pg.dsn, rounds, calls))
    print(f"  {load_line(at_start)}")
    if not ns.smoke or ns.out:
        method = (
            "one process; process CPU per statement (per key for batches); palindromic (ABBA) "
            "rounds; ratio per round = row / psycopg execute; PostgreSQL with fsync on"
        )
        payload = {"method": method, "calls": calls, "rows": rows}
        print(f"wrote {write_results('pg_driver', payload, ns.out, at_start)}")


if __name__ == "__main__":
    main()
