"""The MCP wire contract: the ``_meta`` fields and the typed refusals, shared by both halves.

A ``tools/call`` request carries the key in ``params._meta``::

    {"method": "tools/call", "params": {"name": "create_vm", "arguments": {...},
     "_meta": {"io.agentkey/idempotency-key": "<plan_session_id>:<step>:<args_hash>"}}}

The middleware also reads the key where other clients put it (:data:`KeyConvention`).
A result replayed from the store carries ``"io.agentkey/replayed": true`` in
its ``_meta``; every result of a protected tool, and the tool's entry in
``tools/list``, carries ``"io.agentkey/protected": true``. A refusal is a
JSON-RPC error whose ``data`` is an object with ``"type": "io.agentkey/<kind>"``
(and ``"retryAfter"`` in seconds for the transient kinds). Names follow MCP's
``_meta`` rule: a reverse-DNS prefix, a slash, then a name; nothing here uses
the reserved ``modelcontextprotocol`` or ``mcp`` prefixes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal, get_args

from ..._exceptions import ConfigurationError

__all__ = [
    "CONVENTIONS",
    "CONVENTIONS_FIELD",
    "ERROR_CODES",
    "FIELD_NAMES",
    "KEY_FIELD",
    "PREFIX",
    "PROTECTED_FIELD",
    "REPLAYED_FIELD",
    "KeyConvention",
    "RefusalKind",
    "check_conventions",
    "keys_in",
    "refusal_data",
    "refusal_of",
    "with_key",
    "without_keys",
]

#: The namespace of every field agentkey puts in ``_meta`` or in error data.
PREFIX: Final = "io.agentkey/"
#: ``params._meta`` field of a ``tools/call`` request: the idempotency key, as a string.
KEY_FIELD: Final = PREFIX + "idempotency-key"
#: ``result._meta`` field of a ``tools/call`` result: ``true`` when the stored result was replayed.
REPLAYED_FIELD: Final = PREFIX + "replayed"
#: ``_meta`` field of a ``tools/call`` result, and of a tool in ``tools/list``: ``true`` when
#: the server runs the tool at most once per key. Absent: the key was not honoured (the tool
#: is not protected), and a client must not resend what may have run.
PROTECTED_FIELD: Final = PREFIX + "protected"

#: ``_meta`` field of a protected tool in ``tools/list``: the key conventions the server reads
#: for it (a list of :data:`KeyConvention` names), so a client sends one of those.
CONVENTIONS_FIELD: Final = PREFIX + "key-conventions"

#: Where a ``tools/call`` may carry its idempotency key (every one is read by default):
#:
#: - ``agentkey``: ``params._meta["io.agentkey/idempotency-key"]`` (agentkey's own);
#: - ``sep-3182``: ``params.idempotencyKey`` (MCP's closed SEP-3182);
#: - ``sep-3182-meta``: ``params._meta.idempotencyKey`` (that proposal's earlier form);
#: - ``ucp``: ``arguments.meta["idempotency-key"]`` (UCP's checkout binding);
#: - ``argument``: ``arguments.idempotency_key`` (a plain tool argument).
#:
#: A key inside the arguments is not part of what it binds: the arguments are checked
#: (hashed) without it, and without a ``meta`` object that held only the key.
KeyConvention = Literal["agentkey", "sep-3182", "sep-3182-meta", "ucp", "argument"]
CONVENTIONS: Final[tuple[KeyConvention, ...]] = get_args(KeyConvention)
#: How each convention's field is named in messages (refusals name the fields).
FIELD_NAMES: Final[Mapping[str, str]] = {
    "agentkey": f"params._meta[{KEY_FIELD!r}]",
    "sep-3182": "params.idempotencyKey",
    "sep-3182-meta": "params._meta.idempotencyKey",
    "ucp": "arguments.meta['idempotency-key']",
    "argument": "arguments.idempotency_key",
}
_UCP_FIELD: Final = "idempotency-key"
_ARGUMENT_FIELD: Final = "idempotency_key"
_SEP_FIELD: Final = "idempotencyKey"

#: Why a server refused a ``tools/call`` (``data.type`` is ``PREFIX + kind``):
#:
#: - ``in-progress``: the same key is running; resend the same key after ``retryAfter``.
#: - ``unavailable``: the idempotency store cannot be reached; nothing ran; resend later.
#: - ``in-doubt``: an earlier call with this key may have started its side effect and did
#:   not finish (its server died, or it failed after the effect); nothing runs under the
#:   key until the server's reconcile hook or an operator settles it. Final for the client.
#: - ``key-required``: the server requires a key and the call had none.
#: - ``invalid-key``: the key is not a string of 1 to 255 printable ASCII characters, or
#:   the call carries different keys in two conventions (``data.fields`` names them).
#: - ``payload-mismatch``: the arguments do not hash to the key's ``args_hash``, or
#:   differ from the arguments first stored under this opaque key.
#: - ``key-reused``: the key is bound to another tool.
#: - ``unauthenticated``: the server scopes keys by caller and this call has none
#:   (no OAuth identity); nothing ran and nothing was looked up.
RefusalKind = Literal[
    "in-progress",
    "unavailable",
    "in-doubt",
    "key-required",
    "invalid-key",
    "payload-mismatch",
    "key-reused",
    "unauthenticated",
]
_KINDS: Final[frozenset[str]] = frozenset(get_args(RefusalKind))
_TRANSIENT: Final = frozenset({"in-progress", "unavailable"})

#: JSON-RPC error code per kind: a transient refusal is an internal error (-32603), a
#: refusal about the request is invalid params (-32602), for clients that read codes only.
ERROR_CODES: Final[Mapping[str, int]] = {
    kind: (-32603 if kind in _TRANSIENT else -32602) for kind in _KINDS
}


def refusal_data(kind: RefusalKind, *, retry_after: float | None = None) -> dict[str, Any]:
    """The ``data`` of the JSON-RPC error for a refusal of ``kind`` (never holds the key).

    ``unavailable`` carries the protected marker (only a protected tool is refused so):
    a client believes it (nothing ran) only with the marker, or from a tool the server
    marks protected in ``tools/list``."""
    data: dict[str, Any] = {"type": PREFIX + kind}
    if kind == "unavailable":
        data[PROTECTED_FIELD] = True
    if retry_after is not None:
        data["retryAfter"] = round(max(0.0, retry_after), 3)
    return data


def refusal_of(data: object) -> tuple[RefusalKind, float | None] | None:
    """``(kind, retry_after)`` when ``data`` is an agentkey refusal, else None.

    A ``retryAfter`` that is not a finite number >= 0 is ignored (backoff instead).
    """
    if not isinstance(data, Mapping):
        return None
    kind = data.get("type")
    if not isinstance(kind, str) or kind.removeprefix(PREFIX) not in _KINDS:
        return None
    if not kind.startswith(PREFIX):
        return None
    hint = data.get("retryAfter")
    retry_after: float | None = None
    if isinstance(hint, (int, float)) and not isinstance(hint, bool):
        value = float(hint)
        if math.isfinite(value) and value >= 0:
            retry_after = value
    return kind.removeprefix(PREFIX), retry_after  # type: ignore[return-value]


def check_conventions(value: object) -> tuple[KeyConvention, ...]:
    """``value`` as a tuple of convention names (in :data:`CONVENTIONS` order)."""
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
        raise ConfigurationError(
            f"key_conventions must be a collection of names out of {list(CONVENTIONS)}, "
            f"got {value!r}"
        )
    unknown = [name for name in value if name not in CONVENTIONS]
    if unknown or not value:
        raise ConfigurationError(
            f"key_conventions must name one or more of {list(CONVENTIONS)}, got {list(value)!r}"
        )
    return tuple(name for name in CONVENTIONS if name in value)


def keys_in(
    params: Mapping[str, Any], conventions: tuple[KeyConvention, ...]
) -> list[tuple[KeyConvention, object]]:
    """Each ``(convention, value)`` of ``conventions`` that the call's raw params carry."""
    found: list[tuple[KeyConvention, object]] = []
    meta = params.get("_meta")
    arguments = params.get("arguments")
    for name in conventions:
        value: object = None
        if name == "agentkey" and isinstance(meta, Mapping):
            value = meta.get(KEY_FIELD)
        elif name == "sep-3182":
            value = params.get(_SEP_FIELD)
        elif name == "sep-3182-meta" and isinstance(meta, Mapping):
            value = meta.get(_SEP_FIELD)
        elif name == "ucp" and isinstance(arguments, Mapping):
            inner = arguments.get("meta")
            value = inner.get(_UCP_FIELD) if isinstance(inner, Mapping) else None
        elif name == "argument" and isinstance(arguments, Mapping):
            value = arguments.get(_ARGUMENT_FIELD)
        if value is not None:
            found.append((name, value))
    return found


