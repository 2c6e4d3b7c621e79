"""Retry and poll policies: frozen, keyword-only, with production defaults.

``RetryPolicy`` is turned into a tenacity engine in exactly one place,
:func:`retry_engine`; no tenacity type ever appears in a public signature.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import tenacity
from tenacity.wait import wait_base

from ._exceptions import ConfigurationError

__all__ = ["DEFAULT_RETRY_STATUSES", "PollPolicy", "RetryPolicy", "retry_engine"]

#: 409 and 423 (in flight), 429/503 (overloaded), 500/502/504 (ambiguous: may have run).
DEFAULT_RETRY_STATUSES: frozenset[int] = frozenset({409, 423, 429, 500, 502, 503, 504})


def _positive(name: str, value: object, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if math.isnan(number) or math.isinf(number) or number < 0 or (number == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigurationError(f"{name} must be a finite number {bound}, got {value!r}")
    return number


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How hard one ``invoke`` tries before it gives up.

    Every resend carries the same ``Idempotency-Key``, so a retry can never
    turn one step into two side effects.

    - ``max_attempts``: requests sent for one step, the first one included.
    - ``deadline``: seconds the whole call may take, from the first send: every
      attempt, read, wait and poll falls within it (a dripping answer is cut off).
    - ``initial_backoff`` / ``max_backoff``: the window of the jittered
      ("full jitter") exponential backoff used when the server gives no
      usable ``Retry-After``.
    - ``max_retry_after``: the cap on any single wait a server asks for.
    - ``retry_statuses``: HTTP statuses that are resent (the rest are final). 409 and
      423 are resent only while their problem code does not say "mismatch".
    """

    max_attempts: int = 8
    deadline: float = 120.0
    initial_backoff: float = 0.5
    max_backoff: float = 10.0
    max_retry_after: float = 30.0
    retry_statuses: frozenset[int] = DEFAULT_RETRY_STATUSES

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_attempts, bool)
            or not isinstance(self.max_attempts, int)
            or self.max_attempts < 1
        ):
            raise ConfigurationError(f"max_attempts must be an int >= 1, got {self.max_attempts!r}")
        _positive("deadline", self.deadline)
        _positive("initial_backoff", self.initial_backoff, allow_zero=True)
        _positive("max_backoff", self.max_backoff, allow_zero=True)
        _positive("max_retry_after", self.max_retry_after, allow_zero=True)
        if self.max_backoff < self.initial_backoff:
            raise ConfigurationError(
                f"max_backoff ({self.max_backoff}) must be >= initial_backoff "
                f"({self.initial_backoff})"
            )
        statuses = _statuses(self.retry_statuses)
        object.__setattr__(self, "retry_statuses", statuses)

    def replace(self, **changes: Any) -> RetryPolicy:
        """A copy with ``changes`` applied (validated like the constructor)."""
        return _replace(self, changes)


@dataclass(frozen=True, slots=True, kw_only=True)
class PollPolicy:
    """How an asynchronous (202) step is polled.

    The first wait is ``interval``; each later one is ``backoff`` times the
    previous, up to ``max_interval``. A ``Retry-After`` on a poll answer wins
    (capped by ``max_interval``). After ``deadline`` seconds of polling, or at
    the call's ``RetryPolicy.deadline`` if that comes first,
    :class:`~agentkey.PollTimeout` carries the status URL so polling can be
    resumed later with ``resume_poll``.
    """

    interval: float = 1.0
    backoff: float = 1.5
    max_interval: float = 30.0
    deadline: float = 600.0

    def __post_init__(self) -> None:
        _positive("interval", self.interval, allow_zero=True)
        backoff = _positive("backoff", self.backoff)
        if backoff < 1:
            raise ConfigurationError(f"backoff must be >= 1, got {self.backoff!r}")
        _positive("max_interval", self.max_interval, allow_zero=True)
        _positive("deadline", self.deadline)
        if self.max_interval < self.interval:
            raise ConfigurationError(
                f"max_interval ({self.max_interval}) must be >= interval ({self.interval})"
            )

    def replace(self, **changes: Any) -> PollPolicy:
        """A copy with ``changes`` applied (validated like the constructor)."""
        return _replace(self, changes)

    def wait(self, poll_number: int) -> float:
        """The wait before poll ``poll_number + 1`` when the server gives no ``Retry-After``."""
        return float(
            min(self.max_interval, self.interval * self.backoff ** max(0, poll_number - 1))
        )


