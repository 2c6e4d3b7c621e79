"""The server's own waits run on its injected clock: a held duplicate's polls and the example
app's simulated work are waits recorded in ``FakeClock.sleeps``, none waited in real time."""

from __future__ import annotations

import concurrent.futures
import threading

import httpx
import pytest

from agentkey.server import MemoryStore
from agentkey.testing import FakeClock, example_app
from tests.server._apps import tool_app
from tests.server._util import built_on, request_for, serve_closing


def test_a_held_duplicate_polls_on_the_servers_clock_and_gets_its_409_when_the_hold_ends() -> None:
    """hold_in_flight=0.6 on a FakeClock: the duplicate asks the store after 0.1 s, 0.2 s and
    0.3 s of the server's clock (its waits, in clock.sleeps), then gets its late 409 while
    the first request still runs; the first then finishes and the step ran once."""
    clock = FakeClock()
    headers, body = request_for({"gate": "held"})
    with built_on(clock):  # the middleware is built at the first request, in the server
        store = MemoryStore()
        app = tool_app(store, hold_in_flight=0.6)
        with (
            serve_closing(app, store) as url,
            httpx.Client(base_url=url, timeout=30) as client,
            concurrent.futures.ThreadPoolExecutor(1) as pool,
        ):
            first = pool.submit(client.post, "/wait", headers=headers, content=body)
            entered = app.state.entered.setdefault("held", threading.Event())
            assert entered.wait(10), "the handler never started"
            dup = client.post("/wait", headers=headers, content=body)
            assert not first.done()  # the first request still runs
            app.state.gates.setdefault("held", threading.Event()).set()
            assert first.result(timeout=10).status_code == 200
    assert dup.status_code == 409
    assert clock.sleeps == pytest.approx([0.1, 0.2, 0.3])
    assert app.state.runs["wait"] == 1


async def test_the_example_apps_work_sleeps_on_its_clock() -> None:
    """example_app(clock=FakeClock): provision's simulated work is a wait on that clock."""
    clock = FakeClock()
    app = example_app(clock=clock, work_seconds=5.0)
    headers, body = request_for({"region": "eu"})
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        got = await client.post("/tools/provision", headers=headers, content=body)
    assert got.status_code == 200, got.text
    assert clock.sleeps == [5.0]
    assert app.state.executions["provision"] == 1
