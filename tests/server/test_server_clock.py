"""The server's own waits run on its injected clock: a held duplicate's polls, a settle's
retries and the example app's simulated work are waits recorded in ``FakeClock.sleeps``,
none waited in real time."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentkey import ConfigurationError
from agentkey.server import (
    FileBlobStore,
    IdempotencyMiddleware,
    MemoryStore,
    PostgresStore,
    RedisStore,
    current_claim,
)
from agentkey.server._claim import SETTLE_BACKOFF
from agentkey.server._stores import SETTLE_SECONDS
from agentkey.testing import FakeClock, example_app
from tests.server._apps import tool_app
from tests.server._util import FailingFinish, built_on, request_for, serve_closing


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


async def test_a_settle_whose_store_stays_down_gives_up_after_its_budget_on_the_clock(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The handler ran and the store never takes its outcome: the answer is delivered, the
    write is retried with backoff on the server's clock until SETTLE_SECONDS (10 s) have
    passed on it, then abandoned with an ERROR naming the key; no real time is waited."""
    clock = FakeClock()
    store = FailingFinish(failures=1_000_000, clock=clock)
    runs = [0]

    async def charge(request: Request) -> Response:
        current_claim().begin_mutation()
        runs[0] += 1
        return JSONResponse({"run": runs[0]}, status_code=201)

    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/charge", charge, methods=["POST"])]),
        store=store,
        shared_key_space=True,
        clock=clock,
    )
    headers, body = request_for({"amount": 3})
    transport = httpx.ASGITransport(app=app)
    with caplog.at_level(logging.WARNING, logger="agentkey.server"):
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            got = await client.post("/charge", headers=headers, content=body)
    assert got.status_code == 201  # delivered after the first failed write
    assert runs == [1]
    assert sum(clock.sleeps) == pytest.approx(SETTLE_SECONDS)
    assert max(clock.sleeps) <= SETTLE_BACKOFF.cap
    assert store.finishes == len(clock.sleeps) + 1  # the inline write, then one per wait
    assert "did not finish within 10.0 s" in caplog.text


@pytest.mark.parametrize(
    "build",
    [
        lambda clock: MemoryStore(clock=clock),
        lambda clock: RedisStore("redis://127.0.0.1:1/0", clock=clock),
        lambda clock: PostgresStore("postgresql://u@127.0.0.1:1/db", clock=clock),
        lambda clock: FileBlobStore(clock=clock),
    ],
    ids=["MemoryStore", "RedisStore", "PostgresStore", "FileBlobStore"],
)
@pytest.mark.parametrize(
    "clock", [time.monotonic, lambda: 1.0, 5], ids=["monotonic", "lambda", "5"]
)
def test_a_store_refuses_a_clock_that_is_not_a_clock(build: Any, clock: Any) -> None:
    """A store given a time function (what MemoryStore and FileBlobStore took before) or
    anything else that is not a Clock says so when it is built, not at its first wait."""
    with pytest.raises(ConfigurationError, match=r"clock must be an agentkey Clock"):
        build(clock)
