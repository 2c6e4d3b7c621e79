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
import warnings
from collections import deque
from typing import Any

from .._exceptions import ConfigurationError, MissingExtra, StoreError, StoreUnavailable
from .._schedule import Backoff
from ._resp import PUSH, ProtocolError, Replies, ReplyError, pack
from ._stores import _check_ttl, after_failure, owner_prefix, shown

try:
    from redis import asyncio as aioredis
    from redis import exceptions as redis_errors
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialWithJitterBackoff
    from redis.commands.core import AsyncScript
except ImportError:  # pragma: no cover - exercised in a subprocess test
    raise MissingExtra("server", "redis") from None

__all__ = ["RETRIES", "RedisStore"]

#: The wait before a command is re-sent: full jitter up to 0.1 s.
_RESEND = Backoff(initial=0.1, cap=0.1)

_logger = logging.getLogger("agentkey.server")

#: Re-sends of a command whose connection broke or timed out (a connection Redis closed
#: by a restart or its idle ``timeout``), after a jittered wait of up to 0.1 s, on a new
#: connection. One is enough for a stale connection; redis-py retries the connection
#: handshake with the same policy, so a Redis that stops answering costs
#: (1 + RETRIES) ** 2 timeouts before the store gives up, and more would multiply that.
RETRIES = 1


