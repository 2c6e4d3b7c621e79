"""A store outage after the handler ran: the outcome is still recorded, the step runs once."""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from pathlib import Path

import anyio
import httpx
import psycopg
import pytest
import redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentkey import Clock, StoreUnavailable
from agentkey._clock import SYSTEM
from agentkey._keys import shown_key
from agentkey._schedule import Backoff
from agentkey.server import (
    Claim,
    IdempotencyMiddleware,
    MemoryStore,
    PostgresStore,
    RedisStore,
    ServerOptions,
    current_claim,
)
from agentkey.server._claim import SETTLE_BACKOFF
from agentkey.server._records import Binding, digest, encode_in_progress
from agentkey.server.redis._store import _RELEASE_BACKOFF
from agentkey.testing import FakeClock
from tests._loopback import RedisServer
from tests.server._util import FailingFinish, request_for, serve_closing
from tests.server.test_redis_resilience import ReplyDropper, RestartableRedis

_LOGGER = "agentkey.server"


def _gated_app(store: RedisStore | MemoryStore, *, lock_ttl: float) -> Starlette:
    """One tool, ``/charge``: begins its mutation, counts the run, waits on ``app.state.gate``."""
    gate, entered = threading.Event(), threading.Event()
    runs = [0]

    async def charge(request: Request) -> Response:
        current_claim().begin_mutation()
        runs[0] += 1
        entered.set()
        await anyio.to_thread.run_sync(gate.wait, 30)
        return JSONResponse({"charged": await request.json(), "run": runs[0]}, status_code=201)

    app = Starlette(routes=[Route("/charge", charge, methods=["POST"])])
    app.add_middleware(
        IdempotencyMiddleware,
        store=store,
        options=ServerOptions(lock_ttl=lock_ttl),
        shared_key_space=True,
    )
    app.state.gate, app.state.entered, app.state.runs = gate, entered, runs
    return app


@pytest.mark.realtime
def test_a_redis_restart_after_the_handler_ran_neither_loses_nor_repeats_the_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis (AOF, fsync always) stops while a handler runs and comes back after its lease
    ended: the outcome is still recorded, the retry gets the replay, the step ran once.
    Real time: a real Redis process stops and its records expire on its own clock."""
    server = RestartableRedis(tmp_path, "--appendonly", "yes", "--appendfsync", "always")
    server.start()
    store = RedisStore(server.url, prefix="outage")
    app = _gated_app(store, lock_ttl=1.0)
    headers, body = request_for({"amount": 5})
    first: list[httpx.Response] = []
    try:
        with (
            caplog.at_level(logging.WARNING, logger=_LOGGER),
            serve_closing(app, store) as url,
            httpx.Client(base_url=url, timeout=30) as client,
        ):
            sender = threading.Thread(
                target=lambda: first.append(client.post("/charge", headers=headers, content=body))
            )
            sender.start()
            assert app.state.entered.wait(10)
            server.stop()  # the handler has begun its side effect; its record is on disk
            app.state.gate.set()
            time.sleep(1.5)  # longer than the lease: the record expires across the restart
            server.start()
            sender.join(30)
            deadline = time.monotonic() + 15
            with redis.Redis(port=server.port) as admin:
                while True:  # the middleware writes the outcome once Redis is back
                    values = [admin.get(k) for k in admin.keys("outage:*")]
                    if values and all(v is not None and not v.startswith(b"P:") for v in values):
                        break
                    assert time.monotonic() < deadline, f"the outcome was never recorded: {values}"
                    time.sleep(0.1)
            again = client.post("/charge", headers=headers, content=body)
    finally:
        server.stop()
    assert first[0].status_code == 201
    assert (again.status_code, again.headers.get("idempotent-replayed")) == (201, "true")
    assert again.json() == first[0].json()
    assert app.state.runs == [1]
    assert "could not record the outcome" in caplog.text  # the outage was seen and logged


class _TimedFailingFinish(FailingFinish):
    """FailingFinish that notes the time of each finish call on its clock."""

    def __init__(self, failures: int, clock: Clock) -> None:
        super().__init__(failures, clock=clock)
        self.at: list[float] = []
        self._fake = clock

    async def finish(self, key: str, owner: str, value: bytes, *, ttl_ms: int) -> bool:
        self.at.append(self._fake.monotonic())
        return await super().finish(key, owner, value, ttl_ms=ttl_ms)


def _jittered(backoff: Backoff, attempts: int, cap: float) -> list[float]:
    """What ``backoff`` waits after each of ``attempts`` failures with FakeClock's 0.5 draw."""
    return [min(cap, backoff.delay(n, rng=lambda: 0.5)) for n in range(1, attempts + 1)]


