"""IdempotencyMiddleware: pure ASGI, in front of any Starlette or FastAPI app.

```
request ─▶ key? ─400─▶  body JSON object? ─400/413─▶  hash matches? ─422─▶
        ─▶ claim (one store round trip)
             ├─ store down ............ 503 + Retry-After, handler never runs
             ├─ IN_PROGRESS ........... 409 + Retry-After, at once
             ├─ COMPLETED / FAILED .... replay status, headers, body + Idempotent-Replayed: true
             └─ claimed ─▶ handler ─▶ finish (compare-and-set on the owner token)
                    storable answer (2xx, 3xx, request 4xx) ... COMPLETED
                    other answer or exception, mutation begun .. FAILED
                    other answer or exception, no mutation ..... released (retry is safe)
```
The final chunk of a response is held back until its record is written, so a
client never holds a result the store does not know about.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Collection, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import quote

import anyio

from .._canonical import Profile, canonical_json, check_profile
from .._exceptions import ConfigurationError, InvalidArguments, InvalidKey, StoreError
from .._keys import StepKey
from ._blobs import BlobStore, FileBlobStore
from ._claim import SCOPE_STATE_KEY, Claim, reset_current, set_current
from ._records import InProgress, Outcome, decode_record, encode_in_progress, encode_outcome
from ._stores import Store

__all__ = ["REPLAY_HEADER", "IdempotencyMiddleware", "PrincipalFunc", "is_storable"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
PrincipalFunc = Callable[[Scope], "str | Awaitable[str]"]
RoutesFunc = Callable[[Scope], bool]

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


def _route_matcher(routes: Collection[str] | RoutesFunc | None) -> RoutesFunc:
    if routes is None:
        return lambda scope: True
    if callable(routes):
        return routes
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
    prefixes = tuple(r.rstrip("/") for r in routes if r.endswith("/*"))
    exact = frozenset(r for r in routes if not r.endswith("/*"))

    def match(scope: Scope) -> bool:
        path: str = scope.get("path", "")
        return path in exact or any(path.startswith(p[:-1]) for p in prefixes)

    return match


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
        ``(scope) -> bool``. Default: every request whose method is in ``methods``.
    ``methods``
        HTTP methods to protect (default ``POST``).
    ``require_key``
        Answer 400 when the key is missing (default). False lets keyless
        requests through unprotected.
    ``lock_ttl``, ``result_ttl``
        Seconds an in-progress claim and a finished record live (120 s, 24 h).
    ``retry_after``
        Seconds sent in ``Retry-After`` with 409 and 503 (default 1).
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
        A :class:`BlobStore`; default a :class:`FileBlobStore` in the temp dir.
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
        lock_ttl: float = 120.0,
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
        if result_ttl < lock_ttl:
            raise ConfigurationError("result_ttl must be at least lock_ttl")
        if isinstance(retry_after, bool) or not isinstance(retry_after, int) or retry_after < 0:
            raise ConfigurationError("retry_after must be a whole number of seconds >= 0")
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
        self.app = app
        self.store = store
        self._match = _route_matcher(routes)
        self.methods = frozenset(m.upper() for m in methods)
        self.require_key = require_key
        self.lock_ttl_ms = max(1, round(lock_ttl * 1000))
        self.result_ttl_ms = max(1, round(result_ttl * 1000))
        self.retry_after = retry_after
        self._principal: PrincipalFunc = principal or _default_principal
        self.hash_profile = check_profile(hash_profile)
        self.max_inline_bytes = max_inline_bytes
        self.max_body_bytes = max_body_bytes
        self._blob_store = blob_store

    @property
    def blob_store(self) -> BlobStore:
        if self._blob_store is None:
            self._blob_store = FileBlobStore()
        return self._blob_store

    # --- ASGI ----------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method", "GET").upper() not in self.methods
            or not self._match(scope)
        ):
            await self.app(scope, receive, send)
            return

        values = [v for k, v in scope.get("headers", ()) if k.lower() == b"idempotency-key"]
        if not values:
            if self.require_key:
                await _error(
                    send,
                    400,
                    "idempotency_key_missing",
                    "this endpoint needs an Idempotency-Key header: "
                    "<plan_session_id>:<step>:<args_hash>",
                )
                return
            await self.app(scope, receive, send)
            return
        key = _parse_key(values)
        if isinstance(key, str):
            await _error(send, 400, "idempotency_key_invalid", key)
            return

        body = await _read_body(scope, receive, self.max_body_bytes)
        if body is None:
            return  # the client went away
        if isinstance(body, int):
            await _error(
                send, 413, "body_too_large", f"the request body exceeds {self.max_body_bytes} bytes"
            )
            return
        problem = _check_body(body, key, self.hash_profile)
        if problem is not None:
            await _error(send, *problem)
            return

        principal = await self._principal_of(scope)
        record_key = _record_key(principal, key)
        owner = secrets.token_hex(16)
        try:
            existing = await self.store.claim(
                record_key,
                encode_in_progress(owner, int(time.time() * 1000)),
                ttl_ms=self.lock_ttl_ms,
            )
            record = None if existing is None else decode_record(existing, key=key.format())
        except StoreError as exc:
            _logger.error("idempotency store failed while claiming %s: %s", key.format(), exc)
            await _error(
                send,
                503,
                "store_unavailable",
                "the idempotency store is unavailable, so the request was not run; "
                "retry with the same key",
                retry_after=self.retry_after,
            )
            return

        if isinstance(record, InProgress) and record.owner == owner:
            # Our own claim, read back: the client library re-sent a SET that had
            # already succeeded (a retry after a timeout). The key is ours.
            record = None
        if isinstance(record, InProgress):
            await _error(
                send,
                409,
                "in_progress",
                f"step {key.step_label} is already running with this key; retry "
                "with the same key after Retry-After",
                retry_after=self.retry_after,
            )
            return
        if isinstance(record, Outcome):
            await self._replay(send, record, key)
            return

        claim = Claim(
            key=key,
            principal=principal,
            record_key=record_key,
            owner=owner,
            store=self.store,
            lock_ttl_ms=self.lock_ttl_ms,
        )
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

    async def _replay(self, send: Send, record: Outcome, key: StepKey) -> None:
        body = record.body
        if record.blob_uri is not None:
            try:
                body = await self.blob_store.get(record.blob_uri)
            except StoreError as exc:
                _logger.error("stored response of %s is unreadable: %s", key.format(), exc)
                await _error(
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
        """Settle the claim, shielded: a request cancelled from outside (a client gone
        under an anyio cancel scope, a server shutting down) still records FAILED or
        releases its key, instead of leaving it locked until lock_ttl and letting a
        retry repeat a side effect that already began."""
        with anyio.move_on_after(_SETTLE_SECONDS, shield=True) as scope:
            await self._settle(claim, capture, error=error)
        if scope.cancelled_caught:
            _logger.error(
                "settling %s took over %s s and was abandoned; the key stays locked "
                "until lock_ttl passes",
                claim.key.format(),
                _SETTLE_SECONDS,
            )

    async def _settle(self, claim: Claim, capture: _Capture, *, error: bool) -> None:
        """Record the outcome (compare-and-set on the owner), or release the claim."""
        status = capture.status if capture.started and not error else 500
        key = claim.key.format()
        try:
            state: Literal["COMPLETED", "FAILED"]
            if is_storable(status) and not error:
                state = "COMPLETED"
            elif claim.mutation_started:
                state = "FAILED"
            else:
                await self.store.release(claim.record_key, claim.owner)
                return
            outcome = await self._outcome(state, status, capture, error=error)
            encoded = encode_outcome(outcome)
            stored = await self.store.finish(
                claim.record_key, claim.owner, encoded, ttl_ms=self.result_ttl_ms
            )
            if not stored:
                # A finish that the client library re-sent after it had succeeded also
                # answers "not owned": the record is then exactly ours, blob and all.
                stored = await self.store.get(claim.record_key) == encoded
            if not stored:
                _logger.warning(
                    "the lease on %s expired before the handler finished and another request "
                    "owns the key now; this result was not stored (raise lock_ttl or use "
                    "claim.keep_alive())",
                    key,
                )
                if outcome.blob_uri is not None:
                    await self.blob_store.delete(outcome.blob_uri)
        except StoreError as exc:
            _logger.error(
                "could not record the outcome of %s (%s); the key stays locked until "
                "lock_ttl passes",
                key,
                exc,
            )

    async def _outcome(
        self,
        state: Literal["COMPLETED", "FAILED"],
        status: int,
        capture: _Capture,
        *,
        error: bool,
    ) -> Outcome:
        if error:
            headers: tuple[tuple[str, str], ...] = (("content-type", "application/json"),)
            body = json.dumps(
                {
                    "error": "step_failed",
                    "detail": "the tool failed after its side effect started; the outcome "
                    "is unknown to the server and is not retried automatically. Inspect "
                    "the target system before running the step again under a new key",
                }
            ).encode()
        else:
            headers = tuple(
                (k.decode("latin-1").lower(), v.decode("latin-1"))
                for k, v in capture.headers
                if k.lower() not in _DROP_HEADERS
            )
            body = bytes(capture.body)
        now = int(time.time() * 1000)
        if len(body) > self.max_inline_bytes:
            try:
                uri = await self.blob_store.put(body)
            except StoreError as exc:
                # The handler has run: an unrecorded outcome would free the key after
                # lock_ttl and let a retry run the side effect again. Keep it inline.
                _logger.warning(
                    "blob store failed (%s); keeping the %d-byte response inline in the record",
                    exc,
                    len(body),
                )
            else:
                return Outcome(state, status, headers, b"", uri, now)
        return Outcome(state, status, headers, body, None, now)


# --- request checks (pure) ------------------------------------------------------


def _parse_key(values: list[bytes]) -> StepKey | str:
    """The parsed key, or the 400 message."""
    if len(values) > 1:
        return "send exactly one Idempotency-Key header"
    raw = values[0]
    if len(raw) > 300:
        return f"Idempotency-Key is {len(raw)} bytes; a key is at most 255 characters"
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        return "Idempotency-Key must be ASCII: <plan_session_id>:<step>:<args_hash>"
    try:
        return StepKey.parse(text.strip(" \t"))
    except InvalidKey as exc:
        return str(exc)


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


def _record_key(principal: str, key: StepKey) -> str:
    scoped = quote(principal.encode("utf-8", "surrogatepass"), safe="")
    if len(scoped) > _MAX_PRINCIPAL:
        # "!" is never left bare by quote(), so no short principal can spell this.
        scoped = "!sha256-" + hashlib.sha256(principal.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{scoped}:{key.format()}"


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


async def _error(
    send: Send, status: int, code: str, detail: str, *, retry_after: int | None = None
) -> None:
    body = json.dumps({"error": code, "detail": detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
