"""The one module that touches httpx: clients, requests, and the translation of its errors.

A user's client may also come from ``httpx2``, the fork with the same API: the
drivers build requests, timeouts and errors from the module the client belongs
to (see :func:`_lib`), and hand an ``httpx.Auth`` such as a token provider to
an httpx2 client through a bridge. httpx2 is never imported here: a user's
httpx2 client has already loaded it.

Only public interfaces of httpx and httpcore are used. Three hostile-server
defences live here, because only here are bytes read:

- **Bounded decoding.** Bodies are read raw and decoded by agentkey, never by httpx,
  so a compressed answer can never inflate past ``max_response_bytes`` in memory.
  One ``gzip`` or ``deflate`` coding is decoded; stacked (``gzip, gzip``) or unknown
  codings are refused unread.
- **The caller's deadline.** Each request carries the call's deadline, on the clock
  of the flow that yielded it (its driver passes that clock): the time left is read
  once, on that clock, and from there measured on the monotonic clock the sockets
  run on. Every timeout is cut to it, the body read stops when it passes (a server
  dripping one byte at a time never resets it), and a sync request's socket
  operations end by it (``_deadline``); the async driver cancels the whole exchange.
- **Redirects httpx never parses.** httpx builds the request of any redirect it
  receives inside ``send``, even one it does not follow, and a ``Location`` it cannot
  parse (``data:,x``, a bad host) escapes as a raw error. The clients agentkey builds
  move a redirect's ``Location`` out of httpx's way with a response event hook; the
  core reads it from there. With a user's client, an error httpx raises on it is
  turned into the same typed failure.

Requests to another origin (polls of an allowed status origin, token requests) go
through a client agentkey builds without a cookie jar, so that origin's cookies
never reach the tool.
"""

from __future__ import annotations

import abc
import http.cookiejar
import math
import ssl
import sys
import time
import urllib.request
import weakref
import zlib
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import anyio
import httpx

from ._deadline import REDIRECTS, DeadlineTransport, Watchdog, deadline_scope
from ._effects import Answer, Failure, FailureKind, Outgoing, Received
from ._exceptions import ConfigurationError
from ._net import secret_forms
from ._policy import DEFAULT_MAX_RESPONSE_BYTES  # the invoker's option default, defined there
from ._protocol import BAD_LOCATION

__all__ = [
    "ACCEPT_ENCODING",
    "DEFAULT_MAX_RESPONSE_BYTES",
    "DEFAULT_TIMEOUT",
    "AsyncClient",
    "Auth",
    "Client",
    "Outgoing",
    "ReadTimeout",
    "Request",
    "Response",
    "Timeout",
    "adapt_auth",
    "asgi_client",
    "make_async_client",
    "make_client",
    "make_max_response_bytes",
    "make_timeout",
    "send_async",
    "send_sync",
    "translate",
]

Auth = httpx.Auth
Timeout = httpx.Timeout
Request = httpx.Request
Response = httpx.Response
ReadTimeout = httpx.ReadTimeout

#: connect 5 s, read 30 s, write 30 s, pool 5 s.
DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=30.0, write=30.0, pool=5.0)


#: The content codings agentkey decodes itself (with a size limit); it asks for no other.
ACCEPT_ENCODING = "gzip, deflate"

_DEADLINE = "the call's deadline passed before the answer was read"


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
_PARKED = "agentkey.location"


def _park(response: httpx.Response) -> None:
    """Move a redirect's ``Location`` where httpx does not look, so ``send`` never parses it.

    httpx builds the request of every redirect it receives, followed or not, and a
    ``Location`` it cannot parse raises from ``send``. agentkey follows no redirect
    itself and judges every ``Location`` in the core, so it takes the header out of
    httpx's sight (a response event hook runs first) and reads it back in ``_Body``.
    """
    if response.status_code in REDIRECTS and "location" in response.headers:
        response.extensions[_PARKED] = response.headers["location"]
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
class _Made:
    """How agentkey built a client (clients it did not build have no entry)."""

    timeout: httpx.Timeout | None
    verify: ssl.SSLContext | bool
    cookies: bool  # False: no cookie jar, so it sends any origin's requests itself
    exact: bool  # every socket operation keeps the deadline (DeadlineTransport, no proxy)


