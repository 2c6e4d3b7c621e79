"""Step keys: the one place that knows the ``Idempotency-Key`` format.

```
<plan_session_id>:<step>:<args_hash>
  plan_session_id  1-64 chars of [A-Za-z0-9._~-]
  step             step_003, sub-steps step_003.001 (each index >= 0, 3+ digits)
  args_hash        64 lowercase hex: sha256 of the canonical JSON of the arguments
```

Header styles: ``raw`` (the key as is), ``sf-string`` (an RFC 8941 string, quoted)
and ``uuid`` (a UUIDv5 of the raw key, for servers that accept only UUIDs: the same
step still sends the same UUID).
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from ._canonical import Profile, args_hash
from ._exceptions import ConfigurationError, InvalidKey

__all__ = [
    "AGENTKEY_NAMESPACE",
    "HEADER_STYLES",
    "KEY_UUID_NAMESPACE",
    "HeaderStyle",
    "StepIndex",
    "StepKey",
    "format_step",
    "header_value",
    "key_prefix",
    "normalize_step",
    "parse_sf_item",
    "plan_id_from_external",
    "raw_key",
    "shown_key",
    "uuid_key",
    "validate_plan_session_id",
]

HeaderStyle: TypeAlias = Literal["raw", "sf-string", "uuid"]
#: Every key header style, in the order the docs list them.
HEADER_STYLES: tuple[HeaderStyle, ...] = ("raw", "sf-string", "uuid")
StepIndex: TypeAlias = "int | Sequence[int]"

#: Namespace for UUIDv5 plan ids derived from external ids that are not valid as is.
AGENTKEY_NAMESPACE = uuid.UUID("6f1c3d2e-8b4a-5c7d-9e0f-a1b2c3d4e5f6")
#: Namespace of the ``uuid`` header style: ``uuid5(KEY_UUID_NAMESPACE, raw key)``. Fixed
#: forever: changing it would give every step already sent a new key.
KEY_UUID_NAMESPACE = uuid.UUID("0b6f3c52-2d8e-5a41-9c07-6e4d1f8a2b93")

MAX_KEY_LENGTH = 255
MAX_PLAN_ID_LENGTH = 64
_PLAN_ID = re.compile(r"[A-Za-z0-9._~-]{1,64}")
_STEP = re.compile(r"step_(\d{3,})((?:\.\d{3,})*)")
_HASH = re.compile(r"[0-9a-f]{64}")
_INT_ONLY = frozenset({int})


def validate_plan_session_id(plan_session_id: object) -> str:
    """Return ``plan_session_id`` if it is a valid plan id, else raise :class:`InvalidKey`."""
    if not isinstance(plan_session_id, str):
        raise InvalidKey(f"plan session id must be a str, got {type(plan_session_id).__name__}")
    if not _PLAN_ID.fullmatch(plan_session_id):
        shown = plan_session_id if len(plan_session_id) <= 80 else plan_session_id[:77] + "..."
        raise InvalidKey(
            f"invalid plan session id {shown!r}: it must be 1-{MAX_PLAN_ID_LENGTH} characters "
            "from [A-Za-z0-9._~-] (no ':'); use PlanSession.from_external_id() to map "
            "any other id to a valid one"
        )
    return plan_session_id


def plan_id_from_external(external_id: str) -> str:
    """Use ``external_id`` as a plan id when valid, else map it to a UUIDv5."""
    if not isinstance(external_id, str) or not external_id:
        raise InvalidKey("external id must be a non-empty str")
    if _PLAN_ID.fullmatch(external_id):
        return external_id
    # uuid.uuid5 itself, except that a lone surrogate is hashed instead of crashing.
    name = external_id.encode("utf-8", "surrogatepass")
    digest = hashlib.sha1(AGENTKEY_NAMESPACE.bytes + name, usedforsecurity=False).digest()
    return str(uuid.UUID(bytes=digest[:16], version=5))


def normalize_step(step: object) -> tuple[int, ...]:
    """Turn an int or a sequence of ints into a validated step index tuple."""
    if type(step) is tuple and step and _INT_ONLY.issuperset(map(type, step)) and min(step) >= 0:
        return step  # already normalised
    parts: Sequence[object]
    if isinstance(step, int) and not isinstance(step, bool):
        parts = (step,)
    elif isinstance(step, Sequence) and not isinstance(step, (str, bytes)):
        parts = step
    else:
        raise InvalidKey(
            f"step index must be an int or a sequence of ints, got {type(step).__name__}"
        )
    if not parts:
        raise InvalidKey("step index must not be empty")
    out: list[int] = []
    for part in parts:
        if isinstance(part, bool) or not isinstance(part, int):
            raise InvalidKey(f"step index parts must be ints, got {part!r} in {step!r}")
        if part < 0:
            raise InvalidKey(f"step indexes must be >= 0, got {part} in {step!r}")
        out.append(int(part))
    return tuple(out)


def format_step(step: int | Sequence[int]) -> str:
    """Format a step index as the key's step label: ``step_003`` or ``step_003.001``."""
    return _label(normalize_step(step))


