"""IdempotencyMiddleware: pure ASGI, in front of any Starlette or FastAPI app.

```
request ─▶ protected method and route? (the path relative to root_path / the mount) ─no─▶ app
        ─▶ principal(scope): whose key space? none (not authenticated) ─401─▶ (nothing looked up)
        ─▶ key? ─400─▶ key well formed? ─400─▶ body within max_body_bytes? ─413─▶
             agentkey key <plan>:<step>:<hash>: sha256(body) = hash? taken unparsed; else
                 body a JSON object ─400─▶ its canonical JSON hashes to hash ─422─▶
             opaque key (UUID, ik_...): fingerprint = digest of the body's bytes
                 (body_fingerprint="canonical": of its canonical JSON)
        ─▶ claim (one store round trip; the record binds METHOD + route path)
             ├─ store down ............ 503 + Retry-After, handler never runs
             ├─ bound to another route  422 key_reused (never a replay, never a 409)
             ├─ opaque key, other body  422 payload_mismatch (other bytes, by default)
             ├─ IN_PROGRESS ........... 409 + Retry-After (the lease's end if its holder
             │                          stopped renewing), at once or after hold_in_flight
             │                          (a held duplicate replays if the first finishes)
             ├─ IN_DOUBT .............. (may have started, lease lapsed, or failed after)
             │                          reconcile hook: ran ─▶ record + replay; not run ─▶
             │                          claim afresh, run; unknown/none ─▶ 409 in_doubt
             ├─ COMPLETED / FAILED .... replay status, headers, body + Idempotent-Replayed: true
             └─ claimed ─▶ handler, lease renewed every lock_ttl/3 (unless auto_renew=False)
                    ─▶ finish (compare-and-set on the owner token)
                    storable answer (2xx, 3xx but 307/308, request 4xx) .. COMPLETED
                    other answer or exception, mutation begun ......... FAILED
                    answer over max_recorded_bytes (never buffered) ... FAILED, a 500 saying so
                    5xx or exception, may have started (the default) .. IN_DOUBT
                    other answer or exception, nothing started ........ released (retry is safe)
                    StoreUnavailable raised, no mutation, no answer .... 503, released
```
The final chunk of a response is held back until its record is written, so a
client never holds a result the store does not know about. When that write fails
(a store outage), the answer is sent and the write retried, shielded, for up to
10 s: the step has run, and an unrecorded outcome would let a retry run it again. A
failed release is retried the same way: until it lands, the key stays blocked.
The claim, the hold and the settle are the ones every front end shares
(:mod:`agentkey.server._lifecycle`); this module keeps the ASGI plumbing.
The middleware's own errors are RFC 9457 problem details (``application/problem+json``, ``type`` =
``urn:agentkey:problem:<code>``) that keep an ``"error": <code>`` member.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import (
    Awaitable,
    Callable,
    Collection,
    Coroutine,
    Iterable,
    MutableMapping,
    Sequence,
)
from typing import Any

import anyio

from .._clock import Clock
from .._exceptions import ConfigurationError, StoreError, StoreUnavailable
from .._keys import shown_key
from ._blobs import BlobStore, FileBlobStore
from ._claim import Claim, reset_current, set_current, wall_ms
from ._decide import (
    REPLAY_HEADER,
    Checked,
    Conflict,
    DecisionEvent,
    InDoubt,
    KeyFormat,
    Problem,
    Reject,
    Replay,
    Unavailable,
    body_too_large,
    check_body,
    is_storable,
    not_finished,
    on_finished,
    parse_key,
    replay_headers,
    stored_headers,
    unauthenticated,
    unavailable,
)
from ._lifecycle import (
    SHARED_PRINCIPAL,
    Doubted,
    Lifecycle,
    check_principal_options,
    resolve_principal,
)
from ._options import ServerOptions, check_hooks, check_store, options_or_default
from ._reconcile import ReconcileHook, check_reconcile, context_for
from ._stores import MemoryStore, Store, resolve_clock

__all__ = [
    "REPLAY_HEADER",
    "DecisionHook",
    "IdempotencyMiddleware",
    "KeyFormat",
    "PrincipalFunc",
    "is_storable",
    "route_path",
    "starlette_user_identity",
    "stored_headers",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
PrincipalFunc = Callable[[Scope], "str | Awaitable[str | None] | None"]
RoutesFunc = Callable[[Scope], bool]
DecisionHook = Callable[[DecisionEvent], object]

_logger = logging.getLogger("agentkey.server")

#: Set on every answer of a protected route: clients learn that it honours the key.
_PROTECTED = (b"idempotency-protected", b"true")
#: The method an OPTIONS probe asks about, as a CORS preflight names it.
_ASKED_METHOD = b"access-control-request-method"


#: The hooks' event of each problem a claim can meet (a Reject: "mismatch").
_EVENTS: dict[type, str] = {Conflict: "conflict", Unavailable: "unavailable", InDoubt: "in_doubt"}


def _asked_method(scope: Scope) -> str | None:
    """The method an OPTIONS request asks about (``Access-Control-Request-Method``)."""
    for name, value in scope.get("headers", ()):
        if name.lower() == _ASKED_METHOD:
            return bytes(value).decode("latin-1").strip().upper()
    return None


def _advertising(send: Send) -> Send:
    """``send``, with the route's protection header on the response's start."""

    async def advertise(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), _PROTECTED]}
        await send(message)

    return advertise


def starlette_user_identity(scope: Scope) -> str | None:
    """The principal of Starlette's ``AuthenticationMiddleware``: ``scope["user"].identity``.

    Pass it as ``principal=`` when the idempotency middleware runs inside
    Starlette's (or FastAPI's) ``AuthenticationMiddleware``. An unauthenticated
    request has no principal (None), so the middleware answers 401 and runs
    nothing. Never the display name: two users may share one, and would share
    records. Raises :class:`~agentkey.ConfigurationError` when the scope has no
    ``user`` at all (the middleware sits outside the authentication, so it would
    decide before anyone checked the caller) or an authenticated user has no
    ``str`` identity.
    """
    if "user" not in scope:
        raise ConfigurationError(
            "starlette_user_identity found no scope['user']: IdempotencyMiddleware runs "
            "before AuthenticationMiddleware, so it would decide before the caller is "
            "authenticated. Put AuthenticationMiddleware first in Starlette(middleware=[...]) "
            "(with add_middleware, add IdempotencyMiddleware first: the last one added runs "
            "first)"
        )
    user = scope["user"]
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    try:
        identity = user.identity
    except (AttributeError, NotImplementedError):
        identity = None
    if not isinstance(identity, str) or not identity:
        raise ConfigurationError(
            f"the authenticated user ({type(user).__name__}) has no str identity to scope "
            "idempotency records by; implement BaseUser.identity or pass another principal= "
            "to IdempotencyMiddleware"
        )
    return identity


def route_path(scope: Scope) -> str:
    """The path the app's router matches: ``path`` relative to ``root_path``.

    Starlette's ``Mount`` and ``uvicorn --root-path`` keep the prefix in
    ``scope["path"]`` and name it in ``scope["root_path"]`` (older Starlette
    strips it from ``path``: then there is nothing to remove).
    """
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        if path == root:
            return "/"
        if path[len(root)] == "/":
            return path[len(root) :]
    return path


def _every_path(scope: Scope) -> bool:
    return True


class _Routes:
    """Which route paths are protected; warns once when a pattern looks misplaced."""

    def __init__(self, routes: Collection[str] | RoutesFunc | None) -> None:
        self._func: RoutesFunc | None = None
        self._exact: frozenset[str] = frozenset()
        self._prefixes: tuple[str, ...] = ()
        self._warned = False
        if routes is None:
            self._func = _every_path
            self._unmatched: set[str] = set()
            return
        if callable(routes):
            self._func = routes
            self._unmatched = {"<the routes function>"}
            return
        if isinstance(routes, str):
            raise ConfigurationError("routes is a collection of paths, not one string: use [path]")
        routes = list(routes)
        for route in routes:
            if (
                not isinstance(route, str)
                or not route.startswith("/")
                or ("*" in route and (not route.endswith("/*") or "*" in route[:-1]))
            ):
                # "/tools*" or "tools/*" would silently match nothing and leave tools unprotected.
                raise ConfigurationError(
                    f"invalid route {route!r}: use an exact path such as '/tools/charge' or a "
                    "prefix pattern ending in '/*' such as '/tools/*'"
                )
        self._exact = frozenset(r for r in routes if not r.endswith("/*"))
        self._prefixes = tuple(r[:-1] for r in routes if r.endswith("/*"))
        self._unmatched = set(routes)

    @property
    def every(self) -> bool:
        """Every path is protected (no ``routes`` given): nothing to match."""
        return self._func is _every_path

    def match(self, scope: Scope, path: str) -> bool:
        if self._func is not None:
            hit = bool(self._func(scope))
            if hit and self._unmatched:
                self._unmatched.clear()
            return hit
        if path in self._exact:
            self._unmatched.discard(path)
            return True
        for prefix in self._prefixes:
            if path.startswith(prefix):
                self._unmatched.discard(prefix + "*")
                return True
        return False

    def passed_unprotected(self, scope: Scope, path: str) -> None:
        """A request carrying an Idempotency-Key matched no route: warn once if a
        configured pattern never matched anything (a prefix or mount mismatch)."""
        if self._warned or not self._unmatched:
            return
        self._warned = True
        _logger.warning(
            "IdempotencyMiddleware: routes %s have not matched any request yet, while a "
            "request carrying an Idempotency-Key reached the unprotected path %r (root_path "
            "%r): it ran without idempotency protection. Routes are matched against the "
            "path relative to root_path, as the router sees it; check them against your "
            "mounts and --root-path",
            sorted(self._unmatched),
            path[:200],
            str(scope.get("root_path", ""))[:200],
        )


def _principal(principal: PrincipalFunc | None, shared_key_space: bool) -> PrincipalFunc | None:
    """The principal function; refused when there is none and no shared key space."""
    check_principal_options(principal, shared_key_space, what="scope")
    if principal is None and not shared_key_space:
        raise ConfigurationError(
            "IdempotencyMiddleware cannot tell callers apart: pass principal=, a function "
            "(scope) -> str | None giving the caller from the app's authentication "
            "(starlette_user_identity for Starlette's AuthenticationMiddleware), or "
            "shared_key_space=True if every caller may share one key space (and so "
            "replay each other's answers)"
        )
    return principal


def _methods(methods: object) -> frozenset[str]:
    """The protected HTTP methods, upper case."""
    names = () if isinstance(methods, str) or not isinstance(methods, Iterable) else tuple(methods)
    if not names or not all(isinstance(m, str) and m for m in names):
        # A bare "POST" would become the methods P, O, S and T and protect nothing.
        raise ConfigurationError(
            f"methods is a collection of HTTP method names, got {methods!r}; use ['POST']"
        )
    return frozenset(m.upper() for m in names)


def _blob_store(blob_store: object, result_ttl: float) -> BlobStore | None:
    """The blob store given (None: a FileBlobStore, built on first use)."""
    if blob_store is not None and not isinstance(blob_store, BlobStore):
        raise ConfigurationError(
            "blob_store must implement agentkey.server.BlobStore (put, get, delete), "
            f"got {type(blob_store).__name__}"
        )
    if isinstance(blob_store, FileBlobStore) and blob_store.ttl < result_ttl:
        raise ConfigurationError(
            f"the FileBlobStore's ttl ({blob_store.ttl:g} s) is shorter than result_ttl "
            f"({result_ttl:g} s): large answers would expire before their records; give "
            "it ttl=result_ttl"
        )
    return blob_store


class _Exchange:
    """One claimed request between the app and the server.

    The app receives the body the middleware already read, once, then the server's
    own messages. Its answer is captured for the record; the start is held with the
    body, so a one-body answer leaves whole once its outcome is recorded (a streamed
    answer flushes the start with its first chunk). A slotted object rather than
    closures over the request: the request holds it across the store's round trip at
    the finish, and one object is less for the garbage collector to walk than a dozen
    cells and functions, with every request in flight holding its own.
    """

    __slots__ = (
        "abandoned",
        "answer",
        "claim",
        "dropped",
        "final",
        "finished",
        "headers",
        "held",
        "method",
        "middleware",
        "path",
        "request_body",
        "server_receive",
        "server_send",
        "settle_began",
        "settling",
        "size",
        "started",
        "status",
    )

    def __init__(
        self,
        middleware: IdempotencyMiddleware,
        claim: Claim,
        body: list[bytes],
        receive: Receive,
        send: Send,
        method: str,
        path: str,
    ) -> None:
        self.middleware, self.claim, self.method, self.path = middleware, claim, method, path
        # The body's chunks as they came, handed on in order (reversed: pop() is the next).
        self.request_body = body[::-1]
        self.server_receive, self.server_send = receive, send
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.answer = bytearray()
        self.size = 0  # bytes the app has answered so far
        self.dropped = False  # over max_recorded_bytes: the answer is no longer kept
        self.started = self.finished = False
        self.held: Message | None = None  # the response's start, until its body goes out
        self.final: Message | None = None  # the answer's last message, sent by the settle
        self.settling: asyncio.Task[str] | None = None  # the settle, beside the app
        self.settle_began = False  # the settle has started to run (see _settled)
        self.abandoned = False  # the request was cancelled: the answer is not sent

    async def receive(self) -> Message:
        chunks = self.request_body
        if chunks:
            chunk = chunks.pop()
            return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}
        return await self.server_receive()  # after the body: the server's own disconnect

    async def send_held(self) -> None:
        held = self.held
        if held is not None:
            self.held = None
            await self.server_send(held)

    async def deliver(self) -> None:
        """Send the answer's last message (and the start still held), unless the
        request was cancelled meanwhile."""
        final = self.final
        if self.abandoned or final is None:
            return
        held = self.held
        if held is not None:
            self.held = None
            await self.server_send(held)
        await self.server_send(final)

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.body":
            if self.finished:
                raise RuntimeError(
                    "the app sent a response body after its final one (more_body=False); "
                    "an ASGI response ends with exactly one final body message"
                )
            chunk = message.get("body", b"")
            self.size += len(chunk)
            if not self.dropped:
                if self.size > self.middleware.options.max_recorded_bytes:
                    # Never an unbounded buffer: the answer goes out as it comes, and
                    # the record says it was too large to keep.
                    self.dropped = True
                    self.answer = bytearray()
                else:
                    self.answer += chunk
            if message.get("more_body", False):
                await self.send_held()
                await self.server_send(message)
                return
            self.finished = True
            self.final = message
            middleware, claim = self.middleware, self.claim
            if (
                self.status >= 500
                and claim._unavailable is not None
                and self.held is not None
                and not claim.mutation_started
            ):
                if claim._nothing_outside:
                    claim.nothing_started()  # the store's transaction failed: nothing committed
                self.final = middleware._unavailable_answer(self, claim._unavailable)
            settle = middleware._finish(self, error=False)
            try:
                # Alone (no other request in flight), nothing allocates while the store
                # answers, so the stack costs the collector nothing, and a task would
                # add a few loop iterations to the answer's path.
                alone = middleware._in_flight <= 1
                loop = None if middleware._settle_inline or alone else asyncio.get_running_loop()
            except RuntimeError:  # not asyncio (trio): settle here, inside the app's send
                loop = None
            if loop is not None:
                # Settled in a task of its own, beside the app: the app's call stack
                # unwinds now instead of waiting on the store with every other request
                # in flight, where the garbage collector, run by their allocations, would
                # walk it again and again. The request awaits the task before it ends
                # (IdempotencyMiddleware._run).
                self.settling = loop.create_task(settle)
                return
            decision = await settle
            if middleware._hooks:
                middleware._emit(
                    decision, self.method, self.path, claim.idempotency_key, self.status
                )
        elif kind == "http.response.start":
            self.status = int(message["status"])
            self.headers = headers = list(message.get("headers", ()))
            self.started = True
            # Held with the body, so a one-body answer leaves in one go once recorded.
            # The headers may be a one-shot iterable (ASGI allows it): keep our copy, and
            # send another that says the route is protected.
            self.held = {**message, "headers": [*headers, _PROTECTED]}
        else:
            await self.send_held()
            await self.server_send(message)


class IdempotencyMiddleware:
    """Turn a repeated ``Idempotency-Key`` into a replay, never a second side effect.

    It must know whose key space a request belongs to: give it ``principal=``
    (a function of the request's authentication) or, when every caller may
    share one key space, ``shared_key_space=True``; with neither it refuses to
    start. How keys are claimed, recorded and replayed (``require_key``,
    ``lock_ttl``, ``result_ttl``, the body and answer limits ...) is one
    :class:`ServerOptions` value, the one the MCP middleware takes too; the
    keywords here are what only this front end knows:

    ``store``
        A :class:`Store` (``RedisStore`` in production, ``MemoryStore`` for tests).
    ``options``
        A :class:`ServerOptions` (default: ``ServerOptions()``, production defaults).
    ``principal``
        ``(scope) -> str | None`` (or async): the tenant, user or client the
        request acts for, from the same authentication the app trusts (for
        Starlette's ``AuthenticationMiddleware``: :func:`starlette_user_identity`).
        Records are scoped by it. None or ``""`` means the request is not
        authenticated: a protected route then answers 401 and runs nothing.
    ``shared_key_space``
        True: every caller shares one key space (one client, or callers that
        trust each other), and no principal is asked for. Default False.
    ``routes``
        Paths to protect: exact paths, ``/prefix/*`` patterns, or a callable
        ``(scope) -> bool``. Paths are relative to ``root_path`` (a ``Mount``,
        ``uvicorn --root-path``), as the router matches them. Default: every
        request whose method is in ``methods``.
    ``methods``
        HTTP methods to protect (default ``POST``).
    ``blob_store``
        A :class:`BlobStore` for answers over ``options.max_inline_bytes``; default
        a :class:`FileBlobStore` in the temp dir whose blobs live as long as
        ``options.result_ttl``. A ``FileBlobStore`` with a shorter ``ttl`` is refused.
    ``hooks``
        Callables each receiving one :class:`DecisionEvent` per request once its
        answer is sent (``claimed``, ``replay``, ``conflict``, ``rejected`` ...).
        An exception in a hook propagates.
    ``reconcile``
        ``(ReconcileContext) -> Reconciled`` (or async): asked when a request meets
        a key in doubt; it answers ``Reconciled.ran(...)`` (recorded, replayed),
        ``Reconciled.not_run()`` (the request runs now) or ``Reconciled.in_doubt()``
        (within ``options.reconcile_timeout``; after that the key stays in doubt).
    ``clock``
        The :class:`~agentkey.Clock` leases, records and waits are measured on
        (default: the system clock; ``agentkey.testing.FakeClock`` in tests).

    A duplicate of a request in flight gets a 409 with ``Retry-After`` at once, or
    waits ``options.hold_in_flight`` for its replay: the first request's settle wakes
    the duplicates held in its process; for a request running elsewhere one held
    duplicate per key asks the store (every 0.1 s, doubling to 1 s), and at most
    1,000 are held at once. With ``mutation_starts="on_mark"`` a ``begin_mutation()``
    not awaited is never written: the middleware logs a WARNING, once per route.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: Store,
        options: ServerOptions | None = None,
        principal: PrincipalFunc | None = None,
        shared_key_space: bool = False,
        routes: Collection[str] | RoutesFunc | None = None,
        methods: Iterable[str] = ("POST",),
        blob_store: BlobStore | None = None,
        hooks: Sequence[DecisionHook] = (),
        reconcile: ReconcileHook | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.app = app
        self.store = check_store(store)
        self.options = options = options_or_default(options)
        self._principal = _principal(principal, shared_key_space)
        self.shared_key_space = shared_key_space
        self._routes = _Routes(routes)
        self._every_route = self._routes.every
        self.methods = _methods(methods)
        self._blob_store = _blob_store(blob_store, options.result_ttl)
        self._hooks = check_hooks(hooks)
        check_reconcile(reconcile, options.reconcile_timeout)
        self._reconcile = reconcile
        self._clock = resolve_clock(clock, "IdempotencyMiddleware")
        self._replay_header = options.replay_header.lower()
        # A MemoryStore answers without ever waiting, so its settle cannot hold the app's
        # stack across a wait: a task beside the app (_Exchange.send) would only cost one.
        self._settle_inline = type(store) is MemoryStore
        # Claimed requests whose app is running (see _run). It only picks where the settle
        # runs, and both places are correct: a count skewed by event loops in several
        # threads sharing this middleware changes nothing but that choice.
        self._in_flight = 0
        self._life = Lifecycle(
            store,
            lock_ttl_ms=options.lock_ttl_ms,
            result_ttl_ms=options.result_ttl_ms,
            retry_after=options.retry_after,
            auto_renew=options.auto_renew,
            clock=self._clock,
            blob_store=lambda: self.blob_store,
            mutation_starts=options.mutation_starts,
        )

    @property
    def blob_store(self) -> BlobStore:
        if self._blob_store is None:
            self._blob_store = FileBlobStore(
                ttl=self.options.result_ttl_ms / 1000, clock=self._clock
            )
        return self._blob_store

    # --- ASGI ----------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = str(scope.get("method", "GET")).upper()
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        if method not in self.methods:
            if (
                method == "OPTIONS"
                and _asked_method(scope) in self.methods
                and self._routes.match(scope, path)
            ):
                # A client asks whether this method on this route honours keys: said only
                # for a method protected here, never for OPTIONS without the question.
                send = _advertising(send)
            await self._pass(scope, receive, send, method, path)
            return
        # One pass over the headers for the key and the declared body length.
        values: list[bytes] = []
        lengths: list[bytes] | None = None
        for name, value in scope.get("headers", ()):
            name = name.lower()
            if name == b"idempotency-key":
                values.append(value)
            elif name == b"content-length":
                if lengths is None:
                    lengths = [value]
                else:
                    lengths.append(value)
        if not (self._every_route or self._routes.match(scope, path)):
            if values:
                self._routes.passed_unprotected(scope, path)
            await self._pass(scope, receive, send, method, path)
            return
        if not values and not self.options.require_key:
            await self._pass(scope, receive, send, method, path)
            return
        # From here every answer carries _PROTECTED: the middleware's own (_messages) and
        # the app's start (_Exchange.send) add it as they are built.
        # Whose key space, before anything about the key: an unauthenticated request
        # learns nothing (no replay, no 409, no 422 saying the key exists).
        principal = SHARED_PRINCIPAL
        if self._principal is not None:
            found = await resolve_principal(self._principal, scope)
            if found is None:
                await self._problem(send, unauthenticated(), "rejected", method, path, None)
                return
            principal = found
        key = parse_key(values, key_format=self.options.key_format)
        if isinstance(key, Reject):
            await self._problem(send, key, "rejected", method, path, None)
            return
        body = await _read_body(lengths, receive, self.options.max_body_bytes)
        if body is None:
            return  # the client went away
        if isinstance(body, int):
            reject = body_too_large(self.options.max_body_bytes)
            await self._problem(send, reject, "rejected", method, path, key.format())
            return
        # The binding names the route with its mount prefix: two mounted apps that share
        # a store both serve "/create", and must never answer with each other's records.
        operation = (method, f"{scope.get('root_path', '')}{path}")
        checked = check_body(
            key,
            operation,
            body,
            hash_profile=self.options.hash_profile,
            body_fingerprint=self.options.body_fingerprint,
        )
        if isinstance(checked, Reject):
            await self._problem(send, checked, "rejected", method, path, key.format())
            return
        # The Claim is built only when the request goes on with one (it runs, is held, or
        # meets a key in doubt): a replay or a refusal is answered from the record alone.
        decision = await self._life.open(
            checked, principal, body, " ".join(operation), hold=self.options.hold_in_flight
        )
        if isinstance(decision, Doubted):
            decision = await self._reconciled(decision, checked, principal, method, path, body)
        # One dispatch from the decision to the answer (a run is the Claim it runs under).
        if isinstance(decision, Claim):
            await self._run(scope, receive, send, body, decision, method, path)
        elif isinstance(decision, Replay):
            await self._replay(send, decision, method, path, checked.idempotency_key)
        else:
            event = _EVENTS.get(type(decision), "mismatch")
            await self._problem(send, decision, event, method, path, checked.idempotency_key)

    async def _reconciled(
        self,
        doubted: Doubted,
        checked: Checked,
        principal: str,
        method: str,
        path: str,
        body: list[bytes],
    ) -> Claim | Replay | Problem:
        """A key in doubt: the reconcile hook's verdict, or the doubt without a hook."""
        if self._reconcile is None:
            return doubted.doubt
        claim = doubted.claim
        context = context_for(
            claim.idempotency_key,
            principal,
            method,
            path,
            b"".join(body),
            doubted.doubt.record,
            self._life.now_ms(),
            claim.key_for,
        )
        return await self._life.reconcile(
            doubted,
            checked,
            self._reconcile,
            context,
            self.options.reconcile_timeout,
            max_inline_bytes=self.options.max_inline_bytes,
            max_recorded_bytes=self.options.max_recorded_bytes,
        )

    def _emit(self, decision: str, method: str, path: str, key: str | None, status: int) -> None:
        event = DecisionEvent(decision, method, path, key, status)
        for hook in self._hooks:
            hook(event)

    async def _pass(
        self, scope: Scope, receive: Receive, send: Send, method: str, path: str
    ) -> None:
        """Not protected: the app answers alone (watched only when hooks listen)."""
        if not self._hooks:
            await self.app(scope, receive, send)
            return
        status = 0

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        await self.app(scope, receive, watch)
        self._emit("passthrough", method, path, None, status)

    async def _problem(
        self, send: Send, problem: Problem, event: str, method: str, path: str, key: str | None
    ) -> None:
        await _send(send, problem.status, problem.headers, problem.body)
        if self._hooks:
            self._emit(event, method, path, key, problem.status)

    async def _replay(self, send: Send, replay: Replay, method: str, path: str, key: str) -> None:
        body = replay.body
        if replay.blob_uri is not None:
            try:
                body = await self.blob_store.get(replay.blob_uri)
            except StoreError as exc:
                _logger.error("stored response of %s is unreadable: %s", shown_key(key), exc)
                problem = unavailable(self.options.retry_after, reading=True)
                await self._problem(send, problem, "unavailable", method, path, key)
                return
        # The start and the body, straight from the record: _messages' shape, in one go.
        raw = [
            (k.encode("latin-1"), v.encode("latin-1"))
            for k, v in replay_headers(replay, self._replay_header)
        ]
        raw.append((b"content-length", b"%d" % len(body)))
        raw.append(_PROTECTED)
        await send({"type": "http.response.start", "status": replay.status, "headers": raw})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        if self._hooks:
            self._emit("replay", method, path, key, replay.status)

    async def _run(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        body: list[bytes],
        claim: Claim,
        method: str,
        path: str,
    ) -> None:
        exchange = _Exchange(self, claim, body, receive, send, method, path)
        token = set_current(claim)
        if claim.auto_renew and not claim.start_renewing():
            _logger.warning(
                "no asyncio loop runs this request, so the lease on %s is not renewed "
                "automatically; renew it from the handler or raise lock_ttl",
                shown_key(claim.idempotency_key),
            )
        self._in_flight += 1
        try:
            await self.app(scope, exchange.receive, exchange.send)
        except StoreUnavailable as exc:
            if (
                exchange.started
                or claim.mutation_started
                or (claim._may_have_started and claim._unavailable is not exc)
            ):
                await self._conclude(exchange)
                if exchange.status == 503 and claim._unavailable is exc:
                    return  # answered 503 already (the app's own 500 was replaced)
                raise
            unavailable_inside: StoreUnavailable | None = exc
        except BaseException:
            # An app failing after its answer (a background task, say) still has the
            # answer recorded and sent before the error goes on.
            await self._conclude(exchange)
            raise
        else:
            unavailable_inside = None
        finally:
            self._in_flight -= 1
            reset_current(token)
        if unavailable_inside is not None:
            await self._unavailable_inside(exchange, unavailable_inside)
            return
        if exchange.settling is not None or not exchange.finished:
            await self._conclude(exchange)

    async def _unavailable_inside(self, exchange: _Exchange, exc: StoreUnavailable) -> None:
        """The store failed inside the handler (its transaction) and the app raised it
        before any answer: free the key and answer 503 (``not_finished`` and the record's
        own rule when work of it may have committed, or a foreign call was made)."""
        if exchange.claim._nothing_outside:
            exchange.claim.nothing_started()  # the store's own transaction: nothing committed
        exchange.final = self._unavailable_answer(exchange, exc)
        exchange.finished = True
        await self._finish(exchange, error=True)
        if self._hooks:
            key = exchange.claim.idempotency_key
            self._emit("unavailable", exchange.method, exchange.path, key, 503)

    def _unavailable_answer(self, exchange: _Exchange, exc: StoreUnavailable) -> Message:
        """Make the answer a 503 with ``Retry-After`` (held, as the app's start would be);
        return its final message. ``not_run`` when nothing of the request can have
        happened (the key is freed); ``not_finished`` when a transaction of it committed
        or may have (a COMMIT whose answer was lost), or it called a third party: the
        record under the key then tells the retry what happened."""
        claim = exchange.claim
        nothing = claim._nothing_outside
        _logger.error(
            "idempotency store failed inside the handler of %s: %s; answered 503 (%s)",
            shown_key(claim.idempotency_key),
            exc,
            "nothing ran, the key is freed"
            if nothing
            else "not finished: some of its work may have committed",
        )
        problem = (
            unavailable(self.options.retry_after, str(exc))
            if nothing
            else not_finished(self.options.retry_after, str(exc))
        )
        body = problem.body
        headers = _raw_headers(problem.headers, body)
        exchange.held = {
            "type": "http.response.start",
            "status": problem.status,
            "headers": [*headers, _PROTECTED],
        }
        exchange.status, exchange.started = problem.status, True
        exchange.headers = headers
        return {"type": "http.response.body", "body": body, "more_body": False}

    async def _conclude(self, exchange: _Exchange) -> None:
        """After the app: wait for the settle its final answer started, or, when it
        gave no complete response, settle the claim as a failure (a 500)."""
        if exchange.settling is not None:
            await self._settled(exchange)
        elif not exchange.finished:
            claim = exchange.claim
            decision = await self._finish(exchange, error=True)
            if self._hooks:
                self._emit(decision, exchange.method, exchange.path, claim.idempotency_key, 500)

    async def _settled(self, exchange: _Exchange) -> None:
        """Wait for the settle that the app's final answer started, then tell the hooks.

        A cancellation of the request (the client left, the server shuts down) does
        not leave the settle behind, and the answer is no longer sent. A settle that
        is running is cancelled too, as it was when it ran inside the app's send,
        which makes it record the outcome again, shielded and within the settle
        budget (see :meth:`Lifecycle.settle`); one that has not run yet runs
        uncancelled. The request waits for it before the cancellation goes on.
        """
        task = exchange.settling
        assert task is not None
        claim = exchange.claim
        try:
            decision = await asyncio.shield(task)
        except BaseException as exc:
            if task.done() or not isinstance(exc, anyio.get_cancelled_exc_class()):
                raise
            exchange.abandoned = True
            if exchange.settle_began:
                task.cancel()
            # else: cancelled before the task ever ran (a cancellation pending while the
            # app finished), and a task cancelled then would never run at all: the
            # outcome would stay unrecorded. It runs uncancelled, bounded by the store's
            # timeout and the settle budget, and sends nothing.
            with anyio.CancelScope(shield=True):
                await asyncio.wait({task})
            if not task.cancelled() and task.exception() is not None:
                _logger.error(
                    "settling %s after its request was cancelled failed: %r",
                    shown_key(claim.idempotency_key),
                    task.exception(),
                )
            raise
        if self._hooks:
            self._emit(
                decision, exchange.method, exchange.path, claim.idempotency_key, exchange.status
            )

    def _finish(self, exchange: _Exchange, *, error: bool) -> Coroutine[Any, Any, str]:
        """The settle of the claim once the app answered (or failed: ``error``).

        What to record comes from the decision table; the settle itself
        (:meth:`Lifecycle.settle`) sends the answer's last message after the
        first write. Returned unawaited: the caller awaits it inline or in a task.
        """
        exchange.settle_began = True
        claim = exchange.claim
        if exchange.dropped:
            _logger.warning(
                "the answer of %s is over max_recorded_bytes (%d) and was not stored; "
                "resends of the key get 500 response_too_large",
                shown_key(claim.idempotency_key),
                self.options.max_recorded_bytes,
            )
        decision = on_finished(
            exchange.status,
            exchange.headers,
            bytes(exchange.answer),
            error=error or not exchange.started,
            mutation_started=claim.mutation_started,
            may_have_started=claim._may_have_started,
            binding=claim.binding,
            now_ms=wall_ms(self._clock),
            max_inline_bytes=self.options.max_inline_bytes,
            max_recorded_bytes=self.options.max_recorded_bytes,
            size=exchange.size,
        )
        deliver = exchange.deliver if exchange.final is not None else None
        return self._life.settle(claim, decision, deliver)


async def _read_body(
    lengths: list[bytes] | None, receive: Receive, limit: int
) -> list[bytes] | int | None:
    """The whole body, in the chunks it came in; its size when over ``limit`` (or when a
    ``Content-Length`` in ``lengths`` says so); None when the client disconnected. The
    chunks are never joined here: the key is checked on them as they are, and the app
    receives them as the server gave them."""
    for value in lengths or ():
        declared = _declared(value)
        if declared is not None and declared > limit:
            return declared
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            return size
        if not message.get("more_body", False):
            return chunks


def _declared(value: bytes) -> int | None:
    """A ``Content-Length`` value as a number; None when it is not one."""
    try:
        return int(value)
    except ValueError:
        return None


def _raw_headers(headers: Iterable[tuple[str, str]], body: bytes) -> list[tuple[bytes, bytes]]:
    """The headers of a whole answer as ASGI sends them, its ``content-length`` last."""
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
    raw.append((b"content-length", b"%d" % len(body)))
    return raw


def _messages(
    status: int, headers: Iterable[tuple[str, str]], body: bytes
) -> tuple[Message, Message]:
    """The start and the one body message of a whole answer of a protected route (it
    says so: ``idempotency-protected: true``, last)."""
    raw = _raw_headers(headers, body)
    raw.append(_PROTECTED)
    return (
        {"type": "http.response.start", "status": status, "headers": raw},
        {"type": "http.response.body", "body": body, "more_body": False},
    )


async def _send(send: Send, status: int, headers: Iterable[tuple[str, str]], body: bytes) -> None:
    start, final = _messages(status, headers, body)
    await send(start)
    await send(final)
