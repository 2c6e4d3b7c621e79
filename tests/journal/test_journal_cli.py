"""``agentkey journal``: list, doubt, show, settle and prune, never printing a whole key."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from agentkey import PlanSession, StepRepeated, ToolInvoker
from agentkey._keys import shown_key
from agentkey.cli import main
from agentkey.journal import CallRecord, CallState, SQLiteJournal
from tests._loopback import serve
from tests.journal._tools import PlainTool


def _seed(
    path: Path, route: str = "POST http://127.0.0.1:9/tools/{tool}?sig=s3cret"
) -> tuple[CallRecord, CallRecord]:
    """A journal with one call in doubt (its sender gone) and one answered, sent to ``route``."""
    journal = SQLiteJournal(path)
    plan = PlanSession.new()
    now = time.time()
    doubt = plan.step(0, "charge", {"amount": 5})
    done = plan.step(1, "refund", {"amount": 5})
    records = []
    for step, state in ((doubt, CallState.PENDING), (done, CallState.ANSWERED)):
        record = CallRecord(
            key=step.idempotency_key,
            plan=plan.id,
            step=step.label,
            tool=step.tool,
            args_hash=step.key.args_hash,
            route=route.format(tool=step.tool),
            state=state,
            created_at=now,
            updated_at=now,
            owner="gone-host:1:x:1",
            lease_until=now - 1,  # its lease ended: the sender is gone
            status_code=201 if state is CallState.ANSWERED else None,
            body=b'{"ok":true}' if state is CallState.ANSWERED else None,
        )
        journal.begin(record)
        records.append(record)
    journal.close()
    return records[0], records[1]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def test_doubt_lists_the_calls_whose_sender_is_gone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pending call whose sender died is in doubt; an answered one is not listed."""
    path = tmp_path / "j.sqlite3"
    doubt, done = _seed(path)
    code, out = run(capsys, "journal", "--journal", str(path), "doubt")
    assert code == 0
    assert shown_key(doubt.key) in out
    assert shown_key(done.key) not in out
    assert doubt.key not in out  # never the whole key
    code, out = run(capsys, "journal", "--journal", str(path), "--json", "list")
    rows = [json.loads(line) for line in out.splitlines()]
    assert {r["state"] for r in rows} == {"in_doubt", "answered"}
    assert all("s3cret" not in r["route"] for r in rows)  # a URL's query stays out


@pytest.mark.parametrize("verdict", ["--ran", "--not-run"])
def test_settle_takes_effect_on_the_next_call(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], verdict: str
) -> None:
    """--not-run lets the next call of the step go; --ran keeps it from ever running."""
    path = tmp_path / "j.sqlite3"
    plain = PlainTool()
    with serve(plain) as url:
        doubt, _ = _seed(path, f"POST {url}/tools/{{tool}}")
        shown = shown_key(doubt.key)
        code, out = run(capsys, "journal", "--journal", str(path), "settle", shown, verdict)
        assert code == 0
        assert ("answered" if verdict == "--ran" else "not_sent") in out
        code, out = run(capsys, "journal", "--journal", str(path), "--json", "show", shown)
        said = "ran" if verdict == "--ran" else "did not run"
        assert json.loads(out)["reason"] == f"settled by an operator: {said}"
        step = PlanSession(id=doubt.plan).step(0, "charge", {"amount": 5})
        inv = ToolInvoker(url, route_template="/tools/{tool}", journal=SQLiteJournal(path))
        with inv:
            if verdict == "--ran":
                with pytest.raises(StepRepeated, match="already ran"):
                    inv.invoke(step)  # no answer was kept, and it must not run again
            else:
                assert inv.invoke(step).status_code == 201  # not run, so sent now
                again = inv.invoke(step)  # the tool does not honour keys: the journal answers
                assert (again.source, again.replayed) == ("journal", True)
    assert plain.executions["charge"] == (0 if verdict == "--ran" else 1)


