"""`agentkey check`: passes against the example server, fails clearly against broken ones."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import traceback
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentkey import ConfigurationError, InsecureTransport, StepKey, canonical_json
from agentkey.cli import main
from agentkey.server import RedisStore
from agentkey.testing import CheckReport, check_server, example_app
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


def _stuck_step_app(retry_after: str = "1") -> Starlette:
    """Replays correctly, except that step 1 of any plan is stuck in progress (409 forever)."""
    cache: dict[str, bytes] = {}

    async def tool(request: Request) -> Response:
        await request.body()
        key = request.headers.get("idempotency-key", "")
        if ":step_001:" in key:
            return JSONResponse(
                {"error": "in_progress"}, status_code=409, headers={"retry-after": retry_after}
            )
        if key in cache:
            return Response(
                cache[key], media_type="application/json", headers={"idempotent-replayed": "true"}
            )
        cache[key] = b'{"vm":"vm-%d"}' % len(cache)
        return Response(cache[key], media_type="application/json")

    return Starlette(routes=[Route("/tools/x", tool, methods=["POST"])])


def _opaque_key_app(
    *, by_route: bool = True, deterministic: bool = False, every_path: bool = False
) -> Starlette:
    """An IETF-draft server with opaque keys: fingerprints the body, knows no agentkey format.

    Runs a request whose key it has not seen (any string), answers 409 + Retry-After while
    it runs, replays with ``Idempotent-Replayed``, refuses another body under a used key
    with 422, and a missing key with 400. ``by_route=False`` forgets the route in its
    records (and serves every path), so a key is replayed on another route.
    ``deterministic=True`` answers every run with the same bytes; ``every_path=True`` serves
    the tool on every path.
    """
    records: dict[tuple[str, str], tuple[bytes, bytes | None]] = {}
    runs = {"n": 0}

    async def tool(request: Request) -> Response:
        body = await request.body()
        key = request.headers.get("idempotency-key")
        if key is None:
            return JSONResponse({"error": "missing_key"}, status_code=400)
        slot = (request.url.path if by_route else "", key)
        if slot in records:
            seen, answer = records[slot]
            if seen != body:
                return JSONResponse({"type": "urn:x:payload-mismatch"}, status_code=422)
            if answer is None:
                return JSONResponse({}, status_code=409, headers={"retry-after": "1"})
            return Response(answer, headers={"idempotent-replayed": "true"})
        records[slot] = (body, None)
        await asyncio.sleep(0.1)
        runs["n"] += 1
        answer = b'{"ok":true}' if deterministic else b'{"run":%d}' % runs["n"]
        records[slot] = (body, answer)
        return Response(answer, media_type="application/json")

    path = "/tools/x" if by_route and not every_path else "/{path:path}"
    return Starlette(routes=[Route(path, tool, methods=["POST"])])


def _verdicts(report: CheckReport) -> dict[str, str]:
    return {r.name: r.verdict for r in report.results}


def _failed_rows(out: str) -> set[str]:
    """Names of the FAIL rows in a printed table (columns: result, scope, check, detail)."""
    return {line[20:].split("  ")[0] for line in out.splitlines() if line.startswith("  FAIL")}


def test_check_passes_against_the_example_server(capsys: pytest.CaptureFixture[str]) -> None:
    """Every point passes on the example server; the CLI prints the table and exits 0."""
    # A tool that works 1 s, not the default 0.2 s: on a loaded machine the burst's duplicates
    # arrived after a 0.2 s run had finished, and the in-flight row was SKIP (seen once in CI-like
    # runs under -n 2), which this test, asserting 0 skipped, read as a failure.
    app = example_app(shared_key_space=False, work_seconds=1.0)
    with serve(app) as url:
        code = main(["check", url, "--path", "/tools/provision", "--args", ARGS, "--token", "tk-9"])
    out, err = capsys.readouterr()
    assert code == 0, out
    assert "13 passed, 0 failed, 0 skipped" in out
    assert "FAIL" not in out
    assert "honours the idempotency contract, agentkey's rows included" in out
    assert "REAL side effects" in err
    assert "tk-9" not in out + err
    assert app.state.executions["provision"] == 4  # as the warning says


def test_check_passes_on_redis_in_sf_string_style(redis_proc: RedisServer) -> None:
    """The checker's primary style can be sf-string; the example on Redis passes every point."""
    store = RedisStore(redis_proc.url, prefix="check")
    app = example_app(store, shared_key_space=False, work_seconds=1.0)  # see the test above
    with serve_closing(app, store) as url:
        report = check_server(
            url, path="/tools/provision", args={"region": "x"}, style="sf-string", token="tk-1"
        )
    assert report.ok, report.table()
    assert set(_verdicts(report).values()) == {"PASS"}


