"""Instrumentation: frozen event records and the hook Protocol that receives them.

A hook is any callable taking one event. The invoker calls every hook, in
order, when a call starts, before each request is sent, for each retry, poll,
replay and give-up, and when the call ends. An exception raised by a hook
propagates (a broken hook is a bug to see, not to hide). Events carry the
key, never a token or a header value. An :class:`AttemptEvent` hook may add
headers such as ``traceparent`` to the request about to be sent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol, TypeAlias, runtime_checkable

from .._keys import shown_key

__all__ = [
    "AttemptEvent",
    "CallEndEvent",
    "CallStartEvent",
    "GiveUpEvent",
    "InvokeEvent",
    "InvokeHook",
    "LoggingHook",
    "PollEvent",
    "RepeatEvent",
    "ReplayEvent",
    "RetryEvent",
]

logger = logging.getLogger("agentkey")

#: Why a resend is safe, for the retry log line: only the tool's honouring the key makes
#: "at most once" true; otherwise agentkey resends only what the tool did not run.
_WHY_SAFE = {
    True: "same key: the tool honours it, so the step runs at most once",
    False: "the last attempt did not run the step: sending it again is safe",
}


@dataclass(frozen=True, slots=True)
class CallStartEvent:
    """One ``invoke`` (or ``resume_poll``) starts: ``url`` is the step's (or the status) URL."""

    idempotency_key: str
    step: str | None
    method: str
    url: str
    tool: str | None = None  # the step's tool (None when resuming a poll)


@dataclass(frozen=True, slots=True)
class AttemptEvent:
    """A request of the call is about to be sent.

    ``attempt`` numbers the step's sends (1 for the first) and, for a poll (a
    ``GET`` of the status URL), the polls. A hook may add headers to ``headers``
    (it starts empty), e.g. trace context (``traceparent``); the names agentkey
    sets itself (Authorization, Idempotency-Key, Cookie, Host, Accept,
    Content-*) are refused with :class:`~agentkey.ConfigurationError`. Added
    headers go to whatever ``url`` is, so a hook adds nothing secret.
    """

    idempotency_key: str
    step: str | None
    attempt: int
    method: str
    url: str
    headers: dict[str, str]


@dataclass(frozen=True, slots=True)
class CallEndEvent:
    """The call ended: with a result (``outcome`` "executed", "replayed" or "answered": the
    server showed neither) or an ``error``.

    ``error`` is the class name of the exception leaving ``invoke`` (None on success);
    ``status_code`` is that of the final answer, or of the error when it has one.
    """

    idempotency_key: str
    step: str | None
    outcome: str | None
    attempts: int
    polls: int
    status_code: int | None
    error: str | None


@dataclass(frozen=True, slots=True)
class RetryEvent:
    """The step's request is about to be resent with the same key after ``wait`` seconds.

    ``honoured`` says whether the tool is known to honour Idempotency-Key (declared,
    or shown by an answer). When it is not, agentkey resends only what did not run
    (nothing reached the tool, or it answered "overloaded" or "in flight").
    """

    idempotency_key: str
    step: str | None
    attempt: int  # the attempt that just failed (1 for the first)
    reason: str  # "conflict: in flight", "ReadTimeout", "server error 502", ...
    wait: float
    status_code: int | None
    honoured: bool = False


@dataclass(frozen=True, slots=True)
class PollEvent:
    """A poll answered ``state``; the next poll follows after ``wait`` seconds."""

    idempotency_key: str
    step: str | None
    poll: int  # polls made so far
    status_url: str
    state: str
    wait: float


@dataclass(frozen=True, slots=True)
class ReplayEvent:
    """The tool replayed the stored outcome of an earlier attempt instead of running again."""

    idempotency_key: str
    step: str | None
    status_code: int


@dataclass(frozen=True, slots=True)
class RepeatEvent:
    """The call repeats an earlier step of its plan (same tool, same arguments) and is sent
    under that step's key, so the tool answers with that step's result (``repeat_of``)."""

    idempotency_key: str
    step: str | None
    repeat_of: str
    tool: str | None


@dataclass(frozen=True, slots=True)
class GiveUpEvent:
    """The invoker gave up on the step: its budget or deadline ran out.

    ``error`` is the class name of the error about to be raised
    (``OutcomeUnknown``, ``StepInProgress``, ``PollTimeout``).
    """

    idempotency_key: str
    step: str | None
    attempts: int
    polls: int
    reason: str  # the last answer: "in flight (409)", "ReadTimeout", ...
    error: str


#: Any event a hook receives.
InvokeEvent: TypeAlias = (
    CallStartEvent
    | AttemptEvent
    | RetryEvent
    | PollEvent
    | ReplayEvent
    | RepeatEvent
    | GiveUpEvent
    | CallEndEvent
)


