"""The token provider base: a single flight per credential across threads and coroutines.

Every provider keeps one current token behind a short ``threading.Lock``
(never held during I/O). A caller that finds the token due either joins the
refresh already in flight or becomes its leader:

- a thread leads by refreshing inline; a coroutine leads by starting the
  refresh as a task that it, like every other waiter, awaits through its own
  future, so cancelling any waiter (the leader included) never cancels the
  refresh the others wait on;
- waiters take the refresh's result as it is (they do not re-check expiry
  against a token that was just issued, so a short-lived token cannot cause a
  refresh loop);
- a failure is remembered for ``TokenPolicy.failure_ttl`` seconds, so the
  callers right behind it fail fast;
- a token a tool rejected (401) is renewed at most once per
  ``TokenPolicy.rejection_interval``, so a tool that refuses every token does
  not turn each call into a token request.

Decisions are made once, under the lock, in ``_decide``; the sync and async
paths only wait, send and await. A refresh (``_obtain``, yielding token
requests and store calls) and each token request (``TokenEndpoint.exchange``,
a flow on the client's retry loop) run on the shared drivers of ``_drive``;
the carriers here send through ``_http`` on clients the provider owns (opened
on first use, released by ``close``, so a refresh never builds a new HTTP
client), sleep, and give events to the hooks and lines to the logger.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import threading
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Iterable, Sequence
from types import TracebackType
from typing import Any, TypeVar

from .._clock import Clock, default_clock
from .._exceptions import AuthError, ConfigurationError
from ..client import _clients, _http, _httpx2
from ..client._drive import Handlers, async_carrier, carrier, run_async, run_sync
from ..client._effects import Emit, Outgoing, Sleep
from ..client._net import require_secure
from ._endpoint import MAX_TOKEN_ANSWER_BYTES, Note, TokenEndpoint, TokenFlow, TokenRequest
from ._token import Token, TokenEvent, TokenHook
from ._token_policy import TokenPolicy

__all__ = ["Call", "Obtain", "TokenProvider", "call", "send"]

T = TypeVar("T")
_P = TypeVar("_P", bound="TokenProvider")
_C = TypeVar("_C")

_log = logging.getLogger("agentkey.auth")


class Call:
    """An instruction from ``_obtain``: run ``fn`` (blocking I/O such as a token store)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn


# ``_obtain`` yields token requests and store calls; the driver sends back their results.
Obtain = Generator[TokenRequest | Call, object, Token]


def send(request: TokenRequest) -> Generator[TokenRequest | Call, object, Token]:
    """Yield ``request`` to the driver and return the Token it obtained."""
    result = yield request
    assert isinstance(result, Token)
    return result


def call(fn: Callable[[], T]) -> Generator[TokenRequest | Call, object, T]:
    """Yield ``fn`` to the driver (in a worker thread on the async path); return its result."""
    result = yield Call(fn)
    return result  # type: ignore[return-value]  # the driver sends back fn()'s own result


def _clone(error: AuthError) -> AuthError:
    """A copy of a remembered failure, so threads never share one traceback."""
    clone = copy.copy(error)
    clone.__traceback__ = None
    clone.__cause__ = error.__cause__
    return clone


class _Flight:
    """One refresh in progress; threads wait on an Event, coroutines on their own future."""

    __slots__ = ("_lock", "_waiters", "done", "error", "token")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.done = threading.Event()
        self.token: Token | None = None
        self.error: AuthError | None = None

    def finish(self, token: Token | None, error: AuthError | None) -> None:
        with self._lock:
            self.token, self.error = token, error
            self.done.set()
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            # A loop that closed meanwhile has nobody left to wake; the others must still be.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, future)

    def result(self) -> Token:
        if self.error is not None:
            raise _clone(self.error)
        assert self.token is not None
        return self.token

    def wait_sync(self, timeout: float) -> Token:
        # Real time, whatever the provider's clock: the leader is another thread, refreshing
        # in real time; ``timeout`` only rescues a waiter whose leader can never finish.
        if not self.done.wait(timeout):
            raise AuthError(
                f"a token refresh did not finish within {timeout:g} s; if a synchronous client "
                "shares this provider with an event loop in the same thread, give each its own "
                "provider, otherwise retry the call"
            )
        return self.result()

    async def wait_async(self) -> Token:
        loop = asyncio.get_running_loop()
        with self._lock:
            future: asyncio.Future[None] | None = None
            if not self.done.is_set():
                future = loop.create_future()
                self._waiters.append((loop, future))
        if future is not None:
            await future  # cancelling this waiter cancels only its own future
        return self.result()


