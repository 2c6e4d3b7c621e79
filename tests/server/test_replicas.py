"""RedisStore on a Redis with a replica: claims and finishes wait for it (WAIT), a claim no
replica confirmed is refused and its key freed, and a claim whose answer was lost is released.
Real redis-server processes on loopback; a stalled replica is a SIGSTOPped one."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from agentkey import StoreUnavailable
from agentkey.server import RedisStore
from agentkey.server._records import encode_in_progress
from agentkey.testing import FakeClock
from tests.server._apps import tool_app
from tests.server._nodes import Node, master_and_replica
from tests.server._util import request_for, serve_closing
from tests.server.test_redis_resilience import ReplyDropper, RestartableRedis, own_redis

__all__ = ["own_redis"]  # the fixture, for this module's tests

pytestmark = pytest.mark.realtime

#: How long a replica may take to confirm: ample on a loaded machine, and what each refusal costs.
_PATIENT = 1.5


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Node, Node]]:
    """A Redis (no persistence) with one replica in sync."""
    with master_and_replica(tmp_path, "--appendonly", "no") as nodes:
        yield nodes


def _held(owner: str | None = None) -> bytes:
    return encode_in_progress(owner or secrets.token_hex(16), 1)


def _waits(node: Node) -> int:
    with node.admin() as probe:
        stats: dict[str, Any] = probe.info("commandstats")
    return int(stats.get("cmdstat_wait", {}).get("calls", 0))


async def test_a_store_finds_the_replica_and_waits_for_it(pair: tuple[Node, Node]) -> None:
    """replicas=None turns into 1 at the first claim on a Redis with a replica; each claim,
    renewal and finish is then followed by one WAIT, and still takes one round trip."""
    master, _ = pair
    store = RedisStore(master.url, prefix="auto")
    owner = secrets.token_hex(16)
    try:
        asked = store.replicas
        assert await store.claim("warm", _held(owner), ttl_ms=60_000) is None
        assert (asked, store.replicas) == (None, 1)
        assert await store.renew("warm", owner, ttl_ms=60_000)  # loads the scripts (and
        assert await store.finish("warm", owner, b"C:{}\n", ttl_ms=60_000)  # waits again)
        before = _waits(master)
        assert await store.claim("k", _held(owner), ttl_ms=60_000) is None
        assert await store.renew("k", owner, ttl_ms=60_000)
        assert await store.finish("k", owner, b"C:{}\n", ttl_ms=60_000)
        assert await store.release("k", owner) is False  # finished: nothing to release
        assert _waits(master) - before == 3
        with master.admin() as probe:  # the replica holds the outcome
            assert probe.wait(1, 1000) >= 1
    finally:
        await store.aclose()


async def test_replicas_zero_opts_out(pair: tuple[Node, Node]) -> None:
    """replicas=0 sends no WAIT, even with a replica attached: the documented opt-out."""
    master, _ = pair
    store = RedisStore(master.url, prefix="optout", replicas=0)
    owner = secrets.token_hex(16)
    try:
        before = _waits(master)
        assert await store.claim("k", _held(owner), ttl_ms=60_000) is None
        assert await store.finish("k", owner, b"C:{}\n", ttl_ms=60_000)
        assert _waits(master) == before
        assert store.replicas == 0
    finally:
        await store.aclose()


async def test_a_claim_no_replica_confirms_is_refused_and_freed(pair: tuple[Node, Node]) -> None:
    """With the replica stalled, a claim waits replica_timeout, is deleted again and raises
    StoreUnavailable (the middleware's 503): the key is free, and runs once the replica is back."""
    master, replica = pair
    store = RedisStore(master.url, prefix="stalled", replica_timeout=_PATIENT)
    try:
        assert await store.claim("warm", _held(), ttl_ms=60_000) is None
        replica.pause()
        try:
            with pytest.raises(StoreUnavailable, match="no Redis replica confirmed the claim"):
                await store.claim("k", _held(), ttl_ms=60_000)
            assert await store.get("k") is None  # not left locked for a lease
        finally:
            replica.resume()
        assert await store.claim("k", _held(), ttl_ms=60_000) is None
    finally:
        await store.aclose()


async def test_a_finish_no_replica_confirms_raises_then_lands(pair: tuple[Node, Node]) -> None:
    """A finish the replica did not confirm raises; sent again once the replica is back it
    answers True (it finds its own outcome) and the replica holds it."""
    master, replica = pair
    store = RedisStore(master.url, prefix="finish", replica_timeout=_PATIENT)
    owner = secrets.token_hex(16)
    try:
        assert await store.claim("k", _held(owner), ttl_ms=60_000) is None
        replica.pause()
        try:
            with pytest.raises(StoreUnavailable, match="no Redis replica confirmed the finish"):
                await store.finish("k", owner, b"C:{}\ndone", ttl_ms=60_000)
        finally:
            replica.resume()
        assert await store.finish("k", owner, b"C:{}\ndone", ttl_ms=60_000)
        with replica.admin() as probe:
            assert probe.get("finish:{k}") == b"C:{}\ndone"
    finally:
        await store.aclose()


def test_the_middleware_answers_503_while_no_replica_confirms(
    pair: tuple[Node, Node],
) -> None:
    """End to end: a stalled replica gets 503 and the handler never runs; once it is back the
    same request runs once and its retry is a replay."""
    master, replica = pair
    store = RedisStore(master.url, prefix="mw", replica_timeout=_PATIENT)
    app = tool_app(store)
    headers, body = request_for({"n": 1})
    with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
        assert client.post("/ok", headers=request_for({"warm": 1})[0],
                           content=request_for({"warm": 1})[1]).status_code == 201  # fmt: skip
        replica.pause()
        try:
            refused = client.post("/ok", headers=headers, content=body)
        finally:
            replica.resume()
        ran = client.post("/ok", headers=headers, content=body)
        again = client.post("/ok", headers=headers, content=body)
    assert refused.status_code == 503
    assert ran.status_code == 201
    assert again.headers.get("idempotent-replayed") == "true"
    assert app.state.runs["ok"] == 2  # the warm-up and this step, once


def test_a_claim_whose_answer_was_lost_is_released(own_redis: RestartableRedis) -> None:
    """The SET lands but its answer is lost and the re-send is cut too: the request gets 503,
    and the store deletes its own claim, so the retry runs at once instead of a 409 for the
    whole lease (issue 29, item 2)."""
    proxy = ReplyDropper(own_redis.port)
    store = RedisStore(proxy.url, prefix="lostclaim")
    app = tool_app(store)
    headers, body = request_for({"n": 2})
    try:
        with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
            warm = request_for({"warm": 2})
            assert client.post("/ok", headers=warm[0], content=warm[1]).status_code == 201
            proxy.arm(b"\r\nSET\r\n")  # the claim lands, its answer is cut
            proxy.swallow(b"\r\nSET\r\n")  # the re-send never reaches Redis
            refused = client.post("/ok", headers=headers, content=body)
            with redis.Redis(port=own_redis.port) as probe:
                left = probe.keys("lostclaim:*")
            ran = client.post("/ok", headers=headers, content=body)
    finally:
        proxy.close()
    assert len(proxy.dropped) == 2
    assert refused.status_code == 503
    assert len(left) == 1  # the warm-up's record alone: the lost claim was deleted
    assert ran.status_code == 201  # not 409: the key was not left locked
    assert app.state.runs["ok"] == 2


async def test_a_client_passed_in_keeps_its_own_settings(pair: tuple[Node, Node]) -> None:
    """A redis.asyncio client passed in works with the replica wait too (one WAIT a write)."""
    master, _ = pair
    client = aioredis.Redis(port=master.port)
    store = RedisStore(client, prefix="given")
    try:
        before = _waits(master)
        assert await store.claim("k", _held(), ttl_ms=60_000) is None
        assert _waits(master) - before == 1
    finally:
        await store.aclose()
        await client.aclose()


def _calls(node: Node, command: str) -> int:
    with node.admin() as probe:
        stats: dict[str, Any] = probe.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def test_a_resent_claim_is_written_again_under_the_wait(pair: tuple[Node, Node]) -> None:
    """The answer to SET + WAIT is lost and redis-py re-sends both on a new connection: the SET
    reads its own record back, and that connection's WAIT covers none of its writes. The store
    rewrites the lease there (one EVALSHA) so the WAIT after it proves the replica has it."""
    master, _ = pair
    proxy = ReplyDropper(master.port)
    store = RedisStore(proxy.url, prefix="resent", replica_timeout=_PATIENT)
    owner = secrets.token_hex(16)
    try:
        assert await store.claim("warm", _held(owner), ttl_ms=60_000) is None  # finds the replica
        assert await store.renew("warm", owner, ttl_ms=60_000)  # loads the script
        evalsha, waits = _calls(master, "evalsha"), _waits(master)
        proxy.arm(b"\r\nSET\r\n")
        value = _held(owner)
        assert await store.claim("k", value, ttl_ms=60_000) == value  # its own, read back
        assert len(proxy.dropped) == 1
        assert _calls(master, "evalsha") - evalsha == 1  # the lease written again
        assert _waits(master) - waits == 3  # the lost pipeline's, the re-sent one's, the rewrite's
    finally:
        proxy.close()
        await store.aclose()


async def test_a_lost_claim_is_released_once_redis_answers_again(
    own_redis: RestartableRedis,
) -> None:
    """The claim lands, its answer and its re-send are lost, and so is the first release: the
    store keeps releasing in the background, and the key is free soon after, not a lease later."""
    proxy = ReplyDropper(own_redis.port)
    store = RedisStore(proxy.url, prefix="later")
    owner = secrets.token_hex(16)
    try:
        assert await store.claim("warm", _held(owner), ttl_ms=60_000) is None
        assert await store.release("warm", owner)  # loads the release script
        proxy.arm(b"\r\nSET\r\n")
        proxy.swallow(b"\r\nSET\r\n", store._release.sha.encode(), store._release.sha.encode())
        with pytest.raises(StoreUnavailable, match="could not be reached during claim"):
            await store.claim("k", _held(owner), ttl_ms=60_000)
        with redis.Redis(port=own_redis.port) as probe:
            assert probe.exists("later:{k}")  # it landed, and the release was lost
            for _ in range(200):
                if not probe.exists("later:{k}"):
                    break
                await asyncio.sleep(0.05)
            assert not probe.exists("later:{k}")
    finally:
        proxy.close()
        await store.aclose()


async def test_a_replica_attached_later_is_found(tmp_path: Path) -> None:
    """replicas=None on a Redis without replicas starts at 0 and asks again every 30 s of the
    store's clock (a FakeClock here) beside later claims: not before, and a replica attached
    meanwhile turns the wait on for good."""
    clock = FakeClock()
    master = Node(tmp_path, "--appendonly", "no")
    master.start()
    replica = Node(tmp_path, "--appendonly", "no")
    store = RedisStore(master.url, prefix="later-replica", replica_timeout=_PATIENT, clock=clock)
    try:
        assert await store.claim("a", _held(), ttl_ms=60_000) is None
        assert store.replicas == 0
        replica.start("--replicaof", "127.0.0.1", str(master.port))
        with master.admin() as probe:
            for _ in range(400):  # the replica is attached (the store is not asked yet)
                if probe.info("replication")["connected_slaves"]:
                    break
                await asyncio.sleep(0.05)
        clock.advance(29.9)
        await store.claim("b0", _held(), ttl_ms=60_000)
        await asyncio.sleep(0.2)
        assert store.replicas == 0  # 30 s have not passed on the store's clock
        clock.advance(0.2)  # now they have
        for n in range(400):
            await store.claim(f"b{n + 1}", _held(), ttl_ms=60_000)
            if store.replicas:
                break
            await asyncio.sleep(0.05)
        assert store.replicas == 1
        before = _waits(master)
        assert await store.claim("b", _held(), ttl_ms=60_000) is None
        assert _waits(master) - before == 1
    finally:
        await store.aclose()
        replica.stop()
        master.stop()
