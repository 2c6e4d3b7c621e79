"""The I/O-free protocol core: every decision the invoker makes, and nothing else.

It never opens a socket, never sleeps and never imports httpx. It sees an
:class:`Answer` (status, headers, body bytes, URL) or a :class:`Failure`
(a transport error, already sorted into "not sent" or "ambiguous") and says
what to do next:

```
answer ─▶ classify()       ─▶ DONE | POLL(url) | RETRY(hint) | FOLLOW(url) | FETCH(url) | RAISE
poll   ─▶ interpret_poll() ─▶ DONE | WAIT(hint) | FOLLOW(url) | FETCH(url) | RAISE
```

The rows of the wire contract (section 3) map one to one onto ``classify``;
section 4 (202 polling) onto the status-URL strategies and ``interpret_poll``.
"""

from __future__ import annotations

import enum
import ipaddress
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urljoin, urlsplit

from ._exceptions import (
    AuthenticationError,
    InvokeError,
    KeyRejected,
    OutcomeUnknown,
    PayloadMismatch,
    StepFailed,
    StepInProgress,
    ToolError,
    UnsafeRedirect,
)
from ._retry_after import parse_retry_after

__all__ = [
    "DEFAULT_REPLAY_HEADERS",
    "DEFAULT_STATUS_URL_STRATEGIES",
    "Action",
    "Answer",
    "BodyFieldStrategy",
    "CallContext",
    "Decision",
    "Failure",
    "FailureKind",
    "HeaderStrategy",
    "Origin",
    "ProtocolConfig",
    "Reply",
    "StatusUrlStrategy",
    "budget_exhausted",
    "classify",
    "find_status_url",
    "interpret_poll",
    "is_loopback",
    "origin_of",
    "parse_json",
    "poll_target",
    "replay_header",
]

#: Replay headers recognised by default (compared case-insensitively, value ``true``).
DEFAULT_REPLAY_HEADERS: tuple[str, ...] = (
    "Idempotent-Replayed",
    "Idempotent-Replay",
    "X-Idempotent-Replayed",
    "X-Idempotency-Replayed",
)

_SUCCEEDED = frozenset({"succeeded", "success", "completed", "complete", "done"})
_FAILED = frozenset({"failed", "failure", "canceled", "cancelled", "error"})
_REDIRECTS = frozenset({301, 302, 307, 308})


class FailureKind(enum.Enum):
    """What a transport error says about whether the request reached the tool."""

    NOT_SENT = "not sent"  # connect error, connect or pool timeout: the tool never saw it
    AMBIGUOUS = "ambiguous"  # read/write timeout, reset, protocol error: it may have run


@dataclass(frozen=True, slots=True)
class Failure:
    """A request that produced no HTTP answer."""

    kind: FailureKind
    description: str  # "read timeout", "connection reset", ... (never a header or token)


@dataclass(frozen=True, slots=True)
class Answer:
    """An HTTP answer, fully read. ``headers`` keys are lowercase."""

    status_code: int
    headers: Mapping[str, str]
    content: bytes
    url: str
    oversize: bool = False  # the body was over the invoker's max_response_bytes (not kept)

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())


Reply = Answer | Failure


@dataclass(frozen=True, slots=True, order=True)
class Origin:
    """scheme://host:port, with the default port filled in."""

    scheme: str
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"


def _unsendable(url: str) -> bool:
    """True when ``url`` holds a control character: httpx refuses it with its own error."""
    return any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in url)


def origin_of(url: str) -> Origin | None:
    """The origin of an absolute http(s) URL, or None when it has none (or cannot be sent)."""
    if _unsendable(url):
        return None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        return None
    return Origin(scheme, parts.hostname.lower(), port or (443 if scheme == "https" else 80))


