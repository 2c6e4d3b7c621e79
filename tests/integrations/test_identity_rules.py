"""Issue 38: the identity rule's cases for recoveries that change the plan or hide the history.

Pure logic on the rule itself (``_identity.decide``, ``unfinished_elsewhere``,
``adopted``); the recoveries they serve run against real processes and a real tool
server in ``tests/recovery/`` and ``tests/integrations/test_identity_recipes_race.py``.
"""

from __future__ import annotations

import logging

import pytest
import redis.asyncio as aioredis

from agentkey import AsyncToolInvoker, PlanSession
from agentkey._canonical import args_hash
from agentkey.integrations._adapter import unsettled
from agentkey.integrations._identity import (
    CallSite,
    Earlier,
    Seen,
    adopted,
    decide,
    in_thread,
    lost_turns,
    unfinished_elsewhere,
)
from agentkey.journal import CallRecord, RedisJournal
from agentkey.journal._records import CallState

ARGS = {"amount": 5}
DIGEST = args_hash(ARGS)


def _key(plan: PlanSession, index: int) -> str:
    return plan.step(index, "charge", ARGS, on_repeat="allow").idempotency_key


def _record(plan: PlanSession, index: int, call_id: str, context: str) -> CallRecord:
    return CallRecord(
        key=_key(plan, index), plan=plan.id, step=f"step_{index}", tool="charge",
        args_hash=DIGEST, route="POST /tools/charge", state=CallState.PENDING,
        call_id=call_id, context=context, created_at=float(index),
    )  # fmt: skip


def test_a_task_without_history_takes_another_runs_call_never_its_own_runs() -> None:
    """No history shown (a @task): an identical call of another run on the thread is asked
    again (its key, a repeat); one of the same run (a twin in one response) is a new call;
    and a key this run already took again is not taken by its second call."""
    plan = PlanSession.from_external_id("thread-1")
    earlier_run = [Earlier(_key(plan, 1), "c1", "t#run-1"), Earlier(_key(plan, 2), "c2", "t#run-1")]
    site = CallSite(plan, "charge", ARGS, "c3", context="t#run-2", seen=Seen(shown=False))
    first = decide(site, earlier_run, "replay", DIGEST)
    assert first.key == _key(plan, 1)
    assert first.repeat_of is not None
    taken = [*earlier_run, Earlier(_key(plan, 1), "c3", "t#run-2")]
    second = CallSite(plan, "charge", ARGS, "c4", context="t#run-2", seen=Seen(shown=False))
    assert decide(second, taken, "replay", DIGEST).key == _key(plan, 2)
    twin = [Earlier(_key(plan, 3), "c5", "t#run-3")]
    same_run = CallSite(plan, "charge", ARGS, "c6", context="t#run-3", seen=Seen(shown=False))
    assert decide(same_run, twin, "replay", DIGEST).key is None  # a new call


def test_an_unsettled_call_of_another_plan_in_the_same_scope_is_adopted() -> None:
    """unfinished_elsewhere finds the oldest identical unsettled call of another plan in the
    same scope, never one of another scope, tool or arguments; adopted() moves the call to
    its plan, where decide() gives it that call's key as asked again."""
    crashed, now = PlanSession.from_external_id("run-1"), PlanSession.from_external_id("run-2")
    lost = _record(crashed, 1, "c1", "run 1 in conversation C")
    elsewhere = _record(PlanSession.from_external_id("run-0"), 1, "c0", "run 0 in conversation D")
    site = CallSite(now, "charge", ARGS, "c9", context="run 2", seen=Seen())
    in_c = lambda context: (context or "").endswith(" in conversation C")  # noqa: E731
    assert unfinished_elsewhere(site, DIGEST, [elsewhere, lost], in_c) == lost
    assert unfinished_elsewhere(site, "0" * 64, [lost], in_c) is None
    moved = adopted(site, lost)
    assert moved.plan.id == crashed.id
    verdict = decide(moved, [Earlier(lost.key, lost.call_id, lost.context)], "replay", DIGEST)
    assert verdict.key == lost.key
    assert verdict.repeat_of is not None


def test_a_key_the_history_knows_counts_beside_a_copys_record_of_it() -> None:
    """A key known from the history (an unanswered call of an earlier run) still counts when
    the journal holds it under another call id (a copy of the job took it first)."""
    plan = PlanSession.from_external_id("run-1")
    key = _key(plan, 1)
    copy = [Earlier(key, "c-copy", "other run")]
    site = CallSite(
        plan, "charge", ARGS, "c-mine", context="mine",
        seen=Seen(contexts=frozenset({"mine"}), asked={"c1": (0, 1), "c-mine": (0, 3)}),
        position=(0, 3), known={"c1": key},
    )  # fmt: skip
    assert decide(site, copy, "replay", DIGEST).key == key


def test_a_thread_never_adopts_the_unsettled_call_of_a_thread_named_after_it() -> None:
    """Thread "acme" never takes (nor warns of) the unsettled call of thread "acme#bob"
    (context "acme#bob#m1"), nor "acme#bob" that of thread "acme" with message "bob#m1":
    an ambiguous context is missed; an unambiguous one of the same thread is still found."""
    bob = PlanSession.from_external_id("acme#bob")
    ambiguous = _record(bob, 7, "call-bob", "acme#bob#m1")
    for thread in ("acme", "acme#bob"):
        mine = PlanSession.from_external_id(f"{thread} now")
        site = CallSite(mine, "charge", ARGS, "c9", context=f"{thread}#m9", fresh_thread=thread)
        assert unfinished_elsewhere(site, DIGEST, [ambiguous], in_thread(thread)) is None
        assert lost_turns(site, DIGEST, [ambiguous]) == []
    own = _record(PlanSession.from_external_id("acme"), 1, "c1", "acme#m1")
    site = CallSite(bob, "charge", ARGS, "c9", context="acme#m9", fresh_thread="acme")
    assert unfinished_elsewhere(site, DIGEST, [ambiguous, own], in_thread("acme")) == own
    assert lost_turns(site, DIGEST, [ambiguous, own]) == ["step_1"]


def test_an_async_only_journal_says_once_that_the_lost_call_recovery_is_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """unsettled() on a journal it cannot read synchronously (RedisJournal on redis.asyncio)
    finds nothing, and says so once per journal (which recovery is off, what to pass)."""
    journal = RedisJournal(aioredis.Redis(host="127.0.0.1", port=1))  # never contacted
    invoker = AsyncToolInvoker("http://127.0.0.1:9", journal=journal)
    with caplog.at_level(logging.WARNING, logger="agentkey"):
        assert unsettled(invoker) == []
        assert unsettled(invoker) == []
    (said,) = [r.getMessage() for r in caplog.records]
    assert "RedisJournal" in said
    assert "cannot be read synchronously" in said
    assert "redis.Redis" in said
