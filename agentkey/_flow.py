"""The invoker's state machine across answers, without I/O (like ``httpx.Auth.auth_flow``).

A flow is a generator. It yields an effect, :class:`Outgoing` (send this) or
:class:`Sleep` (wait this long), and receives the reply (an ``Answer`` or
``Failure`` for ``Outgoing``, None after ``Sleep``). It returns
:class:`Finished`. It reads time only through the injected ``clock`` and
reports only through the injected hooks, so a test drives it with a fake clock
and no socket. The decisions about one answer are ``_protocol``'s; the waits are
``_schedule``'s; the drivers in ``_invoker`` only send and sleep.

```
CallStart ─▶ (Attempt ─▶ send ─▶ classify ─▶ Retry+Sleep)* ─▶ (Sleep ─▶ Attempt ─▶ poll)* ─▶ CallEnd
```

One deadline rule: every wait is cut to the time left, and no new request or
poll starts once the deadline has passed; every request carries the call's
deadline (``RetryPolicy.deadline`` from the first send).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import TypeAlias

from ._exceptions import ConfigurationError, InvokeError, PollTimeout
from ._hooks import (
    AttemptEvent,
    CallEndEvent,
    CallStartEvent,
    GiveUpEvent,
    InvokeEvent,
    InvokeHook,
    PollEvent,
    ReplayEvent,
    RetryEvent,
    _one_line,
)
from ._net import redact_url
from ._policy import PollPolicy, RetryPolicy
from ._protocol import (
    Action,
    Answer,
    CallContext,
    Decision,
    ProtocolConfig,
    Reply,
    budget_exhausted,
    classify,
    interpret_poll,
    poll_target,
)
from ._schedule import Backoff

__all__ = [
    "HOOK_OWNED",
    "KEY_HEADER",
    "Call",
    "Effect",
    "Finished",
    "Flow",
    "Outgoing",
    "Settings",
    "Sleep",
    "check_headers",
    "invoke",
    "resume",
]

KEY_HEADER = "Idempotency-Key"
MAX_POLL_REDIRECTS = 10
#: Header names agentkey sets itself; an AttemptEvent hook may add any other (``traceparent``).
HOOK_OWNED = frozenset(
    {
        "idempotency-key",
        "authorization",
        "proxy-authorization",
        "cookie",
        "host",
        "accept",
        "accept-encoding",
        "transfer-encoding",
    }
)
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 field-name
_FIELD_VALUE = re.compile(r"(?:[\x21-\x7e](?:[\x20-\x7e\t]*[\x21-\x7e])?)?")  # visible ASCII


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One request the flow wants sent.

    ``same_origin`` requests go through the invoker's auth and the client's
    defaults; any other request is built bare: no auth, no client headers or
    cookies, no Idempotency-Key, and sent past the client's cookie jar (so
    another origin's cookies never land there, and never reach the tool).
    ``deadline`` (on the flow's clock, ``time.monotonic()`` in the drivers)
    bounds the whole exchange.
    """

    method: str
    url: str
    # Kept out of repr: user headers carry API keys, and error trackers record frame locals.
    headers: tuple[tuple[str, str], ...] = field(repr=False)
    content: bytes | None
    same_origin: bool
    deadline: float | None = None


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait ``seconds`` before the next effect (then send None back)."""

    seconds: float


Effect: TypeAlias = Outgoing | Sleep


@dataclass(frozen=True, slots=True)
class Call:
    """Everything one logical call needs, computed once before the first send."""

    url: str
    method: str
    headers: tuple[tuple[str, str], ...] = field(repr=False)  # the user's (checked)
    key: str  # the raw key, for events and errors
    label: str | None  # the step label, e.g. step_003
    key_value: str  # the Idempotency-Key header value in the configured style
    body: bytes
    tool: str | None = None  # the step's tool, for events


@dataclass(frozen=True, slots=True)
class Settings:
    """One invoker's fixed inputs to every flow: config, policies, hooks, clock."""

    protocol: ProtocolConfig
    retry: RetryPolicy
    polling: PollPolicy
    hooks: tuple[InvokeHook, ...]
    clock: Callable[[], float]
    rng: Callable[[], float] = random.random
    steps: Backoff = field(init=False)
    polls: Backoff = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", self.retry.schedule)
        object.__setattr__(self, "polls", self.polling.schedule)


@dataclass(frozen=True, slots=True)
class Finished:
    """The answer that ends a flow, and how the flow got there."""

    answer: Answer
    key: str
    label: str | None
    replayed: bool
    attempts: int
    polls: int
    elapsed: float
    status_url: str | None


Flow: TypeAlias = Generator[Effect, "Reply | None", Finished]


def invoke(call: Call, settings: Settings) -> Flow:
    """The flow of one step: send it (same key on every resend), then poll a 202 to its end."""
    run = _Run(call, settings)
    return run.observed(run.step()) if settings.hooks else run.step()  # no hook: no event


