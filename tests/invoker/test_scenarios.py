"""The scenario table: every row of contract section 3 and the issue's extra cases, on both drivers.

Pure logic over ``httpx.MockTransport``; the same behaviours run over real
sockets in ``test_e2e.py``.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from agentkey import (
    InvokeError,
    KeyRejected,
    KeyReused,
    OutcomeUnknown,
    PayloadMismatch,
    PollTimeout,
    StepFailed,
    StepInProgress,
    TokenRejected,
    ToolError,
    ToolRejected,
    ToolUnreachable,
    UnsafeRedirect,
)
from agentkey._keys import shown_key
from agentkey.client._hooks import PollEvent, ReplayEvent
from agentkey.client._invoker import Outcome, ToolResult

from ._support import (
    BASE,
    DRIVERS,
    FAST_POLL,
    FAST_RETRY,
    Bearer,
    Driver,
    Recorder,
    Script,
    make_step,
    run_invoke,
)

REPLAYED = {"Idempotent-Replayed": "true"}
PROTECTED = {"Idempotency-Protected": "true"}
FOREIGN = "https://elsewhere.test"


def ok(status: int = 200, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    return httpx.Response(status, headers=headers, json=body or {"ok": True})


def status(code: int, retry_after: str | None = None, **headers: str) -> httpx.Response:
    if retry_after is not None:
        headers["Retry-After"] = retry_after
    return httpx.Response(code, headers=headers, json={"error": code})


def state(value: str, code: int = 200) -> httpx.Response:
    return httpx.Response(code, json={"status": value})


def http_date(seconds_ahead: float) -> str:
    return email.utils.formatdate(time.time() + seconds_ahead, usegmt=True)


@dataclass
class Row:
    id: str
    answers: list[Any]
    error: type[InvokeError] | None = None
    outcome: Outcome = Outcome.ANSWERED  # the scripted answers mark nothing
    posts: int = 1
    gets: int = 0
    result_status: int = 200
    probes: int = 0  # OPTIONS asked of a tool not known to honour keys
    options: dict[str, Any] = field(default_factory=dict)
    check: Callable[[ToolResult | InvokeError, Recorder], None] | None = None


def waits_capped(result: ToolResult | InvokeError, hooks: Recorder) -> None:
    """Retry-After asked for more than the cap: every wait is exactly the cap (50 ms)."""
    assert [e.wait for e in hooks.retries()] == [0.05]


def in_flight_floor(result: ToolResult | InvokeError, hooks: Recorder) -> None:
    """A 409 in flight with Retry-After 0 still waits the in-flight floor (no spinning)."""
    assert [e.wait for e in hooks.retries()] == [FAST_RETRY.initial_backoff]


def in_flight_capped(result: ToolResult | InvokeError, hooks: Recorder) -> None:
    """A long Retry-After on an in-flight answer is an upper bound: the wait is the short cap."""
    assert [e.wait for e in hooks.retries()] == [FAST_RETRY.max_backoff]


def wait_zero(result: ToolResult | InvokeError, hooks: Recorder) -> None:
    assert [e.wait for e in hooks.retries()] == [0.0]


def backoff_used(result: ToolResult | InvokeError, hooks: Recorder) -> None:
    """Garbage Retry-After: the wait comes from the jittered backoff window (<= 2 ms)."""
    waits = [e.wait for e in hooks.retries()]
    assert len(waits) == 1
    assert 0.0 <= waits[0] <= 0.002


def replay_seen(result: ToolResult | InvokeError, hooks: Recorder) -> None:
    """A replay, even of an error, reaches the hooks as one ReplayEvent."""
    assert [type(e) for e in hooks.events if isinstance(e, ReplayEvent)] == [ReplayEvent]


def polls_seen(result: ToolResult | InvokeError, hooks: Recorder) -> None:
    """Each wait of the polling phase reaches the hooks, starting with the one after the 202."""
    polls = [e for e in hooks.events if isinstance(e, PollEvent)]
    assert [(e.poll, e.state) for e in polls] == [(0, "accepted"), (1, "running")]
    assert all(e.status_url == f"{BASE}/ops/1" for e in polls)


def status_url_is(url: str) -> Callable[[ToolResult | InvokeError, Recorder], None]:
    def check(result: ToolResult | InvokeError, hooks: Recorder) -> None:
        if isinstance(result, ToolResult):
            assert result.status_url == url
        else:
            assert isinstance(result, PollTimeout)
            assert result.status_url == url

    return check


STRIPE = (
    "Keys for idempotent requests can only be used with the same parameters they were first "
    "used with. Try using a key other than 'k' if you meant to execute a different request."
)


def problem(code: int, type_: str, *headers: str) -> httpx.Response:
    """An RFC 9457 problem answer, with agentkey's legacy "error" field beside the type."""
    extra = dict(zip(headers[::2], headers[1::2], strict=True))
    body = {"type": type_, "title": "t", "status": code, "error": type_.rsplit(":", 1)[-1]}
    return httpx.Response(
        code, headers={"Content-Type": "application/problem+json", **extra}, json=body
    )


