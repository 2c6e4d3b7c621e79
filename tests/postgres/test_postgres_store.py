"""PostgresStore on a real PostgreSQL: round trips, transactional completion, phases, purge."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from typing import Any

import httpx
import psycopg
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentkey import ConfigurationError, PlanSession, StoreError, StoreUnavailable
from agentkey._keys import shown_key
from agentkey.server import IdempotencyMiddleware, current_claim
from agentkey.server._postgres import PostgresStore, PostgresTransaction, RecoveryPoint
from agentkey.server._records import (
    StoredOutcome,
    decode_record,
    encode_in_progress,
    encode_outcome,
)
from agentkey.testing import FakeClock
from tests._loopback import free_port
from tests._postgres import PostgresServer
from tests.postgres.conftest import TurnCounter
from tests.server._util import with_options

Factory = Callable[..., PostgresStore]


def _owner() -> str:
    return secrets.token_hex(16)


def _done(body: bytes = b"{}") -> bytes:
    return encode_outcome(StoredOutcome("COMPLETED", 200, (), body))


async def test_each_operation_is_one_round_trip(turn_counter: TurnCounter) -> None:
    """claim (fresh and existing), renew, finish, release and get each take one round trip."""
    store = PostgresStore(turn_counter.dsn, table="rt_records", min_size=1, max_size=1)
    try:
        await store.create_table()
        await store.get("warm-up")  # the pooled connection is open
        counts: dict[str, int] = {}

        async def count(name: str, op: Any) -> Any:
            turn_counter.reset()
            result = await op
            counts[name] = turn_counter.turns
            return result

        owner = _owner()
        assert (
            await count("claim fresh", store.claim("k", encode_in_progress(owner, 1), ttl_ms=5000))
            is None
        )
        assert await count(
            "claim existing", store.claim("k", encode_in_progress(_owner(), 1), ttl_ms=5000)
        )
        assert await count("renew", store.renew("k", owner, ttl_ms=5000))
        assert await count("finish", store.finish("k", owner, _done(), ttl_ms=5000))
        assert await count("get", store.get("k")) == _done()
        await store.claim("k2", encode_in_progress(owner, 1), ttl_ms=5000)
        assert await count("release", store.release("k2", owner))
        assert counts == dict.fromkeys(counts, 1), counts
    finally:
        await store.aclose()


def _charge_app(store: PostgresStore, **middleware: Any) -> Any:
    """A tool whose side effect (a row in charges) commits with its idempotency record."""

    async def charge(request: Request) -> JSONResponse:
        args = await request.json()
        async with store.transaction(current_claim()) as tx:
            cur = await tx.connection.execute(
                "INSERT INTO charges (amount) VALUES (%s) RETURNING id", (args["amount"],)
            )
            row = await cur.fetchone()
            assert row is not None
            if args.get("fail"):
                raise RuntimeError("the tool failed before its commit")
            return await tx.complete(JSONResponse({"charge_id": row[0]}, status_code=201))

    app = Starlette(routes=[Route("/charge", charge, methods=["POST"])])
    return IdempotencyMiddleware(
        app, store=store, shared_key_space=True, **with_options(middleware)
    )


async def _charges(dsn: str) -> int:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute("SELECT count(*) FROM charges")
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])


@pytest.fixture
async def charges_table(postgres_proc: PostgresServer) -> str:
    """An empty charges table (the tool's own data) in the session's PostgreSQL."""
    async with await psycopg.AsyncConnection.connect(postgres_proc.dsn, autocommit=True) as conn:
        await conn.execute("DROP TABLE IF EXISTS charges")
        await conn.execute("CREATE TABLE charges (id serial PRIMARY KEY, amount int NOT NULL)")
    return postgres_proc.dsn


async def test_transactional_completion_replays_and_never_repeats(
    postgres_store_factory: Factory, charges_table: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The side effect and the COMPLETED record commit together; a retry replays the same body."""
    store = postgres_store_factory()
    step = PlanSession.new().step(0, "charge", {"amount": 5})
    transport = httpx.ASGITransport(app=_charge_app(store))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            headers = {"idempotency-key": step.idempotency_key}
            with caplog.at_level(logging.WARNING, logger="agentkey.server"):
                first = await client.post("/charge", headers=headers, content=step.body)
                second = await client.post("/charge", headers=headers, content=step.body)
        assert first.status_code == second.status_code == 201
        assert second.json() == first.json()
        assert second.headers["idempotent-replayed"] == "true"
        assert await _charges(charges_table) == 1
        assert not caplog.records  # the middleware's own finish found the sealed record
    finally:
        await store.aclose()


async def test_a_failure_before_commit_rolls_back_and_the_retry_runs_cleanly(
    postgres_store_factory: Factory, charges_table: str
) -> None:
    """An exception inside the transaction leaves neither the charge nor a record behind."""
    store = postgres_store_factory()
    failing = PlanSession.new().step(0, "charge", {"amount": 5, "fail": True})
    transport = httpx.ASGITransport(app=_charge_app(store), raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            headers = {"idempotency-key": failing.idempotency_key}
            response = await client.post("/charge", headers=headers, content=failing.body)
            assert response.status_code == 500
            assert await _charges(charges_table) == 0
            # The key was released: the same key runs again (and fails again, cleanly).
            again = await client.post("/charge", headers=headers, content=failing.body)
            assert again.status_code == 500
            assert "idempotent-replayed" not in again.headers
        assert await _charges(charges_table) == 0
    finally:
        await store.aclose()


async def test_a_foreign_call_before_the_transaction_keeps_the_key_in_doubt(
    postgres_store_factory: Factory, charges_table: str
) -> None:
    """Charge at a provider (claim.key_for), then fail inside store.transaction(): the key
    is in doubt, never released for a second charge (the old code flipped the record to
    "claimed" and released it, so the retry charged again: 2 provider charges)."""
    store = postgres_store_factory()
    provider: list[str] = []

    async def charge(request: Request) -> JSONResponse:
        args = await request.json()
        claim = current_claim()
        provider.append(claim.key_for("payments"))  # the foreign, non-transactional call
        async with store.transaction(claim) as tx:
            await tx.connection.execute("INSERT INTO charges (amount) VALUES (%s)", (5,))
            if args.get("fail"):
                raise RuntimeError("the ledger write failed after the charge")
            return await tx.complete(JSONResponse({"charged": True}, status_code=201))

    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/charge", charge, methods=["POST"])]),
        store=store,
        shared_key_space=True,
    )
    step = PlanSession.new().step(0, "charge", {"amount": 5, "fail": True})
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            headers = {"idempotency-key": step.idempotency_key}
            assert (
                await client.post("/charge", headers=headers, content=step.body)
            ).status_code == 500
            again = await client.post("/charge", headers=headers, content=step.body)
        assert again.status_code == 409, again.text
        assert again.json()["type"] == "urn:agentkey:problem:in_doubt"
        assert len(provider) == 1
        assert await _charges(charges_table) == 0  # the local write rolled back
    finally:
        await store.aclose()


async def test_leaving_the_block_without_complete_rolls_back(
    postgres_store_factory: Factory, charges_table: str
) -> None:
    """Writes without complete() or advance() never commit: they would run again on a retry."""
    store = postgres_store_factory()
    claim = _claim(store, "p:nocomplete")
    await store.claim(claim.record_key, encode_in_progress(claim.owner, 1), ttl_ms=5000)
    try:
        with pytest.raises(ConfigurationError, match="without complete"):
            async with store.transaction(claim) as tx:
                await tx.connection.execute("INSERT INTO charges (amount) VALUES (1)")
        assert await _charges(charges_table) == 0
    finally:
        await store.aclose()


def _claim(store: PostgresStore, record_key: str, idempotency_key: str | None = None) -> Any:
    from agentkey.server import Claim

    return Claim(
        key=None,
        idempotency_key=record_key if idempotency_key is None else idempotency_key,
        principal="p",
        record_key=record_key,
        owner=_owner(),
        store=store,
        lock_ttl_ms=5000,
    )


async def test_a_lost_lease_rolls_the_side_effect_back(
    postgres_store_factory: Factory, charges_table: str
) -> None:
    """If another request took the key, complete() fails the CAS and the writes roll back."""
    store = postgres_store_factory()
    claim = _claim(store, "p:lost")
    await store.claim(claim.record_key, encode_in_progress(claim.owner, 1), ttl_ms=5000)
    try:

        async def attempt() -> None:
            async with store.transaction(claim) as tx:
                await tx.connection.execute("INSERT INTO charges (amount) VALUES (1)")
                # Meanwhile the lease lapsed and another request claimed the key.
                assert await store.release(claim.record_key, claim.owner)
                taken = encode_in_progress(_owner(), 2)
                assert await store.claim(claim.record_key, taken, ttl_ms=5000) is None
                await tx.complete(JSONResponse({}, status_code=201))

        with pytest.raises(StoreError, match="lease") as lost:
            await attempt()
        assert await _charges(charges_table) == 0
        assert claim.idempotency_key not in str(lost.value)  # a key is a bearer secret
    finally:
        await store.aclose()


async def test_a_transaction_never_shows_its_whole_key(postgres_store_factory: Factory) -> None:
    """A transaction's repr and a lease lost inside it show the key as a digest, not whole."""
    store = postgres_store_factory()
    claim = _claim(store, "p:secret-key", "ik_live_SECRET_5f2a9c81d7e04b3a")
    await store.claim(claim.record_key, encode_in_progress(claim.owner, 1), ttl_ms=5000)
    try:

        async def attempt() -> None:
            async with store.transaction(claim) as tx:
                assert claim.idempotency_key not in repr(tx)
                assert await store.release(claim.record_key, claim.owner)
                await tx.recovery_point()

        with pytest.raises(StoreError) as lost:
            await attempt()
        assert "SECRET" not in str(lost.value)
        assert shown_key(claim.idempotency_key) in str(lost.value)
    finally:
        await store.aclose()


async def test_a_renewal_after_the_commit_never_shortens_the_completed_record(
    postgres_store_factory: Factory,
) -> None:
    """A lease renewal (a finish with the in-progress value) landing after the seal keeps it."""
    store = postgres_store_factory(result_ttl=3600)
    claim = _claim(store, "p:sealed")
    await store.claim(claim.record_key, encode_in_progress(claim.owner, 1), ttl_ms=5000)
    try:
        async with store.transaction(claim) as tx:
            await tx.complete(JSONResponse({"ok": 1}, status_code=201))
        sealed = await store.get(claim.record_key)
        assert sealed is not None
        assert sealed.startswith(b"C:")
        assert await store.finish(
            claim.record_key, claim.owner, encode_in_progress(claim.owner, 1), ttl_ms=1
        )
        assert await store.renew(claim.record_key, claim.owner, ttl_ms=1)
        await asyncio.sleep(0.05)
        assert await store.get(claim.record_key) == sealed
        assert not await store.release(claim.record_key, claim.owner)
        # Another owner's finish is still fenced off.
        assert not await store.finish(claim.record_key, _owner(), _done(), ttl_ms=5000)
    finally:
        await store.aclose()


async def test_purge_drops_expired_records_and_keeps_recovery_points(
    postgres_store_factory: Factory,
) -> None:
    """purge() deletes expired records, keeps live ones and released claims holding a phase."""
    store = postgres_store_factory(recovery_ttl=3600)
    try:
        for i in range(5):
            await store.claim(f"old:{i}", encode_in_progress(_owner(), 1), ttl_ms=1)
        await store.claim("live", encode_in_progress(_owner(), 1), ttl_ms=60_000)
        claim = _claim(store, "phased")
        await store.claim("phased", encode_in_progress(claim.owner, 1), ttl_ms=60_000)
        async with store.transaction(claim) as tx:
            await tx.advance("reserved", {"n": 1})
        assert await store.release("phased", claim.owner)
        await asyncio.sleep(0.01)
        assert await store.purge() == 5
        assert await store.get("live") is not None
        # The released claim kept its phase: the next owner takes it over and resumes.
        retry = _claim(store, "phased")
        assert await store.claim("phased", encode_in_progress(retry.owner, 2), ttl_ms=5000) is None
        async with store.transaction(retry) as tx:
            assert await tx.recovery_point() == RecoveryPoint("reserved", {"n": 1})
            await tx.complete(JSONResponse({}, status_code=200))
    finally:
        await store.aclose()


async def test_an_expired_outcome_taken_over_starts_without_a_recovery_point(
    postgres_store_factory: Factory,
) -> None:
    """A new claim on an expired finished record starts afresh: no stale phase leaks into it."""
    store = postgres_store_factory()
    claim = _claim(store, "reuse")
    try:
        await store.claim("reuse", encode_in_progress(claim.owner, 1), ttl_ms=5000)
        async with store.transaction(claim) as tx:
            await tx.advance("half", {})
        assert await store.finish("reuse", claim.owner, _done(), ttl_ms=1)
        await asyncio.sleep(0.01)
        fresh = _claim(store, "reuse")
        assert await store.claim("reuse", encode_in_progress(fresh.owner, 2), ttl_ms=5000) is None
        async with store.transaction(fresh) as tx:
            assert await tx.recovery_point() is None
            await tx.complete(JSONResponse({}, status_code=200))
    finally:
        await store.aclose()


async def test_concurrent_claims_have_exactly_one_winner(postgres_store_factory: Factory) -> None:
    """50 simultaneous claims of one key: one wins, 49 read the winner's record."""
    store = postgres_store_factory(max_size=20)
    await store.create_table()
    try:
        values = [encode_in_progress(_owner(), i) for i in range(50)]
        results = await asyncio.gather(*(store.claim("race", v, ttl_ms=5000) for v in values))
        winners = [v for v, r in zip(values, results, strict=True) if r is None]
        assert len(winners) == 1
        assert all(r == winners[0] for r in results if r is not None)
    finally:
        await store.aclose()


async def test_many_stores_create_the_table_at_once(postgres_proc: PostgresServer) -> None:
    """Concurrent first use from several processes' stores creates the table once, no error."""
    stores = [PostgresStore(postgres_proc.dsn, table="shared_first_use") for _ in range(8)]
    try:
        await asyncio.gather(
            *(
                s.claim(f"k{i}", encode_in_progress(_owner(), 1), ttl_ms=5000)
                for i, s in enumerate(stores)
            )
        )
    finally:
        for s in stores:
            await s.aclose()


async def test_database_down_is_store_unavailable_without_the_password() -> None:
    """A store on a closed port raises StoreUnavailable; neither error nor repr shows the DSN."""
    store = PostgresStore(
        f"postgresql://u:hunter2@127.0.0.1:{free_port()}/db", connect_timeout=1, timeout=1.5
    )
    try:
        with pytest.raises(StoreUnavailable) as info:
            await store.claim("p:k", encode_in_progress(_owner(), 1), ttl_ms=1000)
        assert "hunter2" not in str(info.value)
        assert "hunter2" not in repr(store)
    finally:
        await store.aclose()


@pytest.mark.parametrize(
    ("dsn", "options"),
    [
        ("redis://x", {}),
        ("postgresql://x/db", {"table": "Bad-Name"}),
        ("postgresql://x/db", {"table": "a; DROP TABLE b"}),
        ("postgresql://x/db", {"result_ttl": 0}),
        ("postgresql://x/db", {"sweep_every": -1}),
    ],
)
def test_bad_configuration_is_refused(dsn: str, options: dict[str, Any]) -> None:
    """A non-PostgreSQL DSN, an unsafe table name or a bad option fails at construction."""
    with pytest.raises(ConfigurationError):
        PostgresStore(dsn, **options)


def test_schema_sql_is_the_documented_migration() -> None:
    """schema_sql() names the table, its expiry index and the five columns."""
    text = PostgresStore("postgresql://x/db", table="app.idem").schema_sql()
    assert 'CREATE TABLE IF NOT EXISTS "app"."idem"' in text
    assert '"idem_expires_at"' in text
    for column in ("key", "value", "expires_at", "sealed_by", "recovery"):
        assert column in text


def test_transaction_type_is_exported_for_annotations() -> None:
    """Handlers can annotate the transaction they get."""
    assert PostgresTransaction.__name__ == "PostgresTransaction"


@pytest.mark.parametrize(("starts", "transactional"), [("on_run", 6), ("on_mark", 5)])
async def test_round_trips_per_fresh_and_replayed_request(
    turn_counter: TurnCounter, charges_table: str, starts: str, transactional: int
) -> None:
    """Through the middleware: fresh 2 round trips, replay 1; transactional fresh 5 (the
    finish after this process's own commit needs none), replay 1. "May have started"
    rides in the claim (no extra round trip); a transaction turns it back to "claimed"
    first (one more, 6), so a crash before its commit frees the key rather than leaving
    it in doubt, unless mutation_starts="on_mark" never said it (5)."""

    async def plain(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True}, status_code=201)

    store = PostgresStore(turn_counter.dsn, table="rt_mw", min_size=2, max_size=2)
    routes = [Route("/plain", plain, methods=["POST"])]
    app = _charge_app(store, mutation_starts=starts)
    app.app.router.routes.extend(routes)
    plan = PlanSession.new()
    counts: dict[str, int] = {}
    try:
        await store.create_table()
        await asyncio.gather(store.get("warm"), store.get("warm"))
        # Both pooled connections set up before counting: the two gets above may share the
        # first one while the pool still opens the second, whose set-up (its configure
        # statement) then counted as a turn of the first request (seen once, Python 3.10).
        await store._pool.wait(timeout=10)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            for path, step in (
                ("/plain", plan.step(0, "plain", {})),
                ("/charge", plan.step(1, "charge", {"amount": 1})),
            ):
                headers = {"idempotency-key": step.idempotency_key}
                for attempt in ("fresh", "replayed"):
                    turn_counter.reset()
                    response = await client.post(path, headers=headers, content=step.body)
                    assert response.status_code == 201
                    counts[f"{path} {attempt}"] = turn_counter.turns
    finally:
        await store.aclose()
    assert counts == {
        "/plain fresh": 2,
        "/plain replayed": 1,
        "/charge fresh": transactional,
        "/charge replayed": 1,
    }, counts


