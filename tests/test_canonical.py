"""Canonical JSON: golden vectors, RFC 8785 examples and properties."""

from __future__ import annotations

import datetime as dt
import enum
import json
import math
import struct
import sys
import uuid
from decimal import Decimal
from typing import Any

import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from agentkey import ConfigurationError, InvalidArguments, args_hash, canonical_json
from agentkey._canonical import Profile


class _Level(enum.IntEnum):
    HUGE = 10**4400


def dumps(value: Any) -> bytes:
    """The expression a Python tool server uses; the ``python`` profile must match it."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


GOLDEN: list[tuple[str, dict[str, Any], bytes]] = [
    ("empty", {}, b"{}"),
    ("key order", {"b": 1, "a": 2, "c": {"z": 0, "y": []}}, b'{"a":2,"b":1,"c":{"y":[],"z":0}}'),
    ("unicode", {"name": "café"}, b'{"name":"caf\\u00e9"}'),
    ("emoji", {"e": "\U0001f600"}, b'{"e":"\\ud83d\\ude00"}'),
    ("controls", {"c": "a\nb\t\x00\x1f"}, b'{"c":"a\\nb\\t\\u0000\\u001f"}'),
    ("quotes", {"q": 'say "hi" \\'}, b'{"q":"say \\"hi\\" \\\\"}'),
    ("nested", {"a": [1, {"b": [None, True, False]}]}, b'{"a":[1,{"b":[null,true,false]}]}'),
    ("big int", {"n": 2**70}, b'{"n":1180591620717411303424}'),
    ("float one", {"f": 1.0}, b'{"f":1.0}'),
    ("float tiny", {"f": 1e-7}, b'{"f":1e-07}'),
    ("float sum", {"f": 0.1 + 0.2}, b'{"f":0.30000000000000004}'),
    ("negative zero", {"f": -0.0}, b'{"f":-0.0}'),
    ("empty nested", {"a": {}, "b": []}, b'{"a":{},"b":[]}'),
]


@pytest.mark.parametrize(("name", "args", "expected"), GOLDEN, ids=[g[0] for g in GOLDEN])
def test_python_profile_golden(name: str, args: dict[str, Any], expected: bytes) -> None:
    """Each golden vector gives the expected bytes, equal to the json.dumps expression."""
    assert canonical_json(args) == expected
    assert canonical_json(args) == dumps(args)


# RFC 8785 section 3.2.2 (sample input) and 3.2.3 (sorting), and Appendix B (numbers).
def test_jcs_rfc8785_sample() -> None:
    """The RFC 8785 section 3.2.2 example canonicalises to the published output."""
    source = (
        '{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],'
        ' "string": "\\u20ac$\\u000F\\u000aA\'\\u0042\\u0022\\u005c\\\\\\"\\/",'
        ' "literals": [null, true, false]}'
    )
    expected = (
        '{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],'
        '"string":"€$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}'
    ).encode()
    assert canonical_json(json.loads(source), profile="jcs") == expected


def test_jcs_rfc8785_sorting() -> None:
    """Keys sort by UTF-16 code units, as in the RFC 8785 section 3.2.3 example."""
    source = {
        "\u20ac": "Euro Sign",
        "\r": "Carriage Return",
        "\ufb33": "Hebrew Letter Dalet With Dagesh",
        "1": "One",
        "\U0001f600": "Emoji: Grinning Face",
        "\u0080": "Control",
        "\u00f6": "Latin Small Letter O With Diaeresis",
    }
    order = [k for k, _ in json.loads(canonical_json(source, profile="jcs")).items()]
    assert order == ["\r", "1", "\u0080", "\u00f6", "\u20ac", "\U0001f600", "\ufb33"]


APPENDIX_B = [
    ("0000000000000000", "0"),
    ("8000000000000000", "0"),
    ("0000000000000001", "5e-324"),
    ("8000000000000001", "-5e-324"),
    ("7fefffffffffffff", "1.7976931348623157e+308"),
    ("ffefffffffffffff", "-1.7976931348623157e+308"),
    ("4340000000000000", "9007199254740992"),
    ("c340000000000000", "-9007199254740992"),
    ("4430000000000000", "295147905179352830000"),
    ("44b52d02c7e14af5", "9.999999999999997e+22"),
    ("44b52d02c7e14af6", "1e+23"),
    ("44b52d02c7e14af7", "1.0000000000000001e+23"),
    ("444b1ae4d6e2ef4e", "999999999999999700000"),
    ("444b1ae4d6e2ef4f", "999999999999999900000"),
    ("444b1ae4d6e2ef50", "1e+21"),
    ("3eb0c6f7a0b5ed8c", "9.999999999999997e-7"),
    ("3eb0c6f7a0b5ed8d", "0.000001"),
    ("41b3de4355555553", "333333333.3333332"),
    ("41b3de4355555554", "333333333.33333325"),
    ("41b3de4355555555", "333333333.3333333"),
    ("41b3de4355555556", "333333333.3333334"),
    ("41b3de4355555557", "333333333.33333343"),
    ("becbf647612f3696", "-0.0000033333333333333333"),
    ("43143ff3c1cb0959", "1424953923781206.2"),
]


@pytest.mark.parametrize(("bits", "expected"), APPENDIX_B)
def test_jcs_number_serialisation(bits: str, expected: str) -> None:
    """Every IEEE 754 example of RFC 8785 Appendix B serialises as published."""
    value = struct.unpack(">d", bytes.fromhex(bits))[0]
    assert canonical_json({"n": value}, profile="jcs") == f'{{"n":{expected}}}'.encode()


def test_jcs_rejects_unsafe_integers() -> None:
    """Integers beyond 2**53 cannot be exact in RFC 8785 and are refused with the path."""
    with pytest.raises(InvalidArguments, match=r"args\.n") as info:
        canonical_json({"n": 2**60}, profile="jcs")
    assert info.value.path == "args.n"


def test_jcs_rejects_lone_surrogates() -> None:
    """A lone surrogate has no UTF-8 form, so JCS refuses it instead of crashing."""
    with pytest.raises(InvalidArguments):
        canonical_json({"s": "\ud800"}, profile="jcs")


def test_unknown_profile() -> None:
    """An unknown profile is a configuration error at the boundary."""
    with pytest.raises(ConfigurationError, match="profile"):
        canonical_json({}, profile="yaml")  # type: ignore[arg-type]


class Color(enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    HIGH = 3


class Item(BaseModel):
    sku: str
    when: dt.date


def test_conversion_of_python_values() -> None:
    """Models, datetimes, UUIDs, enums and tuples become their JSON forms."""
    ident = uuid.UUID("12345678-1234-5678-1234-567812345678")
    value = {
        "item": Item(sku="a", when=dt.date(2026, 1, 2)),
        "at": dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc),
        "id": ident,
        "color": Color.RED,
        "level": Level.HIGH,
        "pair": (1, 2),
    }
    assert json.loads(canonical_json(value)) == {
        "item": {"sku": "a", "when": "2026-01-02"},
        "at": "2026-01-02T03:04:05+00:00",
        "id": str(ident),
        "color": "red",
        "level": 3,
        "pair": [1, 2],
    }


def test_model_as_arguments() -> None:
    """A pydantic model can be the arguments object itself."""
    assert canonical_json(Item(sku="x", when=dt.date(2026, 5, 1))) == (
        b'{"sku":"x","when":"2026-05-01"}'
    )


@pytest.mark.parametrize(
    ("args", "path"),
    [
        ({"items": [1, 2, {"price": math.nan}]}, "args.items[2].price"),
        ({"x": math.inf}, "args.x"),
        ({"tags": {"a", "b"}}, "args.tags"),
        ({"amount": Decimal("1.10")}, "args.amount"),
        ({"blob": b"raw"}, "args.blob"),
        ({"m": {1: "one"}}, "args.m"),
        ({"odd key": {"v": object()}}, "args['odd key'].v"),
        ({"big": [1, 10**4300]}, "args.big[1]"),
        ({"big": -(10**5000)}, "args.big"),
        ({"big": _Level.HUGE}, "args.big"),
    ],
)
def test_unsupported_values_name_their_path(args: dict[str, Any], path: str) -> None:
    """Values JSON cannot carry exactly raise InvalidArguments naming where they are."""
    with pytest.raises(InvalidArguments) as info:
        canonical_json(args)
    assert info.value.path == path
    assert str(info.value).startswith(path)


class _Masked(str):
    def __str__(self) -> str:
        return "***"


class _Lying(int):
    def __int__(self) -> int:
        return 99

    def __index__(self) -> int:
        return 99


class _Rounded(float):
    def __float__(self) -> float:
        return 1.5


def test_subclasses_serialise_their_value_exactly_as_json_dumps_does() -> None:
    """An overridden __str__/__int__/__float__ on a subclass does not change the bytes."""
    args = {"s": _Masked("secret"), "i": _Lying(5), "f": _Rounded(2.5)}
    expected = json.dumps(
        args, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()
    assert canonical_json(args) == expected == b'{"f":2.5,"i":5,"s":"secret"}'
    assert canonical_json(args, profile="jcs") == expected


def _cyclic() -> dict[str, Any]:
    loop: dict[str, Any] = {"name": "a"}
    loop["self"] = loop
    return loop


def _deep(levels: int) -> dict[str, Any]:
    root: list[Any] = []
    node = root
    for _ in range(levels):
        node.append([])
        node = node[0]
    return {"deep": root}


@pytest.mark.parametrize("profile", ["python", "jcs"])
@pytest.mark.parametrize("args", [_cyclic(), _deep(100_000)], ids=["cycle", "100k levels"])
def test_cycles_and_absurd_nesting_raise_invalid_arguments(
    args: dict[str, Any], profile: Profile
) -> None:
    """A cycle or 100k levels of nesting is a typed InvalidArguments, not a RecursionError."""
    with pytest.raises(InvalidArguments, match="nested too deeply") as info:
        canonical_json(args, profile=profile)
    assert info.value.path == "args"


def test_largest_integer_a_python_server_can_read_is_accepted() -> None:
    """An integer of exactly 4300 digits still serialises, and json.loads reads it back."""
    edge = 10**4300 - 1
    body = canonical_json({"n": edge, "m": -edge})
    assert json.loads(body) == {"n": edge, "m": -edge}


@pytest.mark.parametrize("args", [[1, 2], "text", 3, None, (("a", 1),)])
def test_arguments_must_be_an_object(args: object) -> None:
    """Anything but a JSON object is refused before any request is made."""
    with pytest.raises(InvalidArguments, match="JSON object"):
        args_hash(args)


# --- properties ---------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
json_objects = st.dictionaries(st.text(max_size=8), json_values, max_size=6)


@given(json_objects)
def test_python_profile_equals_json_dumps(args: dict[str, Any]) -> None:
    """For any JSON object the python profile is byte-identical to the json.dumps expression."""
    assert canonical_json(args) == dumps(args)


@given(json_objects)
def test_server_side_reserialisation_verifies_hash(args: dict[str, Any]) -> None:
    """A Python server that parses the body and re-dumps it computes the same args_hash."""
    import hashlib

    body = canonical_json(args)
    assert hashlib.sha256(dumps(json.loads(body))).hexdigest() == args_hash(args)


safe_ints = st.integers(min_value=-(2**53 - 1), max_value=2**53 - 1)
jcs_values = st.recursive(
    st.none()
    | st.booleans()
    | safe_ints
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(exclude_categories=["Cs"])),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@given(st.dictionaries(st.text(max_size=8), jcs_values, max_size=6))
def test_jcs_matches_independent_implementation(args: dict[str, Any]) -> None:
    """The jcs profile agrees byte for byte with the rfc8785 package on any JSON object."""
    assert canonical_json(args, profile="jcs") == rfc8785.dumps(args)


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_jcs_numbers_round_trip(value: float) -> None:
    """Every finite double serialises under jcs to text that parses back to the same double."""
    text = canonical_json({"n": value}, profile="jcs")[5:-1]
    assert float(text) == value


@given(json_objects, st.randoms())
def test_key_order_does_not_matter(args: dict[str, Any], rnd: Any) -> None:
    """Any insertion order of the same object gives the same hash, in both profiles."""
    items = list(args.items())
    rnd.shuffle(items)
    shuffled = dict(items)
    assert args_hash(shuffled) == args_hash(args)


# --- the fast path (plain JSON straight to json.dumps) agrees with the precise walk ----


class _Shout(str):
    def __str__(self) -> str:
        return "SHOUT"


class _Hex(int):
    def __repr__(self) -> str:
        return hex(self)

    __str__ = __repr__


class _Half(float):
    def __repr__(self) -> str:
        return "0.5"


class _Tone(str, enum.Enum):
    LOW = "low"


class _Ordered(dict):  # type: ignore[type-arg]
    pass


class _Rows(list):  # type: ignore[type-arg]
    pass


def _precise(args: Any, profile: Profile) -> tuple[object, object, object]:
    """What _outcome gives with the lean walks switched off: the precise walk only."""
    from unittest import mock

    from agentkey import _canonical

    off = _canonical._NotPlain
    with (
        mock.patch.object(_canonical, "_plain_copy", side_effect=off),
        mock.patch.object(_canonical, "_check_plain", side_effect=off),
    ):
        return _outcome(args, profile)


def _outcome(args: Any, profile: Profile) -> tuple[object, object, object]:
    """canonical_json's bytes, to_jsonable's value and plain_and_body's pair, or (error, path)."""
    from agentkey._canonical import plain_and_body, to_jsonable

    def run(fn: Any) -> object:
        try:
            return fn()
        except InvalidArguments as exc:
            return (type(exc).__name__, str(exc.path))

    return (
        run(lambda: canonical_json(args, profile=profile)),
        run(lambda: to_jsonable(args)),
        run(lambda: plain_and_body(args, profile)),
    )


