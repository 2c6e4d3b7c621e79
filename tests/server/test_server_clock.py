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
    ServerOptions,
    current_claim,
)
from agentkey.server._claim import SETTLE_BACKOFF
from agentkey.server._stores import SETTLE_SECONDS
from agentkey.testing import FakeClock, example_app, set_testing
from tests.server._apps import tool_app
from tests.server._util import FailingFinish, request_for, serve_closing


def test_a_held_duplicate_polls_on_the_servers_clock_and_gets_its_409_when_the_hold_ends() -> None:
    """hold_in_flight=0.6 on a FakeClock: the duplicate asks the store after 0.1 s, 0.2 s and
    0.3 s of the server's clock (its waits, in clock.sleeps), then gets its late 409 while
    the first request still runs; the first then finishes and the step ran once."""
    clock = FakeClock()
    headers, body = request_for({"gate": "held"})
    store = MemoryStore(clock=clock)
    app = tool_app(store, hold_in_flight=0.6, clock=clock)
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


class _CountingFinish(MemoryStore):
    """MemoryStore counting finish calls (each renewal rewrites the record with finish)."""

    finishes = 0

    async def finish(self, key: str, owner: str, value: bytes, *, ttl_ms: int) -> bool:
        self.finishes += 1
        return await super().finish(key, owner, value, ttl_ms=ttl_ms)


def _two_tools(store: MemoryStore, clock: FakeClock | None) -> tuple[Any, dict[str, int]]:
    """/tools/a answers at once; /tools/b waits 0.5 s of real I/O, past a third of the lease."""
    import anyio

    runs = {"a": 0, "b": 0}

    async def tool(request: Request) -> Response:
        name = request.path_params["name"]
        runs[name] += 1
        if name == "b":
            await anyio.sleep(0.5)  # a payment API taking half a second
        return JSONResponse({"run": runs[name]})

    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/tools/{name}", tool, methods=["POST"])]),
        store=store,
        options=ServerOptions(lock_ttl=0.3, result_ttl=100.0),
        shared_key_space=True,
        clock=clock,
    )
    return app, runs


@pytest.mark.parametrize("given", ["set_testing", "FakeClock"])
async def test_a_long_handler_renews_on_real_time_and_ages_no_other_record(given: str) -> None:
    """A handler running past a third of its lease on a clock that moves when slept on
    (set_testing's, or a FakeClock given as clock=) renews at most every interval of real
    time: the clock is not pushed on, and another key's stored result still replays (on the
    old code the renewal loop spun, pushed the clock ~270 s on, and that step ran twice)."""
    clock = FakeClock() if given == "FakeClock" else None
    with set_testing(given == "set_testing"):
        store = _CountingFinish(clock=clock)
        app, runs = _two_tools(store, clock)
    a = {"Idempotency-Key": "11111111-1111-4111-8111-111111111111"}
    b = {"Idempotency-Key": "22222222-2222-4222-8222-222222222222"}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t"
    ) as client:
        assert (await client.post("/tools/a", json={}, headers=a)).status_code == 200
        assert (await client.post("/tools/b", json={}, headers=b)).status_code == 200
        again = await client.post("/tools/a", json={}, headers=a)
    assert again.headers.get("idempotent-replayed") == "true"
    assert runs == {"a": 1, "b": 1}
    assert store.finishes < 20  # two seals and a few renewals; the spin made thousands
    if clock is not None:
        assert clock.sleeps == []
