"""PostgresStore overhead: the same tool bare, on Redis and on PostgreSQL, over loopback.

Rows, each sequential requests from one client (fresh keys, then one key replayed):

- the bare app, and the app behind the middleware on RedisStore and PostgresStore;
- a tool whose side effect is an INSERT: bare (autocommit), and behind the
  middleware on PostgresStore with the INSERT and the record in one transaction.

PostgreSQL runs with fsync on (commits are paid for). The machine may be shared:
the ratios are indicative.

    python bench/bench_postgres.py            # full run
    python bench/bench_postgres.py --smoke    # a quick run for CI
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psycopg
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests._loopback

from agentkey.server import IdempotencyMiddleware, RedisStore, get_claim
from agentkey.server._postgres import PostgresStore
from bench.bench_server import run, tool_app
from tests._loopback import redis_server, serve
from tests._postgres import postgres_server


def insert_app(dsn: str, store: PostgresStore | None) -> Any:
    """A charge tool whose side effect is one INSERT; transactional behind the store."""
    pool: list[psycopg.AsyncConnection[Any]] = []

    async def charge(request: Request) -> JSONResponse:
        args = await request.json()
        sql = "INSERT INTO bench_charges (amount) VALUES (%s) RETURNING id"
        if store is None:
            if not pool:
                pool.append(await psycopg.AsyncConnection.connect(dsn, autocommit=True))
            row = await (await pool[0].execute(sql, (args["amount"],))).fetchone()
            assert row is not None
            return JSONResponse({"charge_id": row[0]}, status_code=201)
        async with store.transaction(get_claim(request)) as tx:
            row = await (await tx.connection.execute(sql, (args["amount"],))).fetchone()
            assert row is not None
            return await tx.complete(JSONResponse({"charge_id": row[0]}, status_code=201))

    app: Any = Starlette(routes=[Route("/tools/charge", charge, methods=["POST"])])
    return app if store is None else IdempotencyMiddleware(app, store=store)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a quick run for CI")
    ns = parser.parse_args()
    n = 50 if ns.smoke else 1000

    with ExitStack() as stack:
        pg = stack.enter_context(postgres_server(durable=True))
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE bench_charges (id serial PRIMARY KEY, amount int)")
        variants: list[tuple[str, Callable[[], Any]]] = [("bare app", lambda: tool_app(None))]
        if shutil.which("redis-server"):
            redis = stack.enter_context(redis_server())
            variants.append(("middleware + RedisStore", lambda: tool_app(RedisStore(redis.url))))
        variants += [
            ("middleware + PostgresStore", lambda: tool_app(PostgresStore(pg.dsn))),
            ("bare app, INSERT", lambda: insert_app(pg.dsn, None)),
            (
                "PostgresStore, INSERT in tx",
                lambda: insert_app(pg.dsn, PostgresStore(pg.dsn, table="tx_records")),
            ),
        ]
        print(f"{n} sequential requests per row, one client, uvicorn on loopback")
        print(f"{'variant':<30} {'fresh req/s':>12} {'ratio':>7} {'replay req/s':>13} {'ratio':>7}")
        base_fresh = base_replay = 0.0
        for name, make in variants:
            with serve(make()) as url:
                fresh = run(url, n, replay=False)
                replay = run(url, n, replay=True)
            if name.startswith("bare app"):
                base_fresh, base_replay = fresh, replay
            print(
                f"{name:<30} {fresh:>12.0f} {fresh / base_fresh:>7.2f} "
                f"{replay:>13.0f} {replay / base_replay:>7.2f}"
            )
        # Pools opened in the server threads are dropped with their loops.


if __name__ == "__main__":
    main()
