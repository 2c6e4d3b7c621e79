"""IdempotencyMiddleware: pure ASGI, in front of any Starlette or FastAPI app.

```
request ─▶ protected method and route? (the path relative to root_path / the mount) ─no─▶ app
        ─▶ key? ─400─▶ key well formed? ─400─▶ body within max_body_bytes? ─413─▶
             agentkey key <plan>:<step>:<hash>: body a JSON object ─400─▶ hash matches ─422─▶
             opaque key (UUID, ik_...): fingerprint = digest of the canonical body
        ─▶ claim (one store round trip; the record binds METHOD + route path)
             ├─ store down ............ 503 + Retry-After, handler never runs
             ├─ bound to another route  422 key_reused (never a replay, never a 409)
             ├─ opaque key, other body  422 payload_mismatch
             ├─ IN_PROGRESS ........... 409 + Retry-After (the lease's end if its holder
             │                          stopped renewing), at once or after hold_in_flight
             │                          (a held duplicate replays if the first finishes)
             ├─ COMPLETED / FAILED .... replay status, headers, body + Idempotent-Replayed: true
             └─ claimed ─▶ handler, lease renewed every lock_ttl/3 (unless auto_renew=False)
                    ─▶ finish (compare-and-set on the owner token)
                    storable answer (2xx, 3xx, request 4xx) ... COMPLETED
                    other answer or exception, mutation begun .. FAILED
                    other answer or exception, no mutation ..... released (retry is safe)
```
The final chunk of a response is held back until its record is written, so a
client never holds a result the store does not know about. The middleware's own
errors are RFC 9457 problem details (``application/problem+json``, ``type`` =
``urn:agentkey:problem:<code>``) that keep an ``"error": <code>`` member.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import re
import secrets
import time
from collections.abc import (
    Awaitable,
    Callable,
    Collection,
    Iterable,
    MutableMapping,
    Sequence,
)
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import quote

import anyio

from .._canonical import Profile, canonical_json, check_profile
from .._exceptions import ConfigurationError, InvalidArguments, InvalidKey, StoreError
from .._keys import MAX_KEY_LENGTH, StepKey, _parse_sf_string
from ._blobs import BlobStore, FileBlobStore
from ._claim import SCOPE_STATE_KEY, Claim, _wall_ms, reset_current, set_current
from ._records import Binding, InProgress, Outcome, decode_record, digest, encode_outcome
from ._stores import Store

__all__ = [
    "REPLAY_HEADER",
    "IdempotencyMiddleware",
    "KeyFormat",
    "OpaqueKey",
    "PrincipalFunc",
    "in_progress_retry_after",
    "is_storable",
    "route_path",
    "stored_headers",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
PrincipalFunc = Callable[[Scope], "str | Awaitable[str]"]
RoutesFunc = Callable[[Scope], bool]
KeyFormat = Literal["any", "agentkey"]

#: The header every replayed answer carries.
REPLAY_HEADER = "Idempotent-Replayed"

_logger = logging.getLogger("agentkey.server")
_NOT_STORED = frozenset({401, 403, 408, 409, 429})
# Never stored or replayed: per-connection, recomputed, or credentials.
_DROP_HEADERS = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"content-length",
        b"date",
        b"server",
        b"set-cookie",
        REPLAY_HEADER.lower().encode(),
    }
)
_MAX_PRINCIPAL = 128
# The longest a shielded finish/release may hold a cancelled request.
_SETTLE_SECONDS = 10.0
# How often a held duplicate (hold_in_flight) asks the store again: one round trip each.
_HOLD_POLL_SECONDS = 0.1


def is_storable(status: int) -> bool:
    """Whether an answer is final for the key.

    2xx, 3xx (a ``303 See Other`` after a POST reports success) and the 4xx
    that are about the request. Not 401, 403, 408, 409, 429 or any 5xx: those
    depend on the moment, not on the request.
    """
    return 200 <= status < 400 or (400 <= status < 500 and status not in _NOT_STORED)


def _default_principal(scope: Scope) -> str:
    """Starlette's authenticated user's ``identity`` (AuthenticationMiddleware), else ``anonymous``.

    Never the display name: two users may share one, and would share records.
    """
    user = scope.get("user")
    if user is None or not getattr(user, "is_authenticated", False):
        return "anonymous"
    try:
        identity = user.identity
    except (AttributeError, NotImplementedError):
        identity = None
    if not isinstance(identity, str) or not identity:
        raise ConfigurationError(
            f"the authenticated user ({type(user).__name__}) has no str identity to scope "
            "idempotency records by; implement BaseUser.identity or pass principal= to "
            "IdempotencyMiddleware"
        )
    return identity


def stored_headers(raw: Iterable[tuple[bytes, bytes]]) -> tuple[tuple[str, str], ...]:
    """The answer's headers a record keeps: per-connection and credential headers dropped."""
    return tuple(
        (bytes(k).decode("latin-1").lower(), bytes(v).decode("latin-1"))
        for k, v in raw
        if bytes(k).lower() not in _DROP_HEADERS
    )


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