def _statuses(value: object) -> frozenset[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigurationError(f"retry_statuses must be a set of ints, got {value!r}")
    out: set[int] = set()
    for status in value:
        if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599:
            raise ConfigurationError(f"retry_statuses holds {status!r}, not an HTTP status")
        if 200 <= status < 400:
            raise ConfigurationError(f"retry_statuses cannot hold {status}: it is not an error")
        out.add(status)
    return frozenset(out)


_P = TypeVar("_P", "RetryPolicy", "PollPolicy")


def _replace(policy: _P, changes: dict[str, Any]) -> _P:
    names = {f.name for f in dataclasses.fields(policy)}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise ConfigurationError(
            f"{type(policy).__name__} has no option(s) {', '.join(unknown)}; "
            f"valid options: {', '.join(sorted(names))}"
        )
    return dataclasses.replace(policy, **changes)


class _WaitRetryAfter(wait_base):
    """Wait what the server asked for (capped), else jittered backoff; never past the deadline.

    The attempt's outcome is a decision object with a ``retry_after`` attribute
    (seconds or None), set by the protocol core.
    """

    def __init__(self, policy: RetryPolicy) -> None:
        self._policy = policy
        self._fallback = tenacity.wait_random_exponential(
            multiplier=policy.initial_backoff, max=policy.max_backoff
        )

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        outcome = retry_state.outcome
        hint = None if outcome is None or outcome.failed else outcome.result().retry_after
        if hint is None:
            wait = float(self._fallback(retry_state))
        else:
            wait = min(float(hint), self._policy.max_retry_after)
        remaining = self._policy.deadline - (retry_state.seconds_since_start or 0.0)
        return max(0.0, min(wait, remaining))


class _StopAtDeadline(tenacity.stop.stop_base):
    def __init__(self, deadline: float) -> None:
        self._deadline = deadline

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return (retry_state.seconds_since_start or 0.0) >= self._deadline


def _wants_retry(retry_state: tenacity.RetryCallState) -> bool:
    outcome = retry_state.outcome
    return outcome is not None and not outcome.failed and bool(outcome.result().retry)


def _last_decision(retry_state: tenacity.RetryCallState) -> Any:
    assert retry_state.outcome is not None
    return retry_state.outcome.result()


def retry_engine(policy: RetryPolicy) -> tuple[tenacity.Retrying, tenacity.RetryCallState]:
    """The one place ``RetryPolicy`` becomes tenacity: a fresh engine and its call state.

    The caller records each attempt's decision with ``state.set_result`` and
    asks ``engine.iter(state)`` what to do: ``DoAttempt``, ``DoSleep(seconds)``,
    or (when the decision is final or the budget ran out) the last decision.
    """
    sleep: Callable[[float], None] = _never_sleep
    engine = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(policy.max_attempts) | _StopAtDeadline(policy.deadline),
        wait=_WaitRetryAfter(policy),
        retry=_wants_retry,
        retry_error_callback=_last_decision,
        sleep=sleep,
    )
    engine.begin()
    return engine, tenacity.RetryCallState(engine, fn=None, args=(), kwargs={})


def _never_sleep(seconds: float) -> None:  # pragma: no cover - the drivers sleep, not tenacity
    raise AssertionError("agentkey drivers sleep; tenacity's own sleep must never run")
