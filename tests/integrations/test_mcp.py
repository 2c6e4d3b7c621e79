"""MCP end to end: IdempotentSession against IdempotentToolsMiddleware over real streamable HTTP.

Every server is the SDK's own streamable HTTP app under uvicorn on loopback;
executions are counted on the server.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any, cast

import anyio
import anyio.to_thread
import pytest
from mcp import Client, ClientSession
from mcp.server.context import ServerRequestContext
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, RequestParamsMeta

from agentkey import (
    KeyReused,
    OutcomeUnknown,
    PayloadMismatch,
    PlanSession,
    RetryPolicy,
    Step,
    StepInProgress,
    TokenRejected,
    canonical_json,
)
from agentkey.auth import ClientCredentials, TokenProvider
from agentkey.client._hooks import CallEndEvent, InvokeEvent
from agentkey.integrations.mcp import IdempotentSession, MCPToolResult, connect
from agentkey.integrations.mcp._wire import KEY_FIELD, PROTECTED_FIELD, REPLAYED_FIELD
from agentkey.server import MemoryStore, RedisStore, Store
from agentkey.testing import FakeClock
from tests._loopback import RedisServer
from tests.integrations._mcp_app import Lab, running
from tests.server._util import FailingFinish

pytestmark = pytest.mark.timeout(60)

FAST = RetryPolicy(max_attempts=4, deadline=20.0, initial_backoff=0.01, max_backoff=0.05)


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest, redis_proc: RedisServer) -> Iterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
    else:
        yield RedisStore(redis_proc.url, prefix=f"mcp{uuid.uuid4().hex[:10]}")


@asynccontextmanager
async def session(lab: Lab, auth: TokenProvider | None = None) -> AsyncIterator[ClientSession]:
    async with connect(lab.url + "/mcp", auth=auth) as s:
        yield s


async def raw_call(
    s: ClientSession, name: str, args: dict[str, Any], key: object = None
) -> CallToolResult:
    """A plain SDK call, the key (if any) set by hand in ``_meta``."""
    meta = None if key is None else cast(RequestParamsMeta, {KEY_FIELD: key})
    return await s.call_tool(name, args, meta=meta)


def text_of(got: MCPToolResult) -> str:
    block = got.result.content[0]
    return str(getattr(block, "text", ""))


async def test_answer_lost_after_commit_is_replayed(store: Store) -> None:
    """A tools/call answer lost after the tool ran is resent with the same key and replayed."""
    events: list[InvokeEvent] = []

    def record(event: InvokeEvent) -> None:
        events.append(event)

    with running(store) as lab:
        lab.drop["create_vm"] = 1
        async with session(lab) as s:
            tools = IdempotentSession(s, PlanSession.new(), policy=FAST, hooks=[record])
            got = await tools.call_tool("create_vm", {"region": "eu-west-1", "size": 2})
        assert lab.runs["create_vm"] == 1
    assert got.replayed
    assert got.attempts == 2
    assert [type(e).__name__ for e in events] == [
        "CallStartEvent",
        "AttemptEvent",
        "RetryEvent",
        "AttemptEvent",
        "ReplayEvent",
        "CallEndEvent",
    ]
    assert {e.idempotency_key for e in events} == {got.idempotency_key}
    assert isinstance(events[-1], CallEndEvent)
    assert events[-1].outcome == "replayed"
    assert got.result.structured_content == {"id": "vm-1", "region": "eu-west-1", "size": 2}
    assert got.result.meta == {REPLAYED_FIELD: True, PROTECTED_FIELD: True}


async def test_session_torn_down_by_a_reset_is_reopened_and_replayed() -> None:
    """2026-07-28 protocol: a reset ends the SDK session; a new one resends the key and replays."""
    with running(MemoryStore()) as lab:
        lab.drop["create_vm"] = 1
        factory = functools.partial(Client, lab.url + "/mcp")
        async with IdempotentSession(factory, PlanSession.new(), policy=FAST) as tools:
            assert (await tools.session()).protocol_version == "2026-07-28"
            got = await tools.call_tool("create_vm", {"region": "me-south-1"})
            after = await tools.call_tool("create_vm", {"region": "me-south-2"})
        assert lab.runs["create_vm"] == 2
    assert got.replayed
    assert got.attempts == 2
    assert not after.replayed


async def test_without_the_middleware_a_lost_answer_is_not_sent_again() -> None:
    """Issue 25: a server without the middleware does not honour the key, so a lost answer is
    not resent (that resend ran the tool twice): OutcomeUnknown, the tool ran once."""
    with running(None) as lab:
        lab.drop["create_vm"] = 1
        async with session(lab) as s:
            tools = IdempotentSession(s, PlanSession.new(), policy=FAST)
            with pytest.raises(OutcomeUnknown, match="did not send it again"):
                await tools.call_tool("create_vm", {"region": "eu-west-1"})
    assert lab.runs["create_vm"] == 1


@pytest.mark.realtime
async def test_a_stalled_tools_list_probe_ends_at_the_deadline() -> None:
    """After a lost answer the client asks tools/list whether the tool is protected; a server
    that never answers that question cannot hold the call past its deadline."""
    with running(None) as lab:
        lab.drop["create_vm"] = 1
        lab.stall_list = True
        try:
            async with session(lab) as s:
                policy = RetryPolicy(max_attempts=4, deadline=2.0, initial_backoff=0.01)
                tools = IdempotentSession(s, PlanSession.new(), policy=policy)
                with anyio.fail_after(15), pytest.raises(OutcomeUnknown):
                    await tools.call_tool("create_vm", {"region": "eu-west-1"})
        finally:
            lab.gate.set()
    assert lab.runs["create_vm"] == 1


async def test_a_tool_the_server_does_not_protect_is_not_resent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 23, case 9: the middleware protects only other tools; the called tool's result
    says nothing of the key, so its lost answer is not resent, and no log line promises that
    it runs at most once."""
    with running(MemoryStore(), tools=["delete_vm"]) as lab:
        lab.drop["create_vm"] = 1
        async with session(lab) as s:
            tools = IdempotentSession(s, PlanSession.new(), policy=FAST)
            with pytest.raises(OutcomeUnknown):
                await tools.call_tool("create_vm", {"region": "eu-west-1"})
            unprotected = await tools.call_tool("create_vm", {"region": "eu-west-2"})
            protected = await tools.call_tool("delete_vm", {"region": "eu-west-2"})
    assert lab.runs["create_vm"] == 2  # the lost one once, the second call once
    assert PROTECTED_FIELD not in (unprotected.result.meta or {})
    assert (protected.result.meta or {}).get(PROTECTED_FIELD) is True
    assert "at most once" not in caplog.text


