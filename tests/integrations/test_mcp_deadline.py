"""MCP client: a reconnect spends the call's deadline, and a read can go past the journal
(issue 37, item 2).

Real servers: the SDK's streamable HTTP app under uvicorn on loopback, stopped and started
again on the same port; executions counted on the server.
"""

from __future__ import annotations

import functools
import uuid
from contextlib import AbstractContextManager, ExitStack

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
from mcp import Client

from agentkey import ConfigurationError, OutcomeUnknown, PlanSession, RetryPolicy
from agentkey.integrations.mcp import IdempotentSession, MCPToolResult, connect
from agentkey.journal import MemoryJournal
from agentkey.server import MemoryStore, RedisStore
from agentkey.testing import FakeClock
from tests._loopback import RedisServer
from tests.integrations._mcp_app import Lab, running

pytestmark = pytest.mark.timeout(60)


def text_of(got: MCPToolResult) -> str:
    return str(getattr(got.result.content[0], "text", ""))


@pytest.mark.realtime
async def test_a_call_waits_for_its_server_to_come_back_and_gets_the_real_answer(
    redis_proc: RedisServer,
) -> None:
    """The tool runs, its answer is lost and the server goes down, is stopped, then started
    again on the same port: the session keeps asking tools/list (with backoff, within the
    deadline) until the server is back, resends the key and gets the stored answer: one
    execution (before: two tries within ~50 ms, then OutcomeUnknown)."""
    prefix = f"mcp{uuid.uuid4().hex[:10]}"
    lab = Lab(down_after_drop=True)
    lab.drop["create_vm"] = 1
    with ExitStack() as servers:
        first: AbstractContextManager[Lab] = running(RedisStore(redis_proc.url, prefix=prefix), lab)
        servers.enter_context(first)
        port = int(lab.url.rsplit(":", 1)[1])
        phases: list[str] = []

        def stop() -> None:
            servers.close()  # the first server, really stopped: its port refuses connections
            phases.append("stopped")

        def start() -> None:
            store = RedisStore(redis_proc.url, prefix=prefix)  # the same records
            servers.enter_context(running(store, lab, port=port))
            phases.append("started")

        class Restarting(FakeClock):
            """The session's clock: its second wait while the server is down stops the
            server, its fourth starts it again."""

            waits_while_down = 0

            async def asleep(self, seconds: float) -> None:
                if lab.down or phases == ["stopped"]:
                    self.waits_while_down += 1
                    if self.waits_while_down == 2:
                        await anyio.to_thread.run_sync(stop)
                    elif self.waits_while_down == 4:
                        await anyio.to_thread.run_sync(start)
                await super().asleep(seconds)

        policy = RetryPolicy(max_attempts=4, deadline=30.0, initial_backoff=0.02, max_backoff=0.1)
        factory = functools.partial(Client, f"http://127.0.0.1:{port}/mcp")
        clock = Restarting()
        async with IdempotentSession(factory, PlanSession.new(), policy=policy, clock=clock) as s:
            got = await s.call_tool("create_vm", {"region": "eu-west-1"})
        assert lab.runs["create_vm"] == 1
    assert phases == ["stopped", "started"]
    assert got.replayed
    assert got.attempts == 2
    assert got.result.structured_content == {"id": "vm-1", "region": "eu-west-1", "size": 1}


async def test_a_server_that_stays_down_is_asked_until_the_deadline() -> None:
    """The server never comes back: the check is repeated, with backoff, until the call's
    deadline on the session's own clock (no real time waited), then OutcomeUnknown (before:
    given up after 0.05 s of a 40 s deadline)."""
    clock = FakeClock()
    lab = Lab(down_after_drop=True)
    lab.drop["create_vm"] = 1
    policy = RetryPolicy(max_attempts=4, deadline=40.0, initial_backoff=0.5, max_backoff=5.0)
    with running(MemoryStore(), lab) as lab:
        factory = functools.partial(Client, lab.url + "/mcp")
        tools = IdempotentSession(factory, PlanSession.new(), policy=policy, clock=clock)
        async with tools:
            with pytest.raises(OutcomeUnknown):
                await tools.call_tool("create_vm", {"region": "eu-west-1"})
    assert sum(clock.sleeps) >= 40.0 - 1e-6  # the whole deadline was spent waiting for it
    assert lab.runs["create_vm"] == 1


async def test_a_read_let_through_the_journal_reads_the_servers_value() -> None:
    """After a restart, lookup with journal=False reads the server's current value (the tool
    runs); without it, the journal answers with the value kept from the first run, as
    documented (before: no per-call way past the journal)."""
    kept_calls = MemoryJournal()
    plan_id = str(uuid.uuid4())
    args = {"name": "price"}
    with running(None) as lab:
        lab.values["price"] = "10"

        async def run(journal: bool = True) -> MCPToolResult:
            async with connect(lab.url + "/mcp") as s:  # a new process, the same plan
                tools = IdempotentSession(
                    s, PlanSession(id=plan_id), journal=kept_calls, server="s"
                )
                return await tools.call_tool("lookup", args, journal=journal)

        first = await run()
        lab.values["price"] = "12"
        fresh = await run(journal=False)
        kept = await run()
        assert lab.runs["lookup"] == 2
    assert (text_of(first), first.source) == ("10", "tool")
    assert (text_of(fresh), fresh.source, fresh.replayed) == ("12", "tool", False)
    assert (text_of(kept), kept.source) == ("10", "journal")
    assert fresh.idempotency_key == first.idempotency_key  # the same call, read again


async def test_journal_takes_only_true_or_false() -> None:
    """journal= on one call is True or False: anything else is a ConfigurationError."""
    with running(None) as lab:
        async with connect(lab.url + "/mcp") as s:
            tools = IdempotentSession(s, PlanSession.new(), journal=MemoryJournal())
            with pytest.raises(ConfigurationError, match="journal"):
                await tools.call_tool("lookup", {"name": "x"}, journal="off")  # type: ignore[arg-type]
        assert lab.runs["lookup"] == 0


async def test_a_read_let_through_the_journal_of_a_protected_tool_is_replayed_by_its_server() -> (
    None
):
    """journal=False skips only the client's journal: the key is the same, so a tool the
    server protects answers with the result it stored for that key (as documented)."""
    plan_id = str(uuid.uuid4())
    with running(MemoryStore()) as lab:
        lab.values["price"] = "10"
        async with connect(lab.url + "/mcp") as s:
            first = await IdempotentSession(
                s, PlanSession(id=plan_id), journal=MemoryJournal()
            ).call_tool("lookup", {"name": "price"})
            lab.values["price"] = "12"
            again = await IdempotentSession(
                s, PlanSession(id=plan_id), journal=MemoryJournal()
            ).call_tool("lookup", {"name": "price"}, journal=False)
        assert lab.runs["lookup"] == 1
    assert (text_of(first), text_of(again)) == ("10", "10")
    assert (again.source, again.replayed) == ("tool", True)