odd_scalars = (
    json_scalars
    | st.sampled_from(
        [
            math.nan,
            -math.inf,
            -0.0,
            2**60,
            True,
            False,
            _Shout("masked"),
            _Hex(255),
            _Half(2.5),
            Level.HIGH,
            _Tone.LOW,
            Color.RED,
            "\ud800",
            "\ud83d\ude00",
        ]
    )
    | st.builds(_Shout, st.text(max_size=4))
    | st.builds(_Hex, st.integers())
    # integers around the 4300-digit limit a Python server can read (built lazily:
    # hypothesis cannot repr them in its strategy descriptions)
    | st.tuples(st.integers(4299, 4301), st.sampled_from([1, -1])).map(lambda p: p[1] * 10 ** p[0])
)
odd_keys = st.text(max_size=4) | st.sampled_from([1, None, True, 2.5, _Shout("k")])
odd_values = st.recursive(
    odd_scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=3).map(tuple)
        | st.lists(children, max_size=3).map(_Rows)
        | st.dictionaries(odd_keys, children, max_size=4)
        | st.dictionaries(st.text(max_size=4), children, max_size=3).map(_Ordered)
    ),
    max_leaves=12,
)


@pytest.mark.parametrize("profile", ["python", "jcs"])
@settings(max_examples=min(300, settings().max_examples))  # 100 by default, 300 under `long`
@given(args=st.dictionaries(odd_keys, odd_values, max_size=5))
def test_fast_path_equals_precise_walk(profile: Profile, args: dict[str, Any]) -> None:
    """On any JSON-ish input (subclasses, enums, NaN, huge ints, odd keys) both paths agree."""
    assert _outcome(args, profile) == _precise(args, profile)


