"""The dialect table: what each idempotent server's refusals mean, read from its exact bytes.

Each row is an answer a real server sends (its status, headers and body, copied from
the release named), and the one reading agentkey must give it. The suites beside this
file prove the same readings on the wire against the peers that install here; these
rows also cover the ones that do not (idemgate pins redis-py below 8).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from agentkey import (
    InvokeError,
    KeyRejected,
    KeyReused,
    PayloadMismatch,
    StepInProgress,
    ToolRejected,
)
from agentkey._keys import StepKey, uuid_key
from agentkey.client._net import origin_of
from agentkey.client._policies import DEFAULT_RETRY_STATUSES
from agentkey.client._protocol import (
    Action,
    Answer,
    CallContext,
    Meaning,
    ProtocolConfig,
    classify,
    problem_code,
    replay_header,
    replay_markers,
)

BASE = "https://tool.test"
CFG = ProtocolConfig(
    base_origin=origin_of(BASE),  # type: ignore[arg-type]
    retry_statuses=DEFAULT_RETRY_STATUSES,
)
KEY = StepKey.build("plan-1", 3, {"amount": 5})
CTX = CallContext(KEY.format(), KEY.label, 1)


@dataclass(frozen=True)
class Row:
    """One answer a peer sends, and what it means."""

    peer: str
    status: int
    body: object
    error: type[InvokeError] | None  # None: "in flight", resend the same key
    meaning: Meaning | None = None


# fmt: off
ROWS = [
    # idemgate 0.1.0: {"error": {"code", "message"}}, 409 for another body
    Row("idemgate", 409, {"error": {"code": "idempotency_key_reused", "message": "The Idempotency-Key was used for a different request."}}, PayloadMismatch, Meaning.MISMATCH),  # noqa: E501
    Row("idemgate", 409, {"error": {"code": "idempotency_in_progress", "message": "An identical request is still processing."}}, None, Meaning.IN_FLIGHT),  # noqa: E501
    Row("idemgate", 400, {"error": {"code": "invalid_idempotency_key", "message": "The Idempotency-Key header is invalid."}}, KeyRejected, Meaning.KEY),  # noqa: E501
    Row("idemgate", 400, {"error": {"code": "missing_idempotency_key", "message": "An Idempotency-Key header is required."}}, KeyRejected, Meaning.KEY),  # noqa: E501
    # asgi-idempotency-header 0.2.0: {"detail": ...}
    Row("asgi-idempotency-header", 422, {"detail": "'Idempotency-Key' header value must be formatted as a v4 UUID"}, KeyRejected, Meaning.KEY),  # noqa: E501
    Row("asgi-idempotency-header", 409, {"detail": f"Request already pending for idempotency key '{KEY}'"}, None, Meaning.IN_FLIGHT),  # noqa: E501
    # drf-idempotency 1.0.0: {"detail": ...}
    Row("drf-idempotency", 400, {"detail": "Invalid Idempotency-Key: must contain only letters, digits, and '-._~:' characters"}, KeyRejected, Meaning.KEY),  # noqa: E501
    Row("drf-idempotency", 400, {"detail": "This request requires an Idempotency-Key header."}, KeyRejected, Meaning.KEY),  # noqa: E501
    Row("drf-idempotency", 422, {"detail": f"The Idempotency-Key '{KEY}' was previously used with a different request. Use a new key for a different request body."}, PayloadMismatch, Meaning.MISMATCH),  # noqa: E501
    Row("drf-idempotency", 409, {"detail": f"A request with Idempotency-Key '{KEY}' is already being processed. Retry after it completes."}, None, Meaning.IN_FLIGHT),  # noqa: E501
    # ichido 0.1.0: {"error": <code>, "message": ...}
    Row("ichido", 422, {"error": "fingerprint_mismatch", "message": f"Idempotency key '{KEY}' was already used with different request parameters. Each key must be used with identical requests."}, PayloadMismatch, Meaning.MISMATCH),  # noqa: E501
    Row("ichido", 409, {"error": "request_in_progress", "message": f"A request with idempotency key '{KEY}' is currently being processed. Please retry later."}, None, Meaning.IN_FLIGHT),  # noqa: E501
    Row("ichido", 409, {"error": "conflict", "message": "Idempotency key state is inconsistent. Please retry."}, None),  # noqa: E501
    # fastapi-idempotency-key 0.1.1
    Row("fastapi-idempotency-key", 409, {"detail": "A request with this idempotency key is currently in progress."}, None, Meaning.IN_FLIGHT),  # noqa: E501
    Row("fastapi-idempotency-key", 422, {"detail": "Idempotency key was previously used with a different request payload."}, PayloadMismatch, Meaning.MISMATCH),  # noqa: E501
    Row("fastapi-idempotency-key", 400, {"detail": "Idempotency-Key header is required."}, KeyRejected, Meaning.KEY),  # noqa: E501
    # fastidempotent 0.1.0
    Row("fastidempotent", 422, {"detail": "Request payload does not match the original request for this idempotency key"}, PayloadMismatch, Meaning.MISMATCH),  # noqa: E501
    Row("fastidempotent", 409, {"detail": "A request with this idempotency key is already being processed"}, None, Meaning.IN_FLIGHT),  # noqa: E501
    Row("fastidempotent", 400, {"detail": "Idempotency key exceeds maximum length of 256 characters"}, KeyRejected, Meaning.KEY),  # noqa: E501
    # fastapi-idempotency 0.1.1: every key problem is a 422
    Row("fastapi-idempotency", 422, {"detail": "Idempotency-Key must be 1 to 255 characters long."}, KeyRejected, Meaning.KEY),  # noqa: E501
    Row("fastapi-idempotency", 422, {"detail": f"Idempotency-Key '{KEY}' was already used for a different request."}, PayloadMismatch, Meaning.MISMATCH),  # noqa: E501
    Row("fastapi-idempotency", 409, {"detail": f"A request with idempotency key '{KEY}' is still being processed."}, None, Meaning.IN_FLIGHT),  # noqa: E501
    # agentkey's own middleware and idemkit (their table rows, unchanged)
    Row("agentkey", 422, {"type": "urn:agentkey:problem:key_reused", "error": "key_reused"}, KeyReused, Meaning.REUSED),  # noqa: E501
    Row("idemkit", 423, {"type": "urn:idemkit:in-progress"}, None, Meaning.IN_FLIGHT),
    # A tool's own refusals that mention no idempotency stay the tool's
    Row("a tool", 400, {"detail": "Invalid API key"}, ToolRejected),
    Row("a tool", 422, {"detail": [{"loc": ["body", "amount"], "msg": "field required"}]}, ToolRejected),  # noqa: E501
]
# fmt: on


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r.peer}-{r.status}")
def test_each_peer_answer_is_read_right(row: Row) -> None:
    """Each peer's refusal means what its server says: mismatch, key, or in flight."""
    body = json.dumps(row.body).encode()
    _, meaning = problem_code(row.body)
    assert meaning is row.meaning
    decision = classify(Answer(row.status, {}, body, f"{BASE}/tools/x"), CTX, CFG)
    if row.error is None:
        assert decision.action is Action.RETRY
        assert decision.in_flight
        return
    assert decision.action is Action.RAISE
    assert type(decision.error) is row.error, decision.error
    assert decision.error.idempotency_key == KEY.format()


