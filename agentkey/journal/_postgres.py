"""The journal in PostgreSQL, for a fleet of agents that share one record of their calls.

Two tables (created on first use): ``agentkey_calls``, one row per call, and
``agentkey_evidence``, what routes showed about honouring keys. Writing a
call's start is one statement (insert unless present, and return what was
there and what is known of its route); its end is one compare-and-set on the
owner. Every statement runs in its own transaction (the connections are in autocommit),
with a statement timeout.

A start that looks for the same call at another step first (``repeats=True``) is one
transaction instead: it takes a transaction-scoped advisory lock on the call's plan and
arguments, looks, and inserts (or answers with the earlier calls). Two agents starting
the same call at once thus meet at the lock, and the second finds the first's record.
BEGIN, the lock and the look go out as one message, the insert and COMMIT as another (the
look gets its own snapshot, taken once the lock is held): two round trips where the other
starts take one, plus the pool's check of the connection.

Needs psycopg 3 and its pool (``pip install 'agentkey-idempotency[postgres]'``).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import AsyncIterator, Collection, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from .._clock import Clock
from .._exceptions import ConfigurationError, JournalError, missing_extra
from ._base import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_RETENTION,
    EVIDENCE_TTL,
    SETTLED,
    Begun,
    CallRecord,
    CallState,
    Evidence,
    afinish_missed,
    check_journal_options,
    finish_missed,
    is_live,
    journal_clock,
    prunable,
    repeats_among,
    settle_by_take_over,
)
from ._sqlite import COLUMNS, one_record, records_of_rows, row_of_record

try:
    import psycopg
    from psycopg import sql
    from psycopg_pool import AsyncConnectionPool, ConnectionPool
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise missing_extra("postgres", "psycopg", exc) from exc

__all__ = ["PostgresJournal"]

_TYPES = {
    "created_at": "DOUBLE PRECISION NOT NULL",
    "updated_at": "DOUBLE PRECISION NOT NULL",
    "lease_until": "DOUBLE PRECISION NOT NULL",
    "attempts": "INTEGER NOT NULL",
    "status_code": "INTEGER",
    "honoured": "BOOLEAN",
    "body": "BYTEA",
    "body_size": "BIGINT",
    "plan": "TEXT NOT NULL",
    "route": "TEXT NOT NULL",
    "state": "TEXT NOT NULL",
}
_TABLE = re.compile(r"[a-z_][a-z0-9_]{0,40}")
#: When a row of evidence expires: its ``expires_at`` (``learn(ttl=)``), else EVIDENCE_TTL
#: after it was last seen (rows written before the column). A constant, never user data.
assert EVIDENCE_TTL == 2592000.0  # the SQL below spells it out
_COLS = sql.SQL(", ").join(map(sql.Identifier, COLUMNS))
_QUALIFIED = sql.SQL(", ").join(sql.Identifier("c", c) for c in COLUMNS)
_PLACES = sql.SQL(", ").join(sql.Placeholder() * len(COLUMNS))
_SET = sql.SQL(", ").join(sql.SQL("{} = %s").format(sql.Identifier(c)) for c in COLUMNS[1:])
_DEFS = sql.SQL(", ").join(
    sql.SQL("{} {}").format(
        sql.Identifier(c), sql.SQL("TEXT PRIMARY KEY" if c == "key" else _TYPES.get(c, "TEXT"))
    )
    for c in COLUMNS
)


def lock_id(*names: str) -> int:
    """An advisory lock's id for ``names``: the first 8 bytes of their SHA-256 as a signed
    bigint (the same in every process, unlike ``hash()``)."""
    digest = hashlib.sha256("\0".join(names).encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class _Sql:
    """The statements of one journal, on its own tables (composed with psycopg's ``sql``)."""

    def __init__(self, table: str) -> None:
        names = {
            "calls": sql.Identifier(table),
            "evidence": sql.Identifier(f"{table}_evidence"),
            "by_plan": sql.Identifier(f"{table}_by_plan"),  # before the args index: dropped
            "by_args": sql.Identifier(f"{table}_by_args"),
            "by_time": sql.Identifier(f"{table}_by_time"),
            "cols": _COLS,
            "qualified": _QUALIFIED,
            "places": _PLACES,
            "set": _SET,
            "defs": _DEFS,
            "schema_lock": sql.Literal(lock_id("schema", table)),
        }

        def q(text: str) -> sql.Composed:
            return sql.SQL(text).format(**names)

        # One transaction (a message of several statements), under an advisory lock on the
        # table's name: two journals creating the tables at once would otherwise collide.
        self.schema = q(
            "SELECT pg_advisory_xact_lock({schema_lock}); "
            "CREATE TABLE IF NOT EXISTS {calls} ({defs}); "
            "DROP INDEX IF EXISTS {by_plan}; "
            # What the repeat look-up before every call asks: a plan's calls with these args.
            "CREATE INDEX IF NOT EXISTS {by_args} ON {calls} (plan, args_hash, created_at); "
            "CREATE INDEX IF NOT EXISTS {by_time} ON {calls} (updated_at); "
            "CREATE TABLE IF NOT EXISTS {evidence} (route TEXT PRIMARY KEY, "
            "evidence TEXT NOT NULL, seen_at DOUBLE PRECISION NOT NULL); "
            "ALTER TABLE {evidence} ADD COLUMN IF NOT EXISTS first_seen DOUBLE PRECISION; "
            "ALTER TABLE {evidence} ADD COLUMN IF NOT EXISTS expires_at DOUBLE PRECISION"
        )
        # The record unless its key exists; then the existing row; and the route's evidence.
        # One statement: the SELECT of the existing row sees the table as it was before.
        self.begin = q(
            "WITH inserted AS (INSERT INTO {calls} ({cols}) VALUES ({places}) "
            "ON CONFLICT (key) DO NOTHING RETURNING key) "
            "SELECT (SELECT count(*) FROM inserted), "
            "(SELECT evidence FROM {evidence} WHERE route = %s "
            "AND coalesce(expires_at, seen_at + 2592000.0) >= %s), "
            "{qualified} FROM (SELECT 1) AS one LEFT JOIN {calls} c ON c.key = %s"
        )
        # The begin that looks for the same call at another step: BEGIN, an advisory lock on
        # the call's plan and arguments held to the end of the transaction, then the look.
        # The look is a statement of its own, so its snapshot (READ COMMITTED: one per
        # statement) is taken once the lock is held: it sees the record of the copy that
        # held the lock before. Then the insert and COMMIT, or ROLLBACK. The same call is
        # under another key, made without a runtime's call id; or whatever the call id (a
        # begin with ``known=``). Served by the (plan, args_hash) index.
        locked = "BEGIN; SELECT pg_advisory_xact_lock(%s); "
        same = "SELECT {cols} FROM {calls} WHERE plan = %s AND args_hash = %s AND key <> %s"
        self.locked_repeats = q(f"{locked}{same} AND call_id IS NULL")
        self.locked_same_calls = q(f"{locked}{same}")
        self.begin_and_commit = sql.Composed([self.begin, sql.SQL("; COMMIT")])
        self.take_over = q(
            "UPDATE {calls} SET {set} WHERE key = %s AND state = %s "
            "AND owner IS NOT DISTINCT FROM %s AND updated_at = %s"
        )
        self.finish = q("UPDATE {calls} SET {set} WHERE key = %s AND owner IS NOT DISTINCT FROM %s")
        self.select = q("SELECT {cols} FROM {calls}")
        self.by_key = q("SELECT {cols} FROM {calls} WHERE key = %s")
        self.learn = q(
            "INSERT INTO {evidence} AS e (route, evidence, seen_at, first_seen, expires_at) "
            "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (route) DO UPDATE SET "
            "evidence = excluded.evidence, first_seen = CASE WHEN "
            "coalesce(e.expires_at, e.seen_at + 2592000.0) >= %s "
            "THEN coalesce(e.first_seen, e.seen_at) ELSE excluded.first_seen END, "
            "seen_at = excluded.seen_at, expires_at = excluded.expires_at"
        )
        self.evidence = q(
            "SELECT route, evidence, coalesce(first_seen, seen_at), seen_at, "
            "coalesce(expires_at, seen_at + 2592000.0) FROM {evidence} "
            "WHERE coalesce(expires_at, seen_at + 2592000.0) >= %s ORDER BY seen_at DESC, route"
        )
        self.forget = q("DELETE FROM {evidence} WHERE route = %s")
        self.expire_evidence = q(
            "DELETE FROM {evidence} WHERE coalesce(expires_at, seen_at + 2592000.0) < %s"
        )
        self.prune = q("DELETE FROM {calls} WHERE updated_at < %s AND state = ANY(%s)")
        self.unsettled = q(
            "SELECT {cols} FROM {calls} WHERE updated_at < %s AND NOT state = ANY(%s)"
        )
        self.delete_unchanged = q(
            "DELETE FROM {calls} WHERE key = %s AND state = %s "
            "AND owner IS NOT DISTINCT FROM %s AND updated_at = %s"
        )

    def where(self, conditions: Sequence[str], order: str) -> sql.Composed:
        """``SELECT ... WHERE <conditions> <order>``; the conditions are this module's own."""
        clause = sql.SQL(" AND ").join(sql.SQL(c) for c in conditions)
        return sql.SQL("{} WHERE {} {}").format(self.select, clause, sql.SQL(order))

    def find(
        self, plan: str, tool: str | None, args_hash: str | None, call_id: str | None
    ) -> tuple[sql.Composed, list[Any]]:
        where, params = ["plan = %s"], [plan]
        for column, value in (("tool", tool), ("args_hash", args_hash), ("call_id", call_id)):
            if value is not None:
                where.append(f"{column} = %s")
                params.append(value)
        return self.where(where, "ORDER BY created_at, key"), params


class PostgresJournal:
    """The journal in a PostgreSQL database.

    ``conninfo`` is a libpq connection string or URL
    (``postgresql://agent@db/agents``); the journal opens small pools of its
    own (a synchronous one for :class:`~agentkey.ToolInvoker`, an asyncio one
    for :class:`~agentkey.AsyncToolInvoker`) on first use. ``statement_timeout``
    (seconds) bounds every statement, lock waits included. ``table`` names the
    calls table (the evidence table is ``<table>_evidence``).
    """

    supports_sync = True
    supports_async = True

    def __init__(
        self,
        conninfo: str,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        retention: float = DEFAULT_RETENTION,
        statement_timeout: float = 5.0,
        table: str = "agentkey_calls",
        clock: Clock | None = None,
    ) -> None:
        self.max_body_bytes, self.retention = check_journal_options(max_body_bytes, retention)
        if not isinstance(conninfo, str) or not conninfo:
            raise ConfigurationError("PostgresJournal takes a libpq connection string or URL")
        if (
            isinstance(statement_timeout, bool)
            or not isinstance(statement_timeout, (int, float))
            or not 0 < statement_timeout <= 600
        ):
            raise ConfigurationError("statement_timeout must be 0 to 600 seconds (not 0)")
        if not isinstance(table, str) or not _TABLE.fullmatch(table):
            raise ConfigurationError(
                f"table must be a lowercase SQL name ([a-z_][a-z0-9_]*, up to 41 characters), "
                f"got {table!r}"
            )
        self._sql = _Sql(table)
        self._table = table
        self._conninfo = conninfo
        self._options: dict[str, Any] = {
            "autocommit": True,  # one statement, one transaction: no BEGIN and COMMIT turns
            # A begin's lock is held between two statements; a client stuck there (never
            # one that died: its lock goes with its connection) is cut after the timeout.
            "options": f"-c statement_timeout={int(statement_timeout * 1000)} "
            f"-c lock_timeout={int(statement_timeout * 1000)} "
            f"-c idle_in_transaction_session_timeout={int(statement_timeout * 1000)}",
        }
        self._clock = journal_clock(clock)
        self._pool: ConnectionPool[psycopg.Connection[Any]] | None = None
        self._apool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] | None = None
        self._schema = False

    def __repr__(self) -> str:
        return "PostgresJournal(<conninfo>)"  # the conninfo may hold a password

    def _wrap(self, exc: Exception) -> JournalError:
        return JournalError(
            f"the PostgreSQL journal failed ({type(exc).__name__}); the call was not sent. "
            "Check that the database is reachable, or pass another journal",
            sent=False,
        )

    # --- synchronous ---------------------------------------------------------------------

    @contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection (one transaction, committed on a clean exit), the tables made."""
        if self._pool is None:
            self._pool = ConnectionPool(
                self._conninfo, kwargs=self._options, min_size=1, max_size=4, open=True,
                check=ConnectionPool.check_connection,
            )  # fmt: skip
        try:
            with self._pool.connection() as conn:
                if not self._schema:
                    conn.execute(self._sql.schema)
                    self._schema = True
                yield conn
        except psycopg.Error as exc:
            raise self._wrap(exc) from None

    def _run(self, query: sql.Composed, params: Sequence[Any] = (), *, rows: bool = False) -> Any:
        with self._connection() as conn:
            cursor = conn.execute(query, params)
            return cursor.fetchall() if rows else cursor.rowcount

    def begin(
        self, record: CallRecord, *, repeats: bool = False, known: Collection[str] | None = None
    ) -> Begun:
        if repeats and record.args_hash is not None:
            with self._connection() as conn, psycopg.ClientCursor(conn) as cursor:
                try:
                    cursor.execute(*self._locked_look(record, known))
                    cursor.nextset()  # past BEGIN
                    cursor.nextset()  # past the lock
                    found = records_of_rows(cursor.fetchall(), repr(self))
                    if earlier := repeats_among(record, found, known=known):
                        conn.rollback()  # nothing written: end the transaction, free the lock
                        return Begun(None, None, False, earlier)  # their key's begin says more
                    cursor.execute(self._sql.begin_and_commit, self._begin_params(record))
                    (row,) = cursor.fetchall()
                except BaseException:
                    with contextlib.suppress(psycopg.Error):
                        conn.rollback()
                    raise
        else:
            (row,) = self._run(self._sql.begin, self._begin_params(record), rows=True)
        if not row[0] and row[2] is None:  # another insert won after this statement's snapshot
            return self._begun(
                (0, row[1], *(self._run(self._sql.by_key, (record.key,), rows=True)[0]))
            )
        return self._begun(row)

    def take_over(self, record: CallRecord, previous: CallRecord) -> bool:
        return bool(self._run(self._sql.take_over, self._take_over_params(record, previous)) == 1)

    def finish(self, record: CallRecord) -> bool:
        params = (*row_of_record(record)[1:], record.key, record.owner)
        if self._run(self._sql.finish, params) == 1:
            return True
        raise finish_missed(self, record)

    def get(self, key: str) -> CallRecord | None:
        found = self._run(self._sql.by_key, (key,), rows=True)
        return one_record(found[0] if found else None, repr(self))

    def find(
        self,
        plan: str,
        *,
        tool: str | None = None,
        args_hash: str | None = None,
        call_id: str | None = None,
    ) -> list[CallRecord]:
        query, params = self._sql.find(plan, tool, args_hash, call_id)
        return records_of_rows(self._run(query, params, rows=True), repr(self))

    def calls(
        self,
        *,
        plan: str | None = None,
        states: Sequence[CallState] | None = None,
        limit: int = 100,
    ) -> list[CallRecord]:
        where: list[str] = ["TRUE"]
        params: list[Any] = []
        if plan is not None:
            where.append("plan = %s")
            params.append(plan)
        if states is not None:
            where.append("state = ANY(%s)")
            params.append([CallState(s).value for s in states])
        query = self._sql.where(where, "ORDER BY updated_at DESC, key LIMIT %s")
        rows = self._run(query, [*params, max(0, int(limit))], rows=True)
        return records_of_rows(rows, repr(self))

    def learn(self, route: str, evidence: str, *, ttl: float | None = None) -> None:
        self._run(self._sql.learn, self._learn_params(route, evidence, ttl))

    def evidence(self) -> list[Evidence]:
        now = self._clock.time()
        self._run(self._sql.expire_evidence, (now,))
        rows = self._run(self._sql.evidence, (now,), rows=True)
        return [Evidence(r, str(m), f, s, e) for r, m, f, s, e in rows]

    def forget(self, route: str) -> bool:
        return bool(self._run(self._sql.forget, (route,)))

    def settle(
        self, key: str, state: CallState, *, reason: str, force: bool = False
    ) -> CallRecord | None:
        return settle_by_take_over(self, key, state, reason, force=force, now=self._clock.time())

    def prune(self, *, older_than: float, include_unsettled: bool = False) -> int:
        now = self._clock.time()
        cutoff = now - older_than
        ended = [s.value for s in SETTLED]
        count: int = self._run(self._sql.prune, (cutoff, ended))
        if include_unsettled:
            rows = self._run(self._sql.unsettled, (cutoff, ended), rows=True)
            for found in records_of_rows(rows, repr(self)):
                if prunable(found, cutoff, include_unsettled=True, now=now):
                    count += self._run(
                        self._sql.delete_unchanged,
                        (found.key, found.state.value, found.owner, found.updated_at),
                    )
        return count

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    # --- asyncio -------------------------------------------------------------------------

    @asynccontextmanager
    async def _aconnection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """:meth:`_connection` for asyncio."""
        if self._apool is None:
            pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] = AsyncConnectionPool(
                self._conninfo, kwargs=self._options, min_size=1, max_size=4, open=False,
                check=AsyncConnectionPool.check_connection,
            )  # fmt: skip
            await pool.open()
            self._apool = pool
        try:
            async with self._apool.connection() as conn:
                if not self._schema:
                    await conn.execute(self._sql.schema)
                    self._schema = True
                yield conn
        except psycopg.Error as exc:
            raise self._wrap(exc) from None

    async def _arun(
        self, query: sql.Composed, params: Sequence[Any] = (), *, rows: bool = False
    ) -> Any:
        async with self._aconnection() as conn:
            cursor = await conn.execute(query, params)
            return await cursor.fetchall() if rows else cursor.rowcount

    async def abegin(
        self, record: CallRecord, *, repeats: bool = False, known: Collection[str] | None = None
    ) -> Begun:
        if repeats and record.args_hash is not None:
            async with self._aconnection() as conn, psycopg.AsyncClientCursor(conn) as cursor:
                try:
                    await cursor.execute(*self._locked_look(record, known))
                    cursor.nextset()
                    cursor.nextset()
                    found = records_of_rows(await cursor.fetchall(), repr(self))
                    if earlier := repeats_among(record, found, known=known):
                        await conn.rollback()
                        return Begun(None, None, False, earlier)
                    await cursor.execute(self._sql.begin_and_commit, self._begin_params(record))
                    (row,) = await cursor.fetchall()
                except BaseException:
                    with contextlib.suppress(psycopg.Error):
                        await conn.rollback()
                    raise
        else:
            (row,) = await self._arun(self._sql.begin, self._begin_params(record), rows=True)
        if not row[0] and row[2] is None:  # another insert won after this statement's snapshot
            (again,) = await self._arun(self._sql.by_key, (record.key,), rows=True)
            return self._begun((0, row[1], *again))
        return self._begun(row)

    async def atake_over(self, record: CallRecord, previous: CallRecord) -> bool:
        return bool(
            await self._arun(self._sql.take_over, self._take_over_params(record, previous)) == 1
        )

    async def afinish(self, record: CallRecord) -> bool:
        params = (*row_of_record(record)[1:], record.key, record.owner)
        if await self._arun(self._sql.finish, params) == 1:
            return True
        raise await afinish_missed(self, record)

    async def aget(self, key: str) -> CallRecord | None:
        found = await self._arun(self._sql.by_key, (key,), rows=True)
        return one_record(found[0] if found else None, repr(self))

    async def afind(
        self,
        plan: str,
        *,
        tool: str | None = None,
        args_hash: str | None = None,
        call_id: str | None = None,
    ) -> list[CallRecord]:
        query, params = self._sql.find(plan, tool, args_hash, call_id)
        return records_of_rows(await self._arun(query, params, rows=True), repr(self))

    async def alearn(self, route: str, evidence: str, *, ttl: float | None = None) -> None:
        await self._arun(self._sql.learn, self._learn_params(route, evidence, ttl))

    async def aclose(self) -> None:
        if self._apool is not None:
            await self._apool.close()
            self._apool = None

    # --- shared --------------------------------------------------------------------------

    def _learn_params(self, route: str, evidence: str, ttl: float | None) -> tuple[Any, ...]:
        now = self._clock.time()
        return (route, evidence, now, now, now + (EVIDENCE_TTL if ttl is None else ttl), now)

    def _lock_id(self, record: CallRecord) -> int:
        """The advisory lock of the record's table, plan and arguments."""
        return lock_id("call", self._table, record.plan, record.args_hash or "")

    def _locked_look(
        self, record: CallRecord, known: Collection[str] | None
    ) -> tuple[sql.Composed, tuple[Any, ...]]:
        """BEGIN, the lock and the look, sent as one message (bound on the client)."""
        query = self._sql.locked_repeats if known is None else self._sql.locked_same_calls
        return query, (self._lock_id(record), record.plan, record.args_hash, record.key)

    def _begin_params(self, record: CallRecord) -> tuple[Any, ...]:
        return (*row_of_record(record), record.route, self._clock.time(), record.key)

    @staticmethod
    def _take_over_params(record: CallRecord, previous: CallRecord) -> tuple[Any, ...]:
        return (
            *row_of_record(record)[1:],
            record.key,
            previous.state.value,
            previous.owner,
            previous.updated_at,
        )

    def _begun(self, row: Sequence[Any]) -> Begun:
        inserted, evidence, *rest = row
        existing = None if inserted or rest[0] is None else one_record(rest, repr(self))
        live = existing is not None and is_live(existing, self._clock.time())
        return Begun(existing, evidence, live)
