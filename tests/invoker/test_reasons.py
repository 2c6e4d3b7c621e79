"""The server's short reason and the dialect table: classification, cleaning, never the key."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from agentkey import KeyRejected, OutcomeUnknown, PayloadMismatch, StepInProgress, ToolRejected
from agentkey._keys import shown_key
from agentkey.client._hooks import GiveUpEvent, LoggingHook, RetryEvent
from agentkey.client._net import origin_of
from agentkey.client._policies import DEFAULT_RETRY_STATUSES
from agentkey.client._protocol import (
    Action,
    Answer,
    CallContext,
    Decision,
    Meaning,
    ProtocolConfig,
    budget_exhausted,
    classify,
    problem_code,
    short_reason,
)

from ._support import FAST_RETRY, Script, make_step, run_invoke

KEY = "plan:step_001:" + "a" * 64
CTX = CallContext(KEY, "step_001", 1)
CFG = ProtocolConfig(
    base_origin=origin_of("https://tool.test"),  # type: ignore[arg-type]
    retry_statuses=DEFAULT_RETRY_STATUSES,
)


def _classify(status: int, body: object) -> Decision:
    content = json.dumps(body).encode()
    return classify(Answer(status, {}, content, "https://tool.test/t"), CTX, CFG)


def test_reason_is_cut_cleaned_and_never_the_key() -> None:
    """A reason loses control characters and the key, and is cut to about 200 characters."""
    body = {"detail": f"bad\x1b[31m key {KEY}\n\u202eforged line " + "x" * 1000}
    reason = short_reason(body, KEY)
    assert reason is not None
    assert KEY not in reason
    assert "<key>" in reason
    assert len(reason) <= 200
    assert all(ch.isprintable() for ch in reason)
    error = _classify(400, body).error
    assert isinstance(error, ToolRejected)
    assert error.reason == reason


@pytest.mark.parametrize(
    ("body", "code", "meaning"),
    [
        (
            {"type": "urn:agentkey:problem:key_reused", "error": "key_reused"},
            "key_reused",
            Meaning.REUSED,
        ),
        ({"error": "idempotency_key_missing"}, "idempotency_key_missing", Meaning.KEY),
        ({"type": "urn:idemkit:payload-mismatch"}, "payload_mismatch", Meaning.MISMATCH),
        ({"type": "urn:idemkit:in-progress"}, "in_progress", Meaning.IN_FLIGHT),
        (
            {"error": {"type": "idempotency_error", "message": "same parameters"}},
            "idempotency_error",
            Meaning.MISMATCH,
        ),
        (
            {"error": {"type": "idempotency_error", "message": "request in progress"}},
            "idempotency_error",
            Meaning.IN_FLIGHT,
        ),
        ({"type": "https://example.com/probs/out-of-credit"}, "out_of_credit", None),
        ([1, 2], None, None),
    ],
)
def test_problem_codes(body: object, code: str | None, meaning: Meaning | None) -> None:
    """RFC 9457 types, legacy error fields and Stripe's error object map through one table."""
    assert problem_code(body) == (code, meaning)


def test_bare_400_is_key_rejected_and_reasoned_400_is_tool_rejected() -> None:
    """Only a 400 with no other reason (or a key code) blames the key."""
    assert isinstance(_classify(400, {}).error, KeyRejected)
    assert isinstance(_classify(400, {"error": "idempotency_key_invalid"}).error, KeyRejected)
    rejected = _classify(400, {"title": "Bad", "detail": "amount over limit"}).error
    assert isinstance(rejected, ToolRejected)
    assert rejected.reason == "amount over limit"
    assert "amount over limit" in str(rejected)


def test_409_mismatch_is_final_and_423_waits() -> None:
    """A mismatch 409 raises at once; 423 Locked with Retry-After is in flight."""
    assert isinstance(
        _classify(409, {"type": "urn:idemkit:payload-mismatch"}).error, PayloadMismatch
    )
    locked = classify(Answer(423, {"retry-after": "30"}, b"{}", "https://tool.test/t"), CTX, CFG)
    assert locked.action is Action.RETRY
    assert locked.in_flight
    assert locked.retry_after == 30.0