@pytest.mark.parametrize(
    "args",
    [
        {"s": _Shout("secret"), "i": _Hex(16), "f": _Half(2.5)},
        {"d": _Ordered(b=1, a=2), "l": _Rows([1, 2])},
        {"flag": True, "one": 1, "zero": -0.0},
        {1: "int key"},
        {"nested": {None: 1}},
        {"t": Level.HIGH, "c": _Tone.LOW},
        {"rows": [{"a": 1}, {2: "b"}, {"c": 3}]},
        {"m": [{"a": {"b": [{3.5: 4}]}}], "n": "x"},
        {"rows": [{"a": 1}, {_Shout("k"): 2}]},
        {"rows": [{"a": (1, 2)}, [Level.HIGH]]},
        {"deep": [[[[{"a": [[{"b": {"c": [True, None, 1.5]}}]]}]]]]},
    ],
    ids=[
        "str-int-float subclasses",
        "dict-list subclasses",
        "bool-int--0.0",
        "int key",
        "None key",
        "enums",
        "int key in one record of a list",
        "float key deep in a mixed level",
        "str-subclass key in a record",
        "tuple and enum below plain containers",
        "plain and deep",
    ],
)
def test_fast_path_edges_match_the_precise_walk(args: dict[str, Any]) -> None:
    """Named edges of the fast path: same bytes or the same refusal and path as the walk."""
    for profile in ("python", "jcs"):
        assert _outcome(args, profile) == _precise(args, profile)
    assert canonical_json({"flag": True, "one": 1}) == b'{"flag":true,"one":1}'