AGENTKEY_ONLY = {
    "hash does not match body gets 422",
    "key on another route gets 422 key_reused",
    "malformed key gets 400",
}


@pytest.mark.parametrize(
    ("app", "failing"),
    [
        (
            _no_idempotency_app,
            AGENTKEY_ONLY
            | {
                "duplicate is replayed",
                "replays carry a replay header",
                "same key, other body is refused (422)",
                "missing key gets 400",
                "both header styles accepted",
            },
        ),
        (
            _waiting_cache_app,
            AGENTKEY_ONLY
            | {
                "replays carry a replay header",
                "same key, other body is refused (422)",
                "missing key gets 400",
            },
        ),
        (
            _stuck_step_app,
            AGENTKEY_ONLY
            | {
                "concurrent duplicates run once",
                "same key, other body is refused (422)",
                "missing key gets 400",
                "both header styles accepted",
            },
        ),
        (
            lambda: _opaque_key_app(by_route=False),
            AGENTKEY_ONLY
            | {"key on another route is never replayed", "both header styles accepted"},
        ),
    ],
    ids=["no idempotency", "waits and replays silently", "409 forever", "replays across routes"],
)
def test_check_fails_with_a_clear_table_against_broken_servers(
    app: Any, failing: set[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A server that breaks a contract row fails exactly the broken rows and exits 1."""
    with serve(app()) as url:
        code = main(["check", url, "--path", "/tools/x", "--args", ARGS])
    out, _ = capsys.readouterr()
    assert code == 1
    assert _failed_rows(out) == failing, out
    assert "the server does NOT honour the contract" in out


def test_an_opaque_key_server_honours_the_contract_without_agentkey_rows(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A draft server that knows no agentkey format passes (exit 0); agentkey rows are reported."""
    with serve(_opaque_key_app()) as url:
        code = main(["check", url, "--path", "/tools/x", "--args", ARGS])
    out, _ = capsys.readouterr()
    assert code == 0, out
    assert "same key, other body is refused (422)" not in _failed_rows(out)
    assert _failed_rows(out) == AGENTKEY_ONLY | {"both header styles accepted"}
    assert "4 agentkey-specific row(s) failed: reported, not required" in out


def test_a_deterministic_tool_that_runs_anew_on_another_route_is_not_called_a_replay() -> None:
    """Identical bytes without a replay header, from a server that marks replays, ran anew."""
    with serve(_opaque_key_app(deterministic=True, every_path=True)) as url:
        report = check_server(url, path="/tools/x", args=json.loads(ARGS), other_path="/tools/x/y")
    assert _verdicts(report)["key on another route is never replayed"] == "PASS", report


def test_replays_under_another_header_name_and_held_duplicates_count_once() -> None:
    """Replays marked Idempotency-Replayed (idemkit) or not at all count as replays, not runs."""
    runs = {"n": 0}
    done: dict[str, asyncio.Event] = {}
    answers: dict[str, bytes] = {}

    async def tool(request: Request) -> Response:
        await request.body()
        key = request.headers.get("idempotency-key", "")
        if key in done:  # a duplicate: held until the first finishes, then replayed
            await done[key].wait()
            marked = {"idempotency-replayed": "true"} if ":step_000:" in key else {}
            return Response(answers[key], headers=marked)
        done[key] = asyncio.Event()
        await asyncio.sleep(0.1)
        runs["n"] += 1
        answers[key] = b'{"run":%d}' % runs["n"]
        done[key].set()
        return Response(answers[key])

    app = Starlette(routes=[Route("/tools/x", tool, methods=["POST"])])
    with serve(app) as url:
        report = check_server(url, path="/tools/x", args={"a": 1}, concurrency=6)
    by_name = {r.name: r for r in report.results}
    assert by_name["duplicate is replayed"].verdict == "PASS", report.table()
    assert by_name["replays carry a replay header"].detail == "Idempotency-Replayed: true"
    burst = by_name["concurrent duplicates run once"]
    assert burst.verdict == "PASS", report.table()
    assert "1 ran, 5 replayed" in burst.detail
    assert by_name["in-flight duplicate gets 409 + Retry-After"].verdict == "SKIP"


def test_check_on_a_fast_tool_skips_the_concurrency_point() -> None:
    """When duplicates only ever see replays, the 409 point is SKIP (unproven), not PASS."""
    app = example_app(shared_key_space=False)
    with serve(app) as url:
        report = check_server(
            url, path="/tools/charge", args={"amount": 5}, concurrency=2, token="tk-1"
        )
    verdicts = _verdicts(report)
    assert verdicts["concurrent duplicates run once"] == "PASS"
    assert verdicts["in-flight duplicate gets 409 + Retry-After"] in {"PASS", "SKIP"}
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
        {"base_url": "http://127.0.0.1:1", "path": "/x", "args": {}, "concurrency": 65},
        {"base_url": "http://127.0.0.1:1", "path": "/x", "args": {}, "other_path": "x"},
        {"base_url": "http://u:p@127.0.0.1:1", "path": "/x", "args": {}},
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
    """A target that refuses connections is 'could not reach' with its cause, exit 3, no verdict."""
    from tests._loopback import free_port

    port = free_port()
    code = main(["check", f"http://127.0.0.1:{port}", "--path", "/x", "--args", "{}"])
    out = capsys.readouterr().out
    assert code == 3
    assert f"could not reach http://127.0.0.1:{port}/x: connection refused" in out
    assert "does NOT honour" not in out
    assert "FAIL" not in out


def test_check_reports_a_tls_failure_as_unreachable(capsys: pytest.CaptureFixture[str]) -> None:
    """https:// to a server that speaks no TLS is 'could not reach: the TLS handshake failed'."""
    with serve(example_app(shared_key_space=False)) as url:
        tls_url = url.replace("http://", "https://")
        code = main(["check", tls_url, "--path", "/tools/provision", "--args", ARGS])
    out = capsys.readouterr().out
    assert code == 3, out
    assert "could not reach https://127.0.0.1:" in out
    assert "TLS handshake failed" in out


def test_check_reports_a_dns_failure_as_unreachable(capsys: pytest.CaptureFixture[str]) -> None:
    """A host no DNS knows (.invalid, RFC 6761) is 'could not reach: the DNS lookup failed'."""
    code = main(
        ["check", "http://agentkey-check.invalid", "--path", "/x", "--args", "{}", "--timeout", "5"]
    )
    out = capsys.readouterr().out
    assert code == 3, out
    assert "could not reach http://agentkey-check.invalid/x: the DNS lookup of" in out


@pytest.mark.parametrize("digits", [400, 5000])
def test_an_absurd_retry_after_is_a_failed_row_not_a_crash(
    digits: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 409 with a Retry-After of hundreds or thousands of digits fails a row, no traceback."""
    with serve(_stuck_step_app("9" * digits)) as url:
        code = main(["check", url, "--path", "/tools/x", "--args", ARGS])
    out, err = capsys.readouterr()
    assert code == 1
    assert "Traceback" not in out + err
    assert "in-flight duplicate gets 409 + Retry-After" in _failed_rows(out)
    assert "an absurd Retry-After ('99999999999999999999... " in out


def test_credentials_in_the_target_url_are_refused_unsent_and_unprinted(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """user:password@ in the target is a usage error (exit 2): nothing sent, nothing printed."""
    app = example_app(shared_key_space=False)
    with serve(app) as url:
        target = url.replace("http://", "http://admin:pa55w0rd@")
        code = main(["check", target, "--path", "/tools/provision", "--args", ARGS])
    out, err = capsys.readouterr()
    assert code == 2
    assert "user name or password" in err
    assert "pa55w0rd" not in out + err
    assert "admin" not in out + err
    assert sum(app.state.executions.values()) == 0


_BOMB_APP = """
import sys, zlib
import uvicorn
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip framing
zeros = bytes(1024 * 1024)
BOMB = b"".join(packer.compress(zeros) for _ in range(256)) + packer.flush()  # 256 MiB inflated

async def tool(request):
    await request.body()
    return Response(BOMB, headers={"content-encoding": "gzip", "content-type": "application/json"})

uvicorn.run(Starlette(routes=[Route("/tools/x", tool, methods=["POST"])]),
            host="127.0.0.1", port=int(sys.argv[1]), log_level="error")
"""


# VmHWM is this process's own peak. getrusage's ru_maxrss is not: Linux carries the
# forking parent's RSS into it across fork and exec, so a big pytest worker inflated it.
_MEASURED_CHECK = """
import sys
from agentkey.cli import main
code = main(sys.argv[1:])
with open("/proc/self/status") as status:
    peak = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
print("peak-rss-kib", peak, file=sys.stderr)
sys.exit(code)
"""


def test_a_gzip_bomb_is_read_only_up_to_the_cap() -> None:
    """A 250 KB gzip answer that inflates to 256 MiB is cut at 1 MiB; the checker stays small."""
    from tests._loopback import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", _BOMB_APP, str(port)])
    try:
        for _ in range(400):
            try:
                httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        args = ["check", f"http://127.0.0.1:{port}", "--path", "/tools/x", "--args", "{}"]
        checker = subprocess.run(
            [sys.executable, "-c", _MEASURED_CHECK, *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        server.terminate()
        server.wait(timeout=10)
    out, err = checker.stdout, checker.stderr
    assert checker.returncode == 1, out + err
    assert "Traceback" not in err
    assert "over 1024 KiB, not read" in out
    peak_mib = int(err.rsplit("peak-rss-kib", 1)[1].split()[0]) / 1024
    assert peak_mib < 200, f"the checker peaked at {peak_mib:.0f} MiB"


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
    app = example_app(shared_key_space=False)
    args = {"rows": rows}
    key = StepKey.build("plan-report", 0, args).format()
    with serve(app) as url:
        response = httpx.post(
            url + "/tools/report",
            headers={
                "idempotency-key": key,
                "content-type": "application/json",
                "authorization": "Bearer tk-1",
            },
            content=canonical_json(args),
            timeout=30,
        )
    assert response.status_code == 400
    assert "rows" in response.json()["error"]
    assert app.state.executions["report"] == 0


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--concurrency", "0"], "--concurrency"),
        (["--concurrency", "many"], "--concurrency"),
        (["--timeout", "0"], "--timeout"),
    ],
)
def test_check_cli_usage_errors_exit_2_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad --concurrency or --timeout is a usage error (exit 2) whose message names the flag."""
    with pytest.raises(SystemExit) as info:
        main(["check", "http://127.0.0.1:1", "--path", "/x", "--args", "{}", *argv])
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


def test_check_cli_same_changed_args_names_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """--changed-args equal to --args is exit 2 with a message about the flags, no request."""
    argv = ["check", "http://127.0.0.1:1", "--path", "/x", "--args", '{"a":1}']
    code = main([*argv, "--changed-args", '{"a": 1}'])
    assert code == 2
    err = capsys.readouterr().err
    assert "--changed-args must differ from --args" in err
    assert "changed_args" not in err


def test_check_help_explains_style_and_concurrency(capsys: pytest.CaptureFixture[str]) -> None:
    """--style and --concurrency have help text; the exit codes are listed."""
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "sf-string (RFC 8941 quoted" in out
    assert "identical requests are sent at once" in out
    assert "3 the target could not be reached" in out
