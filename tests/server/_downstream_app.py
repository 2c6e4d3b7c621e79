"""A tool server whose handler calls another agentkey-protected service (issue 35, item 4).

Run as ``uvicorn --factory tests.server._downstream_app:app``. Configured by environment:
``AGENTKEY_TEST_DOWNSTREAM`` (base URL of the payments service), ``AGENTKEY_TEST_KEYS`` (a
file each run appends the downstream key it sent to), ``AGENTKEY_TEST_CRASH`` (a file: while
it exists, the handler removes it and SIGKILLs its own process right after the downstream
call, as a server that dies after its side effect) and ``AGENTKEY_TEST_KEYING``
(``key_for``: ``claim.key_for("payments")``; ``fresh``: a new random key on every run, the
mistake key_for prevents). The store is a MemoryStore: the crash takes the record with it,
so the retry runs the handler again, as it does after ``reconcile=`` answers "run it".
"""

from __future__ import annotations

import os
import signal
import uuid

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentkey.server import IdempotencyMiddleware, MemoryStore, current_claim


def app() -> Starlette:
    downstream = os.environ["AGENTKEY_TEST_DOWNSTREAM"]
    keys, crash = os.environ["AGENTKEY_TEST_KEYS"], os.environ["AGENTKEY_TEST_CRASH"]
    keying = os.environ.get("AGENTKEY_TEST_KEYING", "key_for")

    async def order(request: Request) -> JSONResponse:
        args = await request.json()
        claim = current_claim()
        key = claim.key_for("payments") if keying == "key_for" else str(uuid.uuid4())
        with open(keys, "a") as f:  # noqa: ASYNC230 - one tiny append, test only
            f.write(key + "\n")
        async with httpx.AsyncClient(timeout=30) as client:
            paid = await client.post(
                downstream + "/charge",
                json={"amount": args["amount"]},
                headers={"Idempotency-Key": key},
            )
        if os.path.exists(crash):  # noqa: ASYNC240 - test only
            os.remove(crash)
            os.kill(os.getpid(), signal.SIGKILL)  # dies after the side effect downstream
        return JSONResponse(
            {
                "charge": paid.json(),
                "status": paid.status_code,
                "replayed": paid.headers.get("idempotent-replayed"),
            },
            status_code=201,
        )

    return Starlette(
        routes=[Route("/tools/order", order, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=MemoryStore(),
                routes=["/tools/*"],
                principal=lambda scope: (
                    dict(scope["headers"]).get(b"x-tenant", b"").decode() or None
                ),
            )
        ],
    )
