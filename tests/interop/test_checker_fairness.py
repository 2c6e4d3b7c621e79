"""`agentkey check` is fair in every style (issue 37 §6): it tests what each row says.

Every server is real, on loopback: asgi-idempotency-header (a UUID-only third-party
server on the session's Redis), a draft server that refuses in-flight duplicates with
422, a server that remembers every key it saw, and agentkey's example server. What ran
is counted on the server.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentkey.cli import EXIT_OK, EXIT_UNREACHABLE, main
from agentkey.testing import CheckReport, CheckResult, check_server, example_app
from tests._loopback import RedisServer, serve

from ._peers import PEERS, serve_peer

ARGS = {"region": "eu-west-1", "gb": 20}
HASH_ROW = "hash does not match body gets 422"
MALFORMED_ROW = "malformed key gets 400"
BURST_ROW = "concurrent duplicates run once"
IN_FLIGHT_ROW = "in-flight duplicate gets 409 + Retry-After"


def row(report: CheckReport, name: str) -> CheckResult:
    (found,) = [r for r in report.results if r.name == name]
    return found


@pytest.mark.redis
def test_a_uuid_only_server_is_not_credited_with_a_hash_check_it_never_made(
    redis_proc: RedisServer,
) -> None:
    """Under --style uuid, asgi-idempotency-header's "must be a v4 UUID" 422 is no PASS for
    the hash row (SKIP: a UUID carries no hash), and its 422 for a malformed key is a WARN."""
    (peer,) = [p for p in PEERS if p.style == "uuid"]
    with serve_peer(peer, redis_proc) as served:
        served.tool.delay = 0.1
        report = check_server(
            served.url,
            path="/tools/check",
            other_path="/v2/tools/check",
            args=ARGS,
            style="uuid",
            concurrency=4,
            timeout=30,
        )
        refused = [a for a in served.wire.on("/tools/check") if a.status == 422]
    table = report.table()
    assert report.no_verdict is None, table
    hashed = row(report, HASH_ROW)
    assert hashed.verdict == "SKIP", table
    assert "carries no args hash" in hashed.detail
    malformed = row(report, MALFORMED_ROW)
    assert malformed.verdict == "WARN", table
    assert malformed.detail.startswith("422"), table
    assert refused, table  # the malformed probe, refused as no UUID
    assert served.tool.most_runs_per_key() == 1, table


def _sf_string_only_app(runs: Counter[str]) -> Starlette:
    """Takes only RFC 8941 quoted keys (a raw one: 422 "must be a structured field string"),
    replays a used key, and never compares bodies."""

    answers: dict[str, bytes] = {}

    async def tool(request: Request) -> Response:
        await request.body()
        key = request.headers.get("idempotency-key", "")
        if not (len(key) > 2 and key.startswith('"') and key.endswith('"')):
            detail = "the Idempotency-Key header must be a structured field string"
            return JSONResponse({"detail": detail}, status_code=422)
        if key in answers:
            return Response(answers[key], headers={"idempotent-replayed": "true"})
        runs[key] += 1
        answers[key] = b'{"run":%d}' % sum(runs.values())
        return Response(answers[key], media_type="application/json")

    return Starlette(routes=[Route("/tools/{name:path}", tool, methods=["POST"])])


def test_the_hash_probe_is_sent_in_the_style_the_server_takes() -> None:
    """--style sf-string: the hash probe is a quoted key too (the old one was raw, and the
    server's 422 for the raw form passed a row about bodies it never compared)."""
    runs: Counter[str] = Counter()
    with serve(_sf_string_only_app(runs)) as url:
        report = check_server(url, path="/tools/x", args=ARGS, style="sf-string", timeout=10)
    table = report.table()
    hashed = row(report, HASH_ROW)
    # It never compares bodies: the probe ran, and the row says so.
    assert (hashed.verdict, hashed.scope) == ("FAIL", "agentkey"), table
    assert "its key was not made for" in hashed.detail
    assert sum(":step_003:" in key for key in runs) == 1, runs
    assert all(count == 1 for count in runs.values()), runs


def _refuses_in_flight_duplicates_with_422(n: int, runs: Counter[str]) -> Starlette:
    """A draft server that runs the first request of a key and refuses every duplicate
    that arrives while it runs with 422 (as some servers answer "in progress"). The first
    run is held until the other ``n - 1`` of the burst were refused: no timing involved."""
    records: dict[str, tuple[bytes, bytes | None]] = {}
    refused: Counter[str] = Counter()
    released: dict[str, asyncio.Event] = {}

    async def tool(request: Request) -> Response:
        body = await request.body()
        key = request.headers.get("idempotency-key")
        if key is None:
            return JSONResponse({"error": "missing_key"}, status_code=400)
        slot = f"{request.url.path} {key}"
        if slot in records:
            first, answer = records[slot]
            if first != body:
                return JSONResponse({"type": "urn:x:payload-mismatch"}, status_code=422)
            if answer is None:
                refused[slot] += 1
                if refused[slot] >= n - 1:
                    released[slot].set()
                detail = "a request with this key is being processed"
                return JSONResponse({"detail": detail}, status_code=422)
            return Response(answer, headers={"idempotent-replayed": "true"})
        records[slot] = (body, None)
        released[slot] = asyncio.Event()
        if ":step_001:" in key:  # the burst's key: wait for the duplicates
            await asyncio.wait_for(released[slot].wait(), 20)
        runs[slot] += 1
        answer = b'{"run":%d}' % sum(runs.values())
        records[slot] = (body, answer)
        return Response(answer, media_type="application/json")

    return Starlette(routes=[Route("/tools/{name:path}", tool, methods=["POST"])])


def test_duplicates_refused_with_422_while_the_step_ran_pass_the_burst_row() -> None:
    """One execution and 422 for each in-flight duplicate: the contract row passes (nothing
    ran twice), and the blame goes to the agentkey 409 row."""
    n = 6
    runs: Counter[str] = Counter()
    with serve(_refuses_in_flight_duplicates_with_422(n, runs)) as url:
        report = check_server(url, path="/tools/x", args=ARGS, concurrency=n, timeout=30)
    table = report.table()
    burst = [slot for slot in runs if ":step_001:" in slot]
    assert [runs[slot] for slot in burst] == [1], runs  # one execution, on the server
    assert row(report, BURST_ROW).verdict == "PASS", table
    assert f"1 ran, 0 replayed, {n - 1} refused ([422])" in row(report, BURST_ROW).detail
    in_flight = row(report, IN_FLIGHT_ROW)
    assert (in_flight.verdict, in_flight.scope) == ("FAIL", "agentkey"), table
    assert "got [422], not 409" in in_flight.detail
    assert report.ok, table


def _remembers_every_key(seen: list[str]) -> Starlette:
    """A draft server with opaque keys that remembers each key with its body: a used key
    with another body gets 422, however long ago it was used."""
    records: dict[str, tuple[bytes, bytes]] = {}

    async def tool(request: Request) -> Response:
        body = await request.body()
        key = request.headers.get("idempotency-key")
        if key is None:
            return JSONResponse({"error": "missing_key"}, status_code=400)
        seen.append(key)
        if key in records:
            first, answer = records[key]
            if first != body:
                return JSONResponse({"type": "urn:x:payload-mismatch"}, status_code=422)
            return Response(answer, headers={"idempotent-replayed": "true"})
        records[key] = (body, b'{"run":%d}' % (len(records) + 1))
        return Response(records[key][1], media_type="application/json")

    return Starlette(routes=[Route("/tools/{name:path}", tool, methods=["POST"])])


def test_a_second_check_of_a_server_that_remembers_keys_gives_the_same_verdicts() -> None:
    """The malformed-key probe is new per run: a second check (other --args) against a
    server that remembers keys reads as the first did, never "422; expected 400"."""
    seen: list[str] = []
    with serve(_remembers_every_key(seen)) as url:
        first = check_server(url, path="/tools/x", args={"gb": 20}, timeout=10)
        between = len(seen)
        second = check_server(url, path="/tools/x", args={"gb": 40}, timeout=10)
    probes = [k for k in seen if "step_malformed" in k]
    assert len(probes) == 2
    assert seen.index(probes[0]) < between <= seen.index(probes[1])
    assert probes[0] != probes[1]
    assert [(r.name, r.verdict) for r in first.results] == [
        (r.name, r.verdict) for r in second.results
    ], second.table()
    assert row(first, MALFORMED_ROW).detail == row(second, MALFORMED_ROW).detail
    assert "422" not in row(second, MALFORMED_ROW).detail


def test_agentkeys_server_refuses_the_malformed_probe_on_every_run() -> None:
    """agentkey's own server answers the probe 400 on two runs in a row (its probe looks like
    agentkey's format and is broken, whatever opaque keys the server accepts)."""
    app = example_app(shared_key_space=False)
    with serve(app) as url:
        reports = [
            check_server(url, path="/tools/charge", args={"amount": 5 + i}, token="tk")
            for i in range(2)
        ]
    for report in reports:
        assert row(report, MALFORMED_ROW).verdict == "PASS", report.table()


@pytest.mark.parametrize("token", ["key", "e"])
def test_a_short_token_never_rewrites_an_answer_before_it_is_parsed(
    token: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--token key / e against agentkey's example server: every row passes as with any
    token (the old code read "urn:agentkey:problem:***_reused" and failed rows), and the
    checker's own words are never redacted."""
    app = example_app(work_seconds=0.2, shared_key_space=False)
    with serve(app) as url:
        code = main(
            ["check", url, "--path", "/tools/provision", "--args", json.dumps(ARGS),
             "--token", token, "--timeout", "10"]
        )  # fmt: skip
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    assert "FAIL" not in out
    assert "key on another route gets 422 key_reused" in out
    assert "***" not in out  # the server never echoed the token: nothing to redact
    assert app.state.executions["provision"] == 4, out


def _refuses_with_a_quota(token: str) -> Starlette:
    """Refuses every call with 429 and a sentence that names the caller's token."""

    async def tool(request: Request) -> Response:
        await request.body()
        detail = f"8 executions today: the quota of {token} is spent"
        return JSONResponse({"detail": detail}, status_code=429)

    return Starlette(routes=[Route("/tools/{name:path}", tool, methods=["POST"])])


def test_a_short_token_is_redacted_as_a_whole_word_at_output_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--token x: the server's sentence is printed with "x" as *** and "executions" intact
    (the old code printed "8 e***ecutions")."""
    with serve(_refuses_with_a_quota("x")) as url:
        code = main(["check", url, "--path", "/tools/x", "--args", json.dumps(ARGS),
                     "--token", "x"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == EXIT_UNREACHABLE, out  # the fresh request was refused: no verdict
    assert "8 executions today: the quota of *** is spent" in out
