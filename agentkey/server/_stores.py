"""Idempotency stores: the Protocol and the in-memory store (Redis: :mod:`._redis`).

A store keeps one value per record key. The middleware encodes records with
:mod:`agentkey.server._records`; an ``IN_PROGRESS`` value always starts with
``P:<owner>:``, so a store can compare-and-set on the owner with a prefix test
and never needs to parse a record.

"""

from __future__ import annotations

import heapq
import threading
from typing import Protocol, runtime_checkable

from .._clock import SYSTEM, Clock
from .._exceptions import ConfigurationError
from .._keys import shown_key

__all__ = ["SETTLE_SECONDS", "MemoryStore", "Store", "after_failure", "owner_prefix", "shown"]

#: The longest the middleware spends settling a claim, retries of a failed write included.
SETTLE_SECONDS = 10.0

_AFTER_FAILURE = {
    "claim": "the request was refused, not run; retry with the same key once the store is back",
    "renew": (
        "the handler is running and its lease was not extended; the renewal is retried, and "
        "if the store stays away for a whole lock_ttl the key is in doubt (a later request "
        "gets 409 in_doubt; with mutation_starts='on_mark', before the mark, it runs again)"
    ),
    "finish": (
        "the handler already ran and its outcome may not be recorded; the middleware retries "
        f"the write for up to {SETTLE_SECONDS:g} s, a retry with the same key gets 409 or 503 "
        "until it lands, and if it never does the key is in doubt once its lease ends"
    ),
    "release": (
        "the handler had not begun its side effect; the key stays locked until its lease "
        "(lock_ttl) ends, then a retry with the same key runs the step"
    ),
    "transaction": (
        "the handler's transaction may or may not have committed, and its record tells: "
        "committed, a retry with the same key gets the replay; not, the retry runs the step"
    ),
}


def shown(record_key: str) -> str:
    """A record key fit for a message or log: the Idempotency-Key as ``shown_key`` shows it
    (never whole: it is a bearer secret), never the principal.

    Record keys are ``<principal>:<key>``; a principal may be an e-mail address or a
    client id that logs must not collect.
    """
    _, sep, key = record_key.partition(":")
    return repr(f"<principal>:{shown_key(key)}" if sep else "<record>")


def after_failure(operation: str) -> str:
    """What a store failure during ``operation`` means for the request, for error messages.

    Only a failed claim refuses a request before its handler runs; a failed renew or
    finish comes while (or after) the handler runs.
    """
    return _AFTER_FAILURE.get(operation, f"the {operation} did not complete")


def owner_prefix(owner: str) -> bytes:
    """The prefix every ``IN_PROGRESS`` value held by ``owner`` starts with."""
    return b"P:" + owner.encode("ascii") + b":"


@runtime_checkable
class Store(Protocol):
    """What the middleware needs from a store. All methods are atomic per key.

    Times are whole milliseconds. Implementations raise
    :class:`~agentkey.StoreUnavailable` when the backend cannot be reached and
    :class:`~agentkey.StoreError` for any other backend failure.
    """

    async def claim(self, key: str, value: bytes, *, ttl_ms: int) -> bytes | None:
        """Set ``key`` to ``value`` for ``ttl_ms`` if absent; return the existing value, or None."""
        ...

    async def renew(self, key: str, owner: str, *, ttl_ms: int) -> bool:
        """Extend the lease of ``owner``'s in-progress record; False if no longer owned."""
        ...

    async def finish(self, key: str, owner: str, value: bytes, *, ttl_ms: int) -> bool:
        """Replace ``owner``'s in-progress record with ``value``; False if no longer owned."""
        ...

    async def release(self, key: str, owner: str) -> bool:
        """Delete ``owner``'s in-progress record so the step can be retried."""
        ...

    async def get(self, key: str) -> bytes | None:
        """The current value of ``key`` (for inspection and tests)."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...


def resolve_clock(clock: Clock | None, owner: str) -> Clock:
    """``clock``, or the system clock when None; a ConfigurationError for anything else
    (the ``time.monotonic``-style function the stores took before :class:`~agentkey.Clock`).

    The server half does not follow ``set_testing()``'s skipping clock: its leases are
    timed by the store (Redis, PostgreSQL) in real seconds, and a clock that jumps over one
    request's waits would age every other request's lease and record. Tests that want the
    server's waits on a fake clock pass ``clock=`` explicitly."""
    if clock is None:
        return SYSTEM
    if not all(callable(getattr(clock, name, None)) for name in ("monotonic", "time", "asleep")):
        raise ConfigurationError(
            f"{owner} clock must be an agentkey Clock (monotonic(), time(), sleep(), asleep(), "
            f"random(): agentkey.testing.FakeClock in tests), got {type(clock).__name__}; "
            "leave it out for the system clock"
        )
    return clock


