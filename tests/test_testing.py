"""agentkey.testing: an invoker against a ScriptedTool retries, replays and polls, no socket."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

from agentkey import (
    AsyncToolInvoker,
    Outcome,
    PlanSession,
    Step,
    ToolInvoker,
    ToolRejected,
    ToolResult,
)
from agentkey.auth import TokenPolicy
from agentkey.testing import (
    Reply,
    ScriptedTool,
    example_app,
    fast_poll_policy,
    fast_retry_policy,
    fast_token_policy,
)

BASE = "https://tools.test"
DRIVERS = ("sync", "async")


def _step() -> Step:
    return PlanSession.new().step(0, "charge", {"amount": 100, "currency": "EUR"})


def _invoke(driver: str, tool: ScriptedTool, step: Step, **options: Any) -> ToolResult:
    options = {"retry": fast_retry_policy(), "polling": fast_poll_policy(), **options}
    options.setdefault("route_template", "/tools/{tool}")
    if driver == "sync":
        with tool.client() as client, ToolInvoker(BASE, client=client, **options) as invoker:
            return invoker.invoke(step)

    async def main() -> ToolResult:
        async with (
            tool.async_client() as client,
            AsyncToolInvoker(BASE, client=client, **options) as invoker,
        ):
            return await invoker.invoke(step)

    return asyncio.run(main())


@pytest.mark.parametrize("driver", DRIVERS)
def test_retries_resend_the_same_key_and_body(driver: str) -> None:
    """A 503 "not run", a reset and a 409 are retried with the step's own key and body."""
    step = _step()
    not_run = {"type": "urn:agentkey:problem:not_run"}  # a bare 503 may have run (issue 34)
    tool = ScriptedTool(
        [
            Reply(
                503, json=not_run, headers={"Retry-After": "30", "Idempotency-Protected": "true"}
            ),  # capped by the policy
            httpx.ConnectError("connection refused"),
            Reply(409, json={"type": "in_progress"}, headers={"Retry-After": "1"}),
            Reply(201, json={"charge_id": "ch_1"}),
        ]
    )
    started = time.monotonic()
    result = _invoke(driver, tool, step)
    assert time.monotonic() - started < 5  # no 30 s wait: Retry-After is capped
    assert result.status_code == 201
    assert result.body == {"charge_id": "ch_1"}
    assert result.attempts == 4
    assert result.outcome is Outcome.EXECUTED
    assert tool.keys == [step.idempotency_key] * 4
    assert {r.content for r in tool.requests} == {step.body}
    assert {r.url.path for r in tool.requests} == {"/tools/charge"}


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_replayed_answer_is_reported_as_a_replay(driver: str) -> None:
    """A stored outcome replayed by the tool comes back as Outcome.REPLAYED, sent once."""
    step = _step()
    tool = ScriptedTool([Reply(201, json={"charge_id": "ch_1"}, replayed=True)])
    result = _invoke(driver, tool, step)
    assert result.replayed
    assert result.outcome is Outcome.REPLAYED
    assert tool.keys == [step.idempotency_key]


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_202_is_polled_to_its_end(driver: str) -> None:
    """A 202 with Operation-Location is polled by GET until it succeeds; the step is POSTed once."""
    step = _step()
    tool = ScriptedTool(
        [
            Reply(202, headers={"Operation-Location": "/operations/7"}),
            Reply(200, json={"status": "running"}),
            Reply(200, json={"status": "running"}, headers={"Retry-After": "60"}),
            Reply(200, json={"status": "succeeded", "charge_id": "ch_1"}),
        ]
    )
    result = _invoke(driver, tool, step)
    assert result.polls == 3
    assert result.body["charge_id"] == "ch_1"
    assert len(tool.calls("POST")) == 1
    assert [r.url.path for r in tool.calls("GET")] == ["/operations/7"] * 3


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_tool_rejection_is_final(driver: str) -> None:
    """A 400 is the tool's own answer: one request, a ToolRejected carrying the reason."""
    tool = ScriptedTool([Reply(400, json={"detail": "amount too large"})])
    with pytest.raises(ToolRejected):
        _invoke(driver, tool, _step())
    assert len(tool.requests) == 1


