"""Cancellation: a cancelled task or a KeyboardInterrupt leaves no response open.

A transport wrapper counts responses that were opened and not yet closed,
using only httpx's public transport API, against the loopback tool app.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from agentkey import AsyncToolInvoker, RetryEvent, ToolInvoker
from tests._loopback import serve

from ._support import FAST_RETRY, Recorder, make_step
from ._toolapp import Faults, ToolApp

SLOW_WAITS = FAST_RETRY.replace(max_retry_after=5.0)


class _Stream(httpx.AsyncByteStream, httpx.SyncByteStream):
    def __init__(
        self, inner: httpx.AsyncByteStream | httpx.SyncByteStream, owner: Counting
    ) -> None:
        self._inner = inner
        self._owner = owner

    def __iter__(self) -> Iterator[bytes]:
        assert isinstance(self._inner, httpx.SyncByteStream)
        yield from self._inner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        assert isinstance(self._inner, httpx.AsyncByteStream)
        async for chunk in self._inner:
            yield chunk

    def close(self) -> None:
        self._owner.open -= 1
        assert isinstance(self._inner, httpx.SyncByteStream)
        self._inner.close()

    async def aclose(self) -> None:
        self._owner.open -= 1
        assert isinstance(self._inner, httpx.AsyncByteStream)
        await self._inner.aclose()


class Counting(httpx.BaseTransport, httpx.AsyncBaseTransport):
    """Real HTTP transport that counts responses still open."""

    def __init__(self) -> None:
        self.open = 0
        self.sync = httpx.HTTPTransport()
        self.async_ = httpx.AsyncHTTPTransport()

    def _wrap(self, response: httpx.Response) -> httpx.Response:
        self.open += 1
        assert isinstance(response.stream, (httpx.SyncByteStream, httpx.AsyncByteStream))
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_Stream(response.stream, self),
            extensions=response.extensions,
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self._wrap(self.sync.handle_request(request))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return self._wrap(await self.async_.handle_async_request(request))

    def close(self) -> None:
        self.sync.close()

    async def aclose(self) -> None:
        await self.async_.aclose()


@pytest.fixture
def tool() -> Iterator[tuple[ToolApp, str]]:
    """The scripted tool app served on loopback."""
    app = ToolApp()
    with serve(app) as url:
        yield app, url


async def test_cancel_during_retry_wait(tool: tuple[ToolApp, str]) -> None:
    """Cancelling a task asleep between retries closes everything; the client stays usable."""
    app, url = tool
    step = make_step(tool="busy")
    app.faults["busy"] = Faults(prelude=[(409, {"Retry-After": "5"})] * 3)
    waiting = asyncio.Event()

    def hook(event: object) -> None:
        if isinstance(event, RetryEvent):
            waiting.set()

    transport = Counting()
    async with (
        httpx.AsyncClient(transport=transport) as client,
        AsyncToolInvoker(
            url, client=client, retry=SLOW_WAITS, route_template="/tools/{tool}", hooks=[hook]
        ) as invoker,
    ):
        task = asyncio.create_task(invoker.invoke(step))
        await asyncio.wait_for(waiting.wait(), timeout=10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert transport.open == 0
        app.faults["busy"].prelude.clear()
        result = await invoker.invoke(step)
        assert result.status_code == 200
        assert transport.open == 0
    assert app.executions == {step.idempotency_key: 1}


async def test_cancel_during_request_then_resend_is_safe(tool: tuple[ToolApp, str]) -> None:
    """Cancelling mid-request leaves nothing open; resending the key later gives the one outcome."""
    app, url = tool
    step = make_step(tool="slowpoke")
    app.faults["slowpoke"] = Faults(delay=0.5)
    transport = Counting()
    async with (
        httpx.AsyncClient(transport=transport) as client,
        AsyncToolInvoker(
            url, client=client, retry=FAST_RETRY, route_template="/tools/{tool}", hooks=()
        ) as invoker,
    ):
        task = asyncio.create_task(invoker.invoke(step))
        assert await asyncio.to_thread(app.request_seen.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert transport.open == 0
        policy = FAST_RETRY.replace(max_attempts=100, max_retry_after=0.05)
        async with AsyncToolInvoker(
            url, client=client, retry=policy, route_template="/tools/{tool}", hooks=()
        ) as again:
            result = await again.invoke(step)
    assert result.replayed
    assert app.executions == {step.idempotency_key: 1}
    assert transport.open == 0


def test_keyboard_interrupt_during_wait(tool: tuple[ToolApp, str]) -> None:
    """A KeyboardInterrupt while waiting to retry propagates and leaves no response open."""
    app, url = tool
    step = make_step(tool="busy")
    app.faults["busy"] = Faults(prelude=[(503, {"Retry-After": "0"})])
    seen = Recorder()

    def interrupt(event: object) -> None:
        seen(event)  # type: ignore[arg-type]
        if isinstance(event, RetryEvent):
            raise KeyboardInterrupt

    transport = Counting()
    with (
        httpx.Client(transport=transport) as client,
        ToolInvoker(
            url, client=client, retry=FAST_RETRY, route_template="/tools/{tool}", hooks=[interrupt]
        ) as invoker,
    ):
        with pytest.raises(KeyboardInterrupt):
            invoker.invoke(step)
        assert transport.open == 0
        assert len(seen.retries()) == 1
    assert app.executions == {}
