"""``agentkey server doubt|settle`` against real Redis and PostgreSQL stores.

A real loopback server puts a key in doubt (its handler charged, then answered 500);
the CLI lists it (as a digest, never whole) and settles it; the next request then gets
the operator's answer, or runs the step once.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from agentkey.cli import main
from agentkey.server import PostgresStore, RedisStore, Store
from tests._loopback import RedisServer
from tests._postgres import PostgresServer
from tests.server._util import request_for, serve_closing
from tests.server.test_in_doubt import _plant, charging_app


@pytest.fixture(params=["redis", "postgres"])
def backend(request: pytest.FixtureRequest) -> Iterator[tuple[Callable[[], Store], list[str]]]:
    """A store factory and the CLI options that name the same store."""
    import uuid

    if request.param == "redis":
        redis: RedisServer = request.getfixturevalue("redis_proc")
        prefix = f"cli{uuid.uuid4().hex[:10]}"
        yield (
            lambda: RedisStore(redis.url, prefix=prefix),
            ["--store", redis.url, "--prefix", prefix],
        )
        return
    pg: PostgresServer = request.getfixturevalue("postgres_proc")
    table = f"cli{uuid.uuid4().hex[:10]}"
    yield lambda: PostgresStore(pg.dsn, table=table), ["--store", pg.dsn, "--table", table]


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[dict[str, object]]]:
    code = main(["server", *args])
    out = capsys.readouterr().out
    return code, [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _post(client: httpx.Client, headers: dict[str, str], body: bytes) -> httpx.Response:
    return client.post("/charge", headers={**headers, "connection": "close"}, content=body)


@pytest.mark.parametrize("verdict", ["--not-run", "--ran"])
def test_doubt_lists_and_settle_settles_a_key_in_doubt(
    backend: tuple[Callable[[], Store], list[str]],
    capsys: pytest.CaptureFixture[str],
    verdict: str,
) -> None:
    """doubt lists the key (digest, principal, route); settle --not-run lets the next
    request run the step once; settle --ran --body makes it the replayed answer."""
    make, where = backend
    store = make()
    app = charging_app(store)
    headers, body = request_for({"amount": 7, "answer": "500", "once": True})
    key = headers["idempotency-key"]
    with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
        assert _post(client, headers, body).status_code == 500
        assert _post(client, headers, body).status_code == 409  # in doubt
        code, rows = _cli(capsys, "doubt", *where, "--json")
        assert code == 0
        (row,) = rows
        assert row["principal"] == "shared"
        assert (row["method"], row["route"]) == ("POST", "/charge")
        assert row["why"] == "failed"
        shown = str(row["key"])
        assert key not in shown
        assert "#" in shown
        extra = (
            ["--body", '{"charged": "by hand"}', "--status", "201"] if verdict == "--ran" else []
        )
        code, _ = _cli(capsys, "settle", *where, shown, verdict, *extra)
        assert code == 0
        code, rows = _cli(capsys, "doubt", *where, "--json")
        assert (code, rows) == (0, [])  # a listing exits 0, empty or not
        after = _post(client, headers, body)
        again = _post(client, headers, body)
    if verdict == "--not-run":
        assert after.status_code == 201
        assert "idempotent-replayed" not in after.headers
        assert app.state.attempts["charge"] == 2
    else:
        assert after.status_code == 201
        assert after.json() == {"charged": "by hand"}
        assert after.headers["idempotent-replayed"] == "true"
        assert app.state.attempts["charge"] == 1
    assert again.headers["idempotent-replayed"] == "true"


def test_settle_of_a_key_not_in_doubt_finds_nothing(
    backend: tuple[Callable[[], Store], list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A key that is not in doubt is never settled: exit 1, the store untouched."""
    make, where = backend

    async def touch() -> None:  # the store in use (PostgreSQL: its table created)
        store = make()
        await store.get("nothing")
        await store.aclose()

    asyncio.run(touch())
    assert main(["server", "settle", *where, "plan:step_000:#00000000", "--not-run"]) == 1
    assert "no key" in capsys.readouterr().err


def test_a_store_url_it_cannot_use_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown URL scheme: exit 2 and a message naming the schemes."""
    assert main(["server", "doubt", "--store", "mysql://x"]) == 2
    assert "redis://" in capsys.readouterr().err


def test_a_lapsed_lease_is_listed_as_in_doubt(
    backend: tuple[Callable[[], Store], list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    """The record a dead process left (may have started, lease lapsed) is listed as in
    doubt, "lease lapsed", since its lease's end; one whose lease runs is not listed."""
    import time

    make, where = backend
    lapsed, _ = request_for({"amount": 1})
    running, _ = request_for({"amount": 2})
    now = int(time.time() * 1000)

    async def plant() -> None:
        store = make()
        try:
            for headers, lease_end in ((lapsed, now - 1000), (running, now + 60_000)):
                body = request_for({"amount": 1 if headers is lapsed else 2})[1]
                await _plant(
                    store,
                    headers["idempotency-key"],
                    body,
                    phase="started",
                    lease_end_ms=lease_end,
                    ttl_ms=3_600_000,
                )
        finally:
            await store.aclose()

    asyncio.run(plant())
    code, rows = _cli(capsys, "doubt", *where, "--json")
    assert code == 0
    (row,) = rows
    assert row["why"] == "lease lapsed"
    assert row["since"] == pytest.approx((now - 1000) / 1000)
    assert str(row["key"]).split("#")[0] in lapsed["idempotency-key"]


