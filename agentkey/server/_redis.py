"""RedisStore: the Store protocol on Redis >= 7, Valkey or Redis Cluster (``redis.asyncio``).

Loaded on first use of ``agentkey.server.RedisStore``: it needs redis-py, which
``MemoryStore`` users need not install.

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
import sys
from collections.abc import Awaitable
from typing import Any, TypeVar

from .._exceptions import ConfigurationError, MissingExtra, StoreError, StoreUnavailable
from ._stores import _check_ttl, after_failure, owner_prefix, shown

try:
    from redis import asyncio as aioredis
    from redis import exceptions as redis_errors
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialWithJitterBackoff
    from redis.commands.core import AsyncScript
except ImportError:  # pragma: no cover - exercised in a subprocess test
    raise MissingExtra("server", "redis") from None

_T = TypeVar("_T")

if sys.version_info >= (3, 11):

    async def _bounded(awaitable: Awaitable[_T], seconds: float) -> _T:
        """``asyncio.wait_for`` without its task: one timer."""
        async with asyncio.timeout(seconds):
            return await awaitable

else:  # pragma: no cover - Python 3.10
    _bounded = asyncio.wait_for

__all__ = ["HEALTH_CHECK_INTERVAL", "RETRIES", "RedisStore"]

_logger = logging.getLogger("agentkey.server")

#: Seconds a pooled connection may sit idle before it is PINGed ahead of its next command.
HEALTH_CHECK_INTERVAL = 30
#: Re-sends of a command whose connection broke or timed out (a stale pooled connection
#: after a Redis restart or its idle ``timeout``), after a jittered wait of up to 0.1 s, on
#: a fresh connection. One is enough for a stale connection; redis-py retries the connection
#: handshake with the same policy, so a Redis that stops answering costs (1 + RETRIES) ** 2
#: timeouts before the store gives up, and more retries would multiply that.
RETRIES = 1


def _pack(args: tuple[bytes, ...]) -> bytes:
    """One command in RESP: an array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        parts += (b"$%d\r\n" % len(arg), arg, b"\r\n")
    return b"".join(parts)