def _label_format(parts: int) -> str:
    return "step_" + ".".join(["%03d"] * parts)


# The label's format per number of index parts, built once (a key has room for fewer than 64).
_LABEL_FORMATS = tuple(_label_format(n) for n in range(64))


def _label(index: tuple[int, ...]) -> str:
    """The label of an index :func:`normalize_step` already validated (exact ints >= 0)."""
    parts = len(index)
    return (_LABEL_FORMATS[parts] if parts < 64 else _label_format(parts)) % index


def _parse_step(label: str, whole: str) -> tuple[int, ...]:
    match = _STEP.fullmatch(label)
    if match is None:
        raise InvalidKey(
            f"invalid step {label!r} in key {whole!r}: expected step_NNN or step_NNN.NNN"
        )
    parts = tuple(int(p) for p in label[len("step_") :].split("."))
    if format_step(parts) != label:
        raise InvalidKey(
            f"non-canonical step {label!r} in key {whole!r}: indexes are zero-padded "
            f"to exactly three digits, e.g. {format_step(parts)!r}"
        )
    return parts


def _parse_sf_string(value: str) -> str:
    """Decode an RFC 8941 sf-string (``"..."``), strictly."""
    if len(value) < 2 or not value.startswith('"') or not value.endswith('"'):
        raise InvalidKey(f"invalid sf-string header value {value[:80]!r}: missing quotes")
    out: list[str] = []
    body = value[1:-1]
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == "\\":
            if i + 1 >= len(body) or body[i + 1] not in '"\\':
                raise InvalidKey(
                    f'invalid sf-string header value {value[:80]!r}: only \\" and \\\\ '
                    "escapes are allowed"
                )
            out.append(body[i + 1])
            i += 2
            continue
        if ch == '"' or not (0x20 <= ord(ch) <= 0x7E):
            raise InvalidKey(
                f"invalid sf-string header value {value[:80]!r}: unescaped quote or "
                "non-printable character"
            )
        out.append(ch)
        i += 1
    return "".join(out)


# RFC 8941 parameters after an Item: ;key or ;key=bare-item (token, number, string, boolean).
_SF_PARAMS = re.compile(
    r"(?:;[ ]*[a-z*][a-z0-9_.*-]*(?:=(?:\?[01]|-?[0-9]{1,15}(?:\.[0-9]{1,3})?"
    r'|[A-Za-z*][!#$%&\'*+.^_`|~0-9A-Za-z:/-]*|"(?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*"))?)*'
)


