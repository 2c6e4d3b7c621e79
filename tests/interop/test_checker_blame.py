"""`agentkey check` blames the right party, bounds each request, and prints nothing raw.

Every server here is real, on loopback: agentkey's example server, small Starlette
apps that answer as other servers do, a proxy that drops reused connections, and a
raw socket that drips its answer.
"""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentkey.cli import EXIT_OK, EXIT_UNREACHABLE, main
from agentkey.testing import check_server, example_app
from tests._loopback import raw_server, serve

ARGS = {"region": "eu-west-1", "size": "m5.large"}
TOKEN = "Tok-En-9xYz"


def _recv_message(conn: socket.socket, buffer: bytes) -> tuple[bytes, bytes] | None:
    """One HTTP/1.1 message (head and a Content-Length body) from ``buffer`` and ``conn``."""
    while b"\r\n\r\n" not in buffer:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        buffer += chunk
    head, _, rest = buffer.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        rest += chunk
    return head + b"\r\n\r\n" + rest[:length], rest[length:]


@contextlib.contextmanager
def dropping_proxy(upstream: str, *, answers: int | None = None) -> Iterator[str]:
    """A proxy that answers only the first request of each client connection; the next
    request on a kept-alive connection is read, then the connection closes unanswered.

    ``answers`` caps how many requests are answered in all (the rest: closed unanswered).
    """
    host, port = upstream.removeprefix("http://").split(":")
    answered = [0]
    lock = threading.Lock()

    class Proxy(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            conn: socket.socket = self.request
            conn.settimeout(10)
            request = _recv_message(conn, b"")
            with lock:
                allowed = answers is None or answered[0] < answers
                answered[0] += allowed
            if request is None or not allowed:
                return
            with socket.create_connection((host, int(port))) as up:
                up.sendall(request[0])
                response = _recv_message(up, b"")
            if response is not None:
                conn.sendall(response[0])
                _recv_message(conn, request[1])  # the reused connection's request: dropped

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Proxy)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1})
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _validating_app() -> Starlette:
    """A tool that wants {"amount": int} and refuses anything else with 400."""

    async def tool(request: Request) -> Response:
        body = await request.json()
        if not isinstance(body.get("amount"), int):
            return JSONResponse({"detail": "amount must be an integer"}, status_code=400)
        return JSONResponse({"ok": True})

    return Starlette(routes=[Route("/tools/charge", tool, methods=["POST"])])


def _conflict_on_other_body_app(echo: str = "") -> Starlette:
    """Honours keys, but refuses another body under a used key with a safe 409.

    ``echo`` goes into its 409's problem type (a hostile server's escape sequences, or
    the caller's token).
    """
    records: dict[str, tuple[bytes, bytes]] = {}
    runs = [0]

    async def tool(request: Request) -> Response:
        body = await request.body()
        key = request.headers.get("idempotency-key")
        if key is None:
            return JSONResponse({"error": "missing_key"}, status_code=400)
        if key in records:
            seen, answer = records[key]
            if seen != body:
                problem = {"type": f"urn:x:{echo or 'conflict'}", "detail": f"no {echo}"}
                return JSONResponse(problem, status_code=409)
            return Response(answer, headers={"idempotent-replayed": "true"})
        runs[0] += 1
        answer = b'{"run":%d}' % runs[0]
        records[key] = (body, answer)
        return Response(answer, media_type="application/json")

    app = Starlette(routes=[Route("/tools/x", tool, methods=["POST"])])
    app.state.runs = runs
    return app


