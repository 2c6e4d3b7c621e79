"""Fixtures: idemkit (both modes) and agentkey's middleware, each on the session's real Redis."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager

import pytest

from tests._loopback import RedisServer

from ._support import Mode, Served, StartIdemkit, serve_agentkey, serve_idemkit


@pytest.fixture
def idemkit_server(redis_proc: RedisServer) -> StartIdemkit:
    """``with idemkit_server(mode) as served:`` idemkit on Redis, served on loopback.

    Options are idemkit's, with its defaults: ``wait_timeout`` is how long it holds a
    duplicate of an in-flight request before it answers "in flight" (423, or 409 in
    Stripe mode); ``require_key`` makes it answer 400 to a POST without a key.
    """

    def start(
        mode: Mode, *, wait_timeout: float = 10.0, require_key: bool = False
    ) -> AbstractContextManager[Served]:
        return serve_idemkit(redis_proc, mode, wait_timeout=wait_timeout, require_key=require_key)

    return start


@pytest.fixture
def agentkey_server(redis_proc: RedisServer) -> Iterator[Served]:
    """agentkey's own IdempotencyMiddleware on Redis, in front of the counting tool."""
    with serve_agentkey(redis_proc) as served:
        yield served