async def test_the_journal_answers_a_repeated_step_of_an_unprotected_tool() -> None:
    """A step that an unprotected tool answered is answered again from the journal, with its
    source said, and the tool is not called a second time."""
    with running(None) as lab:
        async with session(lab) as s:
            tools = IdempotentSession(s, PlanSession.new(), policy=FAST)
            first = await tools.call_tool("create_vm", {"region": "eu-west-3"}, step=7)
            again = await tools.call_tool("create_vm", {"region": "eu-west-3"}, step=7)
    assert lab.runs["create_vm"] == 1
    assert (first.source, again.source) == ("tool", "journal")
    assert again.replayed
    assert text_of(again) == text_of(first)


async def test_a_tool_slower_than_the_attempt_timeout_runs_once() -> None:
    """Issue 23, case 8: the client gives up on an attempt while the tool runs; the server
    lets the tool finish (it is not cancelled half-way) and records it, so the resend waits
    for it and gets the replay: one execution, and a result."""
    with running(MemoryStore(), retry_after=0) as lab:
        async with session(lab) as s:
            tools = IdempotentSession(
                s, PlanSession.new(), policy=FAST.replace(max_attempts=50), attempt_timeout=0.1
            )
            got = await tools.call_tool("slow_charge", {"amount": 5})
    assert lab.runs["slow_charge"] == 1
    assert got.replayed
    assert text_of(got) == "charged 5"


async def test_a_restarted_session_reading_first_keeps_the_charges_key(store: Store) -> None:
    """Issue 23, case 10: without step=, a call's key is its tool and its number among the
    identical calls before it, so a restarted process that makes a read call first still
    gives the charge its first key: one execution."""
    plan_id = str(uuid.uuid4())
    with running(store) as lab:
        async with session(lab) as s:
            first = IdempotentSession(s, PlanSession(id=plan_id))
            charged = await first.call_tool("create_vm", {"region": "ap-east-1"})
        async with session(lab) as s:  # the restarted process
            again = IdempotentSession(s, PlanSession(id=plan_id))
            await again.call_tool("delete_vm", {"region": "elsewhere"})  # a call first
            replayed = await again.call_tool("create_vm", {"region": "ap-east-1"})
            twice = await again.call_tool("create_vm", {"region": "ap-east-1"})  # meant twice
        assert lab.runs["create_vm"] == 2
    assert replayed.idempotency_key == charged.idempotency_key
    assert replayed.replayed
    assert twice.idempotency_key != charged.idempotency_key
    assert not twice.replayed


