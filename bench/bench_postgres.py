"""PostgresStore against its floor: the same claim and finish statements written by hand.

Configurations, each a uvicorn process of its own (one worker, loopback; see ``bench/_apps.py``):

- ``floor``: the baseline the target is set against (issue 39: "≤ 1.1× the floor"). The
  charge tool behind a hand-written ASGI middleware (:class:`Floor`, below) that runs
  PostgresStore's own claim and finish statements on a ``psycopg_pool`` pool of
  autocommit connections (``pool.connection()``, ``connection.execute``), on a table of
  the same shape, in the same database: a fresh request claims (one round trip), runs the
  tool and writes its answer (one more); a replay reads the stored answer with the claim.
  It keeps what a correct store needs (an owner-fenced finish, a fingerprint of the body,
  leases that expire) and nothing else: no error handling, recovery or sweeps.
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
    python bench/bench_postgres.py --floor-only --rounds 20  # the floor rows alone:
                                              # writes bench/results/postgres-floor.json
    python bench/bench_postgres.py --floor-only --against 1221695  # adds that revision's
                                              # PostgresStore to the same rounds

``--floor-only`` puts only the floor and PostgresStore (and, with ``--against``, the
revision's PostgresStore) in the rounds, so they sit next to each other in every round;
the bare endpoint is loaded after the rounds, for the ``loadgen`` row alone. The full
run's rounds hold every configuration, so its floor and PostgresStore slots are further
apart in time; both runs pair each round's two slots of each and take the median of the
per-round ratios.

Server CPU is read in nanoseconds (the sum of ``/proc/<pid>/task/*/schedstat``), not in
the 10 ms clock ticks of ``/proc/<pid>/stat``: a 0.4 s slot at one connection spends
about 0.2 s of server CPU, where one tick is 5%.

Why the floor-only and the full run of stop 45 disagreed at one connection (fresh 1.11x
against 1.06x, replay 1.12x against 1.04x): not a different request mix (both send the
same requests to the same two servers), nor the warm-up (one slot per configuration in
both), nor the process measured (``--workers 1`` serves in the process whose CPU is
read). Their per-round ratios spread over 0.99-1.14 and 1.00-1.10 (IQR), so with 10
rounds each median was known to about +-0.04 to 0.09: the two runs are within noise of
each other. The floor-only run's CPU per request was also about 30% higher for both
configurations (1505/1397 us against 1135/1068 us fresh): the machine was slower in
that hour, which moves both sides. Each row now prints the 95% interval of its median
(order statistics); a 1.1x line is checked only when the interval is narrow enough
(more rounds, or a quiet machine). Instruction counts (cachegrind) do not move with load
and are the figure to compare code by.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
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

from agentkey.server._postgres import PostgresStore
from bench._harness import (
    ROOT,
    Block,
    Load,
    Server,
    Slot,
    load_line,
    loadgen_row,
    machine,
    print_row,
    proc_cpu,
    run_block,
    servers,
    write_results,
)
from tests._loopback import redis_server
from tests._postgres import postgres_server

FLOOR_APP = "bench.bench_postgres:floor_app"
FLOOR_TABLE = "floor_records"
ROWS = [
    ("middleware + PostgresStore / hand-written floor", "postgres", "floor"),
    ("middleware + PostgresStore / bare endpoint", "postgres", "bare"),
    ("middleware + PostgresStore / RedisStore", "postgres", "redis"),
    ("PostgresStore, INSERT + record in one tx / bare INSERT", "postgres_insert", "bare_insert"),
]
BLOCKS = [("fresh", 1), ("fresh", 64), ("replay", 1), ("replay", 64)]


class Floor:
    """The floor, an ASGI middleware written by hand: PostgresStore's claim and finish
    statements (the same text, from its module) on a ``psycopg_pool`` pool, nothing more.

    Records: ``P:<owner>:<body sha256>`` while the tool runs (the lease, 30 s), then
    ``C:<body sha256>:<status>:<body>`` for a day. A replay whose body differs gets 422;
    a key in progress 409.
    """

    def __init__(self, app: Any, dsn: str, table: str = FLOOR_TABLE) -> None:
        from psycopg import sql
        from psycopg_pool import AsyncConnectionPool

        from agentkey.server import _postgres

        self.app = app
        ident = sql.Identifier(table)
        self.claim = sql.SQL(_postgres._CLAIM).format(t=ident).as_bytes(None)
        self.finish = sql.SQL(_postgres._FINISH).format(t=ident).as_bytes(None)
        self.pool: Any = AsyncConnectionPool(
            dsn, min_size=1, max_size=20, open=False, kwargs={"autocommit": True}
        )
        self.ready = False
        self.opening: asyncio.Lock | None = None

    async def _open(self) -> None:
        self.opening = self.opening or asyncio.Lock()
        async with self.opening:
            if not self.ready:
                await self.pool.open()
                self.ready = True

    async def _one(self, query: bytes, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(query, params)
            rows: list[tuple[Any, ...]] = await cur.fetchall()
            return rows

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self.ready:
            await self._open()
        key = dict(scope["headers"]).get(b"idempotency-key", b"").decode("ascii")
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        fp = hashlib.sha256(body).hexdigest().encode()
        if not key:
            await _answer(send, 400, b'{"error":"Idempotency-Key is required"}')
            return
        owner = os.urandom(16).hex()
        prefix = b"P:" + owner.encode() + b":"
        rows = await self._one(self.claim, {"k": key, "v": prefix + fp, "ttl": 30_000})
        won = rows[0][1] if rows else False  # no row: a racing claim; answer 409 (rare)
        if not won:
            stored = bytes(rows[0][0]) if rows else b"P:"
            if stored.startswith(b"P:"):
                await _answer(send, 409, b'{"error":"in progress"}')
                return
            _, stored_fp, status, answer = stored.split(b":", 3)
            if stored_fp != fp:
                await _answer(send, 422, b'{"error":"payload mismatch"}')
                return
            await _answer(send, int(status), answer, replayed=True)
            return
        started: dict[str, Any] = {}
        parts: list[bytes] = []
        sent = False

        async def body_once() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def capture(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                started.update(message)
            else:
                parts.append(message.get("body", b""))

        await self.app(scope, body_once, capture)
        answer = b"".join(parts)
        status = started["status"]
        value = b"C:" + fp + b":%d:" % status + answer
        params = {"k": key, "p": prefix, "n": len(prefix), "o": owner, "v": value}
        if not (await self._one(self.finish, {**params, "ttl": 86_400_000}))[0][0]:
            await _answer(send, 500, b'{"error":"lost the claim"}')
            return
        await send(started)
        await send({"type": "http.response.body", "body": answer})


async def _answer(send: Any, status: int, body: bytes, *, replayed: bool = False) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if replayed:
        headers.append((b"idempotent-replayed", b"true"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def floor_app() -> Any:
    """The ``floor`` server: the charge tool of ``bench/_apps.py`` behind :class:`Floor`."""
    from bench._apps import app

    os.environ["BENCH_APP"] = "bare"
    return Floor(app(), os.environ["BENCH_PG_DSN"])


def server_cpu(pid: int) -> float:
    """CPU seconds the process ``pid`` has used so far, to the nanosecond where Linux says.

    The sum over its threads of ``/proc/<pid>/task/<tid>/schedstat`` (time on a CPU, in ns);
    falls back to ``/proc/<pid>/stat`` (clock ticks) where schedstat is missing.
    """
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            total += int((task / "schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return proc_cpu(pid)
    return total / 1e9


def measure(load: Load, server: Server, mode: str, connections: int, seconds: float) -> Slot:
    """One slot against ``server``, its CPU read by :func:`server_cpu`; fails loudly on any
    answer other than 201 (and, replaying, on any request not replayed)."""
    load.prepare(server.port, mode, connections, 1)
    before = server_cpu(server.pid)
    got = load.run(server.port, mode, connections, seconds, 1)
    cpu = server_cpu(server.pid) - before
    if got["errors"]:
        raise RuntimeError(f"{server.config} answered non-201s: {got['statuses']}")
    idempotent = server.config not in ("bare", "bare_insert")
    if mode == "replay" and idempotent and got["replayed"] != got["requests"]:
        raise RuntimeError(f"{server.config}: {got['replayed']}/{got['requests']} replayed")
    if mode == "fresh" and got["replayed"]:
        raise RuntimeError(f"{server.config}: a fresh key was replayed")
    return Slot(got["requests"], got["elapsed"], cpu, got["load_cpu"], 0.0)


def _per_request(s: Slot) -> float:
    return s.server_cpu / s.requests


def median_ci(values: list[float]) -> tuple[float, float]:
    """A distribution-free 95% interval of the median of ``values`` (order statistics of
    the binomial(n, 1/2)): where the median of more rounds would fall."""
    ordered = sorted(values)
    n = len(ordered)
    if n < 6:
        return ordered[0], ordered[-1]
    from math import comb

    low, mass = 0, 0.0
    while True:
        mass += comb(n, low) / 2**n
        if mass > 0.025:
            break
        low += 1
    return ordered[max(0, low - 1)], ordered[min(n - 1, n - low)]


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
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="a few seconds, for CI")
    parser.add_argument("--rounds", type=int, default=10, help="ABBA rounds per block")
    parser.add_argument("--seconds", type=float, default=0.4, help="length of one slot")
    parser.add_argument("--out", type=Path, help="where to write the JSON results")
    parser.add_argument(
        "--against",
        metavar="REV",
        help="also run PostgresStore from git revision REV, interleaved: a before/after row",
    )
    parser.add_argument(
        "--floor-only",
        action="store_true",
        help="only PostgresStore, its floor and the bare endpoint (for the loadgen row), so "
        "the two sit next to each other in every round; writes postgres-floor.json",
    )
    ns = parser.parse_args()
    at_start = machine()
    rounds, seconds = (1, 0.1) if ns.smoke else (ns.rounds, ns.seconds)

    with ExitStack() as stack:
        pg = stack.enter_context(postgres_server(durable=True))
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE bench_charges (id serial PRIMARY KEY, amount int)")
            conn.execute(PostgresStore(pg.dsn, table=FLOOR_TABLE).schema_sql())  # same shape
        env = {"BENCH_PG_DSN": pg.dsn}
        configs = ["bare", "postgres"]
        if not ns.floor_only:
            configs += ["bare_insert", "postgres_insert"]
        if (
            shutil.which("redis-server") and not ns.smoke and not ns.floor_only
        ):  # bench_server's smoke runs Redis
            env["BENCH_REDIS"] = stack.enter_context(redis_server()).url
            configs.insert(1, "redis")
        running = stack.enter_context(servers(configs, env))
        floor = Server("floor", env, app=FLOOR_APP)
        stack.callback(floor.stop)
        floor.start()
        floor.wait_ready()
        running["floor"] = floor
        configs.insert(0, "floor")
        if ns.floor_only:  # the bare endpoint only for the loadgen row, after the rounds
            configs.remove("bare")
        rows_for = list(ROWS)
        if ns.against:
            before = Server("postgres", env, root=stack.enter_context(tree_at(ns.against)))
            stack.callback(before.stop)
            before.start()
            before.wait_ready()
            running["postgres_before"] = before
            configs.append("postgres_before")
            rows_for.append(
                (
                    f"middleware + PostgresStore, this tree / at {ns.against}",
                    "postgres",
                    "postgres_before",
                )
            )
            rows_for.append(
                (
                    f"middleware + PostgresStore at {ns.against} / hand-written floor",
                    "postgres_before",
                    "floor",
                )
            )
        load = Load(processes=2)
        stack.callback(load.close)

        print(
            f"bench_postgres: {rounds} rounds x {len(configs) * 2} slots of {seconds} s per "
            f"block ({', '.join(configs)}); ratio = agentkey / baseline, median (IQR) "
            "[95% interval of the median]; server CPU in ns (schedstat)"
        )
        print(f"  baseline of the target: floor (hand-written statements); {load_line(at_start)}")
        rows: list[dict[str, Any]] = []
        for mode, connections in [BLOCKS[0], BLOCKS[-1]] if ns.smoke else BLOCKS:

            def slot(name: str, mode: str = mode, connections: int = connections) -> Slot:
                return measure(load, running[name], mode, connections, seconds)

            block = run_block(Block(mode, connections), rounds, slot, configs)
            for what, ours, base in rows_for:
                if ours in configs and base in configs:
                    rows.append(block.row(what, ours, base))
                    ratios = [
                        _per_request(block.total(r, ours)) / _per_request(block.total(r, base))
                        for r in block.rounds
                    ]
                    low, high = median_ci(ratios)
                    rows[-1]["server_cpu_per_request_ratio"]["ci95"] = [
                        round(low, 3),
                        round(high, 3),
                    ]
                    print_row(rows[-1])
                    print(f"  {'':<56} 95% interval of the cpu/req median: {low:.2f}-{high:.2f}")
            print(f"  {load_line(at_start)}")

        rows.append(loadgen_row(load, running["bare"], rounds, seconds))
        print_row(rows[-1])
        print(f"  {load_line(at_start)}")

    if not ns.smoke or ns.out:
        path = write_results(
            "postgres-floor" if ns.floor_only else "postgres",
            {
                "bench": "bench/bench_postgres.py" + (" --floor-only" if ns.floor_only else ""),
                "method": "each configuration in its own uvicorn process (1 worker, loopback); "
                "palindromic (ABBA) rounds; ratio per round = agentkey/baseline; "
                "CPU from /proc/<pid>/task/*/schedstat of the uvicorn process (ns); "
                "PostgreSQL with fsync on",
                "slot_seconds": seconds,
                "rows": rows,
            },
            ns.out,
            at_start,
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
