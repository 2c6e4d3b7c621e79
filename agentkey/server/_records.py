"""The stored record: one encoding, decoded in one place.

```
P:<owner>:<started_ms>:<lease_end_ms>:<renew_ms>:<binding>:<phase>:<operation>
                                           IN_PROGRESS (v3); phase c: claimed, s: may have
                                           started, d: in doubt (since lease_end_ms)
P:<owner>:<started_ms>:<lease_end_ms>:<renew_ms>:<binding>  IN_PROGRESS (v2, read as claimed)
P:<owner>:<started_ms>                                      IN_PROGRESS (v1, still read)
C:<json>\n<body>                           COMPLETED  status, headers; the body's bytes or
                                                      a blob URI in the JSON (v3)
F:<json>\n<body>                           FAILED     the mutation began, did not finish
C:<json> / F:<json>                        v2, still read: the body base64 in the JSON
```

- The owner token fences every later write: a store compares the prefix
  ``P:<owner>:`` and never parses a record.
- ``lease_end_ms`` is when the claim clears unless renewed (a renewal rewrites the
  record); ``renew_ms`` is how often its holder renews it (0: it does not).
- ``<phase>``: ``c`` the handler has not begun its side effect (the record lives one
  lease; when it lapses the key is free), ``s`` it may have begun (the record lives as
  long as a result; when its lease lapses the key is *in doubt*), ``d`` in doubt: the
  handler failed after it may have begun, or its lease lapsed and a reconcile hook
  could not tell. ``<operation>`` is the method and route (MCP: the tool), quoted, for
  operators who list what is in doubt; the binding's digest is what is compared.
- ``<binding>`` is what the key is bound to (:class:`Binding`): a digest of the
  method and route path, and for an opaque key a digest of the body: of its bytes
  (``bytes:<body>``, the default) or of its canonical JSON (``json:<canonical>``,
  the middleware's ``body_fingerprint="canonical"``, and every JSON-object body
  before bytes became the default). The digest does not say which; a request whose
  body's bytes digest differs from a record's is compared by its canonical digest too.
  The outcome's JSON carries it as ``"fp"``. Records written before bindings
  existed (v1) have none and replay as they always did.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _quote
from typing import Literal
from urllib.parse import quote, unquote

from .._exceptions import StoreError
from .._keys import shown_key

__all__ = [
    "Binding",
    "InProgress",
    "Phase",
    "StoredOutcome",
    "decode_record",
    "digest",
    "encode_in_progress",
    "encode_outcome",
]

_OWNER = re.compile(r"[0-9a-f]{32}")
_JSON = json.JSONDecoder()  # json.loads's own decoder (no options): built once
_RAW_DECODE = _JSON.raw_decode  # documented: the object at the start, and its end
#: What a stored header's name and value may hold: latin-1 text (what the app's header
#: bytes decode to) without CR, LF or NUL, which would split or end the answer's head.
_FIELD_TEXT = re.compile(r"[^\r\n\x00\u0100-\U0010ffff]*")
_DIGEST = re.compile(r"[A-Za-z0-9_-]{22}")


def digest(data: bytes) -> str:
    """A compact digest for a binding: 128 bits of SHA-256, base64url (22 characters)."""
    return digest_of(hashlib.sha256(data).digest())


def digest_of(sha256: bytes) -> str:
    """:func:`digest` of data whose SHA-256 is ``sha256`` (computed in chunks)."""
    return base64.urlsafe_b64encode(sha256[:16]).decode("ascii")[:22]


@dataclass(frozen=True, slots=True)
class Binding:
    """The one operation a key belongs to.

    ``route``: digest of ``"<METHOD> <route path>"``; ``body``: digest of the
    body (its bytes, or its canonical JSON), kept for opaque keys only (an agentkey
    key carries its own ``args_hash``).
    """

    route: str
    body: str | None = None

    def encode(self) -> str:
        return self.route if self.body is None else f"{self.route}.{self.body}"

    @classmethod
    def decode(cls, text: str) -> Binding:
        known = _ROUTE_BINDINGS.get(text)
        if known is not None:
            return known
        route, dot, body = text.partition(".")
        if not _DIGEST.fullmatch(route) or (dot and not _DIGEST.fullmatch(body)):
            raise ValueError("bad binding")
        if dot:
            return cls(route, body)
        # A route alone (every agentkey key's binding): a server sees few routes, and
        # each on every replay, so their bindings are kept, a bounded number of them.
        binding = cls(route)
        if len(_ROUTE_BINDINGS) >= 1024:
            _ROUTE_BINDINGS.clear()
        _ROUTE_BINDINGS[text] = binding
        return binding


_ROUTE_BINDINGS: dict[str, Binding] = {}


#: ``claimed``: nothing has started; ``started``: the side effect may have started;
#: ``in_doubt``: it may have started and did not finish (settled by a reconcile or a person).
Phase = Literal["claimed", "started", "in_doubt"]
_PHASE_CHAR: dict[str, str] = {"claimed": "c", "started": "s", "in_doubt": "d"}
_CHAR_PHASE: dict[str, Phase] = {"c": "claimed", "s": "started", "d": "in_doubt"}


@dataclass(frozen=True, slots=True)
class InProgress:
    """A claim held by ``owner`` since ``started_ms`` (Unix milliseconds).

    ``lease_end_ms`` and ``renew_ms`` are 0 and ``binding`` None in a v1 record; a v1
    or v2 record is ``claimed`` (written before phases existed). In doubt,
    ``lease_end_ms`` is when the key became in doubt.
    """

    owner: str
    started_ms: int
    lease_end_ms: int = 0
    renew_ms: int = 0
    binding: Binding | None = None
    phase: Phase = "claimed"
    operation: str = ""

    def in_doubt(self, now_ms: int) -> bool:
        """Whether the key is in doubt at ``now_ms``: marked so, or its handler may have
        started and its lease lapsed (the process died, or could not renew)."""
        if self.phase == "in_doubt":
            return True
        return self.phase == "started" and 0 < self.lease_end_ms <= now_ms


@dataclass(frozen=True, slots=True)
class StoredOutcome:
    """A finished step: what is replayed for every later request with the key."""

    state: Literal["COMPLETED", "FAILED"]
    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes = b""
    blob_uri: str | None = None
    finished_ms: int = 0
    binding: Binding | None = None


def encode_in_progress(
    owner: str,
    started_ms: int,
    *,
    lease_end_ms: int = 0,
    renew_ms: int = 0,
    binding: Binding | None = None,
    phase: Phase = "claimed",
    operation: str = "",
) -> bytes:
    if not _OWNER.fullmatch(owner):
        raise ValueError("owner tokens are 32 lowercase hex digits")
    if binding is None:
        return f"P:{owner}:{started_ms}".encode("ascii")
    head = f"P:{owner}:{started_ms}:{lease_end_ms}:{renew_ms}:{binding.encode()}"
    if phase == "claimed" and not operation:
        return head.encode("ascii")
    op = _QUOTED.get(operation)
    if op is None:
        op = quote(operation, safe=" /")
        if len(operation) <= _CACHED_OPERATION:  # a client's long path is quoted each time
            if len(_QUOTED) >= 1024:
                _QUOTED.clear()
            _QUOTED[operation] = op
    return f"{head}:{_PHASE_CHAR[phase]}:{op}".encode("ascii")


# The operations of claims (``POST /charges``) as records quote them: few, each on every
# claim and renewal, so kept, a bounded number of them, each short (operations come from
# clients: a long one, quoted up to 9 bytes a character, would make the cache a client's).
_QUOTED: dict[str, str] = {}
_CACHED_OPERATION = 256


def encode_outcome(outcome: StoredOutcome) -> bytes:
    """v3: the JSON head (ASCII, so never a raw newline), a newline, the body's bytes.

    The head is what ``json.dumps(doc, separators=(",", ":"))`` writes for
    ``{"v": 3, "status", "headers", "finished_ms"[, "blob"][, "fp"]}``, formatted
    directly: it is written once per request, and the generic encoder costs three
    times as much for these few fields.
    """
    headers = ",".join([f"[{_quote(k)},{_quote(v)}]" for k, v in outcome.headers])
    extra = "" if outcome.blob_uri is None else ',"blob":' + _quote(outcome.blob_uri)
    if outcome.binding is not None:
        extra += ',"fp":' + _quote(outcome.binding.encode())
    head = (
        f'{{"v":3,"status":{int(outcome.status)},"headers":[{headers}],'
        f'"finished_ms":{int(outcome.finished_ms)}{extra}}}'
    )
    tag = b"C:" if outcome.state == "COMPLETED" else b"F:"
    return b"%s%s\n%s" % (tag, head.encode("ascii"), outcome.body)


def decode_record(value: bytes, *, key: str) -> InProgress | StoredOutcome:
    """Decode a stored value; a value this module did not write raises StoreError.

    ``key`` (the Idempotency-Key) is named in that error in its redacted form only.
    """
    try:
        if value.startswith(b"P:"):
            fields = value.decode("ascii").split(":")
            if not _OWNER.fullmatch(fields[1]):
                raise ValueError("bad owner")
            if len(fields) == 3:  # v1
                return InProgress(fields[1], int(fields[2]))
            if len(fields) == 6:  # v2
                _, owner, started, lease_end, renew, binding = fields
                return InProgress(
                    owner, int(started), int(lease_end), int(renew), Binding.decode(binding)
                )
            _, owner, started, lease_end, renew, binding, phase = fields[:7]
            return InProgress(
                owner,
                int(started),
                int(lease_end),
                int(renew),
                Binding.decode(binding),
                _CHAR_PHASE[phase],
                unquote(":".join(fields[7:])),
            )
        if value[:2] in (b"C:", b"F:"):
            head, newline, body = value[2:].partition(b"\n")
            # What json.loads(head) does, without its encoding detection: a head opening
            # with "{" then a non-NUL byte is UTF-8 (what detect_encoding says of it).
            if head[:1] == b"{" and head[1:2] != b"\x00":
                text = head.decode("utf-8", "surrogatepass")
                # What _JSON.decode does for a head with nothing after its object (as
                # every writer of records writes it), without its two whitespace matches.
                doc, end = _RAW_DECODE(text)
                if end != len(text):
                    doc = _JSON.decode(text)  # raises ValueError, or reads trailing spaces
            else:
                doc = json.loads(head)
            if not newline:  # v2: the body base64 inside the JSON
                body = base64.b64decode(doc["body"], validate=True)
            headers = tuple([(str(k), str(v)) for k, v in doc["headers"]])
            if not _FIELD_TEXT.fullmatch("".join([k + v for k, v in headers])):
                # Not latin-1 (the app's headers come as bytes), or CR, LF, NUL: not
                # written by agentkey from an answer a server could send.
                raise ValueError("a stored header is not HTTP field text")
            blob = doc.get("blob")
            fp = doc.get("fp")
            return StoredOutcome(
                "COMPLETED" if value[:1] == b"C" else "FAILED",
                int(doc["status"]),
                headers,
                body,
                None if blob is None else str(blob),
                int(doc.get("finished_ms", 0)),
                None if fp is None else Binding.decode(str(fp)),
            )
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, OverflowError, RecursionError):
        pass  # a status of 1e400, JSON nested past the recursion limit: not ours either
    raise StoreError(
        f"the stored record for {shown_key(key)!r} is not an agentkey record; something else wrote "
        "to the store's key space. Use a dedicated prefix or database for agentkey"
    )
