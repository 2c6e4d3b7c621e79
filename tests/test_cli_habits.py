"""The command line follows argparse habits (issue 37 §7): options before or after their
subcommand, one exit-code scheme, dates not epochs, errors that name the flag, and
``check`` with ``--json`` and rows printed as they are decided."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from agentkey import PlanSession
from agentkey._keys import shown_key
from agentkey.cli import EXIT_OK, main
from agentkey.journal import CallRecord, CallState, SQLiteJournal
from agentkey.testing import CheckResult, FakeClock, check_server, example_app
from tests._loopback import RedisServer, free_port, serve

ARGS = {"region": "eu-west-1", "size": "m5.large"}
#: 2026-12-06T07:31:02Z, as Unix seconds.
WHEN = 1796542262.25


def _journal(path: Path) -> CallRecord:
    """A journal holding one answered call, last touched at :data:`WHEN`."""
    step = PlanSession.new().step(0, "charge", {"amount": 5})
    record = CallRecord(
        key=step.idempotency_key,
        plan=step.plan_session_id,
        step=step.label,
        tool=step.tool,
        args_hash=step.key.args_hash,
        route="POST http://127.0.0.1:9/tools/charge",
        state=CallState.ANSWERED,
        created_at=WHEN,
        updated_at=WHEN,
        owner="gone-host:1:x:1",
        lease_until=WHEN - 1,
        status_code=201,
        body=b'{"ok":true}',
    )
    journal = SQLiteJournal(path, clock=FakeClock(wall=WHEN))
    journal.begin(record)
    journal.close()
    return record


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's own usage errors
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "argv",
    [
        ["journal", "--journal", "{j}", "--json", "list"],
        ["journal", "--journal", "{j}", "list", "--json"],
        ["journal", "list", "--journal", "{j}", "--json"],
        ["journal", "--json", "show", "{k}", "--journal", "{j}"],
        ["journal", "show", "{k}", "--json", "--journal", "{j}"],
        ["--json", "journal", "list", "--journal", "{j}"],
    ],
    ids=["before", "json-after", "both-after", "mixed", "show-after", "top-level"],
)
def test_journal_options_go_before_or_after_the_subcommand(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--journal and --json work on either side of the subcommand (`journal list --json`
    was "unrecognized arguments" before)."""
    path = tmp_path / "j.sqlite3"
    record = _journal(path)
    filled = [a.format(j=path, k=shown_key(record.key)) for a in argv]
    code, out, err = _run(capsys, *filled)
    assert code == EXIT_OK, err
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert row["key"] == shown_key(record.key)
    assert row["updated"] == WHEN  # --json keeps Unix seconds


def test_show_and_list_print_iso_8601_utc_not_epochs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`show` prints its times as 2026-12-06T07:31:02Z (it printed 1796542262.25)."""
    path = tmp_path / "j.sqlite3"
    record = _journal(path)
    code, out, err = _run(capsys, "journal", "--journal", str(path), "show", record.key)
    assert code == EXIT_OK, err
    fields = dict(line.strip().split("  ", 1) for line in out.splitlines())
    assert fields["updated"].strip() == "2026-12-06T07:31:02Z"
    assert fields["created"].strip() == "2026-12-06T07:31:02Z"
    assert str(int(WHEN)) not in out
    code, out, err = _run(capsys, "journal", "list", "--journal", str(path))
    assert out.splitlines()[1].startswith("2026-12-06T07:31:02Z"), out


def test_an_unreachable_journal_names_the_flag_not_python(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A --journal Redis nobody answers: exit 3 and a line that names --journal (it was a
    traceback; PostgreSQL's said "pass another journal", Python advice)."""
    where = f"redis://:s3cret@127.0.0.1:{free_port()}/0"
    code, out, err = _run(capsys, "journal", "--journal", where, "list")
    assert code == 3, err
    assert "--journal redis://" in err
    assert "Traceback" not in err
    assert "journal=" not in err
    assert "pass another journal" not in err
    assert "s3cret" not in err
    assert out == ""


