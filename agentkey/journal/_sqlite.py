"""The default journal: one SQLite file in the user's data directory, no service to run.

WAL mode with ``synchronous=NORMAL``: a committed record survives the process
being killed at any moment (it is in the WAL, in the operating system's
cache); a power cut may lose the last records unless ``durable=True``
(``synchronous=FULL``: an fsync per write). Several processes on one host may
share the file.

The database file is never opened except by SQLite. A process's POSIX locks on
a file belong to the process, not to the descriptor: closing any descriptor of
the file drops them all, and then another process's SQLite (the ``agentkey
journal`` command, say) may take itself for the last user, checkpoint and delete
the ``-wal`` and ``-shm`` files under the agent's feet, losing its records. So
the checks on the path use ``lstat`` and the file is created by SQLite itself.
"""

from __future__ import annotations

import operator
import os
import sqlite3
import stat
import sys
import threading
import time
import weakref
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

from .._clock import Clock
from .._exceptions import ConfigurationError, JournalError
from ._base import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_RETENTION,
    EVIDENCE_TTL,
    SETTLED,
    Begun,
    CallRecord,
    CallState,
    Evidence,
    check_journal_options,
    is_live,
    journal_clock,
    malformed,
    missed_finish,
    prunable,
    repeats_among,
)
from ._memory import SyncJournal
from ._records import FIELDS, recorded, values_of

__all__ = [
    "COLUMNS",
    "SQLiteJournal",
    "UnsafeJournal",
    "default_journal_path",
    "one_record",
    "record_of_row",
    "records_of_rows",
    "row_of_record",
]

#: The record's fields, in column order (the SQL journals share it).
COLUMNS: tuple[str, ...] = FIELDS
_BUSY_TIMEOUT = 5.0  # seconds a statement waits for another connection's write lock
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
#: Evidence records when it was first seen (a column added after the table).
_FIRST_SEEN = "ALTER TABLE agentkey_evidence ADD COLUMN first_seen REAL"
#: ... and when it expires (``learn(ttl=)``; a row without one expires EVIDENCE_TTL after
#: it was last seen).
_EXPIRES_AT = "ALTER TABLE agentkey_evidence ADD COLUMN expires_at REAL"
_COLUMNS = (("first_seen", _FIRST_SEEN), ("expires_at", _EXPIRES_AT))
#: The evidence in force: a row whose expiry is at or after the parameter ``now``.
_IN_FORCE = "coalesce(expires_at, seen_at + 2592000.0) >= ?"
_EXPIRY = "coalesce(expires_at, seen_at + 2592000.0)"
assert EVIDENCE_TTL == 2592000.0  # the SQL above spells it out
_ENDED = tuple(sorted(s.value for s in SETTLED))
_ENDED_IN = f"state IN ({', '.join('?' * len(_ENDED))})"
_LEARN = (
    "INSERT INTO agentkey_evidence (route, evidence, seen_at, first_seen, expires_at) "
    "VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT (route) DO UPDATE SET evidence = excluded.evidence, "
    "first_seen = CASE WHEN coalesce(agentkey_evidence.expires_at, "
    "agentkey_evidence.seen_at + 2592000.0) >= ? "
    "THEN coalesce(agentkey_evidence.first_seen, agentkey_evidence.seen_at) "
    "ELSE excluded.first_seen END, seen_at = excluded.seen_at, "
    "expires_at = excluded.expires_at"
)

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
#: The columns of the repeat index (and the key): a record keeps them from its begin.
_KEPT = ("key", "plan", "args_hash", "created_at")
_ENDING = tuple(i for i, c in enumerate(COLUMNS) if c not in _KEPT)
_ending_values = operator.itemgetter(*_ENDING)
_WHOSE = ("key", "owner", "plan", "args_hash", "created_at")
_ending_where = operator.itemgetter(*(COLUMNS.index(c) for c in _WHOSE))
#: ``_FINISH`` as the usual finish runs it: the row its begin wrote (the same key, owner,
#: plan, arguments and creation) gets every other column. Setting an indexed column rewrites
#: its index entry and one more page of the log at each commit, even to the same value; a
#: row that does not match in full goes to ``_FINISH`` itself (:meth:`SQLiteJournal.finish`).
_FINISH_ENDING = (
    f"UPDATE agentkey_calls SET {', '.join(f'{COLUMNS[i]} = ?' for i in _ENDING)} "  # noqa: S608
    "WHERE key = ? AND owner IS ? AND plan = ? AND args_hash IS ? AND created_at = ?"
)  # (the order of _WHOSE)
_REPEATS = f"{_SELECT} WHERE plan = ? AND args_hash = ? AND key != ? AND call_id IS NULL"
#: The same, whatever the runtime's call id (a begin with ``known=``).
_SAME_CALLS = f"{_SELECT} WHERE plan = ? AND args_hash = ? AND key != ?"
#: A begin that carries its look-up: the record is inserted only when its key is new and
#: no identical call (``_REPEATS``; ``_SAME_CALLS`` for ``_FIRST_OF_ALL``) is recorded. One
#: write statement, so one write transaction (SQLite takes the write lock before it reads):
#: the usual fresh call costs one statement and one commit instead of four statements.
_FIRST = (
    f"INSERT INTO agentkey_calls ({', '.join(COLUMNS)}) "  # noqa: S608
    f"SELECT {', '.join('?' * len(COLUMNS))} WHERE NOT EXISTS "
    "(SELECT 1 FROM agentkey_calls WHERE plan = ? AND args_hash = ? AND key != ?"
)
_FIRST_OF_ALL = f"{_FIRST}) ON CONFLICT (key) DO NOTHING"
_FIRST = f"{_FIRST} AND call_id IS NULL) ON CONFLICT (key) DO NOTHING"


