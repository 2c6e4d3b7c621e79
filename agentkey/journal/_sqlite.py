"""The default journal: one SQLite file in the user's data directory, no service to run.

WAL mode with ``synchronous=NORMAL``: a committed record survives the process
being killed at any moment (it is in the WAL, in the operating system's
cache); a power cut may lose the last records unless ``durable=True``
(``synchronous=FULL``: an fsync per write). Several processes on one host may
share the file.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import sys
import threading
import weakref
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

from .._exceptions import ConfigurationError
from ._base import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_RETENTION,
    EVIDENCE_TTL,
    Begun,
    CallRecord,
    CallState,
    check_journal_options,
    is_live,
    now_wall,
    repeats_among,
)
from ._memory import SyncJournal
from ._records import FIELDS, values_of

__all__ = ["COLUMNS", "SQLiteJournal", "default_journal_path", "record_of_row", "row_of_record"]

#: The record's fields, in column order (the SQL journals share it).
COLUMNS: tuple[str, ...] = FIELDS
_PRUNE_EVERY = 600.0  # seconds between opportunistic prunes
_EVIDENCE_READ_EVERY = 60.0  # seconds a route's evidence is trusted from memory
_EVIDENCE_CACHE = 4096  # routes remembered in memory at most

_SCHEMA = """
CREATE TABLE IF NOT EXISTS agentkey_calls (
  key TEXT PRIMARY KEY NOT NULL,
  plan TEXT NOT NULL,
  step TEXT,
  tool TEXT,
  args_hash TEXT,
  route TEXT NOT NULL,
  state TEXT NOT NULL,
  call_id TEXT,
  context TEXT,
  created_at REAL NOT NULL,
  updated_at REAL NOT NULL,
  owner TEXT,
  lease_until REAL NOT NULL,
  attempts INTEGER NOT NULL,
  status_code INTEGER,
  outcome TEXT,
  source TEXT,
  error TEXT,
  reason TEXT,
  honoured INTEGER,
  body BLOB,
  body_size INTEGER,
  status_url TEXT
);
DROP INDEX IF EXISTS agentkey_calls_by_plan;
-- What the repeat look-up before every call asks: a plan's calls with these arguments.
CREATE INDEX IF NOT EXISTS agentkey_calls_by_args ON agentkey_calls (plan, args_hash, created_at);
CREATE TABLE IF NOT EXISTS agentkey_evidence (
  route TEXT PRIMARY KEY NOT NULL,
  evidence TEXT NOT NULL,
  seen_at REAL NOT NULL
);
"""

# Statements built once from the column list (constants: never user data).
_INSERT = (
    f"INSERT INTO agentkey_calls ({', '.join(COLUMNS)}) "  # noqa: S608
    f"VALUES ({', '.join('?' * len(COLUMNS))}) ON CONFLICT (key) DO NOTHING"
)
_SET = ", ".join(f"{c} = ?" for c in COLUMNS[1:])
_SELECT = f"SELECT {', '.join(COLUMNS)} FROM agentkey_calls"  # noqa: S608
_BY_KEY = f"{_SELECT} WHERE key = ?"
_TAKE_OVER = (
    f"UPDATE agentkey_calls SET {_SET} "  # noqa: S608
    "WHERE key = ? AND state = ? AND owner IS ? AND updated_at = ?"
)
_FINISH = f"UPDATE agentkey_calls SET {_SET} WHERE key = ? AND owner IS ?"  # noqa: S608
_REPEATS = f"{_SELECT} WHERE plan = ? AND args_hash = ? AND key != ? AND call_id IS NULL"
#: The same, whatever the runtime's call id (a begin with ``known=``).
_SAME_CALLS = f"{_SELECT} WHERE plan = ? AND args_hash = ? AND key != ?"


def row_of_record(record: CallRecord) -> tuple[Any, ...]:
    """The record's column values, in :data:`COLUMNS` order (a state binds as its value)."""
    return values_of(record)


def record_of_row(row: Sequence[Any]) -> CallRecord:
    """The record a row holds (columns in :data:`COLUMNS` order)."""
    fields = dict(zip(COLUMNS, row, strict=True))
    fields["state"] = CallState(fields["state"])
    if fields["honoured"] is not None:
        fields["honoured"] = bool(fields["honoured"])
    if fields["body"] is not None:
        fields["body"] = bytes(fields["body"])
    return CallRecord(**fields)


def _close_in(conn: sqlite3.Connection, pid: int) -> None:
    """Close ``conn`` if this is the process that opened it (a forked child must not)."""
    if os.getpid() == pid:
        conn.close()


