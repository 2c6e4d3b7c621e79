"""A user's httpx2 client (the fork with httpx's API) carries agentkey's calls end to end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import pytest

from agentkey import AsyncToolInvoker, PlanSession, ToolInvoker
from agentkey.auth import StaticToken
from agentkey.client._effects import Outgoing
from agentkey.client._http import send_async, send_sync
from agentkey.client._protocol import Failure, FailureKind
from tests._loopback import free_port, serve

httpx2 = pytest.importorskip("httpx2", reason="httpx2 is not installed (`nox -s httpx2` adds it)")
pytest.importorskip("starlette", reason="the tool server needs agentkey[server]")

from agentkey.testing import example_app  # noqa: E402 - after the skips above

pytestmark = pytest.mark.httpx2

Message = MutableMapping[str, Any]


class _Recorder:
    """ASGI wrapper that records the Authorization header of every request."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.authorization: list[bytes | None] = []

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/tools/"):
            self.authorization.append(dict(scope["headers"]).get(b"authorization"))
        await self.app(scope, receive, send)


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_invoke_through_an_httpx2_client(kind: str) -> None:
    """An httpx2 client and a token provider run a step once; the same step again is replayed."""
    app = example_app(work_seconds=0.0, shared_key_space=False)
    recorder = _Recorder(app)
    step = PlanSession.new().step(0, "charge", {"amount": 5, "currency": "EUR"})
    options: dict[str, Any] = {"auth": StaticToken("tok-httpx2"), "route_template": "/tools/{tool}"}
    with serve(recorder) as url:
        if kind == "sync":

            def run() -> list[Any]:
                with httpx2.Client() as client, ToolInvoker(url, client=client, **options) as inv:
                    return [inv.invoke(step), inv.invoke(step)]

            first, again = await asyncio.to_thread(run)
        else:
            async with (
                httpx2.AsyncClient() as client,
                AsyncToolInvoker(url, client=client, **options) as inv,
            ):
                first, again = [await inv.invoke(step), await inv.invoke(step)]
    assert first.status_code == 201
    assert not first.replayed
    assert again.replayed
    assert again.body == first.body
    assert app.state.executions["charge"] == 1
    assert recorder.authorization == [b"Bearer tok-httpx2"] * 2


async def test_httpx2_errors_take_the_core_categories() -> None:
    """A refused connection through httpx2 is NOT_SENT, as through httpx (its errors translate)."""
    out = Outgoing("POST", f"http://127.0.0.1:{free_port()}/x", (), b"{}", same_origin=True)
    with httpx2.Client() as client:
        failure = send_sync(client, out, auth=None, timeout=None)
    async with httpx2.AsyncClient() as async_client:
        async_failure = await send_async(async_client, out, auth=None, timeout=None)
    for reply in (failure, async_failure):
        assert isinstance(reply, Failure)
        assert reply.kind is FailureKind.NOT_SENT
        assert reply.description == "ConnectError"


@pytest.mark.realtime  # real time: a socket deadline against a dripping peer
@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_the_deadline_cuts_a_drip_through_httpx2(kind: str) -> None:
    """The call's deadline ends a one-byte-per-100-ms answer read through an httpx2 client."""
    from tests.wire._drip import dripping_app

    with serve(dripping_app(seconds=600.0)) as url:  # longer than the test's timeout
        deadline = time.monotonic() + 0.5  # real time: the socket's deadline
        out = Outgoing("POST", url + "/x", (), b"{}", same_origin=True, deadline=deadline)
        if kind == "sync":
            with httpx2.Client() as client:
                reply = await asyncio.to_thread(send_sync, client, out, auth=None, timeout=None)
        else:
            async with httpx2.AsyncClient() as async_client:
                reply = await send_async(async_client, out, auth=None, timeout=None)
    assert isinstance(reply, Failure)
    assert reply.kind is FailureKind.IN_DOUBT
    assert "deadline" in reply.description