def reason_is(text: str) -> Callable[[ToolResult | InvokeError, Recorder], None]:
    def check(result: ToolResult | InvokeError, hooks: Recorder) -> None:
        assert isinstance(result, InvokeError)
        assert result.reason == text
        assert text in str(result)

    return check


def honest_after_409(result: ToolResult | InvokeError, hooks: Recorder) -> None:
    """After 409s then 503s the message never claims the tool did not run the step."""
    assert "did not run" not in str(result)
    assert "in flight" in str(result)


def says_accepted(result: ToolResult | InvokeError, hooks: Recorder) -> None:
    """An unusable status URL after a 202 says the step was accepted (has run or runs)."""
    assert "accepted the step (202)" in str(result)


def says_ran(result: ToolResult | InvokeError, hooks: Recorder) -> None:
    assert "already ran" in str(result)


def says_not_resent(result: ToolResult | InvokeError, hooks: Recorder) -> None:
    """A call in doubt to a tool not known to honour keys: not resent, and the message says so."""
    assert "did not send it again" in str(result)
    assert "at most once" not in str(result)
    assert hooks.retries() == []


PROTECTED = {"Idempotency-Protected": "true"}


ROWS = [
    # -- contract section 3, row by row --
    Row("2xx-done", [ok(201)], result_status=201),
    Row("2xx-replayed", [ok(200, REPLAYED)], outcome=Outcome.REPLAYED, check=replay_seen),
    # -- the verdict: "executed" only where the answer (or its route) shows it ran now --
    Row("2xx-protected", [ok(200, PROTECTED)], outcome=Outcome.EXECUTED),
    Row(
        "2xx-marker-says-run",
        [ok(201, {"X-Ichido-Status": "executed"})],
        outcome=Outcome.EXECUTED,
        result_status=201,
    ),
    Row("2xx-marker-false", [ok(200, {"Idempotent-Replayed": "false"})], outcome=Outcome.EXECUTED),
    # The route showed it marks replays (the 503's protection header): no marker is a run.
    Row(
        "protected-503-then-ok",
        [status(503, "0", **PROTECTED), ok()],
        posts=2,
        outcome=Outcome.EXECUTED,
    ),
    # The tool marks replays: a 2xx after its 409 without a marker ran now (the holder failed).
    Row(
        "protected-409-then-ok",
        [status(409, "0", **PROTECTED), ok(200, PROTECTED)],
        posts=2,
        outcome=Outcome.EXECUTED,
    ),
    Row(
        "423-then-ok-no-markers",
        [status(423, "0"), ok()],
        posts=2,
        outcome=Outcome.REPLAYED,
        options={"replay_headers": ()},
    ),
    # replay_headers=(): no replay can be seen, so the protection header proves nothing.
    Row(
        "2xx-protected-no-replay-headers",
        [ok(200, PROTECTED)],
        outcome=Outcome.ANSWERED,
        options={"replay_headers": ()},
    ),
    Row(
        "2xx-replayed-x-header",
        [ok(200, {"X-Idempotency-Replayed": "TRUE"})],
        outcome=Outcome.REPLAYED,
    ),
    Row(
        "202-poll",
        [status(202, Location="/ops/1"), state("running"), state("Succeeded")],
        gets=2,
        check=polls_seen,
    ),
    # An unmarked answer after "the same key is in flight": from a tool that may mark
    # replays it may be a second run (never "replayed"); from one declared to mark none
    # (replay_headers=()) it is the earlier attempt's outcome.
    Row("409-then-ok", [status(409, "0"), ok()], posts=2, check=in_flight_floor),
    Row(
        "409-then-ok-no-markers",
        [status(409, "0"), ok()],
        posts=2,
        outcome=Outcome.REPLAYED,
        options={"replay_headers": ()},
    ),
    Row("429-then-ok", [status(429, "120"), ok()], posts=2, check=waits_capped),
    Row("503-then-ok", [status(503, "1"), ok()], posts=2, check=waits_capped),
    Row("500-then-ok", [status(500), ok()], posts=2),
    Row("502-then-ok", [status(502), ok()], posts=2),
    Row("504-then-ok", [status(504), ok()], posts=2),
    Row(
        "read-timeout-then-replay",
        [httpx.ReadTimeout("slow"), ok(200, REPLAYED)],
        posts=2,
        outcome=Outcome.REPLAYED,
    ),
    Row(
        "reset-then-replay",
        [httpx.RemoteProtocolError("reset"), ok(200, REPLAYED)],
        posts=2,
        outcome=Outcome.REPLAYED,
    ),
    Row("connect-error-then-ok", [httpx.ConnectError("refused"), ok()], posts=2),
    Row("connect-timeout-then-ok", [httpx.ConnectTimeout("slow"), ok()], posts=2),
    Row("401-final", [status(401)], error=TokenRejected),
    Row("422-final", [status(422)], error=PayloadMismatch),
    Row("400-final", [status(400)], error=KeyRejected),
    Row("403-final", [status(403)], error=ToolRejected),
    Row("404-final", [status(404)], error=ToolRejected),
    Row("replayed-422-final", [status(422, **REPLAYED)], error=PayloadMismatch),
    # -- the extra cases --
    Row(
        "409-storm-then-ok",
        [*(status(409, "1") for _ in range(6)), ok(200, REPLAYED)],
        posts=7,
        outcome=Outcome.REPLAYED,
    ),
    Row("retry-after-http-date", [status(429, http_date(3600)), ok()], posts=2, check=waits_capped),
    Row("retry-after-past-date", [status(503, http_date(-3600)), ok()], posts=2, check=wait_zero),
    Row("retry-after-zero", [status(503, "0"), ok()], posts=2, check=wait_zero),
    Row("retry-after-garbage", [status(503, "soon-ish"), ok()], posts=2, check=backoff_used),
    Row("retry-after-negative", [status(429, "-5"), ok()], posts=2, check=backoff_used),
    Row("retry-after-fraction", [status(429, "1.5"), ok()], posts=2, check=backoff_used),
    Row("500-until-budget", [status(500) for _ in range(8)], posts=8, error=OutcomeUnknown),
    Row(
        "timeouts-until-budget",
        [httpx.ReadTimeout("slow") for _ in range(8)],
        posts=8,
        error=OutcomeUnknown,
    ),
    Row(
        "connect-errors-until-unreachable",
        [httpx.ConnectError("no") for _ in range(3)],
        posts=3,
        error=ToolUnreachable,
    ),
    Row(
        "202-three-polls-success",
        [
            status(202, **{"Operation-Location": "/ops/7"}),
            state("queued"),
            state("in_progress"),
            state("running"),
            state("completed"),
        ],
        gets=4,
    ),
    Row(
        "202-polls-then-failure",
        [status(202, Location="/ops/2"), state("pending"), state("running"), state("FAILED")],
        gets=3,
        error=StepFailed,
    ),
    Row(
        "202-poll-canceled",
        [status(202, Location="/ops/2"), state("Cancelled")],
        gets=1,
        error=StepFailed,
    ),
    Row(
        "202-body-status-url",
        [httpx.Response(202, json={"status_url": "/ops/9"}), state("done")],
        gets=1,
        check=status_url_is(f"{BASE}/ops/9"),
    ),
    Row(
        "202-nested-operation-url",
        [httpx.Response(202, json={"operation": {"url": "/ops/10"}}), state("succeeded")],
        gets=1,
        check=status_url_is(f"{BASE}/ops/10"),
    ),
    Row(
        "202-aip151-done-response",
        [
            status(202, Location="/ops/3"),
            httpx.Response(200, json={"done": False}),
            httpx.Response(200, json={"done": True, "response": {"id": 1}}),
        ],
        gets=2,
    ),
    Row(
        "202-aip151-done-error",
        [status(202, Location="/ops/3"), httpx.Response(200, json={"done": True, "error": {}})],
        gets=1,
        error=StepFailed,
    ),
    Row(
        "202-poll-no-status-field",
        [status(202, Location="/ops/4"), httpx.Response(200, json={"id": 4})],
        gets=1,
    ),
    Row(
        "202-poll-202-then-ok",
        [status(202, Location="/ops/4"), status(202, "0"), state("succeeded")],
        gets=2,
    ),
    Row(
        "202-poll-transient-503",
        [
            status(202, Location="/ops/5"),
            status(503, "0"),
            httpx.ReadTimeout("x"),
            state("succeeded"),
        ],
        gets=3,
    ),
    Row(
        "202-poll-404",
        [status(202, Location="/ops/5"), status(404)],
        gets=1,
        error=ToolError,
    ),
    Row(
        "202-poll-see-other",
        [
            status(202, Location="/ops/6"),
            status(303, Location="/results/6"),
            httpx.Response(200, json={"status": "running-is-ignored", "id": 6}),
        ],
        gets=2,
    ),
    Row("202-no-status-url", [httpx.Response(202, json={"accepted": True})], result_status=202),
    Row(
        "202-replayed",
        [status(202, Location="/ops/8", **REPLAYED), state("succeeded")],
        gets=1,
        outcome=Outcome.REPLAYED,
    ),
    Row(
        "202-cross-origin-location",
        [status(202, Location=f"{FOREIGN}/ops/1")],
        error=UnsafeRedirect,
    ),
    # An allowed foreign status origin is polled through agentkey's own cookieless client, not
    # the user's (mock) transport: tests/invoker/test_e2e.py and test_invoker_api.py cover it
    # over loopback.
    Row("307-same-origin-redirect", [status(307, Location="/v2/tools/create_db"), ok()], posts=2),
    Row(
        "308-cross-origin-redirect",
        [status(308, Location=f"{FOREIGN}/tools/x")],
        error=UnsafeRedirect,
    ),
    Row(
        "302-scheme-downgrade",
        [status(302, Location="http://tool.test/tools/x")],
        error=UnsafeRedirect,
    ),
    Row("303-see-other", [status(303, Location="/results/1"), ok(id=1)], gets=1),
    Row("replayed-500-final", [status(500, **REPLAYED)], error=ToolError, check=replay_seen),
    Row("500-then-replayed-500", [status(500), status(500, **REPLAYED)], posts=2, error=ToolError),
    Row(
        "409-not-retried-when-configured",
        [status(409, "0")],
        error=StepInProgress,
        options={"retry_statuses": frozenset({429, 503})},
    ),
    # -- dialects of other idempotency servers (issue 15): one table in _protocol --
    Row(
        "idempotency-replayed-header",
        [ok(200, {"Idempotency-Replayed": "true"})],
        outcome=Outcome.REPLAYED,
    ),
    Row(
        "423-locked-then-replay",
        [problem(423, "urn:idemkit:in-progress", "Retry-After", "30"), ok(200, REPLAYED)],
        posts=2,
        outcome=Outcome.REPLAYED,
        check=in_flight_capped,
    ),
    Row(
        "409-idemkit-stripe-mode-mismatch",
        [problem(409, "urn:idemkit:payload-mismatch")],
        error=PayloadMismatch,
    ),
    Row(
        "409-stripe-idempotency-error",
        [httpx.Response(409, json={"error": {"type": "idempotency_error", "message": STRIPE}})],
        error=PayloadMismatch,
    ),
    Row(
        "400-stripe-idempotency-error",
        [httpx.Response(400, json={"error": {"type": "idempotency_error", "message": STRIPE}})],
        error=PayloadMismatch,
    ),
    Row("422-key-reused", [problem(422, "urn:agentkey:problem:key_reused")], error=KeyReused),
    Row(
        "422-legacy-key-reused",
        [httpx.Response(422, json={"error": "key_reused", "detail": "bound to /tools/a"})],
        error=KeyReused,
    ),
    Row(
        "400-key-invalid",
        [problem(400, "urn:agentkey:problem:idempotency_key_invalid")],
        error=KeyRejected,
    ),
    Row("400-idemkit-missing-key", [problem(400, "urn:idemkit:missing-key")], error=KeyRejected),
    Row(
        "400-business-reason",
        [httpx.Response(400, json={"error": "amount must be a positive integer"})],
        error=ToolRejected,
        check=reason_is("amount must be a positive integer"),
    ),
    Row(
        "422-validation-list",
        [httpx.Response(422, json={"detail": [{"loc": ["body", "gb"], "msg": "too big"}]})],
        error=ToolRejected,
    ),
    Row(
        "409s-then-503s-honest",
        [status(409, "0"), *(status(503, "0") for _ in range(8))],
        posts=9,
        error=OutcomeUnknown,
        check=honest_after_409,
    ),
    # -- tools not known to honour keys (issue 25): no blind resend of what may have run --
    Row(
        "unknown-tool-read-timeout-stops",
        [httpx.ReadTimeout("slow"), status(405)],
        error=OutcomeUnknown,
        probes=1,
        options={"honours_keys": None},
        check=says_not_resent,
    ),
    Row(
        "unknown-tool-502-stops",
        [status(502), status(405)],
        error=OutcomeUnknown,
        probes=1,
        options={"honours_keys": None},
        check=says_not_resent,
    ),
    Row(
        "declared-unhonoured-reset-stops-unasked",
        [httpx.RemoteProtocolError("reset")],
        error=OutcomeUnknown,
        options={"honours_keys": False},
        check=says_not_resent,
    ),
    Row(
        "unknown-tool-says-protected-then-replays",
        [httpx.ReadTimeout("slow"), status(405, **PROTECTED), ok(200, REPLAYED)],
        posts=2,
        probes=1,
        outcome=Outcome.REPLAYED,
        options={"honours_keys": None},
    ),
    Row(
        "unknown-tool-protected-answer-then-timeout-resends",
        [status(409, "0", **PROTECTED), httpx.ReadTimeout("slow"), ok(200, REPLAYED)],
        posts=3,
        outcome=Outcome.REPLAYED,
        options={"honours_keys": None},
    ),
    Row(
        "unknown-tool-connect-error-resends",
        [httpx.ConnectError("refused"), ok()],
        posts=2,
        options={"honours_keys": None},
    ),
    Row(
        "unknown-tool-503-stops",  # a gateway's 503 after the tool got it (issue 34)
        [status(503, "0"), status(405)],
        error=OutcomeUnknown,
        probes=1,
        options={"honours_keys": None},
        check=says_not_resent,
    ),
    Row(
        "unknown-tool-429-stops",
        [status(429, "0"), status(405)],
        error=OutcomeUnknown,
        probes=1,
        options={"honours_keys": None},
        check=says_not_resent,
    ),
    # -- hostile Retry-After values: capped, never OverflowError or ValueError --
    Row(
        "retry-after-400-digits",
        [status(409, "9" * 400), ok()],
        posts=2,
        check=in_flight_capped,
    ),
    Row("retry-after-5000-digits", [status(503, "7" * 5000), ok()], posts=2, check=waits_capped),
    Row(
        "poll-retry-after-5000-digits",
        [status(202, Location="/ops/1"), status(202, "8" * 5000), state("done")],
        gets=2,
    ),
    # -- Location / status URLs httpx cannot parse: typed, keeping the key, "already ran" --
    *(
        Row(f"202-status-url-{name}", [answer], error=ToolError, check=says_accepted)
        for name, answer in [
            ("data", status(202, Location="data:text/plain,hi")),
            ("bad-ipv6", status(202, Location="https://[zz]/ops")),
            ("bad-port", status(202, Location="https://tool.test:99999/ops")),
            (
                "non-ascii-host",
                httpx.Response(202, json={"status_url": "https://ex\u00e4mple.test/"}),
            ),
            ("non-ascii-path", httpx.Response(202, json={"status_url": "/ops/\u00e4"})),
        ]
    ),
    Row(
        "303-location-bad-ipv6",
        [status(303, Location="https://[zz]/r")],
        error=ToolError,
        check=says_ran,
    ),
    Row(
        "poll-303-location-bad-ipv6",
        [status(202, Location="/ops/1"), status(303, Location="https://[zz]/r")],
        gets=1,
        error=ToolError,
        check=says_accepted,
    ),
    # -- URLs from the tool that httpx cannot send: a typed ToolError, never httpx.InvalidURL --
    Row("202-location-with-nul", [status(202, Location="/ops/1\x00x")], error=ToolError),
    Row(
        "202-body-status-url-with-control",
        [httpx.Response(202, json={"status_url": "/ops/1\u0001x"})],
        error=ToolError,
    ),
    Row(
        "202-body-status-url-with-del",
        [httpx.Response(202, json={"operation": {"url": "/ops/\u007f"}})],
        error=ToolError,
    ),
]


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_scenario(row: Row, driver: Driver) -> None:
    """Each scenario gives the expected result or error, same key and body on every send."""
    script = Script(list(row.answers))
    hooks = Recorder()
    step = make_step()
    options = dict(row.options)
    if "retry_statuses" in options:
        options["retry"] = FAST_RETRY.replace(retry_statuses=options.pop("retry_statuses"))
    outcome: ToolResult | InvokeError
    if row.error is None:
        outcome = run_invoke(driver, script, step, auth=Bearer(), hooks=[hooks], **options)
        assert outcome.outcome is row.outcome
        assert outcome.replayed is (row.outcome is Outcome.REPLAYED)
        assert outcome.status_code == row.result_status
        assert outcome.attempts == row.posts
        assert outcome.polls == row.gets
        assert outcome.idempotency_key == step.idempotency_key
    else:
        with pytest.raises(row.error) as caught:
            run_invoke(driver, script, step, auth=Bearer(), hooks=[hooks], **options)
        assert type(caught.value) is row.error
        outcome = caught.value
        assert outcome.idempotency_key == step.idempotency_key
        assert outcome.step == "step_003"
        assert outcome.attempts == row.posts
        assert shown_key(step.idempotency_key) in str(outcome)  # plan and step readable
        assert step.idempotency_key not in str(outcome)  # a bearer secret: never whole
    assert not script.answers, "every scripted answer was used"
    assert len(script.posts()) == row.posts
    assert len(script.gets()) == row.gets
    assert len(script.probes()) == row.probes
    for post in script.posts():
        assert post.headers["Idempotency-Key"] == step.idempotency_key
        assert post.content == step.body
        assert post.headers["Content-Type"] == "application/json"
    for request in script.requests:
        if request.method == "OPTIONS":  # the probe asks about the route, not about the key
            assert "Idempotency-Key" not in request.headers
            continue
        on_base = request.url.host == "tool.test" and request.url.scheme == "https"
        if on_base:
            assert request.headers["Authorization"] == "Bearer s3cret-token"
            assert request.headers["Idempotency-Key"] == step.idempotency_key
        else:
            assert "Authorization" not in request.headers
            assert "Idempotency-Key" not in request.headers
    if row.check is not None:
        row.check(outcome, hooks)


