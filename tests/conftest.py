"""Shared fixtures. Servers run on loopback only; nothing leaves this machine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from tests._loopback import RedisServer, redis_server


@pytest.fixture(scope="session")
def redis_proc() -> Iterator[RedisServer]:
    """A real redis-server for the whole session; a missing binary fails, never skips."""
    try:
        with redis_server() as server:
            yield server
    except RuntimeError as exc:
        pytest.fail(str(exc))


# No per-example deadline: CI machines are slow and shared; correctness is the point.
# The default run keeps property tests quick; `nox -s long` (--hypothesis-profile long) digs deeper.
# Nor a "too slow to generate" health check: on a loaded machine (or under coverage) it fails
# runs whose data is fine.
_patient = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("agentkey", _patient, max_examples=100)
settings.register_profile("long", _patient, max_examples=2000)
settings.load_profile("agentkey")