def _still_usable(token: Token | None, now: float) -> bool:
    """True when ``token`` will not expire for a while (a tenth of its life, at most 1 s)."""
    if token is None or token.lifetime is None or token.expires_at is None:
        return False
    return token.expires_at - now > min(1.0, 0.1 * token.lifetime)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class TokenProvider(_http.Auth):
    """Base of every agentkey token provider; an ``httpx.Auth`` usable with any httpx client.

    Before each request it makes sure the token has more than the policy's
    leeway left (refreshing once for all concurrent callers), refuses plain
    http to a non-loopback host, and sets ``Authorization: Bearer``. When the
    tool answers 401 and the token it rejected is still the current one, the
    token is refreshed once and the same request (same body, same headers,
    ``Idempotency-Key`` included) is sent again; a second 401 is returned to
    the caller, who raises. Such refreshes are at least
    ``TokenPolicy.rejection_interval`` apart: a 401 sooner than that after the
    last one is returned at once. A 403 never causes a refresh. When an early
    renewal fails while the current token still has a safe margin left, that
    token is used (with a warning) rather than failing the call.

    Token requests go through HTTP clients the provider opens on first use;
    ``close()`` / ``aclose()`` (or ``with`` / ``async with``) release them, and
    a later token request opens new ones. Each hook in ``hooks`` receives a
    :class:`TokenEvent` when a token request starts and ends.

    Token lifetimes, refresh points, remembered failures, the rejection interval,
    each refresh's deadline, the waits between token requests and their jitter all
    run on ``clock`` (an :class:`agentkey.Clock`; default: the system's). Tests pass
    ``agentkey.testing.FakeClock()`` and move it by hand, so a loaded machine never
    expires a short-lived token between two lines of a test.
    """

    requires_request_body = True  # the same request may be sent twice after a 401

    _can_refresh = True

    def __init__(
        self,
        endpoint: TokenEndpoint | None,
        *,
        policy: TokenPolicy,
        hooks: Sequence[TokenHook] | None = None,
        clock: Clock | None = None,
    ) -> None:
        if not isinstance(policy, TokenPolicy):
            raise ConfigurationError(f"policy must be an agentkey.auth.TokenPolicy, got {policy!r}")
        if clock is not None and not isinstance(clock, Clock):
            raise ConfigurationError(
                "clock must be an agentkey.Clock (e.g. agentkey.testing.FakeClock()), or None "
                f"for the system clock; got {clock!r}"
            )
        #: What token times are measured on, waits are slept on and jitter is drawn from.
        self._clock: Clock = clock if clock is not None else default_clock()
        chosen = () if hooks is None else hooks
        if callable(chosen) or not isinstance(chosen, Iterable):
            raise ConfigurationError(
                f"hooks must be a sequence of callables, e.g. hooks=[my_hook], got {hooks!r}"
            )
        self._hooks: tuple[TokenHook, ...] = tuple(chosen)
        if not all(callable(h) for h in self._hooks):
            raise ConfigurationError(f"hooks must be callables taking one event, got {hooks!r}")
        self._endpoint = endpoint
        self._policy = policy
        self._lock = threading.Lock()
        self._token: Token | None = None
        self._flight: _Flight | None = None
        self._failure: tuple[AuthError, float] | None = None
        self._rejected_at: float | None = None  # when a 401 last caused a refresh
        self._tasks: set[asyncio.Task[None]] = set()
        self._client: _httpx2.Client | None = None
        self._async_client: _httpx2.AsyncClient | None = None

    # -- subclasses -----------------------------------------------------------------

    def _obtain(self, current: Token | None) -> Obtain:
        """Yield the token requests (and store calls) that produce a new token."""
        raise NotImplementedError

    # -- public helpers -------------------------------------------------------------

    @property
    def policy(self) -> TokenPolicy:
        """The frozen policy this provider renews tokens with."""
        return self._policy

    def invalidate(self) -> None:
        """Forget the current token and any remembered failure; the next call fetches anew."""
        with self._lock:
            self._token = None
            self._failure = None

    def close(self) -> None:
        """Release the provider's HTTP clients (the token is kept; a refresh reopens them)."""
        with self._lock:
            client, self._client = self._client, None
            self._async_client = None  # unpooled: it holds no connection to release
        if client is not None:
            client.close()

    async def aclose(self) -> None:
        """Awaitable ``close``."""
        with self._lock:
            client, self._client = self._client, None
            async_client, self._async_client = self._async_client, None
        if client is not None:
            client.close()
        if async_client is not None:
            await async_client.aclose()

    def __enter__(self: _P) -> _P:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self: _P) -> _P:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- decisions, under the lock ----------------------------------------------------

    def _require_endpoint(self) -> TokenEndpoint:
        if self._endpoint is None:
            raise AuthError(f"{type(self).__name__} has no token endpoint to renew its token")
        return self._endpoint

    def _decide(self, rejected: Token | None) -> Token | tuple[_Flight, bool, Token | None]:
        """A token to use now, or the flight to join (False) or lead (True).

        With ``rejected`` (the token a tool answered 401 to), returning ``rejected``
        itself means "not renewed": a 401 caused a refresh less than
        ``rejection_interval`` ago, so this 401 goes back to the caller.
        """
        now = self._clock.monotonic()
        with self._lock:
            current = self._token
            if current is not None:
                if rejected is None and not current.due(now):
                    return current
                if rejected is not None and current is not rejected:
                    return current  # someone already replaced the rejected token
            if self._flight is not None:
                return self._flight, False, current
            if rejected is not None and current is not None:
                last = self._rejected_at
                if last is not None and now - last < self._policy.rejection_interval:
                    return current  # the identity provider was asked moments ago
                self._rejected_at = now
            if self._failure is not None:
                error, until = self._failure
                if now < until:
                    if rejected is None and _still_usable(current, now):
                        assert current is not None
                        return current
                    raise _clone(error)
                self._failure = None
            flight = self._flight = _Flight()
            return flight, True, current

    def _settle(
        self,
        flight: _Flight,
        token: Token | None,
        error: AuthError | None,
        *,
        remember: bool = True,
    ) -> None:
        """Publish the flight's outcome; a failure is remembered unless it was an interruption."""
        with self._lock:
            self._flight = None
            if token is not None:
                self._token = token
                self._failure = None
            elif error is not None and remember:
                self._failure = (error, self._clock.monotonic() + self._policy.failure_ttl)
        flight.finish(token, error)

    @staticmethod
    def _wrap(exc: BaseException) -> AuthError:
        """The AuthError every caller sees when obtaining a token broke in an unexpected way."""
        if isinstance(exc, Exception):
            error = AuthError(
                f"obtaining a token failed with {type(exc).__name__} (see the cause); "
                "fix the token store or callable involved, then retry the call"
            )
        else:
            error = AuthError(
                f"obtaining a token was interrupted ({type(exc).__name__}); retry the call"
            )
        error.__cause__ = exc
        return error

    # -- sync path --------------------------------------------------------------------

    def _tell(self, effect: Emit) -> None:
        """Give a token request's event to the hooks, or its note to the logger."""
        event = effect.event
        if isinstance(event, Note):
            (_log.warning if event.level == "warning" else _log.debug)("%s", event.text)
            return
        assert isinstance(event, TokenEvent)
        for hook in self._hooks:
            hook(event)

    def _sync_client(self) -> _httpx2.Client:
        with self._lock:
            if self._client is None:
                self._client = self._open(_clients.make_client)
            return self._client

    def _open(self, factory: Callable[..., _C]) -> _C:
        # Unpooled: refreshes come minutes apart, long after an idle connection would have
        # closed, and an async client with no pooled connection serves any event loop.
        # Cookieless: token requests go out bare, and this client sends them itself.
        timeout = _clients.make_timeout(self._policy.timeout)
        return factory(timeout, verify=self._require_endpoint().verify, pooled=False, cookies=False)

    def _flow(self, request: TokenRequest) -> TokenFlow:
        clock = self._clock
        return self._require_endpoint().exchange(
            request, clock=clock.monotonic, rng=clock.random, wall=clock.time
        )

    def _carry_sync(self) -> Callable[[Any], Any]:
        """How a refresh's ``_obtain`` and its token requests' flows are carried out."""
        handlers: Handlers = {
            TokenRequest: lambda request: run_sync(self._flow(request), self._carry_sync()),
            Call: lambda call: call.fn(),
            Outgoing: self._send_sync,
            Sleep: lambda sleep: self._clock.sleep(sleep.seconds),
            Emit: self._tell,
        }
        return carrier(handlers)  # built per refresh: the provider keeps no cycle through it

    def _send_sync(self, out: Outgoing) -> object:
        return _http.send_sync(
            self._sync_client(),
            out,
            auth=None,
            timeout=None,
            max_bytes=MAX_TOKEN_ANSWER_BYTES,
            clock=self._clock,
        )

    def _token_sync(self, rejected: Token | None = None) -> Token:
        decision = self._decide(rejected)
        if isinstance(decision, Token):
            return decision
        flight, lead, current = decision
        try:
            return self._refresh_sync(flight, lead, current)
        except AuthError as exc:
            return self._fallback(current, rejected, exc)

    def _refresh_sync(self, flight: _Flight, lead: bool, current: Token | None) -> Token:
        if not lead:
            return flight.wait_sync(self._wait_cap())
        try:
            token = run_sync(self._obtain(current), self._carry_sync())
        except AuthError as exc:
            self._settle(flight, None, exc)
            raise
        except Exception as exc:
            error = self._wrap(exc)
            self._settle(flight, None, error)
            raise error from exc
        except BaseException as exc:
            self._settle(flight, None, self._wrap(exc), remember=False)
            raise
        self._settle(flight, token, None)
        return token

    # -- async path -------------------------------------------------------------------

    def _async_http(self) -> _httpx2.AsyncClient:
        with self._lock:
            if self._async_client is None:
                self._async_client = self._open(_clients.make_async_client)
            return self._async_client

    def _carry_async(self) -> Callable[[Any], Awaitable[Any]]:
        """The asyncio ``_carry_sync``: store calls run in a worker thread."""
        handlers: Handlers = {
            TokenRequest: lambda request: run_async(self._flow(request), self._carry_async()),
            Call: lambda call: asyncio.to_thread(call.fn),
            Outgoing: self._send_async,
            Sleep: lambda sleep: self._clock.asleep(sleep.seconds),
            Emit: self._tell,
        }
        return async_carrier(handlers)

    def _send_async(self, out: Outgoing) -> Awaitable[object]:
        return _http.send_async(
            self._async_http(),
            out,
            auth=None,
            timeout=None,
            max_bytes=MAX_TOKEN_ANSWER_BYTES,
            clock=self._clock,
        )

    async def _lead_async(self, flight: _Flight, current: Token | None) -> None:
        try:
            token = await run_async(self._obtain(current), self._carry_async())
        except AuthError as exc:
            self._settle(flight, None, exc)
        except Exception as exc:
            self._settle(flight, None, self._wrap(exc))
        except BaseException as exc:
            self._settle(flight, None, self._wrap(exc), remember=False)
            raise  # cancellation, KeyboardInterrupt: let the loop see them
        else:
            self._settle(flight, token, None)

    async def _token_async(self, rejected: Token | None = None) -> Token:
        decision = self._decide(rejected)
        if isinstance(decision, Token):
            return decision
        flight, lead, current = decision
        if lead:
            task = asyncio.get_running_loop().create_task(self._lead_async(flight, current))
            self._tasks.add(task)  # a strong reference until it is done
            task.add_done_callback(self._tasks.discard)
        try:
            return await flight.wait_async()
        except AuthError as exc:
            return self._fallback(current, rejected, exc)

    def _fallback(self, current: Token | None, rejected: Token | None, error: AuthError) -> Token:
        """After a failed early renewal, keep using a token that has not expired yet."""
        now = self._clock.monotonic()
        if rejected is not None or not _still_usable(current, now):
            raise error
        assert current is not None
        assert current.expires_at is not None
        _log.warning(
            "%s: renewing the token failed (%s); the current token stays in use for its "
            "remaining %.1f s",
            type(self).__name__,
            type(error).__name__,
            current.expires_at - now,
        )
        return current

    def _wait_cap(self) -> float:
        policy = self._policy
        return (
            policy.deadline + policy.timeout + max(policy.max_backoff, policy.max_retry_after) + 5.0
        )

    # -- the httpx.Auth flows -------------------------------------------------------------

    @staticmethod
    def _authorize(request: _http.Request, token: Token) -> None:
        request.headers["Authorization"] = f"Bearer {token.access_token.get_secret_value()}"

    def _retry_after_401(self, response: _http.Response) -> bool:
        return response.status_code == 401 and self._can_refresh

    def sync_auth_flow(
        self, request: _http.Request
    ) -> Generator[_http.Request, _http.Response, None]:
        require_secure(str(request.url), what="a bearer token")
        request.read()
        sent = self._token_sync()
        self._authorize(request, sent)
        response = yield request
        if self._retry_after_401(response):
            renewed = self._token_sync(rejected=sent)
            if renewed is not sent:  # not renewed: the 401 goes back to the caller
                self._authorize(request, renewed)
                yield request

    async def async_auth_flow(
        self, request: _http.Request
    ) -> AsyncGenerator[_http.Request, _http.Response]:
        require_secure(str(request.url), what="a bearer token")
        await request.aread()
        sent = await self._token_async()
        self._authorize(request, sent)
        response = yield request
        if self._retry_after_401(response):
            renewed = await self._token_async(rejected=sent)
            if renewed is not sent:  # not renewed: the 401 goes back to the caller
                self._authorize(request, renewed)
                yield request

    def auth_flow(self, request: _http.Request) -> Generator[_http.Request, _http.Response, None]:
        """Not used: httpx calls ``sync_auth_flow`` or ``async_auth_flow``, which do the I/O."""
        raise NotImplementedError("token providers run through httpx's sync or async auth flow")

    # -- conveniences ---------------------------------------------------------------------

    def get_token(self) -> str:
        """A valid access token (refreshed if due), for callers that set headers themselves.

        Handle it as a secret: never log or print it.
        """
        return self._token_sync().access_token.get_secret_value()

    async def aget_token(self) -> str:
        """Awaitable ``get_token``."""
        token = await self._token_async()
        return token.access_token.get_secret_value()