def test_the_fast_check_sees_every_value_through_the_collector() -> None:
    """The fast check takes a level's values from ``gc.get_referents``: on CPython that
    gives every value of a dict and a list, and a dict's keys too once one is not an
    exact str (a dict that ever held such a key keeps giving them). Elsewhere the fast
    path is off and the precise walk gives the same answer."""
    from unittest import mock

    from agentkey import _canonical

    if sys.implementation.name == "cpython":
        assert _canonical._FAST
    emptied: dict[Any, Any] = {1: "gone", "a": [1]}
    del emptied[1]  # only str keys now, but the dict still gives its keys
    for args in ({"a": [1, {"b": 2}]}, {"d": emptied}, {"rows": [{"x": 1}, {2: 3}]}):
        with mock.patch.object(_canonical, "_FAST", False):
            off = _outcome(args, "python")
        assert _outcome(args, "python") == off == _precise(args, "python")


def test_plain_arguments_skip_the_python_walk() -> None:
    """Plain JSON arguments skip the precise walk (its paths and conversions) entirely."""
    from unittest import mock

    from agentkey import _canonical

    args = {"a": [1, 2.5, {"b": None, "c": "x"}], "d": True}
    slow = AssertionError("slow path")
    with (
        mock.patch.object(_canonical, "_convert", side_effect=slow),
        mock.patch.object(_canonical, "_plain_copy", side_effect=slow),
    ):
        assert canonical_json(args) == dumps(args)
    with mock.patch.object(_canonical, "_convert", side_effect=slow):
        assert _canonical.to_jsonable(args) == args