class _Routes:
    """Which route paths are protected; warns once when a pattern looks misplaced."""

    def __init__(self, routes: Collection[str] | RoutesFunc | None) -> None:
        self._func: RoutesFunc | None = None
        self._exact: frozenset[str] = frozenset()
        self._prefixes: tuple[str, ...] = ()
        self._warned = False
        if routes is None:
            self._func = lambda scope: True
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


@dataclass
class _Capture:
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)
    started: bool = False
    finished: bool = False


class IdempotencyMiddleware:
    """Turn a repeated ``Idempotency-Key`` into a replay, never a second side effect.

    Keyword options (production defaults):

    ``store``
        A :class:`Store` (``RedisStore`` in production, ``MemoryStore`` for tests).
    ``routes``
        Paths to protect: exact paths, ``/prefix/*`` patterns, or a callable
        ``(scope) -> bool``. Paths are relative to ``root_path`` (a ``Mount``,
        ``uvicorn --root-path``), as the router matches them. Default: every
        request whose method is in ``methods``.
    ``methods``
        HTTP methods to protect (default ``POST``).
    ``require_key``
        Answer 400 when the key is missing (default). False lets keyless
        requests through unprotected.
    ``key_format``
        ``"any"`` (default): agentkey keys (``<plan>:<step>:<hash>``, checked
        against the body) and opaque keys such as UUIDs or ``ik_...`` (bound to
        a digest of the body). ``"agentkey"``: only agentkey keys.
    ``lock_ttl``
        Seconds a claim's lease lasts (15 s). It is renewed every third of that
        while the handler runs, so a claim whose server died clears within one
        lease.
    ``auto_renew``
        False turns the automatic renewal off: the claim then lives ``lock_ttl``
        unless the handler calls ``claim.renew()`` or ``claim.keep_alive()``
        (set ``lock_ttl`` to the tool's timeout plus slack).
    ``hold_in_flight``
        Seconds a duplicate of a request in flight waits for it to finish and
        then gets its replay, before a 409 (default 0: a 409 at once). Each
        held duplicate asks the store again every 0.1 s and keeps its
        connection open; keep it below your clients' read timeout.
    ``result_ttl``
        Seconds a finished record lives (24 h).
    ``retry_after``
        Seconds sent in ``Retry-After`` with 409 and 503 (default 1). A 409 for
        a claim whose holder stopped renewing says when its lease ends instead.
    ``principal``
        ``(scope) -> str`` (or async): the tenant, user or client the request
        acts for. Records are scoped by it. Default: Starlette's authenticated
        user, else ``"anonymous"`` — set it whenever more than one caller exists.
    ``hash_profile``
        Canonical JSON profile used to re-serialise a body whose bytes do not
        hash to ``args_hash`` directly (``python`` or ``jcs``).
    ``max_inline_bytes``
        Larger response bodies go to ``blob_store`` (default 100 KiB).
    ``blob_store``
        A :class:`BlobStore`; default a :class:`FileBlobStore` in the temp dir
        whose blobs live as long as ``result_ttl``. A ``FileBlobStore`` with a
        shorter ``ttl`` is refused.
    ``max_body_bytes``
        Larger request bodies get 413 (default 1 MiB).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: Store,
        routes: Collection[str] | RoutesFunc | None = None,
        methods: Sequence[str] = ("POST",),
        require_key: bool = True,
        key_format: KeyFormat = "any",
        lock_ttl: float = 15.0,
        auto_renew: bool = True,
        hold_in_flight: float = 0.0,
        result_ttl: float = 86_400.0,
        retry_after: int = 1,
        principal: PrincipalFunc | None = None,
        hash_profile: Profile = "python",
        max_inline_bytes: int = 100 * 1024,
        blob_store: BlobStore | None = None,
        max_body_bytes: int = 1024 * 1024,
    ) -> None:
        if not isinstance(store, Store):
            raise ConfigurationError(
                f"store must implement agentkey.server.Store, got {type(store).__name__}"
            )
        for name, value in (("lock_ttl", lock_ttl), ("result_ttl", result_ttl)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0.001:
                raise ConfigurationError(f"{name} must be a positive number of seconds")
        if (
            isinstance(hold_in_flight, bool)
            or not isinstance(hold_in_flight, (int, float))
            or not 0 <= hold_in_flight <= 60
        ):
            raise ConfigurationError("hold_in_flight must be 0 to 60 seconds")
        if result_ttl < lock_ttl:
            raise ConfigurationError("result_ttl must be at least lock_ttl")
        if isinstance(retry_after, bool) or not isinstance(retry_after, int) or retry_after < 0:
            raise ConfigurationError("retry_after must be a whole number of seconds >= 0")
        if key_format not in ("any", "agentkey"):
            raise ConfigurationError(
                f"key_format must be 'any' (agentkey and opaque keys) or 'agentkey', "
                f"got {key_format!r}"
            )
        for name, size in (
            ("max_inline_bytes", max_inline_bytes),
            ("max_body_bytes", max_body_bytes),
        ):
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ConfigurationError(f"{name} must be a whole number of bytes >= 0")
        if isinstance(methods, str) or not all(isinstance(m, str) and m for m in methods):
            # A bare "POST" would become the methods P, O, S and T and protect nothing.
            raise ConfigurationError(
                f"methods is a collection of HTTP method names, got {methods!r}; use ['POST']"
            )
        if principal is not None and not callable(principal):
            raise ConfigurationError(
                f"principal must be a function (scope) -> str, got {type(principal).__name__}"
            )
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
        self.app = app
        self.store = store
        self._routes = _Routes(routes)
        self.methods = frozenset(m.upper() for m in methods)
        self.require_key = require_key
        self.key_format: KeyFormat = key_format
        self.lock_ttl_ms = max(3, round(lock_ttl * 1000))
        self.auto_renew = bool(auto_renew)
        self.hold_in_flight = float(hold_in_flight)
        self.result_ttl_ms = max(self.lock_ttl_ms, round(result_ttl * 1000))
        self.retry_after = retry_after
        self._principal: PrincipalFunc = principal or _default_principal
        self.hash_profile = check_profile(hash_profile)
        self.max_inline_bytes = max_inline_bytes
        self.max_body_bytes = max_body_bytes
        self._blob_store = blob_store
        self._clock: Callable[[], int] = _wall_ms  # Unix ms; tests inject their own

    @property
    def blob_store(self) -> BlobStore:
        if self._blob_store is None:
            self._blob_store = FileBlobStore(ttl=self.result_ttl_ms / 1000)
        return self._blob_store

    # --- ASGI ----------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = str(scope.get("method", "GET")).upper()
        if scope["type"] != "http" or method not in self.methods:
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        values = [v for k, v in scope.get("headers", ()) if k.lower() == b"idempotency-key"]
        if not self._routes.match(scope, path):
            if values:
                self._routes.passed_unprotected(scope, path)
            await self.app(scope, receive, send)
            return

        if not values:
            if self.require_key:
                await _problem(
                    send,
                    400,
                    "idempotency_key_missing",
                    "this endpoint needs an Idempotency-Key header: "
                    + (
                        "<plan_session_id>:<step>:<args_hash>"
                        if self.key_format == "agentkey"
                        else "a unique value per operation, such as a UUID or "
                        "<plan_session_id>:<step>:<args_hash>"
                    ),
                )
                return
            await self.app(scope, receive, send)
            return
        key = _parse_key(values, opaque=self.key_format == "any")
        if isinstance(key, str):
            await _problem(send, 400, "idempotency_key_invalid", key)
            return

        body = await _read_body(scope, receive, self.max_body_bytes)
        if body is None:
            return  # the client went away
        if isinstance(body, int):
            await _problem(
                send, 413, "body_too_large", f"the request body exceeds {self.max_body_bytes} bytes"
            )
            return
        # The binding names the route with its mount prefix: two mounted apps that share
        # a store both serve "/create", and must never answer with each other's records.
        route = f"{method} {scope.get('root_path', '')}{path}".encode("utf-8", "surrogatepass")
        if isinstance(key, StepKey):
            problem = _check_body(body, key, self.hash_profile)
            if problem is not None:
                await _problem(send, *problem)
                return
            binding = Binding(digest(route))
        else:
            binding = Binding(digest(route), _body_digest(body, self.hash_profile))

        principal = await self._principal_of(scope)
        claim = Claim(
            key=key if isinstance(key, StepKey) else None,
            idempotency_key=key.format(),
            principal=principal,
            record_key=_record_key(principal, key),
            owner=secrets.token_hex(16),
            store=self.store,
            lock_ttl_ms=self.lock_ttl_ms,
            auto_renew=self.auto_renew,
            binding=binding,
            clock=self._clock,
        )
        hold_until = time.monotonic() + self.hold_in_flight
        while True:
            try:
                existing = await self.store.claim(
                    claim.record_key, claim.in_progress_record(), ttl_ms=self.lock_ttl_ms
                )
                record = None if existing is None else decode_record(existing, key=key.format())
                if isinstance(record, InProgress) and record.owner == claim.owner:
                    # Our own claim, read back: the client library re-sent a SET that had
                    # already succeeded (a retry after a timeout). The key is ours, but its
                    # lease started at the first send: renew it now, not a third of a
                    # lease from now.
                    record = None
                    await claim.renew()
            except StoreError as exc:
                _logger.error("idempotency store failed while claiming %s: %s", key.format(), exc)
                await _problem(
                    send,
                    503,
                    "store_unavailable",
                    "the idempotency store is unavailable, so the request was not run; "
                    "retry with the same key",
                    retry_after=self.retry_after,
                )
                return
            if record is not None:
                mismatch = _binding_mismatch(record.binding, binding)
                if mismatch is not None:
                    await _problem(send, 422, *mismatch)
                    return
            left = hold_until - time.monotonic()
            if not isinstance(record, InProgress) or left <= 0:
                break
            # hold_in_flight: wait for the first request, then replay or claim.
            await anyio.sleep(min(_HOLD_POLL_SECONDS, left))
        if isinstance(record, InProgress):
            retry_after, lease_left = in_progress_retry_after(
                record, self._clock(), retry_after=self.retry_after
            )
            where = f"step {key.step_label}" if isinstance(key, StepKey) else "the operation"
            lease = (
                ""
                if lease_left is None
                else f"; if the request holding it stopped (its server may have died), "
                f"its lease ends within {lease_left} s and a retry then runs the step"
            )
            await _problem(
                send,
                409,
                "in_progress",
                f"{where} is already running with this key{lease}; retry with the same "
                "key after Retry-After",
                retry_after=retry_after,
                extra={} if lease_left is None else {"lease_expires_in": lease_left},
            )
            return
        if isinstance(record, Outcome):
            await self._replay(send, record, key.format())
            return
        await self._run(scope, receive, send, body, claim)

    async def _principal_of(self, scope: Scope) -> str:
        value = self._principal(scope)
        if inspect.isawaitable(value):
            value = await value
        if not isinstance(value, str) or not value:
            # The type only: a principal function gone wrong may return a credential.
            raise ConfigurationError(
                "the principal function must return a non-empty str, got "
                + ("an empty str" if value == "" else f"a {type(value).__name__}")
                + "; return the tenant, user or client id of the request"
            )
        return value

    async def _replay(self, send: Send, record: Outcome, key: str) -> None:
        body = record.body
        if record.blob_uri is not None:
            try:
                body = await self.blob_store.get(record.blob_uri)
            except StoreError as exc:
                _logger.error("stored response of %s is unreadable: %s", key, exc)
                await _problem(
                    send,
                    503,
                    "store_unavailable",
                    "the stored response of this key cannot be read right now; "
                    "retry with the same key",
                    retry_after=self.retry_after,
                )
                return
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in record.headers]
        headers.append((b"content-length", str(len(body)).encode()))
        headers.append((REPLAY_HEADER.lower().encode(), b"true"))
        await send({"type": "http.response.start", "status": record.status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _run(
        self, scope: Scope, receive: Receive, send: Send, body: bytes, claim: Claim
    ) -> None:
        capture = _Capture()
        delivered = False

        async def receive_body() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the server's own disconnect

        async def send_through(message: Message) -> None:
            if message["type"] == "http.response.start":
                capture.status = int(message["status"])
                capture.headers = list(message.get("headers", ()))
                capture.started = True
                # The headers may be a one-shot iterable (ASGI allows it): send our copy.
                await send({**message, "headers": capture.headers})
            elif message["type"] == "http.response.body":
                capture.body += message.get("body", b"")
                if message.get("more_body", False):
                    await send(message)
                    return
                capture.finished = True
                await self._finish(claim, capture, error=False)
                await send(message)
            else:
                await send(message)

        state = scope.setdefault("state", {})
        state[SCOPE_STATE_KEY] = claim
        token = set_current(claim)
        if claim.auto_renew and not claim.start_renewing():
            _logger.warning(
                "no asyncio loop runs this request, so the lease on %s is not renewed "
                "automatically; renew it from the handler or raise lock_ttl",
                claim.idempotency_key,
            )
        try:
            await self.app(scope, receive_body, send_through)
        except BaseException:
            if not capture.finished:
                await self._finish(claim, capture, error=True)
            raise
        finally:
            reset_current(token)
            state.pop(SCOPE_STATE_KEY, None)
        if not capture.finished:  # the app returned without a complete response
            await self._finish(claim, capture, error=True)

    async def _finish(self, claim: Claim, capture: _Capture, *, error: bool) -> None:
        """Stop renewing, then settle the claim, shielded: a request cancelled from
        outside (a client gone under an anyio cancel scope, a server shutting down)
        still records FAILED or releases its key, instead of leaving it locked until
        its lease ends and letting a retry repeat a side effect that already began."""
        with anyio.move_on_after(_SETTLE_SECONDS, shield=True) as scope:
            await claim.stop_renewing()
            claim.mark_settled()
            await self._settle(claim, capture, error=error)
        if scope.cancelled_caught:
            _logger.error(
                "settling %s took over %s s and was abandoned; the key stays locked "
                "until its lease (lock_ttl) ends",
                claim.idempotency_key,
                _SETTLE_SECONDS,
            )

    async def _settle(self, claim: Claim, capture: _Capture, *, error: bool) -> None:
        """Record the outcome (compare-and-set on the owner), or release the claim."""
        status = capture.status if capture.started and not error else 500
        key = claim.idempotency_key
        try:
            state: Literal["COMPLETED", "FAILED"]
            if is_storable(status) and not error:
                state = "COMPLETED"
            elif claim.mutation_started:
                state = "FAILED"
            else:
                await self.store.release(claim.record_key, claim.owner)
                return
            outcome = await self._outcome(state, status, capture, claim, error=error)
            encoded = encode_outcome(outcome)
            ttl = self.result_ttl_ms
            stored = await self.store.finish(claim.record_key, claim.owner, encoded, ttl_ms=ttl)
            if not stored:
                # A finish that the client library re-sent after it had succeeded also
                # answers "not owned": the record is then exactly ours, blob and all.
                current = await self.store.get(claim.record_key)
                if current is None:
                    # The lease lapsed (a stalled loop or store) and nobody took the
                    # key: the outcome is still this request's, so record it.
                    current = await self.store.claim(claim.record_key, encoded, ttl_ms=ttl)
                stored = current is None or current == encoded
            if not stored:
                _logger.warning(
                    "the lease on %s lapsed before the handler finished and another request "
                    "owns the key now; this result was not stored (the lease is renewed "
                    "automatically unless auto_renew=False; it lapses when the store or the "
                    "event loop stalls for a whole lock_ttl)",
                    key,
                )
                if outcome.blob_uri is not None:
                    await self.blob_store.delete(outcome.blob_uri)
        except StoreError as exc:
            _logger.error(
                "could not record the outcome of %s (%s); the key stays locked until "
                "its lease (lock_ttl) ends",
                key,
                exc,
            )

    async def _outcome(
        self,
        state: Literal["COMPLETED", "FAILED"],
        status: int,
        capture: _Capture,
        claim: Claim,
        *,
        error: bool,
    ) -> Outcome:
        binding = claim.binding
        if error:
            headers: tuple[tuple[str, str], ...] = (("content-type", _PROBLEM_TYPE),)
            body = _problem_body(
                status,
                "step_failed",
                "the tool failed after its side effect started; the outcome is unknown to "
                "the server and is not retried automatically. Inspect the target system "
                "before running the step again under a new key",
            )
        else:
            headers = stored_headers(capture.headers)
            body = bytes(capture.body)
        now = self._clock()
        if len(body) > self.max_inline_bytes:
            try:
                uri = await self.blob_store.put(body)
            except StoreError as exc:
                # The handler has run: an unrecorded outcome would free the key after
                # its lease and let a retry run the side effect again. Keep it inline.
                _logger.warning(
                    "blob store failed (%s); keeping the %d-byte response inline in the record",
                    exc,
                    len(body),
                )
            else:
                return Outcome(state, status, headers, b"", uri, now, binding)
        return Outcome(state, status, headers, body, None, now, binding)


def in_progress_retry_after(
    record: InProgress, now_ms: int, *, retry_after: int
) -> tuple[int, int | None]:
    """``(Retry-After, seconds until the lease ends or None)`` for a 409 (pure).

    A holder renews every ``renew_ms``; one that let 1.5 renewals pass looks
    stopped (its server may have died), so the client is told to come back when
    its lease ends. Otherwise the configured ``retry_after``, capped by the lease.
    """
    if record.lease_end_ms <= 0:  # a v1 record: nothing known about the lease
        return retry_after, None
    left = max(1, -(-(record.lease_end_ms - now_ms) // 1000))
    if record.renew_ms > 0 and now_ms > record.lease_end_ms - record.renew_ms * 3 // 2:
        return left, left
    return min(retry_after, left), left


# --- request checks (pure) ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OpaqueKey:
    """A key that is not an agentkey key: a UUID, a Stripe-style ``ik_...``.

    It is bound to a digest of the request's canonical body instead of carrying one.
    """

    text: str

    def format(self) -> str:
        return self.text


def _parse_key(values: list[bytes], *, opaque: bool = True) -> StepKey | OpaqueKey | str:
    """The parsed key, or the 400 message.

    A key containing ``:`` claims agentkey's format and must parse as one, so a
    broken agentkey client gets a precise 400 rather than losing its hash check.
    Any other key of 1-255 printable ASCII characters is opaque (when allowed).
    Both header styles, raw and RFC 8941 sf-string, name the same key.
    """
    if len(values) > 1:
        return "send exactly one Idempotency-Key header"
    raw = values[0]
    if len(raw) > 300:
        return f"Idempotency-Key is {len(raw)} bytes; a key is at most {MAX_KEY_LENGTH} characters"
    try:
        text = raw.decode("ascii").strip(" \t")
    except UnicodeDecodeError:
        return "Idempotency-Key must be ASCII"
    try:
        if ":" in text or not opaque:
            return StepKey.parse(text)
        value = _parse_sf_string(text) if text.startswith('"') else text
    except InvalidKey as exc:
        return str(exc) + (
            "" if opaque else "; this server accepts only agentkey keys (key_format='agentkey')"
        )
    if not value.strip(" ") or len(value) > MAX_KEY_LENGTH or not _PRINTABLE.fullmatch(value):
        return _OPAQUE_RULE
    return OpaqueKey(value)


_PRINTABLE = re.compile(r"[\x20-\x7e]+")
_OPAQUE_RULE = (
    f"an Idempotency-Key is 1 to {MAX_KEY_LENGTH} printable ASCII characters; a key "
    "containing ':' must be an agentkey key <plan_session_id>:<step>:<args_hash>"
)


def _body_digest(body: bytes, profile: Profile) -> str:
    """An opaque key's body fingerprint: its canonical JSON when it is a JSON object,
    else its bytes. Equivalent JSON (spacing, member order) is one body."""
    try:
        parsed = json.loads(
            body, parse_constant=_reject_constant, object_pairs_hook=_unique_members
        )
        if isinstance(parsed, dict):
            return digest(b"json:" + canonical_json(parsed, profile=profile))
    except (ValueError, RecursionError, InvalidArguments):
        pass
    return digest(b"bytes:" + body)


def _binding_mismatch(stored: Binding | None, ours: Binding) -> tuple[str, str] | None:
    """The 422 problem when a record is bound to another operation, else None."""
    if stored is None:  # a record written before bindings existed
        return None
    if stored.route != ours.route:
        return (
            "key_reused",
            "this Idempotency-Key was first used with another method or route; a key "
            "belongs to one operation and is never replayed for another. Send this call "
            "with its own key (its own step)",
        )
    if stored.body != ours.body:
        return (
            "payload_mismatch",
            "this Idempotency-Key was first used with another request body; send changed "
            "arguments with a new key",
        )
    return None


def _check_body(body: bytes, key: StepKey, profile: Profile) -> tuple[int, str, str] | None:
    """None when the body is a JSON object hashing to the key's args_hash, else the error."""
    try:
        parsed = json.loads(
            body, parse_constant=_reject_constant, object_pairs_hook=_unique_members
        )
    except _DuplicateMember as exc:
        # Parsers disagree on which duplicate wins (Python keeps the last, others the
        # first), so the hash would not pin down the arguments the handler acts on.
        return (
            400,
            "body_not_json",
            f"the request body repeats the member name {exc.name[:80]!r}; send each name once",
        )
    except (ValueError, RecursionError):
        return 400, "body_not_json", "the request body must be a JSON object (UTF-8)"
    if not isinstance(parsed, dict):
        return (
            400,
            "body_not_json",
            "the request body must be a JSON object, not " + (type(parsed).__name__),
        )
    if hashlib.sha256(body).hexdigest() == key.args_hash:
        return None
    try:
        canonical = canonical_json(parsed, profile=profile)
    except (InvalidArguments, RecursionError):
        return 400, "body_not_json", "the request body holds values canonical JSON cannot carry"
    if hashlib.sha256(canonical).hexdigest() == key.args_hash:
        return None
    return (
        422,
        "args_hash_mismatch",
        f"the body does not hash to the key's args_hash for step {key.step_label}; "
        "recompute the key from the arguments you send",
    )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class _DuplicateMember(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise _DuplicateMember(name)
            seen.add(name)
    return out


def _record_key(principal: str, key: StepKey | OpaqueKey) -> str:
    scoped = quote(principal.encode("utf-8", "surrogatepass"), safe="")
    if len(scoped) > _MAX_PRINCIPAL:
        # "!" is never left bare by quote(), so no short principal can spell this.
        scoped = "!sha256-" + hashlib.sha256(principal.encode("utf-8", "surrogatepass")).hexdigest()
    if isinstance(key, StepKey):
        return f"{scoped}:{key.format()}"
    # Quoted: no brace breaks the Redis Cluster hash tag, and with no ':' left an
    # opaque key can never spell an agentkey key's record.
    return f"{scoped}:{quote(key.text, safe='')}"


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes | int | None:
    """The whole body; its size when over ``limit``; None when the client disconnected."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                if int(value) > limit:
                    return int(value)
            except ValueError:
                pass
    chunks = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks += message.get("body", b"")
        if len(chunks) > limit:
            return len(chunks)
        if not message.get("more_body", False):
            return bytes(chunks)


_PROBLEM_TYPE = "application/problem+json"
_TITLES = {
    "idempotency_key_missing": "Idempotency-Key missing",
    "idempotency_key_invalid": "Idempotency-Key malformed",
    "body_not_json": "Request body is not a JSON object",
    "body_too_large": "Request body too large",
    "args_hash_mismatch": "Request body does not match the key's args_hash",
    "payload_mismatch": "Idempotency-Key reused with another request body",
    "key_reused": "Idempotency-Key reused for another operation",
    "in_progress": "A request with this Idempotency-Key is in progress",
    "store_unavailable": "Idempotency store unavailable",
    "step_failed": "The step failed after its side effect began",
}


def _problem_body(
    status: int, code: str, detail: str, extra: dict[str, Any] | None = None
) -> bytes:
    """RFC 9457 problem details, plus ``"error": <code>`` for clients that read that."""
    doc: dict[str, Any] = {
        "type": f"urn:agentkey:problem:{code}",
        "title": _TITLES[code],
        "status": status,
        "detail": detail,
        "error": code,
        **(extra or {}),
    }
    return json.dumps(doc, separators=(",", ":")).encode()


async def _problem(
    send: Send,
    status: int,
    code: str,
    detail: str,
    *,
    retry_after: int | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    body = _problem_body(status, code, detail, extra)
    headers = [
        (b"content-type", _PROBLEM_TYPE.encode()),
        (b"content-length", str(len(body)).encode()),
    ]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
