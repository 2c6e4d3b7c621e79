"""OpenTelemetry: spans of real calls to loopback servers, read from the in-memory exporter.

The tool servers run under ``opentelemetry-instrumentation-asgi``, so a server span exists
and its parent is whatever ``traceparent`` reached the server.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanKind, StatusCode

from agentkey import (
    AsyncToolInvoker,
    LoggingHook,
    PlanSession,
    PollPolicy,
    RetryPolicy,
    ToolInvoker,
    ToolRejected,
)
from agentkey._keys import shown_key
from agentkey.auth import ClientCredentials
from agentkey.integrations.otel import OTelHook
from agentkey.server import IdempotencyMiddleware, MemoryStore
from tests._loopback import serve
from tests.auth._idp import IdP
from tests.invoker._toolapp import Faults, ToolApp

pytestmark = pytest.mark.timeout(60)

FAST = RetryPolicy(initial_backoff=0.01, max_backoff=0.02, jitter=False)
POLL = PollPolicy(initial_backoff=0.01, max_backoff=0.02)


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


@pytest.fixture
def server(provider: TracerProvider) -> Iterator[tuple[str, ToolApp]]:
    tools = ToolApp()
    with serve(OpenTelemetryMiddleware(tools, tracer_provider=provider)) as url:
        yield url, tools


def _spans(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    """Spans called ``name`` (``agentkey.invoke`` also matches ``agentkey.invoke <tool>``)."""
    invoke = name == "agentkey.invoke"
    return [
        s
        for s in exporter.get_finished_spans()
        if s.name == name or (invoke and s.name.startswith("agentkey.invoke "))
    ]


def _server_spans(exporter: InMemorySpanExporter, count: int) -> list[ReadableSpan]:
    """The SERVER spans, once ``count`` have ended (a server ends its span after answering)."""
    deadline = time.monotonic() + 10
    while True:
        spans = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
        if len(spans) >= count or time.monotonic() > deadline:
            return sorted(spans, key=lambda s: s.start_time or 0)
        time.sleep(0.01)


def _decision(exporter: InMemorySpanExporter, server: ReadableSpan) -> dict[str, Any]:
    """The decision attributes of a server span: on it, or on its agentkey.decision child."""
    if (server.attributes or {}).get("agentkey.decision"):
        return dict(server.attributes or {})
    assert server.context is not None
    for span in _spans(exporter, "agentkey.decision"):
        if span.parent is not None and span.parent.span_id == server.context.span_id:
            return dict(span.attributes or {})
    return {}


def _invoker(kind: str, url: str, hook: OTelHook, **kw: Any) -> Any:
    cls = ToolInvoker if kind == "sync" else AsyncToolInvoker
    return cls(
        url,
        route_template="/tools/{tool}",
        retry=FAST,
        polling=POLL,
        hooks=[LoggingHook(), hook],
        **kw,
    )


async def _call(invoker: Any, step: Any) -> Any:
    if isinstance(invoker, ToolInvoker):
        with invoker:
            return invoker.invoke(step)
    async with invoker:
        return await invoker.invoke(step)


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_each_attempt_carries_its_own_traceparent(
    kind: str,
    server: tuple[str, ToolApp],
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
) -> None:
    """A 503 then a 200: two CLIENT spans under one invoke span, each a server span's parent."""
    url, tools = server
    tools.faults["charge"] = Faults(prelude=[(503, {"Retry-After": "0"})])
    step = PlanSession.new().step(0, "charge", {"amount": 5})
    result = await _call(_invoker(kind, url, OTelHook(tracer_provider=provider)), step)

    (invoke,) = _spans(exporter, "agentkey.invoke")
    assert invoke.name == "agentkey.invoke charge"
    attempts = sorted(_spans(exporter, "POST"), key=lambda s: s.start_time or 0)
    assert invoke.attributes is not None
    assert invoke.attributes["idempotency.key"] == shown_key(step.idempotency_key)
    assert invoke.attributes["idempotency.key"].startswith(f"{step.plan_session_id}:step_000:#")
    _no_whole_key(exporter, step.idempotency_key)
    assert invoke.attributes["agentkey.step"] == "step_000"
    assert invoke.attributes["agentkey.outcome"] == "executed"
    assert invoke.attributes["agentkey.attempts"] == 2 == result.attempts
    assert invoke.attributes["agentkey.polls"] == 0
    assert [e.name for e in invoke.events] == ["agentkey.retry"]
    assert [a.kind for a in attempts] == [SpanKind.CLIENT, SpanKind.CLIENT]
    first, second = (a.attributes or {} for a in attempts)
    assert first["http.response.status_code"] == 503
    assert second["http.response.status_code"] == 200
    assert second["http.request.resend_count"] == 1
    assert "http.request.resend_count" not in first
    assert second["url.full"] == f"{url}/tools/charge"
    assert second["server.address"] == "127.0.0.1"
    assert attempts[0].status.status_code is StatusCode.ERROR
    for attempt in attempts:
        assert attempt.parent is not None
        assert attempt.parent.span_id == invoke.context.span_id
        assert attempt.context.trace_id == invoke.context.trace_id
    # What the server received, and the server spans it made from it.
    sent = [s.headers["traceparent"].split("-")[1:3] for s in tools.seen]
    assert sent == [[f"{a.context.trace_id:032x}", f"{a.context.span_id:016x}"] for a in attempts]
    servers = _server_spans(exporter, 2)
    assert sorted(s.parent.span_id for s in servers if s.parent) == sorted(
        a.context.span_id for a in attempts
    )
    assert sum(tools.executions.values()) == 1


