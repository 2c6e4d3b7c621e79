"""Plan sessions and steps: where the runtime builds keys."""

from __future__ import annotations

import hashlib
import json
import re
import traceback
import uuid
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from agentkey import (
    ConfigurationError,
    InvalidArguments,
    InvalidKey,
    PlanSession,
    Step,
    StepKey,
    StepRepeated,
    canonical_json,
)
from agentkey._keys import AGENTKEY_NAMESPACE

_VALID_ID = re.compile(r"[A-Za-z0-9._~-]{1,64}")


class Provision(BaseModel):
    region: str
    storage_gb: int


def test_new_session_id_is_uuid4() -> None:
    """PlanSession.new() uses a lowercase hyphenated UUID4."""
    plan = PlanSession.new()
    assert str(uuid.UUID(plan.id)) == plan.id
    assert uuid.UUID(plan.id).version == 4


def test_step_key_matches_build() -> None:
    """A step's key equals StepKey.build().format() of the same plan, index and arguments."""
    plan = PlanSession.new()
    step = plan.step((2, 1), "provision", {"region": "eu-west-1", "storage_gb": 10})
    assert (
        step.idempotency_key
        == StepKey.build(plan.id, (2, 1), {"storage_gb": 10, "region": "eu-west-1"}).format()
    )
    assert step.key == StepKey.parse(step.idempotency_key)
    assert step.label == "step_002.001"
    assert step.body == canonical_json(step.args)


def test_json_round_trip_keeps_keys() -> None:
    """A session restored from JSON after a restart produces the same keys."""
    plan = PlanSession.new(profile="jcs")
    before = plan.step(7, "charge", {"amount_cents": 1250, "currency": "EUR"})
    restored = PlanSession.from_json(plan.to_json())
    assert restored == plan
    after = restored.step(7, "charge", {"currency": "EUR", "amount_cents": 1250})
    assert after.idempotency_key == before.idempotency_key


def test_step_json_round_trip() -> None:
    """A Step itself can be persisted and restored with the same key."""
    step = PlanSession.new().step(1, "t", {"a": [1, 2]})
    assert Step.model_validate_json(step.model_dump_json()).idempotency_key == step.idempotency_key


@pytest.mark.parametrize(
    ("external", "kept"),
    [
        ("thread-42", True),
        ("a" * 64, True),
        ("thread:42", False),
        ("a" * 65, False),
        ("ünïcode", False),
        ("thread-\udc80", False),  # a lone surrogate (from a lenient JSON decoder)
    ],
)
def test_external_ids(external: str, kept: bool) -> None:
    """A valid external id is used as is; any other maps to a stable UUIDv5."""
    plan = PlanSession.from_external_id(external)
    if kept:
        assert plan.id == external
    else:
        assert uuid.UUID(plan.id).version == 5
        assert PlanSession.from_external_id(external).id == plan.id


@given(st.text(min_size=1).filter(lambda s: not _VALID_ID.fullmatch(s)))
def test_external_ids_map_exactly_like_uuid5(external: str) -> None:
    """The mapping of an invalid external id is uuid.uuid5 under agentkey's namespace."""
    assert PlanSession.from_external_id(external).id == str(
        uuid.uuid5(AGENTKEY_NAMESPACE, external)
    )


@pytest.mark.parametrize(
    "saved",
    [
        '{"id": "a:b"}',
        '{"id": "ok", "profile": "xml"}',
        '{"id": 7}',
        "nonsense",
        '{"id": "ok", "x": 1}',
        "[]",
        b"\xff",
        '{"id": "ok", "steps": {}}',
        '{"id": "ok", "steps": [[[1], "t", "not-a-hash"]]}',
        '{"id": "ok", "steps": [[[-1], "t", "' + "a" * 64 + '"]]}',
        '{"id": "ok", "steps": [[[1], "a", "' + "a" * 64 + '"], [[1], "b", "' + "b" * 64 + '"]]}',
    ],
)
def test_restoring_a_corrupt_session_raises_configuration_error(saved: str | bytes) -> None:
    """A corrupt saved session raises agentkey's ConfigurationError, not pydantic's error."""
    with pytest.raises(ConfigurationError, match="saved plan session is not valid"):
        PlanSession.from_json(saved)


class Card(BaseModel):
    number: str
    cvc: int


