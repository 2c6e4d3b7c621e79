"""The one module that touches httpx: clients, requests, and the translation of its errors.

Moving to another httpx-compatible client (the ``httpx2`` fork) changes this file only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import httpx

from ._exceptions import ConfigurationError
from ._protocol import Answer, Failure, FailureKind, Reply

__all__ = [
    "DEFAULT_MAX_RESPONSE_BYTES",
    "DEFAULT_TIMEOUT",
    "AsyncClient",
    "Auth",
    "Client",
    "Outgoing",
    "Timeout",
    "make_async_client",
    "make_client",
    "make_max_response_bytes",
    "make_timeout",
    "send_async",
    "send_sync",
    "translate",
]

Client = httpx.Client
AsyncClient = httpx.AsyncClient
Auth = httpx.Auth
Timeout = httpx.Timeout

#: connect 5 s, read 30 s, write 30 s, pool 5 s.
DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=30.0, write=30.0, pool=5.0)


#: The largest answer body (after content decoding) an invoker reads into memory: 32 MiB.
DEFAULT_MAX_RESPONSE_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One request the protocol flow wants sent.

    ``same_origin`` requests go through the invoker's auth and the client's
    defaults; any other request is built bare: no auth, no client headers or
    cookies, no Idempotency-Key.
    """

    method: str
    url: str
    # Kept out of repr: user headers carry API keys, and error trackers record frame locals.
    headers: tuple[tuple[str, str], ...] = field(repr=False)
    content: bytes | None
    same_origin: bool


def make_timeout(timeout: float | httpx.Timeout | None) -> httpx.Timeout | None:
    """Validate the invoker's ``timeout=`` option."""
    if timeout is None or isinstance(timeout, httpx.Timeout):
        return timeout
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise ConfigurationError(
            "timeout must be a positive, finite number of seconds or an httpx.Timeout, "
            f"got {timeout!r}"
        )
    return httpx.Timeout(float(timeout), connect=min(5.0, float(timeout)))


def make_max_response_bytes(limit: object) -> int:
    """Validate the invoker's ``max_response_bytes=`` option."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigurationError(f"max_response_bytes must be an int >= 1 (bytes), got {limit!r}")
    return limit


def make_client(timeout: httpx.Timeout | None) -> httpx.Client:
    return httpx.Client(timeout=timeout or DEFAULT_TIMEOUT, follow_redirects=False)


def make_async_client(timeout: httpx.Timeout | None) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=timeout or DEFAULT_TIMEOUT, follow_redirects=False)


def _request(
    client: httpx.Client | httpx.AsyncClient, out: Outgoing, timeout: httpx.Timeout | None
) -> httpx.Request:
    if out.same_origin:
        return client.build_request(
            out.method,
            out.url,
            headers=list(out.headers),
            content=out.content,
            timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
        )
    # Another origin: built bare so no client default header (Authorization!) or cookie leaks.
    chosen = timeout if timeout is not None else client.timeout
    return httpx.Request(
        out.method,
        out.url,
        headers=list(out.headers),
        content=out.content,
        extensions={"timeout": chosen.as_dict()},
    )


def _answer(response: httpx.Response, content: bytes, oversize: bool) -> Answer:
    headers: Mapping[str, str] = {k.lower(): v for k, v in response.headers.items()}
    url = str(response.request.url)
    return Answer(response.status_code, headers, content, url, oversize=oversize)


def _declared_too_big(response: httpx.Response, limit: int) -> bool:
    declared = response.headers.get("content-length", "")
    return (
        declared.isdigit() and int(declared) > limit and "content-encoding" not in response.headers
    )


def _read_sync(response: httpx.Response, limit: int) -> Answer:
    """Read at most ``limit`` decoded bytes of ``response``; it is closed on every path."""
    try:
        if _declared_too_big(response, limit):
            return _answer(response, b"", True)
        chunks, size = [], 0
        for chunk in response.iter_bytes():
            size += len(chunk)
            if size > limit:  # decoded size: a small gzip bomb is caught too
                return _answer(response, b"", True)
            chunks.append(chunk)
        return _answer(response, b"".join(chunks), False)
    finally:
        response.close()


async def _read_async(response: httpx.Response, limit: int) -> Answer:
    """Read at most ``limit`` decoded bytes of ``response``; it is closed on every path."""
    try:
        if _declared_too_big(response, limit):
            return _answer(response, b"", True)
        chunks, size = [], 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > limit:
                return _answer(response, b"", True)
            chunks.append(chunk)
        return _answer(response, b"".join(chunks), False)
    finally:
        await response.aclose()


def translate(exc: httpx.RequestError) -> Failure:
    """The one place httpx errors become the core's categories."""
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)):
        return Failure(FailureKind.NOT_SENT, type(exc).__name__)
    if isinstance(exc, (httpx.UnsupportedProtocol, httpx.LocalProtocolError, httpx.InvalidURL)):
        # Not ``{exc}`` nor ``from exc``: h11 quotes the offending header value, which can be
        # a bearer token or an API key, and a traceback prints the whole cause chain.
        raise ConfigurationError(
            f"the request could not be built or sent ({type(exc).__name__}); check base_url, "
            "the route, and that headers and tokens hold only visible ASCII characters"
        ) from None
    # ReadTimeout, WriteTimeout, ReadError, WriteError, RemoteProtocolError, ProxyError,
    # DecodingError: the request may have reached the tool and run.
    return Failure(FailureKind.AMBIGUOUS, type(exc).__name__)


def send_sync(
    client: httpx.Client,
    out: Outgoing,
    *,
    auth: httpx.Auth | None,
    timeout: httpx.Timeout | None,
    max_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
) -> Reply:
    """Send ``out`` and read the answer, up to ``max_bytes``; the response is always closed."""
    request = _request(client, out, timeout)
    try:
        # Auth and redirects are explicit, so a user client's own auth never applies and
        # no redirect is followed behind our back. _read_sync closes the response, also on
        # KeyboardInterrupt.
        response = client.send(
            request, auth=auth if out.same_origin else None, follow_redirects=False, stream=True
        )
        return _read_sync(response, max_bytes)
    except httpx.RequestError as exc:
        return translate(exc)


async def send_async(
    client: httpx.AsyncClient,
    out: Outgoing,
    *,
    auth: httpx.Auth | None,
    timeout: httpx.Timeout | None,
    max_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
) -> Reply:
    """Send ``out`` and read the answer, up to ``max_bytes``; the response is always closed."""
    request = _request(client, out, timeout)
    try:
        response = await client.send(
            request, auth=auth if out.same_origin else None, follow_redirects=False, stream=True
        )
        return await _read_async(response, max_bytes)
    except httpx.RequestError as exc:
        return translate(exc)