_MADE: weakref.WeakKeyDictionary[Any, _Made] = weakref.WeakKeyDictionary()
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
    _MADE[client] = _Made(timeout, verify, cookies, exact)
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
    _MADE[client] = _Made(timeout, verify, cookies, exact=True)
    return client


def asgi_client(app: Any) -> httpx.AsyncClient:
    """An AsyncClient that calls the ASGI ``app`` in-process: no socket, no server."""
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), event_hooks={"response": [_apark]}
    )
    _MADE[client] = _Made(None, True, cookies=True, exact=True)
    return client


def _foreign(client: Any) -> Any:
    """The client for requests to another origin: one with no cookie jar.

    A client agentkey built without a jar serves them itself (it keeps its settings).
    For any other client, a companion is built once: agentkey's own settings, with
    the timeout and certificate verification of a client agentkey built. A user's
    client lends it nothing: its jar would keep that origin's cookies, and httpx
    offers no public way to share its transport.
    """
    made = _MADE.get(client)
    if made is not None and not made.cookies:
        return client
    companion = _FOREIGN.get(client)
    if companion is None:
        timeout, verify = (made.timeout, made.verify) if made is not None else (None, True)
        factory = make_async_client if isinstance(client, AsyncClient) else make_client
        companion = factory(timeout, verify=verify, pooled=False, cookies=False)
        _FOREIGN[client] = companion
    return companion


def _fork() -> Any:
    return sys.modules.get("httpx2")  # loaded by whoever built an httpx2 client; never here


def fork_async_client(headers: dict[str, str], connect: float, read: float) -> Any:
    """An ``httpx2.AsyncClient``, for an SDK whose transports speak httpx2 (MCP's).

    That SDK has loaded httpx2 already; without it this is a configuration error.
    """
    lib = _fork()
    if lib is None:
        raise ConfigurationError("httpx2 is not loaded: the SDK that needs it imports it first")
    return lib.AsyncClient(headers=headers, timeout=lib.Timeout(connect, read=read))


if TYPE_CHECKING:
    Client = httpx.Client
    AsyncClient = httpx.AsyncClient
else:

    class Client(abc.ABC):  # noqa: B024 - a virtual base: isinstance only
        """``isinstance(c, Client)``: c is an ``httpx.Client`` or an ``httpx2.Client``."""

        @classmethod
        def __subclasshook__(cls, other: type) -> bool:
            fork = _fork()
            return issubclass(other, httpx.Client) or (
                fork is not None and issubclass(other, fork.Client)
            )

    class AsyncClient(abc.ABC):  # noqa: B024 - a virtual base: isinstance only
        """``isinstance(c, AsyncClient)``: an ``httpx.AsyncClient`` or an ``httpx2.AsyncClient``."""

        @classmethod
        def __subclasshook__(cls, other: type) -> bool:
            fork = _fork()
            return issubclass(other, httpx.AsyncClient) or (
                fork is not None and issubclass(other, fork.AsyncClient)
            )


def _lib(client: object) -> Any:
    """The module ``client`` comes from: httpx, or its fork httpx2 (the same API)."""
    if isinstance(client, (httpx.Client, httpx.AsyncClient)):
        return httpx
    fork = _fork()
    if fork is not None and isinstance(client, (fork.Client, fork.AsyncClient)):
        return fork
    raise ConfigurationError(
        f"expected an httpx or httpx2 client, got {type(client).__name__}"
    )  # pragma: no cover - the invoker checks its client= first


@cache
def _bridge_class(lib: Any) -> Any:
    class Bridge(lib.Auth):  # type: ignore[misc]
        """An ``httpx.Auth`` (a token provider) as an Auth of ``lib``.

        Both libraries drive an auth flow the same way, a generator that yields
        requests and receives responses, so the flows are handed through as they are.
        """

        def __init__(self, inner: httpx.Auth) -> None:
            self.inner = inner
            self.requires_request_body = inner.requires_request_body
            self.requires_response_body = inner.requires_response_body

        def sync_auth_flow(self, request: Any) -> Any:
            return self.inner.sync_auth_flow(request)

        def async_auth_flow(self, request: Any) -> Any:
            return self.inner.async_auth_flow(request)

    return Bridge


def adapt_auth(auth: httpx.Auth | None, client: Client | AsyncClient) -> Any:
    """``auth`` as an Auth that ``client``'s library (httpx or httpx2) accepts."""
    return _adapt(_lib(client), auth)


