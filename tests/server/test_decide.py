"""The server's decision table, pure: every branch of check_request, on_claimed and on_finished."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkey import InvalidKey, StepKey, StoreError, StoreUnavailable, canonical_json
from agentkey._keys import MAX_KEY_LENGTH
from agentkey.server._decide import (
    Checked,
    Complete,
    Conflict,
    Fail,
    OpaqueKey,
    Reject,
    Release,
    Replay,
    Run,
    Unavailable,
    _parse_key,
    check_request,
    on_claimed,
    on_finished,
    parse_key,
)
from agentkey.server._records import (
    Binding,
    StoredOutcome,
    decode_record,
    digest,
    encode_in_progress,
    encode_outcome,
)

ARGS = {"amount": 100, "currency": "EUR"}
BODY = json.dumps(ARGS, sort_keys=True, separators=(",", ":")).encode()
KEY = StepKey.build("plan-1", 3, ARGS)
OP = ("POST", "/tools/charge")
OWNER, OTHER = "a" * 32, "b" * 32


def _checked(key: str = KEY.format(), op: tuple[str, ...] = OP, body: bytes = BODY) -> Checked:
    checked = check_request([key.encode()], op, body)
    assert isinstance(checked, Checked)
    return checked


@pytest.mark.parametrize(
    ("values", "body", "status", "code"),
    [
        (None, BODY, 400, "idempotency_key_missing"),
        ([], BODY, 400, "idempotency_key_missing"),
        ([KEY.format().encode()] * 2, BODY, 400, "idempotency_key_invalid"),
        (["plan-1:step_3:" + "0" * 64], BODY, 400, "idempotency_key_invalid"),  # not padded
        (["kéy"], BODY, 400, "idempotency_key_invalid"),
        ([b"x" * 400], BODY, 400, "idempotency_key_invalid"),
        ([KEY.format()], b"[1]", 400, "body_not_json"),
        ([KEY.format()], b"{", 400, "body_not_json"),
        ([KEY.format()], b'{"amount":NaN}', 400, "body_not_json"),
        ([KEY.format()], b'{"amount":100,"amount":100,"currency":"EUR"}', 400, "body_not_json"),
        ([KEY.format()], b'{"amount":101,"currency":"EUR"}', 422, "args_hash_mismatch"),
    ],
)
def test_check_request_rejects(
    values: list[bytes | str] | None, body: bytes, status: int, code: str
) -> None:
    """Each malformed key or body is refused with its status and problem code, before any claim."""
    result = check_request(values, OP, body)
    assert isinstance(result, Reject)
    assert (result.status, result.code) == (status, code)
    doc = json.loads(result.body)
    assert doc["error"] == code
    assert doc["type"] == f"urn:agentkey:problem:{code}"
    assert ("content-type", "application/problem+json") in result.headers


@pytest.mark.parametrize(
    "body",
    [
        BODY,  # the canonical bytes themselves
        b'{ "currency": "EUR", "amount": 100 }',  # equivalent JSON: re-serialised
    ],
)
@pytest.mark.parametrize("style", ["raw", "sf-string"])
def test_check_request_accepts_an_agentkey_key(body: bytes, style: str) -> None:
    """A body hashing to args_hash (as bytes or re-serialised) is checked, in both header styles."""
    result = check_request([KEY.header_value(style)], OP, body)  # type: ignore[arg-type]
    assert isinstance(result, Checked)
    assert result.key == KEY
    assert result.binding == Binding(digest(b"POST /tools/charge"))
    assert result.record_key("alice") == "alice:" + KEY.format()


def test_key_format_agentkey_refuses_opaque_keys() -> None:
    """key_format='agentkey' answers 400 for a UUID key, 'any' binds it to the body's digest."""
    refused = check_request(["ik_123"], OP, BODY, key_format="agentkey")
    assert isinstance(refused, Reject)
    assert refused.code == "idempotency_key_invalid"
    opaque = check_request(["ik_123"], OP, BODY)
    assert isinstance(opaque, Checked)
    assert opaque.key == OpaqueKey("ik_123")
    assert opaque.binding.body is not None


