"""PostgresStore: the Store protocol on PostgreSQL, with transactional completion.

One table holds every record (``agentkey_records`` by default)::

    key        text PRIMARY KEY   <principal>:<idempotency key>, opaque to the store
    value      bytea NOT NULL     the record, encoded by _records (P:/C:/F:)
    expires_at timestamptz        end of the lease (in progress) or of the result
    sealed_by  text               owner whose own transaction completed the record
    recovery   jsonb              atomic phases: the last finished phase and its data

Time is the database's clock (``clock_timestamp()``), so every replica agrees on
expiry. Round trips per call (psycopg 3, autocommit connection from a pool):

=========  ================================================  ===========
operation  statement                                          round trips
=========  ================================================  ===========
claim      ``INSERT … ON CONFLICT DO UPDATE … WHERE expired``  1
renew      compare-and-set ``UPDATE``                          1
finish     compare-and-set ``UPDATE``                          1
release    compare-and-set ``DELETE``                          1
=========  ================================================  ===========

Compare-and-set is a prefix test on the owner, as in every store: an in-progress
value always starts with ``P:<owner>:``, so the store never parses a record.

Availability: a pooled connection is looked at before use, without a round trip (an
idle connection has nothing to read, so a readable socket means the server closed it:
a restart, ``pg_terminate_backend``, an idle timeout), and a dead one is replaced. A
statement whose connection dies under it is sent once more on another connection:
every statement here is a compare-and-set or a read, so a second send is safe (a claim
that had landed reads back as this owner's own). At most ``max_size`` statements and
transactions hold a connection at once; the others queue in the store, not in the pool
(a cheaper wait), within the same ``timeout``. Each connection runs with
``lock_timeout`` and ``statement_timeout``, so a locked table answers 503 in about a
second instead of holding requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import select
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from .._clock import Clock, real_deadline
from .._exceptions import ConfigurationError, StoreError, StoreUnavailable, missing_extra
from .._keys import shown_key
from ._decide import is_storable, stored_headers
from ._records import StoredOutcome, encode_outcome
from ._stores import _check_ttl, after_failure, owner_prefix, resolve_clock, shown

try:
    import psycopg
    from psycopg import sql
    from psycopg_pool import AsyncConnectionPool, PoolTimeout
except ImportError as exc:  # pragma: no cover - exercised by installing without the extra
    raise missing_extra("postgres", "psycopg", exc) from None

if TYPE_CHECKING:
    from ._claim import Claim

__all__ = ["SCHEMA_VERSION", "PostgresStore", "PostgresTransaction", "RecoveryPoint"]

_logger = logging.getLogger("agentkey.server")
_TABLE = re.compile(r"(?:[a-z_][a-z0-9_]{0,62}\.)?[a-z_][a-z0-9_]{0,62}")
_Response = TypeVar("_Response")

#: Version of the table layout; docs/postgres.md lists the migration for each.
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS {t} (
    key        text PRIMARY KEY,
    value      bytea NOT NULL,
    expires_at timestamptz NOT NULL,
    sealed_by  text,
    recovery   jsonb
);
CREATE INDEX IF NOT EXISTS {ix} ON {t} (expires_at);
COMMENT ON TABLE {t} IS 'agentkey idempotency records, schema v1';
"""

_LIVE = "expires_at > clock_timestamp()"
_OWNED = f"key = %(k)s AND substr(value, 1, %(n)s) = %(p)s AND {_LIVE}"
_UNTIL = "clock_timestamp() + %(ttl)s * interval '1 millisecond'"

