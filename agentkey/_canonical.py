"""Canonical JSON: the exact bytes that are hashed into a key and sent as the body.

Two profiles:

``python`` (default)
    Byte-identical to ``json.dumps(v, sort_keys=True, separators=(",", ":"),
    ensure_ascii=True, allow_nan=False)``: what a Python tool server computes
    from the parsed body.
``jcs``
    RFC 8785, the JSON Canonicalization Scheme, for servers in other languages.

Before serialising, arguments become plain JSON values (:func:`to_jsonable`).
Anything that cannot be carried exactly raises :class:`InvalidArguments`
naming its path, such as ``args.items[2].price``.

Speed: arguments that already are plain JSON (exact ``dict``/``list``/``str``/
``int``/``float``/``bool``/``None``, string keys: what ``json.loads`` gives) take
the C path. The C encoder that ``json.dumps`` itself uses, built once, writes the
bytes first and refuses NaN, infinities, integers of more than 4300 digits, foreign
types and cycles as it goes; :func:`_check_plain` then makes sure nothing in the
tree was written that the precise walk would have converted or refused (a
subclass, an enum, a tuple, a key that is not a string), taking the values of
dicts and lists in batches from ``gc.get_referents`` (no paths, no copy). Input
that is not plain takes :func:`_convert`, the precise walk that converts values and
names the path of the first bad one. Both give the same bytes or the same refusal
(``tests/test_canonical.py`` checks it on generated inputs).
"""

from __future__ import annotations

import enum
import gc
import hashlib
import json
import math
import sys
import uuid
from collections.abc import Callable, Mapping
from json.encoder import JSONEncoder, encode_basestring_ascii
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, cast

from ._exceptions import ConfigurationError, InvalidArguments

if TYPE_CHECKING:
    from pydantic import BaseModel

__all__ = [
    "JSONObject",
    "Profile",
    "args_hash",
    "canonical_json",
    "check_profile",
    "encode_jsonable",
    "plain_and_body",
    "to_jsonable",
]

Profile: TypeAlias = Literal["python", "jcs"]
JSONObject: TypeAlias = dict[str, Any]

_PROFILES = ("python", "jcs")
# Python refuses to print or parse integers of more than 4300 digits (the default
# sys.int_max_str_digits), so a Python server could not even read such a body.
_MAX_INT_DIGITS = 4300
_MAX_INT = 10**_MAX_INT_DIGITS  # the smallest integer with one digit too many
_SMALL_INT_BITS = 14_284  # every integer of at most this many bits has <= 4300 digits
# RFC 8785 numbers are IEEE 754 doubles: only "safe" integers are exact.
_JCS_MAX_SAFE_INT = 2**53 - 1  # Number.MAX_SAFE_INTEGER


def check_profile(profile: object) -> Profile:
    if profile not in _PROFILES:
        raise ConfigurationError(
            f"unknown canonical JSON profile {profile!r}; use 'python' or 'jcs'"
        )
    return profile  # type: ignore[return-value]


class _NotPlain(Exception):
    """Raised by the lean walks at the first value they leave to the precise walk."""


def _plain_copy(value: Any) -> Any:
    """Copy a ``dict`` or ``list`` that is already plain JSON; else raise :class:`_NotPlain`.

    The common case of :func:`to_jsonable`: exact ``dict`` (with exact ``str``
    keys), ``list``, ``str``, ``bool``, ``None``, finite ``float`` and ``int`` of at
    most ``_SMALL_INT_BITS`` bits, which :func:`_convert` would return unchanged.
    It keeps no paths and converts nothing; anything else (a subclass, an enum, a
    tuple, a huge int, NaN, a non-string key...) raises :class:`_NotPlain` and the
    caller runs the precise walk, which converts it or names its path. A cycle or
    absurd nesting raises ``RecursionError``, which goes the same way.
    """
    if type(value) is dict:
        out: Any = {}
        for key, item in value.items():
            if type(key) is not str:
                raise _NotPlain
            out[key] = _plain_item(item)
        return out
    return [_plain_item(item) for item in value]


def _plain_item(item: Any) -> Any:
    kind = type(item)
    if kind is str or kind is bool or item is None:
        return item
    if kind is dict or kind is list:
        return _plain_copy(item)
    if kind is int:
        if item.bit_length() <= _SMALL_INT_BITS:
            return item
    elif kind is float and math.isfinite(item):
        return item
    raise _NotPlain