async def test_the_finish_after_a_commit_still_lengthens_a_shorter_sealed_lifetime(
    postgres_store_factory: Factory, charges_table: str
) -> None:
    """A store result_ttl shorter than the middleware's: the finish is sent and the record
    lives the middleware's result_ttl."""
    store = postgres_store_factory(result_ttl=60)
    step = PlanSession.new().step(0, "charge", {"amount": 5})
    transport = httpx.ASGITransport(app=_charge_app(store, result_ttl=3600))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            headers = {"idempotency-key": step.idempotency_key}
            assert (await client.post("/charge", headers=headers, content=step.body)).is_success
        async with await psycopg.AsyncConnection.connect(charges_table, autocommit=True) as conn:
            cur = await conn.execute(
                f"SELECT expires_at - clock_timestamp() > interval '3000 seconds' "  # noqa: S608
                f"FROM {store.table}"
            )
            assert await cur.fetchall() == [(True,)]
    finally:
        await store.aclose()


async def test_a_renewal_racing_the_commit_still_finds_the_record_its_own(
    postgres_store_factory: Factory,
) -> None:
    """A renewal blocked on complete()'s row lock until the COMMIT answers True, not "lost"."""
    store = postgres_store_factory(max_size=4)
    claim = _claim(store, "p:race")
    await store.claim(claim.record_key, encode_in_progress(claim.owner, 1), ttl_ms=5000)
    renewal = encode_in_progress(claim.owner, 1)
    try:
        async with store.transaction(claim) as tx:
            await tx.complete(JSONResponse({}, status_code=201))
            racing = asyncio.ensure_future(
                store.finish(claim.record_key, claim.owner, renewal, ttl_ms=5000)
            )
            await asyncio.sleep(0.3)  # the renewal now waits for this transaction's row lock
            assert not racing.done()
        assert await racing
    finally:
        await store.aclose()


