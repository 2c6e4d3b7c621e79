"""Hostile servers attacking the client, on real loopback sockets: bombs, drips, cookies."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import time
import tracemalloc
import zlib
from collections.abc import MutableMapping
from typing import Any

import httpx
import pytest

from agentkey import (
    AsyncToolInvoker,
    InvokeError,
    OutcomeUnknown,
    PlanSession,
    PollTimeout,
    RetryPolicy,
    StepInProgress,
    TokenRejected,
    ToolError,
    ToolInvoker,
    ToolRejected,
    UnsafeRedirect,
)
from agentkey.auth import StaticToken
from tests._loopback import Handler, raw_server

FAST = RetryPolicy(max_attempts=3, deadline=10.0, initial_backoff=0.01, max_backoff=0.02)


def _zeros_gzip(size: int) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    block = b"\0" * (1 << 20)
    parts = [packer.compress(block) for _ in range(size >> 20)]
    return b"".join(parts) + packer.flush()


INNER = _zeros_gzip(256 << 20)  # 256 MiB of zeros, about 250 KB
STACKED = gzip.compress(INNER, 9)  # a few KB on the wire


def _answer(body: bytes, encoding: str) -> Handler:
    def handler(conn: socket.socket, head: bytes) -> None:
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            + f"Content-Encoding: {encoding}\r\nContent-Length: {len(body)}\r\n".encode()
            + b"Connection: close\r\n\r\n"
            + body
        )

    return handler


def _step() -> Any:
    return PlanSession.new().step(1, "t", {"a": 1})


def _invoke(driver: str, base: str, **options: Any) -> Any:
    options.setdefault("retry", FAST)
    options.setdefault("hooks", ())
    if driver == "sync":
        with ToolInvoker(base, **options) as invoker:
            return invoker.invoke(_step(), path="/t")

    async def main() -> Any:
        async with AsyncToolInvoker(base, **options) as invoker:
            return await invoker.invoke(_step(), path="/t")

    return asyncio.run(main())


@pytest.mark.parametrize("driver", ["sync", "async"])
@pytest.mark.parametrize(
    ("body", "encoding", "words"),
    [(STACKED, "gzip, gzip", "stacked"), (INNER, "gzip", "larger than max_response_bytes")],
    ids=["stacked-gzip", "single-gzip"],
)
def test_gzip_bomb_stays_bounded(driver: str, body: bytes, encoding: str, words: str) -> None:
    """A gzip bomb (stacked or single) is a typed ToolError; memory stays near the cap."""
    assert len(STACKED) < 10_000
    limit = 1 << 20
    with raw_server(_answer(body, encoding)) as base:
        tracemalloc.start()
        try:
            with pytest.raises(ToolError, match=words) as caught:
                _invoke(driver, base, max_response_bytes=limit)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert caught.value.idempotency_key is not None
    assert peak < 2 * limit + len(body) + (4 << 20), f"peak {peak} bytes"


def _drip(from_start: bool) -> Handler:
    def handler(conn: socket.socket, head: bytes) -> None:
        if not from_start:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n")
        payload = b"HTTP/1.1 200 OK\r\n" if from_start else b"{" + b" " * 10_000
        for i in range(600):  # one byte per 100 ms: 60 s, far past any deadline here
            conn.sendall(payload[i % len(payload) : i % len(payload) + 1])
            time.sleep(0.1)

    return handler


@pytest.mark.realtime  # real time: a socket deadline against a dripping peer
@pytest.mark.parametrize("driver", ["sync", "async"])
@pytest.mark.parametrize("from_start", [True, False], ids=["headers-drip", "body-drip"])
def test_deadline_bounds_a_dripping_server(driver: str, from_start: bool) -> None:
    """RetryPolicy(deadline=1) ends a one-byte-per-100-ms answer in time, as OutcomeUnknown."""
    policy = FAST.replace(deadline=1.0)
    with raw_server(_drip(from_start)) as base:
        start = time.monotonic()
        with pytest.raises(OutcomeUnknown, match="may have run") as caught:
            _invoke(driver, base, retry=policy)
        elapsed = time.monotonic() - start
    assert caught.value.idempotency_key is not None
    assert "deadline" in str(caught.value)
    assert elapsed < 1.0 + 1.5, f"took {elapsed:.2f} s"


def _status_planting_a_cookie(heads: list[bytes]) -> Handler:
    """A status URL that answers "succeeded" and sets a cookie; it records each request head."""

    def status(conn: socket.socket, head: bytes) -> None:
        heads.append(head)
        body = b'{"status": "succeeded"}'
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Set-Cookie: planted=evil; Path=/\r\n"
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )

    return status


def _accepting(status_base: str, heads: list[bytes]) -> Handler:
    """The tool: 202 with a status URL on ``status_base``; it records each request head."""

    def tool(conn: socket.socket, head: bytes) -> None:
        heads.append(head)
        conn.sendall(
            b"HTTP/1.1 202 Accepted\r\n"
            + f"Location: {status_base}/ops/1\r\n".encode()
            + b"Content-Length: 0\r\nConnection: close\r\n\r\n"
        )

    return tool


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_poll_origin_cookies_never_reach_the_tool(driver: str) -> None:
    """A cookie set by an allowed poll origin (another port) is never sent to the tool."""
    seen: list[bytes] = []

    with (
        raw_server(_status_planting_a_cookie([])) as poll_base,
        raw_server(_accepting(poll_base, seen)) as base,
    ):
        options: dict[str, Any] = {"allowed_poll_origins": [poll_base], "hooks": ()}
        if driver == "sync":
            with ToolInvoker(base, retry=FAST, **options) as invoker:
                for index in (1, 2):
                    invoker.invoke(PlanSession.new().step(index, "t", {}), path="/t")
        else:

            async def main() -> None:
                async with AsyncToolInvoker(base, retry=FAST, **options) as invoker:
                    for index in (1, 2):
                        await invoker.invoke(PlanSession.new().step(index, "t", {}), path="/t")

            asyncio.run(main())
    assert len(seen) == 2
    assert all(b"planted" not in head for head in seen)


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_foreign_polls_carry_nothing_of_a_user_client(driver: str) -> None:
    """With client=: a poll to an allowed origin omits its defaults; its cookie stays out.

    The user's client has default headers and a cookie; the status origin (another port)
    answers and sets a cookie of its own, which must never land in the user's jar.
    """
    posts: list[bytes] = []
    polls: list[bytes] = []
    defaults: dict[str, Any] = {
        "headers": {"Authorization": "Bearer client-default", "X-Api-Key": "k"},
        "cookies": {"session": "abc"},
    }
    with raw_server(_status_planting_a_cookie(polls)) as status_base:
        options: dict[str, Any] = {"allowed_poll_origins": [status_base], "hooks": ()}
        with raw_server(_accepting(status_base, posts)) as base:
            if driver == "sync":
                with (
                    httpx.Client(**defaults) as client,
                    ToolInvoker(base, client=client, retry=FAST, **options) as inv,
                ):
                    inv.invoke(_step(), path="/t", headers={"X-Tenant": "t1"})
                jar = dict(client.cookies)
            else:

                async def main() -> dict[str, str]:
                    async with httpx.AsyncClient(**defaults) as client:
                        async with AsyncToolInvoker(
                            base, client=client, retry=FAST, **options
                        ) as inv:
                            await inv.invoke(_step(), path="/t", headers={"X-Tenant": "t1"})
                        return dict(client.cookies)

                jar = asyncio.run(main())
    (post,) = posts
    (poll,) = polls
    assert b"x-api-key: k" in post.lower()
    assert b"x-tenant: t1" in post.lower()
    for name in (b"authorization", b"x-api-key", b"cookie", b"idempotency-key", b"x-tenant"):
        assert name + b":" not in poll.lower(), name
    assert jar == {"session": "abc"}  # the status origin's cookie never reached the user's jar


@pytest.mark.realtime  # real time: a socket deadline against a dripping peer
@pytest.mark.parametrize("driver", ["sync", "async"])
def test_deadline_bounds_a_dripping_poll(driver: str) -> None:
    """After a 202, a status URL that drips is cut at the caller's deadline: PollTimeout."""
    drip = _drip(from_start=False)

    def tool(conn: socket.socket, head: bytes) -> None:
        if head.startswith(b"POST"):
            conn.sendall(
                b"HTTP/1.1 202 Accepted\r\nLocation: /ops/1\r\nRetry-After: 0\r\n"
                b"Content-Length: 0\r\nConnection: close\r\n\r\n"
            )
        else:
            drip(conn, head)

    with raw_server(tool) as base:
        start = time.monotonic()
        with pytest.raises(PollTimeout, match="the call's deadline") as caught:
            _invoke(driver, base, retry=FAST.replace(deadline=1.0))
        elapsed = time.monotonic() - start
    assert caught.value.status_url == f"{base}/ops/1"
    assert elapsed < 1.0 + 1.5, f"took {elapsed:.2f} s"


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_locked_retry_after_is_capped_by_the_deadline(driver: str) -> None:
    """423 Locked with Retry-After: 30 (idemkit's in flight) waits only until the deadline."""

    def locked(conn: socket.socket, head: bytes) -> None:
        body = b'{"type": "urn:idemkit:in-progress", "title": "Idempotency key in progress"}'
        conn.sendall(
            b"HTTP/1.1 423 Locked\r\nRetry-After: 30\r\nContent-Type: application/problem+json\r\n"
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )

    policy = FAST.replace(deadline=0.5, max_retry_after=30.0, max_attempts=8)
    with raw_server(locked) as base:
        start = time.monotonic()
        with pytest.raises(StepInProgress, match="in flight \\(423\\)"):
            _invoke(driver, base, retry=policy)
        elapsed = time.monotonic() - start
    assert elapsed < 0.5 + 1.5, f"took {elapsed:.2f} s"


