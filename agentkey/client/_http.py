"""One request sent and its answer read: the drivers' ``send_sync`` and ``send_async``.

The wire is split by job: ``_clients`` builds agentkey's own clients, ``_httpx2`` bridges a
user's httpx2 client, ``_decode`` reads a body within its limits, ``_translate`` turns
httpx errors into failures, and ``_deadline`` keeps a sync request's deadline at the
socket. Only public interfaces of httpx and httpcore are used.

Each request carries the call's deadline, on the clock of the flow that yielded it (its
driver passes that clock): the time left is read once, on that clock, and from there
measured on the monotonic clock the sockets run on. Every timeout is cut to it, the body
read stops when it passes (a server dripping one byte at a time never resets it), and a
sync request's socket operations end by it (``_deadline``); the async driver cancels the
whole exchange.

httpx builds the request of any redirect it receives inside ``send``, even one it does
not follow, and a ``Location`` it cannot parse (``data:,x``, a bad host) escapes as a raw
error. The clients agentkey builds keep the ``Location`` out of httpx's way; with a user's
client, that error is turned into the same typed failure (:func:`_bad_location`).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, nullcontext
from typing import Any

import anyio
import httpx

from .._clock import SYSTEM, Clock, real_deadline
from ._clients import MADE, Made, foreign
from ._deadline import DEADLINE_PASSED, REDIRECTS, Watchdog, deadline_scope, seconds_left
from ._decode import ACCEPT_ENCODING, Body
from ._effects import Failure, FailureKind, Outgoing, Received
from ._httpx2 import adapt, lib_of
from ._policies import DEFAULT_MAX_RESPONSE_BYTES  # the invoker's option default, defined there
from ._protocol import BAD_LOCATION
from ._translate import failed

__all__ = [
    "Auth",
    "ReadTimeout",
    "Request",
    "Response",
    "Timeout",
    "send_async",
    "send_sync",
]

Auth = httpx.Auth
Timeout = httpx.Timeout
Request = httpx.Request
Response = httpx.Response
ReadTimeout = httpx.ReadTimeout


def _cut(lib: Any, timeout: httpx.Timeout, left: float | None) -> httpx.Timeout:
    """``timeout`` (as ``lib``'s Timeout) with every part cut to the ``left`` seconds."""
    timeout_type: type[httpx.Timeout] = lib.Timeout
    c, r, w, p = timeout.connect, timeout.read, timeout.write, timeout.pool
    if isinstance(timeout, timeout_type) and (
        left is None
        or (
            (c is not None and r is not None and w is not None and p is not None)
            and max(c, r, w, p) <= left
        )
    ):
        return timeout  # nothing to cut (the common case: a deadline far past each timeout)

    def part(value: float | None) -> float | None:
        return value if left is None else left if value is None else min(value, left)

    return timeout_type(
        connect=part(timeout.connect),
        read=part(timeout.read),
        write=part(timeout.write),
        pool=part(timeout.pool),
    )


_URLS: dict[str, httpx.URL] = {}  # parsed once: the same tool URLs come back on every call
_MAX_URLS = 512


def _url(lib: Any, url: str) -> httpx.URL | str:
    """``url`` parsed as an ``httpx.URL`` (cached), so httpx does not parse it on every send.

    A URL httpx cannot parse raises here, as it would in ``build_request``. URLs are
    immutable: a cached one is shared safely. Another library's client gets the string.
    """
    if lib is not httpx:
        return url
    parsed = _URLS.get(url)
    if parsed is None:
        parsed = httpx.URL(url)
        if len(_URLS) >= _MAX_URLS:  # poll URLs vary: start over rather than grow
            _URLS.clear()
        _URLS[url] = parsed
    return parsed


def _request(
    lib: Any,
    client: httpx.Client | httpx.AsyncClient,
    out: Outgoing,
    timeout: httpx.Timeout | None,
    left: float | None,
) -> httpx.Request:
    chosen = _cut(lib, timeout if timeout is not None else client.timeout, left)
    headers = [*out.headers, ("Accept-Encoding", ACCEPT_ENCODING)]
    url = _url(lib, out.url)
    if out.same_origin:
        return client.build_request(
            out.method, url, headers=headers, content=out.content, timeout=chosen
        )
    # Another origin: built bare so no client default header (Authorization!) or cookie leaks.
    request_type: type[httpx.Request] = lib.Request
    return request_type(
        out.method,
        url,
        headers=headers,
        content=out.content,
        extensions={"timeout": chosen.as_dict()},
    )


def _build(
    lib: Any,
    client: httpx.Client | httpx.AsyncClient,
    out: Outgoing,
    timeout: httpx.Timeout | None,
    deadline: float | None,
) -> httpx.Request | Failure:
    """The request, or why it cannot be sent: a URL from the tool that httpx cannot parse."""
    left = seconds_left(deadline)
    if left is not None and left <= 0:
        return Failure(FailureKind.NOT_SENT, "the call's deadline passed before the request")
    try:
        return _request(lib, client, out, timeout, left)
    except (lib.InvalidURL, lib.UnsupportedProtocol, ValueError, UnicodeError):
        return Failure(FailureKind.UNSENDABLE, "a URL httpx cannot parse")


def _target(client: Any, out: Outgoing, poll_client: Any) -> tuple[Any, Any, Made | None]:
    """The client that sends ``out``, its library, and how agentkey built it (if it did).

    A request to another origin (a poll of an allowed status origin) goes through the
    user's ``poll_client`` when given, else through a client without a cookie jar.
    """
    if not out.same_origin:
        client = foreign(client) if poll_client is None else poll_client
    return client, lib_of(client), MADE.get(client)


def _sending(lib: Any, auth: httpx.Auth | None, out: Outgoing) -> dict[str, Any]:
    """``send``'s options: auth only to the tool's origin, no redirect followed, streamed."""
    return {
        "auth": adapt(lib, auth) if out.same_origin else None,
        "follow_redirects": False,
        "stream": True,
    }


def _bad_location(made: Made | None, watchdog: Watchdog | None) -> Failure | None:
    """An InvalidURL or IDNA error out of ``send`` as a Failure, when it is about a Location.

    The request itself was built before ``send``, so with a user's client the only URL
    httpx parses there is a redirect's ``Location`` (unless the trace saw a head that is
    no redirect). agentkey's own clients never let httpx see a ``Location``: None, so
    the caller re-raises.
    """
    status = None if watchdog is None else watchdog.status
    if made is None and status in (None, *REDIRECTS):
        return Failure(FailureKind.UNSENDABLE, BAD_LOCATION)
    return None


def send_sync(
    client: httpx.Client,
    out: Outgoing,
    *,
    auth: httpx.Auth | None,
    timeout: httpx.Timeout | None,
    max_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    clock: Clock = SYSTEM,
    poll_client: Any = None,
) -> Received:
    """Send ``out`` and read the answer, up to ``max_bytes``; the response is always closed.

    ``clock`` is the one ``out.deadline`` is on: the clock of the flow that yielded it.
    ``poll_client`` sends requests to another origin (the invoker's ``poll_client=``).
    """
    # The time left is read once, on the clock the flow measured its deadline on, so a flow
    # on a test's fake clock and the request it sends agree on how long is left.
    deadline = real_deadline(clock, out.deadline)
    target, lib, made = _target(client, out, poll_client)
    request = _build(lib, target, out, timeout, deadline)
    if isinstance(request, Failure):
        return request
    # A transport agentkey did not build (a user's client, an environment proxy) is watched
    # through httpcore's trace extension instead of keeping the deadline at each socket call.
    watchdog = None if made is not None and made.exact else Watchdog(deadline, request.extensions)
    try:
        with deadline_scope(deadline):
            # Auth and redirects are explicit, so a user client's own auth never applies and
            # no redirect is followed behind our back. Another origin's request goes through
            # a client without a cookie jar (``_foreign``): this one's jar ignores ports, so
            # a poll origin on the same host could plant cookies the tool then receives.
            response = target.send(request, **_sending(lib, auth, out))
            try:
                body = Body(response, max_bytes, deadline)
                if body.pending and body.result is None:
                    for raw in response.iter_raw():
                        if body.feed(raw):
                            break
                # Disarmed before the response is closed: once closed, its connection may go
                # back to the pool and serve another request, whose socket this alarm must
                # never shut.
                if watchdog is not None and watchdog.stop():
                    # The shut socket looks like a normal end to a read-until-close body:
                    # what was read may be cut short, so it is never taken as the answer.
                    return Failure(FailureKind.IN_DOUBT, DEADLINE_PASSED)
                return body.finish()
            finally:
                response.close()  # also on KeyboardInterrupt
    except lib.RequestError as exc:
        return failed(exc, lib, deadline, watchdog is not None and watchdog.redirected)
    except (lib.InvalidURL, UnicodeError):
        failure = _bad_location(made, watchdog)
        if failure is None:
            raise
        return failure
    finally:
        if watchdog is not None:
            watchdog.stop()


if sys.version_info >= (3, 11):
    #: The whole exchange within ``seconds`` (None: unbounded), else TimeoutError. asyncio's
    #: own, a third of ``anyio.fail_after``'s CPU (5 µs against 15 µs a call), which it
    #: replaces where it exists; AsyncToolInvoker runs on asyncio.
    _bounded = asyncio.timeout
else:

    @asynccontextmanager
    async def _bounded(seconds: float | None) -> AsyncIterator[None]:
        """Python 3.10 has no ``asyncio.timeout``: anyio's cancel scope bounds the exchange."""
        with anyio.fail_after(seconds) if seconds is not None else nullcontext():
            yield


async def send_async(
    client: httpx.AsyncClient,
    out: Outgoing,
    *,
    auth: httpx.Auth | None,
    timeout: httpx.Timeout | None,  # noqa: ASYNC109 - httpx per-phase timeouts; the call's deadline is out.deadline
    max_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    clock: Clock = SYSTEM,
    poll_client: Any = None,
) -> Received:
    """Send ``out`` and read the answer, up to ``max_bytes``; the response is always closed.

    ``clock`` is the one ``out.deadline`` is on: the clock of the flow that yielded it.
    ``poll_client`` sends requests to another origin (the invoker's ``poll_client=``).
    """
    # The time left is read once, on the clock the flow measured its deadline on, so a flow
    # on a test's fake clock and the request it sends agree on how long is left.
    deadline = real_deadline(clock, out.deadline)
    target, lib, made = _target(client, out, poll_client)
    request = _build(lib, target, out, timeout, deadline)
    if isinstance(request, Failure):
        return request
    left = seconds_left(deadline)
    try:
        async with _bounded(None if left is None else max(0.0, left)):
            response = await target.send(request, **_sending(lib, auth, out))
            try:
                body = Body(response, max_bytes, deadline)
                if body.pending and body.result is None:
                    async for raw in response.aiter_raw():
                        if body.feed(raw):
                            break
                return body.finish()
            finally:
                if not response.is_closed:  # a body read to its end was closed by httpx
                    with anyio.CancelScope(shield=True):
                        await response.aclose()
    except TimeoutError:
        return Failure(FailureKind.IN_DOUBT, DEADLINE_PASSED)
    except lib.RequestError as exc:
        return failed(exc, lib, deadline, redirected=False)
    except (lib.InvalidURL, UnicodeError):
        failure = _bad_location(made, None)
        if failure is None:
            raise
        return failure
