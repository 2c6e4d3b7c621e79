"""One clock: the retry schedules of an invoker and of a token provider run on ``clock=``.

One table, both drivers. Each row is a real loopback server that refuses twice, then
answers; the object under test is given an ``agentkey.testing.FakeClock`` and waits of
minutes. The waits it asked for are in ``clock.sleeps``, exactly the policy's schedule
(the clock's draws make the jitter known), and the server counted every request. Had
anything slept on the real clock, the test would hit its timeout long before the
schedule ended.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Any

import pytest

from agentkey import (
    AsyncToolInvoker,
    ConfigurationError,
    PlanSession,
    PollPolicy,
    RetryPolicy,
    ToolInvoker,
)
from agentkey._clock import SYSTEM
from agentkey.auth import ClientCredentials, TokenPolicy
from agentkey.testing import FakeClock, check_server
from tests._loopback import serve

from ._support import DRIVERS, Driver

pytestmark = pytest.mark.timeout(60)  # the schedules below are minutes long on the real clock

#: Jitter draws of 0.5 (FakeClock's default) halve every jittered ceiling.
SLOW_RETRY = RetryPolicy(
    max_attempts=5, initial_backoff=100.0, backoff_multiplier=2.0, max_backoff=400.0,
    jitter=True, deadline=3600.0,
)  # fmt: skip
SLOW_POLL = PollPolicy(
    initial_backoff=60.0, backoff_multiplier=2.0, max_backoff=240.0, deadline=3600.0
)
SLOW_TOKEN = TokenPolicy(
    max_attempts=4, initial_backoff=50.0, backoff_multiplier=2.0, max_backoff=200.0,
    jitter=True, deadline=3600.0,
)  # fmt: skip


@dataclass
class Refusing:
    """A plain ASGI server: each path answers its scripted statuses in turn, then its last one.

    ``/tools/*`` answers JSON, a 202 points at ``/status/1``, ``/token`` issues a token.
    Every request is counted per path.
    """

    script: dict[str, list[int]]
    hits: dict[str, int] = field(default_factory=dict)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        path = scope["path"]
        n = self.hits[path] = self.hits.get(path, 0) + 1
        statuses = self.script[path]
        status = statuses[min(n, len(statuses)) - 1]
        headers = [(b"content-type", b"application/json")]
        body: dict[str, Any] = {"error": "busy"}
        if status == 202:
            headers.append((b"location", b"/status/1"))
            body = {"status": "running"}
        elif status < 300 and path == "/token":
            body = {"access_token": "at-1", "token_type": "Bearer", "expires_in": 3600}
        elif status < 300:
            body = {"id": "vm-1"}
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})


def _invoke(driver: Driver, url: str, clock: FakeClock, **options: Any) -> int:
    """One step through a ToolInvoker or an AsyncToolInvoker on ``clock``: its status."""
    options = {"route_template": "/tools/{tool}", "journal": False, "clock": clock, **options}
    step = PlanSession.new().step(0, "create_vm", {"size": 1})
    if driver == "sync":
        with ToolInvoker(url, **options) as invoker:
            return invoker.invoke(step).status_code

    async def main() -> int:
        async with AsyncToolInvoker(url, **options) as invoker:
            return (await invoker.invoke(step)).status_code

    return asyncio.run(main())


def _token(driver: Driver, url: str, clock: FakeClock) -> int:
    """A token from a ClientCredentials provider on ``clock``, by get_token or aget_token."""
    auth = ClientCredentials(url + "/token", "agent", "secret", policy=SLOW_TOKEN, clock=clock)
    if driver == "sync":
        with auth:
            token = auth.get_token()
    else:

        async def main() -> str:
            async with auth:
                return await auth.aget_token()

        token = asyncio.run(main())
    return 200 if token == "at-1" else 0


@dataclass(frozen=True)
class Row:
    script: dict[str, list[int]]
    run: Callable[[Driver, str, FakeClock], int]
    sleeps: list[float]  # the schedule, on the fake clock
    hits: dict[str, int]  # what the server counted


TABLE = {
    # An invoker resending a 503 to a tool that honours keys: RetryPolicy.schedule, halved.
    "invoker-retry": Row(
        {"/tools/create_vm": [503, 503, 201]},
        lambda d, u, c: _invoke(d, u, c, retry=SLOW_RETRY, honours_keys=True),
        [50.0, 100.0],
        {"/tools/create_vm": 3},
    ),
    # An invoker polling a 202's status URL: PollPolicy.schedule (no jitter), whose first
    # wait (before the first poll) and second (after it) are both the initial backoff.
    "invoker-poll": Row(
        {"/tools/create_vm": [202], "/status/1": [202, 202, 200]},
        lambda d, u, c: _invoke(d, u, c, polling=SLOW_POLL, retry=SLOW_RETRY),
        [60.0, 60.0, 120.0],
        {"/tools/create_vm": 1, "/status/1": 3},
    ),
    # A token provider retrying its token endpoint: TokenPolicy.schedule, halved.
    "token-provider-retry": Row(
        {"/token": [503, 503, 200]},
        _token,
        [25.0, 50.0],
        {"/token": 3},
    ),
}


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("row", TABLE.values(), ids=TABLE.keys())
def test_a_retry_schedule_runs_on_the_injected_clock(row: Row, driver: Driver) -> None:
    """The waits of minutes are all in clock.sleeps, the policy's schedule exactly, and the
    server saw every attempt; nothing slept on the real clock (before: no clock= at all)."""
    tool = Refusing({path: list(statuses) for path, statuses in row.script.items()})
    clock = FakeClock()
    start = clock.monotonic()
    with serve(tool) as url:
        assert row.run(driver, url, clock) in (200, 201)
    assert clock.sleeps == row.sleeps
    assert clock.monotonic() - start == sum(row.sleeps)  # the clock moved by its waits alone
    assert tool.hits == row.hits


@pytest.mark.parametrize(
    "build",
    [
        lambda c: ToolInvoker("http://127.0.0.1:1", clock=c),
        lambda c: AsyncToolInvoker("http://127.0.0.1:1", clock=c),
        lambda c: ClientCredentials("http://127.0.0.1:1/token", "agent", "secret", clock=c),
    ],
    ids=["ToolInvoker", "AsyncToolInvoker", "ClientCredentials"],
)
def test_a_clock_that_is_not_a_clock_is_refused(build: Callable[[Any], object]) -> None:
    """clock= takes an agentkey.Clock; a bare function (the old TokenPolicy.clock) is refused
    at construction, naming the option."""
    with pytest.raises(ConfigurationError, match=r"clock must be an agentkey\.Clock"):
        build(lambda: 0.0)


def _stuck(retry_after: str) -> Any:
    """A tool that replays, except step 1 of any plan: in progress forever (409 +
    ``retry_after``)."""
    answers: dict[str, bytes] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        key = dict(scope["headers"]).get(b"idempotency-key", b"").decode()
        headers = [(b"content-type", b"application/json")]
        if ":step_001:" in key:
            status, body = 409, b'{"error": "in_progress"}'
            headers.append((b"retry-after", retry_after.encode()))
        elif key in answers:
            status, body = 200, answers[key]
            headers.append((b"idempotent-replayed", b"true"))
        else:
            status, body = 200, answers.setdefault(key, b'{"vm": %d}' % len(answers))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def test_the_checker_reads_retry_after_dates_on_its_clock() -> None:
    """check_server(clock=) measures a Retry-After date from the clock's wall time: a date ten
    days after the FakeClock's now is absurd advice, the same date (years past) on the system
    clock is none (before: check_server took no clock)."""
    clock = FakeClock()
    date = formatdate(clock.time() + 10 * 86400, usegmt=True)
    args = {"region": "eu-west-1"}
    row = "in-flight duplicate gets 409 + Retry-After"
    with serve(_stuck(date)) as url:
        faked = check_server(url, path="/tools/x", args=args, timeout=10.0, clock=clock)
        real = check_server(url, path="/tools/x", args=args, timeout=10.0, clock=SYSTEM)
    on_fake = next(r for r in faked.results if r.name == row)
    on_system = next(r for r in real.results if r.name == row)
    assert (on_fake.verdict, "an absurd Retry-After" in on_fake.detail) == ("FAIL", True)
    assert "absurd" not in on_system.detail
