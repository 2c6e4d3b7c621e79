"""Single flight per credential: threads and coroutines share one refresh, cancellation is safe."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from pydantic import SecretStr

from agentkey import TokenError
from agentkey.auth import ClientCredentials, TokenPolicy
from agentkey.auth._base import _Flight
from agentkey.auth._token import Token
from agentkey.testing import FakeClock
from tests.auth._idp import IdP, Reply
from tests.auth.conftest import CLIENT_ID, CLIENT_SECRET

POLICY = TokenPolicy(initial_backoff=0.01, max_backoff=0.05, max_attempts=1, failure_ttl=5.0)


@pytest.fixture(autouse=True)
def clock(idp: IdP) -> FakeClock:
    """One fake clock for the providers and the IdP's token lifetimes.

    On the real clock the IdP's tokens live 2 s: on a loaded machine a burst outlived its
    token, the tool answered 401, and a second refresh looked like a broken single flight.
    """
    fake = FakeClock()
    idp.clock = fake.monotonic
    return fake


def _provider(idp: IdP, clock: FakeClock) -> ClientCredentials:
    return ClientCredentials(
        idp.url + "/token", CLIENT_ID, CLIENT_SECRET, policy=POLICY, clock=clock
    )


async def _expire(auth: ClientCredentials, clock: FakeClock) -> None:
    """Give ``auth`` a token, then move the clock past the token's life (no real waiting)."""
    assert await auth.aget_token()
    clock.advance(3600.0)


async def test_1000_concurrent_async_calls_make_one_token_request(
    idp: IdP, clock: FakeClock
) -> None:
    """1,000 concurrent async tool calls over an expired token cause exactly one token request."""
    auth = _provider(idp, clock)
    await _expire(auth, clock)
    before = idp.token_requests
    # The token endpoint is reached over loopback; the tool is the same app served in-process
    # (httpx.ASGITransport), so the 1,000 tool requests do not spend the test's time in sockets.
    tool = httpx.ASGITransport(app=idp.app())
    async with httpx.AsyncClient(auth=auth, timeout=120, transport=tool) as client:
        responses = await asyncio.gather(*(client.get(idp.url + "/tool") for _ in range(1000)))
    assert {r.status_code for r in responses} == {200}
    assert idp.token_requests - before == 1
    assert idp.tool_401 == 0


def test_16_threads_make_one_token_request(idp: IdP, clock: FakeClock) -> None:
    """16 threads calling at once over an expired token cause exactly one token request."""
    auth = _provider(idp, clock)
    asyncio.run(_expire(auth, clock))
    before = idp.token_requests
    barrier = threading.Barrier(16)

    def call() -> int:
        with httpx.Client(auth=auth, timeout=60) as client:
            barrier.wait()
            return client.get(idp.url + "/tool").status_code

    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(lambda _: call(), range(16)))
    assert statuses == [200] * 16
    assert idp.token_requests - before == 1


async def test_threads_and_coroutines_together_make_one_token_request(
    idp: IdP, clock: FakeClock
) -> None:
    """Threads and coroutines hitting one expired credential at once share a single refresh."""
    auth = _provider(idp, clock)
    await _expire(auth, clock)
    idp.delay = 0.3  # keep the refresh in flight while everyone arrives
    before = idp.token_requests

    def in_thread() -> str:
        return auth.get_token()

    async with httpx.AsyncClient(auth=auth, timeout=60) as client:
        coros = [client.get(idp.url + "/tool") for _ in range(100)]
        threads = [asyncio.to_thread(in_thread) for _ in range(16)]
        results = await asyncio.gather(*coros, *threads)
    tokens = {r for r in results if isinstance(r, str)}
    assert len(tokens) == 1
    assert {r.status_code for r in results if isinstance(r, httpx.Response)} == {200}
    assert idp.token_requests - before == 1


async def test_cancelled_waiters_do_not_cancel_the_shared_refresh(
    idp: IdP, clock: FakeClock
) -> None:
    """Cancelling the refresh's starter and a waiter still serves the rest from one refresh."""
    auth = _provider(idp, clock)
    idp.delay = 0.5
    leader = asyncio.ensure_future(auth.aget_token())
    await asyncio.sleep(0.05)
    waiters = [asyncio.ensure_future(auth.aget_token()) for _ in range(5)]
    await asyncio.sleep(0.1)
    leader.cancel()
    waiters[0].cancel()
    results = await asyncio.gather(leader, *waiters, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert isinstance(results[1], asyncio.CancelledError)
    assert len(set(results[2:])) == 1
    assert all(isinstance(r, str) for r in results[2:])
    assert idp.token_requests == 1
    assert await auth.aget_token() == results[2]  # the refresh landed for later callers too


async def test_failure_is_shared_and_remembered(idp: IdP, clock: FakeClock) -> None:
    """One failed refresh fails every waiter, and callers right after fail without a new request."""
    auth = _provider(idp, clock)
    idp.delay = 0.2
    idp.replies = [Reply(503, {"error": "temporarily_unavailable"})]
    results = await asyncio.gather(*(auth.aget_token() for _ in range(50)), return_exceptions=True)
    assert all(isinstance(r, TokenError) for r in results)
    assert idp.token_requests == 1
    with pytest.raises(TokenError):
        await auth.aget_token()
    with pytest.raises(TokenError):
        auth.get_token()
    assert idp.token_requests == 1


async def test_401_from_many_callers_refreshes_once(idp: IdP, clock: FakeClock) -> None:
    """Many concurrent 401s on the same token cause one refresh; each request is resent once."""
    auth = _provider(idp, clock)
    await auth.aget_token()
    idp.revoke_all()
    async with httpx.AsyncClient(auth=auth, timeout=60) as client:
        responses = await asyncio.gather(*(client.get(idp.url + "/tool") for _ in range(20)))
    assert {r.status_code for r in responses} == {200}
    assert idp.token_requests == 2
    assert idp.tool_401 == 20


class _LoopClosingMeanwhile(asyncio.SelectorEventLoop):
    """A loop that closes between the flight's look at it and the wake-up call."""

    pretend_open = False

    def is_closed(self) -> bool:
        return False if self.pretend_open else super().is_closed()


def test_a_closed_waiter_loop_does_not_strand_the_others() -> None:
    """A waiter loop that closed before the refresh ended does not keep the other waiters asleep."""
    flight = _Flight()
    dead = _LoopClosingMeanwhile()
    dead_future: asyncio.Future[None] = dead.create_future()
    dead.close()
    with flight._lock:  # registered while its loop was still running
        flight._waiters.append((dead, dead_future))
    token = Token(access_token=SecretStr("fresh"), obtained_at=time.monotonic())

    async def main() -> Token:
        live = asyncio.create_task(flight.wait_async())
        await asyncio.sleep(0)  # the live waiter registers behind the dead one
        dead.pretend_open = True
        try:
            flight.finish(token, None)
        finally:
            dead.pretend_open = False
        return await asyncio.wait_for(live, timeout=10)

    assert asyncio.run(main()) is token
