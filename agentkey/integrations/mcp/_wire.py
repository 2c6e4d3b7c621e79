"""The MCP wire contract: the ``_meta`` fields and the typed refusals, shared by both halves.

A ``tools/call`` request carries the key in ``params._meta``::

    {"method": "tools/call", "params": {"name": "create_vm", "arguments": {...},
     "_meta": {"io.agentkey/idempotency-key": "<plan_session_id>:<step>:<args_hash>"}}}

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
from collections.abc import Mapping
from typing import Any, Final, Literal, get_args

__all__ = [
    "ERROR_CODES",
    "KEY_FIELD",
    "PREFIX",
    "PROTECTED_FIELD",
    "REPLAYED_FIELD",
    "RefusalKind",
    "refusal_data",
    "refusal_of",
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

#: Why a server refused a ``tools/call`` (``data.type`` is ``PREFIX + kind``):
#:
#: - ``in-progress``: the same key is running; resend the same key after ``retryAfter``.
#: - ``unavailable``: the idempotency store cannot be reached; nothing ran; resend later.
#: - ``in-doubt``: an earlier call with this key may have started its side effect and did
#:   not finish (its server died, or it failed after the effect); nothing runs under the
#:   key until the server's reconcile hook or an operator settles it. Final for the client.
#: - ``key-required``: the server requires a key and the call had none.
#: - ``invalid-key``: the key is not a string of 1 to 255 printable ASCII characters.
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
