"""Retry-After parsing: delay-seconds, HTTP-dates and garbage."""

from __future__ import annotations

import datetime as dt
from email.utils import format_datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkey._retry_after import parse_retry_after

NOW = dt.datetime(2026, 11, 29, 12, 0, 0, tzinfo=dt.timezone.utc)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", 0.0),
        ("7", 7.0),
        (" 120 ", 120.0),
        ("Sun, 29 Nov 2026 12:00:30 GMT", 30.0),
        ("Sun, 29 Nov 2026 11:00:00 GMT", 0.0),  # in the past: now
        ("Sunday, 29-Nov-26 12:01:00 GMT", 60.0),  # obsolete RFC 850 form
        (None, None),
        ("", None),
        ("-1", None),
        ("1.5", None),
        ("inf", None),
        ("Infinity", None),
        ("NaN", None),
        ("1e3", None),
        ("soon", None),
        ("Mon, 99 Foo 2026 07:28:00 GMT", None),
    ],
)
def test_values(value: str | None, expected: float | None) -> None:
    """Valid values give seconds; negative, fractional, infinite and garbage give None."""
    assert parse_retry_after(value, now=NOW) == expected


@given(st.integers(min_value=0, max_value=10**12))
def test_delay_seconds(seconds: int) -> None:
    """Any non-negative integer is that many seconds."""
    assert parse_retry_after(str(seconds)) == float(seconds)


@given(st.integers(min_value=-(10**6), max_value=10**6))
def test_http_dates(offset: int) -> None:
    """An HTTP-date gives its distance from now, never negative."""
    when = NOW + dt.timedelta(seconds=offset)
    assert parse_retry_after(format_datetime(when, usegmt=True), now=NOW) == max(0, offset)


@given(st.text(max_size=40))
def test_never_raises(value: str) -> None:
    """No input makes the parser raise or return a negative or non-finite wait."""
    result = parse_retry_after(value, now=NOW)
    assert result is None or (0 <= result < float("inf"))


@given(st.text(alphabet="0123456789", min_size=1, max_size=6000))
def test_any_number_of_digits_is_a_finite_wait(digits: str) -> None:
    """Delay-seconds of any length (310 digits overflow a float, 5,000 trip int()) never raise."""
    from agentkey._protocol import retry_after

    wait = retry_after(digits)
    assert wait is not None
    assert 0 <= wait < float("inf")
    if len(digits) <= 15:
        assert wait == float(int(digits))


@given(st.text(max_size=400))
def test_protocol_retry_after_never_raises(value: str) -> None:
    """The core's Retry-After reading takes any header text without raising."""
    from agentkey._protocol import retry_after

    wait = retry_after(value)
    assert wait is None or 0 <= wait < float("inf")
