"""`agentkey check`: passes against the example server, fails clearly against broken ones."""

from __future__ import annotations

import asyncio
import traceback
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentkey import (
    CheckReport,
    ConfigurationError,
    InsecureTransport,
    StepKey,
    canonical_json,
    check_server,
)
from agentkey.cli import main
from agentkey.server import RedisStore, example_app
from tests._loopback import RedisServer, serve
from tests.server._util import serve_closing

ARGS = '{"region": "eu-west-1", "size": "m5.large"}'


def _no_idempotency_app() -> Starlette:
    """Runs every request; knows nothing about keys."""
    runs = {"n": 0}

    async def tool(request: Request) -> Response:
        await request.json()
        runs["n"] += 1
        await asyncio.sleep(0.1)
        return JSONResponse({"run": runs["n"]})

    return Starlette(routes=[Route("/tools/x", tool, methods=["POST"])])


def _waiting_cache_app() -> Starlette:
    """Caches by key; duplicates wait (no 409) and replay without a header; checks nothing."""
    cache: dict[str, bytes] = {}
    locks: dict[str, asyncio.Lock] = {}

    async def tool(request: Request) -> Response:
        await request.body()
        key = request.headers.get("idempotency-key", "")
        async with locks.setdefault(key, asyncio.Lock()):
            if key not in cache:
                await asyncio.sleep(0.1)
                cache[key] = b'{"vm":"vm-1"}'
        return Response(cache[key], media_type="application/json")

    return Starlette(routes=[Route("/tools/x", tool, methods=["POST"])])


def _stuck_step_app() -> Starlette:
    """Replays correctly, except that step 1 of any plan is stuck in progress (409 forever)."""
    cache: dict[str, bytes] = {}

    async def tool(request: Request) -> Response:
        await request.body()
        key = request.headers.get("idempotency-key", "")
        if ":step_001:" in key:
            return JSONResponse(
                {"error": "in_progress"}, status_code=409, headers={"retry-after": "1"}
            )
        if key in cache:
            return Response(
                cache[key], media_type="application/json", headers={"idempotent-replayed": "true"}
            )
        cache[key] = b'{"vm":"vm-%d"}' % len(cache)
        return Response(cache[key], media_type="application/json")

    return Starlette(routes=[Route("/tools/x", tool, methods=["POST"])])


def _verdicts(report: CheckReport) -> dict[str, str]:
    return {r.name: r.verdict for r in report.results}


def test_check_passes_against_the_example_server(capsys: pytest.CaptureFixture[str]) -> None:
    """Every point passes on the example server; the CLI prints the table and exits 0."""
    app = example_app()
    with serve(app) as url:
        code = main(["check", url, "--path", "/tools/provision", "--args", ARGS, "--token", "tk-9"])
    out, err = capsys.readouterr()
    assert code == 0, out
    assert "8 passed, 0 failed, 0 skipped" in out
    assert "FAIL" not in out
    assert "REAL side effects" in err
    assert "tk-9" not in out + err
    assert app.state.executions["provision"] == 4  # as the warning says


def test_check_passes_on_redis_in_sf_string_style(redis_proc: RedisServer) -> None:
    """The checker's primary style can be sf-string; the example on Redis passes every point."""
    store = RedisStore(redis_proc.url, prefix="check")
    with serve_closing(example_app(store), store) as url:
        report = check_server(url, path="/tools/provision", args={"region": "x"}, style="sf-string")
    assert report.ok, report.table()
    assert set(_verdicts(report).values()) == {"PASS"}