def test_unknown_key_and_bad_journal_are_clear(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A key not in the journal exits 1; a file that is not a journal exits 2, naming it."""
    path = tmp_path / "j.sqlite3"
    _seed(path)
    code, out = run(capsys, "journal", "--journal", str(path), "show", "plan:step_001:#00000000")
    assert code == 1
    assert "no call" in out
    bogus = tmp_path / "not-a-db"
    bogus.write_bytes(b"\x00" * 4096)
    code, out = run(capsys, "journal", "--journal", str(bogus), "list")
    assert code == 2
    assert "cannot be used as a SQLite database" in out


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["list", "--limit", "0"], "whole number from 1 to 100000"),
        (["list", "--limit", "x"], "whole number from 1 to 100000"),
        (["doubt", "--limit", "100001"], "whole number from 1 to 100000"),
        (["prune", "--older-than", "30"], "seconds >= 60"),
        (["prune", "--older-than", "soon"], "seconds >= 60"),
        (["prune", "--older-than", "inf"], "seconds >= 60"),
        (["list", "--state", "lost"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_and_say_what_is_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], error: str
) -> None:
    """A limit or age out of range, or an unknown state, is a usage error naming the range."""
    with pytest.raises(SystemExit) as exit_:
        main(["journal", "--journal", str(tmp_path / "j.sqlite3"), *argv])
    assert exit_.value.code == 2
    assert error in capsys.readouterr().err


def test_a_journal_turned_off_needs_an_explicit_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With ``$AGENTKEY_JOURNAL=off`` and no --journal, the command says to pass one."""
    monkeypatch.setenv("AGENTKEY_JOURNAL", "off")
    code, out = run(capsys, "journal", "list")
    assert code == 2
    assert "pass --journal" in out


def test_list_show_and_prune_in_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The table, one call with its kept answer, a state filter, and prune's count."""
    path = tmp_path / "j.sqlite3"
    doubt, done = _seed(path)
    code, out = run(capsys, "journal", "--journal", str(path), "list", "--state", "answered")
    assert code == 0
    assert out.splitlines()[0].split() == ["UPDATED", "STATE", "STEP", "TOOL", "STATUS", "KEY",
                                           "REASON"]  # fmt: skip
    assert shown_key(done.key) in out
    assert shown_key(doubt.key) not in out
    code, out = run(
        capsys, "journal", "--journal", str(path), "show", shown_key(done.key), "--body"
    )
    assert code == 0
    assert '{"ok":true}' in out
    assert done.key not in out
    code, out = run(capsys, "journal", "--journal", str(path), "--json", "show", done.key)
    assert json.loads(out)["key"] == shown_key(done.key)  # the whole key finds it too
    code, out = run(capsys, "journal", "--journal", str(path), "prune", "--older-than", "60")
    assert (code, out.strip()) == (0, "deleted 0 record(s)")  # both were touched just now
    code, out = run(capsys, "journal", "--journal", str(path), "--json", "prune",
                    "--older-than", "60")  # fmt: skip
    assert json.loads(out) == {"deleted": 0}


def test_nothing_in_doubt_exits_0_like_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``doubt`` with nothing to settle prints "no calls" and exits 0, as ``list`` does."""
    SQLiteJournal(tmp_path / "empty.sqlite3").close()
    code, out = run(capsys, "journal", "--journal", str(tmp_path / "empty.sqlite3"), "doubt")
    assert (code, out.strip()) == (0, "no calls")


@pytest.mark.parametrize(
    "argv",
    [["list"], ["doubt"], ["show", "plan:step_000:#00000000"], ["evidence"],
     ["settle", "plan:step_000:#00000000", "--ran"], ["prune", "--older-than", "60"]],
    ids=lambda argv: argv[0],
)  # fmt: skip
@pytest.mark.parametrize("missing", ["file", "directory"])
def test_a_mistyped_journal_path_is_an_error_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], missing: str
) -> None:
    """No command creates a journal: a path with nothing at it (or in a directory that does
    not exist) exits 2 naming the path, and no file or directory appears."""
    where = tmp_path / "jounral.sqlite3" if missing == "file" else tmp_path / "nope" / "j.sqlite3"
    code, out = run(capsys, "journal", "--journal", str(where), *argv)
    assert code == 2
    assert f"there is no journal at {str(where)!r}" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_default_journal_is_not_created_by_the_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --journal nor $AGENTKEY_JOURNAL, a missing default journal is an error naming
    it; its directory is not made."""
    monkeypatch.delenv("AGENTKEY_JOURNAL")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    code, out = run(capsys, "journal", "list")
    assert code == 2
    assert "there is no journal at" in out
    assert str(tmp_path / "data" / "agentkey") in out
    assert not (tmp_path / "data").exists()


def test_a_database_that_is_not_a_journal_is_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A SQLite file of something else is refused by name, and gets no journal tables."""
    import sqlite3

    other = tmp_path / "app.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE users (id INTEGER)")
    conn.close()
    code, out = run(capsys, "journal", "--journal", str(other), "list")
    assert code == 2
    assert "not an agentkey journal" in out
    with sqlite3.connect(other) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    conn.close()
    assert tables == {"users"}


@pytest.mark.parametrize("kind", ["redis", "postgres"])
def test_a_shared_journal_by_url(
    request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """``--journal redis://...`` and ``postgresql://...`` open the fleet's journal."""
    if kind == "redis":
        from agentkey.journal import RedisJournal

        where = request.getfixturevalue("redis_proc").url
        journal: Any = RedisJournal(where)
    else:
        from agentkey.journal import PostgresJournal

        where = request.getfixturevalue("postgres_proc").dsn
        journal = PostgresJournal(where)
    plan = PlanSession.new()
    step = plan.step(0, "charge", {"amount": 5})
    now = time.time()
    journal.begin(
        CallRecord(key=step.idempotency_key, plan=plan.id, step=step.label, tool=step.tool,
                   args_hash=step.key.args_hash, route="POST http://127.0.0.1:9/tools/charge",
                   state=CallState.PENDING, created_at=now, updated_at=now,
                   owner="gone-host:1:x:1", lease_until=now - 1)
    )  # fmt: skip
    journal.close()
    code, out = run(capsys, "journal", "--journal", where, "--json", "doubt", "--plan", plan.id)
    assert code == 0
    assert [json.loads(line)["key"] for line in out.splitlines()] == [
        shown_key(step.idempotency_key)
    ]
