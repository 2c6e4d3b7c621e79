"""Idempotency stores: one Protocol, an in-memory store and a Redis store.

A store keeps one value per record key. The middleware encodes records with
:mod:`agentkey.server._records`; an ``IN_PROGRESS`` value always starts with
``P:<owner>:``, so a store can compare-and-set on the owner with a prefix test
and never needs to parse a record.

Every operation touches exactly one key, so Redis Cluster and Valkey work
unchanged. Round trips per call on :class:`RedisStore`:

=========  ======================================  ============
operation  command                                 round trips
=========  ======================================  ============
claim      ``SET key value NX PX ttl GET``          1
renew      Lua compare-and-``PEXPIRE``              1
finish     Lua compare-and-``SET … PX``             1
release    Lua compare-and-``DEL``                  1
=========  ======================================  ============

(The first use of a Lua script on a fresh Redis adds one ``SCRIPT LOAD``.)
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from typing import Any, Protocol, runtime_checkable

from redis import asyncio as aioredis
from redis import exceptions as redis_errors
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.commands.core import AsyncScript

from .._exceptions import ConfigurationError, StoreError, StoreUnavailable

__all__ = ["MemoryStore", "RedisStore", "Store", "owner_prefix", "shown"]

_logger = logging.getLogger("agentkey.server")

#: Seconds a pooled connection may sit idle before it is PINGed ahead of its next command.
HEALTH_CHECK_INTERVAL = 30
#: Re-sends of a command whose connection broke or timed out (a stale pooled connection
#: after a Redis restart or its idle ``timeout``), after a jittered wait of up to 0.1 s, on
#: a fresh connection. One is enough for a stale connection; redis-py retries the connection
#: handshake with the same policy, so a Redis that stops answering costs (1 + RETRIES) ** 2
#: timeouts before the store gives up, and more retries would multiply that.
RETRIES = 1


def shown(record_key: str) -> str:
    """A record key fit for a message or log: the Idempotency-Key, never the principal.

    Record keys are ``<principal>:<key>``; a principal may be an e-mail address or a
    client id that logs must not collect.
    """
    _, sep, key = record_key.partition(":")
    return repr(f"<principal>:{key}" if sep else "<record>")


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


def _check_ttl(ttl_ms: int) -> int:
    if isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int) or ttl_ms <= 0:
        raise ConfigurationError(f"store TTLs are positive whole milliseconds, got {ttl_ms!r}")
    return ttl_ms


class MemoryStore:
    """An in-process store with the same semantics as :class:`RedisStore`.

    For tests, demos and single-process servers. Records vanish when the
    process exits, so it gives no protection across restarts or replicas.
    Thread-safe; expiry is checked on access, and every ``SWEEP_EVERY`` claims
    all expired records are dropped, so memory stays bounded by the live records.
    """

    #: Claims between two sweeps of expired records (amortised O(1) per claim).
    SWEEP_EVERY = 1024

    def __init__(self) -> None:
        self._data: dict[str, tuple[bytes, float]] = {}
        self._lock = threading.Lock()
        self._claims = 0

    def _sweep(self, now: float) -> None:
        """Drop every expired record: keys never read again must not pile up forever."""
        for key in [k for k, (_, expires) in self._data.items() if expires <= now]:
            del self._data[key]

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
        ttl = _check_ttl(ttl_ms)
        with self._lock:
            now = time.monotonic()
            self._claims += 1
            if self._claims % self.SWEEP_EVERY == 0:
                self._sweep(now)
            current = self._live(key, now)
            if current is not None:
                return current
            self._data[key] = (bytes(value), now + ttl / 1000)
            return None

    async def renew(self, key: str, owner: str, *, ttl_ms: int) -> bool:
        ttl = _check_ttl(ttl_ms)
        with self._lock:
            now = time.monotonic()
            current = self._live(key, now)
            if current is None or not current.startswith(owner_prefix(owner)):
                return False
            self._data[key] = (current, now + ttl / 1000)
            return True

    async def finish(self, key: str, owner: str, value: bytes, *, ttl_ms: int) -> bool:
        ttl = _check_ttl(ttl_ms)
        with self._lock:
            now = time.monotonic()
            current = self._live(key, now)
            if current is None or not current.startswith(owner_prefix(owner)):
                return False
            self._data[key] = (bytes(value), now + ttl / 1000)
            return True

    async def release(self, key: str, owner: str) -> bool:
        with self._lock:
            current = self._live(key, time.monotonic())
            if current is None or not current.startswith(owner_prefix(owner)):
                return False
            del self._data[key]
            return True

    async def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._live(key, time.monotonic())

    async def aclose(self) -> None:
        return None


def _text(value: object) -> str | None:
    return value.decode() if isinstance(value, bytes) else value if isinstance(value, str) else None


# KEYS[1] record key; ARGV[1] owner prefix; then per script.
_RENEW = """
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, string.len(ARGV[1])) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
_FINISH = """
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, string.len(ARGV[1])) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"""
_RELEASE = """
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, string.len(ARGV[1])) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""


class RedisStore:
    """A store on Redis >= 7 (or Valkey, or Redis Cluster) through ``redis.asyncio``.

    Pass a URL (``redis://…``, ``rediss://…``) or a ready client
    (``redis.asyncio.Redis`` or ``redis.asyncio.RedisCluster``). Record keys become
    ``<prefix>:{<principal>:<idempotency key>}``. From a URL the store opens a
    blocking pool of ``max_connections``, so a burst waits up to ``timeout``
    seconds for a free connection instead of failing. Its connections re-send a
    command ``RETRIES`` time(s) after a connection error or timeout (a
    connection Redis closed, by a restart or its idle ``timeout``, reconnects
    instead of failing) and PING first when idle for ``HEALTH_CHECK_INTERVAL``
    seconds. A re-sent write is safe: a re-sent claim reads back its own owner
    token and a re-sent finish finds its own record (the middleware checks both).
    Connection problems that outlast the retries raise
    :class:`~agentkey.StoreUnavailable`; the middleware then answers 503 and
    never runs the handler.

    Beside its first claim (never delaying it) the store asks Redis for
    ``appendonly`` and logs one WARNING when it is ``no``: a restart then loses
    finished records, and a retry of their steps runs them again.
    """

    def __init__(
        self,
        redis: str | Any,
        *,
        prefix: str = "agentkey",
        connect_timeout: float = 2.0,
        timeout: float = 5.0,
        max_connections: int = 50,
    ) -> None:
        if not isinstance(prefix, str) or not prefix or any(c in prefix for c in "{}"):
            raise ConfigurationError(
                f"RedisStore prefix must be a non-empty str without braces, got {prefix!r}"
            )
        self.prefix = prefix
        if isinstance(redis, str):
            if not redis.startswith(("redis://", "rediss://", "unix://")):
                raise ConfigurationError(
                    "RedisStore needs a redis://, rediss:// or unix:// URL or a "
                    "redis.asyncio client"
                )
            # A blocking pool queues a burst for a free connection (up to
            # ``timeout``) instead of failing it with MaxConnectionsError.
            pool = aioredis.BlockingConnectionPool.from_url(
                redis,
                max_connections=max_connections,
                timeout=timeout,
                socket_connect_timeout=connect_timeout,
                socket_timeout=timeout,
                retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), RETRIES),
                retry_on_error=[redis_errors.ConnectionError, redis_errors.TimeoutError],
                health_check_interval=HEALTH_CHECK_INTERVAL,
            )
            self._client: Any = aioredis.Redis.from_pool(pool)
            self._owns_client = True
        else:
            # A sync client would block the event loop and fail outside the
            # StoreError mapping (a 500 instead of the fail-closed 503).
            if not inspect.iscoroutinefunction(getattr(redis, "execute_command", None)):
                raise ConfigurationError(
                    f"RedisStore needs a URL or a redis.asyncio client (Redis or RedisCluster), "
                    f"got {type(redis).__module__}.{type(redis).__name__}; a synchronous "
                    "redis.Redis would block the server's event loop"
                )
            self._client = redis
            self._owns_client = False
        self._renew: AsyncScript = self._client.register_script(_RENEW)
        self._finish: AsyncScript = self._client.register_script(_FINISH)
        self._release: AsyncScript = self._client.register_script(_RELEASE)
        self._persistence_check: asyncio.Task[None] | None = None

    def __repr__(self) -> str:  # never shows the URL: it may carry a password
        return f"RedisStore(prefix={self.prefix!r})"

    async def _run(self, what: str, key: str, coro: Any) -> Any:
        """Await ``coro`` (an operation on record ``key``), translating redis-py's errors."""
        try:
            return await coro
        except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError) as exc:
            raise StoreUnavailable(
                f"Redis could not be reached during {what} of record {shown(key)} "
                f"({type(exc).__name__}); the request was refused, not run. "
                "Check that Redis is up and reachable, then retry with the same key"
            ) from None
        except redis_errors.RedisError as exc:
            raise StoreError(
                f"Redis failed during {what} of record {shown(key)}: {type(exc).__name__}: {exc}"
            ) from None
        except Exception as exc:
            # A bug inside the client library (redis-py's cluster client can raise
            # AttributeError on a connection closed under load) must still fail
            # closed with a 503, not escape as a 500 or break the finish.
            raise StoreError(
                f"the Redis client failed unexpectedly during {what} of record {shown(key)} "
                f"({type(exc).__name__}); the request was refused, not run"
            ) from None

    def redis_key(self, key: str) -> str:
        """The Redis key of record ``key``: ``<prefix>:{<key>}``.

        The braces are a Cluster hash tag: the record and anything ever stored
        beside it hash to one slot.
        """
        return f"{self.prefix}:{{{key}}}"

    def _start_persistence_check(self) -> None:
        """Ask once, beside the first claim: never on a claim's path, where a slow answer
        would delay a handler whose lease is already running."""
        if self._persistence_check is None:
            self._persistence_check = asyncio.get_running_loop().create_task(
                self._check_persistence()
            )

    async def _check_persistence(self) -> None:
        """Warn once when Redis keeps records only in memory; never fail anything over it."""
        try:
            config = await self._client.config_get("appendonly")
            # A cluster client may answer per node: {node: {"appendonly": ...}}.
            answers = [v for v in config.values() if isinstance(v, dict)] or [config]
            values = {_text(a.get("appendonly", a.get(b"appendonly"))) for a in answers}
        except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError):
            self._persistence_check = None  # unreachable: ask again with the next claim
            return
        except Exception as exc:  # CONFIG refused or renamed, as on managed Redis
            _logger.debug("could not read Redis's appendonly setting: %s", type(exc).__name__)
            return
        if "no" in values:
            _logger.warning(
                "Redis runs without persistence (appendonly no) under RedisStore(prefix=%r): "
                "a Redis restart loses every finished record, and a retry of those steps "
                "runs them again; set appendonly yes with appendfsync always",
                self.prefix,
            )

    async def claim(self, key: str, value: bytes, *, ttl_ms: int) -> bytes | None:
        ttl = _check_ttl(ttl_ms)
        self._start_persistence_check()
        rkey = self.redis_key(key)
        # Redis >= 7: NX and GET together; one round trip claims or reads.
        result = await self._run(
            "claim",
            key,
            self._client.execute_command("SET", rkey, value, "NX", "PX", ttl, "GET", get=True),
        )
        return None if result is None else bytes(result)

    async def renew(self, key: str, owner: str, *, ttl_ms: int) -> bool:
        ttl = _check_ttl(ttl_ms)
        rkey = self.redis_key(key)
        done = await self._run(
            "renew", key, self._renew(keys=[rkey], args=[owner_prefix(owner), ttl])
        )
        return bool(done)

    async def finish(self, key: str, owner: str, value: bytes, *, ttl_ms: int) -> bool:
        ttl = _check_ttl(ttl_ms)
        rkey = self.redis_key(key)
        done = await self._run(
            "finish", key, self._finish(keys=[rkey], args=[owner_prefix(owner), value, ttl])
        )
        return bool(done)

    async def release(self, key: str, owner: str) -> bool:
        rkey = self.redis_key(key)
        done = await self._run(
            "release", key, self._release(keys=[rkey], args=[owner_prefix(owner)])
        )
        return bool(done)

    async def get(self, key: str) -> bytes | None:
        result = await self._run("get", key, self._client.get(self.redis_key(key)))
        return None if result is None else bytes(result)

    async def aclose(self) -> None:
        check, loop = self._persistence_check, asyncio.get_running_loop()
        if check is not None and not check.done() and check.get_loop() is loop:
            check.cancel()
            await asyncio.gather(check, return_exceptions=True)
        if self._owns_client:
            await self._client.aclose()
