"""The one client engine: its retry loop, and one clock per deadline from the flow to the socket.

``_flow.attempts`` is the loop every front end runs on (the step, its polls, the
token endpoint), each with a classifier of its own. The flow measures its
deadline on its injected clock; the driver hands that clock to ``_http`` with
the request, so the time left is read on one clock. The clock tests drive a
real tool server on loopback and count its executions.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Generator, Iterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from agentkey import AsyncToolInvoker, OutcomeUnknown, RetryPolicy, ToolInvoker, ToolResult
from agentkey.client._drive import run_async, run_sync
from agentkey.client._effects import Answer, Effect, Emit, Outgoing, Received, Sleep
from agentkey.client._flow import Again, Exchange, attempts
from agentkey.testing import FakeClock
from tests._loopback import serve

from ._support import DRIVERS, FAST_POLL, FAST_RETRY, Driver, make_step
from ._toolapp import ToolApp


@pytest.fixture
def tool() -> Iterator[tuple[ToolApp, str]]:
    """The scripted tool app served on loopback."""
    app = ToolApp()
    with serve(app) as url:
        yield app, url


class Scripted(Exchange[int]):
    """An exchange whose classifier reads a script: each reply's verdict, in order."""

    def __init__(self, verdicts: list[int | Again | Exception]) -> None:
        self.verdicts = verdicts
        self.sent = 0

    def request(self) -> Generator[Effect, Any, Outgoing]:
        self.sent += 1
        yield Emit(("request", self.sent))
        return Outgoing("GET", f"https://tool.test/{self.sent}", (), None, True)

    def judge(self, reply: Received) -> Generator[Effect, Any, int | Again]:
        verdict = self.verdicts.pop(0)
        if isinstance(verdict, Exception):
            raise verdict
        yield from ()
        return verdict


def _carried(exchange: Scripted, driver: Driver) -> tuple[list[object], int | Exception]:
    """Run ``attempts(exchange)`` on the sync or the async driver: the effects, and the end."""
    seen: list[object] = []

    def carry(effect: object) -> object:
        seen.append(effect)
        return Answer(200, {}, b"", "https://tool.test/") if isinstance(effect, Outgoing) else None

    async def acarry(effect: object) -> object:
        return carry(effect)

    try:
        if driver == "sync":
            return seen, run_sync(attempts(exchange), carry)
        return seen, asyncio.run(run_async(attempts(exchange), acarry))
    except ValueError as exc:
        return seen, exc


@pytest.mark.parametrize("driver", DRIVERS)
def test_the_engine_sends_waits_and_returns_what_the_classifier_says(driver: Driver) -> None:
    """Again(wait, event): the event, then the sleep, then a new request; a result ends it."""
    exchange = Scripted([Again(0.5, "retrying"), Again(), 7])
    seen, result = _carried(exchange, driver)
    assert result == 7
    kinds = [type(e).__name__ for e in seen]
    assert kinds == ["Emit", "Outgoing", "Emit", "Sleep", "Emit", "Outgoing", "Emit", "Outgoing"]
    assert [e.event for e in seen if isinstance(e, Emit)][1] == "retrying"
    assert [e.seconds for e in seen if isinstance(e, Sleep)] == [0.5]  # Again(): at once


@pytest.mark.parametrize("driver", DRIVERS)
def test_the_classifiers_error_ends_the_engine(driver: Driver) -> None:
    """A classifier that raises (a final answer, a spent budget) ends the loop with its error."""
    seen, result = _carried(Scripted([Again(0.1), ValueError("spent")]), driver)
    assert isinstance(result, ValueError)
    assert sum(isinstance(e, Outgoing) for e in seen) == 2


def _call(driver: Driver, url: str, clock: FakeClock, **options: Any) -> ToolResult:
    """One call by an invoker whose flows run on ``clock`` (its ``clock=``)."""
    options.setdefault("retry", FAST_RETRY)
    step = make_step(tool="create_db")
    common: dict[str, Any] = {"polling": FAST_POLL, "route_template": "/tools/{tool}"}
    if driver == "sync":
        with ToolInvoker(url, **common, **options, clock=clock) as invoker:
            return invoker.invoke(step)

    async def main() -> ToolResult:
        async with AsyncToolInvoker(url, **common, **options, clock=clock) as invoker:
            return await invoker.invoke(step)

    return asyncio.run(main())


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("offset", [-1e7, 1e7], ids=["behind", "ahead"])
def test_the_request_gets_the_time_left_on_the_flows_clock(
    driver: Driver, offset: float, tool: tuple[ToolApp, str]
) -> None:
    """A flow on a clock far from time.monotonic() sends with its own time left; the tool runs."""
    app, url = tool
    result = _call(driver, url, FakeClock(start=time.monotonic() + offset))
    assert (result.status_code, result.attempts) == (200, 1)
    assert sum(app.executions.values()) == 1


def _dripping_tool(runs: list[str]) -> Starlette:
    """A tool that runs, then drips its answer one byte per 100 ms for 30 s."""

    async def tool(request: Request) -> StreamingResponse:
        runs.append(request.headers["idempotency-key"])

        async def body() -> AsyncIterator[bytes]:
            yield b'{"id": "'
            for _ in range(300):
                await asyncio.sleep(0.1)
                yield b"a"
            yield b'"}'

        return StreamingResponse(body(), media_type="application/json")

    return Starlette(routes=[Route("/tools/{name}", tool, methods=["POST"])])


@pytest.mark.realtime
@pytest.mark.parametrize("driver", DRIVERS)
def test_a_fake_clocks_deadline_still_cuts_a_dripping_answer(driver: Driver) -> None:
    """On a fake clock that does not move, the 0.5 s left still cut a 30 s answer at the
    socket: one execution, in doubt (read to its end, it would have been a 200)."""
    runs: list[str] = []
    retry = RetryPolicy(max_attempts=1, deadline=0.5)
    with serve(_dripping_tool(runs)) as url, pytest.raises(OutcomeUnknown, match="deadline"):
        _call(driver, url, FakeClock(start=-5e6), retry=retry, honours_keys=False)
    assert len(runs) == 1
