"""MCP: a tool that may have started and failed leaves its key in doubt; reconcile settles it.

A real MCP server (the SDK's streamable HTTP app under uvicorn on loopback) behind
IdempotentToolsMiddleware; calls go through the SDK's client with the key in ``_meta``;
executions are counted on the server.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, cast

import pytest
from mcp import ClientSession
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, RequestParamsMeta

from agentkey import StoreUnavailable
from agentkey.integrations.mcp import IdempotentToolsMiddleware, connect
from agentkey.integrations.mcp._wire import KEY_FIELD, PROTECTED_FIELD, REPLAYED_FIELD
from agentkey.server import MemoryStore, ReconcileContext, Reconciled, current_claim
from tests._loopback import serve
from tests.server._util import with_options

pytestmark = pytest.mark.timeout(60)


@contextmanager
def _server(store: MemoryStore | None = None, **options: Any) -> Iterator[tuple[str, Counter[str]]]:
    runs: Counter[str] = Counter()
    store = MemoryStore() if store is None else store
    middleware = IdempotentToolsMiddleware(store, shared_key_space=True, **with_options(options))
    server: MCPServer[Any] = MCPServer("in-doubt-test", middleware=[middleware])

    @server.tool()
    def charge(amount: int) -> str:
        """Charges, then the ledger write fails (no begin_mutation)."""
        runs["charge"] += 1
        raise RuntimeError("the ledger write failed after the charge")

    @server.tool()
    def refuse(amount: int) -> str:
        """Fails before anything happened, and says so."""
        runs["refuse"] += 1
        current_claim().nothing_started()
        raise RuntimeError("the card was declined before any charge")

    with serve(server.streamable_http_app(), lifespan="on") as url:
        yield url, runs


@asynccontextmanager
async def _session(url: str) -> AsyncIterator[ClientSession]:
    async with connect(url + "/mcp") as s:
        yield s


async def _call(s: ClientSession, name: str, key: str) -> CallToolResult:
    meta = cast(RequestParamsMeta, {KEY_FIELD: key})
    return await s.call_tool(name, {"amount": 5}, meta=meta)


async def test_a_tool_that_failed_after_it_may_have_started_is_in_doubt() -> None:
    """The tool charged and raised: its error result once, then every call with the key is
    refused as "in-doubt" and the tool never runs again (2 charges on the old code)."""
    key = f"ik_{uuid.uuid4().hex}"
    with _server() as (url, runs):
        async with _session(url) as s:
            first = await _call(s, "charge", key)
            refusals = []
            for _ in range(2):
                with pytest.raises(MCPError) as caught:
                    await _call(s, "charge", key)
                refusals.append(caught.value)
    assert first.is_error
    assert runs["charge"] == 1
    for refusal in refusals:
        # Marked protected: the tool itself refuses (the old code sent no mark).
        assert refusal.error.data == {"type": "io.agentkey/in-doubt", PROTECTED_FIELD: True}
        assert "may have started" in refusal.error.message
        assert "Idempotency-Key" not in refusal.error.message


class _DownStore(MemoryStore):
    async def claim(self, key: str, value: bytes, *, ttl_ms: int) -> bytes | None:
        raise StoreUnavailable("the store is down (test)")


async def test_an_unavailable_refusal_is_marked_protected() -> None:
    """The store is down: the tool does not run, and the "unavailable" refusal carries the
    protected mark, so a client believes its "nothing ran" (the old code sent no mark)."""
    with _server(_DownStore()) as (url, runs):
        async with _session(url) as s:
            with pytest.raises(MCPError) as caught:
                await _call(s, "charge", f"ik_{uuid.uuid4().hex}")
    assert runs["charge"] == 0
    data = caught.value.error.data
    assert isinstance(data, dict)
    assert data["type"] == "io.agentkey/unavailable"
    assert data[PROTECTED_FIELD] is True


async def test_a_tool_that_says_nothing_started_is_released() -> None:
    """nothing_started() then a failure: the key is free, the retry runs the tool again."""
    key = f"ik_{uuid.uuid4().hex}"
    with _server() as (url, runs):
        async with _session(url) as s:
            assert (await _call(s, "refuse", key)).is_error
            assert (await _call(s, "refuse", key)).is_error
    assert runs["refuse"] == 2


async def test_reconcile_answers_for_a_tool_in_doubt() -> None:
    """reconcile says it ran: its result is recorded and replayed (the tool runs once)."""
    asked: list[ReconcileContext] = []

    async def reconcile(context: ReconcileContext) -> Reconciled:
        asked.append(context)
        text = "charged 5 (ledger)"  # the tool's result, as MCPServer would have built it
        content = [{"type": "text", "text": text}]
        return Reconciled.ran({"content": content, "structuredContent": {"result": text}})

    key = f"ik_{uuid.uuid4().hex}"
    with _server(reconcile=reconcile) as (url, runs):
        async with _session(url) as s:
            await _call(s, "charge", key)
            second = await _call(s, "charge", key)
            third = await _call(s, "charge", key)
    assert runs["charge"] == 1
    for got in (second, third):
        assert not got.is_error
        assert got.content[0].text == "charged 5 (ledger)"  # type: ignore[union-attr]
        assert (got.meta or {}).get(REPLAYED_FIELD) is True
    assert len(asked) == 1
    assert (asked[0].method, asked[0].route) == ("tools/call", "charge")
    assert asked[0].json() == {"amount": 5}
