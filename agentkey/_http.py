"""The one module that touches httpx: clients, requests, and the translation of its errors.

A user's client may also come from ``httpx2``, the fork with the same API: the
drivers build requests, timeouts and errors from the module the client belongs
to (see :func:`_lib`), and hand an ``httpx.Auth`` such as a token provider to
an httpx2 client through a bridge. httpx2 is never imported here: a user's
httpx2 client has already loaded it.

Two hostile-server defences live here, because only here are bytes read:

- **Bounded decoding.** Bodies are read raw and decoded by agentkey, never by httpx,
  so a compressed answer can never inflate past ``max_response_bytes`` in memory.
  One ``gzip`` or ``deflate`` coding is decoded; stacked (``gzip, gzip``) or unknown
  codings are refused unread.
- **The caller's deadline.** Each request carries the call's deadline: every timeout
  is cut to the time left, the body read stops when it passes (a server dripping one
  byte at a time never resets it), and the sync driver shuts the connection's
  socket when it passes (the async driver cancels the whole exchange).
"""

from __future__ import annotations

import abc
import math
import os
import socket
import ssl
import sys
import threading
import time
import types
import zlib
from collections.abc import Mapping
from contextlib import nullcontext, suppress
from functools import cache
from typing import TYPE_CHECKING, Any

import anyio
import httpx

from ._exceptions import ConfigurationError
from ._flow import Outgoing
from ._net import secret_forms
from ._protocol import BAD_LOCATION, Answer, Failure, FailureKind, Reply

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


#: The largest answer body (after content decoding) an invoker reads into memory: 32 MiB.
DEFAULT_MAX_RESPONSE_BYTES = 32 * 1024 * 1024

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


def _options(
    timeout: httpx.Timeout | None, verify: ssl.SSLContext | bool, pooled: bool
) -> dict[str, Any]:
    return {
        "timeout": timeout or DEFAULT_TIMEOUT,
        "follow_redirects": False,
        "verify": _default_ssl() if verify is True else verify,
        # An unpooled client keeps no connection open between requests, so it needs no
        # closing to free a socket and is not tied to the event loop of its last request.
        **({} if pooled else {"limits": httpx.Limits(max_keepalive_connections=0)}),
    }


def make_client(
    timeout: httpx.Timeout | None, *, verify: ssl.SSLContext | bool = True, pooled: bool = True
) -> httpx.Client:
    """A client agentkey owns: no redirects followed, the shared SSL context when verifying."""
    return httpx.Client(**_options(timeout, verify, pooled))


def make_async_client(
    timeout: httpx.Timeout | None, *, verify: ssl.SSLContext | bool = True, pooled: bool = True
) -> httpx.AsyncClient:
    """The async form of :func:`make_client`."""
    return httpx.AsyncClient(**_options(timeout, verify, pooled))


def asgi_client(app: Any) -> httpx.AsyncClient:
    """An AsyncClient that calls the ASGI ``app`` in-process: no socket, no server."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app))


def _fork() -> Any:
    return sys.modules.get("httpx2")  # loaded by whoever built an httpx2 client; never here


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
    return None if deadline is None else deadline - time.monotonic()


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
        self._chunks: list[bytes] = []
        self._size = 0
        self.result: Reply | None = None
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

    def finish(self) -> Reply:
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


def _failed(exc: httpx.RequestError, lib: Any, deadline: float | None) -> Failure:
    if isinstance(exc, lib.RemoteProtocolError) and str(exc).startswith("Invalid URL in loc"):
        # httpx builds the redirect request even when it does not follow it, and raises.
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
) -> httpx.Request | Failure:
    """The request, or why it cannot be sent: a URL from the tool that httpx cannot parse."""
    left = _left(out.deadline)
    if left is not None and left <= 0:
        return Failure(FailureKind.NOT_SENT, "the call's deadline passed before the request")
    try:
        return _request(lib, client, out, timeout, left)
    except (lib.InvalidURL, lib.UnsupportedProtocol, ValueError, UnicodeError):
        return Failure(FailureKind.UNSENDABLE, "a URL httpx cannot parse")


class _Alarms:
    """One daemon thread that shuts the sockets of sync requests whose deadline passed.

    It holds only requests in flight (a lock and a dict entry each, cheaper than a
    timer thread per request) and sleeps until the nearest deadline. Arming a
    request wakes it only when that request's deadline comes before the one it
    sleeps until: otherwise it finds the request when it wakes (a request's
    deadline is usually later than those already in flight), so a request costs
    no thread switch.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._live: dict[_Watchdog, socket.socket] = {}
        self._thread: threading.Thread | None = None
        self._wake_at = math.inf  # when the thread wakes next (inf: nothing to watch)

    def arm(self, dog: _Watchdog, sock: socket.socket) -> None:
        with self._cond:
            self._live[dog] = sock
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="agentkey-deadline")
                self._thread.daemon = True
                self._thread.start()
            elif dog.deadline < self._wake_at:
                self._wake_at = dog.deadline  # one notify per earlier deadline, not per arm
                self._cond.notify()

    def disarm(self, dog: _Watchdog) -> bool:
        """Stop watching ``dog``; True if its deadline already shut its socket."""
        with self._cond:
            self._live.pop(dog, None)
            return dog.fired

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for dog in [d for d in self._live if d.deadline <= now]:
                    dog.fired = True
                    with suppress(OSError):  # already closed: nothing left to stop
                        self._live.pop(dog).shutdown(socket.SHUT_RDWR)
                nearest = min((d.deadline for d in self._live), default=math.inf)
                self._wake_at = nearest
                self._cond.wait(None if nearest == math.inf else nearest - now)


