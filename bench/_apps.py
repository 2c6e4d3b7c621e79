"""The tool servers the benches load, one per process: ``uvicorn --factory bench._apps:app``.

``BENCH_APP`` picks the configuration; every one serves the same handler at
``POST /tools/charge`` (parse the JSON body, answer 201 with a small JSON object):

- ``bare``: the handler alone;
- ``memory``, ``redis``, ``postgres``: behind ``IdempotencyMiddleware`` on that store;
- ``naive``: the handler with the idempotency most articles show, written inline on the
  same Redis through the same client library: ``SET key "" NX EX``, run, ``SET key result``;
  a key already set answers its stored result (or 409 while it is empty);
- ``idemkit``: the handler behind idemkit's ASGI middleware (1.0.2, the interop suite's
  pin) on its Redis backend, default mode, one tenant: another library's answer to the
  same problem, on the same Redis;
- ``bare_insert`` / ``postgres_insert``: a handler whose side effect is one INSERT,
  autocommit, or in the store's transaction with the record.

``BENCH_REDIS`` (URL) and ``BENCH_PG_DSN`` name the services. ``BENCH_GC_THRESHOLD``
sets the garbage collector's first-generation threshold (``gc.set_threshold``) of
the server process, for the bench's tuned-GC block.
"""

from __future__ import annotations

import gc
import json
import os
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

__all__ = ["CONFIGS", "app"]

CONFIGS = (
    "bare",
    "memory",
    "redis",
    "naive",
    "idemkit",
    "postgres",
    "bare_insert",
    "postgres_insert",
)
_TTL = 86_400  # a day, as the middleware keeps results


async def charge(request: Request) -> Response:
    args = await request.json()
    return JSONResponse({"charge_id": "ch_1", "amount": args["amount"]}, status_code=201)


def _naive(redis_url: str) -> Any:
    from redis.asyncio import Redis

    redis = Redis.from_url(redis_url)

    async def naive_charge(request: Request) -> Response:
        key = request.headers.get("idempotency-key")
        if not key:
            return JSONResponse({"error": "Idempotency-Key is required"}, status_code=400)
        name = "naive:" + key
        if not await redis.set(name, b"", nx=True, ex=_TTL):
            stored = await redis.get(name)
            if not stored:
                return JSONResponse({"error": "in progress"}, status_code=409)
            return Response(
                stored,
                status_code=201,
                media_type="application/json",
                headers={"Idempotent-Replayed": "true"},
            )
        args = await request.json()
        body = json.dumps({"charge_id": "ch_1", "amount": args["amount"]}).encode()
        await redis.set(name, body, ex=_TTL)
        return Response(body, status_code=201, media_type="application/json")

    return naive_charge


def _insert(dsn: str, store: Any) -> Any:
    import psycopg

    from agentkey.server import current_claim

    sql = "INSERT INTO bench_charges (amount) VALUES (%s) RETURNING id"
    pool: list[psycopg.AsyncConnection[Any]] = []

    async def insert_charge(request: Request) -> Response:
        args = await request.json()
        if store is None:
            if not pool:
                pool.append(await psycopg.AsyncConnection.connect(dsn, autocommit=True))
            row = await (await pool[0].execute(sql, (args["amount"],))).fetchone()
            assert row is not None
            return JSONResponse({"charge_id": row[0]}, status_code=201)
        async with store.transaction(current_claim()) as tx:
            row = await (await tx.connection.execute(sql, (args["amount"],))).fetchone()
            assert row is not None
            return await tx.complete(JSONResponse({"charge_id": row[0]}, status_code=201))  # type: ignore[no-any-return]

    return insert_charge


def _idemkit(tool: Any, redis_url: str) -> Any:
    import idemkit

    # With redis-py 8's default pool (100 connections), 64 connections of load got idemkit's
    # 503 storage-error (observed; its pool ran dry): a pool with room, as a deployment would.
    backend = idemkit.RedisBackend.from_url(
        redis_url, namespace="bench-idemkit", max_connections=1024
    )
    config = idemkit.HttpConfig(scope_mode="single_tenant")
    return idemkit.IdempotencyMiddleware(tool, backend=backend, config=config)


def app() -> Any:
    """The ASGI app named by ``BENCH_APP`` (uvicorn calls this with ``--factory``)."""
    config = os.environ["BENCH_APP"]
    if config not in CONFIGS:
        raise SystemExit(f"BENCH_APP must be one of {', '.join(CONFIGS)}, got {config!r}")
    threshold = os.environ.get("BENCH_GC_THRESHOLD")
    if threshold:
        gc.set_threshold(int(threshold), *gc.get_threshold()[1:])
    store: Any = None
    if config == "memory":
        from agentkey.server import MemoryStore

        store = MemoryStore()
    elif config == "redis":
        from agentkey.server import RedisStore

        store = RedisStore(os.environ["BENCH_REDIS"])
    elif config in ("postgres", "postgres_insert"):
        from agentkey.server._postgres import PostgresStore

        table = "tx_records" if config == "postgres_insert" else "agentkey_records"
        store = PostgresStore(os.environ["BENCH_PG_DSN"], table=table)
    handler: Any = charge
    if config == "naive":
        handler = _naive(os.environ["BENCH_REDIS"])
    elif config.endswith("insert"):
        handler = _insert(os.environ["BENCH_PG_DSN"], store)
    tool: Any = Starlette(routes=[Route("/tools/charge", handler, methods=["POST"])])
    if config == "idemkit":
        return _idemkit(tool, os.environ["BENCH_REDIS"])
    if store is None:
        return tool
    from agentkey.server import IdempotencyMiddleware

    return IdempotencyMiddleware(tool, store=store, shared_key_space=True)
