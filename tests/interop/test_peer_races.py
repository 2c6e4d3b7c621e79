"""fastidempotent 0.1.0's race, made to happen: why the burst test lets it run twice.

Its middleware reads the record, then takes a lock (``SET NX``) and runs the handler; the
first request deletes its lock when it writes its record. A duplicate whose read came
before that write, and whose lock attempt came after it, finds no record it looked for and
a free lock: it runs the tool again. On an idle machine the window is a few microseconds;
under CPU load it opens, and ``test_concurrent_duplicates_run_once[fastidempotent]`` saw
two executions.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from fastidempotent import IdempotencyMiddleware
from fastidempotent.backends.redis import RedisBackend
from starlette.middleware import Middleware
from starlette.types import ASGIApp

from agentkey import PlanSession, ToolResult
from tests._loopback import RedisServer

from ._peers import Peer, _Closer, _starlette, serve_peer
from ._support import Tool, invoke_all

pytestmark = pytest.mark.redis


class _LateLock(RedisBackend):
    """Holds every lock attempt after the first until the first request's record is written."""

    def __init__(self, duplicate_read: threading.Event, **options: Any) -> None:
        super().__init__(**options)
        self.duplicate_read = duplicate_read  # set once a duplicate waits for its lock
        self.attempts = 0
        self.written: asyncio.Event | None = None

    async def acquire_lock(self, key: str, ttl: int) -> bool:
        self.written = self.written or asyncio.Event()
        self.attempts += 1
        if self.attempts > 1:  # a duplicate: it has read "no record" already
            self.duplicate_read.set()
            await self.written.wait()
        return await super().acquire_lock(key, ttl)

    async def set(self, record: Any) -> None:
        await super().set(record)
        self.written = self.written or asyncio.Event()
        self.written.set()


def _late_lock(duplicate_read: threading.Event) -> Callable[..., tuple[ASGIApp, _Closer]]:
    def build(tool: Tool, url: str, prefix: str) -> tuple[ASGIApp, _Closer]:
        client = aioredis.Redis.from_url(url)
        backend = _LateLock(duplicate_read, url=url, key_prefix=f"{prefix}:", client=client)
        app = _starlette(tool, Middleware(IdempotencyMiddleware, backend=backend))
        return app, _Closer(client)

    return build


def test_a_duplicate_that_read_before_the_first_finished_runs_again(
    redis_proc: RedisServer,
) -> None:
    """fastidempotent runs a duplicate twice when its lock comes after the first's record;
    agentkey reports both as executed, each with its own answer, and neither as a replay."""
    step = PlanSession.new().step(0, "provision", {"region": "eu-west-1"})
    duplicate_read = threading.Event()
    peer = Peer("fastidempotent", _late_lock(duplicate_read))
    with serve_peer(peer, redis_proc) as served:
        gate = served.tool.gates["provision"] = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(invoke_all, "async", served.url, [step, step])
            try:
                assert served.tool.entered("provision").wait(10)
                assert duplicate_read.wait(10)  # the duplicate read while the first ran
            finally:
                gate.set()
            outcomes = future.result(timeout=60)
    assert served.tool.executions() == 2
    assert all(isinstance(o, ToolResult) and not o.replayed for o in outcomes), outcomes
    bodies = [o.body for o in outcomes if isinstance(o, ToolResult)]
    assert bodies[0] != bodies[1]
