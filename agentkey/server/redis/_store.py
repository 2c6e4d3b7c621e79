"""RedisStore: the Store protocol on Redis >= 7, Valkey or Redis Cluster (``redis.asyncio``).

Loaded on first use of ``agentkey.server.RedisStore``: it needs redis-py, which
``MemoryStore`` users need not install. Everything goes through redis-py's public
client: ``execute_command`` and non-transactional pipelines.

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

With replicas, a claim, a renewal and a finish are followed by ``WAIT`` in the
same pipeline, on the same connection: still one round trip, which now ends when
a replica holds the write. (The first use of a Lua script on a fresh Redis adds
one ``SCRIPT LOAD``.)
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import itertools
import logging
import math
from typing import Any

from ..._clock import Clock
from ..._exceptions import ConfigurationError, StoreError, StoreUnavailable, missing_extra
from ..._schedule import Backoff
from .._stores import _check_ttl, after_failure, owner_prefix, resolve_clock, shown

try:
    from redis import asyncio as aioredis
    from redis import exceptions as redis_errors
    from redis.asyncio.cluster import RedisCluster
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialWithJitterBackoff
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise missing_extra("server", "redis", exc) from None

__all__ = ["RETRIES", "RedisStore"]

_logger = logging.getLogger("agentkey.server")

#: Re-sends of a command whose connection broke or timed out (a connection Redis closed
#: by a restart or its idle ``timeout``), after a jittered wait of up to 0.5 s, on a new
#: connection: redis-py's own ``Retry`` on a store built from a URL. One is enough for a
#: stale connection; a Redis that stops answering costs (1 + RETRIES) timeouts per
#: command before the store gives up, and more would multiply that.
RETRIES = 1

#: Errors after which a command may have run in Redis without its answer arriving.
_LOST = (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError)
#: Cluster answers that say the command did not run on the node it was sent to.
_ELSEWHERE = (redis_errors.AskError, redis_errors.TryAgainError, redis_errors.ClusterDownError)
#: Between retries of a release that failed on the connection: 0.1 s doubling to 1 s, jittered.
_RELEASE_BACKOFF = Backoff(initial=0.1, cap=1.0)
#: While the deployment has no replica, how often a store on ``replicas=None`` asks again.
_RECHECK_SECONDS = 30.0
# replica_timeout when not given: the smaller of this and half of ``timeout``.
_DEFAULT_REPLICA_TIMEOUT = 1.0


class _Script:
    """A Lua script: its source and the SHA1 that ``EVALSHA`` names it by."""

    __slots__ = ("name", "sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()
        self.name = self.sha.encode()  # as sent: redis-py need not encode it per call


# KEYS[1] record key; ARGV[1] owner prefix; then per script.
_RENEW = _Script("""
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, string.len(ARGV[1])) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
""")
# A finish sent again after it landed finds its own outcome and writes it again: that
# answers 1 and gives the WAIT that follows a write of this connection to wait for.
_FINISH = _Script("""
local v = redis.call('GET', KEYS[1])
if v and (v == ARGV[2] or string.sub(v, 1, string.len(ARGV[1])) == ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
""")
_RELEASE = _Script("""
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, string.len(ARGV[1])) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
""")

_SET_OPTIONS = {"get": True}  # redis-py then returns SET … GET's reply as it is
_NO_OPTIONS: dict[str, Any] = {}
# Arguments as redis-py would encode them, encoded once: its encoder passes bytes through.
# Command names stay str: redis-py looks up its reply callbacks (and, on a cluster, the
# command's keys) by them.
_NX, _PX, _GET, _ONE = b"NX", b"PX", b"GET", b"1"


def _ms(ttl: int) -> bytes:
    return b"%d" % ttl


class _Op:
    """One command on one record key, and what came of it.

    ``confirmed`` is None when no ``WAIT`` ran after it on its connection (none was
    asked for, or a cluster redirect sent the command elsewhere), else whether enough
    replicas acknowledged it in time.
    """

    __slots__ = ("args", "confirm", "confirmed", "error", "future", "options", "result", "rkey")

    def __init__(
        self, rkey: str, args: tuple[Any, ...], options: dict[str, Any], confirm: bool
    ) -> None:
        self.rkey, self.args, self.options, self.confirm = rkey, args, options, confirm
        self.result: Any = None
        self.confirmed: bool | None = None
        self.error: BaseException | None = None
        self.future: asyncio.Future[None] | None = None


class _Link:
    """The commands of one event loop, through one redis-py client.

    A command sent while none is in flight goes out at once with ``execute_command``.
    Commands sent while others are in flight are gathered for the rest of the loop
    iteration and go out in one non-transactional pipeline: one write, one connection
    and one read for many requests, which is what keeps redis-py's per-command cost
    (a pool checkout and release, a retry wrapper) off each request under load.
    When ``wait`` replicas are asked for, each connection's commands end with ``WAIT
    wait timeout``, which answers once that many replicas hold every write before it
    on the connection.
    """

    def __init__(self, client: Any, loop: asyncio.AbstractEventLoop, *, owned: bool) -> None:
        self.client, self.loop, self.owned = client, loop, owned
        self.cluster = isinstance(client, RedisCluster)
        self.wait = 0  # replicas each confirmed write waits for
        self.wait_ms = 0
        self._queue: list[_Op] | None = None
        self._busy = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def send(self, op: _Op) -> _Op:
        if self._busy == 0 and self._queue is None:
            self._busy = 1
            try:
                if op.confirm and self.wait:
                    await self._run([op])
                else:  # the common case, alone: straight to redis-py, nothing around it
                    # (_answer, inline: one coroutine less held across the round trip)
                    try:
                        op.result = await self.client.execute_command(*op.args, **op.options)
                    except redis_errors.ResponseError as exc:
                        op.result = exc
            finally:
                self._busy -= 1
        else:
            op.future = self.loop.create_future()
            if self._queue is None:
                self._queue = [op]
                self.loop.call_soon(self._flush)
            else:
                self._queue.append(op)
            await op.future
        if op.error is not None:
            raise op.error
        return op

    def _flush(self) -> None:
        batch, self._queue = self._queue, None
        if batch:
            self._busy += len(batch)
            task = self.loop.create_task(self._run_batch(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run_batch(self, batch: list[_Op]) -> None:
        try:
            await self._run(batch)
        finally:
            self._busy -= len(batch)
            for op in batch:
                if op.future is not None and not op.future.done():  # not given up on
                    op.future.set_result(None)

    async def _run(self, ops: list[_Op]) -> None:
        """Send ``ops``; fill in each one's result, or its error. Never raises."""
        client = self.client
        try:
            if len(ops) == 1 and not (ops[0].confirm and self.wait):
                ops[0].result = await _answer(client, ops[0])
            elif self.cluster:
                await self._run_cluster(ops)
            else:
                pipe = client.pipeline(transaction=False)
                for op in ops:
                    pipe.execute_command(*op.args, **op.options)
                confirm = self.wait and any(op.confirm for op in ops)
                if confirm:
                    pipe.execute_command("WAIT", self.wait, self.wait_ms)
                results = await pipe.execute(raise_on_error=False)
                acked = bool(confirm) and _enough(results.pop(), self.wait)
                for op, result in zip(ops, results, strict=True):
                    op.result = result
                    if confirm and op.confirm:
                        op.confirmed = acked
        except Exception as exc:
            for op in ops:
                op.error = exc

    async def _run_cluster(self, ops: list[_Op]) -> None:
        client = self.client
        pipe = client.pipeline()
        if not (self.wait and any(op.confirm for op in ops)):
            for op in ops:
                pipe.execute_command(*op.args, **op.options)
            results = await pipe.execute(raise_on_error=False)
            for op, result in zip(ops, results, strict=True):
                op.result = result
            return
        # Each command pinned to its key's node, then one WAIT per node on the same
        # connection; a redirect comes back as an answer instead of being followed, since
        # the command would then run where no WAIT follows it. redis-py sends a cluster
        # pipeline again after a connection error, and then without the pins: a WAIT may
        # run on another connection and confirm writes it never saw. So each node's
        # commands are framed by CLIENT INFO, and a WAIT counts only when both frames name
        # the same connection on the node that serves the key.
        await client.initialize()
        nodes: dict[str, Any] = {}
        pinned = []
        for op in ops:
            node = client.get_node_from_key(op.rkey)
            nodes.setdefault(node.name, node)
            pinned.append(node)
        for node in nodes.values():
            pipe.execute_command("CLIENT", "INFO", target_nodes=node)
        for op, node in zip(ops, pinned, strict=True):
            pipe.execute_command(*op.args, target_nodes=node, **op.options)
        for node in nodes.values():
            pipe.execute_command("WAIT", self.wait, self.wait_ms, target_nodes=node)
        for node in nodes.values():
            pipe.execute_command("CLIENT", "INFO", target_nodes=node)
        results = await pipe.execute(raise_on_error=False, allow_redirections=False)
        k = len(nodes)
        before, answers = results[:k], results[k : k + len(ops)]
        waits, after = results[k + len(ops) : 2 * k + len(ops)], results[2 * k + len(ops) :]
        acked: dict[str, bool | None] = {
            # None: the WAIT may have run elsewhere, so it says nothing either way.
            name: _enough(acks, self.wait) if _one_connection(first, last, node.port) else None
            for (name, node), first, acks, last in zip(
                nodes.items(), before, waits, after, strict=True
            )
        }
        moved = []
        for op, node, result in zip(ops, pinned, answers, strict=True):
            if isinstance(result, _ELSEWHERE):
                moved.append(op)
                continue
            op.result = result
            if op.confirm and _serves(client, op.rkey, node):
                op.confirmed = acked[node.name]
            # Otherwise confirmed stays None: the caller writes again under a new WAIT.
        for op in moved:  # the cluster changed: redis-py follows it, and learns the new map
            op.result = await _answer(client, op)

    async def aclose(self) -> None:
        if self.owned:
            await self.client.aclose()


