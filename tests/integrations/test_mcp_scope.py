"""MCP: evidence and journal answers are scoped by what the client controls (issue 34).

Two unnamed MCP servers report the same name (``MCPServer("agentkey-test")`` here,
``mcp-server`` for every unnamed one, and a hostile server can claim any). Before,
evidence learnt on one server's tool applied to the other's: a lost answer of the
plain server's tool was resent and ran twice. Now the scope is the URL ``connect()``
opened (or ``server=``, or the session alone). Counted on the servers.
"""

from __future__ import annotations

import pytest
from mcp.shared.exceptions import MCPError

from agentkey import OutcomeUnknown, PlanSession, RetryPolicy
from agentkey.client._net import Origin
from agentkey.client._protocol import CallContext, ProtocolConfig, classify
from agentkey.integrations.mcp import IdempotentSession, connect
from agentkey.integrations.mcp._client import _reply_of
from agentkey.integrations.mcp._wire import refusal_data
from agentkey.journal import MemoryJournal
from agentkey.server import MemoryStore
from tests.integrations._mcp_app import running

pytestmark = pytest.mark.timeout(60)

FAST = RetryPolicy(max_attempts=4, deadline=20.0, initial_backoff=0.01, max_backoff=0.05)


async def test_evidence_of_one_server_never_counts_for_another_of_the_same_name() -> None:
    """A protected server's tool, then the same tool on a plain server that reports the same
    name and loses the answer: not resent, 1 execution (before: resent, 2)."""
    journal = MemoryJournal()
    with running(MemoryStore()) as protected, running(None) as plain:
        async with connect(protected.url + "/mcp") as s:
            tools = IdempotentSession(s, PlanSession.new(), policy=FAST, journal=journal)
            await tools.call_tool("create_vm", {"region": "eu-west-1"})
        plain.drop["create_vm"] = 1
        async with connect(plain.url + "/mcp") as s:
            tools = IdempotentSession(s, PlanSession.new(), policy=FAST, journal=journal)
            with pytest.raises(OutcomeUnknown):
                await tools.call_tool("create_vm", {"region": "eu-west-1"})
        assert plain.runs["create_vm"] == 1
        assert protected.runs["create_vm"] == 1


def test_an_in_doubt_refusal_is_outcome_unknown_at_once() -> None:
    """The MCP refusal kind in-doubt reads as agentkey's 409 in_doubt: final, OutcomeUnknown
    with the server's reason (before: an unknown kind, read as a refused key)."""
    error = MCPError(-32602, "the earlier call may have charged", refusal_data("in-doubt"))
    reply = _reply_of(error, [], "mcp://s/tools/charge")
    cfg = ProtocolConfig(Origin("mcp", "the MCP server", 0), frozenset({409, 503}))
    decision = classify(reply, CallContext("p:step_000:abc", "step_000", 1), cfg)
    assert isinstance(decision.error, OutcomeUnknown)
    assert "the earlier call may have charged" in str(decision.error)
    assert not decision.retry


async def test_a_tool_the_server_does_not_mark_is_never_resent() -> None:
    """The server protects delete_vm only: after delete_vm's answers showed the mark, a lost
    answer of create_vm is not resent (OutcomeUnknown, 1 execution); delete_vm's is.

    A regression guard: the evidence was already per tool, so this passed before too;
    test_an_unmarked_tools_unavailable_refusal_is_not_resent is the issue's discriminating case.
    """
    with running(MemoryStore(), tools=["delete_vm"]) as lab:
        async with connect(lab.url + "/mcp") as s:
            tools = IdempotentSession(s, PlanSession.new(), policy=FAST, journal=MemoryJournal())
            await tools.call_tool("delete_vm", {"region": "eu-west-1"})
            lab.drop["create_vm"] = 1
            with pytest.raises(OutcomeUnknown):
                await tools.call_tool("create_vm", {"region": "eu-west-1"})
            lab.drop["delete_vm"] = 1
            again = await tools.call_tool("delete_vm", {"region": "eu-west-2"})
        assert lab.runs["create_vm"] == 1
        assert lab.runs["delete_vm"] == 2  # two calls, each once
    assert again.replayed


async def test_an_unmarked_tools_unavailable_refusal_is_not_resent() -> None:
    """The server protects delete_vm only; forward_charge, a plain tool, charges and then
    passes on a downstream bare "unavailable" refusal: not resent (OutcomeUnknown),
    1 execution (before: read as "nothing ran" from any tool, resent, 2 executions)."""
    with running(MemoryStore(), tools=["delete_vm"]) as lab:
        async with connect(lab.url + "/mcp") as s:
            tools = IdempotentSession(s, PlanSession.new(), policy=FAST, journal=MemoryJournal())
            await tools.call_tool("delete_vm", {"region": "eu-west-1"})
            with pytest.raises(OutcomeUnknown):
                await tools.call_tool("forward_charge", {"amount": 5})
        assert lab.runs["forward_charge"] == 1


def test_an_unavailable_refusal_reads_as_not_run_only_with_the_protected_marker() -> None:
    """agentkey's own unavailable refusal carries the protected marker and reads as 503
    not_run; the bare kind (no marker) reads as a 503 that may have run."""
    cfg = ProtocolConfig(Origin("mcp", "the MCP server", 0), frozenset({409, 503}))
    ctx = CallContext("p:step_000:abc", "step_000", 1)
    marked = MCPError(-32603, "store down", refusal_data("unavailable"))
    bare = MCPError(-32603, "store down", {"type": "io.agentkey/unavailable"})
    assert classify(_reply_of(marked, [], "mcp://s/tools/charge"), ctx, cfg).not_run
    decision = classify(_reply_of(bare, [], "mcp://s/tools/charge"), ctx, cfg)
    assert not decision.not_run
    assert decision.in_doubt