# A live record in the statement's snapshot is returned as is: a replay or a 409
# writes nothing (no row lock, no transaction id, no commit to flush). A released claim
# that holds a recovery point is taken over only by a claim of the same operation (the
# binding, field 6 of an in-progress record): for any other, its old record is returned
# and the middleware refuses the request (422), so a recovery point never reaches
# another route's or another body's handler. Otherwise the
# INSERT claims the key or takes over an expired record; it sees the newest row
# version, while the last SELECT sees the snapshot. If a concurrent claim committed
# in between, the statement returns no row and the claim is re-run.
_CLAIM = f"""
WITH cur AS (
    SELECT value FROM {{t}} WHERE key = %(k)s AND {_LIVE}
), won AS (
    INSERT INTO {{t}} AS r (key, value, expires_at)
    SELECT %(k)s, %(v)s, {_UNTIL} WHERE NOT EXISTS (SELECT 1 FROM cur)
    ON CONFLICT (key) DO UPDATE
    SET value = excluded.value, expires_at = excluded.expires_at, sealed_by = NULL,
        recovery = CASE WHEN substr(r.value, 1, 2) = 'P:'::bytea THEN r.recovery END
    WHERE r.expires_at <= clock_timestamp()
      AND (r.recovery IS NULL OR substr(r.value, 1, 2) <> 'P:'::bytea
           OR split_part(convert_from(r.value, 'SQL_ASCII'), ':', 6)
              = split_part(convert_from(excluded.value, 'SQL_ASCII'), ':', 6))
    RETURNING 1
)
SELECT NULL::bytea, true FROM won
UNION ALL
SELECT value, false FROM cur
UNION ALL
SELECT value, false FROM {{t}}
WHERE key = %(k)s AND NOT EXISTS (SELECT 1 FROM won) AND NOT EXISTS (SELECT 1 FROM cur)
"""  # noqa: S608 - module constants only; the table name is a sql.Identifier
# A record sealed by the owner's own transaction counts as still owned (renew) and
# as already finished (finish only ever lengthens its lifetime: a renewal that
# lands after the commit must not shorten a completed record to a lease).
_RENEW = f"""
WITH r AS (UPDATE {{t}} SET expires_at = {_UNTIL} WHERE {_OWNED} RETURNING 1)
SELECT EXISTS (SELECT 1 FROM r)
    OR EXISTS (SELECT 1 FROM {{t}} WHERE key = %(k)s AND sealed_by = %(o)s AND {_LIVE})
"""  # noqa: S608 - module constants only; the table name is a sql.Identifier
_FINISH = f"""
WITH f AS (UPDATE {{t}} SET value = %(v)s, expires_at = {_UNTIL} WHERE {_OWNED} RETURNING 1),
     s AS (UPDATE {{t}} SET expires_at = greatest(expires_at, {_UNTIL})
           WHERE key = %(k)s AND sealed_by = %(o)s AND {_LIVE} RETURNING 1)
SELECT EXISTS (SELECT 1 FROM f) OR EXISTS (SELECT 1 FROM s)
"""  # noqa: S608 - module constants only; the table name is a sql.Identifier
# A claim that recorded a recovery point is not deleted: its lease ends now, so the
# retry takes it over and resumes after the last finished phase.
_RELEASE = f"""
WITH d AS (DELETE FROM {{t}} WHERE {_OWNED} AND recovery IS NULL RETURNING 1),
     u AS (UPDATE {{t}} SET expires_at = clock_timestamp()
           WHERE {_OWNED} AND recovery IS NOT NULL RETURNING 1)
SELECT EXISTS (SELECT 1 FROM d) OR EXISTS (SELECT 1 FROM u)
"""  # noqa: S608 - module constants only; the table name is a sql.Identifier
# A None keeps the server's own setting.
_LIMITS = """
SELECT set_config('lock_timeout', coalesce(%s, current_setting('lock_timeout')), false),
       set_config('statement_timeout', coalesce(%s, current_setting('statement_timeout')), false)
"""
_GET = f"SELECT value FROM {{t}} WHERE key = %(k)s AND {_LIVE}"  # noqa: S608
_SEAL = f"""
UPDATE {{t}} SET value = %(v)s, expires_at = {_UNTIL}, sealed_by = %(o)s WHERE {_OWNED}
"""  # noqa: S608 - module constants only; the table name is a sql.Identifier
_ADVANCE = f"UPDATE {{t}} SET recovery = %(r)s WHERE {_OWNED}"  # noqa: S608
_RECOVERY = f"SELECT recovery FROM {{t}} WHERE {_OWNED}"  # noqa: S608
_PURGE = """
DELETE FROM {t} WHERE ctid = ANY (ARRAY (
    SELECT ctid FROM {t}
    WHERE expires_at < clock_timestamp()
      AND (recovery IS NULL OR expires_at < clock_timestamp() - %(keep)s * interval '1 second')
    LIMIT %(limit)s
)) RETURNING 1
"""


@dataclass(frozen=True, slots=True)
class RecoveryPoint:
    """The last finished phase of a step and the data it saved for the next phase."""

    phase: str
    data: Mapping[str, Any]


# How long the pool retries a lost connection in the background (its first retry
# comes after a second, doubling) before leaving the slot to the next request, which
# connects at once. Left at psycopg_pool's 5 minutes, a database back after an outage
# of a few seconds waited seconds more for the pool's next scheduled attempt.
_RECONNECT_SECONDS = 0.5
# Records sealed by this process remembered at most (a finish normally takes each out).
_SEALED_MAX = 10_000
# How long a request waits for a pooled connection before it asks the pool to grow.
_KICK_SECONDS = 0.25

# SQLSTATEs of a connection the server ended: connection exceptions (class 08),
# admin_shutdown, crash_shutdown, cannot_connect_now. A lock or statement timeout
# (55P03, 57014) is an answer, not a lost connection: it is never resent.
_GONE = frozenset({"57P01", "57P02", "57P03"})