@pytest.mark.parametrize("status", [409, 422])
def test_a_key_problem_is_never_in_flight(status: int) -> None:
    """A 409 or 422 that names a key problem is final at once, never waited out."""
    bodies = ({"error": {"code": "idempotency_key_reused"}}, {"detail": "Invalid Idempotency-Key"})
    for body in bodies:
        decision = classify(Answer(status, {}, json.dumps(body).encode(), BASE), CTX, CFG)
        assert decision.action is Action.RAISE
        assert not decision.in_flight
        assert not isinstance(decision.error, StepInProgress)


def test_key_rejected_carries_the_servers_reason() -> None:
    """KeyRejected keeps the server's reason and suggests the uuid key style."""
    body = {"detail": "'Idempotency-Key' header value must be formatted as a v4 UUID"}
    decision = classify(Answer(422, {}, json.dumps(body).encode(), BASE), CTX, CFG)
    error = decision.error
    assert isinstance(error, KeyRejected)
    assert error.reason == body["detail"]
    assert "'uuid'" in str(error)
    assert body["detail"] in str(error)


def test_a_uuid_key_echoed_by_the_server_is_not_shown() -> None:
    """A server that echoes the key as sent in the uuid style never gets it into a message."""
    sent = uuid_key(KEY.format())
    body = {"detail": f"Request already pending for idempotency key '{sent}'"}
    answer = Answer(400, {}, json.dumps(body).encode(), BASE)
    error = classify(answer, CTX, CFG).error
    assert error is not None
    assert sent not in str(error)
    assert error.reason is not None
    assert sent not in error.reason


def test_a_named_header_value_marks_a_replay() -> None:
    """`Name: value` entries mark a replay by that value only (ichido's `X-Ichido-Status`)."""
    names = ("X-Ichido-Status: replayed",)
    replayed = Answer(201, {"x-ichido-status": "Replayed"}, b"{}", BASE)
    executed = Answer(201, {"x-ichido-status": "executed"}, b"{}", BASE)
    assert replay_header(replayed, names) == "X-Ichido-Status: replayed"
    assert replay_header(executed, names) is None
    assert replay_header(Answer(201, {"x-ichido-status": "true"}, b"", BASE), names) is None


@pytest.mark.parametrize("entry", ["", "Bad Name", "X-A:", "X:\x00", "a" * 65])
def test_bad_replay_entries_are_refused(entry: str) -> None:
    """A replay entry that is no header name (or names no value) is refused, not ignored."""
    with pytest.raises(ValueError, match="not a replay header entry"):
        replay_markers((entry,))
