"""Fixtures: every store test runs against MemoryStore, a real Redis and PostgreSQL, and under
``-m long`` a real Redis Cluster."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack

import pytest
import redis
from redis.asyncio.cluster import RedisCluster

from agentkey.server import MemoryStore, RedisStore, Store
from tests._loopback import RedisServer, free_port
from tests._postgres import postgres_proc, postgres_store_factory  # noqa: F401 - fixtures

StoreFactory = Callable[[], Store]


class ClusterStore(RedisStore):
    """A RedisStore on a cluster client it owns (closes with the store)."""

    async def aclose(self) -> None:
        client = self._client
        await super().aclose()  # its own tasks first
        await client.aclose()


def _start_node(stack: ExitStack, port: int) -> None:
    workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="agentkey-cluster-"))
    proc = subprocess.Popen(
        [
            "redis-server", "--port", str(port), "--bind", "127.0.0.1",
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-port", str(free_port()),  # the default (port + 10000) may not exist
            "--save", "", "--appendonly", "no", "--dir", workdir,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip

    def stop() -> None:
        proc.terminate()
        proc.wait(timeout=10)

    stack.callback(stop)


@pytest.fixture(scope="session")
def redis_cluster_port() -> Iterator[int]:
    """A private 3-master Redis Cluster on loopback; yields one node's port."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.fail("redis-server and redis-cli are needed for the Cluster tests")
    ports = [free_port() for _ in range(3)]
    with ExitStack() as stack:
        for port in ports:
            _start_node(stack, port)
        for port in ports:
            deadline = time.monotonic() + 10
            while True:
                try:
                    redis.Redis(port=port).ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        pytest.fail(f"cluster node on port {port} did not start")
                    time.sleep(0.05)
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while redis.Redis(port=ports[0]).cluster("info")["cluster_state"] != "ok":
            if time.monotonic() > deadline:
                pytest.fail("the Redis Cluster did not reach state ok")
            time.sleep(0.1)
        yield ports[0]


@pytest.fixture(
    params=["memory", "redis", pytest.param("cluster", marks=pytest.mark.long), "postgres"]
)
def store_kind(request: pytest.FixtureRequest) -> str:
    """Which store backs the test. The Redis Cluster runs under ``-m long`` (three nodes to
    start, a slower client), so the default run stays fast."""
    kind: str = request.param
    return kind


@pytest.fixture
def make_store(store_kind: str, request: pytest.FixtureRequest) -> Iterator[StoreFactory]:
    """Build stores of the parametrized kind; Redis ones get a unique key prefix."""
    if store_kind == "memory":
        yield MemoryStore
        return
    if store_kind == "cluster":
        port: int = request.getfixturevalue("redis_cluster_port")

        def cluster_factory() -> Store:
            # A cluster client fails (not waits) past max_connections per node
            # (default 100): size it for the 200-request burst, as docs/server.md says.
            client = RedisCluster(host="127.0.0.1", port=port, max_connections=1024)
            return ClusterStore(client, prefix=f"c{uuid.uuid4().hex[:12]}")

        yield cluster_factory
        return
    if store_kind == "postgres":
        yield request.getfixturevalue("postgres_store_factory")
        return
    redis_proc: RedisServer = request.getfixturevalue("redis_proc")

    def factory() -> Store:
        return RedisStore(redis_proc.url, prefix=f"t{uuid.uuid4().hex[:12]}")

    yield factory


@pytest.fixture
async def store(make_store: StoreFactory) -> AsyncIterator[Store]:
    """One store of each kind, closed in the test's own event loop."""
    built = make_store()
    yield built
    await built.aclose()
