"""The Store semantics, identical on MemoryStore and a real RedisStore."""

from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import replace
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
import redis.cluster

from agentkey import ConfigurationError, LeaseLost, StepKey, StoreError, StoreUnavailable
from agentkey._keys import shown_key
from agentkey.server import Claim, MemoryStore, RedisStore, Store
from agentkey.server._records import (
    Binding,
    InProgress,
    StoredOutcome,
    decode_record,
    encode_in_progress,
    encode_outcome,
)
from agentkey.testing import FakeClock
from tests._loopback import RedisServer, free_port


def _owner() -> str:
    return secrets.token_hex(16)


def _done(body: bytes = b'{"ok":true}') -> bytes:
    return encode_outcome(
        StoredOutcome("COMPLETED", 200, (("content-type", "application/json"),), body)
    )


async def test_claim_once_then_existing_record(store: Store) -> None:
    """The first claim wins (returns None); a second claim returns the holder's record."""
    owner = _owner()
    held = encode_in_progress(owner, 1)
    assert await store.claim("p:k1", held, ttl_ms=5000) is None
    assert await store.claim("p:k1", encode_in_progress(_owner(), 2), ttl_ms=5000) == held


async def test_finish_is_compare_and_set_on_owner(store: Store) -> None:
    """Only the owner can finish; a stranger's finish leaves the record untouched."""
    owner = _owner()
    await store.claim("p:k2", encode_in_progress(owner, 1), ttl_ms=5000)
    assert not await store.finish("p:k2", _owner(), _done(b"stranger"), ttl_ms=5000)
    assert await store.finish("p:k2", owner, _done(), ttl_ms=5000)
    assert await store.get("p:k2") == _done()
    # Finished: the owner no longer holds an in-progress claim, so a second finish fails.
    assert not await store.finish("p:k2", owner, _done(b"again"), ttl_ms=5000)
    assert await store.get("p:k2") == _done()


async def test_release_only_by_owner_and_only_in_progress(store: Store) -> None:
    """Release deletes the owner's claim; a stranger's release and a finished record stay."""
    owner = _owner()
    await store.claim("p:k3", encode_in_progress(owner, 1), ttl_ms=5000)
    assert not await store.release("p:k3", _owner())
    assert await store.release("p:k3", owner)
    assert await store.get("p:k3") is None
    await store.claim("p:k3", encode_in_progress(owner, 1), ttl_ms=5000)
    await store.finish("p:k3", owner, _done(), ttl_ms=5000)
    assert not await store.release("p:k3", owner)
    assert await store.get("p:k3") == _done()


async def test_lease_expires_and_renew_extends_it(store: Store) -> None:
    """An unrenewed claim expires after its TTL; renewing keeps it; a lost lease cannot renew."""
    owner = _owner()
    await store.claim("p:k4", encode_in_progress(owner, 1), ttl_ms=300)
    for _ in range(3):
        await asyncio.sleep(0.15)
        assert await store.renew("p:k4", owner, ttl_ms=300)
    assert await store.get("p:k4") is not None
    await asyncio.sleep(0.45)
    assert await store.get("p:k4") is None
    assert not await store.renew("p:k4", owner, ttl_ms=300)
    # The key is free again: a new owner claims it and the old one cannot touch it.
    second = _owner()
    assert await store.claim("p:k4", encode_in_progress(second, 2), ttl_ms=5000) is None
    assert not await store.finish("p:k4", owner, _done(b"late"), ttl_ms=5000)
    assert not await store.release("p:k4", owner)
    assert await store.finish("p:k4", second, _done(), ttl_ms=5000)


async def test_owner_prefix_cannot_be_spoofed_by_a_longer_token(store: Store) -> None:
    """An owner whose token is a prefix of the holder's cannot pass the compare-and-set."""
    owner = _owner()
    await store.claim("p:k5", encode_in_progress(owner, 1), ttl_ms=5000)
    assert not await store.finish("p:k5", owner[:-1], _done(), ttl_ms=5000)


@pytest.mark.parametrize("ttl", [0, -1, 1.5, True])
async def test_bad_ttl_is_a_configuration_error(store: Store, ttl: object) -> None:
    """TTLs are positive whole milliseconds; anything else is refused before any I/O."""
    with pytest.raises(ConfigurationError):
        await store.claim("p:k6", encode_in_progress(_owner(), 1), ttl_ms=ttl)  # type: ignore[arg-type]


