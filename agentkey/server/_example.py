"""A small tool server behind the middleware: what ``agentkey check`` is tested against."""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from .._clock import SYSTEM, Clock
from ._blobs import BlobStore
from ._claim import current_claim
from ._middleware import IdempotencyMiddleware, Scope
from ._options import ServerOptions
from ._stores import MemoryStore, Store

__all__ = ["bearer_principal", "example_app"]

# A report of at most ~800 KB: under the middleware's max_recorded_bytes (1 MiB), and
# no request can make the server build more.
_MAX_ROWS = 20_000


def bearer_principal(scope: Scope) -> str | None:
    """Each bearer token is its own principal (fits static API keys, not rotating tokens).

    A request without one has no principal: the middleware answers 401. Any token
    is accepted, so this is for a demo server; a real one verifies the token.
    """
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization" and value[:7].lower() == b"bearer ":
            token = value[7:].strip()
            if token:
                return "token-" + hashlib.sha256(token).hexdigest()[:32]
    return None


def example_app(
    store: Store | None = None,
    *,
    blob_store: BlobStore | None = None,
    work_seconds: float = 0.2,
    lock_ttl: float = 15.0,
    shared_key_space: bool = False,
    clock: Clock | None = None,
) -> Starlette:
    """A tool server with ``POST /tools/charge``, ``/tools/provision`` and ``/tools/report``.

    Every execution is counted in ``app.state.executions`` (also served at
    ``GET /executions``), so tests and demos can see that a duplicate was
    replayed instead of run. ``provision`` works for ``work_seconds`` before
    its side effect, long enough for a concurrent duplicate to get 409.

    Each bearer token is its own caller, and a request without one gets 401
    (any token is accepted: this is a demo). ``shared_key_space=True`` drops
    that: every caller shares one key space, for one agent talking to the
    server in its own process.

    ``clock`` paces the simulated work (``agentkey.testing.FakeClock``: none waited).
    """
    executions: Counter[str] = Counter()
    clock = clock if clock is not None else SYSTEM

    async def charge(request: Request) -> JSONResponse:
        args: dict[str, Any] = await request.json()
        amount = args.get("amount")
        if not isinstance(amount, int) or isinstance(amount, bool) or amount <= 0:
            return JSONResponse({"error": "amount must be a positive integer"}, status_code=400)
        current_claim().begin_mutation()
        executions["charge"] += 1
        n = executions["charge"]
        return JSONResponse(
            {"charge_id": f"ch_{n:06d}", "amount": amount, "currency": args.get("currency")},
            status_code=201,
        )

    async def provision(request: Request) -> JSONResponse:
        args: dict[str, Any] = await request.json()
        claim = current_claim()
        async with claim.keep_alive():
            await clock.asleep(work_seconds)  # quota checks, image lookup: no side effect yet
            claim.begin_mutation()
            executions["provision"] += 1
            n = executions["provision"]
        return JSONResponse({"vm_id": f"vm-{n:04d}", "region": args.get("region")})

    async def report(request: Request) -> JSONResponse:
        args: dict[str, Any] = await request.json()
        rows = args.get("rows", 5000)
        if not isinstance(rows, int) or isinstance(rows, bool) or not 0 <= rows <= _MAX_ROWS:
            return JSONResponse(
                {"error": f"rows must be an integer from 0 to {_MAX_ROWS}"}, status_code=400
            )
        current_claim().begin_mutation()
        executions["report"] += 1
        return JSONResponse({"rows": [{"n": i, "pad": "x" * 20} for i in range(rows)]})

    async def counts(request: Request) -> JSONResponse:
        return JSONResponse(dict(executions))

    app = Starlette(
        routes=[
            Route("/tools/charge", charge, methods=["POST"]),
            Route("/tools/provision", provision, methods=["POST"]),
            Route("/tools/report", report, methods=["POST"]),
            Route("/executions", counts, methods=["GET"]),
        ],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store if store is not None else MemoryStore(clock=clock),
                routes=["/tools/*"],
                principal=None if shared_key_space else bearer_principal,
                shared_key_space=shared_key_space,
                blob_store=blob_store,
                options=ServerOptions(lock_ttl=lock_ttl),
            )
        ],
    )
    app.state.executions = executions
    return app
