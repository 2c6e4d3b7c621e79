"""PostgresStore when the database fails: dead connections, locks, a fault during COMMIT.

Issue 30: a database fault costs a second, not a lease. Each test runs on the session's
real PostgreSQL; faults come from ``pg_terminate_backend``, ``LOCK TABLE`` and a proxy
that cuts a connection at a chosen statement (``tests/postgres/conftest.py``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import httpx
import psycopg
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentkey import Clock, PlanSession, StoreUnavailable
from agentkey.server import IdempotencyMiddleware, MemoryStore, ServerOptions, current_claim
from agentkey.server._claim import SETTLE_BACKOFF
from agentkey.server._postgres import PostgresStore
from agentkey.server._records import encode_in_progress
from agentkey.testing import FakeClock
from tests._postgres import PostgresServer
from tests.postgres.conftest import CutProxy

Factory = Callable[..., PostgresStore]


def _owner() -> str:
    return secrets.token_hex(16)


async def _admin(dsn: str, sql: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(sql)


_TERMINATE_OTHERS = (
    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
    "WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
)


@pytest.fixture
async def charges(postgres_proc: PostgresServer) -> str:
    """An empty ``av_charges`` table: the transactional tool's own data."""
    await _admin(postgres_proc.dsn, "DROP TABLE IF EXISTS av_charges")
    await _admin(
        postgres_proc.dsn, "CREATE TABLE av_charges (id serial PRIMARY KEY, step text, n int)"
    )
    return postgres_proc.dsn


async def _count(dsn: str) -> int:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        row = await (await conn.execute("SELECT count(*) FROM av_charges")).fetchone()
        assert row is not None
        return int(row[0])


def _charge_app(store: PostgresStore, before_commit: Callable[[Any], Any] | None = None) -> Any:
    """A transactional tool: one av_charges row commits with the record."""
    attempts: list[int] = []

    async def charge(request: Request) -> JSONResponse:
        args = await request.json()
        claim = current_claim()
        attempts.append(1)
        async with store.transaction(claim) as tx:
            cur = await tx.connection.execute(
                "INSERT INTO av_charges (step, n) VALUES (%s, %s) RETURNING id",
                (claim.idempotency_key, args["n"]),
            )
            row = await cur.fetchone()
            assert row is not None
            if before_commit is not None and len(attempts) == 1:
                await before_commit(tx)
            return await tx.complete(JSONResponse({"charge_id": row[0]}, status_code=201))

    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/charge", charge, methods=["POST"])]),
        store=store,
        options=ServerOptions(lock_ttl=30),
        principal=lambda scope: "agent",
    )
    app.attempts = attempts  # type: ignore[attr-defined]
    return app


async def test_dead_pooled_connections_are_replaced_before_use(
    postgres_store_factory: Factory, postgres_proc: PostgresServer
) -> None:
    """Every pooled connection killed (as by a restart): the next operations succeed; a
    statement sent on them would fail twice (it is resent once) and answer 503."""
    store = postgres_store_factory(min_size=4, max_size=4)
    try:
        await store.create_table()
        await asyncio.gather(*(store.get(f"warm{i}") for i in range(8)))  # the pool fills
        await _admin(postgres_proc.dsn, _TERMINATE_OTHERS)
        await asyncio.sleep(0.1)  # the FATAL notices and FINs reach the idle sockets
        owner = _owner()
        assert await store.claim("p:k", encode_in_progress(owner, 1), ttl_ms=5000) is None
        assert await store.renew("p:k", owner, ttl_ms=5000)
        assert await store.release("p:k", owner)
    finally:
        await store.aclose()


async def test_a_statement_whose_connection_dies_is_sent_once_more(cut_proxy: CutProxy) -> None:
    """The connection drops under a claim: it is resent on a fresh connection and succeeds."""
    store = PostgresStore(cut_proxy.dsn, table="av_resend", min_size=1, max_size=2)
    try:
        await store.create_table()
        cut_proxy.arm(b"WITH cur AS", "before")
        assert await store.claim("p:k", encode_in_progress(_owner(), 1), ttl_ms=5000) is None
        assert cut_proxy.seen == 2
    finally:
        await store.aclose()


async def test_a_claim_that_landed_before_its_connection_died_reads_back_as_its_own(
    cut_proxy: CutProxy,
) -> None:
    """The claim ran but its answer was lost: the resend finds this owner's own record."""
    store = PostgresStore(cut_proxy.dsn, table="av_landed", min_size=1, max_size=2)
    try:
        await store.create_table()
        value = encode_in_progress(_owner(), 1)
        cut_proxy.arm(b"WITH cur AS", "after")
        assert await store.claim("p:k", value, ttl_ms=5000) == value
        assert cut_proxy.seen == 2
    finally:
        await store.aclose()


