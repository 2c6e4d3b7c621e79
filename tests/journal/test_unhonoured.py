"""Tools that do not honour Idempotency-Key: no duplicate by agentkey's own resend (issue 25).

A real tool on loopback that runs every request it gets, and the same tool behind
agentkey's middleware. The side effects are counted on the server. Every case runs
on both invokers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agentkey import (
    AsyncToolInvoker,
    ConfigurationError,
    JournalError,
    KeyReused,
    OutcomeUnknown,
    PlanSession,
    RetryPolicy,
    Step,
    ToolInvoker,
    ToolResult,
    ToolUnreachable,
)
from agentkey.journal import CallState, HttpLookup, InDoubt, SQLiteJournal, Verdict
from agentkey.journal._base import Begun, is_live
from agentkey.server import IdempotencyMiddleware, MemoryStore
from agentkey.testing import FakeClock
from tests._loopback import serve
from tests.journal._tools import FaultOnce, PassThrough, PlainTool

DRIVERS = ("sync", "async")
RETRY = RetryPolicy(max_attempts=10, initial_backoff=0.01, max_backoff=0.05, deadline=20.0)
#: Each attempt waits at most this long for an answer (the tool's slow mode takes longer).
READ_TIMEOUT = 0.3


@dataclass
class Tool:
    plain: PlainTool
    url: str
    protected: bool
    faults: FaultOnce


@pytest.fixture(params=["plain", "middleware"])
def tool(request: pytest.FixtureRequest) -> Iterator[Tool]:
    """The plain tool, alone or behind IdempotencyMiddleware, behind a faulty way back."""
    plain = PlainTool()
    app: Any = plain
    if request.param == "middleware":
        app = IdempotencyMiddleware(
            plain, store=MemoryStore(), routes=["/tools/*"], shared_key_space=True
        )
    faults = FaultOnce(app, {})
    with serve(faults) as url:
        yield Tool(plain, url, request.param == "middleware", faults)


def invoke(driver: str, url: str, step: Step, **options: Any) -> ToolResult:
    options.setdefault("retry", RETRY)
    options.setdefault("timeout", READ_TIMEOUT)
    options.setdefault("route_template", "/tools/{tool}")
    ahead = options.pop("wall_ahead", 0.0)  # the invoker's wall clock, this much later
    if ahead:
        options["clock"] = FakeClock(start=time.monotonic(), wall=time.time() + ahead)
    if driver == "sync":
        with ToolInvoker(url, **options) as invoker:
            result: ToolResult = invoker.invoke(step)
            return result

    async def run() -> ToolResult:
        async with AsyncToolInvoker(url, **options) as invoker:
            result: ToolResult = await invoker.invoke(step)
            return result

    return asyncio.run(run())


def step_for(tool: str) -> Step:
    return PlanSession.new().step(0, tool, {"amount": 1999, "currency": "EUR"})


FAULTS = ["drop", "slow", "502"]


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("fault", FAULTS)
def test_a_call_that_may_have_run_runs_once(tool: Tool, fault: str, driver: str) -> None:
    """A lost answer, a timeout or a 502 after the side effect: one execution, the truth told.

    Plain tool: OutcomeUnknown, the call in doubt in the journal, never resent
    (the same call ran 10 times before, once per attempt). Behind the middleware:
    resent with the same key and replayed.
    """
    tool.faults.faults["charge"] = fault
    step = step_for("charge")
    journal = SQLiteJournal(os.environ["AGENTKEY_JOURNAL"])
    if tool.protected:
        result = invoke(driver, tool.url, step, journal=journal)
        assert result.replayed
        assert result.status_code == 201
        assert journal.get(step.idempotency_key).state is CallState.ANSWERED  # type: ignore[union-attr]
    else:
        with pytest.raises(OutcomeUnknown) as caught:
            invoke(driver, tool.url, step, journal=journal)
        message = str(caught.value)
        assert "did not send it again" in message
        assert "at most once" not in message
        assert step.idempotency_key not in message  # the key shows as a digest
        assert journal.get(step.idempotency_key).state is CallState.IN_DOUBT  # type: ignore[union-attr]
    assert tool.plain.executions["charge"] == 1


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("fault", FAULTS)
def test_a_reconcile_hook_settles_what_may_have_run(tool: Tool, fault: str, driver: str) -> None:
    """With reconcile=HttpLookup the plain tool's call in doubt is looked up: its answer, once."""
    tool.faults.faults["charge"] = fault
    step = step_for("charge")
    result = invoke(driver, tool.url, step, reconcile=HttpLookup("/lookup/{key}"))
    assert tool.plain.executions["charge"] == 1
    assert result.replayed
    assert result.body["run"] == 1
    assert result.source == ("tool" if tool.protected else "reconcile")


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_reconcile_hook_that_says_not_run_lets_the_call_go(driver: str) -> None:
    """A 502 before the tool ran, and a hook that finds nothing: believed once the request
    can no longer arrive (60 s on the invoker's injected wall clock), then sent: run once."""
    plain = PlainTool()
    plain.modes["charge"] = "502-before"
    asked: list[InDoubt] = []

    def not_there(call: InDoubt) -> Verdict:
        asked.append(call)
        plain.modes["charge"] = "ok"  # the tool recovers
        return Verdict.not_run()

    step = step_for("charge")
    journal = SQLiteJournal(os.environ["AGENTKEY_JOURNAL"])
    with serve(plain) as url:
        with pytest.raises(OutcomeUnknown, match="could still arrive"):
            invoke(driver, url, step, reconcile=not_there, journal=journal)
        assert plain.executions["charge"] == 0
        result = invoke(driver, url, step, reconcile=not_there, journal=journal, wall_ahead=61.0)
    assert plain.executions["charge"] == 1
    assert not result.replayed
    assert {c.tool for c in asked} == {"charge"}
    assert asked[0].args == {"amount": 1999, "currency": "EUR"}


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_key_the_journal_saw_on_another_route_is_refused_there(driver: str) -> None:
    """Sent to tool A, the same step sent to tool B is refused, never answered from A.

    A step never sent (A refused the connection) may go to B instead: it ran nowhere.
    """
    first, second = PlainTool(), PlainTool()
    step = step_for("charge")
    with serve(first) as url_a, serve(second) as url_b:
        assert invoke(driver, url_a, step).status_code == 201
        with pytest.raises(KeyReused, match="another route") as caught:
            invoke(driver, url_b, step)
        assert step.idempotency_key not in str(caught.value)
        unsent = step_for("charge")
        with pytest.raises(ToolUnreachable):
            invoke(driver, "http://127.0.0.1:9", unsent)  # discard: nothing listens there
        assert invoke(driver, url_b, unsent).status_code == 201
    assert (first.executions["charge"], second.executions["charge"]) == (1, 1)