@pytest.mark.parametrize(
    ("path", "args", "fix"),
    [
        ("/tools/nope", '{"region": "eu-west-1"}', "fix --path"),
        ("/tools/charge", '{"amount": "five"}', "fix --path or --args"),
    ],
)
def test_a_refused_fresh_request_is_no_verdict_and_names_the_option(
    path: str, args: str, fix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fresh 404 or 400 is "fix --path/--args", exit 3: no FAIL rows, no contract verdict."""
    with serve(_validating_app()) as url:
        code = main(["check", url, "--path", path, "--args", args, "--timeout", "10"])
    out = capsys.readouterr().out
    assert code == EXIT_UNREACHABLE, out
    assert fix in out
    assert "no verdict" in out
    assert "FAIL" not in out
    assert "does NOT honour" not in out
    assert "409 forever" not in out


def test_a_key_refused_on_the_fresh_request_suggests_another_style() -> None:
    """A server that refuses the key itself on the fresh request is told to try --style."""

    async def uuid_only(request: Request) -> Response:
        await request.body()
        detail = "'Idempotency-Key' header value must be formatted as a v4 UUID"
        return JSONResponse({"detail": detail}, status_code=422)

    app = Starlette(routes=[Route("/tools/x", uuid_only, methods=["POST"])])
    with serve(app) as url:
        report = check_server(url, path="/tools/x", args=ARGS, timeout=10)
    assert not report.ok
    assert report.no_verdict is not None
    assert "--style uuid" in report.no_verdict
    assert "v4 UUID" in report.no_verdict


def test_a_safe_409_for_another_body_is_a_deviation_not_a_failure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """409 instead of 422 for another body: a WARN row, the verdict still "honours", exit 0."""
    app = _conflict_on_other_body_app()
    with serve(app) as url:
        code = main(["check", url, "--path", "/tools/x", "--args", json.dumps(ARGS)])
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    (row,) = [line for line in out.splitlines() if "same key, other body" in line]
    assert row.lstrip().startswith("WARN"), out
    assert "deviation" in out
    assert "honours the idempotency contract" in out


def test_a_connection_dropped_on_reuse_is_retried_on_a_fresh_one() -> None:
    """A kept-alive connection the server drops on reuse costs a resend, not a FAIL row."""
    app = example_app(work_seconds=0.2, shared_key_space=False)
    with serve(app) as url, dropping_proxy(url) as proxied:
        report = check_server(proxied, path="/tools/provision", args=ARGS, timeout=10, token="demo")
    table = report.table()
    assert report.no_verdict is None, table
    assert report.ok, table
    assert "request" not in {r.name for r in report.results}
    assert app.state.executions["provision"] == 4  # fresh, burst, changed args, styles


def test_a_transport_failing_twice_mid_check_is_no_verdict(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """When the fresh connection fails too, the report says "transport problem", exit 3."""
    with (
        serve(example_app(shared_key_space=False)) as url,
        dropping_proxy(url, answers=1) as proxied,
    ):
        argv = ["check", proxied, "--path", "/tools/provision", "--args", json.dumps(ARGS)]
        code = main([*argv, "--token", "demo"])
    out = capsys.readouterr().out
    assert code == EXIT_UNREACHABLE, out
    assert "transport problem" in out
    assert "does NOT honour" not in out


def _drip(conn: socket.socket, head: bytes) -> None:
    """Answers one byte every 0.2 s, for ever (until the client leaves)."""
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
    conn.sendall(b"content-length: 999\r\n\r\n")
    with contextlib.suppress(OSError):
        for _ in range(300):
            conn.sendall(b" ")
            time.sleep(0.2)


@pytest.mark.realtime
def test_a_dripping_server_cannot_hold_the_check(capsys: pytest.CaptureFixture[str]) -> None:
    """Each request is answered whole within --timeout, however often bytes trickle in."""
    started = time.monotonic()
    with raw_server(_drip) as url:
        code = main(["check", url, "--path", "/x", "--args", "{}", "--timeout", "1"])
    elapsed = time.monotonic() - started
    out = capsys.readouterr().out
    assert code == EXIT_UNREACHABLE, out
    assert "within --timeout (1 s)" in out
    assert elapsed < 20  # one 1 s deadline, and its resend's; never the drip's minute


def test_server_text_is_printed_without_control_characters(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An escape sequence in a server's problem code reaches the table as '?'."""
    with serve(_conflict_on_other_body_app("\x1b]0;owned\x07\x1b[31mred")) as url:
        code = main(["check", url, "--path", "/tools/x", "--args", json.dumps(ARGS)])
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    assert "\x1b" not in out
    assert "\x07" not in out
    assert "?[31mred" in out


def test_a_token_echoed_by_the_server_is_redacted_before_it_is_normalised(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that echoes the token as its problem code never gets it printed, in any case."""
    monkeypatch.setenv("AGENTKEY_CHECK_TOKEN", TOKEN)
    with serve(_conflict_on_other_body_app(TOKEN)) as url:
        code = main(["check", url, "--path", "/tools/x", "--args", json.dumps(ARGS)])
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    lowered = out.lower().replace("-", "_")
    assert TOKEN.lower().replace("-", "_") not in lowered
    assert "***" in out
