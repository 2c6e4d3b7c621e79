"""The agentkey command line."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from typing import Any

import httpx
import pytest

from agentkey import StepKey
from agentkey.cli import main
from tests._loopback import free_port


def test_key_command(capsys: pytest.CaptureFixture[str]) -> None:
    """`agentkey key` prints the same key as StepKey.build().format()."""
    assert main(["key", "--plan", "p1", "--step", "3.1", "--args", '{"b":1,"a":2}']) == 0
    assert capsys.readouterr().out.strip() == StepKey.build("p1", (3, 1), {"a": 2, "b": 1}).format()


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
    """Bad input is a usage error (exit 2) with a one-line message, not a traceback."""
    assert main(argv) == 2
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
    lines = out.stdout.splitlines()
    first_key = next(i for i, line in enumerate(lines) if line.strip().startswith("key "))
    assert "<plan session id>:<step>:<sha256 of the canonical JSON args>" in lines[first_key + 1]
    assert out.stdout.count("<plan session id>") == 1  # explained once, on the first key
    assert "read next" in out.stdout
    assert lines[-1].strip().startswith("cli.md")


def test_demo_help_says_what_the_demo_shows(capsys: pytest.CaptureFixture[str]) -> None:
    """`agentkey demo --help` explains the four scenes and the exit status."""
    with pytest.raises(SystemExit) as info:
        main(["demo", "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "answer is lost after the server committed" in out
    assert "two workers racing the same step" in out
    assert "restarts and restores the plan" in out
    assert "changes an argument: a new key" in out


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


def test_serve_runs_the_example_tool_server_on_a_port() -> None:
    """`agentkey serve` answers on its port: a resent key is replayed and the tool ran once."""
    port = free_port()
    argv = [sys.executable, "-m", "agentkey.cli", "serve", "--port", str(port)]
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        try:
            assert proc.stdout is not None
            assert f"http://127.0.0.1:{port}" in proc.stdout.readline()
            key = StepKey.build("serve-test", 0, {"amount": 5, "currency": "EUR"}).format()
            sent = {
                "content": b'{"amount":5,"currency":"EUR"}',
                "headers": {"Idempotency-Key": key, "Authorization": "Bearer agent-7"},
            }
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
                deadline = time.monotonic() + 30
                while True:  # uvicorn binds just after the banner
                    try:
                        first = client.post("/tools/charge", **sent)  # type: ignore[arg-type]
                        break
                    except httpx.ConnectError:
                        assert time.monotonic() < deadline, "agentkey serve did not listen"
                        time.sleep(0.05)
                second = client.post("/tools/charge", **sent)  # type: ignore[arg-type]
                anonymous = client.post(
                    "/tools/charge",
                    content=b'{"amount":5,"currency":"EUR"}',
                    headers={"Idempotency-Key": key},
                )
                counts = client.get("/executions").json()
        finally:
            proc.terminate()
    assert first.status_code == second.status_code == 201
    assert second.headers["idempotent-replayed"] == "true"
    assert second.json() == first.json()
    assert anonymous.status_code == 401  # no token: no key space, nothing replayed or run
    assert "idempotent-replayed" not in anonymous.headers
    assert counts == {"charge": 1}
