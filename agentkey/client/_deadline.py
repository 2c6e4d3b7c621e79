"""The call's deadline at the socket, for sync requests, through public extension points only.

A sync read blocks its thread, so only the socket can end it: a server dripping
one byte at a time resets every read timeout, and the call's deadline would pass.
Two mechanisms, each on a documented interface:

- **The clients agentkey builds** use :class:`DeadlineTransport`: an httpx
  transport over an ``httpcore.ConnectionPool`` whose network backend (httpcore's
  ``NetworkBackend`` interface) hands out streams that cut every read, write,
  connect and TLS handshake to the time left before the deadline of the request
  being sent (:func:`deadline_scope`), and raise httpcore's own timeout once it
  has passed. Connections reused from the pool are bounded the same way.
- **Any other client** (a user's ``client=``, or a proxy httpx mounts from the
  environment) is watched through httpcore's ``trace`` request extension: when a
  connection opens, its socket is handed to one alarm thread that shuts it at the
  deadline. A connection reused from such a client's pool reports no socket, so
  there only the per-phase timeouts, cut to the deadline when the request starts,
  and the body's per-chunk deadline check apply.
"""

from __future__ import annotations

import math
import os
import socket
import ssl
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from typing import Any

import httpcore
import httpx

__all__ = [
    "DEADLINE_PASSED",
    "REDIRECTS",
    "DeadlineTransport",
    "Watchdog",
    "deadline_scope",
    "seconds_left",
]

#: The statuses for which httpx builds a redirect request (and parses the Location) in ``send``.
REDIRECTS = frozenset({301, 302, 303, 307, 308})

#: Why an exchange ended when the call's deadline, not the server, ended it.
DEADLINE_PASSED = "the call's deadline passed before the answer was read"


def seconds_left(deadline: float | None) -> float | None:
    """Seconds left before ``deadline`` (on the real monotonic clock, the sockets' clock)."""
    return None if deadline is None else deadline - time.monotonic()  # real time: sockets


_DEADLINE: ContextVar[float | None] = ContextVar("agentkey_deadline", default=None)


class deadline_scope:
    """Within it, every socket operation of a :class:`DeadlineTransport` ends by ``deadline``.

    ``deadline`` is on the real monotonic clock. A sync request does all its I/O in the
    calling thread, so the context variable reaches the streams it uses. (A class, not
    a ``@contextmanager`` generator: it runs on every request.)
    """

    __slots__ = ("_deadline", "_token")

    def __init__(self, deadline: float | None) -> None:
        self._deadline = deadline

    def __enter__(self) -> None:
        self._token = _DEADLINE.set(self._deadline)

    def __exit__(self, *exc: object) -> None:
        _DEADLINE.reset(self._token)


def _bounded(timeout: float | None, expired: type[Exception]) -> float | None:
    """``timeout`` cut to the time left before the current deadline; ``expired`` once past."""
    deadline = _DEADLINE.get()
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()  # real time: a socket operation's timeout
    if left <= 0:
        raise expired("the call's deadline passed")
    return left if timeout is None else min(timeout, left)


class _Stream(httpcore.NetworkStream):
    """A network stream whose every blocking operation ends by the current deadline."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _bounded(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _bounded(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        bounded = _bounded(timeout, httpcore.ConnectTimeout)
        return _Stream(self._inner.start_tls(ssl_context, server_hostname, bounded))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    """httpcore's sync backend, its streams bounded by the current deadline."""

    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        bounded = _bounded(timeout, httpcore.ConnectTimeout)
        return _Stream(self._inner.connect_tcp(host, port, bounded, local_address, socket_options))

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:  # pragma: no cover - agentkey opens no unix sockets
        bounded = _bounded(timeout, httpcore.ConnectTimeout)
        return _Stream(self._inner.connect_unix_socket(path, bounded, socket_options))

    def sleep(self, seconds: float) -> None:  # pragma: no cover - httpcore's retries, unused
        self._inner.sleep(seconds)