async def test_waits_polls_and_replays_are_span_events(
    server: tuple[str, ToolApp], provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """A 409 wait, a 202 polled to its end, then the same step replayed: events on the spans."""
    url, tools = server
    tools.faults["build"] = Faults(prelude=[(409, {"Retry-After": "0"})], async_polls=1)
    step = PlanSession.new().step(0, "build", {"image": "api"})
    hook = OTelHook(tracer_provider=provider)
    with _invoker("sync", url, hook) as invoker:
        first = invoker.invoke(step)
        again = invoker.invoke(step)
    assert (first.polls, again.replayed) == (2, True)
    ran, replayed = sorted(_spans(exporter, "agentkey.invoke"), key=lambda s: s.start_time or 0)
    assert ran.context is not None
    names = [e.name for e in ran.events]
    assert names[0] == "agentkey.wait_in_flight"
    assert names.count("agentkey.poll") >= 1
    assert (ran.attributes or {})["agentkey.polls"] == 2
    polls = [
        s for s in _spans(exporter, "GET") if s.parent and s.parent.span_id == ran.context.span_id
    ]
    assert [(p.attributes or {}).get("agentkey.poll") for p in polls] == [1, 2]
    assert all((p.attributes or {}).get("http.request.resend_count") is None for p in polls)
    assert replayed.events[0].name == "agentkey.replay"  # of the stored 202, polled again
    assert (replayed.attributes or {})["agentkey.outcome"] == "replayed"
    assert (replayed.attributes or {})["agentkey.replayed"] is True
    assert sum(tools.executions.values()) == 1


async def test_no_traceparent_to_another_origin(
    server: tuple[str, ToolApp], provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """A status URL on another (allowed) origin is polled without a traceparent."""
    url, tools = server
    status = ToolApp()
    status.operations = tools.operations  # the same operations, served from another origin
    with serve(status) as other:
        tools.faults["build"] = Faults(async_polls=1, status_origin=other)
        step = PlanSession.new().step(0, "build", {"image": "api"})
        hook = OTelHook(tracer_provider=provider)
        with _invoker("sync", url, hook, allowed_poll_origins=[other]) as invoker:
            invoker.invoke(step)
    assert all("traceparent" in s.headers for s in tools.seen)
    assert status.seen
    assert not any("traceparent" in s.headers for s in status.seen)


async def test_a_failed_call_ends_its_span_with_the_error(
    server: tuple[str, ToolApp], provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """A final 403: the invoke span ends with status ERROR and error.type, no outcome."""
    url, tools = server
    tools.faults["charge"] = Faults(prelude=[(403, {})])
    step = PlanSession.new().step(0, "charge", {"amount": 5})
    with (
        _invoker("sync", url, OTelHook(tracer_provider=provider)) as invoker,
        pytest.raises(ToolRejected),
    ):
        invoker.invoke(step)
    (invoke,) = _spans(exporter, "agentkey.invoke")
    assert invoke.status.status_code is StatusCode.ERROR
    assert (invoke.attributes or {})["error.type"] == "ToolRejected"
    assert "agentkey.outcome" not in (invoke.attributes or {})


def _no_whole_key(exporter: InMemorySpanExporter, key: str) -> None:
    """No span attribute or event attribute holds the key's args hash (the key is a secret)."""
    secret = key.rsplit(":", 1)[1]
    for span in exporter.get_finished_spans():
        values = [*(span.attributes or {}).values()]
        values += [v for event in span.events for v in (event.attributes or {}).values()]
        assert not any(secret in str(v) for v in values), span.name


async def test_the_server_span_gets_the_middlewares_decision(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """Behind IdempotencyMiddleware: the server spans say claimed, then replay, with the key."""
    hook = OTelHook(tracer_provider=provider)
    tools = ToolApp()
    app = IdempotencyMiddleware(tools, store=MemoryStore(), hooks=[hook], shared_key_space=True)
    step = PlanSession.new().step(0, "charge", {"amount": 5})
    served = serve(OpenTelemetryMiddleware(app, tracer_provider=provider))
    with served as url, _invoker("sync", url, hook) as invoker:
        invoker.invoke(step)
        invoker.invoke(step)
    decisions = [_decision(exporter, s) for s in _server_spans(exporter, 2)]
    assert [d.get("agentkey.decision") for d in decisions] == ["claimed", "replay"]
    assert all(d["idempotency.key"] == shown_key(step.idempotency_key) for d in decisions)
    _no_whole_key(exporter, step.idempotency_key)
    assert sum(tools.executions.values()) == 1


async def test_a_token_request_is_a_span_without_secrets(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """The token fetch is a child of the attempt that needed it; no attribute holds a secret."""
    idp = IdP(clients={"agent": "s3cret-value"})
    hook = OTelHook(tracer_provider=provider)
    with serve(idp.app()) as url:
        idp.url = url
        auth = ClientCredentials(url + "/token", "agent", "s3cret-value", hooks=[hook])
        step = PlanSession.new().step(0, "deploy", {"region": "eu"})
        with ToolInvoker(url, auth=auth, routes={"deploy": "/tool"}, hooks=[hook]) as invoker:
            invoker.invoke(step)
        auth.close()
    (token,) = _spans(exporter, "agentkey.token client_credentials")
    (attempt,) = _spans(exporter, "POST")
    assert token.parent is not None
    assert token.parent.span_id == attempt.context.span_id
    assert (token.attributes or {})["server.address"] == "127.0.0.1"
    issued = list(idp.access)  # the access tokens the IdP gave out
    assert issued
    for span in exporter.get_finished_spans():
        for name, value in (span.attributes or {}).items():
            assert "authorization" not in name.lower()
            text = str(value)
            assert "s3cret-value" not in text
            assert "Bearer" not in text
            assert not any(t in text for t in issued)


def test_missing_opentelemetry_names_the_extra() -> None:
    """Importing the tracing module without opentelemetry raises MissingExtra naming the extra."""
    code = (
        "import sys\nsys.modules['opentelemetry'] = None\nimport agentkey\n"
        "try:\n    import agentkey.integrations.otel\n"
        "except agentkey.MissingExtra as exc:\n    print(exc.extra, exc.module)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "otel opentelemetry"


async def test_sampled_out_calls_pass_the_decision_on(server: tuple[str, ToolApp]) -> None:
    """A sampler that drops the trace: no spans recorded, the tool still gets a traceparent."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    url, tools = server
    step = PlanSession.new().step(0, "charge", {"amount": 5})
    await _call(_invoker("sync", url, OTelHook(tracer_provider=provider)), step)
    assert exporter.get_finished_spans() == ()
    (seen,) = tools.seen
    flags = int(seen.headers["traceparent"].rsplit("-", 1)[1], 16)
    assert flags & 1 == 0  # "not sampled": the tool's own tracing drops it too


async def test_a_cancelled_call_ends_its_span(
    server: tuple[str, ToolApp], provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """An async invoke cancelled mid-request ends its spans, marked with the cancellation."""
    url, tools = server
    tools.faults["charge"] = Faults(delay=1.0)
    step = PlanSession.new().step(0, "charge", {"amount": 5})
    async with _invoker("async", url, OTelHook(tracer_provider=provider)) as invoker:
        task = asyncio.create_task(invoker.invoke(step))
        assert await asyncio.to_thread(tools.request_seen.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    (invoke,) = _spans(exporter, "agentkey.invoke")
    assert (invoke.attributes or {})["error.type"] == "CancelledError"
    assert len(_spans(exporter, "POST")) == 1  # the request span ended too