def is_loopback(host: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8 and ::1: the hosts plain http may carry secrets to."""
    name = host.strip("[]").lower().rstrip(".")
    if name == "localhost":
        return True  # not "*.localhost": a resolver is free to send those elsewhere
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class ProtocolConfig:
    """What the core needs to know about one invoker."""

    base_origin: Origin
    retry_statuses: frozenset[int]
    replay_headers: tuple[str, ...] = DEFAULT_REPLAY_HEADERS
    allowed_poll_origins: frozenset[Origin] = frozenset()
    strategies: tuple[StatusUrlStrategy, ...] = field(default=())
    has_auth: bool = True  # the invoker sends credentials (auth=) to the tool's origin

    def __post_init__(self) -> None:
        if not self.strategies:
            object.__setattr__(self, "strategies", DEFAULT_STATUS_URL_STRATEGIES)

    def same_origin(self, url: str) -> bool:
        return origin_of(url) == self.base_origin


@dataclass(frozen=True, slots=True)
class CallContext:
    """Who an error concerns: the key, the step label and the attempts made so far."""

    idempotency_key: str
    step: str | None
    attempts: int
    polls: int = 0

    def where(self) -> str:
        step = f" (step {self.step})" if self.step else ""
        return f"key {self.idempotency_key!r}{step}"

    def error(
        self,
        cls: type[InvokeError],
        message: str,
        *,
        status_code: int | None = None,
        body: object = None,
    ) -> InvokeError:
        return cls(
            message,
            idempotency_key=self.idempotency_key,
            step=self.step,
            attempts=self.attempts,
            status_code=status_code,
            body=body,
        )


class Action(enum.Enum):
    DONE = "done"  # the answer is the result
    POLL = "poll"  # 202: poll ``url``
    RETRY = "retry"  # resend the same request, same key, after a wait
    FOLLOW = "follow"  # same-origin redirect: resend the same request to ``url``
    FETCH = "fetch"  # 303 See Other: GET ``url`` for the result
    WAIT = "wait"  # poll again after a wait
    RAISE = "raise"  # ``error`` is final


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do with one answer. ``retry`` and ``retry_after`` drive tenacity."""

    action: Action
    reason: str
    retry_after: float | None = None
    ambiguous: bool = False
    url: str | None = None
    error: InvokeError | None = None
    replayed: bool = False
    status_code: int | None = None

    @property
    def retry(self) -> bool:
        return self.action in (Action.RETRY, Action.FOLLOW, Action.WAIT)


def parse_json(content: bytes) -> object:
    """The parsed JSON body, or None when the body is empty or not JSON."""
    if not content.strip():
        return None
    try:
        return json.loads(content)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def replay_header(answer: Answer, names: Sequence[str]) -> bool:
    """True when one of the replay headers ``names`` says ``true``."""
    for name in names:
        value = answer.header(name)
        if value is not None and value.strip().lower() == "true":
            return True
    return False


def _retry_after(answer: Answer) -> float | None:
    return parse_retry_after(answer.header("retry-after"))


def _redirect_target(answer: Answer, ctx: CallContext, cfg: ProtocolConfig) -> str | Decision:
    location = answer.header("location")
    if not location:
        return Decision(
            Action.RAISE,
            "redirect without Location",
            status_code=answer.status_code,
            error=ctx.error(
                ToolError,
                f"the tool answered {answer.status_code} without a Location header for "
                f"{ctx.where()}; fix the tool or the route",
                status_code=answer.status_code,
                body=parse_json(answer.content),
            ),
        )
    target = urljoin(answer.url, location.strip())
    if _unsendable(target):
        return Decision(
            Action.RAISE,
            "unusable Location",
            status_code=answer.status_code,
            error=_bad_url(ctx, "a redirect", answer.status_code),
        )
    if not cfg.same_origin(target):
        return Decision(
            Action.RAISE,
            "cross-origin redirect",
            status_code=answer.status_code,
            error=_unsafe(ctx, target, "a redirect", answer.status_code),
        )
    return target


def _bad_url(ctx: CallContext, what: str, status: int | None) -> ToolError:
    error = ctx.error(
        ToolError,
        f"{what} for {ctx.where()} holds control characters, so it is not a URL agentkey can "
        "send; the tool must percent-encode its URLs",
        status_code=status,
    )
    assert isinstance(error, ToolError)
    return error


def _unsafe(ctx: CallContext, url: str, what: str, status: int | None) -> UnsafeRedirect:
    return UnsafeRedirect(
        f"{what} for {ctx.where()} points at {origin_of(url) or url!r}, another origin; "
        "agentkey never sends the key or credentials there. If that origin is yours, add it "
        "to allowed_poll_origins (polls only); redirects of the step itself are never followed "
        "across origins",
        url=url,
        idempotency_key=ctx.idempotency_key,
        step=ctx.step,
        attempts=ctx.attempts,
        status_code=status,
    )


def classify(reply: Reply, ctx: CallContext, cfg: ProtocolConfig) -> Decision:
    """Decide what one answer to the step's request means (contract section 3)."""
    if isinstance(reply, Failure):
        ambiguous = reply.kind is FailureKind.AMBIGUOUS
        return Decision(Action.RETRY, reply.description, ambiguous=ambiguous)

    if reply.oversize:
        return _oversize(reply, ctx, "the tool")
    status = reply.status_code
    replayed = replay_header(reply, cfg.replay_headers)
    if 200 <= status < 300:
        if status == 202:
            url = find_status_url(reply, cfg.strategies)
            if url is not None:
                return Decision(
                    Action.POLL, "accepted", url=url, replayed=replayed, status_code=status
                )
        return Decision(Action.DONE, "done", replayed=replayed, status_code=status)

    body = parse_json(reply.content)
    if status == 401:
        return Decision(
            Action.RAISE,
            "unauthorized",
            status_code=status,
            error=ctx.error(
                AuthenticationError,
                f"the tool refused the credentials (401) for {ctx.where()}, even after the "
                "auth layer's refresh; check the token's scopes and audience"
                if cfg.has_auth
                else f"the tool answered 401 for {ctx.where()}: it wants credentials and the "
                "invoker has no auth=; pass a token provider such as "
                "agentkey.ClientCredentials(...) or StaticToken(...) as auth=",
                status_code=status,
                body=body,
            ),
        )
    if replayed:
        cls: type[InvokeError] = {400: KeyRejected, 422: PayloadMismatch}.get(status, ToolError)
        return Decision(
            Action.RAISE,
            "replayed error",
            status_code=status,
            replayed=True,
            error=ctx.error(
                cls,
                f"the tool replayed the stored outcome {status} of an earlier attempt of "
                f"{ctx.where()}; it is final: resending the same key replays it again. "
                "Inspect the error body and decide (a new step or args give a new key)",
                status_code=status,
                body=body,
            ),
        )
    if status == 303:
        target = _redirect_target(reply, ctx, cfg)
        if isinstance(target, Decision):
            return target
        return Decision(Action.FETCH, "see other", url=target, status_code=status)
    if status in _REDIRECTS:
        target = _redirect_target(reply, ctx, cfg)
        if isinstance(target, Decision):
            return target
        return Decision(
            Action.FOLLOW, f"redirect {status}", url=target, retry_after=0.0, status_code=status
        )
    if status in cfg.retry_statuses:
        if status == 409:
            reason, ambiguous, hint = "conflict: in flight", False, _retry_after(reply)
        elif status in (429, 503):
            reason, ambiguous, hint = f"overloaded ({status})", False, _retry_after(reply)
        elif status >= 500:
            reason, ambiguous, hint = f"server error {status}", True, None
        else:
            reason, ambiguous, hint = f"status {status}", False, _retry_after(reply)
        return Decision(
            Action.RETRY, reason, retry_after=hint, ambiguous=ambiguous, status_code=status
        )
    return Decision(
        Action.RAISE, f"status {status}", status_code=status, error=_final(reply, body, ctx)
    )


def _oversize(answer: Answer, ctx: CallContext, who: str) -> Decision:
    status = answer.status_code
    ran = (
        "the step ran; invoking it again with the same key replays the stored answer"
        if 200 <= status < 300
        else "the answer was not read"
    )
    return Decision(
        Action.RAISE,
        "answer too large",
        status_code=status,
        error=ctx.error(
            ToolError,
            f"{who} answered {status} for {ctx.where()} with a body larger than "
            f"max_response_bytes, so agentkey did not read it ({ran}). Raise "
            "max_response_bytes on the invoker if such answers are expected",
            status_code=status,
        ),
    )


def _final(answer: Answer, body: object, ctx: CallContext) -> InvokeError:
    status = answer.status_code
    if status == 422:
        return ctx.error(
            PayloadMismatch,
            f"the tool answered 422 for {ctx.where()}: the body does not match the key's "
            "args_hash. The key and body must come from the same Step; do not edit either",
            status_code=status,
            body=body,
        )
    if status == 400:
        return ctx.error(
            KeyRejected,
            f"the tool answered 400 for {ctx.where()}: it rejected the request or its "
            "Idempotency-Key. See error.body for the tool's reason; for a key problem check "
            "key_header_style ('raw' or 'sf-string')",
            status_code=status,
            body=body,
        )
    if status == 409:
        return ctx.error(
            StepInProgress,
            f"the tool answered 409 for {ctx.where()}: the same key is still in flight and 409 "
            "is not in retry_statuses; resend the same key later",
            status_code=status,
            body=body,
        )
    if status >= 500:
        return ctx.error(
            OutcomeUnknown,
            f"the tool answered {status} for {ctx.where()} and {status} is not retried: the "
            "step may have run. Resending later with the same key is safe",
            status_code=status,
            body=body,
        )
    return ctx.error(
        ToolError,
        f"the tool answered {status} for {ctx.where()}; this is final (not retried). "
        "See error.body, then fix the request, route or permissions",
        status_code=status,
        body=body,
    )


def budget_exhausted(last: Decision, ctx: CallContext, *, saw_ambiguous: bool) -> InvokeError:
    """The error once the retry budget ran out with ``last`` still asking for a retry."""
    if last.status_code == 409:
        return ctx.error(
            StepInProgress,
            f"{ctx.where()} was still in flight (409) after {ctx.attempts} attempt(s): another "
            "caller holds it. Resend the same key later to get its outcome",
            status_code=409,
        )
    if saw_ambiguous:
        what = "the step may have run"
    else:
        what = "as far as agentkey can tell the tool did not run it"
    return ctx.error(
        OutcomeUnknown,
        f"gave up on {ctx.where()} after {ctx.attempts} attempt(s), last: {last.reason}; "
        f"outcome unknown ({what}). Resending later with the same key is safe: the tool "
        "replays the stored outcome instead of running the step twice",
        status_code=last.status_code,
    )


# --- 202 status URL strategies (contract section 4), tried in order ---------------------------


class StatusUrlStrategy(Protocol):
    """One way to find a 202's status URL. Strategies are tried in order."""

    @property
    def name(self) -> str: ...

    def can_poll(self, answer: Answer) -> bool: ...

    def status_url(self, answer: Answer) -> str: ...


@dataclass(frozen=True, slots=True)
class HeaderStrategy:
    """The status URL is in a header (``Operation-Location``, ``Location``, ...)."""

    name: str

    def can_poll(self, answer: Answer) -> bool:
        return bool((answer.header(self.name) or "").strip())

    def status_url(self, answer: Answer) -> str:
        return urljoin(answer.url, (answer.header(self.name) or "").strip())


@dataclass(frozen=True, slots=True)
class BodyFieldStrategy:
    """The status URL is a string field of the JSON body (``status_url``, ``operation.url``)."""

    name: str

    def _value(self, answer: Answer) -> str | None:
        node = parse_json(answer.content)
        for part in self.name.split("."):
            if not isinstance(node, dict):
                return None
            node = node.get(part)
        return node.strip() if isinstance(node, str) and node.strip() else None

    def can_poll(self, answer: Answer) -> bool:
        return self._value(answer) is not None

    def status_url(self, answer: Answer) -> str:
        return urljoin(answer.url, self._value(answer) or "")


DEFAULT_STATUS_URL_STRATEGIES: tuple[StatusUrlStrategy, ...] = (
    HeaderStrategy("Operation-Location"),
    HeaderStrategy("Azure-AsyncOperation"),
    HeaderStrategy("Location"),
    BodyFieldStrategy("status_url"),
    BodyFieldStrategy("href"),
    BodyFieldStrategy("operation.url"),
)


def find_status_url(answer: Answer, strategies: Sequence[StatusUrlStrategy]) -> str | None:
    """The status URL of a 202 answer, resolved against its URL, or None."""
    for strategy in strategies:
        if strategy.can_poll(answer):
            return strategy.status_url(answer)
    return None


def poll_target(url: str, ctx: CallContext, cfg: ProtocolConfig) -> bool:
    """Check a status URL: True when same-origin (auth applies), False when explicitly allowed.

    Raises :class:`UnsafeRedirect` for any other origin, :class:`ToolError` for a URL
    holding control characters.
    """
    if _unsendable(url):
        raise _bad_url(ctx, "the status URL", None)
    origin = origin_of(url)
    if origin == cfg.base_origin:
        return True
    if origin is not None and origin in cfg.allowed_poll_origins:
        return False
    raise _unsafe(ctx, url, "the status URL", None)


def _state(body: object) -> str | None:
    if not isinstance(body, dict):
        return None
    for name in ("status", "state"):
        value = body.get(name)
        if isinstance(value, str):
            return value.strip().lower().replace("-", "_").replace(" ", "_")
    return None


def interpret_poll(
    reply: Reply, ctx: CallContext, cfg: ProtocolConfig, *, result_only: bool = False
) -> Decision:
    """Decide what one poll answer means (contract section 4).

    ``result_only`` is set after a ``303 See Other``: the answer is the result
    itself, whatever fields it has.
    """
    if isinstance(reply, Failure):
        return Decision(Action.WAIT, reply.description)
    if reply.oversize:
        return _oversize(reply, ctx, "a poll")
    status = reply.status_code
    body = parse_json(reply.content)
    if status == 202:
        return Decision(Action.WAIT, "accepted", retry_after=_retry_after(reply))
    if status == 303 or status in _REDIRECTS:
        location = reply.header("location")
        if not location:
            return Decision(
                Action.RAISE,
                "redirect without Location",
                status_code=status,
                error=ctx.error(
                    ToolError,
                    f"a poll for {ctx.where()} answered {status} without a Location header",
                    status_code=status,
                    body=body,
                ),
            )
        target = urljoin(reply.url, location.strip())
        action = Action.FETCH if status == 303 else Action.FOLLOW
        return Decision(action, f"poll redirect {status}", url=target, status_code=status)
    if 200 <= status < 300:
        if result_only:
            return Decision(Action.DONE, "result", status_code=status)
        return _poll_state(reply, body, ctx)
    if status == 401:
        return classify(reply, ctx, cfg)
    if status in (408, 409, 425, 429, 500, 502, 503, 504):
        return Decision(
            Action.WAIT,
            f"poll answered {status}",
            retry_after=_retry_after(reply),
            status_code=status,
        )
    return Decision(
        Action.RAISE,
        f"poll status {status}",
        status_code=status,
        error=ctx.error(
            ToolError,
            f"polling {ctx.where()} answered {status}; the status URL is no longer usable. "
            "Ask the tool for the operation's outcome",
            status_code=status,
            body=body,
        ),
    )


def _poll_state(answer: Answer, body: object, ctx: CallContext) -> Decision:
    state = _state(body)
    status = answer.status_code
    if state is None and isinstance(body, dict) and isinstance(body.get("done"), bool):
        if not body["done"]:
            return Decision(Action.WAIT, "running", retry_after=_retry_after(answer))
        state = "failed" if body.get("error") is not None else "succeeded"  # AIP-151
    if state is None or state in _SUCCEEDED:
        return Decision(Action.DONE, state or "done", status_code=status)
    if state in _FAILED:
        return Decision(
            Action.RAISE,
            state,
            status_code=status,
            error=ctx.error(
                StepFailed,
                f"the asynchronous operation of {ctx.where()} reported {state!r}; it is final. "
                "See the error body; a retry needs a new step or new arguments",
                status_code=status,
                body=body,
            ),
        )
    # running, pending, queued, in_progress, notstarted, or a state we do not know yet
    return Decision(Action.WAIT, state, retry_after=_retry_after(answer))