async def test_a_transactionally_completed_key_stays_bound_to_its_route(
    postgres_store_factory: Factory, charges_table: str
) -> None:
    """The sealed record carries the claim's binding: the key on another route is 422, no replay."""
    store = postgres_store_factory()
    app = _charge_app(store)

    async def other(request: Request) -> JSONResponse:
        return JSONResponse({"other": True}, status_code=201)

    app.app.router.routes.append(Route("/other", other, methods=["POST"]))
    step = PlanSession.new().step(0, "charge", {"amount": 5})
    headers = {"idempotency-key": step.idempotency_key}
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as client:
            assert (
                await client.post("/charge", headers=headers, content=step.body)
            ).status_code == 201
            elsewhere = await client.post("/other", headers=headers, content=step.body)
        assert elsewhere.status_code == 422
        assert "idempotent-replayed" not in elsewhere.headers
    finally:
        await store.aclose()


async def test_the_inline_sweep_purges_every_sweep_every_claims(
    postgres_store_factory: Factory, postgres_proc: PostgresServer
) -> None:
    """Expired rows nobody reads again are deleted by the amortised sweep inside claim()."""
    store = postgres_store_factory(sweep_every=10)
    try:
        for i in range(9):
            await store.claim(f"old:{i}", encode_in_progress(_owner(), 1), ttl_ms=1)
        await asyncio.sleep(0.01)
        await store.claim("new", encode_in_progress(_owner(), 1), ttl_ms=60_000)  # the 10th
        async with await psycopg.AsyncConnection.connect(postgres_proc.dsn) as conn:
            cur = await conn.execute(f'SELECT count(*) FROM "{store.table}"')  # noqa: S608
            assert await cur.fetchone() == (1,)
    finally:
        await store.aclose()