@pytest.mark.realtime  # real time: a socket deadline against a dripping peer
def test_deadline_bounds_a_drip_on_a_reused_connection() -> None:
    """Sync: headers dripping over a kept-alive connection (a retry reuses it) end in time."""
    answered: list[int] = []

    def handler(conn: socket.socket, head: bytes) -> None:
        conn.sendall(
            b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 0\r\nContent-Length: 0\r\n\r\n"
        )
        answered.append(1)
        conn.recv(65536)  # the retry, on the same connection
        for _ in range(100):  # then the status line, one byte per 100 ms
            conn.sendall(b"H")
            time.sleep(0.1)

    policy = FAST.replace(deadline=1.0)
    with raw_server(handler) as base:
        start = time.monotonic()
        with pytest.raises(OutcomeUnknown, match="deadline"):
            # Declared: a 503 to a tool not known to honour keys is not resent (issue 34).
            _invoke("sync", base, retry=policy, honours_keys=True)
        elapsed = time.monotonic() - start
    assert answered == [1], "the retry reused the kept-alive connection"
    assert elapsed < 1.0 + 1.5, f"took {elapsed:.2f} s"


def _poll_now(gets: list[bytes]) -> Handler:
    """202 for the step, then "running" with ``Retry-After: 0`` on every poll (counted)."""

    def handler(conn: socket.socket, head: bytes) -> None:
        if head.startswith(b"POST"):
            conn.sendall(
                b"HTTP/1.1 202 Accepted\r\nLocation: /ops/1\r\nRetry-After: 0\r\n"
                b"Content-Length: 0\r\nConnection: close\r\n\r\n"
            )
            return
        gets.append(head)
        body = b'{"status": "running"}'
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nRetry-After: 0\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )

    return handler


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_retry_after_zero_on_a_status_url_cannot_spin(driver: str) -> None:
    """Polls answering Retry-After: 0 wait PollPolicy.min_interval: a handful in 2 s, not 1000s."""
    gets: list[bytes] = []
    with raw_server(_poll_now(gets)) as base, pytest.raises(PollTimeout):
        _invoke(driver, base, retry=FAST.replace(deadline=2.0))
    assert len(gets) <= 5, f"{len(gets)} polls in 2 s"  # 0.5 s apart at the least