@pytest.mark.realtime
async def test_a_request_waiting_through_an_outage_is_served_when_the_database_is_back(
    cut_proxy: CutProxy,
) -> None:
    """The database goes away for 1.5 s (its connections cut, new ones refused): a claim
    that waited through it is served soon after the database is back, though the pool
    had given up reconnecting, instead of failing at the pool's 5 s timeout. Real time:
    the pool's reconnection and timeout are waits of the driver on real sockets."""
    store = PostgresStore(cut_proxy.dsn, table="av_outage", min_size=1, max_size=2, timeout=5)
    try:
        await store.create_table()
        await store.get("p:warm")
        cut_proxy.go_down()
        claim = asyncio.ensure_future(
            store.claim("p:k", encode_in_progress(_owner(), 1), ttl_ms=5000)
        )
        await asyncio.sleep(1.5)  # the pool's reconnection (retried for 0.5 s) gave up
        assert not claim.done()
        cut_proxy.come_back()
        back = time.monotonic()
        assert await claim is None
        assert time.monotonic() - back < 1.5
    finally:
        await store.aclose()


async def test_a_locked_records_table_answers_503_within_the_lock_timeout(
    postgres_store_factory: Factory, postgres_proc: PostgresServer
) -> None:
    """LOCK TABLE held by another session: fresh and replayed requests get 503 + Retry-After
    at lock_timeout, not when the lock is released (only after the loop: with no statement
    timeout, a request that waited for the lock would never be answered); the statement
    is not resent."""
    store = postgres_store_factory(lock_timeout=0.3, statement_timeout=None)
    await store.create_table()
    seen: list[int] = []

    async def tool(request: Request) -> JSONResponse:
        seen.append(1)
        return JSONResponse({"ok": True}, status_code=201)

    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/t", tool, methods=["POST"])]),
        store=store,
        principal=lambda scope: "agent",
    )
    done = PlanSession.new().step(0, "t", {})
    fresh = PlanSession.new().step(0, "t", {})
    transport = httpx.ASGITransport(app=app)
    try:
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://t") as client,
            await psycopg.AsyncConnection.connect(postgres_proc.dsn) as locker,
        ):
            first = await client.post(
                "/t", headers={"idempotency-key": done.idempotency_key}, content=done.body
            )
            assert first.status_code == 201
            await locker.execute(f"LOCK TABLE {store.table} IN ACCESS EXCLUSIVE MODE")
            for step in (done, fresh):
                answer = await asyncio.wait_for(  # a bound on a hang, never a measure
                    client.post(
                        "/t", headers={"idempotency-key": step.idempotency_key}, content=step.body
                    ),
                    60,
                )
                assert answer.status_code == 503
                assert answer.headers["retry-after"] == "1"
            await locker.rollback()
            again = await client.post(
                "/t", headers={"idempotency-key": fresh.idempotency_key}, content=fresh.body
            )
            assert again.status_code == 201
    finally:
        await store.aclose()
    assert len(seen) == 2


async def test_a_lock_timeout_is_not_resent(
    cut_proxy: CutProxy, postgres_proc: PostgresServer
) -> None:
    """A lock timeout is an answer, not a lost connection: StoreUnavailable after one send."""
    store = PostgresStore(cut_proxy.dsn, table="av_locked", lock_timeout=0.2)
    try:
        await store.create_table()
        async with await psycopg.AsyncConnection.connect(postgres_proc.dsn) as locker:
            await locker.execute("LOCK TABLE av_locked IN ACCESS EXCLUSIVE MODE")
            cut_proxy.arm(b"WITH cur AS", "before", cuts=0)
            with pytest.raises(StoreUnavailable, match="lock or statement timeout"):
                await store.claim("p:k", encode_in_progress(_owner(), 1), ttl_ms=5000)
        assert cut_proxy.seen == 1
    finally:
        await store.aclose()


async def _post(client: httpx.AsyncClient, step: Any) -> httpx.Response:
    return await client.post(
        "/charge", headers={"idempotency-key": step.idempotency_key}, content=step.body
    )