def default_journal_path() -> Path:
    """Where the default journal lives: the user's data directory, ``agentkey/journal.sqlite3``.

    ``$XDG_DATA_HOME`` (else ``~/.local/share``) on Linux and the BSDs,
    ``~/Library/Application Support`` on macOS, ``%LOCALAPPDATA%`` on Windows.
    """
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Application Support"
    else:
        base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "agentkey" / "journal.sqlite3"


def _prepare(path: Path) -> None:
    """Create the directory (0700) and the file (0600); refuse a symlink in either place."""
    directory = path.parent
    if directory.is_symlink():
        raise ConfigurationError(f"the journal's directory {str(directory)!r} is a symlink")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise ConfigurationError(
            f"cannot open the journal file {str(path)!r} ({exc.strerror or exc}); pass "
            "journal=SQLiteJournal('<a path you can write>') or set AGENTKEY_JOURNAL"
        ) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigurationError(f"the journal file {str(path)!r} is not a regular file")
    finally:
        os.close(fd)


class SQLiteJournal(SyncJournal):
    """The journal in a SQLite file (default: :func:`default_journal_path`).

    ``durable=True`` makes every write reach the disk before it returns (an fsync
    each), for records that must survive a power cut, not only a killed process.
    Records untouched for ``retention`` seconds (a week) are deleted. Answers
    over ``max_body_bytes`` are not kept (their size is). ``clock`` gives Unix
    seconds.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        durable: bool = False,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        retention: float = DEFAULT_RETENTION,
        clock: Callable[[], float] = now_wall,
    ) -> None:
        self.max_body_bytes, self.retention = check_journal_options(max_body_bytes, retention)
        self.path = Path(path) if path is not None else default_journal_path()
        self.durable = bool(durable)
        self.clock = clock
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._pid = 0
        self._closer: weakref.finalize[Any, Any] | None = None
        self._pruned = 0.0
        # route -> (evidence, when it was read): read at most once a minute per route,
        # so starting a call is one statement, not two.
        self._evidence_cache: dict[str, tuple[str | None, float]] = {}
        self._connection()  # fail at construction, not at the first call

    def __repr__(self) -> str:
        return f"SQLiteJournal({str(self.path)!r})"

    def _connection(self) -> sqlite3.Connection:
        """The connection of this process (reopened in a forked child)."""
        pid = os.getpid()
        if self._conn is not None and self._pid == pid:
            return self._conn
        _prepare(self.path)
        conn = None
        try:
            conn = sqlite3.connect(
                self.path, timeout=5.0, isolation_level=None, check_same_thread=False
            )
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(f"PRAGMA synchronous={'FULL' if self.durable else 'NORMAL'}")
            conn.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            if conn is not None:
                conn.close()  # a file that is not a database: nothing is left open
            raise ConfigurationError(
                f"the journal file {str(self.path)!r} cannot be used as a SQLite database "
                f"({exc}); move it away or pass another path"
            ) from None
        self._conn, self._pid = conn, pid
        # A journal dropped without close() still closes its connection (Python 3.13 warns
        # about a connection left to the collector); never one inherited across a fork.
        self._closer = weakref.finalize(self, _close_in, conn, pid)
        self._prune_now(conn)
        return conn

    def _prune_now(self, conn: sqlite3.Connection) -> int:
        now = self.clock()
        self._pruned = now
        cursor = conn.execute(
            "DELETE FROM agentkey_calls WHERE updated_at < ?", (now - self.retention,)
        )
        conn.execute("DELETE FROM agentkey_evidence WHERE seen_at < ?", (now - EVIDENCE_TTL,))
        return cursor.rowcount

    def _evidence(self, conn: sqlite3.Connection, route: str) -> str | None:
        now = self.clock()
        cached = self._evidence_cache.get(route)
        if cached is not None and now - cached[1] < _EVIDENCE_READ_EVERY:
            return cached[0]
        if len(self._evidence_cache) >= _EVIDENCE_CACHE:
            self._evidence_cache.clear()
        row = conn.execute(
            "SELECT evidence FROM agentkey_evidence WHERE route = ? AND seen_at >= ?",
            (route, now - EVIDENCE_TTL),
        ).fetchone()
        found = None if row is None else str(row[0])
        self._evidence_cache[route] = (found, now)
        return found

    def begin(
        self, record: CallRecord, *, repeats: bool = False, known: Collection[str] | None = None
    ) -> Begun:
        with self._lock:
            conn = self._connection()
            if self.clock() - self._pruned > _PRUNE_EVERY:
                self._prune_now(conn)
            if not repeats:
                return self._begin(conn, record)
            # Look and write in one write transaction: another process sending the same
            # call at another step then finds this one, or this one finds it.
            conn.execute("BEGIN IMMEDIATE")
            try:
                query = _REPEATS if known is None else _SAME_CALLS
                rows = conn.execute(query, (record.plan, record.args_hash, record.key))
                earlier = repeats_among(record, map(record_of_row, rows), known=known)
                begun = (
                    Begun(None, self._evidence(conn, record.route), False, earlier)
                    if earlier
                    else self._begin(conn, record)
                )
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return begun

    def _begin(self, conn: sqlite3.Connection, record: CallRecord) -> Begun:
        inserted = conn.execute(_INSERT, row_of_record(record)).rowcount == 1
        existing = None
        if not inserted:
            row = conn.execute(_BY_KEY, (record.key,)).fetchone()
            existing = None if row is None else record_of_row(row)
        live = existing is not None and is_live(existing, self.clock())
        return Begun(existing, self._evidence(conn, record.route), live)

    def take_over(self, record: CallRecord, previous: CallRecord) -> bool:
        with self._lock:
            cursor = self._connection().execute(
                _TAKE_OVER,
                (
                    *row_of_record(record)[1:],
                    record.key,
                    previous.state.value,
                    previous.owner,
                    previous.updated_at,
                ),
            )
            return cursor.rowcount == 1

    def finish(self, record: CallRecord) -> bool:
        with self._lock:
            cursor = self._connection().execute(
                _FINISH, (*row_of_record(record)[1:], record.key, record.owner)
            )
            return cursor.rowcount == 1

    def get(self, key: str) -> CallRecord | None:
        with self._lock:
            row = self._connection().execute(_BY_KEY, (key,)).fetchone()
        return None if row is None else record_of_row(row)

    def find(
        self,
        plan: str,
        *,
        tool: str | None = None,
        args_hash: str | None = None,
        call_id: str | None = None,
    ) -> list[CallRecord]:
        where, params = ["plan = ?"], [plan]
        for column, value in (("tool", tool), ("args_hash", args_hash), ("call_id", call_id)):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        sql = f"{_SELECT} WHERE {' AND '.join(where)} ORDER BY created_at, key"
        with self._lock:
            rows = self._connection().execute(sql, params).fetchall()
        return [record_of_row(row) for row in rows]

    def calls(
        self,
        *,
        plan: str | None = None,
        states: Sequence[CallState] | None = None,
        limit: int = 100,
    ) -> list[CallRecord]:
        where: list[str] = []
        params: list[Any] = []
        if plan is not None:
            where.append("plan = ?")
            params.append(plan)
        if states is not None:
            where.append(f"state IN ({', '.join('?' * len(states))})")
            params += [CallState(s).value for s in states]
        clause = f" WHERE {' AND '.join(where)}" if where else ""
        sql = f"{_SELECT}{clause} ORDER BY updated_at DESC, key LIMIT ?"
        with self._lock:
            rows = self._connection().execute(sql, [*params, max(0, int(limit))]).fetchall()
        return [record_of_row(row) for row in rows]

    def learn(self, route: str, evidence: str) -> None:
        with self._lock:
            self._evidence_cache[route] = (evidence, self.clock())
            self._connection().execute(
                "INSERT INTO agentkey_evidence (route, evidence, seen_at) VALUES (?, ?, ?) "
                "ON CONFLICT (route) DO UPDATE SET evidence = excluded.evidence, "
                "seen_at = excluded.seen_at",
                (route, evidence, self.clock()),
            )

    def settle(self, key: str, state: CallState, *, reason: str) -> CallRecord | None:
        with self._lock:
            conn = self._connection()
            conn.execute(
                "UPDATE agentkey_calls SET state = ?, owner = NULL, reason = ?, "
                "source = 'operator', updated_at = ? WHERE key = ?",
                (CallState(state).value, reason, self.clock(), key),
            )
            row = conn.execute(_BY_KEY, (key,)).fetchone()
        return None if row is None else record_of_row(row)

    def prune(self, *, older_than: float) -> int:
        with self._lock:
            conn = self._connection()
            cursor = conn.execute(
                "DELETE FROM agentkey_calls WHERE updated_at < ?", (self.clock() - older_than,)
            )
            return cursor.rowcount

    def close(self) -> None:
        with self._lock:
            if self._closer is not None:
                self._closer()  # closes the connection in the process that opened it
            self._conn = self._closer = None