@pytest.mark.parametrize(
    ("one", "two", "same_bytes", "same_canonical"),
    [
        (b'{"a":1,"b":2}', b'{ "b": 2, "a": 1 }', False, True),  # equivalent JSON
        (b'{"a":1}', b'{"a":2}', False, False),
        (b'{"a":1}', b'{"a":1}', True, True),
        (b"not json", b"not json", True, True),  # bound by its bytes
        (b'{"a":1,"a":2}', b'{"a":2}', False, False),  # a repeated name: bound by its bytes
    ],
)
def test_opaque_key_body_fingerprint(
    one: bytes, two: bytes, same_bytes: bool, same_canonical: bool
) -> None:
    """An opaque key's fingerprint is its bytes' digest; with "canonical", equivalent JSON's."""
    by_bytes = [_fingerprinted(body, "bytes") for body in (one, two)]
    by_canonical = [_fingerprinted(body, "canonical") for body in (one, two)]
    assert (by_bytes[0].binding == by_bytes[1].binding) is same_bytes
    assert (by_canonical[0].binding == by_canonical[1].binding) is same_canonical
    # A record written under the other kind: compared by that kind, so a canonical record
    # (an older version's) matches equivalent JSON; a bytes record, the same bytes only.
    assert by_bytes[0].same_body(by_canonical[1].binding.body) is same_canonical
    assert by_canonical[0].same_body(by_bytes[1].binding.body) is same_bytes


def _fingerprinted(body: bytes, kind: str) -> Checked:
    checked = check_request(["ik_1"], OP, body, body_fingerprint=kind)  # type: ignore[arg-type]
    assert isinstance(checked, Checked)
    return checked


def test_non_http_front_end_binds_the_tool_name() -> None:
    """An MCP front end binds ("tools/call", tool): another tool is another operation."""
    charge = _checked(op=("tools/call", "charge"))
    refund = _checked(op=("tools/call", "refund"))
    assert charge.binding.route != refund.binding.route != _checked().binding.route


def _outcome(binding: Binding | None, state: str = "COMPLETED") -> bytes:
    return encode_outcome(
        StoredOutcome(
            state,  # type: ignore[arg-type]
            201,
            (("content-type", "application/json"),),
            b'{"ok":1}',
            None,
            5,
            binding,
        )
    )


def _progress(owner: str, binding: Binding | None, renew_ms: int = 5_000) -> bytes:
    return encode_in_progress(owner, 0, lease_end_ms=15_000, renew_ms=renew_ms, binding=binding)


CHECKED = _checked()
OPAQUE = _checked("ik_1")


@pytest.mark.parametrize(
    ("existing", "checked", "expected", "code"),
    [
        (None, CHECKED, Run(), None),
        (_progress(OWNER, CHECKED.binding), CHECKED, Run(renew=True), None),
        (_progress(OTHER, CHECKED.binding), CHECKED, Conflict, "in_progress"),
        (_progress(OTHER, Binding(digest(b"POST /other"))), CHECKED, Reject, "key_reused"),
        (_outcome(CHECKED.binding), CHECKED, Replay, None),
        (_outcome(CHECKED.binding, "FAILED"), CHECKED, Replay, None),
        (_outcome(None), CHECKED, Replay, None),  # a v1 record carries no binding
        (_outcome(Binding(digest(b"GET /tools/charge"))), CHECKED, Reject, "key_reused"),
        (_outcome(Binding(OPAQUE.binding.route, "A" * 22)), OPAQUE, Reject, "payload_mismatch"),
        (b"something else wrote this", CHECKED, Unavailable, "not_run"),
        (StoreUnavailable("redis down"), CHECKED, Unavailable, "not_run"),
        (StoreError("redis broke"), CHECKED, Unavailable, "not_run"),
    ],
)
def test_on_claimed(
    existing: bytes | StoreError | None, checked: Checked, expected: object, code: str | None
) -> None:
    """Each store answer to a claim maps to run, replay, 409, 422 or 503."""
    result = on_claimed(existing, checked, owner=OWNER, now_ms=1_000, retry_after=2)
    if isinstance(expected, Run):
        assert result == expected
        return
    assert isinstance(result, expected)  # type: ignore[arg-type]
    if isinstance(result, Replay):
        assert isinstance(existing, bytes)
        assert result.outcome == decode_record(existing, key="k")
        assert (result.status, result.body, result.blob_uri) == (201, b'{"ok":1}', None)
        return
    assert isinstance(result, (Reject, Conflict, Unavailable))
    assert result.code == code
    assert json.loads(result.body)["error"] == code
    if isinstance(result, (Conflict, Unavailable)):
        assert ("retry-after", "2") in result.headers
    if isinstance(result, Unavailable):
        assert result.cause  # for the log; never in the body
        assert "redis" not in result.body.decode()