def without_keys(arguments: object, found: Sequence[KeyConvention]) -> object:
    """The arguments a key binds: those sent, without the key fields of ``found``.

    A ``meta`` object left empty by taking the UCP key out goes too, so the arguments
    hash as if the key had never been added."""
    if not isinstance(arguments, Mapping) or not {"ucp", "argument"} & set(found):
        return arguments
    plain = dict(arguments)
    if "argument" in found:
        plain.pop(_ARGUMENT_FIELD, None)
    inner = plain.get("meta")
    if "ucp" in found and isinstance(inner, Mapping):
        rest = {k: v for k, v in inner.items() if k != _UCP_FIELD}
        if rest:
            plain["meta"] = rest
        else:
            del plain["meta"]
    return plain


def with_key(
    convention: KeyConvention,
    key: str,
    arguments: Mapping[str, Any],
    meta: Mapping[str, Any],
    *,
    tool: str = "",
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(arguments, _meta, other params)`` of a call that carries ``key`` in ``convention``.

    Raises :class:`~agentkey.ConfigurationError`, and nothing is sent, when the field the
    convention writes already holds another value the caller put there (a tool's own
    ``idempotency_key`` argument, a UCP ``meta["idempotency-key"]``, a ``_meta`` key):
    the caller's value is never silently replaced by agentkey's key.
    """
    args, extra_meta, params = dict(arguments), dict(meta), {}
    _refuse_overwrite(convention, key, args, extra_meta, tool)
    if convention == "agentkey":
        extra_meta[KEY_FIELD] = key
    elif convention == "sep-3182":
        params[_SEP_FIELD] = key
    elif convention == "sep-3182-meta":
        extra_meta[_SEP_FIELD] = key
    elif convention == "ucp":
        inner = args.get("meta")
        args["meta"] = {**(inner if isinstance(inner, Mapping) else {}), _UCP_FIELD: key}
    else:
        args[_ARGUMENT_FIELD] = key
    return args, extra_meta, params


def _refuse_overwrite(
    convention: KeyConvention,
    key: str,
    args: Mapping[str, Any],
    meta: Mapping[str, Any],
    tool: str,
) -> None:
    """Raise when ``convention``'s field already holds a value other than ``key``."""
    held: object = None
    if convention == "agentkey":
        held = meta.get(KEY_FIELD)
    elif convention == "sep-3182-meta":
        held = meta.get(_SEP_FIELD)
    elif convention == "ucp":
        inner = args.get("meta")
        held = inner.get(_UCP_FIELD) if isinstance(inner, Mapping) else None
        if inner is not None and not isinstance(inner, Mapping):
            held = inner  # a "meta" argument that is not an object cannot take the key
    elif convention == "argument":
        held = args.get(_ARGUMENT_FIELD)
    if held is None or held == key:
        return
    named = f"tool {tool!r}" if tool else "the tool"
    raise ConfigurationError(
        f"not sent: the server reads the idempotency key of {named} from "
        f"{FIELD_NAMES[convention]} (key convention {convention!r}), and the call already "
        "carries a value of its own there; agentkey will not overwrite it. Leave that "
        "field out of the call (agentkey puts its key there), or have the server read "
        "another convention (IdempotentToolsMiddleware(key_conventions=[...]) without "
        f"{convention!r}) if the value is the tool's own business argument"
    )
