"""The tool server of the PostgreSQL fault suite (``tests.postgres._fault_app:app``, a factory).

Two tools behind IdempotencyMiddleware on one PostgresStore:

- ``/tools/plain``: a side effect outside the database. It begins its mutation, then
  appends ``<key> <run id>`` to a ledger file (``AGENTKEY_FAULT_LEDGER``; an
  ``O_APPEND`` line per execution, so two workers never interleave) and answers the run id.
- ``/tools/charge``: a side effect in the database. It inserts a row into
  ``fault_charges`` in the store's transaction and completes the record in the same commit.

Configured by ``AGENTKEY_FAULT_DSN``, ``AGENTKEY_FAULT_TABLE`` and ``AGENTKEY_FAULT_LEASE``.
"""

from __future__ import annotations

import asyncio
import os
import uuid

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentkey.server import IdempotencyMiddleware, PostgresStore, ServerOptions, current_claim

#: Seconds each tool works before its side effect, so racing duplicates overlap it.
WORK = 0.02


def app() -> Starlette:
    ledger = os.environ["AGENTKEY_FAULT_LEDGER"]
    store = PostgresStore(
        os.environ["AGENTKEY_FAULT_DSN"], table=os.environ["AGENTKEY_FAULT_TABLE"]
    )

    async def plain(request: Request) -> JSONResponse:
        await request.json()
        claim = current_claim()
        await asyncio.sleep(WORK)
        claim.begin_mutation()
        run = uuid.uuid4().hex
        fd = os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{claim.idempotency_key} {run}\n".encode())
        finally:
            os.close(fd)
        return JSONResponse({"run": run}, status_code=201)

    async def charge(request: Request) -> JSONResponse:
        args = await request.json()
        claim = current_claim()
        async with store.transaction(claim) as tx:
            await asyncio.sleep(WORK)  # a fault can land inside the transaction
            cur = await tx.connection.execute(
                "INSERT INTO fault_charges (step, amount) VALUES (%s, %s) RETURNING id",
                (claim.idempotency_key, args["amount"]),
            )
            row = await cur.fetchone()
            assert row is not None
            return await tx.complete(JSONResponse({"charge_id": row[0]}, status_code=201))

    return Starlette(
        routes=[
            Route("/tools/plain", plain, methods=["POST"]),
            Route("/tools/charge", charge, methods=["POST"]),
        ],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                routes=["/tools/*"],
                options=ServerOptions(lock_ttl=float(os.environ.get("AGENTKEY_FAULT_LEASE", "15"))),
                principal=lambda scope: "agent",
            )
        ],
    )
