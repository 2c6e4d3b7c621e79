"""The MCP middleware's key spaces and size cap (issue 24), and its one settle (issue 27 §2).

Key spaces are proven over the SDK's streamable HTTP under uvicorn on loopback,
with the SDK's own OAuth layer where a caller is authenticated; executions are
counted on the server.
"""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any, cast

import anyio
import pytest
from mcp import Client
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import RequestParamsMeta

from agentkey import ConfigurationError, PlanSession, TokenRejected
from agentkey.auth import StaticToken
from agentkey.integrations.mcp import IdempotentSession, IdempotentToolsMiddleware, connect
from agentkey.integrations.mcp._wire import KEY_FIELD, REPLAYED_FIELD
from agentkey.server import MemoryStore, ServerOptions, current_claim
from agentkey.server import _lifecycle as lifecycle_module
from tests._loopback import serve
from tests.integrations._mcp_app import running

pytestmark = pytest.mark.timeout(60)

_CALLERS = {"tk-alice": "alice", "tk-bob": "bob"}


class _Verifier:
    """The SDK's token verifier interface: two known bearer tokens, two subjects."""

    async def verify_token(self, token: str) -> AccessToken | None:
        subject = _CALLERS.get(token)
        if subject is None:
            return None
        return AccessToken(token=token, client_id="agents", scopes=[], subject=subject)


def _tools(runs: Counter[str], middleware: IdempotentToolsMiddleware, **server: Any) -> MCPServer:
    mcp: MCPServer[Any] = MCPServer("security", middleware=[middleware], **server)

    @mcp.tool()
    def charge(amount: int) -> str:
        """A charge: a side effect that must happen once."""
        runs["charge"] += 1
        return f"charged {amount} (run {runs['charge']})"

    @mcp.tool()
    def export(size: int) -> str:
        """A large result."""
        current_claim().begin_mutation()
        runs["export"] += 1
        return "e" * size

    return mcp


def test_principal_and_a_shared_key_space_together_are_refused() -> None:
    """principal= and shared_key_space=True contradict each other: ConfigurationError."""
    with pytest.raises(ConfigurationError, match="not both"):
        IdempotentToolsMiddleware(MemoryStore(), principal=lambda ctx: "t", shared_key_space=True)
    with pytest.raises(ConfigurationError, match="shared_key_space"):
        IdempotentToolsMiddleware(MemoryStore(), shared_key_space="yes")  # type: ignore[arg-type]


async def test_without_oauth_sessions_do_not_share_a_key_space() -> None:
    """No OAuth and no principal: a keyed call is refused (nothing runs); the client says why."""
    with running(MemoryStore(), shared_key_space=False) as lab:
        async with connect(lab.url + "/mcp") as s:
            tools = IdempotentSession(s, PlanSession.new())
            with pytest.raises(TokenRejected, match="not authenticated") as caught:
                await tools.call_tool("create_vm", {"region": "eu-west-1"})
            meta = cast(RequestParamsMeta, {KEY_FIELD: caught.value.idempotency_key})
            with pytest.raises(MCPError) as raw:
                await s.call_tool("create_vm", {"region": "eu-west-1"}, meta=meta)
        assert lab.runs["create_vm"] == 0
    assert raw.value.error.data == {"type": "io.agentkey/unauthenticated"}


async def test_each_oauth_caller_has_a_key_space_of_its_own() -> None:
    """With the SDK's OAuth, one key from two verified callers runs once per caller."""
    runs: Counter[str] = Counter()
    middleware = IdempotentToolsMiddleware(MemoryStore())
    auth = AuthSettings(
        issuer_url="https://login.example.com",
        resource_server_url="http://127.0.0.1/mcp",
        validate_token_resource=False,  # the verifier above stands for the audience check
    )
    server = _tools(runs, middleware, token_verifier=_Verifier(), auth=auth)
    plan_id = str(uuid.uuid4())
    replayed: dict[str, list[bool]] = {}
    with serve(server.streamable_http_app(), lifespan="on") as url:
        for token in ("tk-alice", "tk-bob", "tk-alice"):
            async with connect(url + "/mcp", auth=StaticToken(token)) as s:
                got = await IdempotentSession(s, PlanSession(id=plan_id)).call_tool(
                    "charge", {"amount": 5}, step=0
                )
            replayed.setdefault(token, []).append(got.replayed)
    assert replayed == {"tk-alice": [False, True], "tk-bob": [False]}
    assert runs["charge"] == 2


async def test_a_result_over_the_cap_is_returned_once_and_never_stored() -> None:
    """Over max_recorded_bytes: the first call gets it, a resend an isError result, one run."""
    runs: Counter[str] = Counter()
    middleware = IdempotentToolsMiddleware(
        MemoryStore(),
        shared_key_space=True,
        options=ServerOptions(max_recorded_bytes=64 * 1024),
    )
    async with Client(_tools(runs, middleware)) as client:
        tools = IdempotentSession(client.session, PlanSession.new())
        first = await tools.call_tool("export", {"size": 200_000}, step=0)
        again = await tools.call_tool("export", {"size": 200_000}, step=0)
    assert not first.result.is_error
    assert len(first.result.content[0].text) == 200_000  # type: ignore[union-attr]
    assert again.replayed
    assert again.result.is_error
    assert "max_recorded_bytes" in again.result.content[0].text  # type: ignore[union-attr]
    assert (again.result.meta or {})[REPLAYED_FIELD] is True
    assert runs["export"] == 1


class _SlowFinish(MemoryStore):
    """A MemoryStore whose first finish hangs until cancelled."""

    def __init__(self) -> None:
        super().__init__()
        self.finishes = 0
        self.waiting = anyio.Event()

    async def finish(self, key: str, owner: str, value: bytes, *, ttl_ms: int) -> bool:
        self.finishes += 1
        if self.finishes == 1:
            self.waiting.set()
            await anyio.sleep_forever()
        return await super().finish(key, owner, value, ttl_ms=ttl_ms)


async def test_a_cancelled_tool_call_still_records_its_outcome_through_the_shared_settle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cancelled while its result is written, an MCP call writes it again, shielded, once."""
    monkeypatch.setattr(lifecycle_module, "SETTLE_SECONDS", 5.0)
    store = _SlowFinish()
    runs: Counter[str] = Counter()
    middleware = IdempotentToolsMiddleware(store, shared_key_space=True)
    async with Client(_tools(runs, middleware)) as client:
        tools = IdempotentSession(client.session, PlanSession.new())
        planned = tools.step_for("charge", {"amount": 7})
        async with anyio.create_task_group() as group:
            group.start_soon(tools.call_step, planned)
            await store.waiting.wait()
            group.cancel_scope.cancel()
        again = await tools.call_step(planned)  # the same call, sent again
    assert store.finishes == 2  # the interrupted write, then the shielded one
    assert again.replayed
    assert runs["charge"] == 1
