"""The agentkey command line."""

from __future__ import annotations

import subprocess
import sys
import uuid
from typing import Any

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


def test_demo_end_to_end() -> None:
    """`agentkey demo` runs the whole contract in-process and reports it held."""
    out = subprocess.run(
        [sys.executable, "-m", "agentkey.cli", "demo"], capture_output=True, text=True, check=True
    )
    assert "contract held" in out.stdout
    assert '{"charge": 2, "provision": 1}' in out.stdout
    assert out.stdout.count("REPLAYED") == 3


def test_demo_reports_a_broken_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    """If the server stopped replaying, the demo says so and exits non-zero."""
    from agentkey import _demo

    real = _demo._LoseFirstAnswer

    class NoReplay(real):  # type: ignore[misc, valid-type]
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            # A client that sends a fresh key per attempt: every call runs anew.
            fresh = uuid.uuid4().hex.encode()
            headers = [
                (k, fresh + v[v.index(b":") :] if k.lower() == b"idempotency-key" else v)
                for k, v in scope.get("headers", [])
            ]
            await super().__call__({**scope, "headers": headers}, receive, send)

    monkeypatch.setattr(_demo, "_LoseFirstAnswer", NoReplay)
    lines: list[str] = []
    assert _demo.run_demo(lines.append) == 1
    assert "CONTRACT BROKEN" in lines[-1]
