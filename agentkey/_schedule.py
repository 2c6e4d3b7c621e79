"""The one backoff formula: step retries, 409/423 waits, polls and token requests all use it.

``Backoff.delay(attempt)`` is the wait before the next attempt after ``attempt``
attempts: ``initial * multiplier ** (attempt - 1)``, capped at ``cap``, times a
uniform draw in ``[0, 1)`` when ``jitter`` ("full jitter"). A server's
``Retry-After`` wins over the formula, capped at ``max_retry_after``. No wait is
shorter than ``floor`` (polls set it, so ``Retry-After: 0`` cannot make them
spin). The caller cuts the result to its deadline.

The capped exponential is tenacity's ``wait_exponential`` (overflow-safe for any
attempt count), called with a call state the schedule owns. tenacity's retry
engine is not used: its call states read the real ``time.monotonic()``, its jittered
waits draw from the global ``random`` module, and it owns the loop and the sleep, while
the protocol core yields its waits to a driver that sleeps on the injected ``Clock``
(``bench/bench_schedule.py`` also measures it at about 10x this formula's CPU per
wait). The jitter draw comes from the caller's ``rng``, so a test drives the schedule
deterministically; nothing here reads a clock or a random source of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import tenacity

from ._exceptions import ConfigurationError

__all__ = ["Backoff"]


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff from ``initial`` by ``multiplier``, capped at ``cap``."""

    initial: float
    cap: float
    multiplier: float = 2.0
    jitter: bool = True
    max_retry_after: float = math.inf
    floor: float = 0.0
    _ceiling: tenacity.wait_exponential = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("initial", "cap", "multiplier", "max_retry_after", "floor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigurationError(f"Backoff.{name} must be a number >= 0, got {value!r}")
        if not (math.isfinite(self.initial) and math.isfinite(self.cap)) or self.cap < self.initial:
            raise ConfigurationError(
                f"Backoff needs finite 0 <= initial <= cap, got {self.initial!r}, {self.cap!r}"
            )
        if not math.isfinite(self.floor):
            raise ConfigurationError(f"Backoff.floor must be finite, got {self.floor!r}")
        if not 1 <= self.multiplier < math.inf:
            raise ConfigurationError(f"Backoff.multiplier must be >= 1, got {self.multiplier!r}")
        ceiling = tenacity.wait_exponential(
            multiplier=self.initial, max=self.cap, exp_base=self.multiplier
        )
        object.__setattr__(self, "_ceiling", ceiling)

    def delay(
        self,
        attempt: int,
        retry_after: float | None = None,
        *,
        rng: Callable[[], float] | None = None,
    ) -> float:
        """Seconds to wait after ``attempt`` (>= 1) attempts; ``retry_after`` wins, capped.

        Never less than ``floor``. ``rng`` (uniform in [0, 1)) draws the jitter; a
        jittered schedule needs one.
        """
        if retry_after is not None:
            return max(self.floor, min(float(retry_after), self.max_retry_after))
        if self.initial == 0:
            base = 0.0  # tenacity answers its cap once exp_base ** n overflows, even for 0
        else:
            state = tenacity.RetryCallState(_NO_ENGINE, fn=None, args=(), kwargs={})
            state.attempt_number = max(1, attempt)
            base = float(self._ceiling(state))
        if not self.jitter:
            return max(self.floor, base)
        if rng is None:
            raise ConfigurationError("a jittered Backoff draws from the caller's rng; pass rng=")
        return max(self.floor, base * rng())

    def within(
        self,
        attempt: int,
        retry_after: float | None,
        *,
        left: float,
        rng: Callable[[], float] | None = None,
        whole: bool = False,
    ) -> float | None:
        """The wait after ``attempt`` attempts when ``left`` seconds remain before the deadline.

        The one deadline rule of every retry: None once the deadline has passed;
        otherwise :meth:`delay` cut to ``left``, or, with ``whole``, None when that
        delay would not end before the deadline (a wait that would only run out the
        clock is not begun).
        """
        if left <= 0:
            return None
        wait = self.delay(attempt, retry_after, rng=rng)
        if whole and wait >= left:
            return None
        return min(wait, left)


#: The call state tenacity's wait strategies read names an engine; none ever runs.
_NO_ENGINE = tenacity.Retrying(stop=tenacity.stop_after_attempt(1))