def _plant_one(make: Callable[[], Store], lease_end_ms: int, ttl_ms: int = 3_600_000) -> str:
    """A started record (lock_ttl 15 s) whose lease ends at ``lease_end_ms``; its key."""
    headers, body = request_for({"amount": 3})

    async def plant() -> None:
        store = make()
        try:
            await _plant(
                store,
                headers["idempotency-key"],
                body,
                phase="started",
                lease_end_ms=lease_end_ms,
                ttl_ms=ttl_ms,
            )
        finally:
            await store.aclose()

    asyncio.run(plant())
    return headers["idempotency-key"]


def test_not_run_refuses_a_lease_that_lapsed_less_than_a_lock_ttl_ago(
    backend: tuple[Callable[[], Store], list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    """settle --not-run on a key whose lease lapsed 1 s ago (its handler may still run)
    exits 2 and frees nothing; --force frees it (the old code freed it at once)."""
    import time

    make, where = backend
    key = _plant_one(make, int(time.time() * 1000) - 1000)
    code, rows = _cli(capsys, "doubt", *where, "--json")
    (row,) = rows
    assert main(["server", "settle", *where, str(row["key"]), "--not-run"]) == 2
    assert "may still be running" in capsys.readouterr().err
    code, rows = _cli(capsys, "doubt", *where, "--json")
    assert len(rows) == 1  # still in doubt
    assert main(["server", "settle", *where, str(row["key"]), "--not-run", "--force"]) == 0
    assert key not in capsys.readouterr().out
    code, rows = _cli(capsys, "doubt", *where, "--json")
    assert (code, rows) == (0, [])  # a listing exits 0, empty or not


def test_in_doubt_is_decided_on_the_store_clock(
    backend: tuple[Callable[[], Store], list[str]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An operator machine whose clock runs an hour ahead does not see a live lease as
    lapsed (the old code used time.time() and listed it, then let --not-run free it)."""
    import time

    make, where = backend
    _plant_one(make, int(time.time() * 1000) + 60_000)  # leased for another minute
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600)
    code, rows = _cli(capsys, "doubt", *where, "--json")
    monkeypatch.undo()
    assert (code, rows) == (0, [])  # a listing exits 0, empty or not


def test_ran_keeps_the_records_remaining_lifetime_on_redis(
    redis_proc: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """settle --ran keeps the in-doubt record's PTTL (7 days here), never a hard-coded
    24 h shorter than the server's result_ttl (the old code wrote 86,400,000 ms)."""
    import time
    import uuid

    import redis

    prefix = f"cli{uuid.uuid4().hex[:10]}"
    where = ["--store", redis_proc.url, "--prefix", prefix]
    week = 7 * 86_400_000
    _plant_one(
        lambda: RedisStore(redis_proc.url, prefix=prefix),
        int(time.time() * 1000) - 600_000,
        ttl_ms=week,
    )
    code, rows = _cli(capsys, "doubt", *where, "--json")
    (row,) = rows
    code, rows = _cli(capsys, "settle", *where, str(row["key"]), "--ran", "--json")
    assert code == 0
    assert float(rows[0]["kept_s"]) > 86_400  # type: ignore[arg-type]
    client = redis.Redis.from_url(redis_proc.url)
    try:
        (name,) = client.keys(f"{prefix}:*")
        assert 86_400_000 < client.pttl(name) <= week
    finally:
        client.close()


def test_a_redis_cluster_is_refused_not_listed_as_empty(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """doubt against a Redis Cluster node exits 2 with a clear message, never a false
    "no keys in doubt" (the old code scanned one node and exited 1)."""
    from contextlib import ExitStack

    import redis

    from tests._loopback import free_port
    from tests.server.conftest import _start_node

    port = free_port()
    with ExitStack() as stack:
        _start_node(stack, port)  # one cluster-enabled node: INFO says cluster_enabled:1
        client = redis.Redis(port=port)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        client.close()
        assert main(["server", "doubt", "--store", f"redis://127.0.0.1:{port}/0"]) == 2
    assert "Redis Cluster" in capsys.readouterr().err
