"""Polls to an allowed status origin through the user's transport settings (issue 35).

The tool runs on a loopback TCP port; its status URLs name another loopback port, where
nothing listens: that origin is served by a second real server on a Unix socket, which
only a client with ``mounts=`` reaches (no DNS involved). Polls there go through the invoker's
``poll_client=``, bare: none of the user's credentials, cookies or default headers. A poll
that cannot connect says so, with the key's digest and the status origin.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from agentkey import (
    AsyncToolInvoker,
    ConfigurationError,
    PollTimeout,
    RetryPolicy,
    Step,
    ToolInvoker,
    ToolResult,
)
from agentkey._keys import shown_key
from tests._loopback import free_port, serve

from ._support import DRIVERS, FAST_POLL, FAST_RETRY, Bearer, Driver, make_step
from ._toolapp import Faults, ToolApp

#: The status origin: a closed port (connections are refused) that only a mount reaches.
STATUS = f"http://127.0.0.1:{free_port()}"


@contextmanager
def _serve_unix(app: Any, path: str) -> Iterator[None]:
    """Run ``app`` under uvicorn on the Unix socket ``path``, in a thread."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(1000):  # bounded by attempts
        if server.started or not thread.is_alive():
            break
        time.sleep(0.01)
    assert server.started, "uvicorn did not start on the Unix socket"
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[tuple[ToolApp, str, ToolApp, str]]:
    """(tool app, its URL, status app, its Unix socket path): two real servers."""
    tool, status = ToolApp(), ToolApp()
    path = str(tmp_path / "status.sock")
    with serve(tool) as url, _serve_unix(status, path):
        yield tool, url, status, path


def _options(path: str, sync: bool) -> dict[str, Any]:
    """What a user who reaches the status origin through a mount sets on their client."""
    transport = httpx.HTTPTransport(uds=path) if sync else httpx.AsyncHTTPTransport(uds=path)
    return {
        "mounts": {STATUS: transport},
        "headers": {"X-Api-Key": "k-user-secret", "Authorization": "Bearer default-secret"},
        "cookies": {"session": "cookie-secret"},
    }


def _invoke(
    driver: Driver, url: str, step: Step, with_poll_client: bool, path: str, **options: Any
) -> ToolResult:
    """One call from a user whose client (and poll_client) mount the status origin."""
    options.setdefault("retry", FAST_RETRY)
    options.setdefault("polling", FAST_POLL)
    common = {
        "auth": Bearer(),
        "route_template": "/tools/{tool}",
        "allowed_poll_origins": [STATUS],
        **options,
    }
    if driver == "sync":
        with (
            httpx.Client(**_options(path, True)) as client,
            httpx.Client(**_options(path, True), auth=("poll", "pw")) as polls,
        ):
            poll = polls if with_poll_client else None
            with ToolInvoker(url, client=client, poll_client=poll, **common) as invoker:
                return invoker.invoke(step)

    async def main() -> ToolResult:
        async with (
            httpx.AsyncClient(**_options(path, False)) as client,
            httpx.AsyncClient(**_options(path, False), auth=("poll", "pw")) as polls,
        ):
            apoll = polls if with_poll_client else None
            async with AsyncToolInvoker(url, client=client, poll_client=apoll, **common) as inv:
                return await inv.invoke(step)

    return asyncio.run(main())


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_status_origin_behind_the_users_mounts_is_polled_through_poll_client(
    driver: Driver, servers: tuple[ToolApp, str, ToolApp, str]
) -> None:
    """A status origin only a mount reaches is polled through poll_client=, bare."""
    tool, url, status, path = servers
    tool.faults["provision"] = Faults(async_polls=0, status_origin=STATUS)
    status.operations["op1"] = ["running", "succeeded"]
    step = make_step(tool="provision")
    result = _invoke(driver, url, step, True, path)
    assert result.body == {"status": "succeeded", "result": {"id": "op1"}}
    assert result.status_url == f"{STATUS}/operations/op1"
    assert tool.executions == {step.idempotency_key: 1}
    assert [seen.path for seen in status.seen] == ["/operations/op1"] * 2
    for seen in status.seen:
        assert seen.headers["host"] == STATUS.removeprefix("http://")
        for name in ("authorization", "cookie", "x-api-key", "idempotency-key"):
            assert name not in seen.headers, name


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_poll_that_cannot_connect_says_so_with_the_key_and_the_origin(
    driver: Driver, servers: tuple[ToolApp, str, ToolApp, str]
) -> None:
    """Without poll_client=: PollTimeout says it could not connect (key digest, origin)."""
    tool, url, status, path = servers
    tool.faults["provision"] = Faults(async_polls=0, status_origin=STATUS)
    status.operations["op1"] = ["running", "succeeded"]
    short = RetryPolicy(max_attempts=4, deadline=1.0, initial_backoff=0.01, max_backoff=0.05)
    step = make_step(tool="provision")
    with pytest.raises(PollTimeout) as raised:
        _invoke(driver, url, step, False, path, retry=short)
    message = str(raised.value)
    assert raised.value.idempotency_key == step.idempotency_key
    assert shown_key(step.idempotency_key) in message
    assert step.idempotency_key not in message
    assert f"could not connect to {STATUS}" in message
    assert "poll_client=" in message
    assert "deadline passed before the request" not in message
    assert raised.value.status_url == f"{STATUS}/operations/op1"
    assert tool.executions == {step.idempotency_key: 1}
    assert status.seen == []


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_closed_status_port_is_reported_as_not_connecting(
    driver: Driver, servers: tuple[ToolApp, str, ToolApp, str]
) -> None:
    """A closed status port polled until the call's deadline is reported as not connecting."""
    tool, url, _, _ = servers
    closed = f"http://localhost:{free_port()}"
    tool.faults["provision"] = Faults(async_polls=0, status_origin=closed)
    short = RetryPolicy(max_attempts=4, deadline=1.0, initial_backoff=0.01, max_backoff=0.05)
    step = make_step(tool="provision")
    options: dict[str, Any] = {
        "retry": short,
        "polling": FAST_POLL,
        "auth": Bearer(),
        "route_template": "/tools/{tool}",
        "allowed_poll_origins": [closed],
    }

    def call() -> None:
        if driver == "sync":
            with ToolInvoker(url, **options) as invoker:
                invoker.invoke(step)
            return

        async def main() -> None:
            async with AsyncToolInvoker(url, **options) as invoker:
                await invoker.invoke(step)

        asyncio.run(main())

    with pytest.raises(PollTimeout) as raised:
        call()
    message = str(raised.value)
    assert f"could not connect to {closed}" in message
    assert "ConnectError" in message
    assert shown_key(step.idempotency_key) in message


