"""The one atomic step an agent runtime's call is identified by (issue 34 item 5).

The journal half: ``begin(record, repeats=True, known=...)`` on every journal, which
records the call only when no identical call beyond the ``known`` ones exists. The
flow half (``_flow.identified``), driven by hand on a real in-memory journal: the
rule chooses, the journal confirms in the step that records, and the key chosen
then is the one sent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from agentkey import PlanSession, PollPolicy, RetryPolicy, StepInProgress
from agentkey.client._drive import run_sync
from agentkey.client._effects import Emit, Journaled, Outgoing, Sleep
from agentkey.client._flow import MAX_CHOICES, Call, Pick, Settings, identified
from agentkey.client._net import origin_of
from agentkey.client._policies import DEFAULT_RETRY_STATUSES
from agentkey.client._protocol import Answer, ProtocolConfig
from agentkey.journal import CallRecord, MemoryJournal
from agentkey.journal._base import current_owner
from agentkey.journal._records import Begun
from agentkey.testing import FakeClock
from tests.journal.conftest import journal_factory, postgres_proc
from tests.journal.test_journal import MODES, NOW, Mode, call, record

__all__ = ["journal_factory", "postgres_proc"]  # the journal tests' fixtures, every kind


@pytest.mark.parametrize("mode", MODES)
def test_begin_with_known_records_only_when_no_unseen_identical_call_exists(
    journal_factory: Callable[..., Any], mode: Mode
) -> None:
    """begin(repeats=True, known=...): an identical call (any runtime call id) not among the
    known keys is returned, nothing written; once it is known, the call is written. Another
    tool's call with the same arguments never holds it back."""
    journal = journal_factory(clock=FakeClock(wall=NOW))
    first = record("a", created_at=NOW, call_id="call-1")
    assert call(journal, mode, "begin", first, repeats=True, known=()) == Begun(None, None)
    second = record("aa", created_at=NOW + 1, args_hash=first.args_hash, call_id="call-2")
    begun = call(journal, mode, "begin", second, repeats=True, known=())
    assert (begun.existing, begun.earlier) == (None, (first,))
    assert call(journal, mode, "get", second.key) is None  # nothing written
    begun = call(journal, mode, "begin", second, repeats=True, known=(first.key,))
    assert (begun.existing, begun.earlier) == (None, ())
    assert call(journal, mode, "get", second.key) == second
    refund = record("aaa", args_hash=first.args_hash, tool="refund", call_id="call-3")
    assert call(journal, mode, "begin", refund, repeats=True, known=()).earlier == ()
    assert call(journal, mode, "get", refund.key) == refund
    mine = call(journal, mode, "begin", first, repeats=True, known=(second.key,))
    assert (mine.existing, mine.earlier) == (first, ())  # its own key: the record there


# --- the flow, driven by hand ----------------------------------------------------------------

BASE = "https://tool.test"
CONFIG = ProtocolConfig(
    base_origin=origin_of(BASE),  # type: ignore[arg-type]
    retry_statuses=DEFAULT_RETRY_STATUSES,
)
RETRY = RetryPolicy(initial_backoff=0.5, max_backoff=2.0, deadline=60.0)
ARGS = {"amount": 5}


@dataclass
class Rule:
    """An identity rule: a key of its own (step 2) until it sees an identical call, whose key
    it then takes (as ``_identity`` does for a call asked again)."""

    plan: PlanSession
    asked: list[tuple[tuple[str, ...], bool]] = field(default_factory=list)

    def choose(self, earlier: Sequence[CallRecord], looked: bool) -> Pick:
        self.asked.append((tuple(r.key for r in earlier), looked))
        others = [r for r in earlier if r.call_id != "mine"]
        if others:
            return Pick(key=others[0].key, repeat_of=others[0].step)
        return Pick(key=self.plan.step(2, "charge", ARGS, on_repeat="allow").idempotency_key)


