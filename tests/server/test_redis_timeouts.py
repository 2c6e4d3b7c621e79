"""RedisStore's timeouts: a default never conflicts with a timeout the user set (issue 35)."""

from __future__ import annotations

import pytest

from agentkey import ConfigurationError
from agentkey.server import RedisStore


@pytest.mark.parametrize("timeout", [0.5, 0.01, 1.0, 1.5])
def test_a_short_timeout_alone_is_accepted_on_a_single_node(timeout: float) -> None:
    """RedisStore(url, timeout=0.5) builds: replica_timeout, not given, follows the timeout."""
    store = RedisStore("redis://127.0.0.1:1/0", timeout=timeout)
    assert store._replica_timeout == min(1.0, timeout / 2)
    assert store._replica_timeout < timeout


def test_the_default_replica_timeout_is_one_second_with_the_default_timeout() -> None:
    """With the default 5 s timeout the replica wait stays the documented 1 s."""
    assert RedisStore("redis://127.0.0.1:1/0")._replica_timeout == 1.0


def test_an_explicit_conflicting_pair_is_refused_naming_both() -> None:
    """replica_timeout=1.0 with timeout=0.5, both set by the user: refused, both named."""
    with pytest.raises(ConfigurationError) as raised:
        RedisStore("redis://127.0.0.1:1/0", timeout=0.5, replica_timeout=1.0)
    message = str(raised.value)
    assert "replica_timeout (1.0 s)" in message
    assert "timeout (0.5 s)" in message


@pytest.mark.parametrize("timeout", [0, -1.0, True, "5", None, float("nan")])
def test_a_timeout_that_is_not_positive_seconds_is_refused(timeout: object) -> None:
    """A timeout that is not a positive number is a ConfigurationError, not a TypeError later."""
    with pytest.raises(ConfigurationError, match="timeout must be a positive number"):
        RedisStore("redis://127.0.0.1:1/0", timeout=timeout)  # type: ignore[arg-type]
