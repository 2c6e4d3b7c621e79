"""Leases: renewed by default, honest about loss, cleared within one lease when a server dies."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentkey import LeaseLost
from agentkey._keys import shown_key
from agentkey.server import (
    Claim,
    IdempotencyMiddleware,
    MemoryStore,
    RedisStore,
    ServerOptions,
    current_claim,
)
from agentkey.server._decide import in_progress_retry_after
from agentkey.server._records import Binding, InProgress, decode_record, digest, encode_in_progress
from agentkey.testing import FakeClock
from tests._loopback import RedisServer, free_port, serve
from tests.server._util import request_for

ROOT = Path(__file__).resolve().parents[2]
_BINDING = Binding(digest(b"POST /x"))


@pytest.mark.parametrize(
    ("record", "now", "expected"),
    [
        # A live holder (renewed 1 s ago, every 5 s): the configured Retry-After.
        (InProgress("0" * 32, 0, 15_000, 5_000, _BINDING), 1_000, (1, 14)),
        # It let 1.5 renewals pass: its server may have died; come back when the lease ends.
        (InProgress("0" * 32, 0, 15_000, 5_000, _BINDING), 8_000, (7, 7)),
        (InProgress("0" * 32, 0, 15_000, 5_000, _BINDING), 14_500, (1, 1)),
        # No automatic renewal: the configured value, capped by the lease left.
        (InProgress("0" * 32, 0, 500, 0, _BINDING), 100, (1, 1)),
        # A record from before leases were written: nothing known.
        (InProgress("0" * 32, 0), 10_000, (1, None)),
    ],
)
def test_retry_after_reflects_the_lease_that_remains(
    record: InProgress, now: int, expected: tuple[int, int | None]
) -> None:
    """The 409's Retry-After is the lease's end once its holder stopped renewing (pure)."""
    assert in_progress_retry_after(record, now, retry_after=1) == expected


def _claim(store: MemoryStore, *, lease_ms: int, auto_renew: bool = False) -> Claim:
    key = "k-" + uuid.uuid4().hex
    return Claim(
        key=None,
        idempotency_key=key,
        principal="p",
        record_key=key,
        owner=uuid.uuid4().hex,
        store=store,
        lock_ttl_ms=lease_ms,
        auto_renew=auto_renew,
        binding=_BINDING,
    )


async def test_an_expired_lease_nobody_took_is_not_lost() -> None:
    """renew() after the lease lapsed with no competitor takes the key back: lost stays False."""
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    claim = _claim(store, lease_ms=50)
    assert await store.claim(claim.record_key, claim.in_progress_record(), ttl_ms=50) is None
    clock.advance(0.12)  # the lease lapses; nobody else asks for the key
    assert await store.get(claim.record_key) is None
    assert await claim.renew() is True
    assert not claim.lost
    claim.begin_mutation()  # the docs' recipe: renew(), then begin_mutation()
    assert await store.get(claim.record_key) is not None


async def test_lost_means_another_request_took_the_key() -> None:
    """Only a record of another request makes renew() False, lost True, begin_mutation() raise."""
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    mine, theirs = _claim(store, lease_ms=50), _claim(store, lease_ms=5000)
    theirs.record_key = mine.record_key
    assert await store.claim(mine.record_key, mine.in_progress_record(), ttl_ms=50) is None
    clock.advance(0.12)
    assert await store.claim(mine.record_key, theirs.in_progress_record(), ttl_ms=5000) is None
    assert await mine.renew() is False
    assert mine.lost
    with pytest.raises(LeaseLost, match="another request took the key"):
        mine.begin_mutation()


def test_docs_recipe_completes_work_longer_than_the_lease() -> None:
    """auto_renew=False, work past the lease on the server's clock, renew() + begin_mutation():
    runs once, replays (the work is a wait on a FakeClock: no real time passes)."""
    runs: list[int] = []
    clock = FakeClock()

    async def provision(request: Request) -> JSONResponse:
        claim = current_claim()
        await clock.asleep(0.4)  # four leases of unrenewed work, no competitor
        await claim.renew()
        claim.begin_mutation()
        runs.append(1)
        return JSONResponse({"vm": len(runs)})

    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/x", provision, methods=["POST"])]),
        store=MemoryStore(clock=clock),
        options=ServerOptions(lock_ttl=0.1, auto_renew=False),
        shared_key_space=True,
        clock=clock,
    )
    headers, body = request_for({"region": "eu"})
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        first = client.post("/x", headers=headers, content=body)
        again = client.post("/x", headers=headers, content=body)
    assert (first.status_code, again.headers["idempotent-replayed"]) == (200, "true")
    assert runs == [1]
    assert clock.sleeps == [0.4]


class _StubbornStore(MemoryStore):
    """A store whose lease writes swallow one cancellation, as redis-py's send through
    ``asyncio.wait_for`` can on CPython <= 3.11, then take a while to return."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    async def finish(self, key: str, owner: str, value: bytes, *, ttl_ms: int) -> bool:
        self.writes += 1
        try:
            await asyncio.sleep(0.2)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)  # the cancellation is lost
        return await super().finish(key, owner, value, ttl_ms=ttl_ms)


