"""Fixtures: every store test runs against MemoryStore and a real RedisStore."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from agentkey.server import MemoryStore, RedisStore, Store
from tests._loopback import RedisServer

StoreFactory = Callable[[], Store]


@pytest.fixture(params=["memory", "redis"])
def store_kind(request: pytest.FixtureRequest) -> str:
    """Which store backs the test."""
    kind: str = request.param
    return kind


@pytest.fixture
def make_store(store_kind: str, request: pytest.FixtureRequest) -> Iterator[StoreFactory]:
    """Build stores of the parametrized kind; Redis ones get a unique key prefix."""
    if store_kind == "memory":
        yield MemoryStore
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
