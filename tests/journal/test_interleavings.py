"""A property over interleavings of what agents and operators do to one journal (issue 34).

Agents begin calls, send them (the tool runs the call: one execution), finish them, and
die; an operator settles calls and prunes the journal; time passes. Each agent follows the
client's rule for a tool that does not honour keys: it sends a call only when ``begin``
wrote its record, or when it took over a record of a call that was not sent. On every
journal (memory, SQLite, Redis, PostgreSQL) the executions of a call never exceed one,
unless a person settled it ``--not-run`` after it had run (then each such wrong verdict
allows one more); and ``prune`` never removes a call that may have run and is not settled.

The default profile runs a few examples per journal; ``--hypothesis-profile long`` many.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentkey import JournalError
from agentkey.journal import CallRecord, CallState
from agentkey.journal._base import _IN_FLIGHT, SETTLED, current_owner
from agentkey.testing import FakeClock

AGENTS, KEYS = 3, 2
START = 1_800_000_000.0
#: A quarter of the profile's examples: 25 by default, 500 with the long profile.
_PROFILE = settings.default
EXAMPLES = max(10, (_PROFILE.max_examples if _PROFILE is not None else 100) // 4)

agent = st.integers(0, AGENTS - 1)
key = st.integers(0, KEYS - 1)
operation = st.one_of(
    st.tuples(st.just("begin"), agent, key),
    st.tuples(st.just("send"), agent, key),
    st.tuples(st.just("finish"), agent, key, st.sampled_from(["answered", "in_doubt"])),
    st.tuples(st.just("settle"), key, st.sampled_from(["ran", "not_run"])),
    st.tuples(st.just("prune")),
    st.tuples(st.just("kill"), agent),
    st.tuples(st.just("tick")),
)


@dataclass
class Agent:
    owner: str = field(default_factory=current_owner)
    holds: dict[int, bool] = field(default_factory=dict)  # key -> its request reached the tool

    def die(self) -> None:
        """The process is gone: its calls are no longer in flight; a new one takes its place."""
        _IN_FLIGHT.discard(self.owner)
        self.owner, self.holds = current_owner(), {}


class World:
    """The journal under test, the agents, and the truth: what the tool ran."""

    def __init__(self, journal: Any, clock: FakeClock) -> None:
        self.journal, self.clock = journal, clock
        self.plan = f"plan{uuid.uuid4().hex[:12]}"
        self.agents = [Agent() for _ in range(AGENTS)]
        self.executions: Counter[int] = Counter()
        self.wrong_verdicts: Counter[int] = Counter()  # "did not run" said of a call that ran
        self.retired: set[int] = set()  # keys whose ended record was pruned: never begun again

    def key(self, n: int) -> str:
        return f"{self.plan}:step_{n:03d}:" + f"{n:064x}"

    def record(self, n: int, owner: str) -> CallRecord:
        now = self.clock.time()
        return CallRecord(key=self.key(n), plan=self.plan, step=f"step_{n:03d}", tool="charge",
                          args_hash=f"{n:064x}", route="POST http://127.0.0.1:9/tools/charge",
                          created_at=now, updated_at=now, owner=owner,
                          lease_until=now + 10_000)  # fmt: skip

    def hold(self, who: Agent, n: int) -> None:
        who.holds[n] = False
        _IN_FLIGHT.add(who.owner)  # this agent is sending the call now

    def begin(self, who: Agent, n: int) -> None:
        if n in who.holds or n in self.retired:
            return
        mine = self.record(n, who.owner)
        begun = self.journal.begin(mine)
        earlier = begun.existing
        # None: its record was written; not sent: it never reached the tool, send it.
        taken = earlier is not None and earlier.state is CallState.NOT_SENT
        if earlier is None or (
            taken and self.journal.take_over(mine.with_(created_at=earlier.created_at), earlier)
        ):
            self.hold(who, n)
        # answered, failed, accepted: answered from the journal; pending and live: wait;
        # pending and dead, or in doubt: OutcomeUnknown. Nothing is sent.

    def send(self, who: Agent, n: int) -> None:
        if who.holds.get(n) is False:
            who.holds[n] = True
            self.executions[n] += 1

    def finish(self, who: Agent, n: int, outcome: str) -> None:
        if n not in who.holds:
            return
        reached = who.holds.pop(n)
        state = CallState(outcome) if reached else CallState.NOT_SENT
        now = self.clock.time()
        done = self.record(n, who.owner).with_(state=state, updated_at=now)
        current = self.journal.get(self.key(n))
        assert current is not None, "the record of a call being sent vanished"
        assert self.journal.finish(done.with_(created_at=current.created_at)) is True
        if not who.holds:
            _IN_FLIGHT.discard(who.owner)

    def settle(self, n: int, verdict: str) -> None:
        state = CallState.ANSWERED if verdict == "ran" else CallState.NOT_SENT
        try:
            settled = self.journal.settle(self.key(n), state, reason="an operator's verdict")
        except JournalError:
            return  # refused: its sender is alive, or it already ended
        if settled is not None and state is CallState.NOT_SENT and self.executions[n]:
            self.wrong_verdicts[n] += 1

    def prune(self) -> None:
        before = {n: self.journal.get(self.key(n)) for n in range(KEYS)}
        self.journal.prune(older_than=60)
        for n, was in before.items():
            after = self.journal.get(self.key(n))
            if was is not None and was.state not in SETTLED:
                assert after is not None, f"prune removed a call in doubt ({was.state.value})"
            if was is not None and after is None:
                self.retired.add(n)

    def step(self, op: tuple[Any, ...]) -> None:
        name, *args = op
        if name in ("begin", "send", "finish"):
            getattr(self, name)(self.agents[args[0]], *args[1:])
        elif name == "kill":
            self.agents[args[0]].die()
        elif name == "tick":
            self.clock.advance(100)
        else:
            getattr(self, name)(*args)
        for n in range(KEYS):
            assert self.executions[n] <= 1 + self.wrong_verdicts[n], (n, self.executions)

    def end(self) -> None:
        for each in self.agents:
            each.die()


@settings(
    max_examples=EXAMPLES,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(operation, max_size=30))
def test_no_interleaving_runs_a_call_twice(
    journal_factory: Callable[..., Any], ops: list[tuple[Any, ...]]
) -> None:
    """Any interleaving of begin, send, finish, settle, prune, kill and time passing: each
    call runs at most once (one more per wrong "did not run" verdict), and prune keeps
    every call in doubt."""
    journal, clock = _journal(journal_factory)
    world = World(journal, clock)
    try:
        for op in ops:
            world.step(op)
    finally:
        world.end()


def _journal(factory: Callable[..., Any]) -> tuple[Any, FakeClock]:
    """One journal per test run (the factory's store) and its clock, which only moves on:
    each example goes on from the time the one before it left (its plan is new)."""
    made: tuple[Any, FakeClock] | None = getattr(factory, "interleaved", None)
    if made is None:
        clock = FakeClock(wall=START)
        made = (factory(clock=clock), clock)
        factory.interleaved = made  # type: ignore[attr-defined]
    return made
