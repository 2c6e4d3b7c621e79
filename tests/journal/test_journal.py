"""The journal's contract, one table of tests run on every kind: memory, SQLite, Redis, PostgreSQL.

Each test runs through the synchronous methods and through the asyncio ones.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from agentkey import ConfigurationError, JournalError
from agentkey._clock import default_clock, set_default_clock
from agentkey.journal import CallRecord, CallState
from agentkey.journal._base import current_owner, current_process, in_flight, is_live
from agentkey.testing import FakeClock

Mode = str
MODES = ("sync", "async")
NOW = 1_800_000_000.0
ROUTE = "POST https://tools.test/charge"


def call(journal: Any, mode: Mode, op: str, *args: Any, **kwargs: Any) -> Any:
    """``journal.<op>`` or ``await journal.a<op>``, as ``mode`` says."""
    if mode == "sync" or op in ("calls", "settle", "prune"):  # operator tools: sync only
        return getattr(journal, op)(*args, **kwargs)

    async def run() -> Any:
        try:
            return await getattr(journal, "a" + op)(*args, **kwargs)
        finally:
            await journal.aclose()  # an asyncio client belongs to the loop that made it

    return asyncio.run(run())


def record(key_suffix: str = "a", *, plan: str = "plan-1", **fields: Any) -> CallRecord:
    base: dict[str, Any] = {
        "key": f"{plan}:step_00{len(key_suffix)}:" + key_suffix * 64,
        "plan": plan,
        "step": f"step_00{len(key_suffix)}",
        "tool": "charge",
        "args_hash": key_suffix * 64,
        "route": "POST https://tools.test/charge",
        "created_at": NOW,
        "updated_at": NOW,
        "owner": current_owner(),
        "lease_until": NOW + 150,
    }
    base.update(fields)
    if len(base["args_hash"]) != 64:
        base["args_hash"] = (base["args_hash"] * 64)[:64]
    return CallRecord(**base)


def test_a_journal_reads_time_on_the_clock_it_was_built_with(
    journal_factory: Callable[..., Any],
) -> None:
    """With no clock=, a journal takes the default clock in force when it is built (the one
    set_testing installs) and keeps it; a function of Unix seconds, the old clock=, is refused
    by name (before: time.time always, and a FakeClock failed at the first call)."""
    with pytest.raises(ConfigurationError, match=r"clock must be an agentkey Clock.*FakeClock"):
        journal_factory(clock=lambda: NOW)
    fake, before = FakeClock(wall=NOW), default_clock()
    set_default_clock(fake)
    try:
        journal = journal_factory()
    finally:
        set_default_clock(before)
    journal.learn(ROUTE, "protection header")
    fake.advance(60)
    journal.learn(ROUTE, "replay marker")
    [seen] = journal.evidence()
    assert (seen.first_seen, seen.last_seen) == (NOW, NOW + 60)
    fake.advance(30 * 24 * 3600 + 1)  # 30 days after the last sight, on the journal's clock
    assert journal.evidence() == []


@pytest.mark.parametrize("mode", MODES)
def test_begin_writes_once_and_then_returns_the_record(
    journal_factory: Callable[..., Any], mode: Mode
) -> None:
    """The first begin writes the record; a second begin of the key returns it, unchanged."""
    journal = journal_factory(clock=FakeClock(wall=NOW))
    first = record()
    begun = call(journal, mode, "begin", first)
    assert begun.existing is None
    again = call(journal, mode, "begin", first.with_(owner="other:1:x:1", attempts=9))
    assert again.existing == first
    assert call(journal, mode, "get", first.key) == first


@pytest.mark.parametrize("mode", MODES)
def test_take_over_is_compare_and_set_on_what_was_read(
    journal_factory: Callable[..., Any], mode: Mode
) -> None:
    """A take-over lands only if the record is still what the taker read (state, owner, time)."""
    clock = FakeClock(wall=NOW)
    journal = journal_factory(clock=clock)
    first = record(state=CallState.IN_DOUBT, owner="gone:1:x:1")
    call(journal, mode, "begin", first)
    mine = first.with_(state=CallState.PENDING, owner=current_owner(), updated_at=NOW + 1)
    theirs = first.with_(state=CallState.PENDING, owner="other:2:y:1", updated_at=NOW + 2)
    assert call(journal, mode, "take_over", mine, first) is True
    assert call(journal, mode, "take_over", theirs, first) is False  # it changed: mine won
    assert call(journal, mode, "get", first.key) == mine


@pytest.mark.parametrize("mode", MODES)
def test_finish_lands_only_for_the_owner(journal_factory: Callable[..., Any], mode: Mode) -> None:
    """The end of a call is written over its record only while its owner holds it."""
    journal = journal_factory(clock=FakeClock(wall=NOW))
    first = record()
    call(journal, mode, "begin", first)
    done = first.with_(state=CallState.ANSWERED, status_code=201, body=b"\x00\xff{}", body_size=4)
    with pytest.raises(JournalError, match="taken over by another sender") as caught:
        call(journal, mode, "finish", done.with_(owner="other:9:z:1"))
    assert caught.value.sent is True
    assert call(journal, mode, "get", first.key) == first  # the holder's record stays
    assert call(journal, mode, "finish", done) is True
    stored = call(journal, mode, "get", first.key)
    assert stored == done
    assert stored.body == b"\x00\xff{}"  # bytes survive every store, not only UTF-8


@pytest.mark.parametrize("mode", MODES)
def test_a_finish_over_an_operators_verdict_records_the_outcome_and_says_so(
    journal_factory: Callable[..., Any], mode: Mode
) -> None:
    """A verdict written while the call was still being sent: the sender's finish raises
    JournalError (sent=True) and its outcome replaces the verdict; a record deleted meanwhile
    is written again, also with the error."""
    journal = journal_factory(clock=FakeClock(wall=NOW))
    first = record("a")
    call(journal, mode, "begin", first)
    verdict = first.with_(state=CallState.NOT_SENT, owner=None, source="operator",
                          reason="did not run", updated_at=NOW + 1)  # fmt: skip
    assert call(journal, mode, "take_over", verdict, first) is True
    done = first.with_(state=CallState.ANSWERED, status_code=201, updated_at=NOW + 2)
    with pytest.raises(JournalError, match="settled by an operator as not_sent") as caught:
        call(journal, mode, "finish", done)
    assert caught.value.sent is True
    stored = call(journal, mode, "get", first.key)
    assert (stored.state, stored.status_code, stored.owner) == (
        CallState.ANSWERED,
        201,
        first.owner,
    )
    assert "over an operator's verdict" in stored.reason
    gone = record("b")  # begun, then deleted by someone while it was being sent
    call(journal, mode, "begin", gone)
    assert journal.prune(older_than=-1, include_unsettled=True) >= 1
    with pytest.raises(JournalError, match="was deleted while the call was being sent"):
        call(journal, mode, "finish", gone.with_(state=CallState.IN_DOUBT))
    assert call(journal, mode, "get", gone.key).state is CallState.IN_DOUBT


@pytest.mark.parametrize("mode", MODES)
def test_find_filters_a_plans_calls_oldest_first(
    journal_factory: Callable[..., Any], mode: Mode
) -> None:
    """find() lists one plan's records by creation time, by tool, args hash or call id."""
    journal = journal_factory(clock=FakeClock(wall=NOW))
    a = record("a", created_at=NOW + 2, call_id="call-a")
    b = record("b", created_at=NOW + 1, tool="refund", call_id="call-b")
    other = record("c", plan="plan-2")
    twin = record("dd", created_at=NOW + 3, args_hash=a.args_hash)  # a's arguments, step 2
    opaque = record("e", created_at=NOW + 4).with_(args_hash=None)  # a key of the user's
    for r in (a, b, other, twin, opaque):
        call(journal, mode, "begin", r)
    every = [b.key, a.key, twin.key, opaque.key]
    assert [r.key for r in call(journal, mode, "find", "plan-1")] == every
    assert call(journal, mode, "find", "plan-1", tool="refund") == [b]
    assert call(journal, mode, "find", "plan-1", args_hash=a.args_hash) == [a, twin]
    assert call(journal, mode, "find", "plan-1", tool="charge", args_hash=b.args_hash) == []
    assert call(journal, mode, "find", "plan-2", args_hash=a.args_hash) == []
    assert call(journal, mode, "find", "plan-1", call_id="call-a") == [a]
    assert call(journal, mode, "find", "plan-1", call_id="nope") == []
    settled = journal.settle(a.key, CallState.ANSWERED, reason="checked by hand")
    assert call(journal, mode, "find", "plan-1", tool="charge", args_hash=a.args_hash) == [
        settled,
        twin,
    ]


