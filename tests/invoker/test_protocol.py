"""The I/O-free core: classification of every contract row, poll states, status URL strategies."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkey import (
    InvokeError,
    OutcomeUnknown,
    PayloadMismatch,
    StepFailed,
    StepInProgress,
    TokenRejected,
    ToolError,
    ToolRejected,
    UnsafeRedirect,
)
from agentkey._keys import shown_key
from agentkey.client._net import origin_of
from agentkey.client._policies import DEFAULT_RETRY_STATUSES
from agentkey.client._protocol import (
    DEFAULT_REPLAY_HEADERS,
    Action,
    Answer,
    CallContext,
    Decision,
    Failure,
    FailureKind,
    ProtocolConfig,
    budget_exhausted,
    classify,
    find_status_url,
    interpret_poll,
    poll_target,
)

BASE = "https://tool.test"
CFG = ProtocolConfig(
    base_origin=origin_of(BASE),  # type: ignore[arg-type]
    retry_statuses=DEFAULT_RETRY_STATUSES,
    allowed_poll_origins=frozenset({origin_of("https://status.test")}),  # type: ignore[arg-type]
)
CTX = CallContext("plan:step_001:" + "a" * 64, "step_001", 1)


def answer(status: int, body: bytes = b"", url: str = f"{BASE}/tools/x", **headers: str) -> Answer:
    return Answer(status, {k.lower().replace("_", "-"): v for k, v in headers.items()}, body, url)


# -- contract section 3, one row each ------------------------------------------------------


@pytest.mark.parametrize("status", [200, 201, 204])
def test_2xx_is_done(status: int) -> None:
    """2xx other than 202 is the result, not replayed without a replay header."""
    decision = classify(answer(status), CTX, CFG)
    assert decision.action is Action.DONE
    assert not decision.replayed


@pytest.mark.parametrize("entry", DEFAULT_REPLAY_HEADERS)
def test_replay_headers_are_recognised(entry: str) -> None:
    """Each default replay entry with its value (true or the one named, any case) is a replay."""
    name, _, value = entry.partition(":")
    said = value.strip().upper() or "True"
    decision = classify(Answer(200, {name.lower(): said}, b"", BASE), CTX, CFG)
    assert decision.replayed


def test_replay_header_false_is_not_a_replay() -> None:
    """A replay header saying false is not a replay."""
    assert not classify(answer(200, Idempotent_Replayed="false"), CTX, CFG).replayed


def test_202_with_location_polls() -> None:
    """202 with a status URL means poll it, resolved against the request URL."""
    decision = classify(answer(202, Location="../ops/1"), CTX, CFG)
    assert decision.action is Action.POLL
    assert decision.url == f"{BASE}/ops/1"


@pytest.mark.parametrize(
    ("status", "in_doubt", "hint"),
    [
        (409, False, 7.0),
        (429, True, 7.0),
        (503, True, 7.0),
        (500, True, None),
        (502, True, None),
        (504, True, None),
    ],
)
def test_retryable_statuses(status: int, in_doubt: bool, hint: float | None) -> None:
    """409 retries (not in doubt); 429 and every 5xx (503 too) were sent and answered, so
    they may have run (issue 34): resent only where the tool honours keys."""
    decision = classify(answer(status, Retry_After="7"), CTX, CFG)
    assert decision.action is Action.RETRY
    assert decision.retry
    assert decision.in_doubt is in_doubt
    assert decision.retry_after == hint


@pytest.mark.parametrize(
    ("kind", "in_doubt"), [(FailureKind.IN_DOUBT, True), (FailureKind.NOT_SENT, False)]
)
def test_transport_failures_retry(kind: FailureKind, in_doubt: bool) -> None:
    """Read timeouts and resets retry as in doubt; connect errors retry as not sent."""
    decision = classify(Failure(kind, "x"), CTX, CFG)
    assert decision.action is Action.RETRY
    assert decision.in_doubt is in_doubt


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (401, TokenRejected),
        (422, PayloadMismatch),
        (400, ToolRejected),
        (403, ToolRejected),
        (404, ToolRejected),
        (410, ToolRejected),
    ],
)
def test_final_statuses(status: int, error: type[InvokeError]) -> None:
    """401, a reasonless 422, and other 4xx with the tool's own reason are final errors."""
    body = b'{"detail": "no"}' if status != 422 else b'{"detail": "the args_hash differs"}'
    decision = classify(answer(status, body), CTX, CFG)
    assert decision.action is Action.RAISE
    assert type(decision.error) is error
    assert decision.error.idempotency_key == CTX.idempotency_key
    assert decision.error.step == "step_001"
    assert decision.error.status_code == status
    assert decision.error.body == json.loads(body)
    assert decision.error.reason == json.loads(body)["detail"]


