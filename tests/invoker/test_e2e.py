"""End to end over real sockets: uvicorn on 127.0.0.1 running the scripted tool app.

Each test counts side effects on the server: whatever the network does, a
step runs at most once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentkey import (
    AsyncToolInvoker,
    PollTimeout,
    Step,
    StepFailed,
    ToolError,
    ToolInvoker,
    ToolResult,
    UnsafeRedirect,
)
from agentkey.client._hooks import AttemptEvent, CallEndEvent, CallStartEvent, InvokeEvent
from tests._loopback import serve

from ._support import DRIVERS, FAST_POLL, FAST_RETRY, Bearer, Driver, Recorder, make_step
from ._toolapp import Faults, ToolApp


@pytest.fixture
def tool() -> Iterator[tuple[ToolApp, str]]:
    """The scripted tool app served on loopback."""
    app = ToolApp()
    with serve(app) as url:
        yield app, url


@pytest.fixture
def foreign() -> Iterator[tuple[ToolApp, str]]:
    """A second server on another origin (another port), to catch leaked credentials."""
    app = ToolApp()
    with serve(app) as url:
        yield app, url.replace("127.0.0.1", "localhost")


def invoke(
    driver: Driver,
    base_url: str,
    step: Step,
    *,
    path: str | None = None,
    resume: tuple[str, str] | None = None,
    **options: Any,
) -> ToolResult:
    """One call through the chosen driver, with fast test policies and a bearer token."""
    options.setdefault("retry", FAST_RETRY)
    options.setdefault("polling", FAST_POLL)
    options.setdefault("auth", Bearer())
    options.setdefault("route_template", "/tools/{tool}")
    if driver == "sync":
        with ToolInvoker(base_url, **options) as invoker:
            if resume is not None:
                return invoker.resume_poll(*resume)
            return invoker.invoke(step, path=path)

    async def main() -> ToolResult:
        async with AsyncToolInvoker(base_url, **options) as invoker:
            if resume is not None:
                return await invoker.resume_poll(*resume)
            return await invoker.invoke(step, path=path)

    return asyncio.run(main())


@pytest.mark.parametrize("driver", DRIVERS)
def test_plain_call_runs_once(driver: Driver, tool: tuple[ToolApp, str]) -> None:
    """A plain call runs the tool once and sends the key, the canonical body and the token."""
    app, url = tool
    step = make_step(tool="create_db")
    result = invoke(driver, url, step)
    assert result.status_code == 200
    assert not result.replayed
    assert result.body == {"tool": "create_db", "args": step.args, "execution": 1}
    assert app.executions == {step.idempotency_key: 1}
    (seen,) = app.seen
    assert seen.headers["idempotency-key"] == step.idempotency_key
    assert seen.headers["authorization"] == "Bearer s3cret-token"


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize(
    "prelude",
    [
        [(409, {"Retry-After": "1"})] * 3,
        [(429, {"Retry-After": "0"}), (503, {"Retry-After": "garbage"})],
        [(502, {}), (504, {})],
    ],
    ids=["409-storm", "429-503", "502-504"],
)
def test_transient_answers_then_one_execution(
    driver: Driver, prelude: list[tuple[int, dict[str, str]]], tool: tuple[ToolApp, str]
) -> None:
    """Conflicts, overload and gateway errors are retried with the same key; the tool runs once."""
    app, url = tool
    step = make_step(tool="flaky")
    app.faults["flaky"] = Faults(prelude=list(prelude))
    hooks = Recorder()
    result = invoke(driver, url, step, hooks=[hooks])
    assert result.attempts == len(prelude) + 1
    assert app.executions == {step.idempotency_key: 1}
    assert {s.headers["idempotency-key"] for s in app.seen} == {step.idempotency_key}
    assert len(hooks.retries()) == len(prelude)


@pytest.mark.parametrize("driver", DRIVERS)
def test_real_read_timeout_after_commit_is_replayed(
    driver: Driver, tool: tuple[ToolApp, str]
) -> None:
    """The server commits, then stalls past a real socket read timeout: the retry is a replay."""
    app, url = tool
    step = make_step(tool="slow")
    app.faults["slow"] = Faults(after_commit="stall", stall=1.5)
    hooks = Recorder()
    result = invoke(driver, url, step, timeout=httpx.Timeout(0.5), hooks=[hooks])
    assert result.replayed
    assert result.attempts >= 2  # a very loaded machine may time out the replay too
    assert result.body == {"tool": "slow", "args": step.args, "execution": 1}
    assert app.executions == {step.idempotency_key: 1}
    reasons = [e.reason for e in hooks.retries()]
    assert reasons[0] == "ReadTimeout"
    assert set(reasons) == {"ReadTimeout"}


@pytest.mark.parametrize("driver", DRIVERS)
def test_dropped_connection_after_commit_is_replayed(
    driver: Driver, tool: tuple[ToolApp, str]
) -> None:
    """The server commits, then drops the connection mid-body: the retry is a replay."""
    app, url = tool
    step = make_step(tool="dropper")
    app.faults["dropper"] = Faults(after_commit="drop")
    result = invoke(driver, url, step)
    assert result.replayed
    assert result.attempts == 2
    assert app.executions == {step.idempotency_key: 1}


@pytest.mark.parametrize("driver", DRIVERS)
def test_replayed_500_is_final(driver: Driver, tool: tuple[ToolApp, str]) -> None:
    """A stored 500 comes back replayed on the retry: a final ToolError, still one execution."""
    app, url = tool
    step = make_step(tool="broken")
    app.faults["broken"] = Faults(status=500)
    with pytest.raises(ToolError) as caught:
        invoke(driver, url, step)
    assert caught.value.status_code == 500
    assert caught.value.attempts == 2
    assert "replayed" in str(caught.value)
    assert app.executions == {step.idempotency_key: 1}


@pytest.mark.parametrize("driver", DRIVERS)
def test_202_three_polls_then_success(driver: Driver, tool: tuple[ToolApp, str]) -> None:
    """A 202 is polled through three 'running' answers to success, with auth and the same key."""
    app, url = tool
    step = make_step(tool="provision")
    app.faults["provision"] = Faults(async_polls=3)
    result = invoke(driver, url, step)
    assert result.polls == 4
    assert result.body is not None
    assert result.body["status"] == "succeeded"
    assert result.status_url is not None
    assert result.status_url.startswith(f"{url}/operations/")
    polls = [s for s in app.seen if s.method == "GET"]
    assert len(polls) == 4
    assert all(p.headers["authorization"] == "Bearer s3cret-token" for p in polls)
    assert all(p.headers["idempotency-key"] == step.idempotency_key for p in polls)
    assert app.executions == {step.idempotency_key: 1}


@pytest.mark.parametrize("driver", DRIVERS)
def test_attempt_hook_headers_reach_the_tool_on_every_send(
    driver: Driver, tool: tuple[ToolApp, str]
) -> None:
    """A hook's traceparent goes out with each resend and poll; the call is framed by events."""
    app, url = tool
    step = make_step(tool="provision")
    app.faults["provision"] = Faults(prelude=[(503, {"Retry-After": "0"})], async_polls=1)
    seen = Recorder()

    def trace(event: InvokeEvent) -> None:
        seen(event)
        if isinstance(event, AttemptEvent):
            event.headers["traceparent"] = f"00-{'b' * 32}-{len(seen.events):016x}-01"

    result = invoke(driver, url, step, hooks=[trace])
    sent = [s.headers.get("traceparent", "")[36:52] for s in app.seen]
    attempts = [e for e in seen.events if isinstance(e, AttemptEvent)]
    assert len(sent) == len(attempts) == 4  # 503, 202, then two polls
    assert len(set(sent)) == 4
    assert [type(e) for e in (seen.events[0], seen.events[-1])] == [CallStartEvent, CallEndEvent]
    assert seen.events[-1] == CallEndEvent(
        step.idempotency_key, "step_003", "executed", 2, 2, 200, None
    )
    assert result.polls == 2
    assert app.executions == {step.idempotency_key: 1}


