"""Step keys: format, parse, header styles, validation and determinism."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkey import InvalidKey, StepKey, args_hash
from agentkey._keys import KEY_UUID_NAMESPACE, format_step

HASH = "a" * 64
plan_ids = st.text(
    alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._~-",
    min_size=1,
    max_size=64,
)
steps = st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=4).map(tuple)
hashes = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)


def test_key_layout() -> None:
    """A key is plan:step_NNN:sha256 of the canonical arguments."""
    key = StepKey.build("plan-1", 3, {"amount": 5}).format()
    assert key == f"plan-1:step_003:{args_hash({'amount': 5})}"


@pytest.mark.parametrize(
    ("step", "label"),
    [
        (0, "step_000"),
        (3, "step_003"),
        (1000, "step_1000"),
        ((3, 1), "step_003.001"),
        ([12, 0, 7], "step_012.000.007"),
    ],
)
def test_step_labels(step: Any, label: str) -> None:
    """Indexes are zero-padded to three digits; sub-steps join with dots."""
    assert StepKey("p", step, HASH).label == label


def test_both_header_styles_parse_to_the_same_key() -> None:
    """raw and sf-string header values name the same key."""
    key = StepKey("p", (3, 1), HASH)
    assert key.header_value("raw") == f"p:step_003.001:{HASH}"
    assert key.header_value("sf-string") == f'"p:step_003.001:{HASH}"'
    assert StepKey.parse(key.header_value("raw")) == key
    assert StepKey.parse(key.header_value("sf-string")) == key
    assert str(key) == key.format()


@pytest.mark.parametrize(
    "plan_id",
    ["", "a:b", "x" * 65, "has space", "ünï", "new\nline", "slash/id"],
)
def test_bad_plan_ids(plan_id: str) -> None:
    """Plan ids outside 1-64 chars of [A-Za-z0-9._~-] are refused with advice."""
    with pytest.raises(InvalidKey, match="from_external_id"):
        StepKey.build(plan_id, 1, {}).format()


@pytest.mark.parametrize("step", [-1, (1, -2), (), True, 1.5, "3", (1, "2")])
def test_bad_steps(step: Any) -> None:
    """Negative, empty, boolean and non-integer step indexes are refused."""
    with pytest.raises(InvalidKey):
        StepKey.build("p", step, {}).format()


@pytest.mark.parametrize(
    "value",
    [
        "",
        "p:step_001",
        f"p:step_001:{HASH}:extra",
        f"p:step_01:{HASH}",
        f"p:step_0001:{HASH}",
        f"p:step_001.1:{HASH}",
        f"p:step_-01:{HASH}",
        f"p:Step_001:{HASH}",
        f"p:step_001:{HASH.upper()}",
        f"p:step_001:{HASH[:-1]}",
        f"p:step_001:{HASH}\n",
        f'"p:step_001:{HASH}',
        f'"p:step_001:{HASH}\\n"',
        f'"p\\:step_001:{HASH}"',
        f'"p:step_001:{HASH}\u00e9"',
        "x" * 10_000_000,
        f"pl\u00e4n:step_001:{HASH}",
    ],
)
def test_malformed_header_values(value: str) -> None:
    """Malformed, non-canonical, overlong or badly quoted keys raise InvalidKey."""
    with pytest.raises(InvalidKey):
        StepKey.parse(value)


def test_escaped_sf_string_decodes() -> None:
    """A legal sf-string escape decodes before validation (and then fails on the alphabet)."""
    with pytest.raises(InvalidKey, match="plan session id"):
        StepKey.parse(f'"p\\"q:step_001:{HASH}"')


def test_key_length_limit() -> None:
    """A key over 255 characters is refused at construction."""
    with pytest.raises(InvalidKey, match="255"):
        StepKey("p" * 64, tuple(range(60)), HASH)


@given(plan_ids, steps, hashes)
def test_parse_format_round_trip(plan_id: str, step: tuple[int, ...], digest: str) -> None:
    """StepKey.parse(format(k)) == k, in both header styles."""
    try:
        key = StepKey(plan_id, step, digest)
    except InvalidKey:
        return  # over 255 characters: covered above
    assert StepKey.parse(key.format()) == key
    assert StepKey.parse(key.header_value("sf-string")) == key


@given(st.text(max_size=300))
def test_parse_never_crashes(value: str) -> None:
    """Any string either parses to a valid key or raises InvalidKey; nothing else."""
    try:
        key = StepKey.parse(value)
    except InvalidKey:
        return
    assert key.format() in (value, value[1:-1])


leaves = st.none() | st.booleans() | st.integers() | st.text(max_size=5)


@given(st.dictionaries(st.text(max_size=5), leaves, min_size=1, max_size=6), st.data())
def test_changing_any_leaf_changes_the_hash(args: dict[str, Any], data: st.DataObject) -> None:
    """Changing any one argument value gives a new args_hash, so a new operation."""
    name = data.draw(st.sampled_from(sorted(args)))
    new = data.draw(leaves.filter(lambda v: json.dumps(v) != json.dumps(args[name])))
    assert args_hash({**args, name: new}) != args_hash(args)


def test_key_is_stable_across_processes_and_hash_seeds() -> None:
    """Other interpreters with other PYTHONHASHSEEDs compute the same key."""
    args = {"region": "us-east-1", "tags": {"b": 2, "a": 1}, "ids": [3, 1, 2], "name": "é"}
    expected = StepKey.build("plan", (4, 2), args).format()
    code = textwrap.dedent(
        f"""
        from agentkey import StepKey
        print(StepKey.build("plan", (4, 2), {args!r}).format())
        """
    )
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == expected


def test_one_word_each_for_index_and_label() -> None:
    """StepKey names its tuple ``index`` and its text ``label``; the old names are gone."""
    key = StepKey("p", (3, 1), HASH)
    assert key.index == (3, 1)
    assert key.label == "step_003.001"
    assert not hasattr(key, "step")
    assert not hasattr(key, "step_label")
    assert key == StepKey("p", (3, 1), HASH)


@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=5))
def test_trusted_key_equals_validated_key(index: list[int]) -> None:
    """The plan's shortcut (parts already validated) builds the very key the checks build."""
    trusted = StepKey._trusted("plan-1", tuple(index), HASH)
    checked = StepKey("plan-1", tuple(index), HASH)
    assert trusted == checked
    assert trusted.format() == checked.format() == f"plan-1:{format_step(index)}:{HASH}"