def _check_ttl(ttl_ms: int) -> int:
    if isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int) or ttl_ms <= 0:
        raise ConfigurationError(f"store TTLs are positive whole milliseconds, got {ttl_ms!r}")
    return ttl_ms


class MemoryStore:
    """An in-process store with the same semantics as :class:`RedisStore`.

    For tests, demos and single-process servers. Records vanish when the
    process exits, so it gives no protection across restarts or replicas.
    Thread-safe; expiry is checked on access, and every write drops the records
    whose time has passed (a heap of expiry times: O(log n) per write), so memory
    follows the live records.

    Leases and record lifetimes are measured on ``clock``'s monotonic time (default: the
    system's); tests pass ``agentkey.testing.FakeClock`` and advance it.
    """

    def __init__(self, *, clock: Clock | None = None) -> None:
        self._clock = resolve_clock(clock, "MemoryStore")
        self._now = self._clock.monotonic  # read on every call: bound once
        self._data: dict[str, tuple[bytes, float]] = {}
        # (expiry, key) of every write; an entry whose key was rewritten since is stale,
        # and is dropped when its time comes without touching the newer record.
        self._expiries: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def _put(self, key: str, value: bytes, expires: float, now: float) -> None:
        """Write under the lock, first dropping every record that has expired by ``now``."""
        expiries, data = self._expiries, self._data
        while expiries and expiries[0][0] <= now:
            _, old = heapq.heappop(expiries)
            item = data.get(old)
            if item is not None and item[1] <= now:
                del data[old]
        data[key] = (value, expires)
        heapq.heappush(expiries, (expires, key))

    def __repr__(self) -> str:
        return f"MemoryStore(records={len(self._data)})"

    def _live(self, key: str, now: float) -> bytes | None:
        item = self._data.get(key)
        if item is None:
            return None
        if item[1] <= now:
            del self._data[key]
            return None
        return item[0]

    async def claim(self, key: str, value: bytes, *, ttl_ms: int) -> bytes | None:
        ttl = ttl_ms if type(ttl_ms) is int and ttl_ms > 0 else _check_ttl(ttl_ms)
        with self._lock:
            now = self._now()
            current = self._live(key, now)
            if current is not None:
                return current
            self._put(key, bytes(value), now + ttl / 1000, now)
            return None

    async def renew(self, key: str, owner: str, *, ttl_ms: int) -> bool:
        ttl = _check_ttl(ttl_ms)
        with self._lock:
            now = self._now()
            current = self._live(key, now)
            if current is None or not current.startswith(owner_prefix(owner)):
                return False
            self._put(key, current, now + ttl / 1000, now)
            return True

    async def finish(self, key: str, owner: str, value: bytes, *, ttl_ms: int) -> bool:
        ttl = ttl_ms if type(ttl_ms) is int and ttl_ms > 0 else _check_ttl(ttl_ms)
        with self._lock:
            now = self._now()
            current = self._live(key, now)
            if current is None or not current.startswith(owner_prefix(owner)):
                return False
            self._put(key, bytes(value), now + ttl / 1000, now)
            return True

    async def release(self, key: str, owner: str) -> bool:
        with self._lock:
            current = self._live(key, self._now())
            if current is None or not current.startswith(owner_prefix(owner)):
                return False
            del self._data[key]
            return True

    async def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._live(key, self._now())

    async def aclose(self) -> None:
        return None