class _Connection(psycopg.AsyncConnection[Any]):
    """A pooled connection that keeps one cursor for the store's own statements.

    ``connection.execute()`` builds a cursor for every statement; reusing one saves
    about 13 µs of CPU per statement (``docs/performance.md``). The pool hands a
    connection to one request at a time, and each statement's rows are read before
    the connection goes back, so one cursor is enough. A handler's own statements
    (in :meth:`PostgresStore.transaction`) use cursors of their own.
    """

    _agentkey_cursor: psycopg.AsyncCursor[Any] | None = None
    _agentkey_poller: Any = None  # a select.poll() with this connection's socket registered

    async def run(self, query: bytes, params: Mapping[str, Any]) -> psycopg.AsyncCursor[Any]:
        """Execute ``query`` on the kept cursor (made on first use) and return it."""
        cur = self._agentkey_cursor
        if cur is None or cur.closed:
            cur = self._agentkey_cursor = self.cursor()
        # Rows come back in binary: a record's bytea is its bytes as they are (no hex text
        # to decode), and every column loads to the same Python value as in text.
        await cur.execute(query, params, binary=True)
        return cur


class _Slots:
    """At most ``size`` statements or transactions in flight; the others wait their turn here.

    A pool as large as the store's ``max_size`` then always has a connection for the
    ones in flight (or is growing toward one). Waiting inside psycopg_pool instead
    costs about 20 µs of CPU more per statement under load: each waiter gets a task
    (``asyncio.wait_for`` before Python 3.12) and a condition to wake, where a waiter
    here is one future, handed its slot directly by the one that leaves.
    """

    __slots__ = ("_free", "_waiters")

    def __init__(self, size: int) -> None:
        self._free = size
        self._waiters: deque[asyncio.Future[None]] = deque()

    def take(self) -> bool:
        """Take a free slot if one is free and nobody waits for it (no await: no task switch)."""
        if self._free and not self._waiters:
            self._free -= 1
            return True
        return False

    async def acquire(self, timeout: float) -> None:
        """Take a slot, waiting at most ``timeout`` seconds (then :class:`PoolTimeout`)."""
        if self.take():
            return
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[None] = loop.create_future()
        self._waiters.append(turn)
        timer = loop.call_later(timeout, _expire, turn, timeout)
        try:
            await turn
        except BaseException:
            if turn.done() and not turn.cancelled() and turn.exception() is None:
                self.release()  # handed a slot just as this waiter was cancelled
            raise
        finally:
            timer.cancel()

    def release(self) -> None:
        """Give the slot to the longest waiter still waiting, or free it."""
        while self._waiters:
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self._free += 1


def _expire(turn: asyncio.Future[None], timeout: float) -> None:
    if not turn.done():
        turn.set_exception(PoolTimeout(f"no connection was free within {timeout:g} s"))


def _lost_connection(conn: psycopg.AsyncConnection[Any], exc: BaseException) -> bool:
    """Whether ``exc`` says the connection died (so the statement may be sent elsewhere)."""
    if not isinstance(exc, psycopg.OperationalError):
        return False
    state = exc.sqlstate
    return conn.closed or state is None or state.startswith("08") or state in _GONE


def _alive(conn: _Connection) -> bool:
    """Whether an idle pooled connection can still be used, told without a round trip.

    Between statements the server sends nothing, so a socket with something to read
    was closed by the server, which usually says why first (a FATAL notice, then end
    of file). Whatever arrived is read: a connection that only had stray bytes (a TLS
    record, a notice) stays usable; one at end of file is broken.
    """
    if conn.closed:
        return False
    poller = conn._agentkey_poller
    if poller is not None and not poller.poll(0):
        return True  # the usual case: the socket this connection keeps has nothing to read
    fd = conn.fileno()
    for _ in range(3):
        if not _readable(conn, fd):
            return True
        try:
            conn.pgconn.consume_input()
        except psycopg.OperationalError:
            return False
    return False


def _readable(conn: _Connection, fd: int) -> bool:
    if _POLL is None:  # pragma: no cover - Windows has no poll()
        return bool(select.select([fd], [], [], 0)[0])
    # One poller per connection, made on first use: an open connection keeps its socket.
    poller = conn._agentkey_poller
    if poller is None:
        poller = conn._agentkey_poller = _POLL()
        poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


_POLL = getattr(select, "poll", None)


def _recovery(doc: Any) -> RecoveryPoint | None:
    if doc is None:
        return None
    return RecoveryPoint(str(doc["phase"]), dict(doc["data"]))


