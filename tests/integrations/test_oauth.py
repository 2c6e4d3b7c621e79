"""OAuth configured in code flows through LangGraph tools: a real loopback IdP and tool."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from langchain_core.messages import AIMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver

from agentkey import AsyncToolInvoker, ToolInvoker
from agentkey.auth import ClientCredentials
from tests._loopback import serve
from tests.auth._idp import IdP
from tests.integrations._graph import (
    DRIVERS,
    FAST,
    Driver,
    build_graph,
    call,
    close,
    run,
    scripted,
    tool_messages,
    tools_for,
)

pytestmark = pytest.mark.timeout(60)

CLIENT_ID = "graph-agent"
CLIENT_SECRET = "graph-client-secret-77"


@pytest.fixture
def idp() -> Iterator[IdP]:
    """A fresh identity provider whose /tool needs a valid bearer token."""
    provider = IdP(clients={CLIENT_ID: CLIENT_SECRET})
    with serve(provider.app()) as url:
        provider.url = url
        yield provider


@pytest.mark.parametrize("driver", DRIVERS)
async def test_rejected_token_is_renewed_and_the_same_key_resent(driver: Driver, idp: IdP) -> None:
    """A 401 mid-graph renews the token and resends the same key; no secret reaches the state."""
    auth = ClientCredentials(idp.url + "/token", CLIENT_ID, CLIENT_SECRET)
    cls = ToolInvoker if driver == "sync" else AsyncToolInvoker
    invoker = cls(idp.url, auth=auth, routes={"charge": "/tool"}, retry=FAST, hooks=())
    idp.force_401 = 1  # the tool refuses the first, still valid, token once
    model = scripted(AIMessage("", tool_calls=[call("charge", "c1", amount=5)]), AIMessage("ok"))
    saver = InMemorySaver()
    graph = build_graph(tools_for(invoker), model, checkpointer=saver)
    config: RunnableConfig = {"configurable": {"thread_id": f"oauth-{driver}"}}
    final = await run(driver, graph, {"messages": []}, config)
    await close(invoker)

    (message,) = tool_messages(final)
    (first_key, first_auth, first_body), (second_key, second_auth, body) = idp.tool_requests
    assert first_key == second_key == message.artifact["idempotency_key"]
    assert first_auth != second_auth
    assert first_body == body == b'{"amount":5,"currency":"usd","region":"eu-west-1"}'
    assert idp.hits["client_credentials"] == 2
    assert '"ok": true' in message.content
    checkpoint = repr(saver.get_tuple(config))
    tokens = [header[7:] for header in (first_auth, second_auth) if header]
    assert len(tokens) == 2
    for secret in (CLIENT_SECRET, *tokens):
        assert secret not in checkpoint