def test_v2_records_still_decode_and_v3_keeps_the_body_raw() -> None:
    """A record written by the previous release (body base64 in the JSON) replays unchanged."""
    v2 = (
        b'F:{"v":2,"status":500,"headers":[["a","b"]],"body":"AP8=","finished_ms":9,'
        b'"fp":"AAAAAAAAAAAAAAAAAAAAAA"}'
    )
    binding = Binding("A" * 22)
    expected = StoredOutcome("FAILED", 500, (("a", "b"),), b"\x00\xff", None, 9, binding)
    assert decode_record(v2, key="k") == expected
    v3 = encode_outcome(replace(expected, body=b"x" * 1000))
    assert v3.endswith(b"\n" + b"x" * 1000)  # the bytes themselves: no base64, no escaping
    assert len(v3) < 1100


def test_records_round_trip() -> None:
    """Each record state decodes to what was encoded; garbage is a StoreError naming the key."""
    owner = _owner()
    assert decode_record(encode_in_progress(owner, 7), key="k") == InProgress(owner, 7)
    outcome = StoredOutcome("FAILED", 500, (("a", "b"),), b"\x00\xff", None, 9)
    assert decode_record(encode_outcome(outcome), key="k") == outcome
    blob = StoredOutcome("COMPLETED", 201, (), b"", "file:///x/y.blob", 1)
    assert decode_record(encode_outcome(blob), key="k") == blob
    body = b'{"id":"\n"}\n\x00\xff'  # newlines in the body: only the first one ends the head
    with_newlines = replace(outcome, body=body)
    assert decode_record(encode_outcome(with_newlines), key="k") == with_newlines
    deep = b"C:" + b"[" * 100_000 + b"]" * 100_000
    overflow = b'C:{"status":1e400,"headers":[],"body":""}'
    for junk in (b"", b"hello", b"P:short:1", b"C:{not json", b'C:{"status":1}', deep, overflow):
        with pytest.raises(StoreError, match=f"'{shown_key('k')}'"):  # a key is a secret
            decode_record(junk, key="k")


@pytest.mark.parametrize("value", ["\u0100", "\ud800", "x\r\ny: z", "a\nb", "nul\x00"])
@pytest.mark.parametrize("where", ["name", "value"])
def test_a_stored_header_that_is_not_field_text_is_not_ours(value: str, where: str) -> None:
    """A stored header a server cannot send (not latin-1, CR, LF, NUL) is a typed StoreError."""
    header = json.dumps([value, "v"] if where == "name" else ["x-h", value])
    record = b'C:{"v":3,"status":200,"headers":[' + header.encode() + b'],"finished_ms":1}\nb'
    with pytest.raises(StoreError, match="not an agentkey record"):
        decode_record(record, key="k")


async def test_redis_keys_carry_a_cluster_hash_tag(redis_proc: RedisServer) -> None:
    """Record keys are <prefix>:{<principal>:<key>}: one slot per record, as Cluster needs."""
    client = aioredis.from_url(redis_proc.url)
    try:
        store = RedisStore(client, prefix="tagtest")
        assert store.redis_key("alice:plan:step_000:ab") == "tagtest:{alice:plan:step_000:ab}"
        await store.claim("alice:x", encode_in_progress(_owner(), 1), ttl_ms=5000)
        assert await client.exists("tagtest:{alice:x}") == 1
        await store.aclose()  # a client passed in stays open: the caller owns it
        assert await client.ping()
    finally:
        await client.aclose()


async def test_redis_down_raises_store_unavailable() -> None:
    """A RedisStore on a closed port raises StoreUnavailable naming the key, never the URL's
    password nor the record's principal (an e-mail)."""
    store = RedisStore(f"redis://:hunter2@127.0.0.1:{free_port()}/0", connect_timeout=0.5)
    record = "alice%40example.com:plan-1:step_000:" + "a" * 64
    try:
        with pytest.raises(StoreUnavailable) as info:
            await store.claim(record, encode_in_progress(_owner(), 1), ttl_ms=1000)
        assert "hunter2" not in str(info.value)
        assert "hunter2" not in repr(store)
        assert "alice" not in str(info.value)
        assert "plan-1:step_000:" in str(info.value)
    finally:
        await store.aclose()