def parse_sf_item(value: str) -> str:
    """The string of an RFC 8941 Item holding an sf-string, its parameters dropped.

    ``"k"`` and ``"k";x=1`` (parameters, which the IETF draft's syntax allows and
    which say nothing about the key) both give ``k``. Anything else after the
    closing quote, or a broken string, raises :class:`InvalidKey`.
    """
    end = 1
    while end < len(value):
        if value[end] == "\\":
            end += 2
            continue
        if value[end] == '"':
            break
        end += 1
    string, params = value[: end + 1], value[end + 1 :]
    if params and not _SF_PARAMS.fullmatch(params):
        raise InvalidKey(
            f"invalid sf-string header value {value[:80]!r}: after the quoted key only RFC "
            "8941 parameters (;name or ;name=value) may follow"
        )
    return _parse_sf_string(string)


@dataclass(frozen=True, slots=True)
class StepKey:
    """A parsed, validated ``Idempotency-Key``.

    ``str(key)`` gives the raw form; :meth:`header_value` gives the header in
    either style; :meth:`parse` accepts both.

    Words: a :class:`~agentkey.Step` is one tool call of a plan; its ``index`` is
    the tuple of ints (``(3, 1)``); its ``label`` is the text in the key
    (``step_003.001``).
    """

    plan_session_id: str
    index: tuple[int, ...]
    args_hash: str
    # The raw key, formatted once by __post_init__ (callers ask for it many times).
    _raw: str = field(init=False, repr=False, compare=False, default="")

    def __post_init__(self) -> None:
        validate_plan_session_id(self.plan_session_id)
        index = normalize_step(self.index)
        object.__setattr__(self, "index", index)
        if not isinstance(self.args_hash, str) or not _HASH.fullmatch(self.args_hash):
            raise InvalidKey(
                f"invalid args_hash {self.args_hash!r}: expected 64 lowercase hex digits "
                "(sha256 of the canonical JSON of the arguments)"
            )
        object.__setattr__(self, "_raw", raw_key(self.plan_session_id, index, self.args_hash))

    @classmethod
    def _trusted(cls, plan_session_id: str, index: tuple[int, ...], args_hash: str) -> StepKey:
        """A key from parts already validated (a plan's id, a normalised index, a digest).

        For the steps :meth:`PlanSession.step` makes, whose parts it just validated:
        skips re-validating them, not the key's length.
        """
        key = object.__new__(cls)
        _set = object.__setattr__
        _set(key, "plan_session_id", plan_session_id)
        _set(key, "index", index)
        _set(key, "args_hash", args_hash)
        _set(key, "_raw", raw_key(plan_session_id, index, args_hash))
        return key

    @classmethod
    def _parsed(
        cls, plan_session_id: str, index: tuple[int, ...], args_hash: str, raw: str
    ) -> StepKey:
        """The key ``raw``, whose parts one exact match of its canonical raw form already
        validated (the server's parse of the usual header): ``raw`` is the key as
        :func:`raw_key` writes it, at most ``MAX_KEY_LENGTH`` characters, so it is kept as
        is rather than written again."""
        key = object.__new__(cls)
        _set = object.__setattr__
        _set(key, "plan_session_id", plan_session_id)
        _set(key, "index", index)
        _set(key, "args_hash", args_hash)
        _set(key, "_raw", raw)
        return key

    @classmethod
    def build(
        cls,
        plan_session_id: str,
        step: int | Sequence[int],
        args: object,
        *,
        profile: Profile = "python",
    ) -> StepKey:
        """Compute the key of ``args`` at ``step`` of plan ``plan_session_id``."""
        validate_plan_session_id(plan_session_id)
        return cls(plan_session_id, normalize_step(step), args_hash(args, profile=profile))

    @classmethod
    def parse(cls, value: str) -> StepKey:
        """Parse a header value in ``raw`` or ``sf-string`` style."""
        if not isinstance(value, str):
            raise InvalidKey(f"Idempotency-Key must be a str, got {type(value).__name__}")
        if len(value) > MAX_KEY_LENGTH + 2:
            raise InvalidKey(
                f"Idempotency-Key is {len(value)} characters; at most {MAX_KEY_LENGTH} are allowed"
            )
        raw = parse_sf_item(value) if value.startswith('"') else value
        fields = raw.split(":")
        if len(fields) != 3:
            raise InvalidKey(
                f"invalid Idempotency-Key {raw[:80]!r}: expected "
                "<plan_session_id>:<step>:<args_hash>"
            )
        plan, label, digest = fields
        return cls(plan, _parse_step(label, raw), digest)

    @property
    def label(self) -> str:
        """The step's label as it appears in the key, e.g. ``step_003.001``."""
        return _label(self.index)

    def format(self) -> str:
        """The raw key: ``<plan_session_id>:<step>:<args_hash>``."""
        return self._raw

    def header_value(self, style: HeaderStyle = "raw") -> str:
        """The ``Idempotency-Key`` header value in ``raw``, ``sf-string`` or ``uuid`` style."""
        return header_value(self._raw, style)

    def __str__(self) -> str:
        return self._raw


