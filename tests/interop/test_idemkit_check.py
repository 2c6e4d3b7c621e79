"""``agentkey check`` against idemkit 1.0.2 on Redis, in both modes: fair verdicts.

idemkit honours the IETF draft's contract in both modes (one execution per key and
route, replays marked, another body with the same key refused), so ``check`` must say
the server honours it, with or without idemkit's option to require a key.
agentkey-specific rows (a hash that does not match the body, a key agentkey cannot
parse, 422 ``key_reused``) are reported, not required: idemkit treats keys as opaque
and makes the route part of the operation, so a key on another route runs there anew.
"""

from __future__ import annotations

import re

import pytest

from agentkey.cli import main
from agentkey.testing import CheckReport, CheckResult, check_server

from ._support import MODES, Mode, Served, StartIdemkit

pytestmark = [pytest.mark.redis, pytest.mark.parametrize("mode", MODES)]

ARGS = {"region": "eu-west-1", "gb": 20}
BURST = 6


def run_check(served: Served) -> CheckReport:
    served.tool.delay = 0.1  # the concurrent burst overlaps the first request
    return check_server(
        served.url,
        path="/tools/check",
        other_path="/v2/tools/check",  # a second protected route, for the key-reuse rows
        args=ARGS,
        concurrency=BURST,
        timeout=15,
    )


def row(report: CheckReport, fragment: str) -> CheckResult:
    """The one row whose name holds ``fragment``."""
    (found,) = [r for r in report.results if fragment in r.name]
    return found


def test_check_says_idemkit_honours_the_contract(idemkit_server: StartIdemkit, mode: Mode) -> None:
    """check passes idemkit: replays under its header, the burst ran once, no false FAIL."""
    with idemkit_server(mode, require_key=True) as served:
        report = run_check(served)
    table = report.table()
    assert served.tool.most_runs_per_key() == 1
    assert served.tool.executions("/v2/tools/check") == 1  # the key ran anew on another route
    for fragment in ("fresh", "duplicate is replayed", "concurren", "other body", "never replayed"):
        assert row(report, fragment).verdict == "PASS", table
    assert re.search(r"\b1 ran\b", row(report, "concurren").detail), table  # as on the server
    contract = [r for r in report.results if r.scope == "contract"]
    assert all(r.verdict != "FAIL" for r in contract), table
    assert any(r.scope == "agentkey" for r in report.results), table  # reported, not required
    assert report.ok, table


def test_check_cli_exits_0_against_idemkit(
    idemkit_server: StartIdemkit, mode: Mode, capsys: pytest.CaptureFixture[str]
) -> None:
    """`agentkey check` on idemkit (its defaults: a key is optional) exits 0."""
    with idemkit_server(mode) as served:
        served.tool.delay = 0.1
        code = main(
            ["check", served.url, "--path", "/tools/check", "--args", '{"gb": 20}',
             "--other-path", "/v2/tools/check", "--concurrency", str(BURST), "--timeout", "15"]
        )  # fmt: skip
    out = capsys.readouterr().out
    assert served.tool.most_runs_per_key() == 1
    assert code == 0, out
    assert "does NOT honour" not in out
    assert served.tool.executions("/v2/tools/check") == 1  # its own operation there
