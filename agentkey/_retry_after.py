"""``Retry-After`` parsing (RFC 9110 section 10.2.3), shared by tool calls and token requests."""

from __future__ import annotations

import datetime as _dt
import re
from email.utils import parsedate_to_datetime

__all__ = ["TOO_LONG", "parse_retry_after"]

#: What a delay of more than 15 digits means: longer than any cap or deadline, yet finite
#: (``float`` cannot hold 310 digits and ``int`` refuses to parse thousands).
TOO_LONG = 1e15

_DELAY_SECONDS = re.compile(r"[0-9]+")


def parse_retry_after(value: str | None, *, now: _dt.datetime | None = None) -> float | None:
    """Return the wait in seconds that ``value`` asks for, or None when it says nothing usable.

    ``value`` is delay-seconds (``"120"``, ``"0"`` meaning now) or an HTTP-date,
    compared with ``now`` (default: the current UTC time); a date in the past
    means now. Negative, fractional, infinite or garbage values give None, so
    the caller falls back to its own backoff. Capping is the caller's job.
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
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=_dt.timezone.utc)
    current = now if now is not None else _dt.datetime.now(_dt.timezone.utc)
    return max(0.0, (when - current).total_seconds())