def header_value(raw: str, style: HeaderStyle = "raw") -> str:
    """The ``Idempotency-Key`` header value of the raw key ``raw`` in ``style``.

    For a key already formatted (a step's ``idempotency_key``): no :class:`StepKey` needed.
    """
    if style == "raw":
        return raw
    if style == "sf-string":
        return f'"{raw}"'  # the key's alphabet needs no escaping
    if style == "uuid":
        return uuid_key(raw)
    raise ConfigurationError(
        f"unknown key header style {style!r}; use 'raw', 'sf-string' or 'uuid'"
    )


def raw_key(plan_session_id: str, index: tuple[int, ...], args_hash: str) -> str:
    """The raw key of parts already validated (a normalised index); checks only the length."""
    return key_prefix(plan_session_id, index) + args_hash


def key_prefix(plan_session_id: str, index: tuple[int, ...]) -> str:
    """``<plan_session_id>:<step>:``, the raw key before its hash, of parts already validated.

    Refuses an index whose key (with its 64-digit hash) would be too long.
    """
    prefix = f"{plan_session_id}:{_label(index)}:"
    if len(prefix) + 64 > MAX_KEY_LENGTH:
        raise InvalidKey(
            f"key for step {_label(index)} is longer than {MAX_KEY_LENGTH} "
            "characters; use a shorter plan session id or fewer sub-step levels"
        )
    return prefix


def uuid_key(key: str) -> str:
    """The ``uuid`` header style of the raw agentkey ``key``: its UUIDv5, lowercase.

    For servers that accept only UUIDs. The same key always gives the same UUID
    (so a retry, a restart or a replan with unchanged arguments sends the same
    value), and changed arguments give another one, as their key differs.
    """
    return str(uuid.uuid5(KEY_UUID_NAMESPACE, key))


def shown_key(key: str) -> str:
    """``key`` fit for a log line, a span attribute or an error message.

    An Idempotency-Key is a bearer secret: whoever holds it (and the principal's
    credentials) gets the stored answer. Shown, an agentkey key keeps its plan id
    and step label readable and replaces the ``args_hash`` by ``#`` and 8 hex
    digits of the SHA-256 of the whole key (``plan-1:step_003:#1a2b3c4d``); any
    other key (a UUID, ``ik_...``) is shown as ``#`` and those 8 digits alone.
    The digest lets two lines be matched to one key without revealing it.
    """
    text = key if isinstance(key, str) else str(key)
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    plan, sep, rest = text.partition(":")
    label, sep2, tail = rest.partition(":")
    if (
        sep
        and sep2
        and _PLAN_ID.fullmatch(plan)
        and _STEP.fullmatch(label)
        and _HASH.fullmatch(tail)
    ):
        return f"{plan}:{label}:#{digest}"
    return f"#{digest}"