@pytest.mark.parametrize("status", [409, 423, 429, 500, 503, 404])
def test_replayed_non_2xx_is_final(status: int) -> None:
    """Any replayed non-2xx is the stored outcome: a final ToolError, never retried."""
    decision = classify(answer(status, Idempotent_Replayed="true"), CTX, CFG)
    assert decision.action is Action.RAISE
    assert isinstance(decision.error, ToolError)
    assert decision.error.idempotency_key == CTX.idempotency_key


def test_unretried_5xx_is_outcome_unknown() -> None:
    """A 5xx removed from retry_statuses is final, and says the step may have run."""
    cfg = ProtocolConfig(base_origin=CFG.base_origin, retry_statuses=frozenset())
    decision = classify(answer(502), CTX, cfg)
    assert isinstance(decision.error, OutcomeUnknown)


def test_redirects() -> None:
    """Same-origin 307 is followed, 303 fetched, and a foreign Location is refused."""
    assert classify(answer(307, Location="/v2/x"), CTX, CFG).action is Action.FOLLOW
    assert classify(answer(303, Location="/r/1"), CTX, CFG).action is Action.FETCH
    foreign = classify(answer(302, Location="https://evil.test/x"), CTX, CFG)
    assert isinstance(foreign.error, UnsafeRedirect)
    assert foreign.error.url == "https://evil.test/x"
    missing = classify(answer(308), CTX, CFG)
    assert isinstance(missing.error, ToolError)


def test_budget_exhausted_errors() -> None:
    """Out of budget: 409 gives StepInProgress, else OutcomeUnknown saying a resend is safe."""
    conflict = budget_exhausted(
        Decision(Action.RETRY, "c", status_code=409, in_flight=True), CTX, saw_in_doubt=True
    )
    assert isinstance(conflict, StepInProgress)
    unknown = budget_exhausted(Decision(Action.RETRY, "ReadTimeout"), CTX, saw_in_doubt=True)
    assert isinstance(unknown, OutcomeUnknown)
    assert "may have run" in str(unknown)
    assert "same key is safe" in str(unknown)
    assert shown_key(CTX.idempotency_key) in str(unknown)
    assert CTX.idempotency_key not in str(unknown)


@given(
    status=st.integers(100, 599),
    headers=st.dictionaries(
        st.sampled_from(["retry-after", "location", "idempotent-replayed", "operation-location"]),
        st.text(max_size=30),
    ),
    body=st.binary(max_size=50),
)
def test_classify_is_total(status: int, headers: dict[str, str], body: bytes) -> None:
    """Any status, header and body gives a decision; errors always carry the key."""
    decision = classify(Answer(status, headers, body, f"{BASE}/t"), CTX, CFG)
    if decision.action is Action.RAISE:
        assert decision.error is not None
        assert decision.error.idempotency_key == CTX.idempotency_key
    if decision.retry_after is not None:
        assert decision.retry_after >= 0
    if decision.replayed and not 200 <= status < 300:
        assert decision.action is Action.RAISE


# -- 202 status URL strategies --------------------------------------------------------------


def test_strategy_order() -> None:
    """Operation-Location beats Azure-AsyncOperation beats Location beats body fields."""
    full = answer(
        202,
        b'{"status_url": "/body"}',
        Operation_Location="/op",
        Azure_AsyncOperation="/az",
        Location="/loc",
    )
    assert find_status_url(full, CFG.strategies) == f"{BASE}/op"
    assert find_status_url(answer(202, Azure_AsyncOperation="/az", Location="/l"), CFG.strategies)
    assert find_status_url(answer(202, b'{"href": "/h"}'), CFG.strategies) == f"{BASE}/h"
    nested = answer(202, b'{"operation": {"url": "https://tool.test/n"}}')
    assert find_status_url(nested, CFG.strategies) == f"{BASE}/n"
    assert find_status_url(answer(202, b"not json"), CFG.strategies) is None
    assert find_status_url(answer(202, b'{"href": 3}'), CFG.strategies) is None


