"""OpenTelemetry tracing for the invoker, the token providers and the server middleware.

One hook, :class:`OTelHook`, takes every agentkey instrumentation event and
turns it into spans. Give the same object to whichever parts you run::

    hook = OTelHook()
    ToolInvoker(url, hooks=[LoggingHook(), hook])      # client spans + traceparent
    ClientCredentials(..., hooks=[hook])               # token refresh spans
    IdempotencyMiddleware(app, ..., hooks=[hook])      # the decision on the server span

Client side, each ``invoke`` is an ``INTERNAL`` span (``agentkey.invoke``)
with ``idempotency.key`` (the key as shown in logs: plan id and step label,
its args hash replaced by a short digest), ``agentkey.step``, ``agentkey.tool`` (when the
event names it), ``agentkey.outcome``, ``agentkey.attempts``,
``agentkey.polls``. Each request it sends (the first, every resend, every
poll) is a ``CLIENT`` child span named after the method, with the OTel HTTP
client attributes (``http.request.method``, ``url.full`` without query,
fragment or credentials, ``server.address``, ``server.port``,
``http.response.status_code``, ``http.request.resend_count``), and carries a
W3C ``traceparent`` naming that span, to the tool's own origin only (a status
URL on another origin gets nothing). Retries, 409 waits, polls, replays and a
give-up are span events on the invoke span. A token request is an
``agentkey.token`` span (grant, endpoint origin, attempts, error class; never
a secret). Server side, the middleware's decision (``claimed``, ``replay``,
``conflict``, ``mismatch``, ``failed`` ...) is set as ``agentkey.decision``
on the current span, which is the server span when the app runs under an
OTel server instrumentation (``opentelemetry-instrumentation-asgi``); when
that span has already ended, a child span ``agentkey.decision`` carries it.

No attribute or event ever holds a token, a whole Idempotency-Key (a bearer
secret: with the caller's credentials it fetches the stored answer), a header
value, a body or a query string. Spans are made through the OTel API: with no
SDK configured they cost almost nothing and go nowhere.

Needs the ``otel`` extra (``pip install 'agentkey-idempotency[otel]'``).
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .._keys import shown_key
from .._version import __version__
from ..auth._token import TokenEvent
from ..client._hooks import (
    AttemptEvent,
    CallEndEvent,
    CallStartEvent,
    GiveUpEvent,
    PollEvent,
    ReplayEvent,
    RetryEvent,
)
from ..client._net import origin_of, redact_url
from ._adapter import missing_extra

try:
    from opentelemetry import trace
    from opentelemetry.trace import Span, SpanKind, Status, StatusCode, TracerProvider
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ModuleNotFoundError as exc:  # pragma: no cover - exercised in a subprocess test
    raise missing_extra(exc, "otel", "opentelemetry") from None

__all__ = ["OTelHook"]

_W3C = TraceContextTextMapPropagator()


@dataclass
class _Call:
    """The spans of the invoke running in this context."""

    span: Span
    method: str
    url: str
    url_attributes: dict[str, Any]  # of ``url``, computed once per call
    attempt: Span | None = None


class OTelHook:
    """An agentkey hook that records invoker, token and server events as OTel spans.

    ``tracer_provider`` defaults to the global one. Events the hook does not
    know are ignored, so it can be given to every ``hooks=`` of agentkey.
    """

    def __init__(self, *, tracer_provider: TracerProvider | None = None) -> None:
        self._tracer = trace.get_tracer("agentkey", __version__, tracer_provider=tracer_provider)
        # One invoke runs in one thread or task; a ContextVar keeps concurrent invokes apart.
        self._call: ContextVar[_Call | None] = ContextVar(f"agentkey_otel_{id(self)}", default=None)
        self._token: ContextVar[Span | None] = ContextVar(
            f"agentkey_token_{id(self)}", default=None
        )

    def __repr__(self) -> str:
        return "OTelHook()"

    def __call__(self, event: object) -> None:
        if isinstance(event, AttemptEvent):
            self._attempt(event)
        elif isinstance(event, CallStartEvent):
            self._start(event)
        elif isinstance(event, CallEndEvent):
            self._end(event)
        elif isinstance(event, (RetryEvent, PollEvent, ReplayEvent, GiveUpEvent)):
            self._note(event)
        elif isinstance(event, TokenEvent):
            self._token_event(event)
        elif type(event).__name__ == "DecisionEvent":  # agentkey.server: not imported here
            self._decision(event)

    # --- client: one span per invoke, one CLIENT span per request ---------------------------

    def _start(self, event: CallStartEvent) -> None:
        stale = self._call.get()
        if stale is not None:  # an invoke whose end never came (its task was cancelled)
            _close(stale, error="abandoned")
        tool = event.tool
        url_attributes = _url_attributes(event.url)
        attributes: dict[str, Any] = {
            "idempotency.key": shown_key(event.idempotency_key),
            "http.request.method": event.method,
            **url_attributes,
        }
        if event.step is not None:
            attributes["agentkey.step"] = event.step
        if tool:
            attributes["agentkey.tool"] = tool
        span = self._tracer.start_span(
            f"agentkey.invoke {tool}" if tool else "agentkey.invoke",
            kind=SpanKind.INTERNAL,
            attributes=attributes,
        )
        self._call.set(_Call(span, event.method, event.url, url_attributes))

    def _attempt(self, event: AttemptEvent) -> None:
        call = self._call.get()
        if call is None:
            return
        _end_attempt(call, None)
        step_send = (event.method, event.url) == (call.method, call.url)
        # Trace context goes to the tool's own origin only (a status URL may be elsewhere).
        same_origin = step_send or origin_of(event.url) == origin_of(call.url)
        if not call.span.is_recording():  # no SDK, or sampled out: pass the context on as is
            if same_origin:
                _W3C.inject(event.headers, context=trace.set_span_in_context(call.span))
            return
        attributes: dict[str, Any] = {"http.request.method": event.method}
        attributes.update(call.url_attributes if step_send else _url_attributes(event.url))
        if step_send:
            attributes["agentkey.attempt"] = event.attempt
            if event.attempt > 1:
                attributes["http.request.resend_count"] = event.attempt - 1
        else:
            attributes["agentkey.poll"] = event.attempt  # a GET of the status URL
        call.attempt = self._tracer.start_span(
            event.method,
            context=trace.set_span_in_context(call.span),
            kind=SpanKind.CLIENT,
            attributes=attributes,
        )
        if same_origin:
            _W3C.inject(event.headers, context=trace.set_span_in_context(call.attempt))

    def _note(self, event: RetryEvent | PollEvent | ReplayEvent | GiveUpEvent) -> None:
        call = self._call.get()
        if call is None:
            return
        if isinstance(event, RetryEvent):
            _end_attempt(call, event.status_code)
            name = "agentkey.wait_in_flight" if event.status_code == 409 else "agentkey.retry"
            attributes: dict[str, Any] = {
                "agentkey.attempt": event.attempt,
                "agentkey.reason": event.reason,
                "agentkey.wait": event.wait,
            }
            if event.status_code is not None:
                attributes["http.response.status_code"] = event.status_code
            call.span.add_event(name, attributes)
        elif isinstance(event, PollEvent):
            _end_attempt(call, None)
            call.span.add_event(
                "agentkey.poll",
                {
                    "agentkey.poll": event.poll,
                    "agentkey.state": event.state,
                    "agentkey.wait": event.wait,
                    "agentkey.status_url": redact_url(event.status_url),
                },
            )
        elif isinstance(event, ReplayEvent):
            call.span.set_attribute("agentkey.replayed", True)
            call.span.add_event("agentkey.replay", {"http.response.status_code": event.status_code})
        else:
            call.span.add_event(
                "agentkey.give_up",
                {
                    "agentkey.attempts": event.attempts,
                    "agentkey.polls": event.polls,
                    "agentkey.reason": event.reason,
                    "error.type": event.error,
                },
            )

    def _end(self, event: CallEndEvent) -> None:
        call = self._call.get()
        if call is None:
            return
        self._call.set(None)
        _end_attempt(call, event.status_code)
        span = call.span
        span.set_attribute("agentkey.attempts", event.attempts)
        span.set_attribute("agentkey.polls", event.polls)
        if event.outcome is not None:
            span.set_attribute("agentkey.outcome", event.outcome)
        if event.status_code is not None:
            span.set_attribute("http.response.status_code", event.status_code)
        _close(call, error=event.error)

    # --- token providers -----------------------------------------------------------------

    def _token_event(self, event: TokenEvent) -> None:
        if event.phase == "start":
            call = self._call.get()
            parent = call.attempt or call.span if call is not None else None
            context = trace.set_span_in_context(parent) if parent is not None else None
            grant = event.grant
            origin = urlsplit(event.endpoint_origin)
            attributes: dict[str, Any] = {"agentkey.grant": grant}
            if origin.hostname:
                attributes["server.address"] = origin.hostname
                attributes["server.port"] = origin.port or (443 if origin.scheme == "https" else 80)
            self._token.set(
                self._tracer.start_span(
                    f"agentkey.token {grant}" if grant else "agentkey.token",
                    context=context,
                    kind=SpanKind.CLIENT,
                    attributes=attributes,
                )
            )
        else:
            span = self._token.get()
            if span is None:
                return
            self._token.set(None)
            span.set_attribute("agentkey.attempts", event.attempts)
            if event.error:
                span.set_attribute("error.type", event.error)
                span.set_status(Status(StatusCode.ERROR, event.error))
            span.end()

    # --- server middleware ---------------------------------------------------------------

    def _decision(self, event: object) -> None:
        span = trace.get_current_span()
        if not span.get_span_context().is_valid:
            return  # no server span to describe (the app runs without OTel instrumentation)
        decision = str(getattr(event, "decision", ""))
        attributes: dict[str, Any] = {"agentkey.decision": decision}
        key = getattr(event, "idempotency_key", None)
        if key:
            attributes["idempotency.key"] = shown_key(str(key))
        status = getattr(event, "status_code", None)
        if isinstance(status, int):
            attributes["agentkey.decision_status_code"] = status
        if span.is_recording():
            span.set_attributes(attributes)
            span.add_event("agentkey.decision", attributes)
            return
        # The server span already ended (the ASGI instrumentation ends it with the last body
        # chunk, and the decision may be reported after that): a child span carries it.
        self._tracer.start_span(
            "agentkey.decision", context=trace.set_span_in_context(span), attributes=attributes
        ).end()


def _url_attributes(url: str) -> dict[str, Any]:
    """``url.full`` without query, fragment or userinfo, and the server's address and port."""
    parts = urlsplit(url)
    attributes: dict[str, Any] = {"url.full": redact_url(url)}
    if parts.hostname:
        attributes["server.address"] = parts.hostname
        attributes["server.port"] = parts.port or (443 if parts.scheme == "https" else 80)
    return attributes


def _end_attempt(call: _Call, status_code: int | None) -> None:
    span, call.attempt = call.attempt, None
    if span is None:
        return
    if status_code is not None:
        span.set_attribute("http.response.status_code", status_code)
        if status_code >= 400:  # HTTP client semantic conventions: 4xx and 5xx are errors
            span.set_attribute("error.type", str(status_code))
            span.set_status(Status(StatusCode.ERROR))
    span.end()


def _close(call: _Call, *, error: str | None) -> None:
    _end_attempt(call, None)
    if error:
        call.span.set_attribute("error.type", error)
        call.span.set_status(Status(StatusCode.ERROR, error))
    call.span.end()
