"""One SQLite journal file, many users at once: journal objects, threads, processes and the
``agentkey journal`` command beside them. Nothing written is ever lost, even when the agents
are killed. Real processes, real SIGKILLs."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agentkey.journal import SQLiteJournal
from agentkey.journal._sqlite import _SCHEMA as _OLD_SCHEMA

ROOT = Path(__file__).resolve().parents[2]
AGENT = Path(__file__).with_name("_sqlite_agent.py")
CLI = [sys.executable, "-c", "import sys; from agentkey.cli import main; sys.exit(main())"]

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX locks and SIGKILL")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _agent(path: Path, name: str, objects: int, threads: int, count: int) -> subprocess.Popen[str]:
    agent = subprocess.Popen(
        [sys.executable, str(AGENT), str(path), name, str(objects), str(threads), str(count)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(),
    )  # fmt: skip
    assert agent.stdout is not None
    assert agent.stdout.readline().strip() == "ready"
    return agent


def _cli(path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "journal", "--journal", str(path), *argv],
        capture_output=True, text=True, env=_env(), timeout=60,
    )  # fmt: skip


def _go_and_kill(agent: subprocess.Popen[str]) -> None:
    assert agent.stdin is not None
    assert agent.stdout is not None
    agent.stdin.write("go\n")
    agent.stdin.flush()
    assert agent.stdout.readline().strip() == "written"
    agent.send_signal(signal.SIGKILL)
    agent.wait(30)
    agent.stdin.close()
    agent.stdout.close()


def _plans(path: Path) -> dict[str, int]:
    """How many records of each plan a fresh process finds in the file."""
    out = subprocess.run(
        [sys.executable, "-c", "import sys, collections\n"
         "from agentkey.journal import SQLiteJournal\n"
         "j = SQLiteJournal(sys.argv[1])\n"
         "print(dict(collections.Counter(r.plan for r in j.calls(limit=100000))))",
         str(path)],
        capture_output=True, text=True, env=_env(), check=True, timeout=60,
    )  # fmt: skip
    found: dict[str, int] = eval(out.stdout)  # noqa: S307 - our own child's dict literal
    return found


def test_two_journal_objects_and_the_command_beside_them_lose_nothing(tmp_path: Path) -> None:
    """The issue's case: an agent opens a second SQLiteJournal on its file, `agentkey journal
    list` runs and exits, the agent records more calls and is killed. Every record is there
    (on the old code the command deleted the WAL under the agent: 1 record of 5 was left)."""
    path = tmp_path / "journal.sqlite3"
    agent = _agent(path, "agent", objects=2, threads=1, count=2)
    listed = _cli(path, "list")
    assert listed.returncode == 0, listed.stderr
    _go_and_kill(agent)
    assert _plans(path) == {"agent": 5}
    assert _cli(path, "list").returncode == 0


def test_processes_threads_objects_and_the_command_at_once_lose_nothing(tmp_path: Path) -> None:
    """Two agent processes, each with three journal objects of two threads (and objects that
    come and go), record 120 calls while the command lists and prunes beside them; both are
    killed. A fresh process finds every record."""
    path = tmp_path / "journal.sqlite3"
    SQLiteJournal(path).close()
    agents = [_agent(path, f"agent{i}", objects=3, threads=2, count=10) for i in range(2)]
    assert _cli(path, "list").returncode == 0  # between the agents' first and next writes
    commands = [
        subprocess.Popen([*CLI, "journal", "--journal", str(path), *argv],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())
        for argv in (["list"], ["doubt"], ["prune", "--older-than", "60"], ["--json", "list"])
    ]  # fmt: skip
    for agent in agents:
        _go_and_kill(agent)
    for command in commands:
        _, err = command.communicate(timeout=60)
        assert command.returncode in (0, 1), err
    assert _cli(path, "list").returncode == 0
    assert _plans(path) == {"agent0": 61, "agent1": 61}


def _opened_while_held(path: Path, hold: str, copies: int) -> list[str]:
    """``copies`` threads opening the journal file ``path`` (a journal object, one connection
    each) while another connection holds it with ``hold`` for half a second; the errors."""
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute(hold)
    holder.execute("SELECT count(*) FROM sqlite_master").fetchone()
    errors: list[str] = []

    def open_it() -> None:
        try:
            SQLiteJournal(path).close()
        except Exception as exc:  # the test counts every failure
            errors.append(f"{type(exc).__name__}: {exc}")

    workers = [threading.Thread(target=open_it) for _ in range(copies)]
    for worker in workers:
        worker.start()
    time.sleep(0.5)  # the workers reach the held lock (if not, they meet no lock: no failure)
    holder.execute("COMMIT")
    holder.close()
    for worker in workers:
        worker.join(30)
    return errors


def test_workers_opening_one_file_another_holds_all_open_it(tmp_path: Path) -> None:
    """Workers starting together on a journal file an older agentkey wrote (while a write is
    under way), or on a new file another connection writes to, all open it, and the file
    gets its new columns once. Before, they failed with ConfigurationError: "duplicate
    column name" (two workers adding one column) or "database is locked" (SQLite refuses a
    switch to WAL at once, without waiting, while another connection writes)."""
    old = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(old, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.executescript(_OLD_SCHEMA)  # no first_seen or expires_at column
    conn.close()
    errors = _opened_while_held(old, "BEGIN IMMEDIATE", 3)
    conn = sqlite3.connect(old)
    columns = [row[1] for row in conn.execute("PRAGMA table_info(agentkey_evidence)")]
    conn.close()
    assert columns == ["route", "evidence", "seen_at", "first_seen", "expires_at"]
    new = tmp_path / "new.sqlite3"
    sqlite3.connect(new).close()  # an empty database file, as SQLite leaves a new one
    errors += _opened_while_held(new, "BEGIN IMMEDIATE", 2)
    assert errors == []