@pytest.mark.parametrize("driver", DRIVERS)
def test_202_then_failure(driver: Driver, tool: tuple[ToolApp, str]) -> None:
    """An operation that reports 'failed' raises StepFailed with the key and the body."""
    app, url = tool
    step = make_step(tool="provision")
    app.faults["provision"] = Faults(async_polls=2, final_state="Failed")
    with pytest.raises(StepFailed) as caught:
        invoke(driver, url, step)
    assert caught.value.idempotency_key == step.idempotency_key
    assert caught.value.body == {"status": "Failed", "result": {"id": "op1"}}


@pytest.mark.parametrize("driver", DRIVERS)
def test_202_timeout_then_resume(driver: Driver, tool: tuple[ToolApp, str]) -> None:
    """The poll deadline raises PollTimeout; resume_poll finishes the step without a new POST."""
    app, url = tool
    step = make_step(tool="provision")
    app.faults["provision"] = Faults(async_polls=10_000)
    slow_poll = FAST_POLL.replace(
        initial_backoff=0.01, max_backoff=0.01, max_retry_after=0.01, deadline=0.1
    )
    with pytest.raises(PollTimeout) as caught:
        invoke(driver, url, step, polling=slow_poll)
    op = caught.value.status_url.rsplit("/", 1)[1]
    with app.lock:
        app.operations[op] = ["succeeded"]
    result = invoke(driver, url, step, resume=(caught.value.status_url, step.idempotency_key))
    assert result.body is not None
    assert result.body["status"] == "succeeded"
    assert [s.method for s in app.seen].count("POST") == 1
    assert app.executions == {step.idempotency_key: 1}


