"""``agentkey check --remember``: a passing check, kept in the journal as evidence.

A server can honour Idempotency-Key without ever showing it before a loss (a
FastAPI app answers the invoker's ``OPTIONS`` probe with 405). A check that
passed is the proof: :func:`remember_check` writes it into the journal as the
evidence of the checked route (``POST <url>``), for ``ttl`` seconds (7 days by
default). Invokers on that journal then resend a call that may have run on that
route with the same key, as for any evidence, until it expires or an operator
forgets it (``agentkey journal evidence --forget ROUTE``). A check that did not
pass writes nothing.
"""

from __future__ import annotations

import math

from .._exceptions import ConfigurationError
from ..journal._base import Journal
from ..journal._records import route_of
from ._checker import CheckReport

__all__ = ["DEFAULT_REMEMBER_DAYS", "REMEMBERED", "remember_check"]

#: The evidence marker of a remembered check, as ``agentkey journal evidence`` lists it.
REMEMBERED = "agentkey check passed"
#: How long a remembered check counts by default.
DEFAULT_REMEMBER_DAYS = 7.0
#: The longest a check is remembered: a year (a server changes; check it again).
MAX_REMEMBER_DAYS = 365.0


def remember_check(
    report: CheckReport, url: str, journal: Journal, *, days: float = DEFAULT_REMEMBER_DAYS
) -> str | None:
    """Write ``report``'s pass into ``journal`` as evidence that ``url`` (the checked tool's
    URL, POSTed to) honours keys, for ``days``; the route written, or None when the check
    did not pass (nothing is written then)."""
    if isinstance(days, bool) or not isinstance(days, (int, float)) or math.isnan(days):
        raise ConfigurationError(f"the days a check is remembered must be a number, got {days!r}")
    if not 0 < days <= MAX_REMEMBER_DAYS:
        raise ConfigurationError(
            f"a check is remembered for more than 0 and at most {MAX_REMEMBER_DAYS:g} days, "
            f"got {days!r}"
        )
    if not report.ok:
        return None
    route = route_of("POST", url)
    journal.learn(route, REMEMBERED, ttl=days * 86400.0)
    return route


def remember_from_cli(
    report: CheckReport, base_url: str, path: str, days: float, where: str | None
) -> None:
    """``agentkey check --remember``: remember a pass in the journal named by ``where``
    (``--journal``) or the default one, and say what was written (or why nothing was)."""
    import sys
    from datetime import datetime, timezone

    from ..journal._default import resolve_journal

    url = base_url.rstrip("/") + "/" + path.lstrip("/")  # what the checker POSTed to
    if not report.ok:
        print("agentkey: not remembered: the check did not pass", file=sys.stderr)
        return
    if where is not None:
        from .._journal_cli import _open

        journal: Journal | None = _open(where)
    else:
        journal = resolve_journal(None)
    if journal is None:
        raise ConfigurationError(
            "the journal is off ($AGENTKEY_JOURNAL), so the check cannot be remembered; "
            "pass --journal or set AGENTKEY_JOURNAL to a journal"
        )
    route = remember_check(report, url, journal, days=days)
    kept = [e.expires_at for e in journal.evidence() if e.route == route]
    until = (
        datetime.fromtimestamp(kept[0], timezone.utc).isoformat(timespec="seconds")
        if kept
        else f"{days:g} days from now"
    )
    print(
        f"agentkey: remembered: {route} honours Idempotency-Key until {until} (agentkey "
        f"journal evidence lists it; agentkey journal evidence --forget '{route}' forgets it)",
        file=sys.stderr,
    )