def test_args_model_rejection_does_not_chain_the_rejected_values() -> None:
    """A rejected argument's value appears nowhere in the error, its cause or its traceback."""
    plan = PlanSession.new(args_models={"charge": Card})
    number, cvc = "4111" * 4, "no" + "t-a-number"  # never spelled out in this source
    with pytest.raises(InvalidArguments) as info:
        plan.step(0, "charge", {"number": number, "cvc": cvc})
    shown = "".join(traceback.format_exception(info.value))
    assert number not in shown
    assert cvc not in shown
    assert info.value.__cause__ is None


def test_args_model_normalises_before_hashing() -> None:
    """With an args model, "20" and 20 give one key when the schema says int."""
    plan = PlanSession.new(args_models={"provision": Provision})
    a = plan.step(1, "provision", {"region": "r", "storage_gb": "20"})
    b = plan.step(1, "provision", {"region": "r", "storage_gb": 20})
    assert a.idempotency_key == b.idempotency_key
    assert a.args == {"region": "r", "storage_gb": 20}
    # without the model the two are different operations
    raw = PlanSession(id=plan.id)
    assert raw.step(1, "provision", {"region": "r", "storage_gb": "20"}).idempotency_key != (
        a.idempotency_key
    )


def test_per_step_args_model_wins() -> None:
    """args_model= on one step normalises that step even without a registry."""
    plan = PlanSession.new()
    step = plan.step(0, "x", {"region": "r", "storage_gb": "5"}, args_model=Provision)
    assert step.args["storage_gb"] == 5


def test_args_model_rejection_names_the_field() -> None:
    """Arguments the model rejects raise InvalidArguments with the field's path."""
    plan = PlanSession.new(args_models={"provision": Provision})
    with pytest.raises(InvalidArguments) as info:
        plan.step(4, "provision", {"region": "r", "storage_gb": "lots"})
    assert info.value.path == "args.storage_gb"
    assert "step_004" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"id": "a:b"}, InvalidKey),
        ({"id": ""}, InvalidKey),
        ({"id": "x" * 65}, InvalidKey),
        ({"id": "ok", "profile": "xml"}, ConfigurationError),
        ({"id": "ok", "args_models": {"t": dict}}, ConfigurationError),
    ],
)
def test_bad_sessions(kwargs: dict[str, Any], error: type[Exception]) -> None:
    """Bad ids, profiles and args models raise agentkey's typed errors, not pydantic's."""
    with pytest.raises(error):
        PlanSession(**kwargs)


@pytest.mark.parametrize(
    ("index", "tool", "args", "error"),
    [
        (-1, "t", {}, InvalidKey),
        (1, "", {}, ConfigurationError),
        (1, ["not", "hashable"], {}, ConfigurationError),
        (1, "t", ["not", "an", "object"], InvalidArguments),
        (1, "t", {"price": float("nan")}, InvalidArguments),
        (1, "t", {"tags": {"a"}}, InvalidArguments),
    ],
)
def test_bad_steps(index: Any, tool: Any, args: Any, error: type[Exception]) -> None:
    """Bad indexes, tool names and arguments fail when the step is built, before any call."""
    with pytest.raises(error):
        PlanSession.new().step(index, tool, args)


def test_step_is_immutable() -> None:
    """A step cannot be changed after its key exists."""
    step = PlanSession.new().step(1, "t", {"a": 1})
    with pytest.raises(ValueError, match="frozen"):
        step.tool = "other"  # type: ignore[misc]


def test_one_index_is_never_given_to_two_tools() -> None:
    """Step 3 for charge, then for refund: refused, naming the step, both tools and the fix."""
    plan = PlanSession.new()
    plan.step(3, "charge", {"amount": 5})
    assert plan.step(3, "charge", {"amount": 7}).label == "step_003"  # a replan: same tool
    for session in (plan, PlanSession.from_json(plan.to_json())):
        with pytest.raises(ConfigurationError) as caught:
            session.step(3, "refund", {"amount": 5})
        message = str(caught.value)
        assert all(part in message for part in ("step_003", "'charge'", "'refund'", "own step"))


def test_repeated_call_follows_on_repeat_and_survives_a_restore() -> None:
    """The same tool and args at another index: replay the earlier step, raise, or allow."""
    plan = PlanSession.new()
    first = plan.step(0, "charge", {"amount": 5})
    restored = PlanSession.from_json(plan.to_json())
    again = restored.step(4, "charge", {"amount": 5})
    assert again.repeat_of == "step_000"
    assert again.idempotency_key == first.idempotency_key
    with pytest.raises(StepRepeated) as caught:
        restored.step(5, "charge", {"amount": 5}, on_repeat="raise")
    assert (caught.value.previous_step, caught.value.idempotency_key) == (
        "step_000",
        first.idempotency_key,
    )
    allowed = restored.step(6, "charge", {"amount": 5}, on_repeat="allow")
    assert (allowed.label, allowed.repeat_of) == ("step_006", None)
    assert restored.step(1, "charge", {"amount": 6}).repeat_of is None  # other args: new
    with pytest.raises(ConfigurationError, match="on_repeat"):
        restored.step(7, "charge", {"amount": 5}, on_repeat="twice")  # type: ignore[arg-type]


