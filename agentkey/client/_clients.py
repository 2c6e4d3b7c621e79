"""The httpx clients agentkey builds: no redirect followed, deadlines at the socket.

A redirect's ``Location`` is moved out of httpx's way by a response hook (:func:`_park`), so
httpx never parses it; the body reader (``_decode``) reads it back. Requests to another
origin (polls of an allowed status origin, token requests) go through a client without a
cookie jar (:func:`foreign`), so that origin's cookies never reach the tool.
"""

from __future__ import annotations

import http.cookiejar
import math
import ssl
import urllib.request
import weakref
from dataclasses import dataclass
from functools import cache
from typing import Any

import httpx

from .._exceptions import ConfigurationError
from ._deadline import REDIRECTS, DeadlineTransport
from ._httpx2 import AsyncClient

__all__ = [
    "DEFAULT_TIMEOUT",
    "MADE",
    "PARKED",
    "Made",
    "asgi_client",
    "foreign",
    "make_async_client",
    "make_client",
    "make_max_response_bytes",
    "make_timeout",
]

#: connect 5 s, read 30 s, write 30 s, pool 5 s.
DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=30.0, write=30.0, pool=5.0)


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


@cache
def _default_ssl() -> ssl.SSLContext:
    """One verifying SSL context for every client agentkey makes (each costs ~30 ms to build)."""
    return httpx.create_ssl_context()


#: Where a response hook of agentkey's clients keeps a redirect's Location (see ``_park``).
PARKED = "agentkey.location"


def _park(response: httpx.Response) -> None:
    """Move a redirect's ``Location`` where httpx does not look, so ``send`` never parses it.

    httpx builds the request of every redirect it receives, followed or not, and a
    ``Location`` it cannot parse raises from ``send``. agentkey follows no redirect
    itself and judges every ``Location`` in the core, so it takes the header out of
    httpx's sight (a response event hook runs first) and reads it back in ``_Body``.
    """
    if response.status_code in REDIRECTS and "location" in response.headers:
        response.extensions[PARKED] = response.headers["location"]
        del response.headers["location"]


async def _apark(response: httpx.Response) -> None:
    _park(response)


class _NoCookies(http.cookiejar.CookiePolicy):
    """A cookie policy that stores and returns no cookie at all."""

    netscape = True
    rfc2965 = False
    hide_cookie2 = True

    def set_ok(self, cookie: http.cookiejar.Cookie, request: urllib.request.Request) -> bool:
        return False

    def return_ok(self, cookie: http.cookiejar.Cookie, request: urllib.request.Request) -> bool:
        return False

    def domain_return_ok(self, domain: str, request: urllib.request.Request) -> bool:
        return False

    def path_return_ok(self, path: str, request: urllib.request.Request) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class Made:
    """How agentkey built a client (clients it did not build have no entry)."""

    timeout: httpx.Timeout | None
    verify: ssl.SSLContext | bool
    cookies: bool  # False: no cookie jar, so it sends any origin's requests itself
    exact: bool  # every socket operation keeps the deadline (DeadlineTransport, no proxy)


MADE: weakref.WeakKeyDictionary[Any, Made] = weakref.WeakKeyDictionary()
_FOREIGN: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _options(
    timeout: httpx.Timeout | None, verify: ssl.SSLContext | bool, pooled: bool, cookies: bool
) -> dict[str, Any]:
    return {
        "timeout": timeout or DEFAULT_TIMEOUT,
        "follow_redirects": False,
        "verify": _context(verify),
        # An unpooled client keeps no connection open between requests, so it needs no
        # closing to free a socket and is not tied to the event loop of its last request.
        "limits": httpx.Limits() if pooled else httpx.Limits(max_keepalive_connections=0),
        **({} if cookies else {"cookies": http.cookiejar.CookieJar(_NoCookies())}),
    }


def _context(verify: ssl.SSLContext | bool) -> ssl.SSLContext:
    if verify is True:
        return _default_ssl()
    if verify is False:
        return httpx.create_ssl_context(verify=False)
    return verify


def make_client(
    timeout: httpx.Timeout | None,
    *,
    verify: ssl.SSLContext | bool = True,
    pooled: bool = True,
    cookies: bool = True,
) -> httpx.Client:
    """A client agentkey owns: no redirects followed, the shared SSL context when verifying.

    Its transport keeps each request's deadline at the socket (``_deadline``). A proxy
    from the environment is mounted by httpx with its own transport; requests through
    it are watched by the fallback alarm instead. ``cookies=False``: no cookie jar.
    """
    options = _options(timeout, verify, pooled, cookies)
    client = httpx.Client(
        **options,
        transport=DeadlineTransport(verify=options["verify"], limits=options["limits"]),
        event_hooks={"response": [_park]},
    )
    exact = not urllib.request.getproxies()  # what httpx mounts proxies from
    MADE[client] = Made(timeout, verify, cookies, exact)
    return client


def make_async_client(
    timeout: httpx.Timeout | None,
    *,
    verify: ssl.SSLContext | bool = True,
    pooled: bool = True,
    cookies: bool = True,
) -> httpx.AsyncClient:
    """The async form of :func:`make_client` (the deadline cancels the whole exchange)."""
    client = httpx.AsyncClient(
        **_options(timeout, verify, pooled, cookies), event_hooks={"response": [_apark]}
    )
    MADE[client] = Made(timeout, verify, cookies, exact=True)
    return client


def asgi_client(app: Any) -> httpx.AsyncClient:
    """An AsyncClient that calls the ASGI ``app`` in-process: no socket, no server."""
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), event_hooks={"response": [_apark]}
    )
    MADE[client] = Made(None, True, cookies=True, exact=True)
    return client


def foreign(client: Any) -> Any:
    """The client for requests to another origin: one with no cookie jar.

    A client agentkey built without a jar serves them itself (it keeps its settings).
    For any other client, a companion is built once: agentkey's own settings, with
    the timeout and certificate verification of a client agentkey built. A user's
    client lends it nothing: its jar would keep that origin's cookies, and httpx
    offers no public way to share its transport.
    """
    made = MADE.get(client)
    if made is not None and not made.cookies:
        return client
    companion = _FOREIGN.get(client)
    if companion is None:
        timeout, verify = (made.timeout, made.verify) if made is not None else (None, True)
        factory = make_async_client if isinstance(client, AsyncClient) else make_client
        companion = factory(timeout, verify=verify, pooled=False, cookies=False)
        _FOREIGN[client] = companion
    return companion
