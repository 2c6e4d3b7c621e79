"""A tool server for subprocess tests (``uvicorn --factory tests.server._proc_app:app``).

Configured by environment: ``AGENTKEY_TEST_REDIS`` (URL), ``AGENTKEY_TEST_PREFIX``,
``AGENTKEY_TEST_LEASE`` (seconds), ``AGENTKEY_TEST_WORK`` (seconds each step works
before its side effect) and ``AGENTKEY_TEST_RUNS`` (a file each execution appends one
line to, so a test counts executions across processes).
"""

from __future__ import annotations

import asyncio
import os

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentkey.server import IdempotencyMiddleware, RedisStore, ServerOptions, current_claim


def app() -> Starlette:
    runs = os.environ["AGENTKEY_TEST_RUNS"]
    work = float(os.environ.get("AGENTKEY_TEST_WORK", "0"))

    async def slow(request: Request) -> JSONResponse:
        await request.json()
        await asyncio.sleep(work)  # no side effect yet: a kill here orphans the claim
        await current_claim().begin_mutation()  # on_mark: only from here may it have run
        with open(runs, "a") as f:  # noqa: ASYNC230 - one tiny append, test only
            f.write(f"{os.getpid()}\n")
        return JSONResponse({"pid": os.getpid()}, status_code=201)

    return Starlette(
        routes=[Route("/tools/slow", slow, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=RedisStore(
                    os.environ["AGENTKEY_TEST_REDIS"], prefix=os.environ["AGENTKEY_TEST_PREFIX"]
                ),
                routes=["/tools/*"],
                options=ServerOptions(
                    lock_ttl=float(os.environ["AGENTKEY_TEST_LEASE"]), mutation_starts="on_mark"
                ),
                shared_key_space=True,
            )
        ],
    )