@pytest.mark.parametrize("driver", DRIVERS)
def test_same_origin_redirect_is_followed(driver: Driver, tool: tuple[ToolApp, str]) -> None:
    """A 307 to the same origin is followed with the same method, body and key."""
    app, url = tool
    step = make_step(tool="moved")
    result = invoke(driver, url, step, path="/old/moved")
    assert result.status_code == 200
    assert [s.path for s in app.seen] == ["/old/moved", "/tools/moved"]
    assert app.executions == {step.idempotency_key: 1}


@pytest.mark.parametrize("driver", DRIVERS)
def test_cross_origin_status_url_is_refused(
    driver: Driver, tool: tuple[ToolApp, str], foreign: tuple[ToolApp, str]
) -> None:
    """A status URL on another origin raises UnsafeRedirect, and that origin sees nothing."""
    app, url = tool
    other, other_url = foreign
    step = make_step(tool="provision")
    app.faults["provision"] = Faults(async_polls=0, status_origin=other_url)
    with pytest.raises(UnsafeRedirect) as caught:
        invoke(driver, url, step)
    assert caught.value.url.startswith(other_url)
    assert other.seen == []


@pytest.mark.parametrize("driver", DRIVERS)
def test_allowed_poll_origin_gets_no_credentials(
    driver: Driver, tool: tuple[ToolApp, str], foreign: tuple[ToolApp, str]
) -> None:
    """An explicitly allowed status origin is polled without the token or the key."""
    app, url = tool
    other, other_url = foreign
    step = make_step(tool="provision")
    app.faults["provision"] = Faults(async_polls=0, status_origin=other_url)
    op = "op1"
    other.operations[op] = ["running", "succeeded"]
    result = invoke(driver, url, step, allowed_poll_origins=[other_url])
    assert result.status_url == f"{other_url}/operations/{op}"
    assert result.polls == 2
    assert len(other.seen) == 2
    for seen in other.seen:
        assert "authorization" not in seen.headers
        assert "idempotency-key" not in seen.headers