def _adapt(lib: Any, auth: httpx.Auth | None) -> Any:
    if auth is None or lib is httpx or isinstance(auth, lib.Auth):
        return auth
    return _bridge_class(lib)(auth)


def _left(deadline: float | None) -> float | None:
    """Seconds left before ``deadline`` (on ``time.monotonic()``, the sockets' clock)."""
    return None if deadline is None else deadline - time.monotonic()


def _at_socket(out: Outgoing, clock: Callable[[], float]) -> float | None:
    """``out``'s deadline (on ``clock``, the flow's) as a deadline on the sockets' clock.

    The time left is read once, on the clock the flow measured its deadline on, so a
    flow on a test's fake clock and the request it sends agree on how long is left.
    """
    if out.deadline is None or clock is time.monotonic:
        return out.deadline
    return time.monotonic() + (out.deadline - clock())


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


# --- reading a body: raw bytes, decoded here with a limit ------------------------------------


class _Inflate:
    """zlib decoding that never yields more than it is allowed (``max_length``)."""

    def __init__(self, coding: str) -> None:
        self._raw_fallback = coding == "deflate"  # servers send zlib-wrapped or raw deflate
        wbits = zlib.MAX_WBITS | 16 if coding in ("gzip", "x-gzip") else zlib.MAX_WBITS
        self._z = zlib.decompressobj(wbits)
        self._started = False

    def decode(self, data: bytes, budget: int) -> list[bytes] | None:
        """The decoded pieces of ``data``; None once more than ``budget`` bytes came out."""
        try:
            return self._decode(data, budget)
        except zlib.error:
            if self._started or not self._raw_fallback:
                raise
            self._raw_fallback, self._z = False, zlib.decompressobj(-zlib.MAX_WBITS)
            return self._decode(data, budget)

    def _decode(self, data: bytes, budget: int) -> list[bytes] | None:
        pieces = []
        while data and not self._z.eof:
            piece = self._z.decompress(data, budget + 1)
            self._started = True
            budget -= len(piece)
            if budget < 0:
                return None
            pieces.append(piece)
            data = self._z.unconsumed_tail
        return pieces

    def flush(self, budget: int) -> list[bytes] | None:
        piece = self._z.flush(budget + 1)
        return None if len(piece) > budget else [piece]


class _Identity:
    def decode(self, data: bytes, budget: int) -> list[bytes] | None:
        return None if len(data) > budget else [data]

    def flush(self, budget: int) -> list[bytes] | None:
        return []


_IDENTITY = _Identity()  # stateless: shared


class _Body:
    """One answer's body, fed raw chunks: bounded in size, in codings and in time."""

    def __init__(self, response: httpx.Response, limit: int, deadline: float | None) -> None:
        self._response, self._limit, self._deadline = response, limit, deadline
        # Read once: both the checks below and the Answer use them (keys in lowercase).
        self._headers = {k.lower(): v for k, v in response.headers.items()}
        parked = response.extensions.get(_PARKED)
        if isinstance(parked, str):
            self._headers["location"] = parked
        self._chunks: list[bytes] = []
        self._size = 0
        self.result: Received | None = None
        self._decoder: _Inflate | _Identity = _IDENTITY
        #: True while raw chunks must still be read from the network (and fed).
        self.pending = not response.is_stream_consumed
        if not self.pending:  # built in memory (a MockTransport answer): decoded already
            self.feed(response.content)
            return
        codings = [
            c.strip().lower()
            for c in self._headers.get("content-encoding", "").split(",")
            if c.strip() and c.strip().lower() != "identity"
        ]
        if len(codings) > 1:
            self.result = self._answer(b"", unreadable=f"stacked content codings {codings!r}")
        elif codings and codings[0] not in ("gzip", "x-gzip", "deflate"):
            self.result = self._answer(b"", unreadable=f"the content coding {codings[0][:40]!r}")
        elif codings:
            self._decoder = _Inflate(codings[0])
        else:
            declared = self._headers.get("content-length", "")
            if declared.isdigit() and len(declared) < 20 and int(declared) > limit:
                self.result = self._answer(b"", oversize=True)

    def _answer(self, content: bytes, *, oversize: bool = False, unreadable: str = "") -> Answer:
        url = str(self._response.request.url)
        return Answer(
            self._response.status_code,
            self._headers,
            content,
            url,
            oversize=oversize,
            unreadable=unreadable or None,
            sent_secrets=_sent_secrets(self._response),
        )

    def _take(self, pieces: list[bytes] | None) -> bool:
        if pieces is None:
            self.result = self._answer(b"", oversize=True)
            return True
        self._chunks += pieces
        self._size += sum(map(len, pieces))
        return False

    def feed(self, raw: bytes) -> bool:
        """Take one raw chunk; True when reading must stop (``result`` is then set)."""
        left = _left(self._deadline)
        if left is not None and left <= 0:
            self.result = Failure(FailureKind.AMBIGUOUS, _DEADLINE)
            return True
        try:
            return self._take(self._decoder.decode(raw, self._limit - self._size))
        except zlib.error:
            self.result = Failure(FailureKind.AMBIGUOUS, "DecodingError")
            return True

    def finish(self) -> Received:
        if self.result is None:
            try:
                self._take(self._decoder.flush(self._limit - self._size))
            except zlib.error:
                self.result = Failure(FailureKind.AMBIGUOUS, "DecodingError")
        if self.result is None:
            self.result = self._answer(b"".join(self._chunks))
        return self.result