def test_to_jsonable_returns_an_independent_copy() -> None:
    """The fast path still copies: editing the caller's dict later changes nothing validated."""
    from agentkey._canonical import to_jsonable

    args: dict[str, Any] = {"items": [{"sku": "a"}], "s": "\ud800", "n": 10**4000}
    plain = to_jsonable(args)
    args["items"][0]["sku"] = "changed"
    args["items"].append(1)
    assert plain == {"items": [{"sku": "a"}], "s": "\ud800", "n": 10**4000}


def _list_cycle() -> dict[str, Any]:
    loop: list[Any] = [1]
    loop.append(loop)
    return {"loop": [loop, loop]}


def test_list_cycles_and_shared_values() -> None:
    """A cycle through lists is refused with its path; a value shared twice is written twice."""
    with pytest.raises(InvalidArguments, match="nested too deeply") as info:
        canonical_json(_list_cycle())
    assert info.value.path == "args"
    shared = [1, {"x": 2}]
    assert canonical_json({"a": shared, "b": shared}) == b'{"a":[1,{"x":2}],"b":[1,{"x":2}]}'


@pytest.mark.skipif(not hasattr(sys, "set_int_max_str_digits"), reason="no int digit limit")
@pytest.mark.parametrize("limit", [0, 640, 5000])
def test_int_digit_limit_of_the_interpreter_does_not_change_the_answer(limit: int) -> None:
    """Ints pass the fast path unseen only under the default 4300-digit limit; else both agree."""
    args = {"n": [10**4299, 1], "m": {"k": -(10**4300)}}
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(limit)
    try:
        for profile in ("python", "jcs"):
            assert _outcome(args, profile) == _precise(args, profile)
        with pytest.raises(InvalidArguments) as info:
            canonical_json(args)
        assert info.value.path == "args.m.k"
    finally:
        sys.set_int_max_str_digits(old)


def test_plain_arguments_are_returned_as_given_with_their_bytes() -> None:
    """plain_and_body keeps plain arguments as they are (no copy) and converts the rest."""
    from agentkey._canonical import plain_and_body

    plain = {"a": [1, 2.5, {"b": None}], "c": "x"}
    value, body = plain_and_body(plain, "python")
    assert value is plain
    assert body == dumps(plain)
    converted, body = plain_and_body({"t": (1, 2), "when": dt.date(2026, 1, 2)}, "python")
    assert converted == {"t": [1, 2], "when": "2026-01-02"}
    assert body == b'{"t":[1,2],"when":"2026-01-02"}'