@pytest.mark.parametrize("mode", MODES)
def test_begin_with_repeats_returns_the_same_call_at_other_steps_and_writes_nothing(
    journal_factory: Callable[..., Any], mode: Mode
) -> None:
    """begin(repeats=True): the plan's records of the same tool and arguments under other
    keys, oldest first, and nothing written; another tool, a runtime's call or another plan
    is no repeat; repeats=False writes as ever."""
    journal = journal_factory(clock=FakeClock(wall=NOW))
    first = record("a", created_at=NOW + 1)
    runtime = record("aa", created_at=NOW, args_hash=first.args_hash, call_id="call-1")
    for r in (first, runtime):
        call(journal, mode, "begin", r)
    again = record("aaa", created_at=NOW + 2, args_hash=first.args_hash)  # step_003
    begun = call(journal, mode, "begin", again, repeats=True)
    assert begun.earlier == (first,)
    assert begun.existing is None
    assert call(journal, mode, "get", again.key) is None  # nothing written
    other_tool = record("aaaa", args_hash=first.args_hash, tool="refund")
    assert call(journal, mode, "begin", other_tool, repeats=True).earlier == ()
    assert call(journal, mode, "get", other_tool.key) == other_tool
    elsewhere = record("a", plan="plan-2")
    assert call(journal, mode, "begin", elsewhere, repeats=True).earlier == ()
    assert call(journal, mode, "begin", again).earlier == ()  # not asked: written
    assert call(journal, mode, "get", again.key) == again


