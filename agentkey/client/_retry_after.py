"""``Retry-After`` parsing (RFC 9110 section 10.2.3), shared by tool calls and token requests.

Pure: an HTTP-date is measured from the ``now`` the caller passes (Unix
seconds from its injected wall clock); nothing here reads a clock.
"""

from __future__ import annotations

import re
from calendar import monthrange, timegm
from email.utils import parsedate_tz

__all__ = ["TOO_LONG", "parse_retry_after"]

#: What a delay of more than 15 digits means: longer than any cap or deadline, yet finite
#: (``float`` cannot hold 310 digits and ``int`` refuses to parse thousands).
TOO_LONG = 1e15

_DELAY_SECONDS = re.compile(r"[0-9]+")
_DAY = 24 * 3600


def parse_retry_after(value: str | None, *, now: float | None) -> float | None:
    """Return the wait in seconds that ``value`` asks for, or None when it says nothing usable.

    ``value`` is delay-seconds (``"120"``, ``"0"`` meaning now) or an HTTP-date,
    compared with ``now`` (Unix seconds; None: the caller has no wall time, so a
    date says nothing usable); a date in the past means now. Negative,
    fractional, infinite or garbage values give None, so the caller falls back to
    its own backoff. Capping is the caller's job.
    """
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    if _DELAY_SECONDS.fullmatch(text):
        return float(int(text)) if len(text) <= 15 else TOO_LONG
    if not any(ch.isalpha() for ch in text):
        return None  # "-1", "1.5", "1e3": numbers, but not delay-seconds
    if now is None:
        return None  # a date, and no wall time to measure it from
    when = _http_date(text)
    return None if when is None else max(0.0, when - now)


def _http_date(text: str) -> float | None:
    """The Unix time an HTTP-date (or its obsolete forms) names; None for an impossible date.

    The date must exist (no 31 February, no second 60) and its zone offset be less
    than a day, as a ``datetime`` would insist; a date without a zone is UTC.
    """
    try:
        parts = parsedate_tz(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if parts is None:
        return None
    year, month, day, hour, minute, second = parts[:6]
    offset = parts[9] or 0
    if not (1 <= year <= 9999 and 1 <= month <= 12 and abs(offset) < _DAY):
        return None
    if not (1 <= day <= monthrange(year, month)[1] and hour < 24 and minute < 60 and second < 60):
        return None
    if min(hour, minute, second) < 0:
        return None
    return float(timegm((year, month, day, hour, minute, second, 0, 0, 0)) - offset)