def row_of_record(record: CallRecord) -> tuple[Any, ...]:
    """The record's column values, in :data:`COLUMNS` order (a state binds as its value)."""
    return values_of(record)


def record_of_row(row: Sequence[Any]) -> CallRecord:
    """The record a row holds (columns in :data:`COLUMNS` order); ValueError or TypeError
    when the row does not hold a record (an unknown state, a missing value)."""
    fields = dict(zip(COLUMNS, row, strict=True))
    fields["state"] = CallState(fields["state"])
    if fields["honoured"] is not None:
        fields["honoured"] = bool(fields["honoured"])
    if fields["body"] is not None:
        fields["body"] = bytes(fields["body"])
    return CallRecord(**fields)


def records_of_rows(rows: Iterable[Sequence[Any]], where: str) -> list[CallRecord]:
    """The records ``rows`` hold; a row that holds none is reported and skipped."""
    found = (_read(row, where) for row in rows)
    return [r for r in found if r is not None]


def _read(row: Sequence[Any], where: str) -> CallRecord | None:
    try:
        return record_of_row(row)
    except (ValueError, TypeError, KeyError) as exc:
        malformed(where, exc, key=row[0] if row and isinstance(row[0], str) else None)
        return None


def one_record(row: Sequence[Any] | None, where: str) -> CallRecord | None:
    """The record one row holds (None: no row); raise JournalError for a malformed one."""
    if row is None:
        return None
    try:
        return record_of_row(row)
    except (ValueError, TypeError, KeyError) as exc:
        raise malformed(where, exc, key=row[0] if isinstance(row[0], str) else None) from None


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


class UnsafeJournal(ConfigurationError):
    """The journal's directory or file may be someone else's: never used, never a fallback."""


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigurationError(
            f"cannot look at the journal path {str(path)!r} ({exc.strerror or exc})"
        ) from None


def _not_private(info: os.stat_result) -> bool:
    """Owned by another user, or readable or writable by others."""
    return hasattr(os, "getuid") and (info.st_uid != os.getuid() or bool(info.st_mode & 0o077))


def _wal(conn: sqlite3.Connection) -> None:
    """Put the file in WAL mode. Two processes opening a new journal file at once: SQLite
    answers the second one's switch "database is locked" at once, without waiting in its
    busy handler, so this waits for the first one's switch (at most the busy timeout).

    The wait is on another process's progress, as SQLite's own busy handler is: a skipping
    or fake clock would give up on a switch that has not had the time to end, so it is real.
    """
    deadline = time.monotonic() + _BUSY_TIMEOUT  # real time: another process's WAL switch
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:  # real time: as above
                raise
        time.sleep(0.005)  # real time: the other process needs the CPU to end its switch


