"""The SQLite journal's finish: one page of the log for the usual finish, the old row otherwise."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

from agentkey.journal import CallRecord, CallState, SQLiteJournal
from agentkey.journal._base import current_owner
from agentkey.testing import FakeClock

NOW = 1_800_000_000.0
OWNER = current_owner()


def _pending(n: int) -> CallRecord:
    return CallRecord(
        key=f"plan-f:step_{n:03d}:{n:064x}", plan="plan-f", step=f"step_{n:03d}", tool="charge",
        args_hash=f"{n:064x}", route="POST https://tools.test/charge", created_at=NOW + n,
        updated_at=NOW + n, owner=OWNER, lease_until=NOW + 600,
    )  # fmt: skip


def _answered(record: CallRecord) -> CallRecord:
    return record.with_(
        state=CallState.ANSWERED, updated_at=NOW + 50, attempts=1, status_code=201,
        outcome="executed", source="tool", honoured=True, body=b'{"ok":true}', body_size=11,
    )  # fmt: skip


def _rows(path: Path) -> list[tuple[object, ...]]:
    with closing(sqlite3.connect(path)) as conn:
        return conn.execute("SELECT * FROM agentkey_calls ORDER BY key").fetchall()


def test_a_usual_finish_appends_one_page_to_the_log(tmp_path: Path) -> None:
    """A finish leaves the repeat index alone: one page written to the WAL, not two (main: 2)."""
    journal = SQLiteJournal(tmp_path / "j.sqlite3", clock=FakeClock(wall=NOW))
    for n in range(200):  # a table and an index of several pages each
        journal.begin(_pending(n), repeats=True)
    wal = tmp_path / "j.sqlite3-wal"
    with closing(sqlite3.connect(tmp_path / "j.sqlite3")) as conn:
        page = conn.execute("PRAGMA page_size").fetchone()[0]
    for n in (1, 100, 199):
        before = wal.stat().st_size
        assert journal.finish(_answered(_pending(n)))
        assert (wal.stat().st_size - before) / (page + 24) == 1  # a frame: a header and a page
        assert journal.get(_pending(n).key) == _answered(_pending(n))
    journal.close()


def test_a_finish_writes_the_row_main_writes(tmp_path: Path) -> None:
    """The same begins and finishes leave the same rows as main's statement, byte for byte,
    also for a finish whose record's identity differs from its row's (a caller's own)."""
    from agentkey.journal._sqlite import _FINISH, row_of_record

    ours = SQLiteJournal(tmp_path / "ours.sqlite3", clock=FakeClock(wall=NOW))
    theirs = SQLiteJournal(tmp_path / "theirs.sqlite3", clock=FakeClock(wall=NOW))
    done = [
        _answered(_pending(0)),
        _answered(_pending(1)).with_(created_at=NOW - 5, args_hash=None, plan="plan-g"),
        _pending(2).with_(state=CallState.IN_DOUBT, error="ReadError", reason="no answer"),
    ]
    for journal in (ours, theirs):
        for n in range(3):
            journal.begin(_pending(n), repeats=True)
    for record in done:
        assert ours.finish(record)
    # main's one statement (closed: sqlite3's own context manager only commits)
    with closing(sqlite3.connect(tmp_path / "theirs.sqlite3")) as conn, conn:
        for record in done:
            values = (*row_of_record(record)[1:], record.key, record.owner)
            assert conn.execute(_FINISH, values).rowcount == 1
    ours.close()
    theirs.close()
    assert _rows(tmp_path / "ours.sqlite3") == _rows(tmp_path / "theirs.sqlite3")
    assert [ours_row[1] for ours_row in _rows(tmp_path / "ours.sqlite3")] == [
        "plan-f",
        "plan-g",
        "plan-f",
    ]