# Exact types _check_plain passes without looking at the value: the C encoder has already
# refused NaN and infinities (allow_nan=False), and integers of more than 4300 digits when
# the interpreter refuses to print them, as it does by default.
_LEAVES: frozenset[type] = frozenset({str, bool, type(None), float})
_LEAVES_AND_INTS: frozenset[type] = _LEAVES | {int}
_DICTS: frozenset[type] = frozenset({dict})
_LISTS: frozenset[type] = frozenset({list})
_AND_LISTS = {leaves: leaves | _LISTS for leaves in (_LEAVES, _LEAVES_AND_INTS)}
_WIDE = 16  # from this many values, one C-level look at all their types first
_int_digits_limit: Callable[[], int] = getattr(sys, "get_int_max_str_digits", lambda: 0)


def _leaves() -> frozenset[type]:
    """The types :func:`_check_plain` passes unseen, in this interpreter."""
    return _LEAVES_AND_INTS if 0 < _int_digits_limit() <= _MAX_INT_DIGITS else _LEAVES


def _check_plain(value: dict[Any, Any], leaves: frozenset[type]) -> None:
    """Raise :class:`_NotPlain` unless ``value``, which the C encoder has just encoded,
    is plain JSON.

    Plain: exact ``dict``/``list`` containers, exact ``str`` keys, and values of the
    exact types that :func:`_convert` returns unchanged (no subclass, enum or tuple,
    whose bytes the encoder writes but which the precise walk converts); types in
    ``leaves`` pass unseen (see :func:`_leaves`). No copy, no paths.

    The values of a dict, or of all the dicts of a list at once, come from
    ``gc.get_referents``, in C. A dict whose keys are not all exact strings gives its
    keys too, and an instance's ``__dict__`` whose values live in the instance (Python
    3.13) gives none, so a count that does not add up is not plain. Only a tree the
    encoder has walked comes here: it has no cycle, and absurd nesting raises
    ``RecursionError`` as it did there.
    """
    values = _referents(value)
    if len(values) != len(value):
        raise _NotPlain
    _check_values(values, leaves)


def _check_values(values: list[Any], leaves: frozenset[type]) -> None:
    """Raise :class:`_NotPlain` unless every one of ``values`` is plain (see above)."""
    if len(values) >= _WIDE:  # one look in C at all the types first
        if leaves.issuperset(map(type, values)):
            return
        if _AND_LISTS[leaves].issuperset(map(type, values)):  # say, records with tags
            _check_values(_referents(*values), leaves)  # all the lists' items at once
            return
    for item in values:
        kind = type(item)
        if kind in leaves:
            continue
        if kind is dict:
            _check_plain(item, leaves)
        elif kind is list:
            if len(item) > 1 and type(item[0]) is dict and _DICTS.issuperset(map(type, item)):
                expected = sum(map(len, item))  # a list of records: all their values
                item = _referents(*item)
                if len(item) != expected:
                    raise _NotPlain
                _check_values(item, leaves)
            elif not leaves.issuperset(map(type, item)):  # e.g. a list of tags: no call
                _check_values(item, leaves)
        elif kind is not int or item.bit_length() > _SMALL_INT_BITS:
            raise _NotPlain  # ints come here only when the interpreter prints any length


def _referents_as_expected() -> bool:
    """Whether ``gc.get_referents`` gives what :func:`_check_plain` relies on, as CPython's
    does: every value of a dict (keys too unless all are exact strings) and of a list,
    in any order."""
    x, y = "x", 2.5
    try:
        return (
            sorted(map(id, gc.get_referents({"a": x, "b": y}))) == sorted([id(x), id(y)])
            and sorted(map(id, gc.get_referents({1: x}))) == sorted([id(1), id(x)])
            and sorted(map(id, gc.get_referents([x, y, None]))) == sorted([id(x), id(y), id(None)])
        )
    except Exception:  # pragma: no cover - another interpreter's collector
        return False


_referents = gc.get_referents
_join = "".join
_sha256 = hashlib.sha256


def _as_model(value: object) -> BaseModel | None:
    """``value`` if it is a pydantic model, without importing pydantic for everyone.

    Nothing can be a model unless pydantic was imported, so keys alone stay light.
    """
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and isinstance(value, pydantic.BaseModel):
        return cast("BaseModel", value)
    return None


def _is_date(value: object) -> bool:
    """Whether ``value`` is a ``datetime``, ``date`` or ``time``, without importing datetime.

    Nothing can be one unless datetime was imported; this module stays free of the
    module that holds a clock (``datetime.now``).
    """
    dt = sys.modules.get("datetime")
    return dt is not None and isinstance(value, (dt.datetime, dt.date, dt.time))