async def test_fifty_async_callers_and_a_thread_execute_once(tool: tuple[ToolApp, str]) -> None:
    """50 concurrent async invokes plus a sync invoker in a thread: one execution, one body."""
    app, url = tool
    step = make_step(tool="charge")
    app.faults["charge"] = Faults(delay=0.3)
    policy = FAST_RETRY.replace(max_attempts=200, deadline=30.0, max_retry_after=0.02)

    def sync_call() -> ToolResult:
        with ToolInvoker(url, retry=policy, route_template="/tools/{tool}", hooks=()) as inv:
            return inv.invoke(step)

    async with AsyncToolInvoker(
        url, retry=policy, route_template="/tools/{tool}", hooks=()
    ) as invoker:
        results = await asyncio.gather(
            asyncio.to_thread(sync_call), *(invoker.invoke(step) for _ in range(50))
        )
    assert app.executions == {step.idempotency_key: 1}
    assert len(results) == 51
    assert len({str(r.body) for r in results}) == 1
    assert sum(not r.replayed for r in results) == 1
    assert all(r.idempotency_key == step.idempotency_key for r in results)


@pytest.mark.parametrize("driver", DRIVERS)
def test_resume_poll_sends_the_callers_headers(driver: Driver, tool: tuple[ToolApp, str]) -> None:
    """resume_poll(headers=...) sends the invoke's extra headers (a tenant id) on every poll."""
    app, url = tool
    step = make_step(tool="provision")
    app.faults["provision"] = Faults(async_polls=10_000)
    short_poll = FAST_POLL.replace(
        initial_backoff=0.01, max_backoff=0.01, max_retry_after=0.01, deadline=0.05
    )
    tenant = {"X-Tenant": "acme"}
    options: dict[str, Any] = {"retry": FAST_RETRY, "auth": Bearer()}
    options["route_template"] = "/tools/{tool}"
    # The invoke runs out of its short polling deadline; the resume gets FAST_POLL's 10 s,
    # so its two polls fit on a loaded machine too.
    first, later = {**options, "polling": short_poll}, {**options, "polling": FAST_POLL}

    def succeed_later(status_url: str) -> None:
        with app.lock:
            app.operations[status_url.rsplit("/", 1)[1]] = ["running", "succeeded"]

    def run() -> ToolResult:
        if driver == "sync":
            with ToolInvoker(url, **first) as invoker, pytest.raises(PollTimeout) as caught:
                invoker.invoke(step, headers=tenant)
            succeed_later(caught.value.status_url)
            with ToolInvoker(url, **later) as invoker:
                return invoker.resume_poll(
                    caught.value.status_url, step.idempotency_key, headers=tenant
                )

        async def main() -> ToolResult:
            async with AsyncToolInvoker(url, **first) as invoker:
                with pytest.raises(PollTimeout) as caught:
                    await invoker.invoke(step, headers=tenant)
            succeed_later(caught.value.status_url)
            async with AsyncToolInvoker(url, **later) as invoker:
                return await invoker.resume_poll(
                    caught.value.status_url, step.idempotency_key, headers=tenant
                )

        return asyncio.run(main())

    result = run()
    assert result.polls == 2
    gets = [s for s in app.seen if s.method == "GET"]
    assert gets
    assert all(s.headers.get("x-tenant") == "acme" for s in gets)
    assert all(s.headers.get("idempotency-key") == step.idempotency_key for s in gets)
    assert app.executions == {step.idempotency_key: 1}


@pytest.mark.parametrize("driver", DRIVERS)
def test_status_url_with_control_character_is_a_tool_error(driver: Driver) -> None:
    """A 202 body naming a status URL httpx cannot send gives ToolError, not httpx.InvalidURL."""

    async def job(request: Request) -> JSONResponse:
        return JSONResponse({"status_url": "/operations/1\u0000"}, status_code=202)

    app = Starlette(routes=[Route("/tools/job", job, methods=["POST"])])
    step = make_step(tool="job")
    with serve(app) as url, pytest.raises(ToolError, match="control characters") as caught:
        invoke(driver, url, step)
    assert caught.value.idempotency_key == step.idempotency_key
