"""The one backoff formula (``agentkey._schedule.Backoff``): bounds, cap, Retry-After."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkey import ConfigurationError
from agentkey._schedule import Backoff

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