@pytest.mark.parametrize(
    ("path", "body", "expected"),
    [
        ("/b", b'{"amount":100}', 422),  # another route: key_reused
        ("/a", b'{"amount":5000}', 422),  # another body under an opaque key: payload_mismatch
        ("/a", b'{"amount":100}', 200),  # the same operation resumes from its recovery point
    ],
    ids=["other route", "other body", "same operation"],
)
async def test_a_recovery_point_is_resumed_only_by_the_same_operation(
    postgres_store_factory: Factory, path: str, body: bytes, expected: int
) -> None:
    """A released claim's recovery point never reaches another route's or body's handler."""
    store = postgres_store_factory()
    seen: list[object] = []

    async def handler(request: Request) -> JSONResponse:
        claim = current_claim()
        point = await store.recovery_point(claim)
        seen.append(None if point is None else dict(point.data))
        if point is None:
            async with store.transaction(claim) as tx:
                await tx.advance("charged", {"charge_id": "ch_1"})
            raise RuntimeError("crash after the first phase")
        return JSONResponse({"resumed": dict(point.data)})

    routes = [Route(p, handler, methods=["POST"]) for p in ("/a", "/b")]
    app = IdempotencyMiddleware(Starlette(routes=routes), store=store, shared_key_space=True)
    headers = {"idempotency-key": "order-7f3a"}
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            first = await client.post("/a", headers=headers, content=b'{"amount":100}')
            again = await client.post(path, headers=headers, content=body)
    finally:
        await store.aclose()
    assert first.status_code == 500
    assert again.status_code == expected
    if expected == 200:
        assert again.json() == {"resumed": {"charge_id": "ch_1"}}
    assert seen == [None] + ([{"charge_id": "ch_1"}] if expected == 200 else [])