def resume(call: Call, settings: Settings) -> Flow:
    """The flow that finishes polling ``call.url`` after a PollTimeout, sending no step."""
    run = _Run(call, settings)
    flow = run.poll(call.url, False)
    return run.observed(flow) if settings.hooks else flow


def check_headers(
    headers: Mapping[str, str],
    owned: frozenset[str],
    who: str,
    owned_prefixes: tuple[str, ...] = (),
) -> tuple[tuple[str, str], ...]:
    """``headers`` as pairs, each a valid HTTP field; names agentkey owns are refused.

    ``owned`` holds lowercase names, ``owned_prefixes`` lowercase prefixes (``content-``).
    """
    out = []
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise ConfigurationError(f"{who} must map str names to str values")
        if not _TOKEN.fullmatch(name):
            raise ConfigurationError(
                f"{who} holds {name!r}, which is not a valid HTTP header name "
                "(letters, digits and !#$%&'*+-.^_`|~ only)"
            )
        if not _FIELD_VALUE.fullmatch(value):
            # The value is never echoed: headers= is where API keys travel.
            raise ConfigurationError(
                f"the value of header {name!r} holds a character HTTP cannot carry (a line "
                "break, a control character or non-ASCII text); encode it (e.g. base64 or "
                "percent-encoding) before passing it"
            )
        lower = name.lower()
        if lower in owned or lower.startswith(owned_prefixes):
            raise ConfigurationError(
                f"{who} cannot set {name!r}: agentkey sets it (the key comes from the step "
                "or idempotency_key=, credentials from auth=, the body is canonical JSON, and "
                "answers are decoded by agentkey with a size limit)"
            )
        out.append((name, value))
    return tuple(out)