#: Request headers whose values are never credentials.
_PLAIN_HEADERS = frozenset(
    {
        b"accept",
        b"accept-encoding",
        b"connection",
        b"content-length",
        b"content-type",
        b"host",
        b"idempotency-key",  # the key: messages show it as shown_key, the reason as <key>
        b"transfer-encoding",
        b"user-agent",
    }
)
_CREDENTIAL_HEADERS = frozenset({b"authorization", b"proxy-authorization", b"cookie"})
_SHORTEST_HEADER_SECRET = 8  # a shorter value of another header (X-Tenant: t1) is kept


def _sent_secrets(response: httpx.Response) -> tuple[str, ...]:
    """The credentials the requests behind ``response`` carried, longest first.

    The requests: the one answered, and any an auth flow sent before it (a 401's).
    ``Authorization``, ``Proxy-Authorization`` and ``Cookie`` count whole and in parts
    (the token after the scheme, each cookie's value); any other header a user or a
    client default set counts from 8 characters (API keys travel there).
    """
    found: set[str] = set()
    for sent in (*response.history, response):
        for raw_name, raw_value in sent.request.headers.raw:
            name = raw_name.lower()
            if name in _PLAIN_HEADERS:
                continue
            value = raw_value.decode("latin-1").strip()
            if name in _CREDENTIAL_HEADERS:
                found.add(value)
                if name == b"cookie":
                    found.update(c.partition("=")[2].strip() for c in value.split(";"))
                else:
                    found.add(value.partition(" ")[2].strip())
            elif len(value) >= _SHORTEST_HEADER_SECRET:
                found.add(value)
    return secret_forms(found)


def translate(exc: httpx.RequestError, lib: Any = httpx) -> Failure:
    """The one place httpx (or httpx2, ``lib``) errors become the core's categories."""
    if isinstance(exc, (lib.ConnectError, lib.ConnectTimeout, lib.PoolTimeout)):
        return Failure(FailureKind.NOT_SENT, type(exc).__name__)
    if isinstance(exc, (lib.UnsupportedProtocol, lib.LocalProtocolError, lib.InvalidURL)):
        # Not ``{exc}`` nor ``from exc``: h11 quotes the offending header value, which can be
        # a bearer token or an API key, and a traceback prints the whole cause chain.
        raise ConfigurationError(
            f"the request could not be built or sent ({type(exc).__name__}); check base_url, "
            "the route, and that headers and tokens hold only visible ASCII characters"
        ) from None
    # ReadTimeout, WriteTimeout, ReadError, WriteError, RemoteProtocolError, ProxyError,
    # DecodingError: the request may have reached the tool and run.
    return Failure(FailureKind.AMBIGUOUS, type(exc).__name__)


