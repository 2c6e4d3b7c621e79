"""``agentkey.testing.set_testing()`` as a user's own suite uses it, and the one fake clock.

A real tool server on loopback (the example server behind the real middleware, with a
proxy in front that refuses the first two requests with agentkey's ``503 not_run`` and
``Retry-After: 1``); invokers built with no clock and no journal, the production
``RetryPolicy``, as an agent's code builds them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agentkey import Clock, ConfigurationError, PlanSession, Step, ToolInvoker
from agentkey._clock import SYSTEM, SkippingClock, default_clock
from agentkey.journal import MemoryJournal, SQLiteJournal, _default
from agentkey.journal._default import ENV
from agentkey.testing import FakeClock, example_app, set_testing
from tests._loopback import serve
from tests.journal._tools import PlainTool

NOT_RUN = json.dumps(
    {"type": "urn:agentkey:problem:not_run", "title": "Not run", "status": 503,
     "detail": "the store is down; nothing ran"}
).encode()  # fmt: skip


@dataclass
class Flaky:
    """The example tool server, behind a proxy that refuses its first ``refusals`` POSTs
    with ``503 not_run`` (nothing ran) and ``Retry-After: 1``. Counts what reached it."""

    refusals: int = 2
    app: Any = field(default_factory=example_app)
    keys: list[str] = field(default_factory=list)  # the Idempotency-Key of every POST

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = dict(scope["headers"])
            self.keys.append(headers.get(b"idempotency-key", b"").decode())
            if len(self.keys) <= self.refusals:
                await send({"type": "http.response.start", "status": 503, "headers": [
                    (b"content-type", b"application/problem+json"),
                    (b"idempotency-protected", b"true"), (b"retry-after", b"1"),
                ]})  # fmt: skip
                await send({"type": "http.response.body", "body": NOT_RUN})
                return
        await self.app(scope, receive, send)

    @property
    def executions(self) -> int:
        return int(self.app.state.executions["charge"])


@pytest.fixture
def data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A user's machine: no ``$AGENTKEY_JOURNAL`` (this suite's conftest sets one), a data
    directory of its own, no default journal opened yet. Returns the default journal path."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setattr(_default, "_shared", {})
    return tmp_path / "data" / "agentkey" / "journal.sqlite3"


@pytest.fixture
def tool() -> Iterator[tuple[Flaky, str]]:
    """The flaky tool server on loopback (built before testing mode: only the agent's side
    is under test) and its URL."""
    flaky = Flaky()
    with serve(flaky) as url:
        yield flaky, url


@pytest.fixture
def testing_mode(data_dir: Path) -> Iterator[Path]:
    """What a user's conftest does: testing mode for the test, whatever was before after it."""
    with set_testing():
        yield data_dir
    assert default_clock() is SYSTEM
    assert not _default.is_testing()


def charge(plan: PlanSession) -> Step:
    return plan.step(0, "charge", {"amount": 1999, "currency": "EUR"})


def skipped(clock: Clock) -> float:
    """How far the skipping clock is ahead of the real one: the waits it skipped so far."""
    return clock.monotonic() - time.monotonic()


def test_a_production_retry_schedule_runs_without_waiting_and_journals_in_memory(
    testing_mode: Path, tool: tuple[Flaky, str]
) -> None:
    """Under set_testing(True) an invoker built with no clock, no journal and the production
    RetryPolicy gets through two 503s with Retry-After: 1: the 2 s are skipped on the default
    clock, not slept; the tool ran once; nothing is written to the data directory."""
    flaky, url = tool
    clock = default_clock()
    assert isinstance(clock, SkippingClock)
    ahead = skipped(clock)
    step = charge(PlanSession.new())
    with ToolInvoker(url, route_template="/tools/{tool}") as invoker:
        result = invoker.invoke(step)
        assert isinstance(invoker.journal, MemoryJournal)
        assert invoker.journal.get(step.idempotency_key) is not None  # it did journal the call
    assert (result.status_code, result.attempts) == (201, 3)
    assert (flaky.keys, flaky.executions) == ([step.idempotency_key] * 3, 1)
    assert skipped(clock) - ahead == pytest.approx(2.0, abs=0.25)  # the two Retry-After waits
    assert not testing_mode.parent.exists()  # no journal file, not even its directory


def test_two_invokers_under_testing_mode_do_not_share_journal_records(
    testing_mode: Path,
) -> None:
    """Two tests' invokers, the same plan id, one tool server that does not honour keys:
    under set_testing each journals in memory of its own, so the second one's call reaches
    the server and gets its own answer. With one shared default journal (testing mode off)
    the second was answered from the first one's record: run 1, source "journal", the
    server never asked."""
    plain = PlainTool()
    with serve(plain) as url:
        results, journals = [], []
        for _test in range(2):  # two tests, each with its invoker and a fixed thread id
            step = charge(PlanSession.from_external_id("thread-1"))
            with ToolInvoker(url, route_template="/tools/{tool}") as invoker:
                results.append(invoker.invoke(step))
                journals.append(invoker.journal)
    assert plain.executions["charge"] == 2  # each test's call reached the server
    assert [(r.body["run"], r.source) for r in results] == [(1, "tool"), (2, "tool")]
    assert all(isinstance(j, MemoryJournal) for j in journals)
    assert journals[0] is not journals[1]
    assert not testing_mode.parent.exists()