class _Run:
    """The state of one flow: what was sent, what came back, on which clock."""

    def __init__(self, call: Call, settings: Settings) -> None:
        self.call, self.s = call, settings
        self.start = settings.clock()
        self.deadline = self.start + settings.retry.deadline  # bounds every send and poll
        self.attempts = self.polls = 0

    def ctx(self) -> CallContext:
        return CallContext(self.call.key, self.call.label, self.attempts, self.polls)

    def emit(self, event: InvokeEvent) -> None:
        for hook in self.s.hooks:
            hook(event)

    def observed(self, flow: Flow) -> Flow:
        """``flow`` between a CallStartEvent and a CallEndEvent that says how it ended.

        The drivers throw their own failures (a cancellation, a request that cannot be
        built) into the flow, so the CallEndEvent names those too.
        """
        call = self.call
        self.emit(CallStartEvent(call.key, call.label, call.method, call.url, call.tool))
        try:
            done = yield from flow
        except GeneratorExit:
            raise
        except BaseException as exc:
            status = getattr(exc, "status_code", None)
            error = type(exc).__name__
            self.emit(
                CallEndEvent(call.key, call.label, None, self.attempts, self.polls, status, error)
            )
            raise
        outcome = "replayed" if done.replayed else "executed"
        status = done.answer.status_code
        self.emit(
            CallEndEvent(call.key, call.label, outcome, done.attempts, done.polls, status, None)
        )
        return done

    def outgoing(
        self,
        method: str,
        url: str,
        headers: tuple[tuple[str, str], ...],
        body: bytes | None,
        same_origin: bool,
        number: int,
    ) -> Outgoing:
        """The request to send, after the AttemptEvent hooks added their headers."""
        if self.s.hooks:
            extra: dict[str, str] = {}
            self.emit(AttemptEvent(self.call.key, self.call.label, number, method, url, extra))
            if extra:
                hooked = check_headers(extra, HOOK_OWNED, "an AttemptEvent hook", ("content-",))
                headers = (*headers, *hooked)
        return Outgoing(method, url, headers, body, same_origin, self.deadline)

    def wait(
        self, schedule: Backoff, tries: int, hint: float | None, deadline: float
    ) -> float | None:
        """The wait after ``tries`` tries, cut to ``deadline``; None once it has passed."""
        left = deadline - self.s.clock()
        return None if left <= 0 else min(schedule.delay(tries, hint, rng=self.s.rng), left)

    def give_up(self, reason: str, error: InvokeError) -> InvokeError:
        self.emit(
            GiveUpEvent(
                self.call.key,
                self.call.label,
                self.attempts,
                self.polls,
                reason,
                type(error).__name__,
            )
        )
        return error

    def finish(self, answer: Answer, replayed: bool, status_url: str | None) -> Finished:
        elapsed = self.s.clock() - self.start
        key, label = self.call.key, self.call.label
        return Finished(
            answer, key, label, replayed, self.attempts, self.polls, elapsed, status_url
        )

    def step(self) -> Flow:
        call, s = self.call, self.s
        headers = (
            *call.headers,
            ("Content-Type", "application/json"),
            ("Accept", "application/json"),
            (KEY_HEADER, call.key_value),
        )
        url, ambiguous, in_flight = call.url, False, False
        while True:
            out = self.outgoing(call.method, url, headers, call.body, True, self.attempts + 1)
            reply = yield out
            assert reply is not None
            self.attempts += 1
            decision = classify(reply, self.ctx(), s.protocol)
            ambiguous = ambiguous or decision.ambiguous
            in_flight = in_flight or decision.in_flight
            if not decision.retry:
                break
            url = decision.url if decision.action is Action.FOLLOW and decision.url else url
            wait = self.wait(s.steps, self.attempts, decision.retry_after, self.deadline)
            if wait is None or self.attempts >= s.retry.max_attempts:
                break
            self.emit(
                RetryEvent(
                    call.key, call.label, self.attempts, decision.reason, wait, decision.status_code
                )
            )
            if wait > 0:
                yield Sleep(wait)
            if s.clock() >= self.deadline:
                break  # the deadline passed during the wait: the last answer stands
        if decision.retry:
            error = budget_exhausted(
                decision, self.ctx(), saw_ambiguous=ambiguous, saw_in_flight=in_flight
            )
            raise self.give_up(decision.reason, error)
        if decision.replayed:
            assert isinstance(reply, Answer)
            self.emit(ReplayEvent(call.key, call.label, reply.status_code))
        if decision.action is Action.RAISE:
            assert decision.error is not None
            raise decision.error
        assert isinstance(reply, Answer)
        if decision.action is Action.DONE:
            return self.finish(reply, decision.replayed, None)
        assert decision.url is not None
        if decision.action is Action.FETCH:  # 303: the result is there already
            return (yield from self.poll(decision.url, decision.replayed, result_only=True))
        hint = interpret_poll(reply, self.ctx(), s.protocol).retry_after
        return (yield from self.poll(decision.url, decision.replayed, wait_first=True, hint=hint))

    def poll(
        self,
        status_url: str,
        replayed: bool,
        *,
        wait_first: bool = False,
        hint: float | None = None,
        result_only: bool = False,
    ) -> Flow:
        """Poll ``status_url``; ``wait_first``: wait (``hint``: the 202's Retry-After) first."""
        # Polls end at the poll deadline or the caller's deadline, whichever comes first.
        call, s = self.call, self.s
        deadline = min(s.clock() + s.polling.deadline, self.deadline)
        url, hops = status_url, 0
        wait = self.wait(s.polls, 1, hint, deadline) if wait_first else None
        while True:
            same_origin = poll_target(url, self.ctx(), s.protocol)  # raises UnsafeRedirect
            if wait:
                if self.polls == 0:  # the wait between the 202 and the first poll
                    self.emit(PollEvent(call.key, call.label, 0, url, "accepted", wait))
                yield Sleep(wait)
            # Same origin: the step's key goes along so the tool can correlate the poll; any
            # other (explicitly allowed) origin gets neither key, credentials nor user headers.
            headers = (
                (*call.headers, ("Accept", "application/json"), (KEY_HEADER, call.key_value))
                if same_origin
                else (("Accept", "application/json"),)
            )
            reply = yield self.outgoing("GET", url, headers, None, same_origin, self.polls + 1)
            assert reply is not None
            self.polls += 1
            decision = interpret_poll(reply, self.ctx(), s.protocol, result_only=result_only)
            if decision.action is Action.DONE:
                assert isinstance(reply, Answer)
                return self.finish(reply, replayed, status_url)
            if decision.action is Action.RAISE:
                assert decision.error is not None
                raise decision.error
            if decision.action in (Action.FOLLOW, Action.FETCH):
                assert decision.url is not None
                hops += 1
                if hops > MAX_POLL_REDIRECTS:
                    raise self.ctx().error(
                        InvokeError, f"polling {self.ctx().where()} redirected too often"
                    )
                url, wait = decision.url, None
                result_only = result_only or decision.action is Action.FETCH
                continue
            wait = self.wait(s.polls, self.polls, decision.retry_after, deadline)
            if wait is None:
                raise self.give_up(decision.reason, self._timeout(status_url, decision, deadline))
            self.emit(PollEvent(call.key, call.label, self.polls, url, decision.reason, wait))

    def _timeout(self, status_url: str, decision: Decision, deadline: float) -> PollTimeout:
        s, ctx = self.s, self.ctx()
        which = (
            f"the call's deadline (RetryPolicy.deadline={s.retry.deadline:g} s)"
            if deadline >= self.deadline
            else f"the poll deadline (PollPolicy.deadline={s.polling.deadline:g} s)"
        )
        return PollTimeout(
            f"{ctx.where()} was still {_one_line(decision.reason)!r} at "
            f"{redact_url(status_url)} after {self.polls} poll(s) and {which}; it has not "
            "failed. Call invoker.resume_poll(error.status_url, error.idempotency_key) "
            "later to finish it without sending the step again",
            status_url=status_url,
            idempotency_key=ctx.idempotency_key,
            step=ctx.step,
            attempts=ctx.attempts,
            status_code=decision.status_code,
        )