def test_saved_session_round_trips_as_text_or_object() -> None:
    """from_json takes the string, the parsed object, or to_dict(); old saves still load."""
    plan = PlanSession.new()
    plan.step((2, 1), "charge", {"amount": 5})
    text = plan.to_json()
    for saved in (text, text.encode(), json.loads(text), plan.to_dict()):
        assert PlanSession.from_json(saved) == plan
    assert PlanSession.from_dict(plan.to_dict()) == plan
    old = PlanSession.from_json('{"id": "run-7", "profile": "python"}')  # saved before steps
    assert old.step(0, "charge", {}).idempotency_key.startswith("run-7:step_000:")


@given(
    st.dictionaries(
        st.text(max_size=6),
        st.integers(-(2**53) + 1, 2**53 - 1)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=6),
    ),
    st.sampled_from(["python", "jcs"]),
)
def test_plan_steps_equal_validated_steps(args: dict[str, Any], profile: Any) -> None:
    """A step the plan builds on its fast path is the step Step(...) validates, field for field."""
    plan = PlanSession(id="plan-1", profile=profile)
    made = plan.step((4, 2), "provision", args)
    checked = Step(
        plan_session_id="plan-1", index=(4, 2), tool="provision", args=args, profile=profile
    )
    assert made == checked
    assert made.model_dump() == checked.model_dump()
    assert made.model_fields_set == checked.model_fields_set
    assert (made.body, made.key, made.idempotency_key) == (
        checked.body,
        checked.key,
        checked.idempotency_key,
    )
    replay = plan.step(5, "provision", args)  # same call at another index: answered by 4.2
    assert replay.repeat_of == "step_004.002"
    assert replay.key == made.key


def test_key_and_body_are_fixed_when_the_step_is_made() -> None:
    """Plain arguments are not copied, but editing them later changes neither key nor body."""
    args: dict[str, Any] = {"items": [{"sku": "a"}]}
    for step in (
        PlanSession(id="p").step(1, "order", args),
        Step(plan_session_id="p", index=1, tool="order", args=args),
    ):
        key, body = step.idempotency_key, step.body
        args["items"].append({"sku": "b"})
        assert (step.idempotency_key, step.body) == (key, body)
        assert body == b'{"items":[{"sku":"a"}]}'
        args["items"].pop()


def test_an_updated_copy_is_a_new_step_with_its_own_key_and_body() -> None:
    """model_copy(update=) rebuilds the step: never the old arguments' bytes under the old key."""
    plan = PlanSession.new()
    step = plan.step(1, "charge", {"amount": 5})
    assert step.body == b'{"amount":5}'  # cached on the original, with its key
    assert step.idempotency_key.endswith(hashlib.sha256(step.body).hexdigest())
    copy = step.model_copy(update={"args": {"amount": 7}})
    assert copy.body == b'{"amount":7}'
    assert copy.idempotency_key != step.idempotency_key
    assert copy.key.args_hash == hashlib.sha256(copy.body).hexdigest()
    assert step.model_copy() == step
    with pytest.raises(InvalidArguments):
        step.model_copy(update={"args": {"amount": float("nan")}})


@given(index=st.lists(st.integers(0, 99_999), min_size=1, max_size=45).map(tuple))
def test_plan_keys_equal_independent_keys_each_time_they_are_asked(index: tuple[int, ...]) -> None:
    """A step's key is the StepKey of its parts (or the same InvalidKey) each time it is asked."""
    plan = PlanSession(id="p" * 40)
    args = {"n": 1}
    digest = hashlib.sha256(canonical_json(args)).hexdigest()
    try:
        expected = StepKey(plan.id, index, digest).format()
    except InvalidKey:
        for _ in range(2):  # the key prefix is not kept when it was refused
            with pytest.raises(InvalidKey, match="255"):
                plan.step(index, "t", args)
        return
    for _ in range(2):
        step = plan.step(index, "t", args)
        assert step.idempotency_key == expected == step.key.format()
    replay = plan.step((*index, 0), "t", args)  # a repeat answers with the first index's key
    assert replay.idempotency_key == expected