@pytest.mark.parametrize(
    ("url", "prefix"),
    [("redis://127.0.0.1:1/0", ""), ("redis://127.0.0.1:1/0", "has{brace}"), ("http://x", "p")],
)
def test_redis_store_rejects_bad_configuration(url: str, prefix: str) -> None:
    """A bad prefix or URL is refused at construction with a ConfigurationError."""
    with pytest.raises(ConfigurationError):
        RedisStore(url, prefix=prefix)


@pytest.mark.parametrize(
    "client",
    [redis.Redis(port=1), redis.cluster.RedisCluster, object(), None],
    ids=["sync Redis", "sync RedisCluster class", "object", "None"],
)
def test_redis_store_refuses_a_client_that_is_not_async(client: object) -> None:
    """A sync client (which would block the loop and fail open with a 500) is refused at once."""
    with pytest.raises(ConfigurationError, match=r"redis\.asyncio client"):
        RedisStore(client)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"replicas": -1}, "replicas must be None"),
        ({"replicas": True}, "replicas must be None"),
        ({"replica_timeout": 0}, "replica_timeout must be seconds"),
        ({"replica_timeout": 5.0}, "below timeout"),
        ({"replica_timeout": float("nan")}, "replica_timeout must be seconds"),
    ],
)
def test_redis_store_refuses_replica_options_out_of_range(
    options: dict[str, Any], match: str
) -> None:
    """replicas is None or a count; replica_timeout is positive and below the command timeout."""
    with pytest.raises(ConfigurationError, match=match):
        RedisStore("redis://127.0.0.1:1/0", **options)


def test_redis_store_refuses_a_client_that_decodes_responses() -> None:
    """A client with decode_responses=True would turn raw response bodies into str: refused."""
    client = aioredis.Redis(port=1, decode_responses=True)
    with pytest.raises(ConfigurationError, match="decode_responses=False"):
        RedisStore(client)


def test_memory_store_satisfies_the_protocol() -> None:
    """Both stores are Store instances for the middleware's isinstance check."""
    assert isinstance(MemoryStore(), Store)
    assert isinstance(RedisStore("redis://127.0.0.1:1/0"), Store)


@pytest.mark.long
async def test_cluster_records_hash_on_their_tag_and_spread(redis_cluster_port: int) -> None:
    """On a real Redis Cluster a record's slot is its hash tag's, and records spread over nodes."""
    from redis.asyncio.cluster import RedisCluster

    client = RedisCluster(host="127.0.0.1", port=redis_cluster_port)
    try:
        store = RedisStore(client, prefix="spread")
        keys = [f"tenant-{i}:plan:step_000:{i:064x}" for i in range(30)]
        for key in keys:
            assert await store.claim(key, encode_in_progress(_owner(), 1), ttl_ms=5000) is None
        slots = {key: client.keyslot(store.redis_key(key)) for key in keys}
        assert all(slots[key] == client.keyslot(key) for key in keys)  # the tag decides
        nodes = {client.get_node_from_key(store.redis_key(key)) for key in keys}
        assert None not in nodes
        assert len(nodes) > 1
    finally:
        await client.aclose()


async def test_memory_store_drops_expired_records_nobody_reads_again() -> None:
    """Records whose keys are never touched again are dropped, so memory follows the live set."""
    clock = FakeClock(start=0.0)
    store = MemoryStore(clock=clock)
    for i in range(500):
        await store.claim(f"old:{i}", encode_in_progress(_owner(), 1), ttl_ms=1_000)
    # A renewal moves one record's end; its first expiry entry must not drop it.
    owner = _owner()
    await store.claim("kept", encode_in_progress(owner, 1), ttl_ms=1_000)
    clock.advance(0.5)
    assert await store.renew("kept", owner, ttl_ms=60_000)
    clock.advance(1.5)  # every "old" record is now past its TTL
    await store.claim("new", encode_in_progress(_owner(), 1), ttl_ms=60_000)
    assert repr(store) == "MemoryStore(records=2)"
    assert await store.get("kept") is not None
    assert len(store._expiries) == 2  # the stale entries went with their records


