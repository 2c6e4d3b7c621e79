"""The command line tried as a new user would: every mistake fails fast, says which flag,
and exits with the documented code, before anything is printed or started (issue 26 §4)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import httpx
import pytest

from agentkey import StepKey
from agentkey.cli import EXIT_UNREACHABLE, EXIT_USAGE, main
from tests._loopback import RedisServer, free_port

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["serve", "--port", "70000"], "--port"),
        (["serve", "--port", "-1"], "--port"),
        (["serve", "--work-seconds", "-1"], "--work-seconds"),
        (["serve", "--work-seconds", "nan"], "--work-seconds"),
        (["serve", "--redis", "notaurl"], "--redis"),
        (["key", "--step", "-1", "--args", "{}"], "--step"),
        (["key", "--step", "1.-2", "--args", "{}"], "--step"),
        (["key", "--plan", "", "--step", "1", "--args", "{}"], "--plan"),
        (["key", "--plan", "  ", "--step", "1", "--args", "{}"], "--plan"),
        (["key", "--step", "1", "--args", '{"a": 1, "a": 2}'], "--args"),
        (["check", "http://127.0.0.1:9", "--path", "/x", "--args", '{"a": 1, "a": 2}'], "--args"),
        (["check", "not-a-url", "--path", "/x", "--args", "{}"], "http://not-a-url"),
        (["check", "http://127.0.0.1:9", "--path", "/x", "--args", '{"a": NaN}'], "--args"),
        (
            ["check", "http://tools.example.com", "--path", "/x", "--args", "{}", "--token", "t"],
            "--token",
        ),
        (
            ["check", "http://127.0.0.1:9", "--path", "/x", "--args", "{}", "--token", "a b"],
            "--token",
        ),
        (["server", "doubt"], "--store"),
        (["--json", "key", "--step", "1", "--args", "{}"], "--json"),
    ],
)
def test_usage_errors_exit_2_and_name_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad option exits 2 naming it: no traceback, no tuple, no banner, no warning."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    assert code == EXIT_USAGE, err
    assert flag in err
    assert out == ""
    assert "Traceback" not in err
    assert "REAL side effects" not in err
    assert "(-1,)" not in err


def test_a_port_in_use_fails_before_the_banner(capsys: pytest.CaptureFixture[str]) -> None:
    """`serve` on a port in use exits 2 naming the port, and never prints "serving"."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code = main(["serve", "--port", str(port)])
    out, err = capsys.readouterr()
    assert code == EXIT_USAGE
    assert f"127.0.0.1:{port}" in err
    assert "--port" in err
    assert out == ""


def test_a_dead_redis_fails_before_the_banner(capsys: pytest.CaptureFixture[str]) -> None:
    """`serve --redis` to a port nobody listens on exits 3 at once; it never starts."""
    started = time.monotonic()
    code = main(["serve", "--redis", f"redis://127.0.0.1:{free_port()}/0", "--port", "0"])
    out, err = capsys.readouterr()
    assert code == EXIT_UNREACHABLE
    assert "--redis" in err
    assert out == ""
    assert time.monotonic() - started < 30


@pytest.mark.redis
def test_serve_on_a_live_redis_listens_on_the_port_it_prints(redis_proc: RedisServer) -> None:
    """`serve --redis URL --port 0` checks Redis, binds, prints the real port and serves."""
    argv = [sys.executable, "-m", "agentkey.cli", "serve", "--redis", redis_proc.url, "--port", "0"]
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        try:
            assert proc.stdout is not None
            banner = proc.stdout.readline()
            found = re.search(r"http://127\.0\.0\.1:(\d+)", banner)
            assert found, banner
            key = StepKey.build("serve-redis", 0, {"amount": 5, "currency": "EUR"}).format()
            sent = {
                "content": b'{"amount":5,"currency":"EUR"}',
                "headers": {"Idempotency-Key": key, "Authorization": "Bearer demo"},
            }
            with httpx.Client(base_url=found.group(0), timeout=10) as client:
                deadline = time.monotonic() + 30
                while True:  # uvicorn binds the port just after the banner
                    try:
                        first = client.post("/tools/charge", **sent)  # type: ignore[arg-type]
                        break
                    except httpx.ConnectError:
                        assert time.monotonic() < deadline, "agentkey serve did not listen"
                        time.sleep(0.05)
                second = client.post("/tools/charge", **sent)  # type: ignore[arg-type]
        finally:
            proc.terminate()
    assert first.status_code == second.status_code == 201
    assert second.headers["idempotent-replayed"] == "true"


def test_demo_without_the_server_extra_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """`demo` without [server] exits 2, as `serve` does: 1 would mean "the contract broke"."""
    monkeypatch.setitem(sys.modules, "agentkey.server", None)
    lines: list[str] = []
    from agentkey import _demo

    assert _demo.run_demo(lines.append) == EXIT_USAGE
    assert "agentkey-idempotency[server]" in lines[-1]