def _serves(client: Any, rkey: str, node: Any) -> bool:
    """Whether ``rkey``'s slot is still served by the node it was pinned to."""
    try:
        return bool(client.get_node_from_key(rkey).name == node.name)
    except redis_errors.RedisError:
        return False


def _client_info(reply: Any) -> dict[str, str]:
    """``CLIENT INFO``'s ``key=value`` fields; empty for anything else (an error, say)."""
    if isinstance(reply, bytes):
        reply = reply.decode("utf-8", "replace")
    if not isinstance(reply, str):
        return {}
    return dict(field.split("=", 1) for field in reply.split() if "=" in field)


def _one_connection(first: Any, last: Any, port: int) -> bool:
    """Whether two ``CLIENT INFO`` replies come from one connection to the node on ``port``
    (the connection id, and the server's own address, which names the node)."""
    a, b = _client_info(first), _client_info(last)
    laddr = a.get("laddr", "")
    return (
        bool(a.get("id"))
        and a.get("id") == b.get("id")
        and laddr == b.get("laddr")
        and laddr.rpartition(":")[2] == str(port)
    )


async def _answer(client: Any, op: _Op) -> Any:
    """``op``'s command alone; an error reply is an answer (returned), not a failure."""
    try:
        return await client.execute_command(*op.args, **op.options)
    except redis_errors.ResponseError as exc:
        return exc