async def test_lost_lease_refuses_to_begin_the_mutation(store: Store) -> None:
    """Once a renewal finds the lease taken over, begin_mutation() raises instead of mutating."""
    key = StepKey.build("plan-lease", 0, {"a": 1})
    mine, theirs = _owner(), _owner()
    claim = Claim(
        key=key,
        idempotency_key=key.format(),
        principal="p",
        record_key="p:lease",
        owner=mine,
        store=store,
        lock_ttl_ms=5000,
    )
    # Our lease lapsed and another request claimed the key (as after a slow GC pause).
    assert await store.claim("p:lease", encode_in_progress(theirs, 1), ttl_ms=5000) is None
    assert not await claim.renew()
    assert claim.lost
    with pytest.raises(LeaseLost, match="another request took the key") as lost:
        claim.begin_mutation()
    assert isinstance(lost.value, StoreError)  # still caught by code written for StoreError
    assert not claim.mutation_started
    assert not await store.release("p:lease", mine)  # and it cannot free the other's claim


class _BuggyClient:
    """An async Redis client whose library breaks with a non-Redis error (as redis-py's
    cluster client can, on a connection closed beneath a command)."""

    async def execute_command(self, *args: object, **options: object) -> object:
        raise AttributeError("'NoneType' object has no attribute 'writelines'")

    def register_script(self, script: str) -> object:
        async def run(*, keys: list[str], args: list[object]) -> object:
            raise AttributeError("'NoneType' object has no attribute 'writelines'")

        return run


async def test_a_client_library_bug_is_a_store_error_so_the_middleware_fails_closed() -> None:
    """Any exception from the client maps to StoreError (503, handler not run), never a 500."""
    store = RedisStore(_BuggyClient(), prefix="bug")
    with pytest.raises(StoreError, match="AttributeError"):
        await store.claim("k", encode_in_progress(_owner(), 1), ttl_ms=1000)
    with pytest.raises(StoreError):
        await store.finish("k", _owner(), _done(), ttl_ms=1000)
    with pytest.raises(StoreError):
        await store.release("k", _owner())


def test_redis_store_uses_only_redis_pys_public_names() -> None:
    """agentkey/server/redis/_store.py imports no private redis-py module or name and reads no
    private attribute of anything but its own objects (issue 27 §3: no socket takeover)."""
    import ast
    import inspect as inspect_

    from agentkey.server.redis import _store as _redis

    tree = ast.parse(inspect_.getsource(_redis))
    private_imports = [
        f"{node.module}: {[a.name for a in node.names]}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and (node.module or "").startswith("redis")
        and (
            any(part.startswith("_") for part in (node.module or "").split("."))
            or any(a.name.startswith("_") for a in node.names)
        )
    ]
    reaches = [
        f"line {node.lineno}: .{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id == "self")
    ]
    assert private_imports == []
    assert reaches == []


@pytest.mark.parametrize(
    ("first", "last", "port", "same"),
    [
        (
            b"id=7 addr=127.0.0.1:5000 laddr=127.0.0.1:7001 fd=9",
            b"id=7 laddr=127.0.0.1:7001",
            7001,
            True,
        ),
        (b"id=7 laddr=127.0.0.1:7001", b"id=8 laddr=127.0.0.1:7001", 7001, False),  # reconnected
        (b"id=7 laddr=127.0.0.1:7002", b"id=7 laddr=127.0.0.1:7002", 7001, False),  # other node
        (b"id=7 laddr=127.0.0.1:7001", b"id=7 laddr=127.0.0.1:7003", 7001, False),
        (b"id=7 laddr=127.0.0.1:7001", redis.ConnectionError("lost"), 7001, False),
        (None, None, 7001, False),
        ("id=7 laddr=[::1]:7001", "id=7 laddr=[::1]:7001", 7001, True),
    ],
)
def test_a_cluster_wait_counts_only_on_the_connection_of_its_writes(
    first: Any, last: Any, port: int, same: bool
) -> None:
    """The CLIENT INFO frames around a node's writes and WAIT must name one connection to the
    node that serves the key; a pipeline redis-py sent again without its pins fails that."""
    from agentkey.server.redis._store import _one_connection

    assert _one_connection(first, last, port) is same