_AGENT = textwrap.dedent(
    """
    import sys
    from agentkey import PlanSession, ToolInvoker
    url, plan = sys.argv[1], sys.argv[2]
    step = PlanSession(id=plan).step(0, "charge", {"amount": 1999, "currency": "EUR"})
    with ToolInvoker(url, route_template="/tools/{tool}", timeout=30) as invoker:
        invoker.invoke(step)
    """
)


def _killed_agent(url: str, plan: str, plain: PlainTool, journal: Path) -> None:
    """Run an agent process that sends the step; SIGKILL it once the tool ran the side effect."""
    env = {**os.environ, "AGENTKEY_JOURNAL": str(journal), "PYTHONPATH": os.getcwd()}
    child = subprocess.Popen([sys.executable, "-c", _AGENT, url, plan], env=env)
    try:
        assert plain.ran.wait(30), "the agent's request never reached the tool"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    plain.release.set()  # the tool answers a connection nobody reads any more


@pytest.mark.realtime
@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("settle", ["nothing", "reconcile"])
def test_a_killed_agent_leaves_its_call_in_doubt_and_the_restart_settles_it(
    tool: Tool, driver: str, settle: str, tmp_path: Path
) -> None:
    """SIGKILL between "sent" and "answered": the restarted agent never runs the step twice.

    Behind the middleware it resends the same key and gets the replay; on the plain
    tool it raises OutcomeUnknown (nothing told it more), or settles the call with
    its reconcile= hook.
    """
    tool.plain.modes["charge"] = "hold"
    plan = PlanSession.new().id
    path = tmp_path / "journal.sqlite3"
    _killed_agent(tool.url, plan, tool.plain, path)
    journal = SQLiteJournal(path)
    step = PlanSession(id=plan).step(0, "charge", {"amount": 1999, "currency": "EUR"})
    record = journal.get(step.idempotency_key)
    assert record is not None
    assert record.state is CallState.PENDING  # its sender died before writing more
    options: dict[str, Any] = {"journal": journal}
    if settle == "reconcile":
        options["reconcile"] = HttpLookup("/lookup/{key}")
    if tool.protected or settle == "reconcile":
        result = invoke(driver, tool.url, step, **options)
        assert result.replayed
        assert result.body["run"] == 1
    else:
        with pytest.raises(OutcomeUnknown, match="never recorded an answer"):
            invoke(driver, tool.url, step, **options)
        assert journal.get(step.idempotency_key).state is CallState.PENDING  # type: ignore[union-attr]
    assert tool.plain.executions["charge"] == 1