def _failed(exc: httpx.RequestError, lib: Any, deadline: float | None, redirected: bool) -> Failure:
    if isinstance(exc, lib.RemoteProtocolError) and (
        redirected or isinstance(exc.__context__, lib.InvalidURL)
    ):
        # A user's client: httpx parsed the Location of a redirect it does not follow, and
        # failed. The trace saw the redirect's head read whole; without a trace (a mock or
        # ASGI transport), httpx raised it while handling the Location's InvalidURL.
        return Failure(FailureKind.UNSENDABLE, BAD_LOCATION)
    failure = translate(exc, lib)
    left = _left(deadline)
    if left is not None and left <= 0.001:  # the deadline, not the server, ended it
        return Failure(failure.kind, f"{_DEADLINE} ({failure.description})")
    return failure


def _build(
    lib: Any,
    client: httpx.Client | httpx.AsyncClient,
    out: Outgoing,
    timeout: httpx.Timeout | None,
    deadline: float | None,
) -> httpx.Request | Failure:
    """The request, or why it cannot be sent: a URL from the tool that httpx cannot parse."""
    left = _left(deadline)
    if left is not None and left <= 0:
        return Failure(FailureKind.NOT_SENT, "the call's deadline passed before the request")
    try:
        return _request(lib, client, out, timeout, left)
    except (lib.InvalidURL, lib.UnsupportedProtocol, ValueError, UnicodeError):
        return Failure(FailureKind.UNSENDABLE, "a URL httpx cannot parse")


def _target(client: Any, out: Outgoing) -> tuple[Any, Any, _Made | None]:
    """The client that sends ``out``, its library, and how agentkey built it (if it did)."""
    target = client if out.same_origin else _foreign(client)
    return target, _lib(target), _MADE.get(target)


def _sending(lib: Any, auth: httpx.Auth | None, out: Outgoing) -> dict[str, Any]:
    """``send``'s options: auth only to the tool's origin, no redirect followed, streamed."""
    return {
        "auth": _adapt(lib, auth) if out.same_origin else None,
        "follow_redirects": False,
        "stream": True,
    }


def _bad_location(made: _Made | None, watchdog: Watchdog | None) -> Failure | None:
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
    clock: Callable[[], float] = time.monotonic,
) -> Received:
    """Send ``out`` and read the answer, up to ``max_bytes``; the response is always closed.

    ``clock`` is the one ``out.deadline`` is on: the clock of the flow that yielded it.
    """
    deadline = _at_socket(out, clock)
    target, lib, made = _target(client, out)
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
                body = _Body(response, max_bytes, deadline)
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
                    return Failure(FailureKind.AMBIGUOUS, _DEADLINE)
                return body.finish()
            finally:
                response.close()  # also on KeyboardInterrupt
    except lib.RequestError as exc:
        return _failed(exc, lib, deadline, watchdog is not None and watchdog.redirected)
    except (lib.InvalidURL, UnicodeError):
        failure = _bad_location(made, watchdog)
        if failure is None:
            raise
        return failure
    finally:
        if watchdog is not None:
            watchdog.stop()


async def send_async(
    client: httpx.AsyncClient,
    out: Outgoing,
    *,
    auth: httpx.Auth | None,
    timeout: httpx.Timeout | None,  # noqa: ASYNC109 - httpx per-phase timeouts; the call's deadline is out.deadline
    max_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    clock: Callable[[], float] = time.monotonic,
) -> Received:
    """Send ``out`` and read the answer, up to ``max_bytes``; the response is always closed.

    ``clock`` is the one ``out.deadline`` is on: the clock of the flow that yielded it.
    """
    deadline = _at_socket(out, clock)
    target, lib, made = _target(client, out)
    request = _build(lib, target, out, timeout, deadline)
    if isinstance(request, Failure):
        return request
    left = _left(deadline)
    try:
        with anyio.fail_after(max(0.0, left)) if left is not None else nullcontext():
            response = await target.send(request, **_sending(lib, auth, out))
            try:
                body = _Body(response, max_bytes, deadline)
                if body.pending and body.result is None:
                    async for raw in response.aiter_raw():
                        if body.feed(raw):
                            break
                return body.finish()
            finally:
                with anyio.CancelScope(shield=True):
                    await response.aclose()
    except TimeoutError:
        return Failure(FailureKind.AMBIGUOUS, _DEADLINE)
    except lib.RequestError as exc:
        return _failed(exc, lib, deadline, redirected=False)
    except (lib.InvalidURL, UnicodeError):
        failure = _bad_location(made, None)
        if failure is None:
            raise
        return failure
