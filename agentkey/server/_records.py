"""The stored record: one encoding, decoded in one place.

```
P:<owner>:<started_ms>        IN_PROGRESS  (the owner token fences every later write)
C:<json>                      COMPLETED    status, chosen headers, body or blob URI
F:<json>                      FAILED       the mutation started and did not finish
```
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from typing import Literal

from .._exceptions import StoreError

__all__ = ["InProgress", "Outcome", "decode_record", "encode_in_progress", "encode_outcome"]

_OWNER = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True, slots=True)
class InProgress:
    """A claim held by ``owner`` since ``started_ms`` (Unix milliseconds)."""

    owner: str
    started_ms: int


@dataclass(frozen=True, slots=True)
class Outcome:
    """A finished step: what is replayed for every later request with the key."""

    state: Literal["COMPLETED", "FAILED"]
    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes = b""
    blob_uri: str | None = None
    finished_ms: int = 0


def encode_in_progress(owner: str, started_ms: int) -> bytes:
    if not _OWNER.fullmatch(owner):
        raise ValueError("owner tokens are 32 lowercase hex digits")
    return f"P:{owner}:{started_ms}".encode("ascii")


def encode_outcome(outcome: Outcome) -> bytes:
    doc = {
        "v": 1,
        "status": outcome.status,
        "headers": [list(h) for h in outcome.headers],
        "body": base64.b64encode(outcome.body).decode("ascii"),
        "blob": outcome.blob_uri,
        "finished_ms": outcome.finished_ms,
    }
    tag = b"C:" if outcome.state == "COMPLETED" else b"F:"
    return tag + json.dumps(doc, separators=(",", ":")).encode("ascii")


def decode_record(value: bytes, *, key: str) -> InProgress | Outcome:
    """Decode a stored value; a value this module did not write raises StoreError."""
    try:
        if value.startswith(b"P:"):
            _, owner, started = value.decode("ascii").split(":")
            if not _OWNER.fullmatch(owner):
                raise ValueError("bad owner")
            return InProgress(owner, int(started))
        if value[:2] in (b"C:", b"F:"):
            doc = json.loads(value[2:])
            headers = tuple((str(k), str(v)) for k, v in doc["headers"])
            blob = doc.get("blob")
            return Outcome(
                "COMPLETED" if value[:1] == b"C" else "FAILED",
                int(doc["status"]),
                headers,
                base64.b64decode(doc["body"], validate=True),
                None if blob is None else str(blob),
                int(doc.get("finished_ms", 0)),
            )
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        pass
    raise StoreError(
        f"the stored record for {key!r} is not an agentkey record; something else wrote "
        "to the store's key space. Use a dedicated prefix or database for agentkey"
    )