async def test_failed_writes_of_an_outcome_are_retried_on_the_servers_clock() -> None:
    """Three failed finish calls after the handler ran: the settle retries them with backoff on
    the server's injected clock (the waits are in clock.sleeps; none is waited in real time),
    the fourth records the outcome, and a retry after the lease has ended on that clock gets
    the replay (the handler ran once)."""
    clock = FakeClock()
    store = _TimedFailingFinish(3, clock)
    runs = [0]

    async def charge(request: Request) -> Response:
        current_claim().begin_mutation()
        runs[0] += 1
        return JSONResponse({"charged": await request.json(), "run": runs[0]}, status_code=201)

    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/charge", charge, methods=["POST"])]),
        store=store,
        options=ServerOptions(lock_ttl=0.2),
        shared_key_space=True,
        clock=clock,
    )
    headers, body = request_for({"amount": 7})
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        first = await client.post("/charge", headers=headers, content=body)
        # The answer went out after the first failed write; the retries ran behind it.
        assert store.finishes == 4
        assert clock.sleeps == pytest.approx(_jittered(SETTLE_BACKOFF, 3, cap=1.0))
        clock.advance(0.3)  # past the lease: an unrecorded claim would be free now
        again = await client.post("/charge", headers=headers, content=body)
    assert first.status_code == 201
    assert (again.status_code, again.headers.get("idempotent-replayed")) == (201, "true")
    assert again.json() == first.json()
    assert runs == [1]
    assert store.finishes == 4