async def _running_app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
    """An in-process tool: 202 for the step, then "running" with Retry-After: 0, at once."""
    accepted = scope["method"] == "POST"
    headers = [(b"retry-after", b"0"), (b"content-type", b"application/json")]
    if accepted:
        headers.append((b"location", b"/ops/1"))
    await send(
        {"type": "http.response.start", "status": 202 if accepted else 200, "headers": headers}
    )
    await send({"type": "http.response.body", "body": b'{"status": "running"}'})


async def test_an_in_process_poll_loop_yields_to_a_callers_timeout() -> None:
    """Through ASGITransport, Retry-After: 0 polls still sleep, so wait_for cancels the call."""
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=_running_app))
    start = time.monotonic()
    retry = RetryPolicy(deadline=5.0)  # without the floor: a PollTimeout after 5 s of spinning
    async with (
        client,
        AsyncToolInvoker("http://tool.test", client=client, hooks=(), retry=retry) as invoker,
    ):
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(invoker.invoke(_step(), path="/t"), 0.3)
    assert time.monotonic() - start < 3.0


TOKEN = "tok-echoed-by-the-tool-0123"
API_KEY = "key-echoed-by-the-tool-4567"


def _echoing_tool(status: int) -> Handler:
    """Answers ``status`` with a body that quotes the request's Authorization and X-Api-Key."""

    def handler(conn: socket.socket, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")[1:]
        headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)}
        said = f"{headers.get('authorization')} with key {headers.get('x-api-key')} refused"
        body = json.dumps(
            {"error": "invalid_token", "detail": said, "echo": {said: [said, {"x": said}]}}
        ).encode()
        conn.sendall(
            f"HTTP/1.1 {status} No\r\nContent-Type: application/json\r\n".encode()
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )

    return handler


