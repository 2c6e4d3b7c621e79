"""The agentkey command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentkey import StepKey, step_key
from agentkey.cli import main


def test_key_command(capsys: pytest.CaptureFixture[str]) -> None:
    """`agentkey key` prints the same key as step_key()."""
    assert main(["key", "--plan", "p1", "--step", "3.1", "--args", '{"b":1,"a":2}']) == 0
    assert capsys.readouterr().out.strip() == step_key("p1", (3, 1), {"a": 2, "b": 1})


def test_key_command_sf_string(capsys: pytest.CaptureFixture[str]) -> None:
    """--style sf-string prints a quoted header value that parses back."""
    assert main(["key", "--plan", "p1", "--step", "0", "--args", "{}", "--style", "sf-string"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith('"')
    assert StepKey.parse(out).plan_session_id == "p1"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["key", "--step", "1", "--args", "[1]"], "JSON object"),
        (["key", "--step", "1", "--args", "{nope"], "not valid JSON"),
    ],
)
def test_key_command_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bad input exits non-zero with a one-line message, not a traceback."""
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_console_script_demo() -> None:
    """The installed `agentkey demo` console script runs on embedded defaults."""
    out = subprocess.run(
        [sys.executable, "-m", "agentkey.cli", "demo"], capture_output=True, text=True, check=True
    )
    assert "same key" in out.stdout