def test_conflict_says_when_a_stalled_lease_ends() -> None:
    """A holder that stopped renewing: the 409 waits until its lease ends, and says so."""
    stalled = _progress(OTHER, CHECKED.binding)
    result = on_claimed(stalled, CHECKED, owner=OWNER, now_ms=9_000, retry_after=1)
    assert isinstance(result, Conflict)
    assert result.retry_after == 6
    assert json.loads(result.body)["lease_expires_in"] == 6


HEADERS = [(b"content-type", b"application/json"), (b"set-cookie", b"s=1"), (b"date", b"x")]


@pytest.mark.parametrize(
    ("status", "error", "mutated", "expected", "stored_status"),
    [
        (201, False, False, Complete, 201),
        (303, False, True, Complete, 303),
        (404, False, False, Complete, 404),
        (500, False, False, Release, None),
        (401, False, False, Release, None),
        (429, False, True, Fail, 429),
        (503, False, True, Fail, 503),
        (0, True, False, Release, None),
        (201, True, True, Fail, 500),  # raised after its side effect began
    ],
)
def test_on_finished(
    status: int, error: bool, mutated: bool, expected: type, stored_status: int | None
) -> None:
    """The storage rule: storable answers complete, others fail once mutated, else release."""
    result = on_finished(
        status,
        HEADERS,
        b'{"ok":1}',
        error=error,
        mutation_started=mutated,
        binding=CHECKED.binding,
        now_ms=7,
        max_inline_bytes=1000,
    )
    assert type(result) is expected
    if isinstance(result, (Complete, Fail)):
        outcome = result.outcome
        assert outcome.status == stored_status
        assert outcome.binding == CHECKED.binding
        assert outcome.finished_ms == 7
        assert not result.offload
        names = {name for name, _ in outcome.headers}
        assert "set-cookie" not in names
        assert "date" not in names
        if error:
            assert json.loads(outcome.body)["error"] == "step_failed"


def test_on_finished_offloads_a_large_body() -> None:
    """A body over max_inline_bytes is marked for the blob store."""
    result = on_finished(
        200,
        [],
        b"x" * 101,
        error=False,
        mutation_started=True,
        binding=None,
        now_ms=0,
        max_inline_bytes=100,
    )
    assert isinstance(result, Complete)
    assert result.offload


def test_a_body_hashing_as_bytes_or_reserialised_is_checked() -> None:
    """Canonical bytes pass as they are; the same JSON plus a space passes re-serialised."""
    body = json.dumps({"b": [1, {"c": None}], "a": "é"}, sort_keys=True, separators=(",", ":"))
    raw = body.encode()
    key = StepKey("p", (0,), hashlib.sha256(raw).hexdigest())
    assert isinstance(check_request([key.format()], OP, raw), Checked)
    assert isinstance(check_request([key.format()], OP, raw + b" "), Checked)  # re-serialised


@given(
    st.from_regex(
        r"[A-Za-z0-9._~:-]{1,70}:step_[0-9]{1,5}(\.[0-9]{1,5}){0,40}:[0-9a-f]{63,65}",
        fullmatch=True,
    )
)
def test_the_one_match_key_parser_agrees_with_stepkey_parse(text: str) -> None:
    """The server's one-regex parse of a raw key gives exactly StepKey.parse's key or refusal
    (a key of other than three parts does not claim agentkey's format: it is opaque)."""
    try:
        expected: StepKey | None = StepKey.parse(text)
    except InvalidKey:
        expected = None
    got = _parse_key([text.encode()])
    if expected is not None:
        assert got == expected
    elif len(text.split(":")) == 3:  # the middle is a step_ label: agentkey's, malformed
        assert isinstance(got, str)
    elif len(text) <= MAX_KEY_LENGTH:
        assert got == OpaqueKey(text)
    else:
        assert isinstance(got, str)  # too long for any key