@pytest.mark.parametrize(
    ("app", "failing"),
    [
        (
            _no_idempotency_app,
            {
                "duplicate is replayed",
                "concurrent duplicate gets 409",
                "mismatched hash gets 422",
                "malformed key gets 400",
                "missing key gets 400",
                "both header styles accepted",
            },
        ),
        (
            _waiting_cache_app,
            {
                "duplicate is replayed",
                "concurrent duplicate gets 409",
                "mismatched hash gets 422",
                "malformed key gets 400",
                "missing key gets 400",
                "both header styles accepted",
            },
        ),
        (
            _stuck_step_app,
            {
                "both header styles accepted",
                "concurrent duplicate gets 409",
                "mismatched hash gets 422",
                "malformed key gets 400",
                "missing key gets 400",
            },
        ),
    ],
    ids=["no idempotency", "waits and replays silently", "409 forever"],
)
def test_check_fails_with_a_clear_table_against_broken_servers(
    app: Any, failing: set[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A server without replay header or 409 fails exactly those rows and exits 1."""
    with serve(app()) as url:
        code = main(["check", url, "--path", "/tools/x", "--args", ARGS])
    out, _ = capsys.readouterr()
    assert code == 1
    failed = {line[10:].split("  ")[0] for line in out.splitlines() if line.startswith("  FAIL")}
    assert failed == failing, out
    assert "the server does NOT honour the contract" in out


def test_check_on_a_fast_tool_skips_the_concurrency_point() -> None:
    """When duplicates only ever see replays, the 409 point is SKIP (unproven), not PASS."""
    app = example_app()
    with serve(app) as url:
        report = check_server(url, path="/tools/charge", args={"amount": 5}, concurrency=2)
    verdicts = _verdicts(report)
    assert verdicts["concurrent duplicate gets 409"] in {"PASS", "SKIP"}
    assert report.ok


def test_check_refuses_a_token_over_plain_http_to_another_host() -> None:
    """A bearer token never travels over plain http except to loopback."""
    with pytest.raises(InsecureTransport):
        check_server("http://tools.example.com", path="/x", args={}, token="secret")


@pytest.mark.parametrize(
    "token", ["tok\u00e9n-s3cret", "s3cret\r\nX-Injected: 1", "s3cret with spaces", ""]
)
def test_check_refuses_a_malformed_token_without_echoing_it(token: str) -> None:
    """A token no HTTP header can carry is a ConfigurationError that never shows the token."""
    with pytest.raises(ConfigurationError) as info:
        check_server("http://127.0.0.1:1", path="/x", args={}, token=token)
    shown = "".join(traceback.format_exception(info.value)) + repr(info.value)
    assert "s3cret" not in shown
    assert info.value.__context__ is None or info.value.__suppress_context__


@pytest.mark.parametrize(
    "kwargs",
    [
        {"base_url": "ftp://x", "path": "/x", "args": {}},
        {"base_url": "http://[::1", "path": "/x", "args": {}},
        {"base_url": "http://127.0.0.1:1", "path": "/x", "args": {}, "concurrency": 1},
        {"base_url": "http://127.0.0.1:1", "path": "/x", "args": {}, "concurrency": 2.5},
        {"base_url": "http://127.0.0.1:1", "path": "/x", "args": {}, "timeout": 0},
        {"base_url": "http://127.0.0.1:1", "path": "/x", "args": {}, "timeout": float("nan")},
        {
            "base_url": "http://127.0.0.1:1",
            "path": "/x",
            "args": {"a": 1},
            "changed_args": {"a": 1},
        },
    ],
)
def test_check_rejects_bad_options(kwargs: dict[str, Any]) -> None:
    """Bad targets and options are a ConfigurationError before any request."""
    with pytest.raises(ConfigurationError):
        check_server(**kwargs)


def test_check_reports_an_unreachable_target(capsys: pytest.CaptureFixture[str]) -> None:
    """A target that refuses connections gives a FAIL row and exit 1, not a traceback."""
    from tests._loopback import free_port

    code = main(["check", f"http://127.0.0.1:{free_port()}", "--path", "/x", "--args", "{}"])
    assert code == 1
    assert "ConnectError" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["[1]", "{nope"])
def test_check_cli_rejects_bad_args_json(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--args must be a JSON object; otherwise exit 2 with a message."""
    assert main(["check", "http://127.0.0.1:1", "--path", "/x", "--args", bad]) == 2
    assert "--args" in capsys.readouterr().err


def test_check_help_warns_about_side_effects(capsys: pytest.CaptureFixture[str]) -> None:
    """`agentkey check --help` says loudly that it performs real side effects."""
    with pytest.raises(SystemExit) as info:
        main(["check", "--help"])
    assert info.value.code == 0
    assert "REAL side effects" in capsys.readouterr().out


@pytest.mark.parametrize("rows", ["many", -1, 10**7, True])
def test_example_report_refuses_bad_row_counts(rows: object) -> None:
    """The example report tool answers 400 to a row count it should not build, and runs nothing."""
    app = example_app()
    args = {"rows": rows}
    key = StepKey.build("plan-report", 0, args).format()
    with serve(app) as url:
        response = httpx.post(
            url + "/tools/report",
            headers={"idempotency-key": key, "content-type": "application/json"},
            content=canonical_json(args),
            timeout=30,
        )
    assert response.status_code == 400
    assert "rows" in response.json()["error"]
    assert app.state.executions["report"] == 0
