"""The one clock: monotonic and wall time, sleep and chance, injected into every long-lived object.

Every invoker, middleware, store, journal and token provider takes ``clock=`` and reads
time, sleeps and draws jitter only through it. Production code passes nothing and gets
:func:`default_clock` (the system's clock, or the skipping clock after
``agentkey.testing.set_testing(True)``). Tests pass ``agentkey.testing.FakeClock``.

The pure core (the flows, ``Backoff``) never holds a clock: it is handed the numbers
(``now``, a random draw) by the driver that does.

Socket timeouts are the one thing a clock cannot fake: httpx and the database drivers
wait on the real monotonic clock. Code that turns a deadline on an injected clock into a
socket timeout uses :func:`real_deadline`.
"""

from __future__ import annotations

import time as _time
from typing import Protocol, runtime_checkable

__all__ = ["SYSTEM", "Clock", "SkippingClock", "SystemClock", "default_clock", "real_deadline"]


@runtime_checkable
class Clock(Protocol):
    """Time, sleep and chance, as one object.

    ``monotonic()`` measures waits, leases and deadlines; ``time()`` is the wall clock
    (seconds since the epoch) for what is stored or sent (``Retry-After`` dates, record
    timestamps); ``sleep``/``asleep`` wait; ``random()`` is a uniform draw in [0, 1)
    for jitter.
    """

    def monotonic(self) -> float: ...

    def time(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...

    async def asleep(self, seconds: float) -> None: ...

    def random(self) -> float: ...


class SystemClock:
    """The real clock: ``time.monotonic``, ``time.time``, ``time.sleep``, ``anyio.sleep``."""

    __slots__ = ()

    monotonic = staticmethod(_time.monotonic)
    time = staticmethod(_time.time)
    sleep = staticmethod(_time.sleep)

    def random(self) -> float:
        from random import random  # loaded on the first jittered wait, not at import

        return random()  # noqa: S311 - jitter, not security

    async def asleep(self, seconds: float) -> None:
        import anyio  # asyncio or trio, whichever runs the caller; loaded on first wait

        await anyio.sleep(seconds)

    def __repr__(self) -> str:
        return "SystemClock()"


class SkippingClock:
    """Real time that jumps over every wait: sleeps return at once and move the clock on.

    What ``set_testing(True)`` installs as the default: a retry schedule of minutes runs
    in microseconds, yet deadlines still expire, because ``monotonic()`` and ``time()``
    include the waits skipped so far. Async waits yield to the event loop once.
    """

    __slots__ = ("_skipped",)

    def __init__(self) -> None:
        self._skipped = 0.0

    def monotonic(self) -> float:
        return _time.monotonic() + self._skipped

    def time(self) -> float:
        return _time.time() + self._skipped

    def sleep(self, seconds: float) -> None:
        self._skipped += max(0.0, seconds)

    async def asleep(self, seconds: float) -> None:
        import anyio.lowlevel

        self._skipped += max(0.0, seconds)
        await anyio.lowlevel.checkpoint()

    def random(self) -> float:
        from random import random

        return random()  # noqa: S311 - jitter, not security

    def __repr__(self) -> str:
        return f"SkippingClock(skipped={self._skipped:.3f})"


#: The system clock; the default of every ``clock=`` outside testing mode.
SYSTEM = SystemClock()

_default: Clock = SYSTEM


def default_clock() -> Clock:
    """The clock an object built with no ``clock=`` uses (read when it is built)."""
    return _default


def set_default_clock(clock: Clock | None) -> None:
    """Install ``clock`` as the default (None: the system clock). For ``set_testing``."""
    global _default
    _default = SYSTEM if clock is None else clock


def real_deadline(clock: Clock, deadline: float | None) -> float | None:
    """``deadline`` on ``clock``'s monotonic time, as a deadline on the real one (sockets)."""
    if deadline is None or clock.monotonic is _time.monotonic:
        return deadline
    return _time.monotonic() + (deadline - clock.monotonic())
