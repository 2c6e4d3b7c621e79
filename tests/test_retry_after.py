"""Retry-After parsing: delay-seconds, HTTP-dates (from an injected wall time) and garbage."""

from __future__ import annotations

import datetime as dt
from email.utils import format_datetime, parsedate_to_datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkey.client._retry_after import parse_retry_after

NOW_DATE = dt.datetime(2026, 11, 29, 12, 0, 0, tzinfo=dt.timezone.utc)
NOW = NOW_DATE.timestamp()  # the caller's wall clock, in Unix seconds


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
    assert parse_retry_after(str(seconds), now=None) == float(seconds)


@given(st.integers(min_value=-(10**6), max_value=10**6))
def test_http_dates(offset: int) -> None:
    """An HTTP-date gives its distance from now, never negative."""
    when = NOW_DATE + dt.timedelta(seconds=offset)
    assert parse_retry_after(format_datetime(when, usegmt=True), now=NOW) == max(0, offset)


@given(st.text(max_size=40))
def test_never_raises(value: str) -> None:
    """No input makes the parser raise or return a negative or non-finite wait."""
    result = parse_retry_after(value, now=NOW)
    assert result is None or (0 <= result < float("inf"))


@given(st.text(alphabet="0123456789", min_size=1, max_size=6000))
def test_any_number_of_digits_is_a_finite_wait(digits: str) -> None:
    """Delay-seconds of any length (310 digits overflow a float, 5,000 trip int()) never raise."""
    from agentkey.client._protocol import retry_after

    wait = retry_after(digits)
    assert wait is not None
    assert 0 <= wait < float("inf")
    if len(digits) <= 15:
        assert wait == float(int(digits))


@given(st.text(max_size=400))
def test_protocol_retry_after_never_raises(value: str) -> None:
    """The core's Retry-After reading takes any header text without raising."""
    from agentkey.client._protocol import retry_after

    wait = retry_after(value)
    assert wait is None or 0 <= wait < float("inf")


def _by_datetime(value: str, now: dt.datetime) -> float | None:
    """The HTTP-date reading of ``value`` through ``datetime``, as the parser read it before."""
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return max(0.0, (when - now).total_seconds())


_FIELDS = st.tuples(
    st.sampled_from(["Sun, ", "Mon, ", ""]),
    st.integers(-1, 40),
    st.sampled_from(["Jan", "Feb", "Apr", "Nov", "Dec", "Foo"]),
    st.integers(-1, 10000),
    st.integers(-1, 25),
    st.integers(-1, 61),
    st.integers(-1, 61),
    st.sampled_from(["GMT", "UT", "+0200", "-0000", "-0130", "+2400", "+9959", "EST", ""]),
)


@given(_FIELDS)
def test_dates_read_as_datetime_reads_them(fields: tuple[object, ...]) -> None:
    """Impossible dates (31 Feb, second 60, a zone of a day) give None, as datetime refuses them."""
    weekday, day, month, year, hour, minute, second, zone = fields
    value = f"{weekday}{day} {month} {year} {hour:02}:{minute:02}:{second:02} {zone}".strip()
    expected = _by_datetime(value, NOW_DATE)
    assert parse_retry_after(value, now=NOW) == expected


def test_a_date_without_a_wall_time_gives_no_hint() -> None:
    """With no wall time (now=None) an HTTP-date says nothing usable; seconds still count."""
    assert parse_retry_after("Sun, 29 Nov 2026 12:00:30 GMT", now=None) is None
    assert parse_retry_after("30", now=None) == 30.0
