"""A Starlette tool app whose handlers exercise every path of the middleware."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agentkey.server import IdempotencyMiddleware, Store, current_claim
from tests.server._util import with_options

__all__ = ["tenant_principal", "tool_app"]


def tenant_principal(scope: Any) -> str:
    """The tenant named by the X-Tenant header (tests only: real apps use authentication)."""
    for name, value in scope.get("headers", ()):
        if name == b"x-tenant":
            return str(value.decode("latin-1"))
    return "anonymous"


def tool_app(store: Store, **options: Any) -> Starlette:
    """Tools: ok, ok-sync (a def handler), status, fail, big, stream, wait; ``app.state.runs``.

    ``app.state.gates[name]`` is a threading.Event a ``wait`` handler blocks on
    in a worker thread until the test sets it.
    """
    runs: Counter[str] = Counter()
    gates: dict[str, threading.Event] = {}
    entered: dict[str, threading.Event] = {}

    async def ok(request: Request) -> Response:
        args = await request.json()
        if request.headers.get("idempotency-key"):  # keyless requests carry no claim
            current_claim().begin_mutation()
        runs["ok"] += 1
        tenant = request.headers.get("x-tenant", "anonymous")
        return JSONResponse({"run": runs["ok"], "args": args, "tenant": tenant}, status_code=201)

    def ok_sync(request: Request) -> Response:
        # A plain def endpoint: Starlette runs it in a worker thread, where the
        # claim is reached through the copied context.
        current_claim().begin_mutation()
        runs["ok"] += 1
        return JSONResponse({"run": runs["ok"], "thread": "worker"}, status_code=201)

    async def status(request: Request) -> Response:
        args = await request.json()
        if args.get("mutate"):
            current_claim().begin_mutation()
        runs["status"] += 1
        return JSONResponse({"run": runs["status"]}, status_code=int(args["status"]))

    async def fail(request: Request) -> Response:
        args = await request.json()
        runs["fail"] += 1
        if args.get("mutate"):
            current_claim().begin_mutation()
        raise RuntimeError("the tool broke")

    async def big(request: Request) -> Response:
        args = await request.json()
        current_claim().begin_mutation()
        runs["big"] += 1
        return Response(b"%d:" % runs["big"] + b"x" * int(args["size"]), media_type="text/plain")

    async def stream(request: Request) -> Response:
        await request.json()
        runs["stream"] += 1

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(5):
                await asyncio.sleep(0)
                yield b"chunk-%d-run-%d;" % (i, runs["stream"])

        return StreamingResponse(chunks(), media_type="text/plain")

    async def wait(request: Request) -> Response:
        args = await request.json()
        name = str(args["gate"])
        claim = current_claim()
        entered.setdefault(name, threading.Event()).set()
        gate = gates.setdefault(name, threading.Event())

        async def block() -> None:
            await asyncio.to_thread(gate.wait, 30)  # the server loop stays free

        if args.get("keep_alive"):
            async with claim.keep_alive():
                await block()
        else:
            await block()
        claim.begin_mutation()
        runs["wait"] += 1
        return JSONResponse({"run": runs["wait"], "gate": name, "lost": claim.lost})

    options.setdefault("principal", tenant_principal)
    app = Starlette(
        routes=[
            Route("/ok", ok, methods=["POST"]),
            Route("/ok-sync", ok_sync, methods=["POST"]),
            Route("/status", status, methods=["POST"]),
            Route("/fail", fail, methods=["POST"]),
            Route("/big", big, methods=["POST"]),
            Route("/stream", stream, methods=["POST"]),
            Route("/wait", wait, methods=["POST"]),
        ],
        middleware=[Middleware(IdempotencyMiddleware, store=store, **with_options(options))],
    )
    app.state.runs = runs
    app.state.gates = gates
    app.state.entered = entered
    return app


def charge_app(variant: str, redis_url: str = "") -> Any:
    """One ``POST /tools/charge`` handler served four ways, for overhead measurements.

    ``bare``: no idempotency. ``naive``: the usual hand-written guard on the same
    Redis (``SET key IN_PROGRESS NX EX``, run, ``SET key result EX``; a duplicate
    gets the stored result or 409). ``redis`` / ``memory``: IdempotencyMiddleware
    on RedisStore / MemoryStore. ``uvicorn --factory tests.server._apps:bench_app``
    serves the one named by ``AGENTKEY_BENCH_VARIANT`` (Redis at ``AGENTKEY_BENCH_REDIS``).
    """

    async def charge(request: Request) -> Response:
        args = await request.json()
        return JSONResponse({"charge_id": "ch_1", "amount": args["amount"]}, status_code=201)

    if variant == "naive":
        from redis import asyncio as aioredis

        client = aioredis.Redis.from_url(redis_url)

        async def naive(request: Request) -> Response:
            key = "naive:" + request.headers["idempotency-key"]
            if not await client.set(key, b"IN_PROGRESS", nx=True, ex=120):
                stored = await client.get(key)
                if stored is None or stored == b"IN_PROGRESS":
                    return JSONResponse({"error": "in progress"}, status_code=409)
                return Response(stored, 201, {"idempotent-replayed": "true"}, "application/json")
            response = await charge(request)
            await client.set(key, response.body, ex=86_400)
            return response

        return Starlette(routes=[Route("/tools/charge", naive, methods=["POST"])])
    app = Starlette(routes=[Route("/tools/charge", charge, methods=["POST"])])
    if variant == "bare":
        return app
    from agentkey.server import MemoryStore, RedisStore

    store = RedisStore(redis_url) if variant == "redis" else MemoryStore()
    return IdempotencyMiddleware(app, store=store, shared_key_space=True)


def bench_app() -> Any:
    """The :func:`charge_app` named by the environment (a uvicorn factory)."""
    import os

    return charge_app(
        os.environ["AGENTKEY_BENCH_VARIANT"], os.environ.get("AGENTKEY_BENCH_REDIS", "")
    )
