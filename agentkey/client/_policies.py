"""Retry and poll policies: frozen, keyword-only, with production defaults.

One vocabulary across ``RetryPolicy``, ``PollPolicy`` and ``TokenPolicy``:
``max_attempts``, ``initial_backoff``, ``max_backoff``, ``backoff_multiplier``,
``max_retry_after``, ``deadline`` and ``jitter``. Each policy's ``.schedule``
is the one backoff formula, :class:`~agentkey._schedule.Backoff`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._exceptions import ConfigurationError
from .._validate import replace

if TYPE_CHECKING:
    from .._schedule import Backoff

__all__ = [
    "DEFAULT_MAX_RESPONSE_BYTES",
    "DEFAULT_REPLAY_HEADERS",
    "DEFAULT_RETRY_STATUSES",
    "PollPolicy",
    "RetryPolicy",
]

#: 409 and 423 (in flight), 429/503 (overloaded), 500/502/504 (in doubt: may have run).
DEFAULT_RETRY_STATUSES: frozenset[int] = frozenset({409, 423, 429, 500, 502, 503, 504})

#: Replay headers recognised by default. An entry is a header name (its value ``true``
#: marks a replay) or ``"Name: value"`` (that value does); both compare case-insensitively.
#: (Here, beside the other defaults of the invoker's options, so that its signature needs
#: no import of the protocol core; :mod:`agentkey.client._protocol` reads them from here.)
DEFAULT_REPLAY_HEADERS: tuple[str, ...] = (
    "Idempotent-Replayed",
    "Idempotency-Replayed",
    "Idempotent-Replay",
    "X-Idempotent-Replayed",
    "X-Idempotency-Replayed",
    "X-Ichido-Status: replayed",  # ichido 0.1 (it sends "executed" on a first run)
)

#: The largest answer body (after content decoding) an invoker reads into memory: 32 MiB.
DEFAULT_MAX_RESPONSE_BYTES = 32 * 1024 * 1024


def _positive(name: str, value: object, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if math.isnan(number) or math.isinf(number) or number < 0 or (number == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigurationError(f"{name} must be a finite number {bound}, got {value!r}")
    return number


def _count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be an int >= 1, got {value!r}")


def check_backoff(policy: Any, prefix: str = "") -> None:
    """Validate the shared backoff options of ``policy`` (names prefixed by ``prefix``)."""
    for name in ("initial_backoff", "max_backoff", "max_retry_after"):
        _positive(prefix + name, getattr(policy, name), allow_zero=True)
    if _positive(prefix + "backoff_multiplier", policy.backoff_multiplier) < 1:
        raise ConfigurationError(
            f"{prefix}backoff_multiplier must be >= 1, got {policy.backoff_multiplier!r}"
        )
    if policy.max_backoff < policy.initial_backoff:
        raise ConfigurationError(
            f"{prefix}max_backoff ({policy.max_backoff}) must be >= initial_backoff "
            f"({policy.initial_backoff})"
        )
    if not isinstance(policy.jitter, bool):
        raise ConfigurationError(f"{prefix}jitter must be True or False, got {policy.jitter!r}")


def schedule_of(policy: Any, *, floor: float = 0.0) -> Backoff:
    """The :class:`Backoff` of a policy that has the shared backoff options."""
    # Imported here: it loads tenacity, which a policy needs only once it is used (an
    # invoker's settings), not where its defaults are written (the invoker's signature).
    from .._schedule import Backoff

    return Backoff(
        policy.initial_backoff,
        policy.max_backoff,
        policy.backoff_multiplier,
        policy.jitter,
        policy.max_retry_after,
        floor,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How hard one ``invoke`` tries before it gives up.

    Every resend carries the same ``Idempotency-Key``, so a retry can never
    turn one step into two side effects.

    - ``max_attempts``: requests sent for one step, the first one included.
    - ``deadline``: seconds the whole call may take, from the first send: every
      attempt, read, wait and poll falls within it (a dripping answer is cut off).
    - ``initial_backoff`` / ``backoff_multiplier`` / ``max_backoff``: the wait after
      attempt ``n`` is ``initial_backoff * backoff_multiplier ** (n - 1)``, capped at
      ``max_backoff``, when the server gives no usable ``Retry-After``; ``jitter``
      draws it uniformly below that ("full jitter").
    - ``max_retry_after``: the cap on any single wait a server asks for.
    - ``retry_statuses``: HTTP statuses that are resent (the rest are final). 409 and
      423 are resent only while their problem code does not say "mismatch".
    """

    max_attempts: int = 8
    deadline: float = 120.0
    initial_backoff: float = 0.5
    max_backoff: float = 10.0
    backoff_multiplier: float = 2.0
    max_retry_after: float = 30.0
    jitter: bool = True
    retry_statuses: frozenset[int] = DEFAULT_RETRY_STATUSES

    def __post_init__(self) -> None:
        _count("max_attempts", self.max_attempts)
        _positive("deadline", self.deadline)
        check_backoff(self)
        object.__setattr__(self, "retry_statuses", _statuses(self.retry_statuses))

    def replace(self, **changes: Any) -> RetryPolicy:
        """A copy with ``changes`` applied (validated like the constructor)."""
        return replace(self, changes)

    @property
    def schedule(self) -> Backoff:
        """The wait between attempts, as one :class:`~agentkey._schedule.Backoff`."""
        return schedule_of(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class PollPolicy:
    """How an asynchronous (202) step is polled.

    The first wait is ``initial_backoff``; each later one is ``backoff_multiplier``
    times the previous, up to ``max_backoff``. A ``Retry-After`` on a poll answer
    wins (capped by ``max_retry_after``). No wait is shorter than ``min_interval``
    (0.5 s), whatever the server asks: a status URL answering ``Retry-After: 0``
    gets at most two polls a second, not thousands. After ``deadline`` seconds of polling, or
    at the call's ``RetryPolicy.deadline`` if that comes first,
    :class:`~agentkey.PollTimeout` carries the status URL so polling can be
    resumed later with ``resume_poll``.
    """

    initial_backoff: float = 1.0
    backoff_multiplier: float = 1.5
    max_backoff: float = 30.0
    max_retry_after: float = 30.0
    deadline: float = 600.0
    jitter: bool = False
    min_interval: float = 0.5

    def __post_init__(self) -> None:
        check_backoff(self)
        _positive("deadline", self.deadline)
        _positive("min_interval", self.min_interval, allow_zero=True)

    def replace(self, **changes: Any) -> PollPolicy:
        """A copy with ``changes`` applied (validated like the constructor)."""
        return replace(self, changes)

    @property
    def schedule(self) -> Backoff:
        """The wait between polls, as one :class:`~agentkey._schedule.Backoff`."""
        return schedule_of(self, floor=self.min_interval)

    def wait(self, poll_number: int, *, rng: Callable[[], float] | None = None) -> float:
        """The wait before poll ``poll_number + 1`` when the server gives no ``Retry-After``.

        A policy is a value with no clock: a jittered one (``jitter=True``) draws from
        ``rng`` (uniform in [0, 1), e.g. a clock's ``random``), which it then needs.
        """
        return self.schedule.delay(poll_number, rng=rng)


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