class PostgresTransaction:
    """The database transaction a claimed handler does its writes in.

    Obtained from :meth:`PostgresStore.transaction`. The handler runs its SQL on
    :attr:`connection`, then either :meth:`complete` (the record becomes
    ``COMPLETED`` in the same commit as the writes) or :meth:`advance` (the
    recovery point moves to the next phase in the same commit).
    """

    __slots__ = ("_claim", "_conn", "_done", "_sealed_until", "_store", "connection")

    def __init__(self, store: PostgresStore, claim: Claim, connection: _Connection) -> None:
        self._store = store
        self._claim = claim
        self._conn = connection
        self._done = ""
        self._sealed_until = 0.0  # monotonic time the sealed record outlives at least
        #: The psycopg connection, inside the transaction: run the handler's writes on it.
        self.connection: psycopg.AsyncConnection[Any] = connection

    def __repr__(self) -> str:
        return f"PostgresTransaction(key={shown_key(self._claim.idempotency_key)!r})"

    @property
    def _key(self) -> str:
        """The record's key, what :meth:`PostgresStore._map` shows (as a digest)."""
        return self._claim.record_key

    def _params(self, **extra: Any) -> dict[str, Any]:
        prefix = owner_prefix(self._claim.owner)
        return {"k": self._claim.record_key, "p": prefix, "n": len(prefix), **extra}

    def _lost(self, what: str) -> StoreError:
        return StoreError(
            f"the lease on {shown_key(self._claim.idempotency_key)} was lost before {what} "
            "(it expired and another request may hold the key), so this transaction is rolled "
            "back and none of its writes happen; the client retries with the same key"
        )

    async def recovery_point(self) -> RecoveryPoint | None:
        """The last phase a previous attempt finished, or None on a first attempt."""
        cur = await self._store._execute(self._conn, "recovery", self._params(), self._key)
        row = await cur.fetchone()
        if row is None:
            raise self._lost("reading the recovery point")
        return _recovery(row[0])

    async def advance(self, phase: str, data: Mapping[str, Any] | None = None) -> None:
        """Record that ``phase`` finished, with the ``data`` later phases need.

        Committed with this transaction's writes, so a retry after a crash resumes
        exactly after the last phase whose writes committed.
        """
        if self._done == "complete":
            raise ConfigurationError("advance() after complete(): the step is already done")
        if not isinstance(phase, str) or not phase:
            raise ConfigurationError(f"a phase is a non-empty str, got {phase!r}")
        doc = json.dumps({"phase": phase, "data": dict(data or {})}, sort_keys=True)
        params = self._params(r=doc)
        cur = await self._store._execute(self._conn, "advance", params, self._key)
        if cur.rowcount != 1:
            raise self._lost(f"recording phase {phase!r}")
        self._done = "advance"

    async def complete(self, response: _Response) -> _Response:
        """Make the record ``COMPLETED`` with ``response``, in this transaction's commit.

        ``response`` is a Starlette response (``status_code``, ``raw_headers``,
        ``body``); it is returned, so a handler ends with ``return await
        tx.complete(JSONResponse(...))`` and the live answer is the one replayed.
        """
        status = getattr(response, "status_code", None)
        body = getattr(response, "body", None)
        raw = getattr(response, "raw_headers", None)
        if not isinstance(status, int) or not isinstance(body, bytes) or raw is None:
            raise ConfigurationError(
                "complete() takes a Starlette Response with a body (JSONResponse, Response), "
                f"got {type(response).__name__}; a streaming response cannot be stored"
            )
        if not is_storable(status):
            raise ConfigurationError(
                f"complete() got status {status}, which is not a final answer for the key; "
                "raise instead, so the transaction rolls back and the step can be retried"
            )
        if self._done == "complete":
            raise ConfigurationError("complete() was already called in this transaction")
        headers = stored_headers(raw)
        clock = self._store._clock
        finished = int(clock.time() * 1000)
        outcome = StoredOutcome(
            "COMPLETED", status, headers, body, None, finished, binding=self._claim.binding
        )
        value = encode_outcome(outcome)
        ttl = self._store.result_ttl_ms
        params = self._params(v=value, o=self._claim.owner, ttl=ttl)
        sent = clock.monotonic()
        cur = await self._store._execute(self._conn, "seal", params, self._key)
        if cur.rowcount != 1:
            raise self._lost("completing")
        self._done = "complete"
        self._sealed_until = sent + ttl / 1000
        return response