def to_jsonable(args: object, *, root: str = "args") -> JSONObject:
    """Convert tool arguments to a plain JSON object (dict with str keys).

    Pydantic models dump in JSON mode, datetimes become ISO 8601 strings,
    UUIDs strings, enums their values and tuples lists. Sets, NaN, infinities,
    non-string keys and other values JSON cannot carry raise
    :class:`InvalidArguments` with the path of the offending value.
    """
    if type(args) is dict:
        try:
            return cast(JSONObject, _plain_copy(args))  # the common case: already plain
        except (_NotPlain, RecursionError):
            pass  # the precise walk below converts, or names the offending path
    model = _as_model(args)
    if model is not None:
        args = model.model_dump(mode="json")
    if not isinstance(args, Mapping):
        raise InvalidArguments(
            f"tool arguments must be a JSON object (a mapping with string keys), "
            f"got {type(args).__name__}; wrap the value, e.g. {{'value': ...}}",
            path=root,
        )
    try:
        return _convert_mapping(args, root)
    except RecursionError:
        raise InvalidArguments(
            "the arguments are nested too deeply or contain themselves (a cycle); "
            "flatten them or break the cycle",
            path=root,
        ) from None


def _convert_mapping(value: Mapping[Any, Any], path: str) -> JSONObject:
    out: JSONObject = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise InvalidArguments(
                f"object keys must be strings, got {type(key).__name__} key {key!r}; "
                "convert the key to a string explicitly",
                path=path,
            )
        child = f"{path}.{key}" if key.isidentifier() else f"{path}[{key!r}]"
        out[key] = _convert(item, child)
    return out


def _convert_container(value: Mapping[Any, Any] | list[Any] | tuple[Any, ...], path: str) -> Any:
    if isinstance(value, Mapping):
        return _convert_mapping(value, path)
    return [_convert(item, f"{path}[{i}]") for i, item in enumerate(value)]


def _convert(value: object, path: str) -> Any:
    # Fast path for values that already are plain JSON (the common case).
    kind = type(value)
    if kind is str or kind is bool or value is None:
        return value
    if kind is int:
        number = cast(int, value)  # exact type checked above
        return number if number.bit_length() <= _SMALL_INT_BITS else _big_int(number, path)
    if kind is dict or kind is list:
        return _convert_container(value, path)  # type: ignore[arg-type]  # exact types checked
    # Order matters: bool is an int, IntEnum is an int, StrEnum is a str.
    if value is None or value is True or value is False:
        return value
    if isinstance(value, enum.Enum):
        return _convert(value.value, path)
    # Subclasses keep their underlying value, as json.dumps writes it: an overridden
    # __str__/__int__/__float__ (a masking str, say) must not change the bytes.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return _big_int(int.__int__(value), path)
    if isinstance(value, float):
        real = float.__float__(value)
        if not math.isfinite(real):
            raise InvalidArguments(
                f"{real!r} is not valid JSON; send null or a string instead", path=path
            )
        return real
    model = _as_model(value)
    if model is not None:
        return _convert(model.model_dump(mode="json"), path)
    if isinstance(value, (Mapping, list, tuple)):
        return _convert_container(value, path)
    if _is_date(value):
        return value.isoformat()  # type: ignore[attr-defined]  # a datetime, date or time
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, (set, frozenset)):
        raise InvalidArguments(
            "sets have no order and no JSON form; pass a sorted list instead", path=path
        )
    raise InvalidArguments(
        f"a {type(value).__name__} cannot be carried by JSON exactly; convert it to "
        "a string, number, list or object first",
        path=path,
    )


def _big_int(value: int, path: str) -> int:
    if -_MAX_INT < value < _MAX_INT:
        return value
    raise InvalidArguments(
        f"an integer of more than {_MAX_INT_DIGITS} digits cannot be read back by a Python "
        "server; send it as a string",
        path=path,
    )


def canonical_json(args: object, *, profile: Profile = "python") -> bytes:
    """Return the canonical JSON bytes of ``args`` under ``profile``.

    These bytes are both the request body and the input of :func:`args_hash`.
    """
    return plain_and_body(args, check_profile(profile))[1]


def plain_and_body(args: object, profile: Profile) -> tuple[JSONObject, bytes]:
    """``args`` as plain JSON values, and their canonical bytes under ``profile``.

    When ``args`` already is plain JSON the value returned is ``args`` itself, not a
    copy (:func:`to_jsonable` copies); otherwise it is the converted copy.
    """
    if type(args) is dict and _FAST:
        try:
            # The encoder first: in C it refuses what JSON cannot carry (NaN, foreign
            # types, a cycle as a RecursionError), and the check then walks a finite tree.
            text = _text(args)
            _check_plain(args, _leaves())
        except (_NotPlain, RecursionError, ValueError, TypeError):
            pass  # to_jsonable() converts, or names the offending path
        else:
            if profile == "python":
                return args, text.encode("ascii")
            return args, _jcs(args, "args").encode("utf-8")
    plain = to_jsonable(args)
    return plain, encode_jsonable(plain, profile)


def _json_dumps(value: object) -> str:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    )


