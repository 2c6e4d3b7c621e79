"""The server's decision table, pure: no ASGI, no I/O, no store calls, no clock.

Every front end (the HTTP middleware, an MCP ``tools/call`` server, a queue
consumer) drives the same three decisions and does the I/O between them::

    check_request(key_values, operation, body)      ─▶ Reject | Checked
        the front end resolves the principal, then
        store.claim(checked.record_key(principal), claim.in_progress_record())
    on_claimed(existing | StoreError, checked, ...)  ─▶ Run | Replay | Conflict | Unavailable
        Run: run the tool (renew the claim first when ``Run.renew``)          | Reject
    on_finished(status, headers, body, ...)          ─▶ Complete | Fail | Release
        Complete / Fail: store.finish(record_key, owner, encode_outcome(outcome))
        (a blob store first when ``offload``); Release: store.release(record_key, owner)

What the inputs are, for a front end that is not HTTP:

``key_values``
    Every value the request carries for the key (HTTP: each ``Idempotency-Key``
    header; MCP: the one ``_meta`` field), as ``bytes`` or ``str``. None or
    empty means missing; two or more are refused. Raw and RFC 8941
    ``sf-string`` forms name the same key.
``operation``
    What the key is bound to, as a tuple of strings joined by one space before
    hashing: HTTP passes ``(METHOD, root_path + route path)``, MCP passes
    ``("tools/call", tool_name)``, a queue ``("queue", topic)``. The same key
    under another operation is refused with ``422 key_reused``, never replayed.
``body``
    The exact request bytes. An agentkey key (``<plan>:<step>:<args_hash>``)
    needs a body whose bytes hash to ``args_hash`` (taken as they are, unparsed),
    or else a JSON object whose canonical JSON does: an MCP front end passes the
    canonical JSON of the tool's arguments. An opaque key (a UUID, ``ik_...``) is
    bound to a digest of the body's bytes (``body_fingerprint="bytes"``, the default:
    a retry must resend the same bytes), or with ``body_fingerprint="canonical"`` to
    a digest of the canonical body (equivalent JSON is one body; a body that is not
    a JSON object is bound by its bytes). A record written under the canonical kind
    (the only one before bytes became the default) still matches the same body.

Every result is a frozen record of what to send: problems (:class:`Reject`,
:class:`Conflict`, :class:`Unavailable`) carry ``status``, ``code``,
``headers`` and an RFC 9457 ``body``; :class:`Replay` carries the stored
outcome (fetch ``blob_uri`` from the blob store when set; mark the answer as a
replay: HTTP sends ``Idempotent-Replayed: true``). :class:`DecisionEvent` is
what a front end reports to its ``hooks``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import quote

from .._canonical import Profile, canonical_json
from .._exceptions import ConfigurationError, InvalidArguments, InvalidKey, StoreError
from .._keys import MAX_KEY_LENGTH, StepKey, parse_sf_item, shown_key
from ._records import Binding, InProgress, StoredOutcome, decode_record, digest, digest_of

__all__ = [
    "PROBLEM_DOCS",
    "PROBLEM_TYPE",
    "REPLAY_HEADER",
    "BodyFingerprint",
    "Checked",
    "Complete",
    "Conflict",
    "DecisionEvent",
    "Doubt",
    "Fail",
    "InDoubt",
    "KeyFormat",
    "OpaqueKey",
    "Problem",
    "Reject",
    "Release",
    "Replay",
    "Run",
    "Unavailable",
    "body_too_large",
    "check_body",
    "check_replay_header",
    "check_request",
    "in_progress_retry_after",
    "is_storable",
    "on_claimed",
    "on_finished",
    "parse_key",
    "record_key",
    "replay_headers",
    "stored_headers",
    "unauthenticated",
    "unavailable",
]

KeyFormat = Literal["any", "agentkey"]
#: What an opaque key's body fingerprint digests: the body's bytes as sent, or its
#: canonical JSON (equivalent JSON is one body; it costs a parse of every body).
BodyFingerprint = Literal["bytes", "canonical"]

#: The header every replayed HTTP answer carries (the middleware's ``replay_header``).
REPLAY_HEADER = "Idempotent-Replayed"
PROBLEM_TYPE = "application/problem+json"
#: Where the problems of 400, 409 and 422 are explained: sent as ``Link: <...>;
#: rel="describedby"``, as the IETF idempotency-key draft suggests for its error answers.
PROBLEM_DOCS = "https://github.com/agentkey-idempotency/agentkey/blob/main/docs/protocol.md"
_LINKED = frozenset({400, 409, 422})
_LINK = f'<{PROBLEM_DOCS}>; rel="describedby"; type="text/html"'
# RFC 9110 token: what a header field name may be.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")

_NOT_STORED = frozenset({401, 403, 408, 409, 429})
# Redirects that resend the same request elsewhere (a trailing-slash fix-up, a moved
# route): the request did not run here, and the client follows them with the same key.
_RESENT_ELSEWHERE = frozenset({307, 308})
# Never stored or replayed: per-connection, recomputed, or credentials.
_DROP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authenticate",
        "proxy-authorization",
        "content-length",
        "date",
        "server",
        "set-cookie",
        REPLAY_HEADER.lower(),
    }
)
_MAX_PRINCIPAL = 128
_PRINTABLE = re.compile(r"[\x20-\x7e]+")
# An agentkey key in raw form, each step index as format_step writes it (StepKey.parse's
# rules in one match; anything else goes through StepKey.parse for its precise message).
_INDEX = r"(?:[0-9]{3}|[1-9][0-9]{3,})"
_RAW_KEY = re.compile(rf"([A-Za-z0-9._~-]{{1,64}}):step_({_INDEX}(?:\.{_INDEX})*):([0-9a-f]{{64}})")
_OPAQUE_RULE = (
    f"an Idempotency-Key is 1 to {MAX_KEY_LENGTH} printable ASCII characters; a key of "
    "three ':'-separated parts whose middle starts with 'step_' or whose last is 64 hex "
    "digits must be an agentkey key <plan_session_id>:<step>:<args_hash>"
)
# What claims agentkey's key format (and so must parse as one): three ':'-separated parts,
# the middle a step label (``step_...``) or the last a 64-hex digest in either case.
_CLAIMS_STEP = re.compile(r"step_", re.IGNORECASE)
_CLAIMS_HASH = re.compile(r"[0-9a-fA-F]{64}")
_TITLES = {
    "idempotency_key_missing": "Idempotency-Key missing",
    "idempotency_key_invalid": "Idempotency-Key malformed",
    "body_not_json": "Request body is not a JSON object",
    "body_too_large": "Request body too large",
    "args_hash_mismatch": "Request body does not match the key's args_hash",
    "payload_mismatch": "Idempotency-Key reused with another request body",
    "key_reused": "Idempotency-Key reused for another operation",
    "in_progress": "A request with this Idempotency-Key is in progress",
    "store_unavailable": "Idempotency store unavailable",
    "not_run": "The request was refused and did not run",
    "not_finished": "The request did not finish; its outcome is kept under the key",
    "in_doubt": "An earlier request with this Idempotency-Key may have run and did not finish",
    "step_failed": "The step failed after its side effect began",
    "unauthenticated": "Authentication required",
    "response_too_large": "The answer was too large to record",
}


# --- results ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Problem:
    """A refusal the front end sends as is: ``status``, ``headers``, ``body``.

    ``body`` is RFC 9457 problem details (``type`` = ``urn:agentkey:problem:<code>``)
    with an ``"error": <code>`` member; ``retry_after`` (seconds) goes into a
    ``Retry-After`` header.
    """

    status: int
    code: str
    detail: str
    retry_after: int | None = None
    extra: tuple[tuple[str, int], ...] = ()

    @property
    def headers(self) -> tuple[tuple[str, str], ...]:
        headers: tuple[tuple[str, str], ...] = (("content-type", PROBLEM_TYPE),)
        if self.retry_after is not None:
            headers += (("retry-after", str(self.retry_after)),)
        if self.status in _LINKED:
            headers += (("link", _LINK),)
        return headers

    @property
    def body(self) -> bytes:
        return problem_body(self.status, self.code, self.detail, dict(self.extra))


@dataclass(frozen=True, slots=True)
class Reject(Problem):
    """The request is refused before anything runs (400, 413, 422): final for the client."""


@dataclass(frozen=True, slots=True)
class Conflict(Problem):
    """409: another request holds the key; the client resends after ``retry_after``."""


@dataclass(frozen=True, slots=True)
class Unavailable(Problem):
    """503: the store failed; nothing ran. ``cause`` is for the log, never sent."""

    cause: str = ""


@dataclass(frozen=True, slots=True)
class InDoubt(Problem):
    """409 ``in_doubt``: an earlier request with the key may have started its side effect
    and did not finish. Final for the client (no ``Retry-After``): nothing runs under the
    key until a reconcile hook or an operator settles it. ``record`` is the record met."""

    record: InProgress | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Checked:
    """A request whose key and body agree: claim ``record_key(principal)``."""

    key: StepKey | OpaqueKey
    binding: Binding
    #: An opaque key's body, in its chunks: a record whose body fingerprint is of the
    #: other kind (bytes, canonical) is compared with that digest of this body,
    #: computed only then (:meth:`same_body`). None for an agentkey key.
    body: tuple[bytes, ...] | None = field(default=None, compare=False, repr=False)
    body_fingerprint: BodyFingerprint = field(default="bytes", compare=False, repr=False)
    hash_profile: Profile = field(default="python", compare=False, repr=False)

    @property
    def idempotency_key(self) -> str:
        """The key as received (an sf-string unquoted)."""
        return self.key.format()

    @property
    def where(self) -> str:
        """``step step_003`` for an agentkey key, else ``the operation`` (for messages)."""
        return f"step {self.key.label}" if isinstance(self.key, StepKey) else "the operation"

    def record_key(self, principal: str) -> str:
        """The store key of this request for ``principal``: see :func:`record_key`."""
        return record_key(principal, self.key)

    def same_body(self, stored: str | None) -> bool:
        """Whether a record's body fingerprint ``stored`` names this request's body.

        Equal to ours, or to our body's digest of the other kind: a record written
        under canonical fingerprints (``body_fingerprint="canonical"``, or by a version
        before bytes were the default) whose request had the same arguments, or one
        written under bytes fingerprints with the same bytes. That digest is computed
        only here, on a mismatch: a request that matches its record's kind never
        parses its body for it. Never true for another body.
        """
        if stored == self.binding.body:
            return True
        if stored is None or self.body is None:
            return False
        if self.body_fingerprint == "canonical":
            return _bytes_digest(self.body) == stored
        return _canonical_digest(b"".join(self.body), self.hash_profile) == stored


@dataclass(frozen=True, slots=True)
class Run:
    """The key is ours: run the tool. ``renew``: the store re-sent our own claim, so
    its lease started earlier; renew it before running."""

    renew: bool = False


@dataclass(frozen=True, slots=True)
class Replay:
    """Send the stored outcome, marked as a replay (fetch ``blob_uri`` when set)."""

    outcome: StoredOutcome

    @property
    def status(self) -> int:
        return self.outcome.status

    @property
    def headers(self) -> tuple[tuple[str, str], ...]:
        return self.outcome.headers

    @property
    def body(self) -> bytes:
        return self.outcome.body

    @property
    def blob_uri(self) -> str | None:
        return self.outcome.blob_uri


_RUN = Run()  # immutable: every fresh claim's decision is this one


def check_replay_header(name: object) -> str:
    """``name`` as a replay header name (lowercase), or a ConfigurationError."""
    if not isinstance(name, str) or not _TOKEN.fullmatch(name) or len(name) > 64:
        raise ConfigurationError(
            f"replay_header must be an HTTP header name such as {REPLAY_HEADER!r} or "
            f"'X-Idempotent-Replayed', got {name!r}"
        )
    return name.lower()


def replay_headers(
    replay: Replay, name: str = "idempotent-replayed"
) -> tuple[tuple[str, str], ...]:
    """The stored headers of ``replay`` marked with ``name: true`` (a lowercase name).

    A stored header of that name (the app's own) is dropped, so the answer says it once.
    """
    stored = replay.headers
    for k, _ in stored:
        if k == name:
            return (*_without(stored, name), (name, "true"))
    return (*stored, (name, "true"))


def _without(headers: tuple[tuple[str, str], ...], name: str) -> tuple[tuple[str, str], ...]:
    # Apart from replay_headers: a comprehension there would make every call build a cell.
    return tuple((k, v) for k, v in headers if k != name)


@dataclass(frozen=True, slots=True)
class Complete:
    """Store ``outcome`` (COMPLETED). ``offload``: its body goes to the blob store."""

    outcome: StoredOutcome
    offload: bool = False


@dataclass(frozen=True, slots=True)
class Fail:
    """Store ``outcome`` (FAILED): the side effect began and did not finish."""

    outcome: StoredOutcome
    offload: bool = False


@dataclass(frozen=True, slots=True)
class Release:
    """Delete the claim: the tool failed before its side effect, a retry is safe."""


@dataclass(frozen=True, slots=True)
class Doubt:
    """Mark the claim in doubt: the tool failed (a 5xx, an exception) after it may have
    started its side effect, without saying it had. Every later request gets
    :func:`in_doubt` until a reconcile hook or an operator settles the key."""


@dataclass(frozen=True, slots=True)
class DecisionEvent:
    """What a front end decided for one request, reported once to each hook.

    ``decision``: ``claimed`` (the tool ran and its answer was recorded), ``failed``
    (it ran; FAILED recorded), ``released`` (it ran and failed before its side
    effect), ``in_doubt`` (it ran and failed after it may have started, or a request
    met a key in doubt: 409), ``replay``, ``conflict`` (409), ``mismatch`` (422 key_reused or
    payload_mismatch), ``rejected`` (400/413/422 before any claim),
    ``unavailable`` (503) or ``passthrough`` (not protected). ``route`` is the
    path as the router matches it (MCP: the tool name). Never a body or a token.
    ``idempotency_key`` is the whole key; the event's ``repr`` shows it redacted
    (:func:`agentkey._keys.shown_key`), so an event written to a log keeps it secret.
    """

    decision: str
    method: str
    route: str
    idempotency_key: str | None
    status_code: int

    def __repr__(self) -> str:
        # A key is a bearer secret: an event that reaches a log shows its redacted form.
        key = None if self.idempotency_key is None else shown_key(self.idempotency_key)
        return (
            f"DecisionEvent(decision={self.decision!r}, method={self.method!r}, "
            f"route={self.route!r}, idempotency_key={key!r}, status_code={self.status_code})"
        )


# --- the decisions ------------------------------------------------------------------


def parse_key(
    values: Sequence[bytes | str] | None, *, key_format: KeyFormat = "any"
) -> Reject | StepKey | OpaqueKey:
    """The key, or a 400. Two values, non-ASCII, or a malformed agentkey key: 400."""
    if not values:
        return Reject(
            400,
            "idempotency_key_missing",
            "this endpoint needs an Idempotency-Key header: "
            + (
                "<plan_session_id>:<step>:<args_hash>"
                if key_format == "agentkey"
                else "a unique value per operation, such as a UUID or "
                "<plan_session_id>:<step>:<args_hash>"
            ),
        )
    parsed = _parse_key(values, opaque=key_format == "any")
    if isinstance(parsed, str):
        return Reject(400, "idempotency_key_invalid", parsed)
    return parsed


def check_body(
    key: StepKey | OpaqueKey,
    operation: Sequence[str],
    body: bytes | Sequence[bytes],
    *,
    hash_profile: Profile = "python",
    body_fingerprint: BodyFingerprint = "bytes",
) -> Reject | Checked:
    """Bind ``key`` to ``operation``; an agentkey key's ``args_hash`` must match ``body``.

    ``body`` is the request's bytes, whole or in the chunks they came in. A body
    whose bytes hash to ``args_hash`` (what an agentkey client sends) is accepted
    as it is, unparsed and unjoined: the key names exactly these bytes, so no
    parser can read two meanings into one key, and the handler parses it once. Any
    other body must be a JSON object whose canonical JSON hashes to ``args_hash``.
    """
    route = _route_binding(tuple(operation))
    chunks = (body,) if isinstance(body, bytes) else body
    if isinstance(key, StepKey):
        if len(chunks) == 1:
            hashed = hashlib.sha256(chunks[0]).hexdigest()
        else:
            sha = hashlib.sha256()
            for chunk in chunks:
                sha.update(chunk)
            hashed = sha.hexdigest()
        if hashed == key.args_hash:
            return Checked(key, route)
        rejected = _check_body(b"".join(chunks), key, hash_profile)
        if rejected is not None:
            return Reject(*rejected)
        return Checked(key, route)
    chunks = tuple(chunks)
    if body_fingerprint == "canonical":
        fingerprint = _canonical_digest(b"".join(chunks), hash_profile) or _bytes_digest(chunks)
    else:
        fingerprint = _bytes_digest(chunks)
    return Checked(key, Binding(route.route, fingerprint), chunks, body_fingerprint, hash_profile)


_ROUTES: dict[tuple[str, ...], Binding] = {}
_MAX_ROUTES = 1024  # paths come from clients: the cache of their digests stays bounded,
_CACHED_ROUTE = 512  # and so does each entry's size (bytes of the operation)


def _route_binding(operation: tuple[str, ...]) -> Binding:
    """The binding of ``operation`` alone (its route digest, no body), made once per
    distinct route: a binding is immutable, so every request of the route shares it."""
    route = _ROUTES.get(operation)
    if route is None:
        text = " ".join(operation).encode("utf-8", "surrogatepass")
        route = Binding(digest(text))
        if len(text) <= _CACHED_ROUTE:  # a client's long path is not kept
            if len(_ROUTES) >= _MAX_ROUTES:
                _ROUTES.clear()
            _ROUTES[operation] = route
    return route


def check_request(
    values: Sequence[bytes | str] | None,
    operation: Sequence[str],
    body: bytes,
    *,
    key_format: KeyFormat = "any",
    hash_profile: Profile = "python",
    body_fingerprint: BodyFingerprint = "bytes",
) -> Reject | Checked:
    """:func:`parse_key` then :func:`check_body`, for a front end that has the body at once."""
    key = parse_key(values, key_format=key_format)
    if isinstance(key, Reject):
        return key
    return check_body(
        key, operation, body, hash_profile=hash_profile, body_fingerprint=body_fingerprint
    )


def body_too_large(limit: int) -> Reject:
    return Reject(413, "body_too_large", f"the request body exceeds {limit} bytes")


def unauthenticated() -> Reject:
    """401: the front end found no principal for the request, so no key space to use.

    Nothing runs and nothing is looked up: a replay, a 409 or a 422 ``key_reused``
    would each tell an unauthenticated caller something about another's key.
    """
    return Reject(
        401,
        "unauthenticated",
        "this endpoint runs each Idempotency-Key once per authenticated caller, and this "
        "request is not authenticated, so nothing ran and no stored answer was looked up; "
        "send it again with the same key and valid credentials",
    )


def unavailable(retry_after: int, cause: str = "", *, reading: bool = False) -> Unavailable:
    """503: the store (``reading``: a stored response) cannot be used; nothing ran."""
    detail = (
        "the stored response of this key cannot be read right now; retry with the same key"
        if reading
        else "the idempotency store is unavailable, so the request was not run; "
        "retry with the same key"
    )
    return Unavailable(
        503, "store_unavailable" if reading else "not_run", detail, retry_after, cause=cause
    )


def not_finished(retry_after: int, cause: str = "") -> Unavailable:
    """503 ``not_finished``: the store failed inside the handler after work of this request
    may have committed (a phase, or a COMMIT whose answer was lost), so it is not "not run";
    the record under the key tells a retry what happened."""
    return Unavailable(
        503,
        "not_finished",
        "the idempotency store failed while this request ran, after some of its work may "
        "have committed, so it did not finish; retry with the same key: it gets the "
        "step's outcome, resumes it, or learns that the step is in doubt",
        retry_after,
        cause=cause,
    )


def in_doubt(record: InProgress | None, where: str = "the step") -> InDoubt:
    """409 ``in_doubt``, without ``Retry-After``: the same answer to every request with the key."""
    return InDoubt(
        409,
        "in_doubt",
        f"an earlier request with this Idempotency-Key may have started {where}'s side "
        "effect and did not finish (its server stopped, or it failed after the effect "
        "began), so nothing runs under this key until the server's reconcile hook or an "
        "operator settles it (agentkey server settle); check the target system before "
        "running the step again under a new key",
        record=record,
    )


def on_claimed(
    existing: bytes | StoreError | None,
    checked: Checked,
    *,
    owner: str,
    now_ms: int,
    retry_after: int,
) -> Run | Conflict | Replay | Unavailable | Reject | InDoubt:
    """Decide on the store's answer to a claim: None (claimed), the record there, or an error.

    A record whose handler may have started and whose lease lapsed, or one marked in
    doubt, is :class:`InDoubt`: never free, never run again by itself.
    """
    if isinstance(existing, StoreError):
        return unavailable(retry_after, str(existing))
    if existing is None:
        return _RUN
    try:
        record = decode_record(existing, key=checked.idempotency_key)
    except StoreError as exc:
        return unavailable(retry_after, str(exc))
    mismatch = _binding_mismatch(record.binding, checked)
    if mismatch is not None:
        return Reject(422, *mismatch)
    if isinstance(record, StoredOutcome):
        return Replay(record)
    if record.owner == owner:
        # Our own claim, read back: the client library re-sent a SET that had already
        # succeeded (a retry after a timeout). Its lease started at the first send.
        return Run(renew=True)
    if record.in_doubt(now_ms):
        return in_doubt(record, checked.where)
    wait, lease_left = in_progress_retry_after(record, now_ms, retry_after=retry_after)
    lease = (
        ""
        if lease_left is None
        else "; if the request holding it stopped (its server may have died), its lease "
        f"ends within {lease_left} s and a retry then "
        + ("learns whether the step is in doubt" if record.phase == "started" else "runs the step")
    )
    return Conflict(
        409,
        "in_progress",
        f"{checked.where} is already running with this key{lease}; retry with the same "
        "key after Retry-After",
        wait,
        () if lease_left is None else (("lease_expires_in", lease_left),),
    )


def on_finished(
    status: int,
    headers: Iterable[tuple[bytes | str, bytes | str]],
    body: bytes,
    *,
    error: bool,
    mutation_started: bool,
    binding: Binding | None,
    now_ms: int,
    max_inline_bytes: int,
    max_recorded_bytes: int | None = None,
    size: int | None = None,
    may_have_started: bool = False,
) -> Complete | Fail | Release | Doubt:
    """What to record once the tool answered ``status`` (or raised: ``error``).

    ``mutation_started``: the tool said its side effect began (``begin_mutation()``):
    a failure is recorded FAILED and replayed. ``may_have_started``: it may have begun
    without saying so (the default: as soon as the tool runs); a 5xx or an exception
    then puts the key in doubt (:class:`Doubt`), while an answer about the moment
    (401, 403, 408, 409, 429, 307, 308) still releases it. Neither: released.

    ``size`` is the answer's length when the front end stopped keeping its body
    (default ``len(body)``). An answer above ``max_recorded_bytes`` that would be
    recorded is not: a small FAILED record says so instead, and every resend gets
    that 500 rather than running the step again or receiving a partial answer.
    """
    if not error and is_storable(status):
        if max_recorded_bytes is not None and _too_large(body, size, max_recorded_bytes):
            return _not_recorded(
                len(body) if size is None else size, max_recorded_bytes, binding, now_ms
            )
        stored = stored_headers(headers)
        offload = len(body) > max_inline_bytes
        return Complete(
            StoredOutcome("COMPLETED", status, stored, body, None, now_ms, binding), offload
        )
    if not mutation_started:
        if may_have_started and (error or status >= 500):
            return Doubt()
        return Release()
    if error:
        status, stored = 500, (("content-type", PROBLEM_TYPE),)
        body = problem_body(
            500,
            "step_failed",
            "the tool failed after its side effect started; the outcome is unknown to "
            "the server and is not retried automatically. Inspect the target system "
            "before running the step again under a new key",
        )
    elif max_recorded_bytes is not None and _too_large(body, size, max_recorded_bytes):
        return _not_recorded(
            len(body) if size is None else size, max_recorded_bytes, binding, now_ms
        )
    else:
        stored = stored_headers(headers)
    offload = len(body) > max_inline_bytes
    return Fail(StoredOutcome("FAILED", status, stored, body, None, now_ms, binding), offload)


def _too_large(body: bytes, size: int | None, limit: int) -> bool:
    return (len(body) if size is None else size) > limit


def _not_recorded(size: int, limit: int, binding: Binding | None, now_ms: int) -> Fail:
    """The record of an answer too large to keep: the step ran, its answer is gone."""
    body = problem_body(
        500,
        "response_too_large",
        f"the step ran, but its answer ({size} bytes or more) was larger than the "
        f"server's max_recorded_bytes ({limit}), so it was not stored and cannot be "
        "replayed; the step is not run again under this key. Read its result from the "
        "target system, or have the server raise max_recorded_bytes for this tool",
    )
    headers = (("content-type", PROBLEM_TYPE),)
    return Fail(StoredOutcome("FAILED", 500, headers, body, None, now_ms, binding))


# --- rules ------------------------------------------------------------------------


def is_storable(status: int) -> bool:
    """Whether an answer is final for the key.

    2xx, 3xx (a ``303 See Other`` after a POST reports success) and the 4xx
    that are about the request. Not 401, 403, 408, 409, 429 or any 5xx: those
    depend on the moment, not on the request. Not 307 or 308 either: they send
    the same request, with the same key, to another URL (a trailing-slash
    redirect), where it must run rather than meet this route's record.
    """
    if 200 <= status < 400:
        return status not in _RESENT_ELSEWHERE
    return 400 <= status < 500 and status not in _NOT_STORED


def stored_headers(raw: Iterable[tuple[bytes | str, bytes | str]]) -> tuple[tuple[str, str], ...]:
    """The answer's headers a record keeps: per-connection and credential headers dropped."""
    kept = []
    names = _HEADER_NAMES
    for k, v in raw:
        name = names.get(k) if type(k) is bytes else None
        if name is None:
            name = (k if isinstance(k, str) else bytes(k).decode("latin-1")).lower()
            if type(k) is bytes:
                if len(names) >= 1024:
                    names.clear()
                names[k] = name
        if name not in _DROP_HEADERS:
            kept.append((name, v if isinstance(v, str) else bytes(v).decode("latin-1")))
    return tuple(kept)


# Header names as records keep them (str, lowercase): an app answers with few names, on
# every request, so their decoded forms are kept, a bounded number of them.
_HEADER_NAMES: dict[bytes, str] = {}


def in_progress_retry_after(
    record: InProgress, now_ms: int, *, retry_after: int
) -> tuple[int, int | None]:
    """``(Retry-After, seconds until the lease ends or None)`` for a 409.

    A holder renews every ``renew_ms``; one that let 1.5 renewals pass looks
    stopped (its server may have died), so the client is told to come back when
    its lease ends. Otherwise the configured ``retry_after``, capped by the lease.
    """
    if record.lease_end_ms <= 0:  # a v1 record: nothing known about the lease
        return retry_after, None
    left = max(1, -(-(record.lease_end_ms - now_ms) // 1000))
    if record.renew_ms > 0 and now_ms > record.lease_end_ms - record.renew_ms * 3 // 2:
        return left, left
    return min(retry_after, left), left


@dataclass(frozen=True, slots=True)
class OpaqueKey:
    """A key that is not an agentkey key: a UUID, a Stripe-style ``ik_...``.

    It is bound to a digest of the request's canonical body instead of carrying one.
    """

    text: str

    def format(self) -> str:
        return self.text


def _parse_key(values: Sequence[bytes | str], *, opaque: bool = True) -> StepKey | OpaqueKey | str:
    """The parsed key, or the 400 message.

    A key that claims agentkey's format (:func:`_claims_agentkey`: three parts, a
    ``step_`` label or a 64-hex digest) must parse as one, so a broken agentkey client
    gets a precise 400 rather than losing its hash check. Any other key of 1-255
    printable ASCII characters is opaque (when allowed), ``:`` or not: justonce's
    ``charge:v1:run:0``, DBOS's ``<workflow>:<step>``. Both header styles, raw and
    RFC 8941 sf-string, name the same key.
    """
    if len(values) > 1:
        return "send exactly one Idempotency-Key header"
    raw = values[0]
    if len(raw) > 300:
        return f"Idempotency-Key is {len(raw)} bytes; a key is at most {MAX_KEY_LENGTH} characters"
    if not raw.isascii():
        return "Idempotency-Key must be ASCII"
    text = (raw if isinstance(raw, str) else raw.decode("ascii")).strip(" \t")
    try:
        fast = _RAW_KEY.fullmatch(text)
        if fast is not None:  # the common raw form, every part validated by one match
            plan, steps, args_hash = fast.groups()
            index = tuple(map(int, steps.split(".")))
            if len(text) <= MAX_KEY_LENGTH:  # then it is the key as raw_key() writes it
                return StepKey._parsed(plan, index, args_hash, text)
            return StepKey._trusted(plan, index, args_hash)  # raises: the key is too long
        if not opaque:
            return StepKey.parse(text)
        value = parse_sf_item(text) if text.startswith('"') else text
        if _claims_agentkey(value):
            return StepKey.parse(value)
    except InvalidKey as exc:
        return _without_key(str(exc), text) + (
            "" if opaque else "; this server accepts only agentkey keys (key_format='agentkey')"
        )
    if not value.strip(" ") or len(value) > MAX_KEY_LENGTH or not _PRINTABLE.fullmatch(value):
        return _OPAQUE_RULE
    return OpaqueKey(value)


def _claims_agentkey(value: str) -> bool:
    """Whether ``value`` looks like agentkey's ``<plan_session_id>:<step>:<args_hash>``.

    Three ``:``-separated parts, the middle a step label (``step_...``, any case) or
    the last 64 hex digits (any case). Such a key is agentkey's, malformed or not: read
    as opaque, a broken client's key would lose its args_hash check (the body would be
    bound by a digest of its own instead). Any other key is opaque, however many ``:``.
    """
    parts = value.split(":")
    if len(parts) != 3:
        return False
    return bool(_CLAIMS_STEP.match(parts[1]) or _CLAIMS_HASH.fullmatch(parts[2].strip()))


def _without_key(message: str, text: str) -> str:
    """``message`` with the key it quotes in its redacted form: a key is a bearer secret,
    even a malformed one, and a problem detail may end up in a log."""
    shown = shown_key(text)
    unquoted = text[1:-1] if text.startswith('"') and text.endswith('"') else text
    tail = unquoted.rpartition(":")[2]  # what stands for the args_hash
    parts = {text, text[:80], unquoted, unquoted[:80], tail, tail[:80]}
    for part in sorted(parts, key=len, reverse=True):
        if len(part) >= 8:
            message = message.replace(repr(part)[1:-1], shown)
    return message


def record_key(principal: str, key: StepKey | OpaqueKey) -> str:
    """The store key: ``<principal>:<key>``, the principal quoted (or hashed when long)."""
    scoped = _SCOPES.get(principal)
    if scoped is None:
        scoped = _scope(principal)
        if len(_SCOPES) >= _MAX_SCOPES:
            _SCOPES.clear()
        _SCOPES[principal] = scoped
    if isinstance(key, StepKey):
        return f"{scoped}:{key.format()}"
    # Quoted: no brace breaks the Redis Cluster hash tag, and with no ':' left an
    # opaque key can never spell an agentkey key's record.
    return f"{scoped}:{quote(key.text, safe='')}"


def _scope(principal: str) -> str:
    scoped = quote(principal.encode("utf-8", "surrogatepass"), safe="")
    if len(scoped) > _MAX_PRINCIPAL:
        # "!" is never left bare by quote(), so no short principal can spell this.
        scoped = "!sha256-" + hashlib.sha256(principal.encode("utf-8", "surrogatepass")).hexdigest()
    return scoped


# A server sees few principals (tenants, users, clients), each on every one of its
# requests: their quoted form is kept, a bounded number of them, as route digests are.
_SCOPES: dict[str, str] = {}
_MAX_SCOPES = 4096


def _binding_mismatch(stored: Binding | None, checked: Checked) -> tuple[str, str] | None:
    """The 422 problem when a record is bound to another operation, else None."""
    if stored is None:  # a record written before bindings existed
        return None
    if stored.route != checked.binding.route:
        return (
            "key_reused",
            "this Idempotency-Key was first used with another method or route; a key "
            "belongs to one operation and is never replayed for another. Send this call "
            "with its own key (its own step)",
        )
    if stored.body != checked.binding.body and not checked.same_body(stored.body):
        return (
            "payload_mismatch",
            "this Idempotency-Key was first used with another request body; send changed "
            "arguments with a new key",
        )
    return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class _DuplicateMember(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise _DuplicateMember(name)
            seen.add(name)
    return out


# Built once: json.loads(body, **options) builds a decoder and its scanner per call.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, object_pairs_hook=_unique_members)


def _parse(body: bytes) -> object:
    """One parse: ValueError when not JSON (NaN, Infinity) or a member name repeats.

    The duplicate check costs one call per object (about a third more than a plain
    parse); canonicalising the result to compare it with the body would cost more.
    """
    # A body opening with "{" then a non-NUL byte is UTF-8 (what detect_encoding says).
    encoding = "utf-8" if body[:1] == b"{" and body[1:2] != b"\x00" else json.detect_encoding(body)
    return _DECODER.decode(body.decode(encoding, "surrogatepass"))


def _canonical(parsed: dict[str, Any], profile: Profile) -> bytes | None:
    try:
        return canonical_json(parsed, profile=profile)
    except (InvalidArguments, RecursionError):
        return None


def _bytes_digest(chunks: Iterable[bytes]) -> str:
    """An opaque key's body fingerprint by its bytes (``body_fingerprint="bytes"``, and a
    body that is not a JSON object under ``"canonical"``): one pass, no parse."""
    sha = hashlib.sha256(b"bytes:")
    for chunk in chunks:
        sha.update(chunk)
    return digest_of(sha.digest())


def _canonical_digest(body: bytes, profile: Profile) -> str | None:
    """An opaque key's body fingerprint by its canonical JSON (``"canonical"``), or None
    when the body is not a JSON object canonical JSON can carry. Equivalent JSON
    (spacing, member order) is one body. The parsed object is dropped here: a handler
    that wants it calls ``claim.json()``, so none is kept alive while it runs."""
    try:
        parsed = _parse(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(parsed, dict):
        return None
    canonical = _canonical(parsed, profile)
    return None if canonical is None else digest(b"json:" + canonical)


def _check_body(body: bytes, key: StepKey, profile: Profile) -> tuple[int, str, str] | None:
    """None when the body is a JSON object whose canonical JSON hashes to the key's
    args_hash; else the error. (Its bytes do not hash to it: :func:`check_body`.) The
    parsed body is not kept: ``claim.json()`` parses it again if the handler asks."""
    try:
        parsed = _parse(body)
    except _DuplicateMember as exc:
        # Parsers disagree on which duplicate wins (Python keeps the last, others the
        # first), so the hash would not pin down the arguments the handler acts on.
        return (
            400,
            "body_not_json",
            f"the request body repeats the member name {exc.name[:80]!r}; send each name once",
        )
    except (ValueError, RecursionError):
        return 400, "body_not_json", "the request body must be a JSON object (UTF-8)"
    if not isinstance(parsed, dict):
        return (
            400,
            "body_not_json",
            "the request body must be a JSON object, not " + (type(parsed).__name__),
        )
    canonical = _canonical(parsed, profile)
    if canonical is None:
        return 400, "body_not_json", "the request body holds values canonical JSON cannot carry"
    if hashlib.sha256(canonical).hexdigest() == key.args_hash:
        return None
    return (
        422,
        "args_hash_mismatch",
        f"the body does not hash to the key's args_hash for step {key.label}; "
        "recompute the key from the arguments you send",
    )


def problem_body(status: int, code: str, detail: str, extra: dict[str, Any] | None = None) -> bytes:
    """RFC 9457 problem details, plus ``"error": <code>`` for clients that read that."""
    doc: dict[str, Any] = {
        "type": f"urn:agentkey:problem:{code}",
        "title": _TITLES[code],
        "status": status,
        "detail": detail,
        "error": code,
        **(extra or {}),
    }
    return json.dumps(doc, separators=(",", ":")).encode()