_ALARMS = _Alarms()
if hasattr(os, "register_at_fork"):  # a forked child has no alarm thread: start afresh
    os.register_at_fork(after_in_child=_ALARMS._reset)


class _Watchdog:
    """Shuts the connection's socket at the deadline, so no blocking read outlives it.

    Armed from httpcore's ``trace`` extension: with the stream it reports when a
    connection opens, or, for a connection reused from the pool (httpcore reports
    no stream then), with the stream of the connection that starts sending. Once
    armed it leaves the request's extensions, so httpcore's later phases call no hook.
    """

    def __init__(self, deadline: float, extensions: dict[str, Any]) -> None:
        self.deadline = deadline
        self.fired = False  # the deadline shut the socket (set by the alarm thread)
        self._armed = False  # the alarm thread watches the socket (set and read by the sender)
        self._extensions = extensions
        extensions["trace"] = self.trace

    def trace(self, name: str, info: Mapping[str, Any]) -> None:
        if name == "connection.connect_tcp.complete":
            stream = info.get("return_value")
        elif name.endswith(".send_request_headers.started") and not self._armed:
            stream = _sending_stream()
        else:
            return
        sock = stream.get_extra_info("socket") if stream is not None else None
        if isinstance(sock, socket.socket) and not self._armed:
            self._armed = True
            # httpcore reads the hook afresh for every phase: without it, none is called.
            if self._extensions.get("trace") == self.trace:
                del self._extensions["trace"]
            _ALARMS.arm(self, sock)

    def stop(self) -> bool:
        """Disarm; True if the deadline shut the socket (what was read may be cut short)."""
        if self._armed:
            self._armed = False
            self.fired = _ALARMS.disarm(self)
        return self.fired


def _sending_stream() -> Any:
    """The network stream of the httpcore connection whose send called the trace hook.

    httpcore calls the hook from the connection's ``handle_request``; its trace
    carries the request only, so the stream is read from that frame. Should
    httpcore change shape, nothing is found and the watchdog stays unarmed for
    this request (its timeouts are still cut to the deadline).
    """
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return None
        stream = getattr(frame.f_locals.get("self"), "_network_stream", None)
        if stream is not None and callable(getattr(stream, "get_extra_info", None)):
            return stream
        frame = frame.f_back
    return None


def send_sync(
    client: httpx.Client,
    out: Outgoing,
    *,
    auth: httpx.Auth | None,
    timeout: httpx.Timeout | None,
    max_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
) -> Reply:
    """Send ``out`` and read the answer, up to ``max_bytes``; the response is always closed."""
    lib = _lib(client)
    request = _build(lib, client, out, timeout)
    if isinstance(request, Failure):
        return request
    watchdog = _Watchdog(out.deadline, request.extensions) if out.deadline is not None else None
    try:
        # Auth and redirects are explicit, so a user client's own auth never applies and
        # no redirect is followed behind our back. Another origin's answer goes straight
        # through the client's transport (its proxies and mounts): client.send would put
        # its Set-Cookie in the jar, and the jar ignores ports, so a poll origin on the same
        # host could plant cookies the tool then receives.
        if out.same_origin:
            response = client.send(
                request, auth=_adapt(lib, auth), follow_redirects=False, stream=True
            )
        else:
            response = client._transport_for_url(request.url).handle_request(request)
            response.request = request  # what client.send does, minus the cookie jar
        try:
            body = _Body(response, max_bytes, out.deadline)
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
        return _failed(exc, lib, out.deadline)
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
) -> Reply:
    """Send ``out`` and read the answer, up to ``max_bytes``; the response is always closed."""
    lib = _lib(client)
    request = _build(lib, client, out, timeout)
    if isinstance(request, Failure):
        return request
    left = _left(out.deadline)
    try:
        with anyio.fail_after(max(0.0, left)) if left is not None else nullcontext():
            if out.same_origin:
                response = await client.send(
                    request, auth=_adapt(lib, auth), follow_redirects=False, stream=True
                )
            else:  # past the cookie jar, as in send_sync
                transport = client._transport_for_url(request.url)
                response = await transport.handle_async_request(request)
                response.request = request
            try:
                body = _Body(response, max_bytes, out.deadline)
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
        return _failed(exc, lib, out.deadline)