class ReadJustBeforeTheSenderEnds(PassThrough):
    """A real journal, with one interleaving forced: a second caller of a key reads its
    pending record while the first is still sending, and judges that record only after
    the first caller's invoke returned (an asyncio task resumed late, a thread descheduled).
    """

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.read = threading.Event()  # the second caller has read the pending record
        self.sender_done = threading.Event()  # the first caller's invoke returned

    def _late(self, begun: Begun) -> Begun:
        earlier = begun.existing
        if earlier is None or earlier.state is not CallState.PENDING or self.read.is_set():
            return begun
        self.read.set()
        assert self.sender_done.wait(10)
        return Begun(earlier, begun.evidence, is_live(earlier, time.time()))

    def begin(self, record: Any, **options: Any) -> Begun:
        return self._late(self.inner.begin(record, **options))

    def finish(self, record: Any) -> bool:
        assert self.read.wait(10)
        return bool(self.inner.finish(record))

    async def abegin(self, record: Any, **options: Any) -> Begun:
        return await asyncio.to_thread(self._late, await self.inner.abegin(record, **options))

    async def afinish(self, record: Any) -> bool:
        assert await asyncio.to_thread(self.read.wait, 10)
        return bool(await self.inner.afinish(record))


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_pending_record_read_just_before_its_sender_ends_is_read_again(
    journal_factory: Any, driver: str
) -> None:
    """Two callers of one step on a tool that does not honour keys: the second reads the
    first's pending record, and the first finishes before the second judges it. The second
    reads the record again and gets the recorded answer; it is not OutcomeUnknown (the
    bench hit this 1 run in 3 with RedisJournal) and the tool runs once."""
    plain = PlainTool()
    journal = ReadJustBeforeTheSenderEnds(journal_factory())
    step = step_for("charge")
    options: dict[str, Any] = {"retry": RETRY, "route_template": "/tools/{tool}"}
    with serve(plain) as url:
        if driver == "sync":
            with (
                ToolInvoker(url, journal=journal, **options) as first,
                ToolInvoker(url, journal=journal, **options) as second,
                concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool,
            ):

                def send_first() -> ToolResult:
                    try:
                        return first.invoke(step)
                    finally:
                        journal.sender_done.set()

                sent = pool.submit(send_first)
                assert plain.ran.wait(10)
                again = second.invoke(step)
                result = sent.result(timeout=10)
        else:

            async def both() -> tuple[ToolResult, ToolResult]:
                async with (
                    AsyncToolInvoker(url, journal=journal, **options) as first,
                    AsyncToolInvoker(url, journal=journal, **options) as second,
                ):

                    async def send_first() -> ToolResult:
                        try:
                            return await first.invoke(step)
                        finally:
                            journal.sender_done.set()

                    sent = asyncio.create_task(send_first())
                    assert await asyncio.to_thread(plain.ran.wait, 10)
                    again = await second.invoke(step)
                    sent_result = await sent
                await journal.aclose()  # its asyncio client belongs to this loop
                return sent_result, again

            result, again = asyncio.run(both())
    assert journal.read.is_set()
    assert plain.executions["charge"] == 1
    assert not result.replayed
    assert again.replayed
    assert again.body == result.body


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_journal_that_fails_mid_call_is_a_typed_error_that_says_what_ran(driver: str) -> None:
    """Redis, holding the journal, dies while the tool runs: the call ends with a
    JournalError (sent=True) that says the tool answered and the answer was not recorded
    (not a redis-py ConnectionError, nor a ConfigurationError); the next call of the step is
    refused loudly (sent=False), never sent blindly. A journal that cannot start a call
    sends nothing."""
    from agentkey.journal import RedisJournal
    from tests._loopback import redis_server

    plain = PlainTool()
    plain.modes["charge"] = "hold"
    step = step_for("charge")
    with redis_server() as server, serve(plain) as url:

        def stop_redis_once_the_tool_ran() -> None:
            assert plain.ran.wait(10)
            server.process.terminate()
            server.process.wait(10)
            plain.release.set()

        stopper = threading.Thread(target=stop_redis_once_the_tool_ran)
        stopper.start()
        with pytest.raises(JournalError) as caught:
            invoke(driver, url, step, journal=RedisJournal(server.url), timeout=5.0)
        stopper.join(10)
        message = str(caught.value)
        assert "failed during finish of step_000" in message
        assert "the tool answered, but the answer was not recorded" in message
        assert step.idempotency_key not in message  # the key shows as a digest
        assert caught.value.sent is True
        assert caught.value.idempotency_key == step.idempotency_key
        assert not isinstance(caught.value, ConfigurationError)
        with pytest.raises(JournalError) as again:
            invoke(driver, url, step, journal=RedisJournal(server.url), timeout=5.0)
        assert "the call was not sent" in str(again.value)
        assert again.value.sent is False
    assert plain.executions["charge"] == 1