@pytest.mark.realtime  # real time: renewals are paced on it (the store times the lease)
async def test_a_failed_renewal_is_retried_with_backoff_before_the_lease_lapses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Renewals that fail while the store is away are retried with backoff, not once per
    interval: the lease is extended again before it lapses, and the failure is logged."""
    store = _TimedFailingFinish(3, SYSTEM)  # Claim.renew() rewrites the record with finish
    claim = Claim(
        key=None,
        idempotency_key="ik_outage",
        principal="p",
        record_key="p:ik_outage",
        owner="0" * 32,
        store=store,
        lock_ttl_ms=3000,
        binding=Binding(digest(b"POST /x")),
    )
    assert await store.claim(claim.record_key, claim.in_progress_record(), ttl_ms=3000) is None
    with caplog.at_level(logging.WARNING, logger=_LOGGER):
        assert claim.start_renewing()  # the first renewal is due on the event loop's timer
        for _ in range(3000):  # three failures, then the renewal that lands
            if store.finishes >= 4:
                break
            await asyncio.sleep(0.01)
        await claim.stop_renewing()
    assert store.finishes >= 4
    # Once per interval (1 s) the fourth attempt would come 3 s after the first: the whole
    # lease. With backoff (0.05 s doubling, jittered) it comes within about 0.35 s; the lease
    # is long enough that a loaded machine's scheduling delays cannot make it lapse.
    assert store.at[3] - store.at[0] < 1.0
    assert await store.get(claim.record_key) is not None
    shown = shown_key("ik_outage")
    assert f"renewing the lease on {shown} failed" in caplog.text
    assert f"renewed the lease on {shown} after 3 failed attempts" in caplog.text
    assert "lapsed" not in caplog.text


async def test_a_redis_outage_message_says_whether_the_handler_ran(tmp_path: Path) -> None:
    """StoreUnavailable says "refused, not run" only for a claim; for a renew or a finish it
    says the handler ran (or runs) and what happens to its outcome."""
    server = RestartableRedis(tmp_path, "--appendonly", "no")
    server.start()
    store = RedisStore(server.url, prefix="wording")
    server.stop()
    try:
        with pytest.raises(StoreUnavailable) as claimed:
            await store.claim("p:k", b"P:x:1", ttl_ms=1000)
        with pytest.raises(StoreUnavailable) as renewed:
            await store.renew("p:k", "x", ttl_ms=1000)
        with pytest.raises(StoreUnavailable) as finished:
            await store.finish("p:k", "x", b"C:{}", ttl_ms=1000)
    finally:
        await store.aclose()
    assert "the request was refused, not run" in str(claimed.value)
    for exc in (renewed.value, finished.value):
        assert "refused" not in str(exc)
    assert "the handler is running and its lease was not extended" in str(renewed.value)
    assert "the handler already ran and its outcome may not be recorded" in str(finished.value)
    assert "retries the write" in str(finished.value)


def test_a_postgres_outage_message_says_whether_the_handler_ran() -> None:
    """PostgresStore words an unreachable database by operation, as RedisStore does."""
    store = PostgresStore("postgresql://127.0.0.1:1/none")
    down = psycopg.OperationalError("connection refused")
    claim, finish = store._map("claim", "p:k", down), store._map("finish", "p:k", down)
    assert isinstance(claim, StoreUnavailable)
    assert isinstance(finish, StoreUnavailable)
    assert "the request was refused, not run" in str(claim)
    assert "the handler already ran" in str(finish)
    assert "refused" not in str(finish)


async def _lost_claim(store: RedisStore, proxy: ReplyDropper, key: str, lost_releases: int) -> None:
    """Claim ``key`` through ``proxy`` so that the SET lands, its answer and its re-send are
    lost, and the next ``lost_releases`` release sends (each with redis-py's one re-send)
    are cut before Redis sees them."""
    owner = secrets.token_hex(16)
    assert await store.claim("warm", encode_in_progress(owner, 1), ttl_ms=60_000) is None
    assert await store.release("warm", owner)  # loads the release script
    sha = store._release.sha.encode()
    proxy.arm(b"\r\nSET\r\n")
    proxy.swallow(b"\r\nSET\r\n", *[sha] * (2 * lost_releases))
    with pytest.raises(StoreUnavailable, match="could not be reached during claim"):
        await store.claim(key, encode_in_progress(owner, 1), ttl_ms=1000)


async def test_a_lost_claims_release_is_retried_with_backoff_on_the_stores_clock(
    redis_proc: RedisServer,
) -> None:
    """A claim that landed but whose answer was lost, and whose inline release and first
    background retry were lost too, is released by the second retry: the background
    retries wait on the store's injected clock (their waits are in clock.sleeps)."""
    clock = FakeClock()
    proxy = ReplyDropper(redis_proc.port)
    prefix = "rel-" + secrets.token_hex(4)
    store = RedisStore(proxy.url, prefix=prefix, clock=clock)
    try:
        await _lost_claim(store, proxy, "k", lost_releases=2)
        with redis.Redis(port=redis_proc.port) as probe:
            for _ in range(400):  # the release runs in the background, on real sockets
                if not probe.exists(f"{prefix}:{{k}}"):
                    break
                await asyncio.sleep(0.025)
            assert not probe.exists(f"{prefix}:{{k}}")
    finally:
        proxy.close()
        await store.aclose()
    assert clock.sleeps == pytest.approx(_jittered(_RELEASE_BACKOFF, 2, cap=1.0))


async def test_the_background_release_gives_up_when_the_lease_ends_on_the_stores_clock(
    redis_proc: RedisServer,
) -> None:
    """While Redis keeps losing the release, the background retries stop once the claim's
    lease (1 s) has passed on the store's clock: the key then expires by itself, and the
    retries are a bounded series of waits in clock.sleeps, not a loop that outlives it."""
    clock = FakeClock()
    proxy = ReplyDropper(redis_proc.port)
    prefix = "rel-" + secrets.token_hex(4)
    store = RedisStore(proxy.url, prefix=prefix, clock=clock)
    try:
        await _lost_claim(store, proxy, "k", lost_releases=50)
        for _ in range(400):
            if not store._releasing:  # the background task ended
                break
            await asyncio.sleep(0.025)
        assert not store._releasing
    finally:
        proxy.close()
        await store.aclose()
    waits = _jittered(_RELEASE_BACKOFF, len(clock.sleeps), cap=1.0)
    assert clock.sleeps == pytest.approx(waits)
    assert sum(waits[:-1]) < 1.0 <= sum(waits)  # it stopped at the first wait past the lease
