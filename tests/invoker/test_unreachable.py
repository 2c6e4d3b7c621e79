"""A tool server that is down: every connection refused, on a real loopback port (issue 26 §4).

Nothing was ever sent, so nothing can have run: the invoker stops after three refused
attempts, whatever ``max_attempts`` says, and raises ToolUnreachable naming host:port.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from agentkey import (
    AsyncToolInvoker,
    InvokeError,
    OutcomeUnknown,
    RetryPolicy,
    Step,
    ToolInvoker,
    ToolUnreachable,
)
from agentkey._keys import shown_key
from agentkey.client._hooks import GiveUpEvent

from ._support import DRIVERS, Driver, Recorder, make_step

#: Patient on purpose: a down server must not spend these eight attempts.
PATIENT = RetryPolicy(max_attempts=8, deadline=60.0, initial_backoff=0.01, max_backoff=0.05)


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A loopback port that refuses connections: bound (so nobody else takes it), not listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def call(driver: Driver, port: int, step: Step, **options: Any) -> InvokeError:
    """Invoke ``step`` at 127.0.0.1:``port``; the error it raised."""
    url = f"http://127.0.0.1:{port}"
    options.setdefault("route_template", "/tools/{tool}")
    if driver == "sync":
        with ToolInvoker(url, **options) as invoker, pytest.raises(InvokeError) as caught:
            invoker.invoke(step)
        return caught.value

    async def main() -> InvokeError:
        async with AsyncToolInvoker(url, **options) as invoker:
            with pytest.raises(InvokeError) as caught:
                await invoker.invoke(step)
            return caught.value

    return asyncio.run(main())


@pytest.mark.parametrize("driver", DRIVERS)
def test_refused_port_is_unreachable_after_three_attempts(
    driver: Driver, refused_port: int
) -> None:
    """Every connect refused: ToolUnreachable after 3 attempts (not 8), naming 127.0.0.1:port."""
    step, hooks = make_step(tool="create_db"), Recorder()
    error = call(driver, refused_port, step, retry=PATIENT, hooks=[hooks])
    assert isinstance(error, ToolUnreachable), f"the call gave {error!r}"
    assert not isinstance(error, OutcomeUnknown)
    assert error.attempts == 3 < PATIENT.max_attempts
    assert len(hooks.retries()) == 2
    assert [e.error for e in hooks.events if isinstance(e, GiveUpEvent)] == ["ToolUnreachable"]
    message = str(error)
    assert f"127.0.0.1:{refused_port}" in message
    assert "nothing was sent" in message
    assert error.idempotency_key == step.idempotency_key
    assert step.idempotency_key not in message
    assert shown_key(step.idempotency_key) in message