@pytest.mark.parametrize("mode", MODES)
def test_evidence_is_learnt_and_goes_stale(journal_factory: Callable[..., Any], mode: Mode) -> None:
    """What a route showed about honouring keys comes back with begin, for 30 days."""
    clock = FakeClock(wall=NOW)
    journal = journal_factory(clock=clock)
    call(journal, mode, "learn", "POST https://tools.test/charge", "replay marker")
    assert call(journal, mode, "begin", record("a")).evidence == "replay marker"
    assert call(journal, mode, "begin", record("b", route="POST https://x/y")).evidence is None
    clock.advance(31 * 24 * 3600)
    assert call(journal, mode, "begin", record("c")).evidence is None


def test_settle_calls_and_prune(journal_factory: Callable[..., Any]) -> None:
    """An operator's verdict lands whoever holds the record; old records are pruned."""
    clock = FakeClock(wall=NOW)
    journal = journal_factory(clock=clock)
    a, b = record("a", state=CallState.IN_DOUBT), record("b")
    journal.begin(a)
    journal.begin(b)
    assert [r.key for r in journal.calls(states=[CallState.IN_DOUBT])] == [a.key]
    clock.advance(5)
    settled = journal.settle(a.key, CallState.NOT_SENT, reason="checked the ledger")
    assert settled is not None
    assert (settled.state, settled.reason, settled.owner) == (
        CallState.NOT_SENT,
        "checked the ledger",
        None,
    )
    assert journal.calls(states=[CallState.IN_DOUBT]) == []
    assert journal.calls(plan="plan-1")[0].key == a.key  # newest change first
    assert journal.settle("plan-1:step_009:" + "f" * 64, CallState.NOT_SENT, reason="x") is None
    clock.advance(3)
    assert journal.prune(older_than=4) == 0  # b is pending (its sender gone): kept
    assert journal.prune(older_than=4, include_unsettled=True) == 1  # b, untouched for 8 s
    assert journal.get(b.key) is None
    assert journal.get(a.key) is not None  # a changed 3 s ago


@pytest.mark.parametrize("mode", MODES)
def test_begin_says_whether_the_earlier_sender_is_alive(
    journal_factory: Callable[..., Any], mode: Mode
) -> None:
    """A pending record is live while its sender is: this process's in-flight call, a live pid."""
    journal = journal_factory(clock=FakeClock(wall=NOW))
    mine = record("a")
    call(journal, mode, "begin", mine)
    assert call(journal, mode, "begin", mine).live is False  # its owner is not sending now
    with in_flight(mine.owner):
        assert call(journal, mode, "begin", mine).live is True


def test_liveness_of_other_owners() -> None:
    """Another process here: live while its pid exists and the lease lasts; elsewhere: the lease."""
    host = current_process().split(":")[0]
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    alive = record(owner=f"{host}:{os.getppid()}:zz:1")  # our parent: a running process
    gone = record(owner=f"{host}:{int(dead.stdout)}:zz:1")
    remote = record(owner="another-host:1:zz:1")
    assert is_live(alive, NOW)
    assert not is_live(gone, NOW)
    assert is_live(remote, NOW)
    assert not is_live(remote, NOW + 151)  # past the lease
    assert not is_live(alive.with_(state=CallState.IN_DOUBT), NOW)