def _add_columns(conn: sqlite3.Connection) -> None:
    """Add the evidence columns an older journal file lacks, in one write transaction: two
    processes opening one old file at once then add each column once (before, the second
    one's ``ALTER TABLE`` failed with "duplicate column name")."""

    def missing() -> list[str]:
        columns = {row[1] for row in conn.execute("PRAGMA table_info(agentkey_evidence)")}
        return [sql for name, sql in _COLUMNS if name not in columns]

    if not missing():
        return  # the usual case: one read, no write lock
    conn.execute("BEGIN IMMEDIATE")
    try:
        for sql in missing():
            conn.execute(sql)
    except BaseException:
        if conn.in_transaction:  # SQLite ends it itself after some errors (a full disk)
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _prepare(path: Path, *, create: bool, private: bool) -> bool:
    """Check the journal's path without opening the file; True when SQLite will create it.

    ``create``: make a missing directory (0700); else a missing directory or file is an
    error naming the path. ``private`` (the default location): the directory must be this
    user's with mode 0700 and the file (and its ``-wal``/``-shm``) this user's with 0600.
    A symlink in either place is refused. Only ``lstat`` looks at the file (see the module
    docstring: opening it outside SQLite would drop the process's locks on it).
    """
    directory = path.parent
    fix = (
        f"; if they are yours, run: chmod 700 {str(directory)!r} && chmod 600 "
        f"{str(path)!r}* (else move them away), or set AGENTKEY_JOURNAL to another path"
    )
    info = _lstat(directory)
    if info is not None and stat.S_ISLNK(info.st_mode):
        raise UnsafeJournal(
            f"the journal's directory {str(directory)!r} is a symlink, which another user may "
            "have planted; use a real directory"
        )
    if info is None:
        if not create:
            raise ConfigurationError(
                f"there is no journal at {str(path)!r} (no directory {str(directory)!r}); "
                "check the path (--journal, AGENTKEY_JOURNAL)"
            )
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot create the journal's directory {str(directory)!r} "
                f"({exc.strerror or exc}); pass journal=SQLiteJournal('<a path you can "
                "write>') or set AGENTKEY_JOURNAL"
            ) from None
        info = _lstat(directory)
    if info is None or not stat.S_ISDIR(info.st_mode):
        raise ConfigurationError(f"the journal's directory {str(directory)!r} is not a directory")
    if private and _not_private(info):
        raise UnsafeJournal(
            f"the journal's directory {str(directory)!r} is not private to this user (mode "
            f"{stat.S_IMODE(info.st_mode):o}, owner {info.st_uid}): another user could read "
            "its keys or plant records" + fix
        )
    found = _lstat(path)
    if found is None:
        if not create:
            raise ConfigurationError(
                f"there is no journal at {str(path)!r}; check the path (--journal, "
                "AGENTKEY_JOURNAL). Nothing was created"
            )
        return True
    if stat.S_ISLNK(found.st_mode):
        raise UnsafeJournal(f"the journal file {str(path)!r} is a symlink; use a regular file")
    if not stat.S_ISREG(found.st_mode):
        raise ConfigurationError(f"the journal file {str(path)!r} is not a regular file")
    if private:
        for each in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
            side = _lstat(each)
            if side is not None and (stat.S_ISLNK(side.st_mode) or _not_private(side)):
                raise UnsafeJournal(
                    f"the journal file {str(each)!r} is not private to this user (mode "
                    f"{stat.S_IMODE(side.st_mode):o}, owner {side.st_uid})" + fix
                )
    return False


