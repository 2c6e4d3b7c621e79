"""Issue 23, case 11: a custom loop repeating a call at a new step index.

The plan answers a repeat it remembers with the earlier step; the journal catches the
repeats the plan cannot know (a plan saved before the step was handed out). Either
way the repeat is visible: a WARNING log line, ``repeat_of`` on the result; and
``on_repeat="allow"`` is the one argument that makes it a new call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from typing import Any

import pytest

from agentkey import AsyncToolInvoker, PlanSession, Step, StepRepeated, ToolInvoker, ToolResult
from agentkey.server import IdempotencyMiddleware, MemoryStore
from tests._loopback import serve
from tests.journal._tools import PassThrough, PlainTool

DRIVERS = ("sync", "async")
ARGS = {"amount": 1999, "currency": "EUR"}


def invoke(driver: str, url: str, step: Step) -> ToolResult:
    options: dict[str, Any] = {"route_template": "/tools/{tool}"}
    if driver == "sync":
        with ToolInvoker(url, **options) as invoker:
            return invoker.invoke(step)

    async def run() -> ToolResult:
        async with AsyncToolInvoker(url, **options) as invoker:
            return await invoker.invoke(step)

    return asyncio.run(run())


@pytest.fixture(params=["plain", "middleware"])
def tool(request: pytest.FixtureRequest) -> Any:
    plain = PlainTool()
    app: Any = plain
    if request.param == "middleware":
        app = IdempotencyMiddleware(plain, store=MemoryStore(), shared_key_space=True)
    with serve(app) as url:
        yield plain, url


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("saved", ["before the first step", "after the first step"])
def test_a_repeat_at_a_new_index_is_merged_visibly_whenever_the_plan_was_saved(
    tool: Any, driver: str, saved: str, caplog: pytest.LogCaptureFixture
) -> None:
    """plan.step(0, ...) then plan.step(1, ...) with the same call: one run, step_000's answer,
    repeat_of on the result and a WARNING, whether the plan was saved before or after step 0
    was handed out (restored in a new process, the journal remembers)."""
    plain, url = tool
    plan = PlanSession.new()
    snapshot = plan.to_json() if saved == "before the first step" else None
    first = invoke(driver, url, plan.step(0, "charge", ARGS))
    restored = PlanSession.from_json(snapshot or plan.to_json())
    with caplog.at_level(logging.WARNING, logger="agentkey"):
        again = invoke(driver, url, restored.step(1, "charge", ARGS))
    assert plain.executions["charge"] == 1
    assert again.repeat_of == "step_000"
    assert again.idempotency_key == first.idempotency_key
    assert again.body == first.body
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("repeat")]
    assert len(warned) == 1
    assert "on_repeat='allow'" in warned[0]
    assert first.idempotency_key not in warned[0]  # the key shows as a digest


@pytest.mark.parametrize("driver", DRIVERS)
def test_allow_is_the_one_argument_for_an_intended_repeat(tool: Any, driver: str) -> None:
    """on_repeat="allow" makes the same call at a new step a new operation: it runs again."""
    plain, url = tool
    plan = PlanSession.new()
    snapshot = plan.to_json()
    invoke(driver, url, plan.step(0, "charge", ARGS))
    again = PlanSession.from_json(snapshot).step(1, "charge", ARGS, on_repeat="allow")
    result = invoke(driver, url, again)
    assert result.repeat_of is None
    assert result.idempotency_key.split(":")[1] == "step_001"
    assert plain.executions["charge"] == 2


@pytest.mark.parametrize("driver", DRIVERS)
def test_raise_refuses_a_repeat_the_journal_finds(tool: Any, driver: str) -> None:
    """on_repeat="raise": a repeat found in the journal raises StepRepeated, nothing is sent."""
    plain, url = tool
    plan = PlanSession.new()
    snapshot = plan.to_json()
    invoke(driver, url, plan.step(0, "charge", ARGS))
    again = PlanSession.from_json(snapshot).step(1, "charge", ARGS, on_repeat="raise")
    with pytest.raises(StepRepeated) as caught:
        invoke(driver, url, again)
    assert caught.value.previous_step == "step_000"
    assert plain.executions["charge"] == 1


def test_a_fresh_call_costs_the_redis_journal_two_round_trips(redis_proc: Any) -> None:
    """The start (with its look-up for the same call at another step) and the end: two
    round trips per call whatever the plan's length (three before the look-up joined the
    start, and that look-up read the whole plan)."""
    from agentkey.journal import RedisJournal
    from tests.postgres.conftest import TurnCounter

    plain = PlainTool()

    async def run() -> list[int]:
        counter = TurnCounter(redis_proc)  # any TCP server: it counts the client's turns
        await counter.start()
        journal = RedisJournal(f"redis://127.0.0.1:{counter.port}/0", prefix="rt-journal")
        plan = PlanSession.new()
        turns = []
        options: dict[str, Any] = {"journal": journal, "route_template": "/tools/{tool}"}
        try:
            async with AsyncToolInvoker(url, **options) as tools:
                await tools.invoke(plan.step(0, "charge", {"amount": 0}))  # connects
                for index in range(1, 41):
                    counter.reset()
                    await tools.invoke(plan.step(index, "charge", {"amount": index}))
                    turns.append(counter.turns)
        finally:
            await journal.aclose()
            await counter.close()
        return turns

    with serve(plain) as url:
        turns = asyncio.run(run())
    assert turns == [2] * 40
    assert plain.executions["charge"] == 41


def test_a_fresh_call_costs_the_sqlite_journal_two_statements(tmp_path: Any) -> None:
    """A fresh call's start carries its look-up for the same call at another step in its
    one INSERT, and its end is one UPDATE: two statements (five before: BEGIN, SELECT,
    INSERT, COMMIT, UPDATE); a repeat still finds the earlier step."""
    from agentkey.journal import SQLiteJournal

    plain = PlainTool()
    journal = SQLiteJournal(tmp_path / "journal.sqlite3")
    statements: list[str] = []
    plan = PlanSession.new()
    with (
        serve(plain) as url,
        ToolInvoker(url, journal=journal, route_template="/tools/{tool}") as tools,
    ):
        tools.invoke(plan.step(0, "charge", {"amount": 0}))  # opens, prunes, reads evidence
        journal._connection().set_trace_callback(lambda sql: statements.append(sql.split()[0]))
        for index in range(1, 11):
            tools.invoke(plan.step(index, "charge", {"amount": index}))
        assert statements == ["INSERT", "UPDATE"] * 10
        repeat = tools.invoke(plan.step(11, "charge", {"amount": 3}))
    journal.close()
    assert repeat.repeat_of == "step_003"
    assert plain.executions["charge"] == 11


def test_listing_calls_on_redis_costs_two_round_trips_not_one_per_record(redis_proc: Any) -> None:
    """journal.calls() over 30 records (what an adapter's first-turn check reads): the index,
    then every record in one pipelined round trip (before: one GET per record, 31)."""
    from agentkey.journal import CallRecord, RedisJournal
    from tests.postgres.conftest import TurnCounter

    async def run() -> int:
        counter = TurnCounter(redis_proc)
        await counter.start()
        journal = RedisJournal(f"redis://127.0.0.1:{counter.port}/0", prefix="rt-calls")
        now = time.time()
        records = [
            CallRecord(
                key=f"plan{n}:step_000:{n:064x}",
                plan=f"plan{n}",
                step="step_000",
                tool="charge",
                args_hash=f"{n:064x}",
                route="POST https://tools.test/charge",
                created_at=now,
                updated_at=now,
            )
            for n in range(30)
        ]
        try:
            for one in records:  # the sync journal, off the proxy's event loop
                await asyncio.to_thread(journal.begin, one)
            counter.reset()
            listed = await asyncio.to_thread(journal.calls, limit=100)
            assert len(listed) == 30
            return counter.turns
        finally:
            await asyncio.to_thread(journal.close)
            await counter.close()

    assert asyncio.run(run()) == 2


class SlowToBegin(PassThrough):
    """A real journal whose every ``begin`` starts 50 ms late: two concurrent calls then
    reach it together, the way two tasks of one agent can."""

    def begin(self, record: Any, **options: Any) -> Any:
        time.sleep(0.05)
        return self.inner.begin(record, **options)

    async def abegin(self, record: Any, **options: Any) -> Any:
        await asyncio.sleep(0.05)
        return await self.inner.abegin(record, **options)


@pytest.mark.parametrize("driver", DRIVERS)
def test_two_concurrent_repeats_of_one_call_run_it_once(journal_factory: Any, driver: str) -> None:
    """Two copies of one saved plan send the same call at different steps at the same time
    (a plain tool): the look-up for the same call and the record are one step of the
    journal (PostgreSQL: under an advisory lock, in one transaction), so one call runs and
    the other is its labelled repeat. Before, both looked, both found nothing and both ran."""
    plain = PlainTool()
    journal = SlowToBegin(journal_factory())
    snapshot = PlanSession.new().to_json()
    first = PlanSession.from_json(snapshot).step(1, "charge", ARGS)
    second = PlanSession.from_json(snapshot).step(2, "charge", ARGS)
    options: dict[str, Any] = {"journal": journal, "route_template": "/tools/{tool}"}
    with serve(plain) as url:
        if driver == "sync":
            with (
                ToolInvoker(url, **options) as tools,
                concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool,
            ):
                results = list(pool.map(tools.invoke, [first, second]))
        else:

            async def both() -> list[ToolResult]:
                async with AsyncToolInvoker(url, **options) as tools:
                    done = await asyncio.gather(tools.invoke(first), tools.invoke(second))
                await journal.aclose()
                return list(done)

            results = asyncio.run(both())
    assert plain.executions["charge"] == 1
    assert sorted(r.repeat_of is not None for r in results) == [False, True]
    assert results[0].body == results[1].body
    assert results[0].idempotency_key == results[1].idempotency_key


def _record(plan: str, index: int) -> Any:
    from agentkey.journal._records import CallRecord

    return CallRecord(
        key=f"{plan}:step_{index:03d}:{uuid.uuid4().hex}",
        plan=plan,
        step=f"step_{index:03d}",
        tool="charge",
        args_hash=f"args{index}",
        route="POST http://127.0.0.1/tools/charge",
    )


@pytest.mark.parametrize("driver", DRIVERS)
def test_round_trips_of_a_postgres_begin(postgres_proc: Any, driver: str) -> None:
    """Counted on the wire per begin: 2 round trips for a plain start (the pool's check and
    the statement), 3 for a start that looks for the same call at another step (the check;
    BEGIN, lock and look; the insert and COMMIT), 3 when it finds one. Before: 4, 8 and 4
    (separate BEGIN and COMMIT turns, and the look and the insert in two transactions)."""
    from agentkey.journal import PostgresJournal
    from tests.postgres.conftest import TurnCounter

    async def run() -> dict[str, list[int]]:
        counter = TurnCounter(postgres_proc)
        await counter.start()
        journal = PostgresJournal(counter.dsn, table=f"rt{uuid.uuid4().hex[:10]}")
        turns: dict[str, list[int]] = {"plain": [], "repeats": [], "found": []}

        async def begin(record: Any, repeats: bool) -> Any:
            if driver == "sync":  # in a thread: the proxy runs on this loop
                return await asyncio.to_thread(journal.begin, record, repeats=repeats)
            return await journal.abegin(record, repeats=repeats)

        try:
            await begin(_record("warm", 0), False)  # connects, creates the tables
            for index in range(1, 6):
                for kind, repeats in (("plain", False), ("repeats", True)):
                    counter.reset()
                    await begin(_record(f"{kind}{index}", index), repeats)
                    turns[kind].append(counter.turns)
                counter.reset()
                found = await begin(_record(f"repeats{index}", index), True)  # another key
                turns["found"].append(counter.turns)
                assert found.earlier
                assert found.existing is None
        finally:
            await asyncio.to_thread(journal.close)
            await journal.aclose()
            await counter.close()
        return turns

    assert asyncio.run(run()) == {"plain": [2] * 5, "repeats": [3] * 5, "found": [3] * 5}


@pytest.mark.parametrize("driver", DRIVERS)
def test_postgres_journals_first_used_at_once_make_their_tables_once(
    postgres_proc: Any, driver: str
) -> None:
    """Four journals on one new table, first used at the same moment: every begin is
    recorded. Before, their CREATE TABLEs collided and some failed with UniqueViolation."""
    from agentkey.journal import PostgresJournal

    table = f"first{uuid.uuid4().hex[:10]}"
    journals = [PostgresJournal(postgres_proc.dsn, table=table) for _ in range(4)]
    records = [_record("first", index) for index in range(4)]
    meeting = threading.Barrier(4)

    def first_use(pair: tuple[Any, Any]) -> Any:
        journal, record = pair
        meeting.wait(10)
        if driver == "sync":
            return journal.begin(record, repeats=True)

        async def once() -> Any:
            try:
                return await journal.abegin(record, repeats=True)
            finally:
                await journal.aclose()

        return asyncio.run(once())

    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            begun = list(pool.map(first_use, zip(journals, records, strict=True)))
        assert [b.existing for b in begun] == [None] * 4
        assert len(journals[0].find("first")) == 4
    finally:
        for journal in journals:
            journal.close()