async def test_same_step_after_restart_replays_without_running(store: Store) -> None:
    """A restarted orchestrator (same plan id, same step) gets the stored result; nothing reruns."""
    plan_id = str(uuid.uuid4())
    with running(store) as lab:
        async with session(lab) as s:
            first = await IdempotentSession(s, PlanSession(id=plan_id)).call_tool(
                "create_vm", {"region": "us-east-1"}
            )
        async with session(lab) as s:
            again = await IdempotentSession(s, PlanSession(id=plan_id)).call_tool(
                "create_vm", {"region": "us-east-1"}
            )
        assert lab.runs["create_vm"] == 1
    assert not first.replayed
    assert again.replayed
    assert first.idempotency_key == again.idempotency_key
    assert again.result.structured_content == first.result.structured_content


async def test_two_clients_racing_one_key_run_once(store: Store) -> None:
    """Two sessions sending one key at once: one runs, the other waits (in-progress) and replays."""
    plan_id = str(uuid.uuid4())
    results: list[MCPToolResult] = []
    policy = FAST.replace(max_attempts=8)
    with running(store, retry_after=1) as lab:

        async def one() -> None:
            async with session(lab) as s:
                tools = IdempotentSession(s, PlanSession(id=plan_id), policy=policy)
                results.append(await tools.call_tool("slow_charge", {"amount": 42}, step=3))

        async with anyio.create_task_group() as tg:
            tg.start_soon(one)
            tg.start_soon(one)
        assert lab.runs["slow_charge"] == 1
    assert sorted(r.replayed for r in results) == [False, True]
    assert {text_of(r) for r in results} == {"charged 42"}


async def test_key_in_flight_past_the_budget_raises_step_in_progress() -> None:
    """A key still running when the budget ends gives StepInProgress; the server ran it once."""
    decisions: list[str] = []
    plan_id = str(uuid.uuid4())
    with running(
        MemoryStore(), retry_after=0, hooks=[lambda e: decisions.append(e.decision)]
    ) as lab:
        async with session(lab) as first, session(lab) as second, anyio.create_task_group() as tg:
            holder = IdempotentSession(first, PlanSession(id=plan_id))
            tg.start_soon(functools.partial(holder.call_tool, "hold_charge", {"amount": 9}, step=2))
            try:
                await anyio.to_thread.run_sync(lab.holding.wait, 30.0)
                short = FAST.replace(deadline=1.0, initial_backoff=0.1, max_backoff=0.2)
                # The budget runs on a FakeClock that only its waits move: the attempts
                # that fit in it do not depend on how fast a loaded machine answers.
                waiter = IdempotentSession(
                    second, PlanSession(id=plan_id), policy=short, clock=FakeClock()
                )
                with pytest.raises(StepInProgress) as caught:
                    await waiter.call_tool("hold_charge", {"amount": 9}, step=2)
            finally:
                lab.gate.set()
        assert lab.runs["hold_charge"] == 1
    # Waited on the in-flight key until the deadline (not max_attempts), then told so.
    assert caught.value.attempts == decisions.count("conflict") >= 3
    assert caught.value.step == "step_002"
    assert decisions[-1] == "claimed"


async def test_records_are_scoped_per_principal() -> None:
    """One key from two tenants runs once per tenant; neither gets the other's result."""
    args = {"region": "eu-west-3"}
    plan_id = str(uuid.uuid4())

    def tenant(ctx: ServerRequestContext[Any, Any]) -> str:
        assert ctx.request is not None  # the starlette request of the HTTP transport
        return str(ctx.request.headers["x-tenant"])

    with running(MemoryStore(), principal=tenant) as lab:
        got: dict[str, list[MCPToolResult]] = {}
        for name in ("acme", "globex", "acme"):
            async with connect(lab.url + "/mcp", headers={"X-Tenant": name}) as s:
                tools = IdempotentSession(s, PlanSession(id=plan_id))
                got.setdefault(name, []).append(await tools.call_tool("create_vm", args))
        assert lab.runs["create_vm"] == 2
    assert [r.replayed for r in got["acme"]] == [False, True]
    assert [r.replayed for r in got["globex"]] == [False]
    acme, globex = got["acme"][1].result, got["globex"][0].result
    assert acme.structured_content != globex.structured_content