def test_table_is_big_enough() -> None:
    """The issue asks for at least 20 scenarios; the table has more, with unique ids."""
    assert len(ROWS) >= 20
    assert len({r.id for r in ROWS}) == len(ROWS)


@pytest.mark.parametrize("driver", DRIVERS)
def test_poll_timeout_then_resume(driver: Driver) -> None:
    """A poll deadline raises PollTimeout with the status URL; resume_poll finishes without POST."""

    def running(request: httpx.Request) -> httpx.Response:
        time.sleep(0.01)
        return state("running")

    step = make_step()
    script = Script([status(202, Location="/ops/42"), *([running] * 200)])
    tight = FAST_POLL.replace(deadline=0.05)
    with pytest.raises(PollTimeout) as caught:
        run_invoke(driver, script, step, polling=tight)
    error = caught.value
    assert error.status_url == f"{BASE}/ops/42"
    assert error.idempotency_key == step.idempotency_key
    assert "resume_poll" in str(error)
    assert 1 <= len(script.gets()) < 200
    resumed = Script([state("running"), state("succeeded")])
    result = run_invoke(
        driver, resumed, step, resume=(error.status_url, error.idempotency_key or "")
    )
    assert result.status_code == 200
    assert result.polls == 2
    assert result.attempts == 0
    assert result.status_url == f"{BASE}/ops/42"
    assert [r.method for r in resumed.requests] == ["GET", "GET"]


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize(
    ("with_auth", "hint"),
    [(True, "even after the auth layer's refresh"), (False, "the invoker has no auth=")],
)
def test_401_message_fits_the_invoker(driver: Driver, with_auth: bool, hint: str) -> None:
    """A 401 says 'refreshed and still refused' with auth=, and 'pass auth=' without it."""
    script = Script([status(401)])
    options: dict[str, Any] = {"auth": Bearer()} if with_auth else {}
    with pytest.raises(TokenRejected, match=hint) as info:
        run_invoke(driver, script, make_step(), **options)
    assert info.value.status_code == 401
    assert len(script.posts()) == 1