_Encoder: TypeAlias = Callable[[object, int], "list[str] | tuple[str, ...]"]


def _c_encoder() -> _Encoder | None:
    """The C encoder behind ``_json_dumps``, built once (``json.dumps`` builds it per call)."""
    # The factory json.JSONEncoder.iterencode calls (not in typeshed); absent without
    # the _json accelerator (e.g. PyPy).
    make: Callable[..., _Encoder] | None = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return None
    encoder: _Encoder = make(
        None,  # no circular check: a cycle raises RecursionError, as deep nesting does
        JSONEncoder().default,  # raises TypeError, as json.dumps does
        encode_basestring_ascii,
        None,
        ":",
        ",",
        True,  # sort_keys
        False,  # skipkeys
        False,  # allow_nan
    )
    return encoder


_c_encode = _c_encoder()


def _text(value: JSONObject) -> str:
    """The ``python`` profile's text of ``value`` (see :func:`_json_dumps`)."""
    if _c_encode is None:
        return _json_dumps(value)
    return _join(_c_encode(value, 0))


def _encode(value: JSONObject, profile: Profile) -> bytes:
    if profile != "python":
        return _jcs(value, "args").encode("utf-8")
    return _text(value).encode("ascii")


# The fast path needs CPython's view of a container's referents (see _check_plain).
_FAST = _referents_as_expected()


def encode_jsonable(value: JSONObject, profile: Profile) -> bytes:
    """Serialise a value that :func:`to_jsonable` already produced."""
    try:
        return _encode(value, profile)
    except RecursionError:
        raise InvalidArguments(
            "the arguments are nested too deeply to serialise; flatten them", path="args"
        ) from None


def args_hash(args: object, *, profile: Profile = "python") -> str:
    """SHA-256 of the canonical JSON of ``args``, as 64 lowercase hex digits."""
    return _sha256(plain_and_body(args, check_profile(profile))[1]).hexdigest()


# --- RFC 8785 ---------------------------------------------------------------

_JCS_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
}


def _jcs_string(value: str, path: str) -> str:
    parts = ['"']
    for ch in value:
        code = ord(ch)
        if ch in _JCS_ESCAPES:
            parts.append(_JCS_ESCAPES[ch])
        elif code < 0x20:
            parts.append(f"\\u{code:04x}")
        elif 0xD800 <= code <= 0xDFFF:
            raise InvalidArguments(
                "lone UTF-16 surrogates cannot be canonicalised by RFC 8785", path=path
            )
        else:
            parts.append(ch)
    parts.append('"')
    return "".join(parts)


def _jcs_number(value: int | float, path: str) -> str:
    if isinstance(value, int):
        if abs(value) > _JCS_MAX_SAFE_INT:
            raise InvalidArguments(
                f"integer {value} is beyond 2**53 - 1 and cannot be exact in RFC 8785 JSON; "
                "send it as a string or use the 'python' profile",
                path=path,
            )
        return str(value)
    if value == 0:
        return "0"  # also -0.0
    # repr gives the shortest digits that round-trip, as ECMAScript requires;
    # only the layout differs. Write |value| as 0.<digits> * 10**exponent.
    mantissa, _, exp_text = repr(abs(value)).partition("e")
    int_part, _, frac_part = mantissa.partition(".")
    all_digits = int_part + frac_part
    leading = len(all_digits) - len(all_digits.lstrip("0"))
    digits = all_digits[leading:].rstrip("0")
    exponent = len(int_part) + (int(exp_text) if exp_text else 0) - leading
    k = len(digits)
    sign = "-" if value < 0 else ""
    if k <= exponent <= 21:
        text = digits + "0" * (exponent - k)
    elif 0 < exponent <= 21:
        text = f"{digits[:exponent]}.{digits[exponent:]}"
    elif -6 < exponent <= 0:
        text = "0." + "0" * (-exponent) + digits
    else:
        e = exponent - 1
        mant = digits if k == 1 else f"{digits[0]}.{digits[1:]}"
        text = f"{mant}e{'+' if e >= 0 else '-'}{abs(e)}"
    return sign + text


def _utf16_key(key: str) -> bytes:
    return key.encode("utf-16-be", "surrogatepass")


def _jcs(value: Any, path: str) -> str:
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, str):
        return _jcs_string(value, path)
    if isinstance(value, (int, float)):
        return _jcs_number(value, path)
    if isinstance(value, list):
        return "[" + ",".join(_jcs(v, f"{path}[{i}]") for i, v in enumerate(value)) + "]"
    items = sorted(value.items(), key=lambda kv: _utf16_key(kv[0]))
    return (
        "{" + ",".join(f"{_jcs_string(k, path)}:{_jcs(v, f'{path}.{k}')}" for k, v in items) + "}"
    )
