"""RedisStore on a real redis-server that restarts, closes idle connections or loses a reply."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from agentkey.server import FileBlobStore, RedisStore
from agentkey.server._records import encode_in_progress
from tests._loopback import free_port
from tests.server._apps import tool_app
from tests.server._util import request_for, serve_closing

_LOGGER = "agentkey.server"


class RestartableRedis:
    """A private redis-server on one fixed loopback port that a test can stop and start again."""

    def __init__(self, workdir: Path, *options: str) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not on PATH; the tests need a real Redis")
        self.binary = binary
        self.port = free_port()
        self.workdir = workdir
        self.options = options
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--dir", str(self.workdir), *self.options],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while not self._answers():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                pytest.fail(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def _answers(self) -> bool:
        try:
            with redis.Redis(port=self.port, socket_connect_timeout=0.5) as probe:
                return bool(probe.ping())
        except redis.ConnectionError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def clients(self) -> int:
        """Connected clients, not counting the probe that asks."""
        with redis.Redis(port=self.port) as probe:
            return int(probe.info("clients")["connected_clients"]) - 1


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RestartableRedis]:
    """A redis-server this test alone uses (without persistence), stopped at the end."""
    server = RestartableRedis(tmp_path, "--appendonly", "no")
    server.start()
    yield server
    server.stop()


class ReplyDropper:
    """A TCP proxy in front of Redis. Armed with a trigger, it passes the next command that
    contains it to Redis and then cuts the connection instead of relaying Redis's answer:
    the write lands, and the client sees only a broken connection. A swallowed trigger is
    cut before it reaches Redis (once the armed ones are spent)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.triggers: list[bytes] = []
        self.swallowed: list[bytes] = []
        self.dropped: list[bytes] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def arm(self, *triggers: bytes) -> None:
        with self.lock:
            self.triggers.extend(triggers)

    def swallow(self, *triggers: bytes) -> None:
        with self.lock:
            self.swallowed.extend(triggers)

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            cut = threading.Event()
            threading.Thread(target=self._up, args=(client, server, cut), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, cut), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket, cut: threading.Event) -> None:
        with client, server:
            while chunk := _recv(client):
                with self.lock:
                    hit = next((t for t in self.triggers if t in chunk), None)
                    if hit is not None:
                        self.triggers.remove(hit)
                        self.dropped.append(hit)
                        cut.set()  # before Redis can answer
                    else:
                        lost = next((t for t in self.swallowed if t in chunk), None)
                        if lost is not None:
                            self.swallowed.remove(lost)
                            self.dropped.append(lost)
                            cut.set()
                            return  # never sent
                server.sendall(chunk)
                if hit is not None:
                    return

    @staticmethod
    def _down(server: socket.socket, client: socket.socket, cut: threading.Event) -> None:
        while chunk := _recv(server):
            if cut.is_set():
                break
            client.sendall(chunk)
        with contextlib.suppress(OSError):
            client.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            server.shutdown(socket.SHUT_RDWR)


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


def _held() -> bytes:
    return encode_in_progress(secrets.token_hex(16), 1)


async def _claims(store: RedisStore, tag: str, count: int, width: int) -> list[str]:
    """``count`` fresh claims, ``width`` at a time (so the pool holds ``width`` connections);
    the names of the claims that raised."""
    failed: list[str] = []

    async def one(i: int) -> None:
        try:
            assert await store.claim(f"{tag}:{i}", _held(), ttl_ms=60_000) is None
        except Exception as exc:
            failed.append(f"{tag}:{i}: {type(exc).__name__}: {exc}")

    for start in range(0, count, width):
        await asyncio.gather(*(one(i) for i in range(start, min(start + width, count))))
    return failed


async def test_claims_succeed_once_a_restarted_redis_is_back(own_redis: RestartableRedis) -> None:
    """After Redis restarts on its port, no claim on a stale pooled connection fails, and the
    Lua scripts (gone with the old process) load again for renew and finish."""
    store = RedisStore(own_redis.url, prefix="restart")
    owner = secrets.token_hex(16)
    try:
        assert await _claims(store, "before", 40, 8) == []
        assert await store.claim("ops", encode_in_progress(owner, 1), ttl_ms=60_000) is None
        assert await store.renew("ops", owner, ttl_ms=60_000)
        own_redis.stop()
        own_redis.start()
        assert await _claims(store, "after", 40, 8) == []
        assert await store.claim("ops", encode_in_progress(owner, 1), ttl_ms=60_000) is None
        assert await store.renew("ops", owner, ttl_ms=60_000)
        assert await store.finish("ops", owner, b"C:{}", ttl_ms=60_000)
    finally:
        await store.aclose()


async def test_claims_succeed_after_redis_closes_idle_connections(
    own_redis: RestartableRedis,
) -> None:
    """Redis's idle `timeout` closes the store's connection; the next operations still succeed."""
    with redis.Redis(port=own_redis.port) as admin:
        admin.config_set("timeout", 1)
    store = RedisStore(own_redis.url, prefix="idle")
    try:
        assert await _claims(store, "before", 40, 8) == []
        assert own_redis.clients() >= 1  # the store's connections, idle in its pool
        deadline = time.monotonic() + 20
        while own_redis.clients() > 0:  # Redis closes them after 1 s idle (checked each cron)
            assert time.monotonic() < deadline, "Redis did not close the idle connections"
            await asyncio.sleep(0.1)
        assert await _claims(store, "after", 40, 8) == []
        owner = secrets.token_hex(16)
        assert await store.claim("idle:ops", encode_in_progress(owner, 1), ttl_ms=60_000) is None
        while own_redis.clients() > 0:
            assert time.monotonic() < deadline, "Redis did not close the idle connections"
            await asyncio.sleep(0.1)
        assert await store.renew("idle:ops", owner, ttl_ms=60_000)
    finally:
        await store.aclose()