async def test_key_reused_for_another_tool_is_refused() -> None:
    """The same key sent for another tool is refused (KeyReused), never given the first's result."""
    plan_id = str(uuid.uuid4())
    with running(MemoryStore()) as lab:
        async with session(lab) as s:
            await IdempotentSession(s, PlanSession(id=plan_id)).call_tool(
                "create_vm", {"region": "ap-south-1"}, step=0
            )
            # A plan that lost its memory of giving step 0 to create_vm.
            forgetful = IdempotentSession(s, PlanSession(id=plan_id))
            with pytest.raises(KeyReused) as caught:
                await forgetful.call_tool("delete_vm", {"region": "ap-south-1"}, step=0)
        assert lab.runs == {"create_vm": 1}
    assert caught.value.step == "step_000"
    assert caught.value.idempotency_key is not None


async def test_raw_client_interoperates_by_setting_meta_by_hand() -> None:
    """A plain MCP client building the key with the stdlib is deduplicated and sees the replay."""
    args: dict[str, Any] = {"region": "eu-central-1", "size": 4}
    body = json.dumps(args, sort_keys=True, separators=(",", ":")).encode()
    key = f"{uuid.uuid4()}:step_007:{hashlib.sha256(body).hexdigest()}"
    opaque = str(uuid.uuid4())  # an opaque key is bound to the arguments it came with
    with running(MemoryStore(), require_key=True) as lab:
        async with session(lab) as s:
            first = await raw_call(s, "create_vm", args, key)
            second = await raw_call(s, "create_vm", args, key)
            await raw_call(s, "create_vm", args, opaque)
            with pytest.raises(MCPError) as mismatch:
                await raw_call(s, "create_vm", {**args, "size": 8}, opaque)
            with pytest.raises(MCPError) as missing:
                await raw_call(s, "create_vm", args)
        assert lab.runs["create_vm"] == 2
    assert first.meta == {PROTECTED_FIELD: True}  # the tool is protected: the key counts
    assert second.meta == {REPLAYED_FIELD: True, PROTECTED_FIELD: True}
    assert second.structured_content == first.structured_content
    assert mismatch.value.data == {"type": "io.agentkey/payload-mismatch"}
    assert missing.value.data == {"type": "io.agentkey/key-required"}


async def test_arguments_not_matching_args_hash_raise_payload_mismatch() -> None:
    """A key whose args_hash does not match the arguments is refused: PayloadMismatch."""
    with running(MemoryStore()) as lab:
        async with session(lab) as s:
            tools = IdempotentSession(s, PlanSession.new())
            planned = tools.step_for("create_vm", {"region": "us-west-2"})
            with pytest.raises(MCPError) as raw:
                await raw_call(s, "create_vm", {"region": "us-west-1"}, planned.idempotency_key)
            # A step whose key was computed for other arguments (model_copy(update=) rebuilds
            # the key, so the tampering goes through the plan's private constructor).
            other = {"region": "us-west-1"}
            tampered = Step._made(
                planned.plan_session_id,
                planned.index,
                planned.idempotency_key,
                "create_vm",
                other,
                "python",
                canonical_json(other),
            )
            with pytest.raises(PayloadMismatch):
                await tools.call_step(tampered)
        assert lab.runs["create_vm"] == 0
    assert raw.value.data == {"type": "io.agentkey/payload-mismatch"}


async def test_malformed_key_is_rejected() -> None:
    """A key that is not an agentkey key (key_format='agentkey') or not a string: invalid-key."""
    with running(MemoryStore(), key_format="agentkey") as lab:
        async with session(lab) as s:
            refused = []
            for key in ("plan:step_x:00", "ik_123", 7):
                with pytest.raises(MCPError) as caught:
                    await raw_call(s, "create_vm", {"region": "x"}, key)
                refused.append(caught.value)
        assert lab.runs["create_vm"] == 0
    assert [e.data for e in refused] == [{"type": "io.agentkey/invalid-key"}] * 3
    assert [e.code for e in refused] == [-32602] * 3