@pytest.mark.realtime
async def test_leaving_keep_alive_never_hangs_on_a_swallowed_cancellation() -> None:
    """keep_alive stops its loop with an event and a bounded wait: no endless renewals.

    Real time: the first renewal is due on the event loop's timer, and the swallowed
    cancellation needs a store write really in flight when the block ends."""
    store = _StubbornStore()
    claim = _claim(store, lease_ms=150)
    await store.claim(claim.record_key, claim.in_progress_record(), ttl_ms=150)
    async with claim.keep_alive():
        await asyncio.sleep(0.08)  # a renewal is now in flight in the stubborn store
    await asyncio.sleep(0.5)
    writes = store.writes
    await asyncio.sleep(0.5)
    assert store.writes == writes  # the loop is gone: it stopped renewing


@pytest.mark.realtime
async def test_a_cancelled_handler_stays_cancelled() -> None:
    """A cancellation aimed at the handler while keep_alive stops its loop propagates.

    Real time: the cancellation must land while a renewal is really in flight."""
    store = _StubbornStore()
    claim = _claim(store, lease_ms=3000)
    claim._renew_ms = 50  # renew soon, so a renewal is in flight when the block ends
    await store.claim(claim.record_key, claim.in_progress_record(), ttl_ms=3000)
    after: list[str] = []

    async def handler() -> None:
        async with claim.keep_alive():
            await asyncio.sleep(0.08)
        after.append("ran on after a cancellation")

    task = asyncio.ensure_future(handler())
    await asyncio.sleep(0.12)  # the handler is waiting for the renewal in flight
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert after == []


@pytest.mark.realtime
async def test_keep_alive_exits_against_a_real_redis(redis_proc: RedisServer) -> None:
    """Leaving keep_alive just as a renewal is sent to a real Redis never hangs (real time:
    the exits sweep across a real send on the event loop's timer).

    The old loop (cancel, then await with no bound, under suppress(CancelledError))
    hung about half of these exits on CPython 3.10 and 3.11: redis-py's send goes
    through asyncio.wait_for, which there swallows a cancellation that lands as the
    send completes, and the loop renewed forever.
    """
    store = RedisStore(redis_proc.url, prefix="ka-" + uuid.uuid4().hex[:8])
    hung = 0
    try:
        for i in range(100):
            claim = Claim(
                key=None,
                idempotency_key=f"k{i}",
                principal="p",
                record_key=f"k{i}",
                owner=uuid.uuid4().hex,
                store=store,
                lock_ttl_ms=30,
                auto_renew=False,
            )
            await store.claim(claim.record_key, claim.in_progress_record(), ttl_ms=30)

            async def work(claim: Claim = claim, i: int = i) -> None:
                async with claim.keep_alive():  # renews every 10 ms
                    await asyncio.sleep(0.010 + (i % 60) * 0.00003)  # sweep across a send

            task = asyncio.ensure_future(work())
            done, _ = await asyncio.wait({task}, timeout=2)
            hung += not done
    finally:
        await store.aclose()
    assert hung == 0