class PostgresStore:
    """A store on PostgreSQL >= 12 through psycopg 3 and a psycopg_pool pool.

    ``PostgresStore("postgresql://user:pass@host/db")``. Keyword options:

    ``table``
        The records table (``agentkey_records``), optionally ``schema.table``.
    ``create``
        Create the table on first use (default). False: run :meth:`create_table`
        (or the SQL of :meth:`schema_sql`) once, as a migration, yourself.
    ``min_size``, ``max_size``
        Pool size; a burst waits up to ``timeout`` seconds for a free connection.
    ``connect_timeout``, ``timeout``
        Seconds to connect, and to wait for a pooled connection.
    ``lock_timeout``, ``statement_timeout``
        Seconds a statement waits for a lock (1 s), and runs in all (5 s), set on
        every connection when it opens; past them the request gets 503 with
        ``Retry-After`` (a locked records table never holds requests). A handler's
        transaction runs under the same limits: ``SET LOCAL statement_timeout``
        inside it gives one transaction more. None: the server's own setting.
    ``result_ttl``
        Seconds a record completed by :meth:`PostgresTransaction.complete` lives if
        the process dies before the middleware's own finish sets its ``result_ttl``.
    ``recovery_ttl``
        Seconds a released claim keeps its recovery point for the retry (24 h).
    ``sweep_every``
        Claims between two inline purges of expired records (0: only :meth:`purge`).
    ``clock``
        An :class:`~agentkey.Clock` (tests: ``agentkey.testing.FakeClock``): the time a
        completed record is stamped with, and how long this process trusts a record its
        own transaction sealed. Record expiry is the database's clock; the pool's
        ``timeout`` is a wait on the driver, in real time.

    Unreachable database: :class:`~agentkey.StoreUnavailable` (the middleware
    answers 503 and never runs the handler). The DSN is never shown.
    """

    #: Rows one inline sweep deletes at most.
    SWEEP_LIMIT = 500

    def __init__(
        self,
        dsn: str,
        *,
        table: str = "agentkey_records",
        create: bool = True,
        min_size: int = 1,
        max_size: int = 20,
        connect_timeout: float = 2.0,
        timeout: float = 5.0,
        lock_timeout: float | None = 1.0,
        statement_timeout: float | None = 5.0,
        result_ttl: float = 86_400.0,
        recovery_ttl: float = 86_400.0,
        sweep_every: int = 1024,
        clock: Clock | None = None,
    ) -> None:
        if not isinstance(dsn, str) or not (
            dsn.startswith(("postgresql://", "postgres://")) or "=" in dsn
        ):
            raise ConfigurationError(
                "PostgresStore needs a postgresql:// URL or a libpq key=value connection string"
            )
        if not isinstance(table, str) or not _TABLE.fullmatch(table):
            raise ConfigurationError(
                f"table must be a lowercase SQL identifier, optionally schema-qualified, "
                f"got {table!r}"
            )
        for name, seconds in (("result_ttl", result_ttl), ("recovery_ttl", recovery_ttl)):
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
                raise ConfigurationError(f"{name} must be a positive number of seconds")
        if isinstance(sweep_every, bool) or not isinstance(sweep_every, int) or sweep_every < 0:
            raise ConfigurationError("sweep_every must be a whole number >= 0")
        limits: list[str | None] = []
        for name, limit in (
            ("lock_timeout", lock_timeout),
            ("statement_timeout", statement_timeout),
        ):
            if limit is not None and (
                isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0
            ):
                raise ConfigurationError(f"{name} must be a positive number of seconds or None")
            limits.append(None if limit is None else f"{max(1, round(limit * 1000))}ms")
        self.table = table
        self._clock = resolve_clock(clock, "PostgresStore")
        self.result_ttl_ms = max(1, round(result_ttl * 1000))
        self.recovery_ttl = float(recovery_ttl)
        self.sweep_every = sweep_every
        self._create = create
        self._ready = False
        # One creator at a time in this process: a burst of first requests waits for the
        # first one's CREATE instead of queueing on the advisory lock past lock_timeout,
        # and shares its outcome (a failure too: they do not each wait out the pool again).
        self._creating = asyncio.Lock()
        self._creations = 0  # creations that ended, created or failed (not cancelled)
        self._creation_error: StoreError | None = None
        self._claims = 0
        # (record key, owner) of records this process's transactions sealed and committed,
        # with the monotonic time each outlives at least: the middleware's finish that
        # follows needs no round trip. Taken out by that finish (or a release).
        self._sealed: dict[tuple[str, str], float] = {}
        ident = sql.Identifier(*table.split("."))
        index = sql.Identifier(table.split(".")[-1] + "_expires_at")
        # Rendered once: a Composed query would be rendered again on every execute.
        self._sql = {
            name: sql.SQL(text).format(t=ident, ix=index).as_bytes(None)
            for name, text in (
                ("schema", _SCHEMA),
                ("claim", _CLAIM),
                ("renew", _RENEW),
                ("finish", _FINISH),
                ("release", _RELEASE),
                ("get", _GET),
                ("seal", _SEAL),
                ("advance", _ADVANCE),
                ("recovery", _RECOVERY),
                ("purge", _PURGE),
            )
        }
        self._pool: AsyncConnectionPool[_Connection] = AsyncConnectionPool(
            dsn,
            connection_class=_Connection,
            min_size=min_size,
            max_size=max_size,
            timeout=timeout,
            open=False,
            kwargs={"autocommit": True, "connect_timeout": max(1, round(connect_timeout))},
            configure=self._limit if any(limits) else None,
            reconnect_timeout=_RECONNECT_SECONDS,
            name="agentkey",
        )
        self._limits = limits
        self._max_size = max_size
        self._slots = _Slots(max_size)
        self._opened = False

    def __repr__(self) -> str:  # never shows the DSN: it may carry a password
        return f"PostgresStore(table={self.table!r})"

    def schema_sql(self) -> str:
        """The migration that creates the table and its index (idempotent)."""
        return self._sql["schema"].decode()

    # --- plumbing ---------------------------------------------------------------

    def _map(self, what: str, key: str, exc: BaseException) -> StoreError:
        if isinstance(exc, StoreError):
            return exc
        state = getattr(exc, "sqlstate", None)
        if state in ("55P03", "57014"):  # lock_not_available, query_canceled
            return StoreUnavailable(
                f"PostgreSQL did not finish {what} of record {shown(key)} within the store's "
                f"lock or statement timeout ({type(exc).__name__}): {after_failure(what)}. "
                "A transaction is holding the records table, or the database is overloaded"
            )
        if isinstance(exc, (psycopg.OperationalError, PoolTimeout, OSError)):
            return StoreUnavailable(
                f"PostgreSQL could not be reached during {what} of record {shown(key)} "
                f"({type(exc).__name__}): {after_failure(what)}. Check that the "
                "database is up and reachable"
            )
        return StoreError(
            f"PostgreSQL failed during {what} of record {shown(key)}: {type(exc).__name__}"
            + (f" (SQLSTATE {state})" if state else "")
        )

    async def _limit(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Set the lock and statement timeouts on a new connection (one round trip, once)."""
        await conn.execute(_LIMITS, self._limits)

    async def _open(self) -> None:
        if not self._opened:
            self._opened = True
            await self._pool.open(wait=False)
        if self._create and not self._ready:
            await self.create_table()

    async def _execute(
        self, conn: _Connection, name: str, params: dict[str, Any], key: str
    ) -> psycopg.AsyncCursor[Any]:
        try:
            return await conn.run(self._sql[name], params)
        except Exception as exc:
            raise self._map(name, key, exc) from None

    async def _checkout(self) -> _Connection:
        """A slot and a live pooled connection, both within the pool's ``timeout``.

        Give it back with :meth:`_checkin`.
        """
        timeout = self._pool.timeout
        # A deadline on the real clock: the pool waits for a connection in real time.
        deadline = real_deadline(self._clock, self._clock.monotonic() + timeout)
        assert deadline is not None
        if not self._slots.take():  # the usual case takes its slot without a coroutine
            await self._slots.acquire(timeout)
        try:
            # The usual case, inline: the first connection the pool hands over is alive.
            conn = await self._getconn(deadline)
            if _alive(conn):
                return conn
            await conn.close()
            await self._pool.putconn(conn)
            return await self._live(deadline, looked_at=1)
        except BaseException:
            self._slots.release()
            raise

    async def _checkin(self, conn: _Connection) -> None:
        try:
            await self._pool.putconn(conn)
        finally:
            self._slots.release()

    async def _live(self, deadline: float, looked_at: int = 0) -> _Connection:
        """A pooled connection not known to be dead; dead ones go back to be replaced.

        After a restart every idle connection is dead: the pool replaces each one
        returned closed, so at most the pool's size are looked at (``looked_at`` of them
        already were).
        """
        for _ in range(looked_at, self._max_size):
            conn = await self._getconn(deadline)
            if _alive(conn):
                return conn
            await conn.close()
            await self._pool.putconn(conn)
        return await self._getconn(deadline)  # the statement tells

    async def _getconn(self, deadline: float) -> _Connection:
        """A pooled connection, by ``deadline`` (on the real monotonic clock).

        After an outage the pool may have given up reconnecting (it retries for
        ``_RECONNECT_SECONDS``), and only a new request makes it try again: requests
        already waiting would wait out their whole timeout although the database is
        back. So a request that waits asks the pool, every ``_KICK_SECONDS``, to grow
        (``check()``: with no idle connection, that is a connection attempt).
        """
        left = deadline - time.monotonic()  # real time: psycopg_pool's getconn waits on it
        try:
            return await self._pool.getconn(timeout=min(left, _KICK_SECONDS))
        except PoolTimeout:
            if left <= _KICK_SECONDS:
                raise
        left = deadline - time.monotonic()  # real time: psycopg_pool's getconn waits on it
        waiting = asyncio.ensure_future(self._pool.getconn(timeout=left))
        try:
            while not (await asyncio.wait({waiting}, timeout=_KICK_SECONDS))[0]:
                await self._pool.check()
        except BaseException:
            if waiting.done() and not waiting.cancelled() and waiting.exception() is None:
                await self._pool.putconn(waiting.result())  # got one just as this stopped
            else:
                waiting.cancel()  # psycopg_pool returns a connection it had handed over
            raise
        return waiting.result()

    async def _one(self, name: str, key: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """Run one statement on a pooled autocommit connection: one round trip.

        Sent once more on another connection if its connection died under it (every
        statement this runs is safe to repeat).
        """
        try:
            if not self._opened or (self._create and not self._ready):
                await self._open()
            query = self._sql[name]
            for attempt in (1, 2):
                conn = await self._checkout()
                try:
                    # Every statement run here returns rows (a SELECT or a RETURNING):
                    # fetched without asking for cur.description, which builds a Column
                    # object per column on every call.
                    return await (await conn.run(query, params)).fetchall()
                except Exception as exc:
                    if attempt == 2 or not _lost_connection(conn, exc):
                        raise
                finally:
                    await self._checkin(conn)
            raise AssertionError("unreachable")  # pragma: no cover
        except Exception as exc:
            raise self._map(name, key, exc) from None

    async def create_table(self) -> None:
        """Create the table and its index if missing (safe to call from many processes)."""
        seen = self._creations
        async with self._creating:
            if self._creations != seen:  # a creation ended while this call waited for it
                if self._creation_error is None:
                    return
                raise type(self._creation_error)(str(self._creation_error))
            try:
                await self._create_table()
            except StoreError as exc:
                self._creation_error = exc
                self._creations += 1
                raise
            self._creation_error = None
            self._creations += 1

    async def _create_table(self) -> None:
        try:
            if not self._opened:
                self._opened = True
                await self._pool.open(wait=False)
            # The store's own checkout, which asks the pool to connect again every
            # _KICK_SECONDS: a plain pool checkout waited out the whole timeout when the
            # database came back after the pool had given up reconnecting, and every
            # request of a cold worker waits for this creation.
            conn = await self._checkout()
            try:
                async with conn.transaction():
                    # One creator at a time: concurrent CREATE ... IF NOT EXISTS can collide.
                    await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (self.table,))
                    await conn.execute(self._sql["schema"])
            finally:
                await self._checkin(conn)
        except Exception as exc:
            raise self._map("table creation", self.table, exc) from None
        self._ready = True

    # --- the Store protocol -------------------------------------------------------

    async def claim(self, key: str, value: bytes, *, ttl_ms: int) -> bytes | None:
        params = {"k": key, "v": bytes(value), "ttl": _check_ttl(ttl_ms)}
        for _ in range(20):
            rows = await self._one("claim", key, params)
            if rows:
                self._claims += 1  # counted here: no coroutine per claim for a rare sweep
                if self.sweep_every and self._claims % self.sweep_every == 0:
                    await self._sweep()
                return None if rows[0][1] else bytes(rows[0][0])
            # A concurrent claim committed between this statement's snapshot and its
            # INSERT: the record exists now, so the next attempt reads it.
        raise StoreError(f"claiming record {shown(key)} kept racing with other claims; retry")

    async def renew(self, key: str, owner: str, *, ttl_ms: int) -> bool:
        prefix = owner_prefix(owner)
        params = {"k": key, "p": prefix, "n": len(prefix), "o": owner, "ttl": _check_ttl(ttl_ms)}
        return await self._owned("renew", key, params)

    async def finish(self, key: str, owner: str, value: bytes, *, ttl_ms: int) -> bool:
        sealed = self._sealed.pop((key, owner), None)
        if sealed is not None and self._clock.monotonic() + _check_ttl(ttl_ms) / 1000 <= sealed + 1:
            # This owner's own transaction committed the record, which lives long enough
            # (to within a second, the time since the seal): the statement would change
            # nothing else (a sealed record is never rewritten).
            return True
        prefix = owner_prefix(owner)
        params = {
            "k": key,
            "p": prefix,
            "n": len(prefix),
            "o": owner,
            "v": bytes(value),
            "ttl": _check_ttl(ttl_ms),
        }
        return await self._owned("finish", key, params)

    async def _owned(self, name: str, key: str, params: dict[str, Any]) -> bool:
        if (await self._one(name, key, params))[0][0]:
            return True
        # "Not owned" may be a snapshot taken just before this owner's own transaction
        # committed complete() (the UPDATE waited for its row lock, then found the
        # sealed record): a fresh snapshot tells. Only the rare unowned path pays.
        return bool((await self._one(name, key, params))[0][0])

    async def release(self, key: str, owner: str) -> bool:
        self._sealed.pop((key, owner), None)
        prefix = owner_prefix(owner)
        return bool(
            (await self._one("release", key, {"k": key, "p": prefix, "n": len(prefix)}))[0][0]
        )

    async def get(self, key: str) -> bytes | None:
        rows = await self._one("get", key, {"k": key})
        return bytes(rows[0][0]) if rows else None

    async def aclose(self) -> None:
        if self._opened:
            await self._pool.close()

    # --- maintenance --------------------------------------------------------------

    async def purge(self, *, limit: int = 10_000) -> int:
        """Delete up to ``limit`` expired records; return how many. Run it as a job.

        A released claim that holds a recovery point is kept ``recovery_ttl``
        seconds past its lease, so a late retry can still resume.
        """
        params = {"keep": self.recovery_ttl, "limit": limit}
        rows = await self._one("purge", self.table, params)
        return len(rows)

    async def _sweep(self) -> None:
        """The inline purge every ``sweep_every`` claims (counted by :meth:`claim`)."""
        try:
            await self.purge(limit=self.SWEEP_LIMIT)
        except StoreError as exc:  # a failed sweep must not fail the request
            _logger.warning("purging expired idempotency records failed: %s", exc)

    # --- transactional completion -------------------------------------------------

    async def recovery_point(self, claim: Claim) -> RecoveryPoint | None:
        """The last phase an earlier attempt of ``claim``'s step finished (one round trip).

        None on a first attempt. Raises :class:`~agentkey.StoreError` if the claim
        no longer holds the key.
        """
        prefix = owner_prefix(claim.owner)
        params = {"k": claim.record_key, "p": prefix, "n": len(prefix)}
        try:
            rows = await self._one("recovery", claim.record_key, params)
        except StoreUnavailable as exc:
            raise claim._note_unavailable(exc) from None
        if not rows:
            raise StoreError(
                f"the lease on {shown_key(claim.idempotency_key)} was lost (it expired and another "
                "request may hold the key); this attempt must stop, and the client retries "
                "with the same key"
            )
        return _recovery(rows[0][0])

    @asynccontextmanager
    async def transaction(self, claim: Claim) -> AsyncIterator[PostgresTransaction]:
        """The transaction a claimed handler writes in; the record completes in its commit.

        ::

            async with store.transaction(current_claim()) as tx:
                await tx.connection.execute("INSERT INTO charges ...", (...))
                return await tx.complete(JSONResponse({...}, status_code=201))

        Leaving the block without :meth:`~PostgresTransaction.complete` or
        :meth:`~PostgresTransaction.advance` rolls back and raises
        :class:`~agentkey.ConfigurationError`: writes committed without their record
        would run again on a retry. An exception rolls everything back, so the
        middleware releases the key and the retry runs cleanly; unless the handler may
        have started something outside the transaction (it called
        ``claim.begin_mutation()`` or ``claim.key_for()`` before): the record then keeps
        "may have started", and the key is in doubt.
        """
        key = claim.idempotency_key
        body_failed = False
        try:
            await self._open()
            # Everything this step does commits or rolls back with the transaction, so a
            # crash before the commit runs nothing: the record says "claimed" (a lapsed
            # lease frees the key), not "may have started" (in doubt). One write, only
            # when the claim said "may have started" (mutation_starts="on_run") and the
            # handler made no foreign call before (begin_mutation(), key_for()).
            await claim._mark_claimed()
            conn = await self._checkout()
            try:
                async with conn.transaction():
                    tx = PostgresTransaction(self, claim, conn)
                    try:
                        yield tx
                    except BaseException:
                        body_failed = True  # the handler's own error, passed on (below)
                        raise
                    if not tx._done:
                        raise ConfigurationError(
                            f"the transaction of {shown_key(key)} ended without complete() or "
                            "advance(); "
                            "it was rolled back, because writes committed without their "
                            "record would run again on a retry"
                        )
            finally:
                await self._checkin(conn)
            claim._maybe_committed = True  # a phase (or the answer) committed
            if tx._sealed_until:  # committed
                if len(self._sealed) >= _SEALED_MAX:  # finishes that never came: forget them
                    self._sealed.clear()
                self._sealed[(claim.record_key, claim.owner)] = tx._sealed_until
        except StoreUnavailable as exc:  # complete() or advance() failed
            raise claim._note_unavailable(exc) from None
        except (psycopg.Error, PoolTimeout, OSError) as exc:
            if not body_failed:
                # A failed COMMIT is ambiguous, and the record settles it: committed, it is
                # COMPLETED and the retry replays; not committed, it is still the claim,
                # which the middleware releases for a clean retry.
                mapped = self._map("transaction", key, exc)
                if isinstance(mapped, StoreUnavailable):
                    # The COMMIT may have landed: never answered as "not run".
                    claim._note_unavailable(mapped, maybe_committed=True)
                raise mapped from None
            if not isinstance(exc, psycopg.OperationalError):
                raise
            # The database failed the handler's own statement (the connection died, a
            # lock or statement timeout): everything rolled back, so this is the store
            # being unavailable, and the middleware answers 503, not 500.
            raise claim._note_unavailable(
                StoreUnavailable(
                    f"PostgreSQL failed a statement inside the transaction of {shown_key(key)} "
                    f"({type(exc).__name__}"
                    + (f", SQLSTATE {exc.sqlstate}" if exc.sqlstate else "")
                    + "); the transaction was rolled back and none of its writes happened, so "
                    "a retry with the same key runs the step"
                )
            ) from None