#: httpcore's errors as httpx's, most specific first (what httpx's own transport does).
_ERRORS: tuple[tuple[type[Exception], type[httpx.TransportError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.ProxyError, httpx.ProxyError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
)


@contextmanager
def _as_httpx() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        for theirs, ours in _ERRORS:
            if isinstance(exc, theirs):
                raise ours(str(exc)) from exc
        raise


class _Body(httpx.SyncByteStream):
    def __init__(self, stream: Iterable[bytes]) -> None:
        self._stream = stream

    def __iter__(self) -> Iterator[bytes]:
        with _as_httpx():
            yield from self._stream

    def close(self) -> None:
        close = getattr(self._stream, "close", None)
        if close is not None:
            close()


class DeadlineTransport(httpx.BaseTransport):
    """An HTTP/1.1 transport whose connections all keep the current :func:`deadline_scope`."""

    def __init__(self, *, verify: ssl.SSLContext, limits: httpx.Limits) -> None:
        self._pool = httpcore.ConnectionPool(
            ssl_context=verify,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=_Backend(),
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.SyncByteStream)
        core = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=request.url.raw_scheme,
                host=request.url.raw_host,
                port=request.url.port,
                target=request.url.raw_path,
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        with _as_httpx():
            response = self._pool.handle_request(core)
        assert isinstance(response.stream, Iterable)
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_Body(response.stream),
            extensions=response.extensions,
        )

    def close(self) -> None:
        self._pool.close()


# --- the fallback: an alarm thread, armed from httpcore's trace extension --------------------


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
        self._live: dict[Watchdog, socket.socket] = {}
        self._thread: threading.Thread | None = None
        self._wake_at = math.inf  # when the thread wakes next (inf: nothing to watch)

    def arm(self, dog: Watchdog, sock: socket.socket) -> None:
        with self._cond:
            self._live[dog] = sock
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="agentkey-deadline")
                self._thread.daemon = True
                self._thread.start()
            elif dog.deadline < self._wake_at:
                self._wake_at = dog.deadline  # one notify per earlier deadline, not per arm
                self._cond.notify()

    def disarm(self, dog: Watchdog) -> bool:
        """Stop watching ``dog``; True if its deadline already shut its socket."""
        with self._cond:
            self._live.pop(dog, None)
            return dog.fired

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()  # real time: the alarm shuts real sockets at deadlines
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


class Watchdog:
    """httpcore's ``trace`` hook on one request through a transport agentkey did not build.

    With a ``deadline``, it shuts the socket of a connection the request opens when
    the deadline passes (httpcore reports the new stream, a public extension), so
    no blocking read outlives it. It also notes the status of the answer's head,
    so a failure of httpx's own processing of a redirect (its ``Location``) can be
    told from a broken answer.
    """

    def __init__(self, deadline: float | None, extensions: dict[str, Any]) -> None:
        self.deadline = math.inf if deadline is None else deadline
        self.fired = False  # the deadline shut the socket (set by the alarm thread)
        self.status: int | None = None  # the status of the answer's head, once read
        self._armed = False  # the alarm thread watches the socket (set and read by the sender)
        self._watch = deadline is not None
        self._extensions = extensions
        extensions["trace"] = self.trace

    def trace(self, name: str, info: Mapping[str, Any]) -> None:
        if name.endswith(".receive_response_headers.complete"):
            head = info.get("return_value")  # (version, status, ...) or (status, headers)
            if isinstance(head, tuple):
                self.status = next((v for v in head if isinstance(v, int)), None)
            # Nothing later matters: httpcore reads the hook afresh for every phase, so
            # without it the body's phases call none.
            if self._extensions.get("trace") == self.trace:
                del self._extensions["trace"]
        elif self._watch and name == "connection.connect_tcp.complete":
            stream = info.get("return_value")
            sock = stream.get_extra_info("socket") if stream is not None else None
            if isinstance(sock, socket.socket) and not self._armed:
                self._armed = True
                _ALARMS.arm(self, sock)

    @property
    def redirected(self) -> bool:
        """The answer's head was a redirect (so httpx went on to parse its Location)."""
        return self.status in REDIRECTS

    def stop(self) -> bool:
        """Disarm; True if the deadline shut the socket (what was read may be cut short)."""
        if self._armed:
            self._armed = False
            self.fired = _ALARMS.disarm(self)
        return self.fired