def test_give_up_messages_claim_only_what_was_seen() -> None:
    """After an in-flight answer, a final 503 never says the tool did not run the step."""
    last = Decision(Action.RETRY, "overloaded (503)", status_code=503)
    after_409 = budget_exhausted(last, CTX, saw_in_doubt=False, saw_in_flight=True)
    assert isinstance(after_409, OutcomeUnknown)
    assert "did not run" not in str(after_409)
    assert "in flight" in str(after_409)
    plain = budget_exhausted(last, CTX, saw_in_doubt=False)
    assert "did not run" not in str(plain)
    stuck = budget_exhausted(
        Decision(Action.RETRY, "in flight (409)", status_code=409, in_flight=True),
        CTX,
        saw_in_doubt=False,
    )
    assert isinstance(stuck, StepInProgress)
    assert "died" in str(stuck)


def test_first_retry_and_give_up_are_warnings(caplog: pytest.LogCaptureFixture) -> None:
    """At the default WARNING level the first retry and the give-up show, with the key only."""
    step = make_step()
    script = Script([httpx.Response(503, headers={"Retry-After": "0"}) for _ in range(3)])
    caplog.set_level(logging.WARNING, logger="agentkey")
    with pytest.raises(OutcomeUnknown):
        run_invoke(
            "sync", script, step, retry=FAST_RETRY.replace(max_attempts=3), hooks=None,
            auth=None,
        )  # fmt: skip
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(messages) == 2, messages
    assert messages[0].startswith("retrying")
    assert "attempt=1" in messages[0]
    assert messages[1].startswith("giving up")
    assert "OutcomeUnknown" in messages[1]
    assert all(shown_key(step.idempotency_key) in m for m in messages)
    assert not any(step.idempotency_key in m for m in messages)  # keys are bearer secrets


def test_logging_hook_levels() -> None:
    """Later retries log at INFO; the give-up event logs at WARNING."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log = logging.getLogger("agentkey.test-levels")
    log.addHandler(Keep())
    log.setLevel(logging.DEBUG)
    hook = LoggingHook(log)
    hook(RetryEvent(KEY, "step_001", 2, "ReadTimeout", 0.1, None))
    hook(GiveUpEvent(KEY, "step_001", 3, 0, "ReadTimeout", "OutcomeUnknown"))
    assert [r.levelno for r in records] == [logging.INFO, logging.WARNING]


HOSTILE_URLS = [
    "data:text/plain,hi",
    "https:evil",
    "https://[zz]/",
    "http://[::1",
    "https://ex\u00e4mple.test/",
    "/ops/\u00e4",
    "https://tool.test:99999/",
    "javascript:alert(1)",
    "//evil.test/x",
]


@pytest.mark.parametrize("url", HOSTILE_URLS)
@pytest.mark.parametrize("status", [202, 303, 307])
def test_hostile_urls_give_typed_errors(url: str, status: int) -> None:
    """Unparseable or foreign URLs never raise raw errors; any URL kept is sendable."""
    from agentkey import InvokeError
    from agentkey.client._protocol import interpret_poll, poll_target

    reply = Answer(status, {"location": url}, b"{}", "https://tool.test/t")
    for decision in (classify(reply, CTX, CFG), interpret_poll(reply, CTX, CFG)):
        if decision.action is Action.RAISE:
            assert decision.error is not None
            assert decision.error.idempotency_key == KEY
            continue
        if decision.url is None:
            continue
        assert decision.url.isascii()
        if origin_of(decision.url) != CFG.base_origin:
            with pytest.raises(InvokeError, match=r"accepted the step \(202\)") as caught:
                poll_target(decision.url, CTX, CFG)
            assert caught.value.idempotency_key == KEY