def test_poll_target_origins() -> None:
    """Same origin gets auth, an allowed origin gets none, anything else is refused."""
    assert poll_target(f"{BASE}/ops/1", CTX, CFG) is True
    assert poll_target("https://status.test/ops/1", CTX, CFG) is False
    with pytest.raises(UnsafeRedirect):
        poll_target("http://tool.test/ops/1", CTX, CFG)  # scheme downgrade is another origin
    with pytest.raises(UnsafeRedirect):
        poll_target("https://tool.test:8443/ops/1", CTX, CFG)


@given(host=st.from_regex(r"[a-z]{1,10}\.(test|example)", fullmatch=True))
def test_other_hosts_are_refused(host: str) -> None:
    """Every host other than the base host (and the allowed one) is refused."""
    if host in ("tool.test", "status.test"):
        return
    with pytest.raises(UnsafeRedirect):
        poll_target(f"https://{host}/ops", CTX, CFG)


def test_default_ports_are_one_origin() -> None:
    """https://h and https://h:443 are the same origin; case does not matter."""
    assert origin_of("https://Tool.TEST:443/x") == origin_of("https://tool.test/y")
    assert origin_of("ftp://tool.test") is None
    assert origin_of("/relative") is None


# -- poll states ----------------------------------------------------------------------------


def _poll(body: bytes, status: int = 200, **headers: str) -> Decision:
    return interpret_poll(answer(status, body, **headers), CTX, CFG)


@given(
    state=st.sampled_from(["succeeded", "completed", "done"]),
    flips=st.lists(st.booleans(), min_size=9, max_size=9),
)
def test_success_states_any_case(state: str, flips: list[bool]) -> None:
    """Success states are recognised in any letter case."""
    cased = "".join(c.upper() if f else c for c, f in zip(state, flips, strict=False))
    assert _poll(f'{{"status": "{cased}"}}'.encode()).action is Action.DONE


@pytest.mark.parametrize("state", ["failed", "Canceled", "CANCELLED"])
def test_failure_states(state: str) -> None:
    """Failure states raise StepFailed with the body."""
    decision = _poll(f'{{"status": "{state}"}}'.encode())
    assert isinstance(decision.error, StepFailed)
    assert decision.error.body == {"status": state}


@pytest.mark.parametrize("state", ["running", "Pending", "queued", "in_progress", "NotStarted"])
def test_running_states_wait(state: str) -> None:
    """Running states keep polling, honouring Retry-After."""
    decision = _poll(f'{{"status": "{state}"}}'.encode(), Retry_After="3")
    assert decision.action is Action.WAIT
    assert decision.retry_after == 3.0


def test_other_poll_answers() -> None:
    """No status field is done; AIP-151 done flags; 202 waits; 303 fetches; 404 is final."""
    assert _poll(b'{"id": 1}').action is Action.DONE
    assert _poll(b"").action is Action.DONE
    assert _poll(b'{"done": false}').action is Action.WAIT
    assert _poll(b'{"done": true, "response": {}}').action is Action.DONE
    assert isinstance(_poll(b'{"done": true, "error": {"code": 3}}').error, StepFailed)
    assert _poll(b"", 202).action is Action.WAIT
    assert _poll(b"", 303, Location="/r").action is Action.FETCH
    assert isinstance(_poll(b"", 404).error, ToolError)
    assert isinstance(_poll(b"", 401).error, TokenRejected)
    assert _poll(b"", 503).action is Action.WAIT
    failure = interpret_poll(Failure(FailureKind.IN_DOUBT, "ReadTimeout"), CTX, CFG)
    assert failure.action is Action.WAIT


def test_result_only_ignores_status_field() -> None:
    """After a 303, the target's answer is the result whatever its fields say."""
    decision = interpret_poll(answer(200, b'{"status": "failed"}'), CTX, CFG, result_only=True)
    assert decision.action is Action.DONE
