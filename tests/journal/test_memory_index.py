"""MemoryJournal looks for repeats among the call's plan and arguments, not every record."""

from __future__ import annotations

from typing import Any

import pytest

from agentkey.journal import CallRecord, CallState, MemoryJournal, _memory
from agentkey.journal._records import repeats_among
from agentkey.testing import FakeClock

NOW = 1_800_000_000.0


def _record(plan: str, n: int, args: str, **fields: Any) -> CallRecord:
    return CallRecord(
        key=f"{plan}:step_{n:03d}:{args}", plan=plan, step=f"step_{n:03d}", tool="charge",
        args_hash=args, route="POST https://tools.test/charge", created_at=NOW + n,
        updated_at=NOW + n, owner="o", lease_until=NOW + 600, **fields,
    )  # fmt: skip


def test_a_begin_reads_only_the_records_of_its_plan_and_arguments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """200 other calls in the journal: a begin hands repeats_among 1 record, not 201 (main)."""
    journal = MemoryJournal(clock=FakeClock(wall=NOW))
    for n in range(200):
        journal.begin(_record("plan-a", n, f"{n:064x}"), repeats=True)
    journal.begin(_record("plan-b", 0, "f" * 64), repeats=True)
    seen: list[int] = []

    def counting(record: CallRecord, found: Any, **options: Any) -> tuple[CallRecord, ...]:
        found = list(found)
        seen.append(len(found))
        return repeats_among(record, found, **options)

    monkeypatch.setattr(_memory, "repeats_among", counting)
    begun = journal.begin(_record("plan-b", 1, "f" * 64), repeats=True)
    assert [r.key for r in begun.earlier] == [_record("plan-b", 0, "f" * 64).key]
    assert seen == [1]


def test_the_index_follows_takeovers_finishes_and_prunes() -> None:
    """A record rewritten under other arguments, or pruned, is found where it is now only."""
    clock = FakeClock(wall=NOW)
    journal = MemoryJournal(clock=clock)
    first = _record("plan-c", 0, "a" * 64)
    journal.begin(first, repeats=True)
    moved = first.with_(args_hash="b" * 64, owner="p")
    assert journal.take_over(moved, first)
    assert not journal.begin(_record("plan-c", 1, "a" * 64), repeats=True).earlier
    assert journal.begin(_record("plan-c", 2, "b" * 64), repeats=True).earlier == (moved,)
    done = moved.with_(state=CallState.ANSWERED, updated_at=NOW + 5)
    assert journal.finish(done)
    assert journal.begin(_record("plan-c", 3, "b" * 64), repeats=True).earlier == (done,)
    clock.advance(10)
    assert journal.prune(older_than=1) == 1  # the answered call; the pending ones stay
    assert journal.get(done.key) is None
    assert journal.begin(_record("plan-c", 4, "b" * 64), repeats=True).earlier == ()
    assert [r.key for r in journal.begin(_record("plan-c", 5, "a" * 64), repeats=True).earlier] == [
        _record("plan-c", 1, "a" * 64).key
    ]