def test_poll_client_must_not_be_the_tools_client() -> None:
    """The same client for both would let the status origin's cookies reach the tool: refused."""
    with httpx.Client() as client, pytest.raises(ConfigurationError, match="client of its own"):
        ToolInvoker(
            "https://tool.test",
            client=client,
            poll_client=client,
            allowed_poll_origins=["https://status.test"],
        )


def test_poll_client_needs_allowed_poll_origins() -> None:
    """poll_client= without an allowed status origin would never be used: refused."""
    with httpx.Client() as polls, pytest.raises(ConfigurationError, match="allowed_poll_origins"):
        ToolInvoker("https://tool.test", poll_client=polls)


async def test_poll_client_must_be_of_the_invokers_kind() -> None:
    """A sync client for an AsyncToolInvoker (or the reverse) is refused at construction."""
    with httpx.Client() as polls, pytest.raises(ConfigurationError, match=r"httpx\.AsyncClient"):
        AsyncToolInvoker(
            "https://tool.test",
            poll_client=polls,  # type: ignore[arg-type]
            allowed_poll_origins=["https://status.test"],
        )
    async with httpx.AsyncClient() as apolls:
        with pytest.raises(ConfigurationError, match=r"httpx\.Client"):
            ToolInvoker(
                "https://tool.test",
                poll_client=apolls,  # type: ignore[arg-type]
                allowed_poll_origins=["https://status.test"],
            )


def test_the_poll_error_names_the_last_answer_not_the_deadline_cut() -> None:
    """A status URL answering 503 until the call's deadline: the error says 'poll answered 503'."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            return httpx.Response(202, headers={"Location": "/operations/op1"})
        return httpx.Response(503)

    short = RetryPolicy(max_attempts=4, deadline=0.3, initial_backoff=0.01, max_backoff=0.05)
    step = make_step(tool="provision")
    with (
        httpx.Client(transport=httpx.MockTransport(handler)) as client,
        ToolInvoker("https://tool.test", client=client, retry=short, polling=FAST_POLL) as inv,
        pytest.raises(PollTimeout) as raised,
    ):
        inv.invoke(step, path="/tools/provision")
    assert "still 'poll answered 503'" in str(raised.value)
    assert "could not connect" not in str(raised.value)