async def test_its_messages_show_the_key_as_a_digest(
    postgres_store_factory: Factory, charges_table: str
) -> None:
    """recovery_point() on a lost lease and a transaction left without complete() name the
    key as a digest, never whole (the old messages held the bearer key)."""
    store = postgres_store_factory()
    secret = "p:" + secrets.token_hex(16)
    claim = _claim(store, secret)
    await store.claim(claim.record_key, encode_in_progress(claim.owner, 1), ttl_ms=5000)
    try:
        with pytest.raises(ConfigurationError) as left:
            async with store.transaction(claim) as tx:
                await tx.connection.execute("INSERT INTO charges (amount) VALUES (1)")
        assert await store.release(claim.record_key, claim.owner)
        with pytest.raises(StoreError) as lost:
            await store.recovery_point(claim)
        for exc in (left.value, lost.value):
            assert secret not in str(exc)
            assert secret[-6:] not in str(exc)
    finally:
        await store.aclose()


async def test_a_completed_record_is_stamped_on_the_stores_clock(
    postgres_store_factory: Factory,
) -> None:
    """complete() stamps the record's finish time from the store's injected clock (its wall
    time, in Unix ms), not from the process's own time."""
    clock = FakeClock(wall=1_800_000_000.0)
    store = postgres_store_factory(clock=clock)
    claim = _claim(store, "p:stamped")
    await store.claim(claim.record_key, encode_in_progress(claim.owner, 1), ttl_ms=5000)
    try:
        async with store.transaction(claim) as tx:
            await tx.complete(JSONResponse({"ok": 1}, status_code=201))
        value = await store.get(claim.record_key)
        assert value is not None
        record = decode_record(value, key=claim.idempotency_key)
        assert isinstance(record, StoredOutcome)
        assert record.finished_ms == 1_800_000_000_000
    finally:
        await store.aclose()