def test_a_lost_reply_to_a_claim_or_finish_is_resent_and_recognised(
    own_redis: RestartableRedis, tmp_path: Path
) -> None:
    """A claim and a finish whose answers are lost are re-sent by the retry and found to be ours:
    the handler runs once, its answer is stored, its blob kept."""
    proxy = ReplyDropper(own_redis.port)
    store = RedisStore(proxy.url, prefix="lost")
    blobs = FileBlobStore(tmp_path)
    app = tool_app(store, blob_store=blobs, max_inline_bytes=1000)
    try:
        with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
            warm_headers, warm_body = request_for({"size": 10})  # connect, load the scripts
            assert client.post("/big", headers=warm_headers, content=warm_body).status_code == 200
            proxy.arm(b"\r\nSET\r\n", store._finish.sha.encode())
            headers, body = request_for({"size": 5000})
            first = client.post("/big", headers=headers, content=body)
            again = client.post("/big", headers=headers, content=body)
    finally:
        proxy.close()
    assert first.status_code == 200
    assert len(proxy.dropped) == 2  # both answers were lost on the way back
    assert (again.status_code, again.headers.get("idempotent-replayed")) == (200, "true")
    assert again.content == first.content
    assert app.state.runs["big"] == 2  # the warm-up and this step, once
    assert len(list(tmp_path.glob("*.blob"))) == 1


async def _checked(store: RedisStore) -> None:
    """Wait for the store's persistence check, which runs beside its first claim."""
    if store._persistence_check is not None:
        await store._persistence_check


async def test_warns_once_when_redis_runs_without_persistence(
    own_redis: RestartableRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis with appendonly no gets one WARNING on agentkey.server, however many claims follow."""
    store = RedisStore(own_redis.url, prefix="nopersist")
    try:
        with caplog.at_level(logging.WARNING, logger=_LOGGER):
            assert await _claims(store, "k", 5, 1) == []
            await _checked(store)
            assert await _claims(store, "more", 5, 5) == []
            await _checked(store)
    finally:
        await store.aclose()
    warnings = [r for r in caplog.records if r.name == _LOGGER and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "appendonly no" in warnings[0].getMessage()


@pytest.mark.parametrize("case", ["appendonly yes", "CONFIG not permitted"])
async def test_no_persistence_warning_with_aof_or_without_config_access(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    """With AOF on there is nothing to warn about; a Redis that refuses CONFIG (managed Redis)
    still serves every claim, silently."""
    server = RestartableRedis(tmp_path, "--appendonly", "yes" if case == "appendonly yes" else "no")
    server.start()
    url = server.url
    if case == "CONFIG not permitted":
        with redis.Redis(port=server.port) as admin:
            admin.acl_setuser("app", enabled=True, passwords=["+s3cret"], keys=["*"],
                              commands=["+@all", "-config"])  # fmt: skip
        url = f"redis://app:s3cret@127.0.0.1:{server.port}/0"
    store = RedisStore(url, prefix="persist")
    try:
        with caplog.at_level(logging.DEBUG, logger=_LOGGER):
            assert await _claims(store, "k", 3, 1) == []
            await _checked(store)
    finally:
        await store.aclose()
        server.stop()
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert "s3cret" not in caplog.text


class _StuckConfig(aioredis.Redis):
    """A real client whose CONFIG GET never answers (a proxy or a Redis that stalls on it)."""

    async def config_get(self, *args: Any, **kwargs: Any) -> Any:
        await asyncio.Event().wait()


async def test_the_persistence_check_never_delays_a_claim(own_redis: RestartableRedis) -> None:
    """The check runs beside the first claim: a stalled CONFIG GET delays no claim (a delay there
    would eat the lease of a handler that has not started), and aclose() ends it."""
    client = _StuckConfig.from_url(own_redis.url)
    store = RedisStore(client, prefix="stuck")
    try:
        owner = secrets.token_hex(16)
        claim = store.claim("k", encode_in_progress(owner, 1), ttl_ms=60_000)
        assert await asyncio.wait_for(claim, timeout=10) is None
        check = store._persistence_check
        assert check is not None
        assert not check.done()
        await store.aclose()
        assert check.cancelled()
    finally:
        await client.aclose()


@pytest.mark.long
async def test_warns_once_on_a_cluster_without_persistence(
    redis_cluster_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The persistence check reads a Redis Cluster's answer too (its nodes run appendonly no)."""
    from redis.asyncio.cluster import RedisCluster

    client = RedisCluster(host="127.0.0.1", port=redis_cluster_port)
    try:
        store = RedisStore(client, prefix="cluster-persist")
        with caplog.at_level(logging.WARNING, logger=_LOGGER):
            assert await _claims(store, "k", 3, 1) == []
            await _checked(store)
    finally:
        await client.aclose()
    assert [r.getMessage().count("appendonly no") for r in caplog.records] == [1]
