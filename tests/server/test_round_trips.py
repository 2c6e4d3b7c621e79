"""Redis round trips per request, counted on the wire and matched to the documented numbers.

Documented (docs/server.md): a fresh request takes 2 (claim, finish), a replay 1,
a 409 1, a handler failing before its mutation 2 (claim, release).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from agentkey.server import RedisStore
from tests._loopback import RedisServer
from tests.server._apps import tool_app
from tests.server._util import request_for, serve_closing

_sent: list[int] = []
_lock = threading.Lock()


class CountingConnection(aioredis.Connection):
    """A redis.asyncio connection that counts every command batch it writes."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        with _lock:
            _sent.append(1)
        await super().send_packed_command(command, check_health)


def _trips(client: httpx.Client, path: str, headers: dict[str, str], body: bytes) -> int:
    with _lock:
        _sent.clear()
    client.post(path, headers=headers, content=body)
    with _lock:
        return len(_sent)


def _commandstats(url: str) -> dict[str, int]:
    with redis.Redis.from_url(url) as sync:
        stats: dict[str, Any] = sync.info("commandstats")
    return {name: int(value["calls"]) for name, value in stats.items()}


@pytest.mark.parametrize(
    ("case", "path", "args", "expected"),
    [
        ("fresh", "/ok", {"a": 1}, 2),
        ("failing before mutation", "/status", {"status": 503}, 2),
    ],
)
def test_round_trips_per_request(
    redis_proc: RedisServer, case: str, path: str, args: dict[str, Any], expected: int
) -> None:
    """A fresh request and a failure each take 2 round trips; their replay or retry the same."""
    pool = aioredis.ConnectionPool.from_url(redis_proc.url, connection_class=CountingConnection)
    store = RedisStore(aioredis.Redis(connection_pool=pool), prefix=f"rt-{case[:5]}")
    app = tool_app(store)
    with (
        serve_closing(app, store, also=[pool.disconnect]) as url,
        httpx.Client(base_url=url) as client,
    ):
        # Warm up: connect and load the Lua scripts once (SCRIPT LOAD is a one-off).
        for warm in ({"status": 200}, {"status": 503}):
            client.post("/status", headers=request_for(warm)[0], content=request_for(warm)[1])
        headers, body = request_for(args)
        assert _trips(client, path, headers, body) == expected
        if expected == 2 and path == "/ok":
            assert _trips(client, path, headers, body) == 1  # the replay


def test_replay_and_conflict_take_one_round_trip(redis_proc: RedisServer) -> None:
    """A replay and a 409 are answered from the single SET NX GET; commandstats agree."""
    pool = aioredis.ConnectionPool.from_url(redis_proc.url, connection_class=CountingConnection)
    store = RedisStore(aioredis.Redis(connection_pool=pool), prefix="rt-replay")
    app = tool_app(store)
    with (
        serve_closing(app, store, also=[pool.disconnect]) as url,
        httpx.Client(base_url=url) as client,
    ):
        headers, body = request_for({"b": 2})
        client.post("/ok", headers=headers, content=body)
        before = _commandstats(redis_proc.url)
        assert _trips(client, "/ok", headers, body) == 1
        after = _commandstats(redis_proc.url)
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        # Only the SET (and the INFO we sent ourselves) ran on the server.
        assert delta.get("cmdstat_set") == 1
        assert delta.get("cmdstat_evalsha", 0) == 0
        assert delta.get("cmdstat_get", 0) == 0


async def test_each_store_operation_is_one_round_trip(redis_proc: RedisServer) -> None:
    """claim, renew, finish and release each take exactly one round trip once scripts are loaded."""
    from agentkey.server._records import encode_in_progress

    pool = aioredis.ConnectionPool.from_url(redis_proc.url, connection_class=CountingConnection)
    client = aioredis.Redis(connection_pool=pool)
    store = RedisStore(client, prefix="rt-ops")
    owner = "0" * 32
    try:
        await client.script_load("return 1")  # connect first
        for name in ("warm-1", "warm-2"):  # load the scripts once
            await store.claim(name, encode_in_progress(owner, 1), ttl_ms=5000)
            await store.renew(name, owner, ttl_ms=5000)
        await store.finish("warm-1", owner, b"C:{}", ttl_ms=5000)
        await store.release("warm-2", owner)
        counts = {}
        for op, call in (
            ("claim", lambda: store.claim("k", encode_in_progress(owner, 1), ttl_ms=5000)),
            ("renew", lambda: store.renew("k", owner, ttl_ms=5000)),
            ("release", lambda: store.release("k", owner)),
            ("claim again", lambda: store.claim("k", encode_in_progress(owner, 2), ttl_ms=5000)),
            ("finish", lambda: store.finish("k", owner, b"C:{}", ttl_ms=5000)),
        ):
            _sent.clear()
            await call()
            counts[op] = len(_sent)
        assert counts == dict.fromkeys(counts, 1)
    finally:
        await client.aclose()
        await pool.disconnect()


def _clients(url: str) -> int:
    with redis.Redis.from_url(url) as sync:
        return int(sync.info("clients")["connected_clients"]) - 1  # less this INFO's own


async def test_a_store_from_a_url_sends_one_command_per_operation(redis_proc: RedisServer) -> None:
    """A URL store: one command per operation; a burst goes out as the first command and one
    pipeline of the rest, on two connections."""
    from agentkey.server._records import encode_in_progress

    store = RedisStore(redis_proc.url, prefix="rt-lean")
    owner = "1" * 32
    try:
        idle = _clients(redis_proc.url)
        with redis.Redis.from_url(redis_proc.url) as sync:
            sync.script_flush()  # as after a Redis restart: each script loads on first use
        for name in ("warm-1", "warm-2"):
            await store.claim(name, encode_in_progress(owner, 1), ttl_ms=5000)
            assert await store.renew(name, owner, ttl_ms=5000)
        assert await store.finish("warm-1", owner, b"C:{}\n", ttl_ms=5000)
        assert await store.release("warm-2", owner)
        before = _commandstats(redis_proc.url)
        await store.claim("k", encode_in_progress(owner, 1), ttl_ms=5000)
        assert await store.renew("k", owner, ttl_ms=5000)
        assert await store.release("k", owner)
        await store.claim("k", encode_in_progress(owner, 2), ttl_ms=5000)
        assert await store.finish("k", owner, b"C:{}\n", ttl_ms=5000)
        assert await store.get("k") is not None
        after = _commandstats(redis_proc.url)
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        assert delta.get("cmdstat_set") == 3  # two claims, and the finish script's own SET
        assert delta.get("cmdstat_get") == 4  # the get, and one inside each script
        assert delta.get("cmdstat_evalsha") == 3
        assert delta.get("cmdstat_script|load", 0) == 0
        results = await asyncio.gather(
            *(store.claim(f"b{i}", encode_in_progress(owner, 1), ttl_ms=5000) for i in range(30))
        )
        assert results == [None] * 30
        assert _clients(redis_proc.url) - idle <= 2
    finally:
        await store.aclose()