def _enough(acked: Any, wait: int) -> bool:
    return isinstance(acked, int) and not isinstance(acked, bool) and acked >= wait


def _text(value: object) -> str | None:
    return value.decode() if isinstance(value, bytes) else value if isinstance(value, str) else None


class RedisStore:
    """A store on Redis >= 7 (or Valkey, or Redis Cluster) through ``redis.asyncio``.

    Pass a URL (``redis://…``, ``rediss://…``, ``unix://…``) or a ready client
    (``redis.asyncio.Redis``, a Sentinel ``master_for`` client, or
    ``redis.asyncio.RedisCluster``). Record keys become
    ``<prefix>:{<principal>:<idempotency key>}``. From a URL the store builds a
    redis-py client per event loop (TLS, ACL users, the database number all come
    from the URL) whose commands wait at most ``timeout`` seconds for Redis and
    are re-sent ``RETRIES`` time(s) on a new connection when it broke or timed
    out. A re-sent write is safe: a re-sent claim reads back its own owner token
    and a re-sent finish finds its own record. Connection problems that outlast
    the retries raise :class:`~agentkey.StoreUnavailable`; the middleware then
    answers 503 and never runs the handler. A claim whose answer was lost that
    way may still have landed: the store then deletes the record when it is this
    claim's own, so the key is not left locked for a lease.

    ``replicas``: how many replicas must hold each claim, renewal and finish
    before it counts (``WAIT`` on the same connection, at most
    ``replica_timeout`` seconds: by default the smaller of 1 s and half of
    ``timeout``; given, it must be below ``timeout``). ``None`` (the default) is 1
    when the deployment reports a replica at the first claim (a Redis with replicas
    attached, or a cluster with replicas) and 0 otherwise, asked again every 30 s
    while it is 0.
    A claim no replica confirmed in time is deleted again and refused (503): a
    failover can then never lose a claim that ran. A finish no replica confirmed
    raises, and the middleware keeps writing it until one does. ``replicas=0``
    opts out: an acknowledged write lost in a failover then lets a retry run the
    step again.

    Beside its first claim (never delaying it) the store asks Redis for
    ``appendonly`` and logs one WARNING when it is ``no``: a restart then loses
    finished records, and a retry of their steps runs them again.

    ``clock`` (an :class:`~agentkey.Clock`; tests pass ``agentkey.testing.FakeClock``)
    paces the background retries of a release and the replica recheck; the commands'
    own ``timeout`` is a socket timeout, on real time.
    """

    def __init__(
        self,
        redis: str | Any,
        *,
        prefix: str = "agentkey",
        connect_timeout: float = 2.0,
        timeout: float = 5.0,
        replicas: int | None = None,
        replica_timeout: float | None = None,
        clock: Clock | None = None,
    ) -> None:
        if not isinstance(prefix, str) or not prefix or any(c in prefix for c in "{}"):
            raise ConfigurationError(
                f"RedisStore prefix must be a non-empty str without braces, got {prefix!r}"
            )
        if replicas is not None and (
            isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0
        ):
            raise ConfigurationError(
                f"RedisStore replicas must be None (ask the deployment) or an int >= 0, "
                f"got {replicas!r}"
            )
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigurationError(
                f"RedisStore timeout must be a positive number of seconds, got {timeout!r}"
            )
        if replica_timeout is None:
            # Derived, so a default never conflicts with the timeout the user chose: a WAIT
            # for replicas must end before the command's socket timeout does.
            replica_timeout = min(_DEFAULT_REPLICA_TIMEOUT, timeout / 2)
        elif (
            isinstance(replica_timeout, bool)
            or not isinstance(replica_timeout, (int, float))
            or not 0.001 <= replica_timeout < math.inf
        ):
            raise ConfigurationError(
                f"RedisStore replica_timeout must be seconds from 0.001, got {replica_timeout!r}"
            )
        elif replica_timeout >= timeout:
            raise ConfigurationError(
                f"RedisStore replica_timeout ({replica_timeout!r} s) must be below timeout "
                f"({timeout!r} s): the wait for replicas runs inside a command that timeout "
                "ends. Lower replica_timeout, raise timeout, or leave replica_timeout out "
                "(it then defaults to the smaller of 1 s and half the timeout)"
            )
        self.prefix = prefix
        self._clock = resolve_clock(clock, "RedisStore")
        self._connect_timeout, self._timeout = connect_timeout, timeout
        self._url: str | None = None
        self._client: Any = None
        if isinstance(redis, str):
            if not redis.startswith(("redis://", "rediss://", "unix://")):
                raise ConfigurationError(
                    "RedisStore needs a redis://, rediss:// or unix:// URL or a "
                    "redis.asyncio client"
                )
            self._url = redis
        else:
            # A sync client would block the event loop and fail outside the
            # StoreError mapping (a 500 instead of the fail-closed 503).
            if not inspect.iscoroutinefunction(getattr(redis, "execute_command", None)):
                raise ConfigurationError(
                    f"RedisStore needs a URL or a redis.asyncio client (Redis or RedisCluster), "
                    f"got {type(redis).__module__}.{type(redis).__name__}; a synchronous "
                    "redis.Redis would block the server's event loop"
                )
            encoder = getattr(redis, "get_encoder", None)
            if callable(encoder) and getattr(encoder(), "decode_responses", False):
                raise ConfigurationError(
                    "RedisStore needs a client with decode_responses=False: records hold "
                    "response bodies as raw bytes"
                )
            self._client = redis
        self._asked = replicas  # as configured: None asks the deployment
        self._replicas = replicas  # in force; None until asked
        self._replica_timeout = replica_timeout
        self._recheck_at = 0.0
        self._recheck: asyncio.Task[None] | None = None
        self._asking: asyncio.Future[None] | None = None
        self._releasing: set[asyncio.Task[None]] = set()
        self._link_: _Link | None = None
        self._persistence_check: asyncio.Task[None] | None = None

    # The scripts, as attributes for the tests that look for their SHA on the wire.
    _renew, _finish, _release = _RENEW, _FINISH, _RELEASE

    def __repr__(self) -> str:  # never shows the URL: it may carry a password
        return f"RedisStore(prefix={self.prefix!r})"

    @property
    def replicas(self) -> int | None:
        """Replicas each claim, renewal and finish waits for; None until the first claim
        asked the deployment (``replicas=None``)."""
        return self._replicas

    def _link(self) -> _Link:
        """The running loop's link; a store from a URL builds a client for each new loop."""
        loop = asyncio.get_running_loop()
        link = self._link_
        if link is not None and link.loop is loop:
            return link
        if self._url is None:
            new = _Link(self._client, loop, owned=False)
        else:
            client = aioredis.Redis.from_url(
                self._url,
                socket_connect_timeout=self._connect_timeout,
                socket_timeout=self._timeout,
                retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), RETRIES),
                retry_on_error=[redis_errors.ConnectionError, redis_errors.TimeoutError],
            )
            new = _Link(client, loop, owned=True)
            if link is not None and link.owned and link.loop.is_running():
                asyncio.run_coroutine_threadsafe(link.aclose(), link.loop)
        if self._replicas is not None:
            new.wait, new.wait_ms = self._replicas, round(self._replica_timeout * 1000)
        self._link_ = new
        return new

    @staticmethod
    def _failure(what: str, key: str, exc: BaseException) -> StoreError:
        """The store error for redis-py's ``exc`` during ``what`` of record ``key``."""
        if isinstance(exc, _LOST):
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

    def _unconfirmed(self, what: str, key: str) -> StoreUnavailable:
        return StoreUnavailable(
            f"no Redis replica confirmed the {what} of record {shown(key)} within "
            f"{self._replica_timeout:g} s ({self._replicas} asked for): {after_failure(what)}. "
            "Check the replicas and their replication lag; RedisStore(replicas=0) stops "
            "waiting for them, and a failover may then lose acknowledged writes"
        )

    def redis_key(self, key: str) -> str:
        """The Redis key of record ``key``: ``<prefix>:{<key>}``.

        The braces are a Cluster hash tag: the record and anything ever stored
        beside it hash to one slot.
        """
        return f"{self.prefix}:{{{key}}}"

    # --- replicas ---------------------------------------------------------------------

    async def _ask_replicas(self, link: _Link) -> int:
        """How many replicas the deployment reports: a cluster's replica nodes, failed ones
        too (``CLUSTER NODES``; ``CLUSTER SLOTS`` leaves out a replica that has not
        replicated anything yet), or the replicas attached to a single Redis (``ROLE``)."""
        client = link.client
        if link.cluster:
            nodes = await client.cluster_nodes()
            flags = [str(n.get("flags", "")) for n in nodes.values() if isinstance(n, dict)]
            return 1 if any("slave" in f.split(",") for f in flags) else 0
        role = await client.execute_command("ROLE")
        if isinstance(role, (list, tuple)) and len(role) >= 3 and _text(role[0]) == "master":
            return 1 if role[2] else 0
        return 0

    async def _settle_replicas(self, link: _Link) -> None:
        """Decide ``replicas=None`` at the first claim, before any claim is acted on; the
        claims that arrive meanwhile wait for the same answer."""
        asking = self._asking
        if asking is not None and asking.get_loop() is link.loop:
            await asyncio.shield(asking)
            return
        asking = self._asking = link.loop.create_future()
        try:
            await self._decide_replicas(link)
        except BaseException as exc:
            asking.set_exception(
                exc
                if isinstance(exc, Exception)
                else StoreUnavailable("asking Redis for its replicas was interrupted")
            )
            asking.exception()  # retrieved: a lone asker logs nothing
            raise
        finally:
            self._asking = None
        asking.set_result(None)

    async def _decide_replicas(self, link: _Link) -> None:
        try:
            found = await self._ask_replicas(link)
        except _LOST:
            raise
        except Exception as exc:  # ROLE refused (ACL) or renamed: say so, loudly
            _logger.warning(
                "RedisStore(prefix=%r) could not ask Redis for its replicas (%s), so claims "
                "do not wait for a replica; pass replicas=1 to require one, or replicas=0 "
                "to say that none is wanted",
                self.prefix,
                type(exc).__name__,
            )
            found = 0
        self._use_replicas(found)

    def _use_replicas(self, found: int) -> None:
        if self._replicas:  # once on, on for good: a replica lost later must not turn it off
            return
        if found and self._replicas != found:
            _logger.info(
                "RedisStore(prefix=%r): the deployment has replicas; each claim, renewal and "
                "finish now waits for one to confirm it (replicas=0 opts out)",
                self.prefix,
            )
        self._replicas = found
        self._recheck_at = self._clock.monotonic() + _RECHECK_SECONDS
        link = self._link_
        if link is not None:
            link.wait, link.wait_ms = found, round(self._replica_timeout * 1000)

    def _maybe_recheck(self, link: _Link) -> None:
        """With ``replicas=None`` and none found yet, ask again now and then, beside claims."""
        if (
            self._asked is None
            and self._replicas == 0
            and self._recheck is None
            and self._clock.monotonic() >= self._recheck_at
        ):

            async def recheck() -> None:
                try:
                    self._use_replicas(await self._ask_replicas(link))
                except Exception:
                    self._recheck_at = self._clock.monotonic() + _RECHECK_SECONDS
                finally:
                    self._recheck = None

            self._recheck = asyncio.get_running_loop().create_task(recheck())

    # --- persistence ------------------------------------------------------------------

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
            config = await self._link().client.config_get("appendonly")
            # A cluster client may answer per node: {node: {"appendonly": ...}}.
            answers = [v for v in config.values() if isinstance(v, dict)] or [config]
            values = {_text(a.get("appendonly", a.get(b"appendonly"))) for a in answers}
        except _LOST:
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

    # --- operations -------------------------------------------------------------------

    async def _script(
        self, link: _Link, script: _Script, rkey: str, args: tuple[Any, ...], confirm: bool
    ) -> _Op:
        """``EVALSHA`` on ``rkey``, loading the script first where Redis lacks it (a fresh,
        restarted or newly promoted Redis)."""
        command = ("EVALSHA", script.name, _ONE, rkey, *args)
        op = await link.send(_Op(rkey, command, _NO_OPTIONS, confirm))
        if isinstance(op.result, redis_errors.NoScriptError):
            if link.cluster:
                await link.client.execute_command(
                    "SCRIPT LOAD", script.source, target_nodes=link.client.get_node_from_key(rkey)
                )
            else:
                await link.client.script_load(script.source)
            op = await link.send(_Op(rkey, command, _NO_OPTIONS, confirm))
        if isinstance(op.result, Exception):
            raise op.result
        return op

    async def claim(self, key: str, value: bytes, *, ttl_ms: int) -> bytes | None:
        ttl = _check_ttl(ttl_ms)
        self._start_persistence_check()
        rkey = self.redis_key(key)
        link = self._link()
        sent = False
        try:
            if self._replicas is None:
                await self._settle_replicas(link)
            elif not self._replicas:
                self._maybe_recheck(link)
            # Redis >= 7: NX and GET together; one round trip claims or reads.
            sent = True
            op = await link.send(
                _Op(rkey, ("SET", rkey, value, _NX, _PX, _ms(ttl), _GET), _SET_OPTIONS, True)
            )
            if isinstance(op.result, Exception):
                raise op.result
            result = op.result
            if link.wait and (result is None or result == value):
                if op.confirmed is None or result is not None:
                    # Written on another connection (a re-sent SET reads its own record
                    # back: the WAIT after it covers only this connection's writes) or on
                    # a node found through a redirect: no WAIT covered it yet. Rewrite its
                    # lease here, where the WAIT follows it.
                    owner = _owner_of(value)
                    if owner is not None:
                        again = await self._script(link, _RENEW, rkey, (owner, _ms(ttl)), True)
                    else:  # an outcome (written again after a lapsed lease)
                        again = await self._script(
                            link, _FINISH, rkey, (value, value, _ms(ttl)), True
                        )
                    op.confirmed = bool(again.result) and again.confirmed is True
                if not op.confirmed:
                    await self._release_own(
                        link, key, rkey, value, "not confirmed by a replica", ttl
                    )
                    raise self._unconfirmed("claim", key)
        except StoreError:
            raise
        except Exception as exc:
            if sent and not isinstance(exc, redis_errors.ResponseError):
                # The answer was lost (or the client broke): the SET may have landed.
                await self._release_own(link, key, rkey, value, "its answer was lost", ttl)
            raise self._failure("claim", key, exc) from None
        return None if result is None else bytes(result)

    async def _release_own(
        self, link: _Link, key: str, rkey: str, value: bytes, why: str, ttl_ms: int
    ) -> None:
        """Delete the claim ``value`` wrote, if it is there, so a refused request leaves its
        key free instead of locked for a lease."""
        owner = _owner_of(value)
        if owner is None:
            return
        try:
            op = await asyncio.wait_for(
                self._script(link, _RELEASE, rkey, (owner,), confirm=False), self._timeout
            )
        except Exception as exc:
            _logger.warning(
                "a claim of %s was refused (%s) and could not be released yet (%s); the "
                "release is retried until Redis answers or the claim's lease ends",
                shown(key),
                why,
                type(exc).__name__,
            )
            self._release_later(link, key, rkey, owner, ttl_ms)
            return
        if op.result:
            _logger.info("released the claim of %s: %s", shown(key), why)

    def _release_later(self, link: _Link, key: str, rkey: str, owner: bytes, ttl_ms: int) -> None:
        """Retry a release that failed, in the background, until Redis answers or the claim's
        lease would have ended anyway: a key refused with 503 is freed as soon as its store
        is back (after a failover, say), not a lease later."""
        clock = self._clock
        give_up = clock.monotonic() + ttl_ms / 1000

        async def retry() -> None:
            for attempt in itertools.count(1):
                await clock.asleep(_RELEASE_BACKOFF.delay(attempt, rng=clock.random))
                if clock.monotonic() >= give_up:
                    return
                try:
                    op = await asyncio.wait_for(
                        self._script(link, _RELEASE, rkey, (owner,), confirm=False),
                        self._timeout,
                    )
                except Exception:  # noqa: S112 - down, failing over, or the client re-mapping
                    continue  # the cluster (redis-py raises several kinds then): retry
                if op.result:
                    _logger.info("released the claim of %s once Redis answered", shown(key))
                return

        task = link.loop.create_task(retry())
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def renew(self, key: str, owner: str, *, ttl_ms: int) -> bool:
        ttl = _check_ttl(ttl_ms)
        rkey = self.redis_key(key)
        try:
            done = await self._confirmed(
                rkey, _RENEW, (owner_prefix(owner), _ms(ttl)), "renew", key
            )
        except StoreError:
            raise
        except Exception as exc:
            raise self._failure("renew", key, exc) from None
        return done

    async def finish(self, key: str, owner: str, value: bytes, *, ttl_ms: int) -> bool:
        ttl = _check_ttl(ttl_ms)
        rkey = self.redis_key(key)
        args = (owner_prefix(owner), value, _ms(ttl))
        try:
            done = await self._confirmed(rkey, _FINISH, args, "finish", key)
        except StoreError:
            raise
        except Exception as exc:
            raise self._failure("finish", key, exc) from None
        return done

    async def _confirmed(
        self, rkey: str, script: _Script, args: tuple[Any, ...], what: str, key: str
    ) -> bool:
        """Run a fenced write; with replicas, raise unless one confirmed it in time. The
        writes are idempotent for their owner, so one that landed beyond a WAIT (a
        cluster redirect) is sent again where the WAIT follows it."""
        link = self._link()
        op = await self._script(link, script, rkey, args, confirm=True)
        if not (op.result and link.wait):
            return bool(op.result)
        if op.confirmed is None:
            op = await self._script(link, script, rkey, args, confirm=True)
        if op.result and not op.confirmed:
            raise self._unconfirmed(what, key)
        return bool(op.result)

    async def release(self, key: str, owner: str) -> bool:
        rkey = self.redis_key(key)
        try:
            op = await self._script(self._link(), _RELEASE, rkey, (owner_prefix(owner),), False)
        except Exception as exc:
            raise self._failure("release", key, exc) from None
        return bool(op.result)

    async def get(self, key: str) -> bytes | None:
        rkey = self.redis_key(key)
        try:
            op = await self._link().send(_Op(rkey, ("GET", rkey), _NO_OPTIONS, False))
            if isinstance(op.result, Exception):
                raise op.result
        except Exception as exc:
            raise self._failure("get", key, exc) from None
        return None if op.result is None else bytes(op.result)

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        for task in (self._persistence_check, self._recheck, *self._releasing):
            if task is not None and not task.done() and task.get_loop() is loop:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        link, self._link_ = self._link_, None
        if link is not None and link.owned:
            if link.loop is loop:
                await link.aclose()
            elif link.loop.is_running():
                asyncio.run_coroutine_threadsafe(link.aclose(), link.loop)


def _owner_of(value: bytes) -> bytes | None:
    """The ``P:<owner>:`` prefix of an in-progress record, or None for an outcome."""
    if value.startswith(b"P:") and len(value) > 35 and value[34:35] == b":":
        return value[:35]
    return None
