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
    python bench/bench_pg_driver.py --against 1221695 --only read --concurrency 64
        # adds the PostgresStore of that git revision, in the same process and the same
        # rounds: a same-run before/after (its row's ratio is to psycopg, like the others)

``--against`` imports the revision's ``agentkey`` package (from ``git archive``) under
another name, ``agentkey_at_<rev>``, so both stores run on one event loop, one PostgreSQL
and one table, slot by slot; nothing of the old tree is imported as ``agentkey``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import secrets
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # agentkey, bench, tests

from agentkey.server._postgres import PostgresStore
from agentkey.server._records import encode_in_progress
from bench._harness import fmt, load_line, machine, palindrome, spread, write_results
from bench.bench_postgres import tree_at
from tests._postgres import postgres_server

TABLE = "driver_records"
BATCH = 16
Op = Callable[[int, int], Awaitable[Any]]  # (task index, call index) -> one statement


def per_round(values: list[float], base: list[float], rounds: int) -> list[float]:
    """Each palindromic round's ratio: its two slots of ``values`` over its two of ``base``."""
    return [
        (values[2 * r] + values[2 * r + 1]) / (base[2 * r] + base[2 * r + 1]) for r in range(rounds)
    ]


def _asyncpg() -> Any:
    try:
        return importlib.import_module("asyncpg")
    except ImportError:
        return None


def _store_at(root: Path, rev: str) -> Any:
    """``PostgresStore`` of the ``agentkey`` package under ``root`` (a tree at ``rev``),
    imported as ``agentkey_at_<rev>``: beside this tree's, never instead of it."""
    name = "agentkey_at_" + "".join(c if c.isalnum() else "_" for c in rev)
    package = root / "agentkey"
    spec = importlib.util.spec_from_file_location(
        name, package / "__init__.py", submodule_search_locations=[str(package)]
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return importlib.import_module(f"{name}.server._postgres").PostgresStore


async def measure(
    dsn: str,
    rounds: int,
    calls: int,
    *,
    before: tuple[str, Any] | None = None,
    kinds: tuple[str, ...] = ("read", "claim"),
    concurrencies: tuple[int, ...] = (1, 64),
) -> list[dict[str, Any]]:
    store = PostgresStore(dsn, table=TABLE, max_size=64)
    await store.create_table()
    old: Any = None
    if before is not None:
        old = before[1](dsn, table=TABLE, max_size=64)
        await old.create_table()
    value = encode_in_progress(secrets.token_hex(16), 1)
    await store.claim("replayed", b"C:stored", ttl_ms=10**9)
    claim, get = store._sql["claim"].decode(), store._sql["get"].decode()
    conns = [await psycopg.AsyncConnection.connect(dsn, autocommit=True) for _ in range(64)]

    def new_key() -> str:
        return secrets.token_hex(10)

    ops: dict[str, dict[str, Op]] = {"read": {}, "claim": {}}
    ops["read"]["PostgresStore"] = lambda t, i: store.get("replayed")
    ops["claim"]["PostgresStore"] = lambda t, i: store.claim(new_key(), value, ttl_ms=60_000)
    if old is not None:
        at = f"PostgresStore at {before[0]}" if before else ""
        ops["read"][at] = lambda t, i: old.get("replayed")
        ops["claim"][at] = lambda t, i: old.claim(new_key(), value, ttl_ms=60_000)

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
            if kind not in kinds:
                continue
            for concurrency in concurrencies:
                for op in sides.values():  # warm-up: connections, prepared statements
                    await slot(op, concurrency)
                got: dict[str, list[float]] = {name: [] for name in sides}
                for _ in range(rounds):
                    for name in palindrome(list(sides)):
                        got[name].append(await slot(sides[name], concurrency))
                base = got["psycopg"]
                if before is not None:  # this tree's store over the old one's, round by round
                    new_, old_ = got["PostgresStore"], got[f"PostgresStore at {before[0]}"]
                    ab = per_round(new_, old_, rounds)
                    print(
                        f"  {kind:<5} c={concurrency:<3} PostgresStore, this tree / at "
                        f"{before[0]}: {fmt(spread(ab))}"
                    )
                for name, values in got.items():
                    if name == batched:
                        values = [v / BATCH for v in values]
                    paired = per_round(values, base, rounds)
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
        if old is not None:
            await old.aclose()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="a few seconds, for CI")
    parser.add_argument("--rounds", type=int, default=6, help="ABBA rounds per row")
    parser.add_argument("--out", type=Path, help="where to write the JSON results")
    parser.add_argument(
        "--against",
        metavar="REV",
        help="also run the PostgresStore of git revision REV, in the same rounds",
    )
    parser.add_argument("--only", choices=("read", "claim"), help="one kind of statement")
    parser.add_argument(
        "--concurrency", type=int, choices=(1, 64), help="one concurrency (default: both)"
    )
    ns = parser.parse_args()
    at_start = machine()
    rounds, calls = (1, 8) if ns.smoke else (ns.rounds, 300)
    kinds = (ns.only,) if ns.only else ("read", "claim")
    concurrencies = (ns.concurrency,) if ns.concurrency else (1, 64)
    with ExitStack() as stack:
        before = None
        if ns.against:
            root = stack.enter_context(tree_at(ns.against))
            before = (ns.against, _store_at(root, ns.against))
        pg = stack.enter_context(postgres_server(durable=True))
        rows = asyncio.run(
            measure(pg.dsn, rounds, calls, before=before, kinds=kinds, concurrencies=concurrencies)
        )
    print(f"  {load_line(at_start)}")
    partial = ns.against or ns.only or ns.concurrency
    if (not ns.smoke and not partial) or ns.out:  # a partial run writes only where told
        method = (
            "one process; process CPU per statement (per key for batches); palindromic (ABBA) "
            "rounds; ratio per round = row / psycopg execute; PostgreSQL with fsync on"
        )
        payload = {"method": method, "calls": calls, "rows": rows}
        print(f"wrote {write_results('pg_driver', payload, ns.out, at_start)}")


if __name__ == "__main__":
    main()
