"""Evidence with an expiry of its own (``learn(ttl=)``), as ``agentkey check --remember``
writes it, on every kind of journal (issue 37, item 5)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from agentkey import ConfigurationError
from agentkey.client._checker import CheckReport, CheckResult
from agentkey.client._remember import REMEMBERED, remember_check
from agentkey.journal import Evidence, MemoryJournal
from agentkey.testing import FakeClock

from .test_integrity import NOW, ROUTE, record

DAY = 86400.0
URL = "https://tools.test/charge"  # ROUTE is its POST


def report(verdict: str) -> CheckReport:
    row = CheckResult("duplicate is replayed", verdict, "201 then replayed", "contract")  # type: ignore[arg-type]
    return CheckReport(URL, "raw", (row,))


def test_remembered_evidence_lasts_its_own_days_then_is_neither_listed_nor_used(
    journal_factory: Callable[..., Any],
) -> None:
    """A pass remembered for 7 days is listed with that expiry and given by begin(); a day
    later than that it is gone (before: learn() took no expiry, every entry lasted 30 days)."""
    clock = FakeClock(wall=NOW)
    journal = journal_factory(clock=clock)
    assert remember_check(report("PASS"), URL, journal) == ROUTE
    assert journal.evidence() == [Evidence(ROUTE, REMEMBERED, NOW, NOW, NOW + 7 * DAY)]
    assert journal.begin(record("plan-r", 0, route=ROUTE)).evidence == REMEMBERED
    clock.advance(8 * DAY)
    assert journal.evidence() == []
    assert journal.begin(record("plan-r", 1, route=ROUTE)).evidence is None
    journal.learn(ROUTE, "protection header")  # seen by an invoker: the usual 30 days
    assert journal.evidence()[0].expires_at == NOW + 38 * DAY


def test_a_failed_check_writes_nothing() -> None:
    """A check with a failed contract row is never remembered."""
    journal = MemoryJournal()
    assert remember_check(report("FAIL"), URL, journal) is None
    assert journal.evidence() == []


@pytest.mark.parametrize("days", [0, -1, 366, float("nan"), True, "7"])
def test_the_days_are_checked(days: Any) -> None:
    """More than 0 and at most a year; anything else is a ConfigurationError, nothing written."""
    journal = MemoryJournal()
    with pytest.raises(ConfigurationError, match="days"):
        remember_check(report("PASS"), URL, journal, days=days)
    assert journal.evidence() == []