class _Lean:
    """Commands on the store's own pool, without redis-py's per-command layers.

    ``Redis.execute_command`` checks a connection out of the pool and back for every
    command (a condition, a lock and a timer each way), arms a timer and a task per
    send and another timer per read, and records observability metrics: about 160 us
    of CPU per command here, against 70 us for a connection's own
    ``send_packed_command`` + ``read_response``. So the store keeps its idle
    connections itself (at most ``max_connections``, a burst waiting up to
    ``timeout`` for one), sends pre-packed commands, and bounds each command, send
    and read together, by one deadline. A connection error or timeout is retried by
    the connection's own ``Retry`` (``RETRIES``), as redis-py does.
    """

    def __init__(self, pool: Any, timeout: float, max_connections: int) -> None:
        self.pool, self.timeout = pool, timeout
        # redis-py < 5.1 requires a command name here; later versions warn about one.
        name = inspect.signature(pool.get_connection).parameters.get("command_name")
        self._checkout: tuple[str, ...] = ("SET",) if name and name.default is name.empty else ()
        self._idle: list[Any] = []
        self._slots = asyncio.Semaphore(max_connections)

    async def execute(self, *args: bytes) -> Any:
        packed = _pack(args)
        if self._slots.locked():  # every connection is busy: wait for one, up to timeout
            try:
                await _bounded(self._slots.acquire(), self.timeout)
            except asyncio.TimeoutError:
                raise redis_errors.ConnectionError("no Redis connection came free") from None
        else:
            await self._slots.acquire()
        try:
            conn = (
                self._idle.pop() if self._idle else await self.pool.get_connection(*self._checkout)
            )
            try:
                return await conn.retry.call_with_retry(
                    lambda: self._send(conn, packed), lambda error: conn.disconnect()
                )
            finally:
                self._idle.append(conn)
        finally:
            self._slots.release()

    async def _send(self, conn: Any, packed: bytes) -> Any:
        try:
            return await _bounded(self._exchange(conn, packed), self.timeout)
        except asyncio.TimeoutError:
            await conn.disconnect(nowait=True)  # an answer may still come: never reuse it
            raise redis_errors.TimeoutError("Redis did not answer in time") from None

    @staticmethod
    async def _exchange(conn: Any, packed: bytes) -> Any:
        await conn.send_packed_command(packed)
        return await conn.read_response()

    async def evalsha(self, script: AsyncScript, *args: bytes) -> Any:
        try:
            return await self.execute(b"EVALSHA", script.sha.encode(), b"1", *args)
        except redis_errors.NoScriptError:  # a fresh or restarted Redis: load it once
            source = script.script
            await self.execute(
                b"SCRIPT", b"LOAD", source.encode() if isinstance(source, str) else bytes(source)
            )
            return await self.execute(b"EVALSHA", script.sha.encode(), b"1", *args)


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
    ``<prefix>:{<principal>:<idempotency key>}``. From a URL the store keeps up
    to ``max_connections`` connections of its own, so a burst waits up to
    ``timeout`` seconds for a free one instead of failing, and each command (its
    send and its answer) must finish within ``timeout``. Its connections re-send a
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
                socket_timeout=None,  # _Lean bounds each command, send and read together
                retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), RETRIES),
                retry_on_error=[redis_errors.ConnectionError, redis_errors.TimeoutError],
                health_check_interval=HEALTH_CHECK_INTERVAL,
            )
            self._client: Any = aioredis.Redis.from_pool(pool)
            self._lean: _Lean | None = _Lean(pool, timeout, max_connections)
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
            self._lean = None
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
                f"({type(exc).__name__}): {after_failure(what)}. "
                "Check that Redis is up and reachable"
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
                f"({type(exc).__name__}): {after_failure(what)}"
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
            if self._lean is None:
                config = await self._client.config_get("appendonly")
            else:
                config = await self._lean.execute(b"CONFIG", b"GET", b"appendonly")
                if isinstance(config, list):  # RESP2: [name, value]
                    config = dict(zip(config[::2], config[1::2], strict=True))
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

    async def _script(self, script: AsyncScript, key: str, *args: bytes) -> Any:
        rkey = self.redis_key(key)
        if self._lean is None:
            return await script(keys=[rkey], args=list(args))
        return await self._lean.evalsha(script, rkey.encode(), *args)

    async def claim(self, key: str, value: bytes, *, ttl_ms: int) -> bytes | None:
        ttl = _check_ttl(ttl_ms)
        self._start_persistence_check()
        rkey = self.redis_key(key)
        # Redis >= 7: NX and GET together; one round trip claims or reads.
        if self._lean is None:
            command = self._client.execute_command(
                "SET", rkey, value, "NX", "PX", ttl, "GET", get=True
            )
        else:
            command = self._lean.execute(
                b"SET", rkey.encode(), value, b"NX", b"PX", b"%d" % ttl, b"GET"
            )
        result = await self._run("claim", key, command)
        return None if result is None else bytes(result)

    async def renew(self, key: str, owner: str, *, ttl_ms: int) -> bool:
        ttl = b"%d" % _check_ttl(ttl_ms)
        done = await self._run(
            "renew", key, self._script(self._renew, key, owner_prefix(owner), ttl)
        )
        return bool(done)

    async def finish(self, key: str, owner: str, value: bytes, *, ttl_ms: int) -> bool:
        ttl = b"%d" % _check_ttl(ttl_ms)
        prefix = owner_prefix(owner)
        done = await self._run("finish", key, self._script(self._finish, key, prefix, value, ttl))
        return bool(done)

    async def release(self, key: str, owner: str) -> bool:
        done = await self._run(
            "release", key, self._script(self._release, key, owner_prefix(owner))
        )
        return bool(done)

    async def get(self, key: str) -> bytes | None:
        rkey = self.redis_key(key)
        if self._lean is None:
            command = self._client.get(rkey)
        else:
            command = self._lean.execute(b"GET", rkey.encode())
        result = await self._run("get", key, command)
        return None if result is None else bytes(result)

    async def aclose(self) -> None:
        check, loop = self._persistence_check, asyncio.get_running_loop()
        if check is not None and not check.done() and check.get_loop() is loop:
            check.cancel()
            await asyncio.gather(check, return_exceptions=True)
        if self._lean is not None:
            await self._client.aclose()