#: Every event type: what a hook listens to unless it is a plain :class:`LoggingHook`.
EVENT_TYPES: frozenset[type] = frozenset(
    {
        CallStartEvent,
        AttemptEvent,
        RetryEvent,
        PollEvent,
        ReplayEvent,
        RepeatEvent,
        GiveUpEvent,
        CallEndEvent,
    }
)
# What a LoggingHook logs, by the lowest level its logger is enabled for.
_AT_WARNING: frozenset[type] = frozenset({RetryEvent, RepeatEvent, GiveUpEvent})
_AT_INFO = _AT_WARNING | {PollEvent, ReplayEvent}
_AT_DEBUG = _AT_INFO | {CallStartEvent, CallEndEvent}
_SILENT: frozenset[type] = frozenset()


def listened(hooks: tuple[InvokeHook, ...]) -> frozenset[type]:
    """The event types ``hooks`` listen to now, so that no other event is built.

    Any hook listens to every event, except a :class:`LoggingHook` (not a subclass),
    which listens to those its logger would log at its level at this moment: with
    Python's default WARNING, retries, repeats and give-ups, and nothing on a call
    that goes through at the first attempt.
    """
    wanted = _SILENT
    for hook in hooks:
        if type(hook) is not LoggingHook:
            return EVENT_TYPES
        heard = hook._listened()
        wanted = heard if not wanted else wanted | heard
    return wanted


@runtime_checkable
class InvokeHook(Protocol):
    """Anything callable with one :data:`InvokeEvent`."""

    def __call__(self, event: InvokeEvent) -> None: ...


class LoggingHook:
    """The default hook: one ``logging`` record per event on the ``agentkey`` logger.

    Visible at Python's default level (WARNING): the first retry of a step,
    a call sent as a repeat of an earlier step, and every give-up. Later
    retries, polls and replays (the protocol working, not a problem) log at
    INFO; the start and end of each call at DEBUG. Only the key (as a digest:
    :func:`~agentkey._keys.shown_key`), step, attempt, state and wait are
    logged: never a token, a header or a body.
    """

    def __init__(self, logger_: logging.Logger | None = None) -> None:
        self._logger = logger_ or logger

    def __call__(self, event: InvokeEvent) -> None:
        log = self._logger
        if isinstance(event, RetryEvent):
            level = logging.WARNING if event.attempt == 1 else logging.INFO
            if log.isEnabledFor(level):
                log.log(
                    level,
                    "retrying key=%s step=%s attempt=%d reason=%s wait=%.3fs (%s)",
                    shown_key(event.idempotency_key),
                    event.step,
                    event.attempt,
                    _one_line(event.reason),
                    event.wait,
                    _WHY_SAFE[event.honoured],
                )
        elif isinstance(event, RepeatEvent):
            log.warning(
                "repeat key=%s tool=%s: the same call was made at %s of this plan, so it is "
                "sent under that step's key and the tool answers with that step's result "
                "(nothing runs twice); pass on_repeat='allow' to make it a new call",
                shown_key(event.idempotency_key),
                event.tool,
                event.repeat_of,
            )
        elif isinstance(event, GiveUpEvent):
            log.warning(
                "giving up key=%s step=%s attempts=%d polls=%d last=%s raising=%s",
                shown_key(event.idempotency_key),
                event.step,
                event.attempts,
                event.polls,
                _one_line(event.reason),
                event.error,
            )
        elif not log.isEnabledFor(logging.INFO):
            return  # the rest logs at INFO or DEBUG: nothing to build
        elif isinstance(event, PollEvent):
            log.info(
                "polling key=%s step=%s poll=%d state=%s wait=%.3fs",
                shown_key(event.idempotency_key),
                event.step,
                event.poll,
                _one_line(event.state),
                event.wait,
            )
        elif isinstance(event, ReplayEvent):
            log.info(
                "replayed key=%s step=%s status=%d",
                shown_key(event.idempotency_key),
                event.step,
                event.status_code,
            )
        elif not log.isEnabledFor(logging.DEBUG):
            return
        elif isinstance(event, CallStartEvent):
            log.debug(
                "calling key=%s step=%s method=%s",
                shown_key(event.idempotency_key),
                event.step,
                event.method,
            )
        elif isinstance(event, CallEndEvent):
            log.debug(
                "called key=%s step=%s outcome=%s attempts=%d polls=%d status=%s error=%s",
                shown_key(event.idempotency_key),
                event.step,
                event.outcome,
                event.attempts,
                event.polls,
                event.status_code,
                event.error,
            )

    def _listened(self) -> frozenset[type]:
        """The events this hook would log now (see :func:`listened`)."""
        log = self._logger
        if log.isEnabledFor(logging.INFO):
            return _AT_DEBUG if log.isEnabledFor(logging.DEBUG) else _AT_INFO
        return _AT_WARNING if log.isEnabledFor(logging.WARNING) else _SILENT

    def __repr__(self) -> str:
        return f"LoggingHook(logger={self._logger.name!r})"


def _one_line(text: str, limit: int = 64) -> str:
    """A server-chosen string (a poll state) made safe for one log line: no forged lines."""
    flat = "".join(ch if ch.isprintable() else "?" for ch in text)
    return flat if len(flat) <= limit else flat[:limit] + "..."