@pytest.mark.parametrize("parts", [30, 31])
def test_key_prefix_is_the_raw_key_before_its_hash(parts: int) -> None:
    """key_prefix + hash is StepKey's raw key; both refuse the same too-long index."""
    from agentkey._keys import key_prefix

    index = tuple(range(parts))
    try:
        expected = StepKey("p" * 64, index, HASH).format()
    except InvalidKey:
        with pytest.raises(InvalidKey, match="255"):
            key_prefix("p" * 64, index)
        assert parts == 31
        return
    assert key_prefix("p" * 64, index) + HASH == expected
    assert len(expected) <= 255


def test_shown_key_hides_the_args_hash_and_keeps_plan_and_step() -> None:
    """A key shown in logs keeps plan and step readable, never its args_hash or an opaque key."""
    from agentkey._keys import shown_key

    key = StepKey.build("plan-1", 3, {"amount": 5}).format()
    shown = shown_key(key)
    assert shown.startswith("plan-1:step_003:#")
    assert len(shown) == len("plan-1:step_003:#") + 8
    assert key.rsplit(":", 1)[1] not in shown
    assert shown_key(key) == shown  # stable: two lines about one key match
    assert shown_key(StepKey.build("plan-1", 3, {"amount": 6}).format()) != shown
    opaque = "ik_live_4f1d2c3b"
    assert shown_key(opaque).startswith("#")
    assert "ik_live" not in shown_key(opaque)


def test_uuid_style_is_a_deterministic_uuid5_of_the_key() -> None:
    """The uuid style sends a UUIDv5 of the raw key: same step, same UUID; new args, new UUID."""
    key = StepKey.build("plan-1", 3, {"amount": 5})
    value = key.header_value("uuid")
    assert value == str(uuid.uuid5(KEY_UUID_NAMESPACE, key.format()))
    assert uuid.UUID(value).version == 5
    assert StepKey.build("plan-1", 3, {"amount": 5}).header_value("uuid") == value
    assert StepKey.build("plan-1", 3, {"amount": 6}).header_value("uuid") != value
    assert StepKey.build("plan-1", 4, {"amount": 5}).header_value("uuid") != value
    # Pinned: a new namespace would give every step already sent a new key.
    assert StepKey.build("p", 0, {}).header_value("uuid") == "aef5c725-60be-5c49-9a4c-da0594a51545"


@pytest.mark.parametrize(
    "value",
    ['"{k}";x=1', '"{k}";a;b=?0', '"{k}"; v="two words"', '"{k}";n=-1.5;t=tok/x:y'],
)
def test_sf_item_with_parameters_names_the_key(value: str) -> None:
    """An RFC 8941 Item (an sf-string with parameters) parses to the key inside the quotes."""
    key = StepKey.build("plan-1", 3, {"amount": 5})
    assert StepKey.parse(value.format(k=key.format())) == key


@pytest.mark.parametrize("value", ['"{k}"x', '"{k}";X=1', '"{k}";=1', '"{k}" ;a', '"{k}";a="b'])
def test_sf_item_with_broken_parameters_is_refused(value: str) -> None:
    """Anything after the quotes but RFC 8941 parameters is an invalid key, not ignored."""
    key = StepKey.build("plan-1", 3, {"amount": 5})
    with pytest.raises(InvalidKey, match="sf-string"):
        StepKey.parse(value.format(k=key.format()))