class _Pipe(asyncio.Protocol):
    """One Redis connection that carries the commands of every request on its event loop.

    A command on an idle connection is written at once; while others are in flight, the
    commands of one loop iteration go out in one write. Redis answers in order, so each
    answer resolves the oldest waiting future: no pool checkout, no task and no timer
    per command, and one system call for many requests under load. A reply nobody waits
    for, a protocol error or a lost connection fails every command in flight with a
    ``ConnectionError`` and closes the pipe; the next command opens a new one. A
    watchdog closes the pipe when its oldest command has waited ``timeout`` seconds
    (Redis is stuck, or the connection died without a word), so no command waits much
    longer than that.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self.loop, self.timeout = loop, timeout
        self.closed = False
        self._replies = Replies()
        self._waiting: deque[tuple[asyncio.Future[Any], float]] = deque()
        self._out: list[bytes] | None = None  # commands gathered for the next write
        self._transport: asyncio.Transport | None = None
        self._conn: Any = None
        self._watch: asyncio.TimerHandle | None = None

    def attach(self, conn: Any) -> None:
        """Take over the socket of a redis-py connection that has done its handshake."""
        transport = conn._writer.transport
        self._conn, self._transport = conn, transport
        transport.set_protocol(self)

    def send(self, packed: bytes) -> asyncio.Future[Any]:
        if self.closed:
            raise redis_errors.ConnectionError("the Redis connection closed")
        loop = self.loop
        future = loop.create_future()
        busy = bool(self._waiting)
        self._waiting.append((future, loop.time() + self.timeout))
        if self._out is not None:  # others wait to go out: after them, in order
            self._out.append(packed)
        elif busy:  # commands in flight (under load): gather this iteration's into one write
            self._out = [packed]
            loop.call_soon(self._flush)
        else:  # an idle connection: no reason to wait
            assert self._transport is not None
            self._transport.write(packed)
        if self._watch is None:
            self._watch = loop.call_later(self.timeout, self._check)
        return future

    def _flush(self) -> None:
        out, self._out = self._out, None
        if out and self._transport is not None:
            self._transport.write(out[0] if len(out) == 1 else b"".join(out))

    def _check(self) -> None:
        self._watch = None
        if not self._waiting or self.closed:
            return
        due = self._waiting[0][1]
        if self.loop.time() >= due:
            self.close(redis_errors.TimeoutError("Redis did not answer in time"))
        else:
            self._watch = self.loop.call_at(due, self._check)

    def data_received(self, data: bytes) -> None:
        try:
            replies = self._replies.feed(data)
        except ProtocolError as exc:
            self.close(redis_errors.ConnectionError(f"Redis broke the protocol: {exc}"))
            return
        waiting = self._waiting
        for reply in replies:
            if reply is PUSH:
                continue
            if not waiting:
                self.close(redis_errors.ConnectionError("Redis sent a reply nobody asked for"))
                return
            future = waiting.popleft()[0]
            if not future.done():  # not given up on (a cancelled request)
                future.set_result(reply)

    def eof_received(self) -> bool:
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.close(redis_errors.ConnectionError("Redis closed the connection"))

    def close(self, error: Exception) -> None:
        """Fail every command in flight with ``error`` and drop the connection."""
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        self.closed = True
        waiting, self._waiting = self._waiting, deque()
        for future, _ in waiting:
            if not future.done():
                future.set_exception(error)
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        conn, self._conn = self._conn, None
        if conn is not None:  # redis-py's view of the socket: closed, never used again
            conn._reader = conn._writer = None


class _Lean:
    """Commands on one pipelined connection per event loop (:class:`_Pipe`), without
    redis-py's per-command layers.

    ``Redis.execute_command`` checks a connection out of the pool and back for every
    command (a condition, a lock and a timer each way), arms a timer and a task per
    send and another timer per read: about 160 us of CPU per command here. The pipe
    costs a future and a share of one write and one read. redis-py still makes each
    connection (TLS, ACL, ``SELECT``: everything a URL can say) and then hands over its
    socket. A command that fails on a broken or stuck connection is re-sent
    ``RETRIES`` time(s) on a new one, after a jittered wait of up to 0.1 s.
    """

    def __init__(self, pool: Any, timeout: float) -> None:
        self.pool, self.timeout = pool, timeout
        self._pipe: _Pipe | None = None
        self._opening: asyncio.Future[_Pipe] | None = None

    async def execute(self, *args: bytes) -> Any:
        packed = pack(args)
        for attempt in range(RETRIES + 1):
            pipe = self._pipe
            try:
                if pipe is None or pipe.closed or pipe.loop is not asyncio.get_running_loop():
                    pipe = await self._open()
                reply = await pipe.send(packed)
                break
            except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError):
                if attempt == RETRIES:
                    raise
            await asyncio.sleep(_RESEND.delay(attempt + 1))
        if isinstance(reply, ReplyError):
            if reply.message.startswith("NOSCRIPT"):
                raise redis_errors.NoScriptError(reply.message)
            raise redis_errors.ResponseError(reply.message)
        return reply

    async def _open(self) -> _Pipe:
        """The pipe of the running loop, connecting it once for all the commands waiting."""
        loop = asyncio.get_running_loop()
        opening = self._opening
        if opening is not None and opening.get_loop() is loop:
            return await asyncio.shield(opening)
        opening = self._opening = loop.create_future()
        try:
            conn = self.pool.make_connection()
            await conn.connect()
            pipe = _Pipe(loop, self.timeout)
            pipe.attach(conn)
        except BaseException as exc:
            self._opening = None
            # The commands waiting for this connection fail as a connection error (and are
            # re-sent), never with the opener's own cancellation.
            error = (
                exc
                if isinstance(exc, Exception)
                else redis_errors.ConnectionError("opening the Redis connection was interrupted")
            )
            opening.set_exception(error)
            opening.exception()  # marked as retrieved: a lone opener logs nothing
            raise
        old, self._pipe, self._opening = self._pipe, pipe, None
        if old is not None and not old.closed:
            error = redis_errors.ConnectionError("replaced by a connection on another loop")
            if old.loop is loop:
                old.close(error)
            elif not old.loop.is_closed():
                old.loop.call_soon_threadsafe(old.close, error)
        opening.set_result(pipe)
        return pipe

    async def aclose(self) -> None:
        pipe, self._pipe = self._pipe, None
        if pipe is not None and not pipe.closed:
            error = redis_errors.ConnectionError("the store was closed")
            if pipe.loop is asyncio.get_running_loop():
                pipe.close(error)
            elif not pipe.loop.is_closed():
                pipe.loop.call_soon_threadsafe(pipe.close, error)

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
    ``<prefix>:{<principal>:<idempotency key>}``. From a URL the store sends the
    commands of each event loop over one pipelined connection (redis-py makes it:
    TLS, ACL users, the database number all come from the URL), and a command
    waits at most about ``timeout`` seconds for its answer: a connection whose
    oldest command waited that long is dropped. A command whose connection broke
    or timed out is re-sent ``RETRIES`` time(s) on a new connection (so one Redis
    closed, by a restart or its idle ``timeout``, reconnects instead of failing).
    A re-sent write is safe: a re-sent claim reads back its own owner token and a
    re-sent finish finds its own record (the middleware checks both). Connection
    problems that outlast the retries raise :class:`~agentkey.StoreUnavailable`;
    the middleware then answers 503 and never runs the handler.

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
        max_connections: int | None = None,
    ) -> None:
        if max_connections is not None:
            warnings.warn(
                "RedisStore(max_connections=) no longer applies and will be removed: a store "
                "built from a URL sends every command of an event loop over one pipelined "
                "connection; drop the argument",
                DeprecationWarning,
                stacklevel=2,
            )
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
            # The pool only makes the pipe's connections (the handshake, with its retry).
            pool = aioredis.ConnectionPool.from_url(
                redis,
                socket_connect_timeout=connect_timeout,
                socket_timeout=timeout,  # the handshake's; the pipe bounds each command
                retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), RETRIES),
                retry_on_error=[redis_errors.ConnectionError, redis_errors.TimeoutError],
            )
            self._client: Any = aioredis.Redis.from_pool(pool)
            self._lean: _Lean | None = _Lean(pool, timeout)
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

    @staticmethod
    def _failure(what: str, key: str, exc: Exception) -> StoreError:
        """The store error for redis-py's ``exc`` during ``what`` of record ``key``."""
        if isinstance(exc, (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError)):
            return StoreUnavailable(
                f"Redis could not be reached during {what} of record {shown(key)} "
                f"({type(exc).__name__}): {after_failure(what)}. "
                "Check that Redis is up and reachable"
            )
        if isinstance(exc, redis_errors.RedisError):
            return StoreError(
                f"Redis failed during {what} of record {shown(key)}: {type(exc).__name__}: {exc}"
            )
        # A bug inside the client library (redis-py's cluster client can raise
        # AttributeError on a connection closed under load) must still fail
        # closed with a 503, not escape as a 500 or break the finish.
        return StoreError(
            f"the Redis client failed unexpectedly during {what} of record {shown(key)} "
            f"({type(exc).__name__}): {after_failure(what)}"
        )

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

    # Each operation awaits its command directly, with redis-py's errors translated in
    # place: under load every request holds its chain of coroutines across the round
    # trip, and each level adds to what the garbage collector walks (see _middleware).

    async def _script(self, script: AsyncScript, key: str, *args: bytes) -> Any:
        rkey = self.redis_key(key)
        if self._lean is None:
            return await script(keys=[rkey], args=list(args))
        return await self._lean.evalsha(script, rkey.encode(), *args)

    async def claim(self, key: str, value: bytes, *, ttl_ms: int) -> bytes | None:
        ttl = _check_ttl(ttl_ms)
        self._start_persistence_check()
        rkey = self.redis_key(key)
        try:
            # Redis >= 7: NX and GET together; one round trip claims or reads.
            if self._lean is None:
                result = await self._client.execute_command(
                    "SET", rkey, value, "NX", "PX", ttl, "GET", get=True
                )
            else:
                result = await self._lean.execute(
                    b"SET", rkey.encode(), value, b"NX", b"PX", b"%d" % ttl, b"GET"
                )
        except Exception as exc:
            raise self._failure("claim", key, exc) from None
        return None if result is None else bytes(result)

    async def renew(self, key: str, owner: str, *, ttl_ms: int) -> bool:
        ttl = b"%d" % _check_ttl(ttl_ms)
        prefix = owner_prefix(owner)
        try:
            done = await self._script(self._renew, key, prefix, ttl)
        except Exception as exc:
            raise self._failure("renew", key, exc) from None
        return bool(done)

    async def finish(self, key: str, owner: str, value: bytes, *, ttl_ms: int) -> bool:
        ttl = b"%d" % _check_ttl(ttl_ms)
        prefix = owner_prefix(owner)
        try:
            done = await self._script(self._finish, key, prefix, value, ttl)
        except Exception as exc:
            raise self._failure("finish", key, exc) from None
        return bool(done)

    async def release(self, key: str, owner: str) -> bool:
        prefix = owner_prefix(owner)
        try:
            done = await self._script(self._release, key, prefix)
        except Exception as exc:
            raise self._failure("release", key, exc) from None
        return bool(done)

    async def get(self, key: str) -> bytes | None:
        rkey = self.redis_key(key)
        try:
            if self._lean is None:
                result = await self._client.get(rkey)
            else:
                result = await self._lean.execute(b"GET", rkey.encode())
        except Exception as exc:
            raise self._failure("get", key, exc) from None
        return None if result is None else bytes(result)

    async def aclose(self) -> None:
        check, loop = self._persistence_check, asyncio.get_running_loop()
        if check is not None and not check.done() and check.get_loop() is loop:
            check.cancel()
            await asyncio.gather(check, return_exceptions=True)
        if self._lean is not None:
            await self._lean.aclose()
            await self._client.aclose()
