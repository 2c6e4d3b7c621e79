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


@pytest.fixture(autouse=True)
def _journal_per_test(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each test's invokers (and the processes it starts) share a fresh default journal file.

    Invokers given no journal use ``$AGENTKEY_JOURNAL``; a file per test keeps one test's
    calls (fixed plan ids such as ``plan-1``) from settling another test's.
    """
    path = tmp_path_factory.mktemp("journal") / "journal.sqlite3"
    monkeypatch.setenv("AGENTKEY_JOURNAL", str(path))
