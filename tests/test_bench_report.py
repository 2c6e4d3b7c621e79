"""docs/performance.md is generated from bench/results/ by bench/report.py, stale figures marked.

Nobody edits a figure by hand: every table region of the page must be exactly what
``python bench/report.py --write`` makes of the committed results, and a figure measured
before the last change of the code it describes says so.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "bench" / "report.py"
DOC = ROOT / "docs" / "performance.md"


def _report() -> ModuleType:
    if not REPORT.exists():
        pytest.skip("bench/ is not part of this tree (an sdist): nothing to compare with")
    spec = importlib.util.spec_from_file_location("agentkey_bench_report", REPORT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=bench", "-c", "user.email=bench@example.invalid", *args],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def _full_history() -> None:
    try:
        shallow = _git(ROOT, "rev-parse", "--is-shallow-repository")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: a figure's age cannot be told")
    if shallow == "true":
        pytest.skip("a shallow clone: the commits after a run may be missing")


def test_performance_md_is_what_report_py_writes() -> None:
    """Each generated region of performance.md is what `report.py --write` makes of the results."""
    report = _report()
    _full_history()
    text = DOC.read_text("utf-8")
    names = report.regions(text)
    assert {"postgres", "server", "invoker", "inflight"} <= set(names), names
    new = report.rewrite(text)
    for name in names:  # each heading names the run's date, commit and load
        heading = report.table(name).split("\n", 1)[0]
        assert " UTC, commit `" in heading, heading
        assert "load average" in heading, heading
    assert new == text, (
        "docs/performance.md differs from its results: run `python bench/report.py --write` "
        "(after a change to the code a bench measures, it marks that bench's figures stale)"
    )


def _results(root: Path, commit: str | None) -> None:
    data: dict[str, Any] = {
        "bench": "bench/bench_postgres.py",
        "date": "2026-12-06T14:00:00+00:00",
        "machine": {"cpu": "CPU", "cores": 2, "python": "3.11.7", "packages": {}},
        "rows": [],
    }
    data["machine"]["loadavg_at_start"] = [1.0, 1.0, 1.0]
    data["machine"]["loadavg_at_end"] = [2.0, 2.0, 2.0]
    if commit is not None:
        data["commit"] = commit
    path = root / "bench" / "results" / "postgres.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), "utf-8")


def test_a_figure_older_than_its_code_is_marked_stale(tmp_path: Path) -> None:
    """Stale once a later commit touches the code the run measured, or if its commit is unknown."""
    report = _report()
    code = tmp_path / "agentkey" / "server" / "store.py"
    code.parent.mkdir(parents=True)
    code.write_text("A = 1\n")
    (tmp_path / "notes.md").write_text("notes\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "code")
    measured = _git(tmp_path, "rev-parse", "--short", "HEAD")

    _results(tmp_path, measured)
    assert "stale" not in report.table("postgres", tmp_path)
    assert f"commit `{measured}`" in report.table("postgres", tmp_path)

    (tmp_path / "notes.md").write_text("other notes\n")  # not code the bench measures
    _git(tmp_path, "commit", "-qam", "notes")
    assert "stale" not in report.table("postgres", tmp_path)

    code.write_text("A = 2\n")
    _git(tmp_path, "commit", "-qam", "code changed")
    changed = _git(tmp_path, "rev-parse", "--short", "HEAD")
    expected = f"(stale: measured at {measured}, code changed since)"
    assert expected in report.table("postgres", tmp_path)
    assert expected in report.table("header postgres", tmp_path)

    _results(tmp_path, None)  # a file written before benches recorded their commit
    assert "(stale: measured at unknown, code changed since)" in report.table("postgres", tmp_path)

    _results(tmp_path, changed + "+dirty")  # run on this commit, with uncommitted edits
    assert "stale" not in report.table("postgres", tmp_path)