class SQLiteJournal(SyncJournal):
    """The journal in a SQLite file (default: ``agentkey/journal.sqlite3`` in the user's data
    directory: ``$XDG_DATA_HOME`` or ``~/.local/share``, ``~/Library/Application Support``,
    ``%LOCALAPPDATA%``).

    ``durable=True`` makes every write reach the disk before it returns (an fsync
    each), for records that must survive a power cut, not only a killed process.
    Records of ended calls untouched for ``retention`` seconds (a week) are
    deleted; a call in doubt is kept until it is settled. Answers over
    ``max_body_bytes`` are not kept (their size is). ``clock`` (a :class:`~agentkey.Clock`;
    default: the system clock) gives the record times; tests pass a ``FakeClock``.

    ``create=False`` opens an existing journal only: a missing file (a mistyped path)
    is an error naming it, and nothing is created (what ``agentkey journal`` uses).
    The default location (no ``path``) must be private to this user: a directory of
    mode 0700 and a file of mode 0600, both the user's own; anything else is refused.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        durable: bool = False,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        retention: float = DEFAULT_RETENTION,
        clock: Clock | None = None,
        create: bool = True,
    ) -> None:
        self.max_body_bytes, self.retention = check_journal_options(max_body_bytes, retention)
        self.path = Path(path) if path is not None else default_journal_path()
        self._private = self.path == default_journal_path()
        self._create = bool(create)
        self.durable = bool(durable)
        self._clock = journal_clock(clock)
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._pid = 0
        self._closer: weakref.finalize[Any, Any] | None = None
        self._pruned = 0.0
        # route -> (evidence, when it was read on the monotonic clock): read at most once a
        # minute per route, so starting a call is one statement, not two.
        self._evidence_cache: dict[str, tuple[str | None, float]] = {}
        self._connection()  # fail at construction, not at the first call

    def __repr__(self) -> str:
        return f"SQLiteJournal({str(self.path)!r})"

    def _connection(self) -> sqlite3.Connection:
        """The connection of this process (reopened in a forked child)."""
        pid = os.getpid()
        if self._conn is not None and self._pid == pid:
            return self._conn
        new = _prepare(self.path, create=self._create, private=self._private)
        conn = None
        mode = "rwc" if new else "rw"  # SQLite creates a missing file; never anyone else
        try:
            conn = sqlite3.connect(
                f"{self.path.absolute().as_uri()}?mode={mode}",
                uri=True,
                timeout=_BUSY_TIMEOUT,
                isolation_level=None,
                check_same_thread=False,
            )
            if new:
                # SQLite made the file (empty until the first write), with the umask's mode;
                # the -wal and -shm files it makes next copy this mode.
                os.chmod(self.path, 0o600)
            elif (
                not self._create
                and not conn.execute(
                    "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'agentkey_calls'"
                ).fetchone()
            ):
                raise ConfigurationError(
                    f"{str(self.path)!r} is a SQLite database but not an agentkey journal; "
                    "check the path (--journal, AGENTKEY_JOURNAL). Nothing was changed"
                )
            _wal(conn)
            conn.execute(f"PRAGMA synchronous={'FULL' if self.durable else 'NORMAL'}")
            conn.executescript(_SCHEMA)
            _add_columns(conn)
        except (sqlite3.Error, OSError, ConfigurationError) as exc:
            if conn is not None:
                conn.close()  # a file that is not a database: nothing is left open
            if isinstance(exc, ConfigurationError):
                raise
            if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
                raise JournalError(
                    f"the journal file {str(self.path)!r} stayed locked by another process for "
                    f"{_BUSY_TIMEOUT:g} s while opening it; nothing was sent: retry, and if it "
                    "stays locked, find the process that holds it (fuser, lsof)",
                    sent=False,
                ) from None
            raise ConfigurationError(
                f"the journal file {str(self.path)!r} cannot be used as a SQLite database "
                f"({exc}); move it away or pass another path"
            ) from None
        self._conn, self._pid = conn, pid
        # A journal dropped without close() still closes its connection (Python 3.13 warns
        # about a connection left to the collector); never one inherited across a fork.
        self._closer = weakref.finalize(self, _close_in, conn, pid)
        if self._create:  # a journal opened to be read (create=False) is not changed
            self._prune_now(conn)
        return conn

    def _prune_now(self, conn: sqlite3.Connection) -> int:
        now = self._clock.time()
        self._pruned = self._clock.monotonic()
        cursor = conn.execute(
            f"DELETE FROM agentkey_calls WHERE updated_at < ? AND {_ENDED_IN}",  # noqa: S608
            (now - self.retention, *_ENDED),
        )
        conn.execute(f"DELETE FROM agentkey_evidence WHERE {_EXPIRY} < ?", (now,))  # noqa: S608
        return cursor.rowcount

    def _evidence(self, conn: sqlite3.Connection, route: str) -> str | None:
        now, read = self._clock.time(), self._clock.monotonic()
        cached = self._evidence_cache.get(route)
        if cached is not None and read - cached[1] < _EVIDENCE_READ_EVERY:
            return cached[0]
        if len(self._evidence_cache) >= _EVIDENCE_CACHE:
            self._evidence_cache.clear()
        row = conn.execute(
            f"SELECT evidence FROM agentkey_evidence WHERE route = ? AND {_IN_FORCE}",  # noqa: S608
            (route, now),
        ).fetchone()
        found = None if row is None else str(row[0])
        self._evidence_cache[route] = (found, read)
        return found

    def begin(
        self, record: CallRecord, *, repeats: bool = False, known: Collection[str] | None = None
    ) -> Begun:
        with self._lock:
            conn = self._connection()
            if self._create and self._clock.monotonic() - self._pruned > _PRUNE_EVERY:
                self._prune_now(conn)
            if not repeats:
                return self._begin(conn, record)
            # The usual case first: a new key, and no identical call recorded. Otherwise
            # nothing was written, and the look-up below says what is there.
            first = _FIRST if known is None else _FIRST_OF_ALL
            look = (record.plan, record.args_hash, record.key)
            if conn.execute(first, (*row_of_record(record), *look)).rowcount == 1:
                return recorded(self._evidence(conn, record.route))
            # Look and write in one write transaction: another process sending the same
            # call at another step then finds this one, or this one finds it.
            conn.execute("BEGIN IMMEDIATE")
            try:
                query = _REPEATS if known is None else _SAME_CALLS
                rows = conn.execute(query, (record.plan, record.args_hash, record.key))
                earlier = repeats_among(record, records_of_rows(rows, repr(self)), known=known)
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
        if inserted:
            return recorded(self._evidence(conn, record.route))
        existing = one_record(conn.execute(_BY_KEY, (record.key,)).fetchone(), repr(self))
        live = existing is not None and is_live(existing, self._clock.time())
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
        values = row_of_record(record)
        ending = (*_ending_values(values), *_ending_where(values))
        with self._lock:
            conn = self._connection()
            if conn.execute(_FINISH_ENDING, ending).rowcount == 1:
                return True  # one statement, one commit: the usual case
            # Its owner no longer holds it (or the row is not its begin's): look, and write
            # what happened, in one transaction.
            params = (*values[1:], record.key, record.owner)
            conn.execute("BEGIN IMMEDIATE")
            try:
                error = None
                if conn.execute(_FINISH, params).rowcount != 1:
                    row = conn.execute(_BY_KEY, (record.key,)).fetchone()
                    written, error = missed_finish(record, one_record(row, repr(self)))
                    if written is not None:
                        conn.execute("DELETE FROM agentkey_calls WHERE key = ?", (record.key,))
                        conn.execute(_INSERT, row_of_record(written))
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
        if error is not None:
            raise error
        return True

    def get(self, key: str) -> CallRecord | None:
        with self._lock:
            row = self._connection().execute(_BY_KEY, (key,)).fetchone()
        return one_record(row, repr(self))

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
        return records_of_rows(rows, repr(self))

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
        return records_of_rows(rows, repr(self))

    def learn(self, route: str, evidence: str, *, ttl: float | None = None) -> None:
        now = self._clock.time()
        expires = now + (EVIDENCE_TTL if ttl is None else ttl)
        with self._lock:
            self._evidence_cache[route] = (evidence, self._clock.monotonic())
            self._connection().execute(_LEARN, (route, evidence, now, now, expires, now))

    def evidence(self) -> list[Evidence]:
        now = self._clock.time()
        with self._lock:
            rows = self._connection().execute(
                f"SELECT route, evidence, coalesce(first_seen, seen_at), seen_at, {_EXPIRY} "  # noqa: S608
                f"FROM agentkey_evidence WHERE {_IN_FORCE} ORDER BY seen_at DESC, route",
                (now,),
            )
            return [Evidence(r, str(m), f, s, e) for r, m, f, s, e in rows]

    def forget(self, route: str) -> bool:
        with self._lock:
            self._evidence_cache.pop(route, None)
            cursor = self._connection().execute(
                "DELETE FROM agentkey_evidence WHERE route = ?", (route,)
            )
            return cursor.rowcount > 0

    def prune(self, *, older_than: float, include_unsettled: bool = False) -> int:
        now = self._clock.time()
        cutoff = now - older_than
        with self._lock:
            conn = self._connection()
            count: int = conn.execute(
                f"DELETE FROM agentkey_calls WHERE updated_at < ? AND {_ENDED_IN}",  # noqa: S608
                (cutoff, *_ENDED),
            ).rowcount
            if not include_unsettled:
                return count
            rows = conn.execute(
                f"{_SELECT} WHERE updated_at < ? AND NOT {_ENDED_IN}", (cutoff, *_ENDED)
            ).fetchall()
            for found in records_of_rows(rows, repr(self)):
                if prunable(found, cutoff, include_unsettled=True, now=now):
                    count += conn.execute(
                        "DELETE FROM agentkey_calls WHERE key = ? AND state = ? "
                        "AND owner IS ? AND updated_at = ?",
                        (found.key, found.state.value, found.owner, found.updated_at),
                    ).rowcount
            return count

    def close(self) -> None:
        with self._lock:
            if self._closer is not None:
                self._closer()  # closes the connection in the process that opened it
            self._conn = self._closer = None