# --- the batched checks: lists of records, containers of 16+ values, small lists inline ---


class _Skewed(int, enum.Enum):
    """An int enum whose value is not its int content: json.dumps would write 1, not "one"."""

    ONE = (1, "one")

    def __new__(cls, number: int, label: str) -> _Skewed:
        member = int.__new__(cls, number)
        member._value_ = label
        return member


def _record_cycle() -> dict[str, Any]:
    row: dict[str, Any] = {"id": 1}
    rows: list[Any] = [{"id": 0}, row]
    row["rows"] = rows
    return {"rows": rows}


_WIDE_ROWS = [{"id": i, "tags": ["a", "b"]} for i in range(20)]


@pytest.mark.parametrize(
    "args",
    [
        {"rows": [{"a": 1}, {"a": 2}, {2: "b"}]},
        {"rows": [{"a": 1}, {"a": 2}, {_Shout("k"): "b"}]},
        {"rows": [{"a": 1}, {"t": _Skewed.ONE}]},
        {"rows": [{"a": 1}, {"t": Level.HIGH}, {"c": _Tone.LOW}]},
        {"rows": [{"a": 1}, _Ordered(a=1)]},
        {"rows": [{"a": 1}, {"a": 2}, "x"]},
        {"rows": [{"a": [1]}, {"a": (1,)}]},
        {"rows": [{"a": [1]}, {"a": _Rows([1])}]},
        {"rows": [{"x": 1}, {"x": math.nan}]},
        {"rows": [{"x": 1}, {"x": 10**4300}]},
        {"rows": [*_WIDE_ROWS, {"id": 20, "tags": ["a", _Skewed.ONE]}]},
        {"rows": [*_WIDE_ROWS, {"id": 20, "tags": [{None: 1}]}]},
        {"wide": [*range(20), _Skewed.ONE]},
        {"wide": [*range(20), [1, [2, {3: "x"}]]]},
        {"tags": ["a", _Shout("b")], "more": [["c"], [_Half(1.5)]]},
        _record_cycle(),
    ],
    ids=[
        "int key in a later record",
        "str-subclass key in a record",
        "enum whose value is not its int",
        "int and str enums in records",
        "dict subclass among records",
        "a non-dict among records",
        "tuple in a record",
        "list subclass in a record",
        "NaN in a record",
        "huge int in a record",
        "enum in the last of 21 records",
        "None key deep in the last record",
        "enum after 20 ints",
        "int key nested in a wide list",
        "subclasses in small lists",
        "cycle through records",
    ],
)
def test_batched_checks_match_the_precise_walk(args: dict[str, Any]) -> None:
    """Records, wide containers and small lists checked in C give the precise walk's answer."""
    for profile in ("python", "jcs"):
        assert _outcome(args, profile) == _precise(args, profile)


def test_shared_records_are_written_each_time() -> None:
    """One record object listed twice is plain and is written twice, as json.dumps does."""
    from agentkey._canonical import plain_and_body

    row = {"sku": "a", "tags": ["x"]}
    args = {"rows": [row, row, {"sku": "b", "tags": []}]}
    value, body = plain_and_body(args, "python")
    assert value is args
    assert body == dumps(args)


_records = st.lists(st.dictionaries(odd_keys, odd_values, max_size=4), min_size=2, max_size=5)
_wide_list = st.lists(odd_values, min_size=16, max_size=20)
_wide_map = st.dictionaries(st.text(max_size=3), odd_values, min_size=16, max_size=18)


@pytest.mark.parametrize("profile", ["python", "jcs"])
# Each example builds records and 16+-value containers (about 50 ms of CPU, far more on a
# loaded machine): 20 by default, and under `long` the 150 this test always ran.
@settings(max_examples=min(150, settings().max_examples // 5))
@given(
    args=st.fixed_dictionaries(
        {"rows": _records, "wide": _wide_list, "map": _wide_map, "small": st.lists(odd_values)}
    )
)
def test_batched_checks_equal_precise_walk_on_generated_input(
    profile: Profile, args: dict[str, Any]
) -> None:
    """On generated records and 16+-value containers with odd values anywhere, both paths agree."""
    assert _outcome(args, profile) == _precise(args, profile)