async def test_failure_after_side_effect_is_replayed_as_error() -> None:
    """A tool that fails after begin_mutation() is recorded FAILED: a resend replays the error."""
    with running(MemoryStore()) as lab:
        async with session(lab) as s:
            plan = PlanSession.new()
            first = await IdempotentSession(s, plan).call_tool("fragile", {"amount": 5}, step=1)
            again = await IdempotentSession(s, plan).call_tool("fragile", {"amount": 5}, step=1)
        assert lab.runs["fragile"] == 1
    assert first.result.is_error
    assert not first.replayed
    assert again.result.is_error
    assert again.replayed


async def test_every_answer_lost_ends_in_outcome_unknown() -> None:
    """Every answer lost: OutcomeUnknown carries the key, and a later resend replays."""
    with running(MemoryStore()) as lab:
        lab.drop["create_vm"] = 10
        async with session(lab) as s:
            tools = IdempotentSession(s, PlanSession.new(), policy=FAST.replace(max_attempts=3))
            with pytest.raises(OutcomeUnknown) as caught:
                await tools.call_tool("create_vm", {"region": "eu-north-1"})
        assert lab.runs["create_vm"] == 1  # the resends were answered from the store
        lab.drop.clear()
        async with session(lab) as s:
            later = await IdempotentSession(s, PlanSession(id=tools.plan.id)).call_tool(
                "create_vm", {"region": "eu-north-1"}
            )
        assert lab.runs["create_vm"] == 1
    assert caught.value.attempts == 3
    assert caught.value.idempotency_key == later.idempotency_key
    assert later.replayed


async def test_bearer_token_refreshed_once_and_same_key_resent() -> None:
    """A revoked token gets one refresh through agentkey's provider; the same call goes again."""
    with running(MemoryStore(), lab=Lab(tokens=True)) as lab:
        auth = ClientCredentials(lab.url + "/token", "agent", "s3cret")
        async with session(lab, auth=auth) as s:
            lab.revoked.add("t1")  # revoked by the authorization server after the handshake
            got = await IdempotentSession(s, PlanSession.new()).call_tool(
                "create_vm", {"region": "sa-east-1"}
            )
        assert lab.runs["create_vm"] == 1
    assert lab.issued == 2
    assert lab.seen_tokens[-1] == "t2"
    assert not got.replayed


async def test_token_refused_after_refresh_raises_authentication_error() -> None:
    """A 401 for the refreshed token too is TokenRejected at once, not a retry storm."""
    with running(MemoryStore(), lab=Lab(tokens=True)) as lab:
        auth = ClientCredentials(lab.url + "/token", "agent", "s3cret")
        async with session(lab, auth=auth) as s:
            lab.revoked.update({"t1", "t2", "t3"})  # the client lost access to this server
            tools = IdempotentSession(s, PlanSession.new(), policy=FAST)
            with pytest.raises(TokenRejected) as caught:
                await tools.call_tool("create_vm", {"region": "af-south-1"})
        assert lab.runs["create_vm"] == 0
    assert lab.issued >= 2  # (the SDK's GET stream refreshes on its own 401s too)
    assert caught.value.attempts == 1
    assert caught.value.status_code == 401
    assert "t2" not in str(caught.value)


def test_missing_sdk_names_the_extra() -> None:
    """Importing the MCP adapter without the mcp SDK raises MissingExtra naming the extra."""
    code = (
        "import sys\nsys.modules['mcp'] = None\nimport agentkey, agentkey.integrations\n"
        "try:\n    import agentkey.integrations.mcp\n"
        "except agentkey.MissingExtra as exc:\n    print(exc.extra, exc.module)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "mcp mcp"


async def test_an_outcome_the_store_failed_to_record_is_written_again() -> None:
    """The store fails the first writes of a tool's result: the write is retried, so a call after
    the lease would have ended replays instead of running the tool again."""
    store = FailingFinish(failures=3)
    plan_id = str(uuid.uuid4())
    with running(store, lock_ttl=0.2) as lab:
        async with session(lab) as s:
            first = await IdempotentSession(s, PlanSession(id=plan_id)).call_tool(
                "create_vm", {"region": "eu-north-1"}
            )
        await asyncio.sleep(0.3)  # past the lease: an unrecorded claim would be free now
        async with session(lab) as s:
            again = await IdempotentSession(s, PlanSession(id=plan_id)).call_tool(
                "create_vm", {"region": "eu-north-1"}
            )
        assert lab.runs["create_vm"] == 1
    assert again.replayed
    assert text_of(again) == text_of(first)
    assert store.finishes == 4