@pytest.mark.redis
def test_server_store_options_go_before_or_after_the_subcommand(
    redis_proc: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """`agentkey server --store URL doubt --json` works, and an empty list exits 0."""
    for argv in (
        ["server", "--store", redis_proc.url, "doubt", "--json", "--prefix", "habits"],
        ["server", "doubt", "--json", "--store", redis_proc.url, "--prefix", "habits"],
        ["--json", "server", "doubt", "--store", redis_proc.url, "--prefix", "habits"],
    ):
        code, out, err = _run(capsys, *argv)
        assert (code, out) == (EXIT_OK, ""), err
    code, out, err = _run(capsys, "server", "doubt")
    assert code == 2
    assert "--store" in err


def test_serve_help_states_the_row_cap_the_server_enforces(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`serve --help` gives the report tool's real cap (it said 100,000; the server refuses
    over 20,000)."""
    from agentkey.server._example import _MAX_ROWS

    code, out, _ = _run(capsys, "serve", "--help")
    assert code == 0
    text = " ".join(out.split())
    assert f'{{"rows": 0..{_MAX_ROWS}}}' in text
    assert "100000" not in text


def test_check_json_is_one_object_with_rows_and_their_evidence(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`check --json` prints the documented schema: outcome, counts, and each row's name,
    verdict, scope, detail and evidence (keys as digests); the exit code is as without."""
    app = example_app(work_seconds=0.2, shared_key_space=False)
    with serve(app) as url:
        code, out, err = _run(
            capsys, "check", url, "--path", "/tools/provision", "--args", json.dumps(ARGS),
            "--token", "tk-9", "--json",
        )  # fmt: skip
    assert code == EXIT_OK, out + err
    report = json.loads(out)
    assert report["schema"] == 1
    assert (report["outcome"], report["ok"], report["style"]) == ("honours", True, "raw")
    counts = report["counts"]
    assert (counts["FAIL"], counts["WARN"], counts["PASS"] + counts["SKIP"]) == (0, 0, 13)
    assert counts["SKIP"] <= 1  # the 409 row, when a loaded machine let the first run finish
    rows = report["results"]
    assert [sorted(r) for r in rows] == [["detail", "evidence", "name", "scope", "verdict"]] * 13
    fresh = rows[0]
    assert fresh["name"] == "fresh request runs"
    assert fresh["evidence"][0].startswith("POST /tools/provision key agentkey-check-")
    assert "#" in fresh["evidence"][0]  # a digest, never the whole key
    burst = next(r for r in rows if r["name"] == "concurrent duplicates run once")
    assert len(burst["evidence"]) == 8
    assert "tk-9" not in out


def test_check_rows_are_reported_as_they_are_decided(capsys: pytest.CaptureFixture[str]) -> None:
    """The first rows arrive while the check still runs (one execution so far on the
    server), and on a terminal the CLI prints each row to stderr as it comes."""
    app = example_app(work_seconds=0.2, shared_key_space=False)
    seen: list[tuple[str, int]] = []

    def progress(row: CheckResult) -> None:
        seen.append((row.name, app.state.executions["provision"]))

    with serve(app) as url:
        report = check_server(url, path="/tools/provision", args=ARGS, token="t", progress=progress)
        assert seen[0] == ("fresh request runs", 1)  # before the burst was sent
        assert [name for name, _ in seen] == [r.name for r in report.results]

        class Terminal(io.StringIO):
            def isatty(self) -> bool:
                return True

        terminal = Terminal()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("sys.stderr", terminal)
            code = main(["check", url, "--path", "/tools/provision", "--args", json.dumps(ARGS),
                         "--token", "t"])  # fmt: skip
    assert code == EXIT_OK
    lines = [line for line in terminal.getvalue().splitlines() if line.startswith("  ")]
    assert len(lines) == 13
    assert all(line.split()[0] in ("PASS", "SKIP") for line in lines), lines
    assert lines[0].split() == ["PASS", "contract", "fresh", "request", "runs"]
    capsys.readouterr()


def _help(*path: str) -> str:
    """What ``agentkey <path> --help`` prints."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.stdout", out)
        with pytest.raises(SystemExit):
            main([*path, "--help"])
    return out.getvalue()


def _subcommands(*path: str) -> dict[str, set[str]]:
    """Each subcommand under ``path`` (``journal list``) and its long options, recursively,
    as ``--help`` lists them."""
    choices = re.search(r"^positional arguments:\n  \{([\w,-]+)\}", _help(*path), re.MULTILINE)
    if choices is None:
        return {}
    found: dict[str, set[str]] = {}
    for name in choices.group(1).split(","):
        sub = (*path, name)
        options = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", _help(*sub))) - {"--help"}
        found[" ".join(sub)] = options
        found.update(_subcommands(*sub))
    return found


def test_cli_md_documents_every_subcommand_and_option() -> None:
    """docs/cli.md has a section per subcommand and names every option of each (it left out
    options such as journal list --state and --limit, and check's new --json)."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text("utf-8")
    commands = _subcommands()
    top = {path for path in commands if " " not in path}
    assert top == {"key", "demo", "serve", "check", "journal", "server"}
    for path in top:
        assert f"## `agentkey {path}" in text, path
    missing = {
        f"{path} {option}"
        for path, options in commands.items()
        for option in options
        if f"`{option}" not in text and f"{option} " not in text
    }
    assert not missing, sorted(missing)
    for path in commands:
        if " " in path:
            assert f"agentkey {path}" in text or f"`{path.split()[-1]}" in text, path


@pytest.mark.parametrize("where", ["redis://127.0.0.1:notaport/0", "{tmp}"])
def test_an_unusable_journal_value_is_a_usage_error_naming_the_flag(
    where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --journal that is no Redis URL (a ValueError traceback before) or no file (a
    directory) exits 2 with a line that names --journal."""
    code, out, err = _run(capsys, "journal", "--journal", where.format(tmp=tmp_path), "list")
    assert code == 2, err
    assert "--journal" in err
    assert "Traceback" not in err
    assert out == ""