def test_set_testing_false_restores_the_system_clock_and_the_default_journal(
    data_dir: Path,
) -> None:
    """set_testing(False) after set_testing(True): objects built afterwards get the system
    clock and the default journal file in the data directory again; the context manager
    restores what was in force before it, and a non-bool is refused."""
    try:
        set_testing(True)
        assert isinstance(default_clock(), SkippingClock)
        assert isinstance(_default.resolve_journal(None), MemoryJournal)
        set_testing(False)
        assert default_clock() is SYSTEM
        journal = _default.resolve_journal(None)
        assert isinstance(journal, SQLiteJournal)
        assert journal.path == data_dir
        assert data_dir.exists()
        journal.close()
        with set_testing(True):
            inner = default_clock()
            with set_testing(False):
                assert default_clock() is SYSTEM
            assert default_clock() is inner  # nested: the outer mode is back
        assert default_clock() is SYSTEM
        assert not _default.is_testing()
        with pytest.raises(ConfigurationError, match="set_testing takes True or False"):
            set_testing("yes")  # type: ignore[arg-type]
    finally:
        set_testing(False)


def test_testing_mode_keeps_tests_out_of_the_journal_agentkey_journal_names(
    testing_mode: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """$AGENTKEY_JOURNAL set for the agent's own runs (a file, or memory shared by the
    process): under set_testing each invoker still journals in memory of its own and the
    file is never created; "off" still means no journal (before: the file was used)."""
    agents = tmp_path / "agent" / "journal.sqlite3"
    for setting in (str(agents), "memory"):
        monkeypatch.setenv(ENV, setting)
        one, two = _default.resolve_journal(None), _default.resolve_journal(None)
        assert isinstance(one, MemoryJournal)
        assert isinstance(two, MemoryJournal)
        assert one is not two
    assert not agents.parent.exists()
    monkeypatch.setenv(ENV, "off")
    assert _default.resolve_journal(None) is None


def test_a_journal_built_in_testing_mode_runs_on_the_skipping_clock(testing_mode: Path) -> None:
    """A journal built with no clock in testing mode dates its records on the skipping
    clock: a wait skipped there makes its evidence that much older."""
    clock = default_clock()
    journal = MemoryJournal()
    journal.learn("POST https://tools.test/charge", "protection header", ttl=60)
    assert len(journal.evidence()) == 1
    clock.sleep(61)  # returns at once; the journal's time moved on by it
    assert journal.evidence() == []


# --- FakeClock ----------------------------------------------------------------------------


def test_fake_clock_moves_only_when_told_and_records_every_wait() -> None:
    """advance() and sleep() move monotonic and wall time together; sleeps are recorded in
    order (a negative one too, without moving the clock back); advance() never goes back."""
    clock = FakeClock(start=10.0, wall=1_000.0)
    assert isinstance(clock, Clock)
    assert (clock.monotonic(), clock.time()) == (10.0, 1_000.0)
    clock.advance(2.5)
    clock.sleep(1.5)
    clock.sleep(-1.0)
    assert clock.sleeps == [1.5, -1.0]
    assert (clock.monotonic(), clock.time()) == (14.0, 1_004.0)
    for wrong in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite number >= 0"):
            clock.advance(wrong)
    assert clock.monotonic() == 14.0


def test_fake_clock_draws_in_turn_then_repeats_the_last() -> None:
    """random() returns draws= in order, then the last one for ever; 0.5 by default; a draw
    outside [0, 1), or none, is refused."""
    clock = FakeClock(draws=[0.1, 0.9])
    assert [clock.random() for _ in range(4)] == [0.1, 0.9, 0.9, 0.9]
    assert FakeClock().random() == 0.5
    for bad in ([], [1.0], [-0.1]):
        with pytest.raises(ValueError, match="draws="):
            FakeClock(draws=bad)


def test_fake_clock_asleep_records_the_wait_and_lets_other_tasks_run() -> None:
    """await asleep(s) records s, moves the clock by s at once, and yields to the event loop
    (another task runs in between), as a real wait would."""
    clock = FakeClock(start=0.0)
    order: list[str] = []

    async def sleeper() -> None:
        await clock.asleep(30.0)
        order.append(f"woke at {clock.monotonic():g}")

    async def other() -> None:
        order.append("other ran")

    async def main() -> None:
        await asyncio.gather(sleeper(), other())

    asyncio.run(main())
    assert order == ["other ran", "woke at 30"]
    assert clock.sleeps == [30.0]