async def test_a_connection_lost_inside_the_handlers_transaction_is_a_503_not_a_500(
    postgres_store_factory: Factory, charges: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The transaction's connection dies under the handler's own statement: 503 with
    Retry-After, nothing committed, the key freed at once (the retry runs, not 409)."""
    store = postgres_store_factory()

    async def die(tx: Any) -> None:
        await tx.connection.execute("SELECT pg_terminate_backend(pg_backend_pid())")

    app = _charge_app(store, die)
    step = PlanSession.new().step(0, "charge", {"n": 1})
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            with caplog.at_level(logging.ERROR, logger="agentkey.server"):
                first = await _post(client, step)
            again = await _post(client, step)
    finally:
        await store.aclose()
    assert first.status_code == 503, first.text
    assert first.headers["retry-after"] == "1"
    assert first.json()["error"] == "not_run"
    assert first.headers["idempotency-protected"] == "true"  # what lets a client believe it
    assert step.idempotency_key not in caplog.text  # the key is shown redacted
    assert again.status_code == 201
    assert "idempotent-replayed" not in again.headers
    assert app.attempts == [1, 1]
    assert await _count(charges) == 1


@pytest.mark.parametrize(
    ("mode", "retry"),
    [("before", "executed"), ("after", "replayed")],
    ids=["COMMIT never arrives", "COMMIT lands, its answer is lost"],
)
async def test_a_fault_during_commit_is_a_503_and_the_retry_settles_it(
    cut_proxy: CutProxy, charges: str, mode: str, retry: str
) -> None:
    """The connection drops at COMMIT: the request gets 503 not_finished (not 500, and not
    "not run": it may have committed), and the retry with the same key runs the step (it
    never committed) or replays the committed answer, with exactly one charge either way."""
    store = PostgresStore(cut_proxy.dsn, table=f"av_commit_{mode}")
    await store.create_table()

    async def arm(tx: Any) -> None:
        cut_proxy.arm(b"COMMIT", mode)

    app = _charge_app(store, arm)
    step = PlanSession.new().step(0, "charge", {"n": 1})
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            first = await _post(client, step)
            again = await _post(client, step)
    finally:
        await store.aclose()
    assert first.status_code == 503, first.text
    # The COMMIT may have landed: never "not run" (the old code said it did not run).
    assert first.json()["error"] == "not_finished"
    assert "may have committed" in first.json()["detail"]
    assert first.headers["idempotency-protected"] == "true"
    assert again.status_code == 201
    replayed = again.headers.get("idempotent-replayed") == "true"
    assert ("replayed" if replayed else "executed") == retry
    assert app.attempts == ([1] if replayed else [1, 1])
    assert await _count(charges) == 1


class FailingRelease(MemoryStore):
    """A MemoryStore whose first ``failures`` releases raise StoreUnavailable."""

    def __init__(self, failures: int, *, clock: Clock | None = None) -> None:
        super().__init__(clock=clock)
        self.failures = failures
        self.releases = 0

    async def release(self, key: str, owner: str) -> bool:
        self.releases += 1
        if self.failures > 0:
            self.failures -= 1
            raise StoreUnavailable("the store is down (test)")
        return await super().release(key, owner)


async def test_a_failed_release_is_retried_so_the_key_is_not_blocked_for_the_lease() -> None:
    """The handler fails before its side effect and the first two releases fail: the
    release is retried with backoff on the server's clock (a FakeClock: the two waits are
    in clock.sleeps), and the step runs again at once, not after its 30 s lease."""
    clock = FakeClock()
    store = FailingRelease(failures=2, clock=clock)
    runs: list[int] = []

    async def tool(request: Request) -> JSONResponse:
        runs.append(1)
        if len(runs) == 1:
            current_claim().nothing_started()
            raise RuntimeError("the tool failed before its side effect (test)")
        return JSONResponse({"ok": True}, status_code=201)

    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/t", tool, methods=["POST"])]),
        store=store,
        options=ServerOptions(lock_ttl=30),
        principal=lambda scope: "agent",
        clock=clock,
    )
    step = PlanSession.new().step(0, "t", {})
    headers = {"idempotency-key": step.idempotency_key}
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        first = await client.post("/t", headers=headers, content=step.body)
        again = await client.post("/t", headers=headers, content=step.body)
    assert first.status_code == 500
    assert again.status_code == 201, again.text
    assert store.releases == 3
    assert runs == [1, 1]
    assert clock.sleeps == pytest.approx([SETTLE_BACKOFF.delay(n, rng=lambda: 0.5) for n in (1, 2)])


async def test_a_burst_of_first_requests_creates_the_table_once(cut_proxy: CutProxy) -> None:
    """Twenty first claims at once on a fresh store: one table creation, and every claim lands.

    Each used to run its own creation, and those queued on the advisory lock past a short
    lock_timeout answered 503 (seen under CPU load with the default 1 s).
    """
    store = PostgresStore(cut_proxy.dsn, table=f"av_burst_{_owner()[:8]}", min_size=8)
    cut_proxy.arm(b"pg_advisory_xact_lock", "before", cuts=0)
    try:
        keys = [f"p:burst-{n}" for n in range(20)]
        claims = [store.claim(key, encode_in_progress(_owner(), 1), ttl_ms=5000) for key in keys]
        assert await asyncio.gather(*claims) == [None] * 20
    finally:
        await store.aclose()
    assert cut_proxy.seen == 1


@pytest.mark.realtime
async def test_a_burst_of_first_requests_shares_a_failed_table_creation(
    cut_proxy: CutProxy,
) -> None:
    """With the database down, a burst of first claims fails together in about one pool
    timeout: the requests that waited for the failed creation do not each wait out another.
    Real time: the pool's timeout is a wait of the driver on real sockets."""
    store = PostgresStore(cut_proxy.dsn, table=f"av_down_{_owner()[:8]}", timeout=1.0)
    cut_proxy.go_down()
    try:
        started = time.monotonic()
        claims = [
            store.claim(f"p:down-{n}", encode_in_progress(_owner(), 1), ttl_ms=5000)
            for n in range(10)
        ]
        outcomes = await asyncio.gather(*claims, return_exceptions=True)
        elapsed = time.monotonic() - started
    finally:
        cut_proxy.come_back()
        await store.aclose()
    assert all(isinstance(outcome, StoreUnavailable) for outcome in outcomes), outcomes
    assert elapsed < 6.0  # one shared timeout (1 s); one after another would take 10 s
