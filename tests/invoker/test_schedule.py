"""The one backoff formula (``agentkey._schedule.Backoff``): bounds, cap, Retry-After."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkey import AsyncToolInvoker, ConfigurationError, PlanSession, ToolInvoker, ToolResult
from agentkey._schedule import Backoff
from agentkey.testing import FakeClock
from tests._loopback import serve

seconds = st.floats(0, 1e6, allow_nan=False)
draws = st.floats(0, 1, exclude_max=True)


@st.composite
def backoffs(draw: st.DrawFn) -> Backoff:
    initial = draw(seconds)
    cap = draw(st.floats(initial, 1e7, allow_nan=False))
    return Backoff(
        initial,
        cap,
        draw(st.floats(1, 100, allow_nan=False)),
        draw(st.booleans()),
        draw(seconds),
    )


@given(backoff=backoffs(), attempt=st.integers(1, 10_000), draw=draws)
def test_delay_stays_within_zero_and_the_cap(backoff: Backoff, attempt: int, draw: float) -> None:
    """Without Retry-After the wait is in [0, cap]; without jitter, exactly the capped formula."""
    wait = backoff.delay(attempt, rng=lambda: draw)
    assert 0.0 <= wait <= backoff.cap
    if not backoff.jitter and attempt < 50:
        expected = backoff.initial * backoff.multiplier ** (attempt - 1)
        assert wait == pytest.approx(min(backoff.cap, expected))


@given(backoff=backoffs(), attempt=st.integers(1, 500))
def test_the_ceiling_never_shrinks(backoff: Backoff, attempt: int) -> None:
    """The un-jittered wait grows with the attempt until it sticks at the cap."""
    ceiling = Backoff(backoff.initial, backoff.cap, backoff.multiplier, False)
    assert ceiling.delay(attempt) <= ceiling.delay(attempt + 1) <= backoff.cap


@given(backoff=backoffs(), attempt=st.integers(1, 100), hint=st.floats(0, 1e300))
def test_retry_after_wins_capped(backoff: Backoff, attempt: int, hint: float) -> None:
    """A server's Retry-After replaces the formula, capped by max_retry_after, never jittered."""
    assert backoff.delay(attempt, hint, rng=lambda: 0.0) == min(hint, backoff.max_retry_after)


def test_full_jitter_scales_the_ceiling() -> None:
    """Full jitter draws uniformly below the exponential ceiling."""
    backoff = Backoff(0.5, 10.0, 2.0, True)
    assert [backoff.delay(n, rng=lambda: 0.5) for n in (1, 2, 3, 6)] == [0.25, 0.5, 1.0, 5.0]
    assert backoff.delay(10**6, rng=lambda: 1.0) == 10.0  # no OverflowError


def test_the_formula_is_overflow_safe_and_a_zero_start_stays_zero() -> None:
    """Attempt 10**6 waits the cap (no OverflowError, int multiplier included), and a zero
    initial waits 0 however many attempts (before: the cap, once 2.0 ** n overflowed)."""
    assert Backoff(0.5, 10.0, 2).delay(10**6, rng=lambda: 1.0) == 10.0
    assert Backoff(0.0, 5.0, 2.0, False).delay(10**6) == 0.0


@pytest.mark.parametrize(
    "args",
    [
        (-1.0, 1.0),
        (2.0, 1.0),
        (0.1, math.inf),
        (0.1, 1.0, 0.5),
        (0.1, 1.0, 2.0, True, -1.0),
        (0.1, 1.0, 2.0, True, 1.0, -1.0),
        (0.1, 1.0, 2.0, True, 1.0, math.inf),
    ],
)
def test_nonsense_is_refused(args: tuple[float, ...]) -> None:
    """Negative, inverted, infinite or shrinking schedules raise ConfigurationError."""
    with pytest.raises(ConfigurationError):
        Backoff(*args)  # type: ignore[arg-type]


@given(
    backoff=backoffs(),
    floor=st.floats(0, 100, allow_nan=False),
    attempt=st.integers(1, 100),
    hint=st.none() | st.floats(0, 1e300),
    draw=draws,
)
def test_no_wait_is_below_the_floor(
    backoff: Backoff, floor: float, attempt: int, hint: float | None, draw: float
) -> None:
    """With a floor, every wait (Retry-After: 0 and a jitter draw of 0 included) is >= floor."""
    floored = Backoff(
        backoff.initial, backoff.cap, backoff.multiplier, backoff.jitter,
        backoff.max_retry_after, floor,
    )  # fmt: skip
    wait = floored.delay(attempt, hint, rng=lambda: draw)
    assert wait == max(floor, backoff.delay(attempt, hint, rng=lambda: draw))


# --- a key in flight elsewhere: Retry-After: 0 does not make the questions spin ----------


@dataclass
class _Busy:
    """A plain tool that answers 409 in_progress, Retry-After: 0, until ``clock`` passes
    ``until``; then it runs. It counts the POSTs it got and its executions."""

    clock: FakeClock  # the invoker's: it moves only when the invoker sleeps
    until: float
    posts: int = 0
    executions: int = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        status, headers = 201, [(b"content-type", b"application/json")]
        if scope["method"] == "POST":
            self.posts += 1
            if self.clock.monotonic() < self.until:
                status = 409
                headers.append((b"retry-after", b"0"))
            else:
                self.executions += 1
        body = json.dumps({"code": "in_progress"} if status == 409 else {"id": 1}).encode()
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_retry_after_zero_in_flight_is_paced_by_the_backoff(driver: str) -> None:
    """409 in_progress + Retry-After: 0 for 30 s (the invoker's clock): the questions follow
    the growing backoff, at most 20 requests (before: one per initial_backoff, 61)."""
    clock = FakeClock()
    tool = _Busy(clock, clock.monotonic() + 30.0)
    with serve(tool) as url:
        options: dict[str, Any] = {
            "route_template": "/tools/{tool}",
            "journal": False,
            "clock": clock,
        }
        step = PlanSession.new().step(0, "charge", {"amount": 1})
        if driver == "sync":
            with ToolInvoker(url, **options) as invoker:
                result = invoker.invoke(step)
        else:

            async def main() -> ToolResult:
                async with AsyncToolInvoker(url, **options) as invoker:
                    return await invoker.invoke(step)

            result = asyncio.run(main())
    assert result.status_code == 201
    assert tool.executions == 1
    assert 10 <= tool.posts <= 20, tool.posts