def test_the_script_running_out_fails_the_test() -> None:
    """A request past the end of the script raises AssertionError naming it; then= answers on."""
    tool = ScriptedTool([Reply(201)])
    with tool.client() as client:
        assert client.post(BASE + "/tools/a").status_code == 201
        with pytest.raises(AssertionError, match=r"request 2 \(POST /tools/b\)"):
            client.post(BASE + "/tools/b")
    again = ScriptedTool([Reply(503)], then=Reply(201))
    with again.client() as client:
        codes = [client.post(BASE + "/t").status_code for _ in range(3)]
    assert codes == [503, 201, 201]


def test_entries_can_be_functions_of_the_request() -> None:
    """A callable entry sees the request (here it echoes the key back)."""
    tool = ScriptedTool([lambda r: Reply(201, json={"key": r.headers["Idempotency-Key"]})])
    step = _step()
    result = _invoke("sync", tool, step)
    assert result.body == {"key": step.idempotency_key}


def test_reply_refuses_nonsense() -> None:
    """A Reply with a non-HTTP status, or both json= and content=, is refused when built."""
    with pytest.raises(ValueError, match="HTTP status"):
        Reply(42)
    with pytest.raises(ValueError, match="not both"):
        Reply(200, json={}, content=b"x")


def test_fast_policies_are_the_production_ones_with_short_waits() -> None:
    """The fast policies keep production attempts and statuses, with waits of milliseconds."""
    retry, poll, token = fast_retry_policy(), fast_poll_policy(), fast_token_policy()
    assert max(retry.max_backoff, retry.max_retry_after) <= 0.01
    assert max(poll.max_backoff, poll.max_retry_after) <= 0.01
    assert isinstance(token, TokenPolicy)
    assert token.max_backoff <= 0.01
    assert fast_retry_policy(max_attempts=2).max_attempts == 2


def test_example_app_runs_each_step_once_in_process() -> None:
    """The re-exported example app, in process (ASGITransport), runs a step once, then replays."""
    app = example_app()
    step = _step()

    async def main() -> tuple[ToolResult, ToolResult]:
        transport = httpx.ASGITransport(app=app)
        async with (
            httpx.AsyncClient(transport=transport) as client,
            AsyncToolInvoker(
                "http://tools.test", client=client, route_template="/tools/{tool}", hooks=()
            ) as invoker,
        ):
            return await invoker.invoke(step), await invoker.invoke(step)

    first, second = asyncio.run(main())
    assert (first.replayed, second.replayed) == (False, True)
    assert second.body == first.body
    assert app.state.executions["charge"] == 1


def test_import_agentkey_does_not_load_the_testing_module() -> None:
    """agentkey.testing is imported explicitly; `import agentkey` never pulls it in."""
    code = "import sys, agentkey; assert 'agentkey.testing' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_other_entries_ready_responses_raw_bodies_and_errors() -> None:
    """A ready httpx.Response, a raw body, any exception and a bad entry each do what they say."""
    tool = ScriptedTool(
        [
            httpx.Response(201, text="made"),
            Reply(200, content=b"raw", headers={"Content-Type": "text/plain"}),
            RuntimeError("the script says so"),
            "not an answer",  # type: ignore[list-item]
        ]
    )
    with tool.client(base_url=BASE) as client:
        assert client.post("/a").text == "made"
        assert client.get("/b").content == b"raw"
        with pytest.raises(RuntimeError, match="the script says so"):
            client.post("/c")
        with pytest.raises(TypeError, match="a ScriptedTool entry must be"):
            client.post("/d")
    assert [r.url.path for r in tool.requests] == ["/a", "/b", "/c", "/d"]
    assert repr(tool) == "ScriptedTool(0 answers left, 4 requests)"
    with pytest.raises(TypeError, match="status must be an int"):
        Reply(True)
