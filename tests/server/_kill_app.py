"""The tool server the kill tests SIGKILL (``uvicorn --factory tests.server._kill_app:app``).

One tool, ``POST /tools/charge`` with ``{"n": <step>}``, behind IdempotencyMiddleware
(default settings: the side effect may have started as soon as the handler runs). Its
process kills itself (SIGKILL) once, at the point named by the file ``<kills>/<n>``
(deleted first, so a retry never dies there). Configured by environment:

- ``AK_KILL_STORE``: the store URL (``redis://`` or ``postgresql://``);
- ``AK_KILL_MODE``: ``plain`` (the side effect is a line appended, and fsynced, to the
  ledger file ``AK_KILL_LEDGER``) or ``transactional`` (a row in ``kill_tx_charges``,
  committed with the record by ``PostgresStore.transaction``);
- ``AK_KILL_POINTS``: the directory of kill files; ``AK_KILL_LEASE``: ``lock_ttl``;
- ``AK_KILL_RECONCILE=1``: the middleware's ``reconcile`` hook looks the key up in the
  ledger (or the charges table): found, it ran (its answer replayed); else it did not.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentkey.server import (
    IdempotencyMiddleware,
    PostgresStore,
    ReconcileContext,
    Reconciled,
    RedisStore,
    ServerOptions,
    Store,
    current_claim,
)

PLAIN_POINTS = ("before_effect", "after_effect", "after_effect_later")
TX_POINTS = ("before_tx", "after_insert", "before_commit", "after_commit")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _take(points: Path, n: int) -> str | None:
    """The kill point of step ``n``, used once."""
    path = points / str(n)
    try:
        point = path.read_text()
        path.unlink()
    except FileNotFoundError:
        return None
    return point


def _ledger_entry(ledger: Path, key: str) -> str | None:
    if not ledger.exists():
        return None
    for line in ledger.read_text().splitlines():
        k, _, run = line.partition(" ")
        if k == key:
            return run
    return None


def app() -> Starlette:
    url = os.environ["AK_KILL_STORE"]
    mode = os.environ["AK_KILL_MODE"]
    points = Path(os.environ["AK_KILL_POINTS"])
    ledger = Path(os.environ.get("AK_KILL_LEDGER", "/dev/null"))
    store: Store
    if url.startswith("redis"):
        store = RedisStore(url, prefix="kills")
    else:
        store = PostgresStore(url, table="kill_server_records")
    pg = store if isinstance(store, PostgresStore) else None

    async def charge(request: Request) -> Response:
        args = await request.json()
        claim = current_claim()
        point = _take(points, int(args["n"]))
        if mode == "plain":
            if point == "before_effect":
                _die()
            run = uuid.uuid4().hex[:12]
            fd = os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, f"{claim.idempotency_key} {run}\n".encode("ascii"))
                os.fsync(fd)
            finally:
                os.close(fd)
            if point == "after_effect":
                _die()
            await asyncio.sleep(0.05)
            if point == "after_effect_later":
                _die()
            return JSONResponse({"exec": run}, 201)
        assert pg is not None
        if point == "before_tx":
            _die()
        async with pg.transaction(claim) as tx:
            cur = await tx.connection.execute(
                "INSERT INTO kill_tx_charges (step) VALUES (%s) RETURNING id",
                (claim.idempotency_key,),
            )
            row = await cur.fetchone()
            assert row is not None
            if point == "after_insert":
                _die()
            response = await tx.complete(JSONResponse({"exec": str(row[0])}, 201))
            if point == "before_commit":
                _die()
        if point == "after_commit":
            _die()
        return response

    async def reconcile(context: ReconcileContext) -> Reconciled:
        if mode == "plain":
            run = _ledger_entry(ledger, context.idempotency_key)
        else:
            import psycopg

            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                cur = await conn.execute(
                    "SELECT id FROM kill_tx_charges WHERE step = %s", (context.idempotency_key,)
                )
                found = await cur.fetchone()
            run = None if found is None else str(found[0])
        if run is None:
            return Reconciled.not_run()
        return Reconciled.ran({"exec": run}, status=201)

    options: dict[str, Any] = {}
    if os.environ.get("AK_KILL_RECONCILE") == "1":
        options["reconcile"] = reconcile
    return Starlette(
        routes=[Route("/tools/charge", charge, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                routes=["/tools/*"],
                options=ServerOptions(lock_ttl=float(os.environ.get("AK_KILL_LEASE", "1.0"))),
                shared_key_space=True,
                **options,
            )
        ],
    )


def mcp_app() -> Any:
    """The same tool over MCP (``charge(n)``) behind IdempotentToolsMiddleware (Redis or
    PostgreSQL, by the URL)."""
    from mcp.server.mcpserver import MCPServer

    from agentkey.integrations.mcp import IdempotentToolsMiddleware

    points = Path(os.environ["AK_KILL_POINTS"])
    ledger = Path(os.environ["AK_KILL_LEDGER"])
    url = os.environ["AK_KILL_STORE"]
    store: Store = (
        RedisStore(url, prefix="mcpkills")
        if url.startswith("redis")
        else PostgresStore(url, table="kill_server_records")
    )

    async def reconcile(context: ReconcileContext) -> Reconciled:
        run = _ledger_entry(ledger, context.idempotency_key)
        if run is None:
            return Reconciled.not_run()
        return Reconciled.ran(
            {"content": [{"type": "text", "text": run}], "structuredContent": {"result": run}}
        )

    options: dict[str, Any] = {}
    if os.environ.get("AK_KILL_RECONCILE") == "1":
        options["reconcile"] = reconcile
    middleware = IdempotentToolsMiddleware(
        store,
        shared_key_space=True,
        options=ServerOptions(lock_ttl=float(os.environ.get("AK_KILL_LEASE", "1.0"))),
        **options,
    )
    server: MCPServer[Any] = MCPServer("kills", middleware=[middleware])

    @server.tool()
    async def charge(n: int) -> str:
        """Charges once per key; its process dies where the kill file says."""
        claim = current_claim()
        point = _take(points, n)
        if point == "before_effect":
            _die()
        run = uuid.uuid4().hex[:12]
        fd = os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{claim.idempotency_key} {run}\n".encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
        if point == "after_effect":
            _die()
        await asyncio.sleep(0.05)
        if point == "after_effect_later":
            _die()
        return run

    return server.streamable_http_app()
