"""The issue's proof through agentkey's invokers: a long plan with short-lived tokens."""

from __future__ import annotations

import asyncio

import pytest

from agentkey import (
    AsyncToolInvoker,
    PlanSession,
    PollPolicy,
    TokenRejected,
    ToolInvoker,
    ToolResult,
)
from agentkey.auth import ClientCredentials, TokenProvider
from agentkey.testing import FakeClock
from tests.auth._idp import IdP
from tests.auth.conftest import CLIENT_ID, CLIENT_SECRET

STEPS = 10
INTERVAL = 0.6  # 10 steps over 6 seconds of the fake clock


async def _run_plan(
    kind: str, idp: IdP, auth: TokenProvider, revoke_at: int, clock: FakeClock
) -> list[ToolResult]:
    """Invoke STEPS steps INTERVAL apart; revoke every token just before step ``revoke_at``."""
    plan = PlanSession.new()
    routes = {"deploy": "/tool"}
    results: list[ToolResult] = []
    if kind == "async":
        async with AsyncToolInvoker(idp.url, auth=auth, routes=routes) as invoker:
            for i in range(STEPS):
                if i == revoke_at:
                    idp.revoke_all()
                results.append(await invoker.invoke(plan.step(i, "deploy", {"n": i})))
                clock.advance(INTERVAL)
        return results

    def run() -> None:
        with ToolInvoker(idp.url, auth=auth, routes=routes) as invoker:
            for i in range(STEPS):
                if i == revoke_at:
                    idp.revoke_all()
                results.append(invoker.invoke(plan.step(i, "deploy", {"n": i})))
                clock.advance(INTERVAL)

    await asyncio.to_thread(run)
    return results


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_plan_of_10_steps_with_2s_tokens_sees_no_401(idp: IdP, kind: str) -> None:
    """10 steps over 6 s with 2 s tokens (one revoked mid-plan) all succeed; no 401 reaches us."""
    clock = FakeClock()  # token lifetimes pass only between steps
    idp.clock = clock.monotonic
    idp.lifetime = 2.0
    auth = ClientCredentials(idp.url + "/token", CLIENT_ID, CLIENT_SECRET, clock=clock)
    started = clock.monotonic()
    results = await _run_plan(kind, idp, auth, revoke_at=5, clock=clock)
    elapsed = clock.monotonic() - started
    assert [r.status_code for r in results] == [200] * STEPS
    assert [r.attempts for r in results] == [1] * STEPS  # the 401 was absorbed by the auth layer
    assert idp.tool_calls == STEPS
    assert idp.tool_401 == 1  # the revoked token, once; refreshed and resent with the same key
    keys = [k for k, _, _ in idp.tool_requests]
    assert len(keys) == STEPS + 1
    assert len(set(keys)) == STEPS  # only the resend after the 401 repeats a key
    # A 2 s token is renewed once half its life is gone: at most one renewal per second of
    # plan (plus the first token and the one after the revocation), so about six for ten
    # steps 0.6 s apart; and at least one per 2 s, or the tool would have seen it expire.
    hits = idp.hits["client_credentials"]
    assert elapsed // 2.0 <= hits <= elapsed // 1.0 + 2


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_second_401_raises_authentication_error(idp: IdP, kind: str) -> None:
    """A tool that refuses the refreshed token too makes the invoker raise TokenRejected."""
    auth = ClientCredentials(idp.url + "/token", CLIENT_ID, CLIENT_SECRET)
    idp.force_401 = 2
    plan = PlanSession.new()
    step = plan.step(0, "deploy", {"region": "us-east-1"})

    async def invoke() -> ToolResult:
        routes = {"deploy": "/tool"}
        if kind == "async":
            async with AsyncToolInvoker(idp.url, auth=auth, routes=routes) as invoker:
                return await invoker.invoke(step)
        with ToolInvoker(idp.url, auth=auth, routes=routes) as sync_invoker:
            return await asyncio.to_thread(sync_invoker.invoke, step)

    with pytest.raises(TokenRejected) as info:
        await invoke()
    assert info.value.status_code == 401
    assert idp.hits["client_credentials"] == 2
    assert [k for k, _, _ in idp.tool_requests] == [step.idempotency_key] * 2
    assert [b for _, _, b in idp.tool_requests] == [step.body] * 2


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_polls_carry_a_fresh_token(idp: IdP, kind: str) -> None:
    """A 202 operation polled for ~2.4 s with 1 s tokens: each poll is authorised, no 401.

    End to end in real time: the invoker's own poll waits are what age the tokens.
    """
    idp.lifetime = 1.0
    idp.polls_until_done = 8
    auth = ClientCredentials(idp.url + "/token", CLIENT_ID, CLIENT_SECRET)
    polling = PollPolicy(
        initial_backoff=0.3,
        backoff_multiplier=1.0,
        max_backoff=0.3,
        deadline=30.0,
        min_interval=0.3,
    )
    step = PlanSession.new().step(0, "build", {"image": "api:1.2"})
    routes = {"build": "/jobs"}
    if kind == "async":
        async with AsyncToolInvoker(idp.url, auth=auth, routes=routes, polling=polling) as inv:
            result = await inv.invoke(step)
    else:
        with ToolInvoker(idp.url, auth=auth, routes=routes, polling=polling) as sync_inv:
            result = await asyncio.to_thread(sync_inv.invoke, step)
    assert result.status_code == 200
    assert result.polls == 8
    assert idp.tool_401 == 0
    assert idp.hits["client_credentials"] >= 3  # renewed while polling, before expiry