#: What an app's header bytes decode to, without CR, LF and NUL (a record holding them is
#: refused: tests/server/test_stores.py).
_HEADER_TEXT = st.text(
    st.characters(max_codepoint=0xFF, exclude_characters="\r\n\x00"), max_size=20
)


@given(
    status=st.integers(100, 599),
    headers=st.lists(st.tuples(_HEADER_TEXT, _HEADER_TEXT), max_size=4),
    body=st.binary(max_size=40),
    blob=st.none() | st.text(max_size=30),
    finished=st.integers(0, 2**53),
    binding=st.none() | st.just(Binding("r" * 22)) | st.just(Binding("r" * 22, "b" * 22)),
    state=st.sampled_from(["COMPLETED", "FAILED"]),
)
def test_a_record_head_is_the_json_the_generic_encoder_writes_and_decodes_back(
    status: int,
    headers: list[tuple[str, str]],
    body: bytes,
    blob: str | None,
    finished: int,
    binding: Binding | None,
    state: str,
) -> None:
    """The hand-formatted record head is byte for byte json.dumps's, and round-trips."""
    outcome = StoredOutcome(state, status, tuple(headers), body, blob, finished, binding)  # type: ignore[arg-type]
    doc: dict[str, object] = {
        "v": 3,
        "status": status,
        "headers": [list(h) for h in headers],
        "finished_ms": finished,
    }
    if blob is not None:
        doc["blob"] = blob
    if binding is not None:
        doc["fp"] = binding.encode()
    expected = json.dumps(doc, separators=(",", ":")).encode("ascii")
    encoded = encode_outcome(outcome)
    assert encoded == (b"C:" if state == "COMPLETED" else b"F:") + expected + b"\n" + body
    assert decode_record(encoded, key="k") == outcome


@given(
    plan=st.text(st.sampled_from("Ab9._~-"), min_size=1, max_size=64),
    index=st.lists(st.integers(0, 10**6), min_size=1, max_size=40),
    digest=st.text(st.sampled_from("0123456789abcdef"), min_size=64, max_size=64),
)
def test_the_fast_key_parse_equals_step_key_parse(plan: str, index: list[int], digest: str) -> None:
    """The middleware's one-regex parse gives StepKey.parse's key, or a 400 where it refuses."""
    label = "step_" + ".".join(f"{i:03d}" for i in index)
    text = f"{plan}:{label}:{digest}"
    try:
        expected: StepKey | None = StepKey.parse(text)
    except InvalidKey:
        expected = None
    parsed = parse_key([text.encode()])
    if expected is None:
        assert isinstance(parsed, Reject)
    else:
        assert parsed == expected
        assert isinstance(parsed, StepKey)
        assert parsed.format() == text


def test_an_mcp_record_of_the_previous_version_replays() -> None:
    """An MCP call (canonical bytes of its arguments) replays a record stored under the
    previous version's canonical fingerprint, and never one of other arguments."""
    op = ("tools/call", "charge")
    arguments = {"currency": "eur", "amount": 5}
    body = canonical_json(arguments)
    checked = check_request(["ik_mcp"], op, body)
    assert isinstance(checked, Checked)
    old = Binding(checked.binding.route, digest(b"json:" + body))  # what it stored
    assert checked.binding != old  # the new fingerprint digests the bytes
    replay = on_claimed(_outcome(old), checked, owner=OWNER, now_ms=1_000, retry_after=1)
    assert isinstance(replay, Replay)
    other = Binding(old.route, digest(b"json:" + canonical_json({**arguments, "amount": 6})))
    refused = on_claimed(_outcome(other), checked, owner=OWNER, now_ms=1_000, retry_after=1)
    assert isinstance(refused, Reject)
    assert refused.code == "payload_mismatch"