def _drive(journal: Any, rule: Any, plan: PlanSession) -> tuple[Any, list[Any]]:
    """Run one identified call on ``journal``; the tool answers 200. What it gave, and the
    effects it yielded."""
    clock = [1000.0]
    settings = Settings(
        CONFIG, RETRY, PollPolicy(), False, lambda: clock[0], lambda: 0.5,
        lambda: NOW + clock[0], journal=True, journal_max_body=1 << 20, honours_keys=True,
    )  # fmt: skip
    template = plan.step(0, "charge", ARGS, on_repeat="allow")
    key = template.idempotency_key
    the_call = Call(
        f"{BASE}/tools/charge", "POST", (), key, template.label, key, template.body,
        tool="charge", plan=plan.id, args_hash=template.key.args_hash, call_id="mine",
        context="turn-1", owner=current_owner(), identity=rule,
    )  # fmt: skip
    effects: list[Any] = []

    def carry(effect: Any) -> Any:
        effects.append(effect)
        if isinstance(effect, Journaled):
            return getattr(journal, effect.op)(*effect.args, **effect.kwargs)
        if isinstance(effect, Sleep):
            clock[0] += effect.seconds
            return None
        if isinstance(effect, Emit):
            return None
        assert isinstance(effect, Outgoing)
        return Answer(200, {}, b'{"ok":true}', effect.url)

    return run_sync(identified(the_call, settings), carry), effects


def test_a_key_chosen_before_an_identical_call_was_seen_is_never_recorded_nor_sent() -> None:
    """Another copy recorded the identical call first: the begin under this call's own key
    writes nothing and shows it; the rule chooses again, seeing it, and the call is recorded
    and sent under that key alone (its own key is in no record and no request)."""
    plan = PlanSession.new()
    journal = MemoryJournal()
    other = plan.step(1, "charge", ARGS)
    theirs = CallRecord(
        key=other.idempotency_key, plan=plan.id, step=other.label, tool="charge",
        args_hash=other.key.args_hash, route=f"POST {BASE}/tools/charge", call_id="theirs",
        created_at=NOW, updated_at=NOW, owner="elsewhere:1:x:1", lease_until=NOW + 1,
    )  # fmt: skip
    journal.begin(theirs)
    rule = Rule(plan)
    done, effects = _drive(journal, rule, plan)
    own = plan.step(2, "charge", ARGS, on_repeat="allow").idempotency_key
    begins = [e for e in effects if isinstance(e, Journaled) and e.op == "begin"]
    assert [(b.args[0].key, b.kwargs.get("known")) for b in begins] == [
        (own, ()),
        (other.idempotency_key, (other.idempotency_key,)),
    ]
    assert rule.asked == [((), False), ((other.idempotency_key,), True)]
    sent = [dict(e.headers)["Idempotency-Key"] for e in effects if isinstance(e, Outgoing)]
    assert sent == [other.idempotency_key]
    assert (done.key, done.repeat_of) == (other.idempotency_key, other.label)
    assert journal.get(own) is None


def test_a_call_whose_rule_never_settles_is_refused_unsent() -> None:
    """A journal that shows a new identical call at every begin: after MAX_CHOICES choices
    the call ends StepInProgress, recorded nowhere, nothing sent."""
    plan = PlanSession.new()

    class Crowded:
        def __init__(self) -> None:
            self.n = 0

        def begin(self, record: CallRecord, **options: Any) -> Begun:
            self.n += 1
            return Begun(None, None, False, (record.with_(key=f"{plan.id}:x{self.n}"),))

        def find(self, plan_id: str, **options: Any) -> list[CallRecord]:
            return []

    @dataclass
    class Stubborn:
        def choose(self, earlier: Sequence[CallRecord], looked: bool) -> Pick:
            return Pick(key=plan.step(2, "charge", ARGS, on_repeat="allow").idempotency_key)

    journal = Crowded()
    with pytest.raises(StepInProgress, match="nothing was sent"):
        _drive(journal, Stubborn(), plan)
    assert journal.n == MAX_CHOICES