@pytest.mark.parametrize("driver", ["sync", "async"])
@pytest.mark.parametrize(
    ("status", "error"), [(401, TokenRejected), (403, ToolRejected)], ids=["401", "403"]
)
def test_credentials_a_tool_echoes_never_reach_the_error(
    driver: str, status: int, error: type[InvokeError]
) -> None:
    """A tool quoting the bearer token and an API key back: message, reason and body are clean."""
    with raw_server(_echoing_tool(status)) as base, pytest.raises(error) as caught:
        _invoke_with(driver, base, auth=StaticToken(TOKEN), headers={"X-Api-Key": API_KEY})
    exc = caught.value
    seen = " ".join([str(exc), repr(exc), str(exc.reason), json.dumps(exc.body)])
    assert TOKEN not in seen
    assert API_KEY not in seen
    assert "<redacted> with key <redacted> refused" in str(exc)


def _invoke_with(driver: str, base: str, *, headers: dict[str, str], **options: Any) -> Any:
    options.update(retry=FAST, hooks=())
    if driver == "sync":
        with ToolInvoker(base, **options) as invoker:
            return invoker.invoke(_step(), path="/t", headers=headers)

    async def main() -> Any:
        async with AsyncToolInvoker(base, **options) as invoker:
            return await invoker.invoke(_step(), path="/t", headers=headers)

    return asyncio.run(main())


HOSTILE_LOCATIONS = {
    "data": b"data:,x",
    "scheme-without-slashes": b"https:evil.example/x",
    "non-ascii-host": "https://ex\u00e4mple.test/x".encode(),
    "empty-a-label": b"https://xn--/x",
    "unclosed-ipv6": b"http://[::1",
    "bad-port": b"http://tool.test:99x/",
}


def _redirecting(status: int, location: bytes, *, after_accept: bool = False) -> Handler:
    """Answers ``status`` with ``location``; with ``after_accept``, a 202 first, then polls."""

    def handler(conn: socket.socket, head: bytes) -> None:
        if after_accept and head.startswith(b"POST"):
            conn.sendall(
                b"HTTP/1.1 202 Accepted\r\nLocation: /ops/1\r\nRetry-After: 0\r\n"
                b"Content-Length: 0\r\nConnection: close\r\n\r\n"
            )
            return
        conn.sendall(
            f"HTTP/1.1 {status} Elsewhere\r\n".encode()
            + b"Location: "
            + location
            + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )

    return handler


@pytest.mark.parametrize("driver", ["sync", "async"])
@pytest.mark.parametrize("own_client", [False, True], ids=["agentkey-client", "user-client"])
@pytest.mark.parametrize("status", [303, 307])
@pytest.mark.parametrize("location", list(HOSTILE_LOCATIONS), ids=str)
def test_a_hostile_location_is_a_typed_error_with_the_key(
    driver: str, own_client: bool, status: int, location: str
) -> None:
    """A Location httpx cannot parse, on a 303 or 307, is a ToolError keeping the key, never raw.

    httpx builds the redirect request inside ``send`` even when it does not follow it; with
    agentkey's own client it never sees the Location, with a user's client its error is caught.
    """
    handler = _redirecting(status, HOSTILE_LOCATIONS[location])
    with raw_server(handler) as base, pytest.raises((ToolError, UnsafeRedirect)) as caught:
        _invoke_client(driver, base, own_client)
    error = caught.value
    assert error.idempotency_key is not None
    if isinstance(error, UnsafeRedirect):  # parsed, but another origin: refused as such
        assert "another origin" in str(error)
        return
    assert "Location" in str(error)
    assert "http(s) URLs" in str(error)  # says what the tool must send instead


@pytest.mark.parametrize("driver", ["sync", "async"])
@pytest.mark.parametrize("own_client", [False, True], ids=["agentkey-client", "user-client"])
def test_a_hostile_location_on_a_poll_says_the_step_was_accepted(
    driver: str, own_client: bool
) -> None:
    """A poll answering 303 with ``data:,x``: ToolError saying the step was accepted (202)."""
    handler = _redirecting(303, b"data:,x", after_accept=True)
    with raw_server(handler) as base, pytest.raises(ToolError, match="accepted") as caught:
        _invoke_client(driver, base, own_client)
    assert caught.value.idempotency_key is not None


def _invoke_client(driver: str, base: str, own_client: bool) -> Any:
    """Invoke through an invoker's own client, or through a plain httpx client it was given."""
    options: dict[str, Any] = {"retry": FAST, "hooks": ()}
    if driver == "sync":
        client = httpx.Client() if own_client else None
        try:
            with ToolInvoker(base, client=client, **options) as invoker:
                return invoker.invoke(_step(), path="/t")
        finally:
            if client is not None:
                client.close()

    async def main() -> Any:
        client = httpx.AsyncClient() if own_client else None
        try:
            async with AsyncToolInvoker(base, client=client, **options) as invoker:
                return await invoker.invoke(_step(), path="/t")
        finally:
            if client is not None:
                await client.aclose()

    return asyncio.run(main())