@contextmanager
def _tool_server(env: dict[str, str]) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", "tests.server._proc_app:app",
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        cwd=ROOT, env={**os.environ, **env},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                httpx.get(url + "/", timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the tool server did not start"
                time.sleep(0.05)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.realtime
@pytest.mark.long  # a kill suite: `nox -s long` and CI
def test_a_killed_servers_claim_clears_within_one_lease(
    redis_proc: RedisServer, tmp_path: Path
) -> None:
    """SIGKILL a tool server mid-step: a retry on a replica succeeds within about one lease
    (real time: a killed process and leases that expire in a real Redis)."""
    lease = 1.5
    runs = tmp_path / "runs"
    runs.touch()
    env = {
        "AGENTKEY_TEST_REDIS": redis_proc.url,
        "AGENTKEY_TEST_PREFIX": "kill-" + uuid.uuid4().hex[:8],
        "AGENTKEY_TEST_LEASE": str(lease),
        "AGENTKEY_TEST_RUNS": str(runs),
    }
    headers, body = request_for({"amount": 1})
    with (
        _tool_server({**env, "AGENTKEY_TEST_WORK": "60"}) as (doomed, proc),
        _tool_server(env) as (replica, _),
    ):
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        pending: Any = pool.submit(
            httpx.post, doomed + "/tools/slow", headers=headers, content=body, timeout=60
        )
        with httpx.Client(timeout=30) as client:
            time.sleep(2 * lease)  # past one lease: the renewals keep the key
            busy = client.post(replica + "/tools/slow", headers=headers, content=body)
            assert busy.status_code == 409
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            killed = time.monotonic()
            with pytest.raises(httpx.TransportError):
                pending.result(timeout=10)
            pool.shutdown()
            # The retry: the same key, now with work that finishes, honouring Retry-After.
            waits = []
            while True:
                got = client.post(replica + "/tools/slow", headers=headers, content=body)
                if got.status_code != 409:
                    break
                waits.append(int(got.headers["retry-after"]))
                assert got.json()["lease_expires_in"] <= lease + 1
                time.sleep(min(waits[-1], 0.25))
                assert time.monotonic() - killed < 3 * lease, "the orphaned claim did not clear"
    # The step never began before the kill, so the retry runs it, once.
    assert got.status_code == 201
    assert time.monotonic() - killed < lease + 2.0
    assert waits
    assert all(w <= lease + 1 for w in waits)
    assert len(runs.read_text().splitlines()) == 1


class _ResentClaimStore(MemoryStore):
    """The first claim lands, but the client library 'resends' it and reads back its own record.

    ``events`` logs each in-progress rewrite (a renewal) and when the handler ran.
    """

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    async def claim(self, key: str, value: bytes, *, ttl_ms: int) -> bytes | None:
        first = await super().claim(key, value, ttl_ms=ttl_ms)
        return value if first is None else first  # the re-sent SET finds its own record

    async def finish(self, key: str, owner: str, value: bytes, *, ttl_ms: int) -> bool:
        if value.startswith(b"P:"):
            self.events.append("renew")
        return await super().finish(key, owner, value, ttl_ms=ttl_ms)


async def test_a_claim_read_back_after_a_resend_renews_its_lease_before_the_handler() -> None:
    """A re-sent claim's lease began at the first send: it is renewed before the handler runs."""
    store = _ResentClaimStore()

    async def tool(request: Request) -> JSONResponse:
        store.events.append("handler")
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/x", tool, methods=["POST"])])
    wrapped = IdempotencyMiddleware(
        app, store=store, options=ServerOptions(lock_ttl=60), shared_key_space=True
    )
    headers, body = request_for({"a": 1})
    transport = httpx.ASGITransport(app=wrapped)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        assert (await client.post("/x", headers=headers, content=body)).status_code == 200
    assert store.events[:2] == ["renew", "handler"]


@pytest.mark.realtime
async def test_a_blocked_event_loop_that_outlives_the_lease_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A handler that blocks the loop past the lease gets a WARNING naming the cause and the fix."""
    store = MemoryStore()
    claim = _claim(store, lease_ms=90, auto_renew=True)
    assert await store.claim(claim.record_key, claim.in_progress_record(), ttl_ms=90) is None
    assert claim.start_renewing()
    with caplog.at_level("WARNING", logger="agentkey.server"):
        await asyncio.sleep(0.05)
        time.sleep(0.2)  # noqa: ASYNC251 - the blocking call under test: no renewal can run
        await asyncio.sleep(0.05)
        await claim.stop_renewing()
    # The blocking call lapses the lease; on a loaded machine a stall in the short sleeps
    # around it may lapse it once more, and that is logged the same way.
    lapsed = [r for r in caplog.records if "lapsed" in r.getMessage()]
    assert lapsed
    record = lapsed[0]
    assert shown_key(claim.idempotency_key) in record.getMessage()
    assert claim.idempotency_key not in record.getMessage()  # a key is a bearer secret
    assert "blocking calls" in record.getMessage()


@pytest.mark.realtime
async def test_claims_wait_for_their_first_renewal_on_one_timer() -> None:
    """Claims that settle within a third of the lease cost no timer each; the rest renew.

    Many claims of one loop and one interval share a single timer. Those still
    running when their interval has passed start renewing; those that stopped
    never do; a shorter interval is not held up by a longer one.
    """
    store = MemoryStore()
    loop = asyncio.get_running_loop()
    timers = len(loop._scheduled)  # type: ignore[attr-defined]  # asyncio's timer heap
    # A 600 ms lease renewed every 200 ms: the record outlives a stall of up to 400 ms.
    claims = [_claim(store, lease_ms=600, auto_renew=True) for _ in range(40)]
    for claim in claims:
        assert await store.claim(claim.record_key, claim.in_progress_record(), ttl_ms=600) is None
        assert claim.start_renewing()
    assert len(loop._scheduled) == timers + 1  # type: ignore[attr-defined]
    slow = _claim(store, lease_ms=60_000, auto_renew=True)  # its own queue, a later timer
    assert slow.start_renewing()
    stopped, running = claims[:20], claims[20:]
    for claim in stopped:
        await claim.stop_renewing()
    await asyncio.sleep(0.8)  # past the first interval (200 ms) and the lease's first end (600 ms)
    try:
        assert all(claim._task is not None for claim in running)
        assert all(claim._task is None and not claim.renewing for claim in stopped)
        for claim in running:  # renewed: the record's lease was pushed past its first end
            assert await store.get(claim.record_key) is not None
        assert slow.renewing  # queued: not due for 20 s
        assert slow._task is None
    finally:
        for claim in (*running, slow):
            await claim.stop_renewing()
    assert not any(claim.renewing for claim in claims)


def test_the_first_renewal_queue_lets_its_loop_go() -> None:
    """A loop that ran claims is not kept alive by agentkey once it is closed and dropped."""
    import gc
    import weakref

    from agentkey.server import _claim as claim_module

    async def run() -> None:
        claim = _claim(MemoryStore(), lease_ms=30_000, auto_renew=True)
        assert claim.start_renewing()
        await claim.stop_renewing()

    loop = asyncio.new_event_loop()
    loop.run_until_complete(run())
    loop.close()
    gone = weakref.ref(loop)
    del loop
    gc.collect()
    assert gone() is None
    assert all(key is not None for key in claim_module._QUEUES)


class _TakenAtReadBack(MemoryStore):
    """Our claim lands, its answer is lost and the re-sent SET reads our own record back
    (as redis-py's retry of ``SET ... GET`` does); before the renewal that follows,
    our lease lapsed and another request (owner ``e...``, renewing) claimed the key."""

    async def claim(self, key: str, value: bytes, *, ttl_ms: int) -> bytes | None:
        got = await super().claim(key, value, ttl_ms=ttl_ms)
        if got is None:
            mine = decode_record(value, key="k")
            assert isinstance(mine, InProgress)
            other = encode_in_progress(
                "e" * 32, mine.started_ms, lease_end_ms=2**50, renew_ms=5_000,
                binding=mine.binding,
            )  # fmt: skip
            assert await self.finish(key, mine.owner, other, ttl_ms=3_600_000)
            return value
        return got


def test_a_claim_read_back_after_another_request_took_the_key_runs_nothing() -> None:
    """Our own claim read back, whose renewal finds another request's live lease: the
    handler does not run beside it (it ran once, a duplicate, before); the client gets
    the 409 in progress that request's record calls for, over uvicorn."""
    runs: list[int] = []

    async def charge(request: Request) -> JSONResponse:
        runs.append(1)
        return JSONResponse({"charged": len(runs)})

    headers, body = request_for({"amount": 5})
    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/charge", charge, methods=["POST"])]),
        store=_TakenAtReadBack(),
        shared_key_space=True,
    )
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        answer = client.post("/charge", headers=headers, content=body)
    assert runs == []
    assert answer.status_code == 409
    assert answer.json()["type"] == "urn:agentkey:problem:in_progress"
    assert "retry-after" in answer.headers
