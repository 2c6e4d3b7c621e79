"""The I/O-free protocol core: every decision the invoker makes, and nothing else.

It never opens a socket, never sleeps and never imports httpx. It sees an
:class:`Answer` (status, headers, body bytes, URL) or a :class:`Failure`
(a transport error, already sorted into "not sent" or "in doubt") and says
what to do next:

```
answer ─▶ classify()       ─▶ DONE | POLL(url) | RETRY(hint) | FOLLOW(url) | FETCH(url) | RAISE
poll   ─▶ interpret_poll() ─▶ DONE | WAIT(hint) | FOLLOW(url) | FETCH(url) | RAISE
```

The rows of the wire contract (section 3) map one to one onto ``classify``;
section 4 (202 polling) onto the status-URL strategies and ``interpret_poll``.
"""

from __future__ import annotations

import enum
import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urljoin

from .._exceptions import (
    InvokeError,
    KeyRejected,
    KeyReused,
    OutcomeUnknown,
    PayloadMismatch,
    StepFailed,
    StepInProgress,
    TokenRejected,
    ToolError,
    ToolRejected,
    ToolUnreachable,
    UnsafeRedirect,
)
from .._keys import shown_key, uuid_key
from ._effects import Answer, Failure, FailureKind, Received
from ._net import Origin, has_control_character, origin_of, scrub_json
from ._policies import DEFAULT_REPLAY_HEADERS  # the invoker's option default, defined there
from ._retry_after import TOO_LONG, parse_retry_after

__all__ = [
    "BAD_LOCATION",
    "DEFAULT_REPLAY_HEADERS",
    "DEFAULT_STATUS_URL_STRATEGIES",
    "IN_FLIGHT_STATUSES",
    "MARKS_REPLAYS",
    "PROBLEM_CODES",
    "Action",
    "Answer",
    "BodyFieldStrategy",
    "CallContext",
    "Decision",
    "Failure",
    "FailureKind",
    "HeaderStrategy",
    "Meaning",
    "ProtocolConfig",
    "Received",
    "StatusUrlStrategy",
    "budget_exhausted",
    "classify",
    "dialect_marker",
    "find_status_url",
    "interpret_poll",
    "parse_json",
    "poll_target",
    "problem_code",
    "ran_marker",
    "replay_header",
    "replay_markers",
    "retry_after",
    "short_reason",
]

_SUCCEEDED = frozenset({"succeeded", "success", "completed", "complete", "done"})
_FAILED = frozenset({"failed", "failure", "canceled", "cancelled", "error"})
_REDIRECTS = frozenset({301, 302, 307, 308})


#: The description of an UNSENDABLE failure for a redirect whose Location cannot be parsed.
BAD_LOCATION = "a redirect whose Location cannot be parsed"


@dataclass(frozen=True, slots=True)
class ProtocolConfig:
    """What the core needs to know about one invoker."""

    base_origin: Origin
    retry_statuses: frozenset[int]
    replay_headers: tuple[str, ...] = DEFAULT_REPLAY_HEADERS
    allowed_poll_origins: frozenset[Origin] = frozenset()
    strategies: tuple[StatusUrlStrategy, ...] = field(default=())
    has_auth: bool = True  # the invoker sends credentials (auth=) to the tool's origin
    #: ``replay_markers(replay_headers)``, parsed once: every answer is read against them.
    markers: tuple[tuple[str, str, str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.strategies:
            object.__setattr__(self, "strategies", DEFAULT_STATUS_URL_STRATEGIES)
        object.__setattr__(self, "markers", replay_markers(tuple(self.replay_headers)))

    def same_origin(self, url: str) -> bool:
        return origin_of(url) == self.base_origin


@dataclass(slots=True)  # not frozen: built on every call (see _effects.Outgoing)
class CallContext:
    """Who an error concerns: the key, the step label and the attempts made so far.

    ``wall`` is the flow's wall time (Unix seconds) when the answer is judged: an
    HTTP-date ``Retry-After`` is measured from it (None: a date gives no hint).
    """

    idempotency_key: str
    step: str | None
    attempts: int
    polls: int = 0
    wall: float | None = None
    #: The route has evidence in force that it honours keys (or the invoker was told so).
    honoured: bool = False

    def where(self) -> str:
        """The key as messages show it: plan id and step label, never the whole key."""
        step = f" (step {self.step})" if self.step else ""
        return f"key {shown_key(self.idempotency_key)}{step}"

    def error(
        self,
        cls: type[InvokeError],
        message: str,
        *,
        status_code: int | None = None,
        body: object = None,
        reason: str | None = None,
    ) -> InvokeError:
        return cls(
            message,
            idempotency_key=self.idempotency_key,
            step=self.step,
            attempts=self.attempts,
            status_code=status_code,
            body=body,
            reason=reason,
        )


class Action(enum.Enum):
    DONE = "done"  # the answer is the result
    POLL = "poll"  # 202: poll ``url``
    RETRY = "retry"  # resend the same request, same key, after a wait
    FOLLOW = "follow"  # same-origin redirect: resend the same request to ``url``
    FETCH = "fetch"  # 303 See Other: GET ``url`` for the result
    WAIT = "wait"  # poll again after a wait
    RAISE = "raise"  # ``error`` is final


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do with one answer. ``retry`` and ``retry_after`` drive the flow's waits."""

    action: Action
    reason: str
    retry_after: float | None = None
    in_doubt: bool = False
    url: str | None = None
    error: InvokeError | None = None
    replayed: bool = False
    status_code: int | None = None
    in_flight: bool = False  # the answer said the same key is in flight (409/423)
    #: agentkey's server refused the request before anything ran (503 ``not_run``).
    not_run: bool = False

    @property
    def retry(self) -> bool:
        return self.action in (Action.RETRY, Action.FOLLOW, Action.WAIT)


@functools.lru_cache(maxsize=256)
def _done(status: int, replayed: bool) -> Decision:
    """The decision on a final 2xx: the same few, so made once each (a Decision is frozen)."""
    return Decision(Action.DONE, "done", replayed=replayed, status_code=status)


def parse_json(content: bytes) -> object:
    """The parsed JSON body, or None when the body is empty or not JSON."""
    if not content.strip():
        return None
    try:
        return json.loads(content)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def _parsed(answer: Answer) -> object:
    """The answer's JSON body, with every credential the request carried cut out of it."""
    return scrub_json(parse_json(answer.content), answer.sent_secrets)


@functools.lru_cache(maxsize=64)
def replay_markers(entries: tuple[str, ...]) -> tuple[tuple[str, str, str], ...]:
    """``(lowercase name, lowercase value, the entry)`` of each replay header entry.

    An entry is ``"Name"`` (the value ``true`` marks a replay) or ``"Name: value"``.
    Raises ValueError for an entry that is neither.
    """
    out = []
    for entry in entries:
        name, sep, value = entry.partition(":")
        name, value = name.strip(), value.strip() if sep else "true"
        if not _HEADER_NAME.fullmatch(name) or not value or not value.isprintable():
            raise ValueError(f"not a replay header entry: {entry!r}")
        out.append((name.lower(), value.lower(), entry))
    return tuple(out)


_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")


def replay_header(answer: Answer, names: Sequence[str]) -> str | None:
    """The first entry of ``names`` (see :data:`DEFAULT_REPLAY_HEADERS`) that marks
    ``answer`` as a replay, or None."""
    return _marked(answer, replay_markers(names if type(names) is tuple else tuple(names)))


def _marked(answer: Answer, markers: tuple[tuple[str, str, str], ...]) -> str | None:
    """:func:`replay_header` of markers parsed already (``ProtocolConfig.markers``)."""
    headers = answer.headers
    for name, value, entry in markers:
        got = headers.get(name)
        if got is not None and got.strip().lower() == value:
            return entry
    return None


def retry_after(value: str | None, now: float | None = None) -> float | None:
    """The seconds a ``Retry-After`` value asks for, or None (then the caller backs off).

    An HTTP-date is measured from ``now`` (Unix seconds, from the caller's wall
    clock; None: a date gives no hint). Never raises: a delay of hundreds or
    thousands of digits (which ``float`` cannot hold, or ``int`` refuses to parse)
    means "longer than any cap", so it is a large finite number and the caller's
    caps and deadline apply.
    """
    return parse_retry_after(value, now=now)


def _retry_after(answer: Answer, ctx: CallContext) -> float | None:
    return parse_retry_after(answer.header("retry-after"), now=ctx.wall)


# --- the dialects of "the key is the problem", "mismatch" and "in flight" --------------------


class Meaning(enum.Enum):
    """What a server's problem code says about the key."""

    KEY = "key"  # the key itself is missing or malformed: KeyRejected
    MISMATCH = "mismatch"  # the key was used with another body: PayloadMismatch
    REUSED = "reused"  # the key belongs to another route or tool: KeyReused
    IN_FLIGHT = "in flight"  # the same key is running now: wait and resend


#: The one table of server dialects. A code is read from an RFC 9457 problem ``type``
#: (its last ``:``/``/``/``#`` segment), a JSON ``error`` or ``code`` string, or a
#: Stripe-style ``error.type``/``error.code``; it is compared lowercase, ``-`` as ``_``.
#: Codes not listed here say nothing about the key: the answer is the tool's own.
PROBLEM_CODES: Mapping[str, Meaning] = {
    # agentkey's middleware: type "urn:agentkey:problem:<code>" and legacy "error": "<code>"
    "idempotency_key_missing": Meaning.KEY,
    "idempotency_key_invalid": Meaning.KEY,
    "args_hash_mismatch": Meaning.MISMATCH,
    "payload_mismatch": Meaning.MISMATCH,  # also idemkit's "urn:idemkit:payload-mismatch"
    "key_reused": Meaning.REUSED,
    "in_progress": Meaning.IN_FLIGHT,  # also idemkit's "urn:idemkit:in-progress"
    # idemkit 1.0 (default and Stripe-compatible modes)
    "missing_key": Meaning.KEY,
    # Stripe's API: 400/409 with error.type "idempotency_error" ("Keys for idempotent
    # requests can only be used with the same parameters they were first used with")
    "idempotency_error": Meaning.MISMATCH,
    "idempotency_key_in_use": Meaning.IN_FLIGHT,
    "idempotency_key_mismatch": Meaning.MISMATCH,
    # idemgate 0.1: {"error": {"code": ..., "message": ...}}; its 409 for another body
    "idempotency_key_reused": Meaning.MISMATCH,
    "idempotency_in_progress": Meaning.IN_FLIGHT,
    "missing_idempotency_key": Meaning.KEY,  # also drf-idempotency's code
    "invalid_idempotency_key": Meaning.KEY,  # also drf-idempotency's code
    # ichido 0.1: {"error": <code>, "message": ...}
    "fingerprint_mismatch": Meaning.MISMATCH,
    "request_in_progress": Meaning.IN_FLIGHT,
    # drf-idempotency 1.0, when its exceptions reach DRF's handler inside a view
    "idempotency_key_reuse": Meaning.MISMATCH,
    "idempotency_request_in_progress": Meaning.IN_FLIGHT,
}

#: The namespace of agentkey's own problem types (``urn:agentkey:problem:<code>``).
AGENTKEY_PROBLEM = "urn:agentkey:problem:"
#: agentkey's codes that say nothing ran: the server refused the request before its
#: handler (``not_run``; ``store_unavailable`` is what servers before 1.x sent).
NOT_RUN_CODES = frozenset({"not_run", "store_unavailable"})
#: agentkey's code for a key whose earlier request may have started its side effect and
#: did not finish: nothing runs under it until the server settles it. Final for a client.
IN_DOUBT_CODE = "in_doubt"
#: Problem ``type`` URI namespaces of the idempotency layers that send one (agentkey's,
#: idemkit's ``urn:idemkit:<code>``): a code in :data:`PROBLEM_CODES` under one of them
#: is an explicit marker that the route honours keys.
DIALECT_NAMESPACES: tuple[str, ...] = (AGENTKEY_PROBLEM, "urn:idemkit:")


def agentkey_problem(body: object) -> str | None:
    """The code of an answer whose problem ``type`` is agentkey's own, else None."""
    if not isinstance(body, dict):
        return None
    kind = body.get("type")
    if not isinstance(kind, str) or not kind.startswith(AGENTKEY_PROBLEM):
        return None
    return _code_of(kind)


#: Servers that send only a sentence (``{"detail": "..."}``) are read by its words, once
#: the sentence is about idempotency ("idempotency", "fingerprint"), in this order: a
#: sentence about another body, then one about a request in flight, then one refusing
#: the key itself. Sentences seen on the wire (docs/protocol.md has the table):
#: "Idempotency key was previously used with a different request payload.",
#: "Request payload does not match the original request for this idempotency key",
#: "A request with this idempotency key is currently in progress.",
#: "Request already pending for idempotency key '<key>'",
#: "'Idempotency-Key' header value must be formatted as a v4 UUID",
#: "Invalid Idempotency-Key: must contain only letters, digits, and '-._~:' characters".
_TEXT_MEANINGS: tuple[tuple[re.Pattern[str], Meaning], ...] = (
    (re.compile(r"\bdifferent\b|\bdoes not match\b|\bmismatch"), Meaning.MISMATCH),
    (
        re.compile(
            r"in[ -]progress|being processed|\bprocessing\b|\bpending\b|\bin flight\b"
            r"|\blocked\b|\bin use\b"
        ),
        Meaning.IN_FLIGHT,
    ),
    (
        re.compile(
            r"\brequire|\bmissing\b|\binvalid\b|\bmalformed\b|\bmust (?:be|contain|not)\b"
            r"|\btoo long\b|\bexceeds\b|\bformat"
        ),
        Meaning.KEY,
    ),
)
_NAMES_KEY = re.compile(r"idempot|fingerprint")

#: Answers that mean "the same key is in flight": 409 (the contract, Stripe, idemkit's
#: Stripe mode) and 423 Locked (idemkit's default mode), unless their code says otherwise.
IN_FLIGHT_STATUSES: frozenset[int] = frozenset({409, 423})

#: Words in a Stripe-style message that mark an "idempotency_error" as in flight.
_IN_FLIGHT_WORDS = ("in progress", "in-progress", "currently being processed")


def _code_of(value: object) -> str | None:
    if not isinstance(value, str) or not value.strip() or len(value) > 200:
        return None
    tail = value.strip().rstrip("/").replace("#", "/").replace(":", "/").rsplit("/", 1)[-1]
    code = tail.lower().replace("-", "_")
    return code if code and not any(ch.isspace() for ch in code) else None  # not a sentence


def problem_code(body: object) -> tuple[str | None, Meaning | None]:
    """The body's problem code and what it means for the key (either may be None)."""
    if not isinstance(body, dict):
        return None, None
    error = body.get("error")
    candidates = [body.get("type"), error, body.get("code")]
    if isinstance(error, dict):  # Stripe: {"error": {"type": ..., "code": ..., "message": ...}}
        candidates += [error.get("code"), error.get("type")]
    first = None
    for candidate in candidates:
        code = _code_of(candidate)
        first = first or code
        if code is not None and code in PROBLEM_CODES:
            meaning = PROBLEM_CODES[code]
            if code == "idempotency_error":
                text = (short_reason(body) or "").lower()
                if any(word in text for word in _IN_FLIGHT_WORDS):
                    meaning = Meaning.IN_FLIGHT
            return code, meaning
    return first, _text_meaning(short_reason(body))


def _text_meaning(reason: str | None) -> Meaning | None:
    """What a server's sentence says about the key (see _TEXT_MEANINGS), or None."""
    text = (reason or "").lower()
    if not _NAMES_KEY.search(text):
        return None
    return next((meaning for words, meaning in _TEXT_MEANINGS if words.search(text)), None)


def short_reason(body: object, key: str | None = None, *, limit: int = 200) -> str | None:
    """The server's short reason: problem ``detail``/``title``, JSON ``message``/``error``.

    Control and formatting characters are dropped, whitespace is folded, the text
    is cut to ``limit`` characters, and ``key`` (the Idempotency-Key) never appears.
    """
    if not isinstance(body, dict):
        return None
    error = body.get("error")
    found = [body.get("detail"), body.get("message")]
    if isinstance(error, dict):
        found.append(error.get("message"))
    found += [body.get("title"), error, body.get("error_description")]
    text = next((v for v in found if isinstance(v, str) and v.strip()), None)
    if text is None:
        return None
    text = text[: limit * 4]
    # The key as sent in the uuid header style is as much a bearer secret as the key.
    sent = (key, uuid_key(key)) if key else ()
    for value in sent:
        text = text.replace(value, "<key>")
    text = " ".join("".join(ch if ch.isprintable() else " " for ch in text).split())
    for value in sent:
        text = text.replace(value, "<key>")
    if len(text) > limit:
        text = text[: limit - 3].rstrip() + "..."
    return text or None


def _join(base: str, ref: str) -> str | None:
    """``ref`` resolved against ``base``; None when it is no http(s) URL agentkey can send.

    Refused: URLs Python's parser rejects (``https://[zz]/``), non-ASCII or
    control characters (``https://exämple/``), and anything without an http(s)
    origin (``data:``).
    """
    try:
        url = urljoin(base, ref.strip())
    except ValueError:
        return None
    return url if _usable(url) else None


def _usable(url: str) -> bool:
    return url.isascii() and not has_control_character(url) and origin_of(url) is not None


_ACCEPTED = (
    "The tool accepted the step (202), so it has run or is still running: do not send it "
    "as a new step. Invoking it again with the same key replays the acceptance; ask the "
    "tool for the operation's outcome"
)
_SEE_OTHER = (
    "The step already ran (303 See Other points at its result): invoking it again with the "
    "same key replays that answer; ask the tool for the result"
)


def _ran_note(status: int | None) -> str:
    return {202: _ACCEPTED, 303: _SEE_OTHER}.get(status or 0, "")


def _redirect_target(answer: Answer, ctx: CallContext, cfg: ProtocolConfig) -> str | Decision:
    status = answer.status_code
    location = answer.header("location")
    if not location:
        return Decision(
            Action.RAISE,
            "redirect without Location",
            status_code=status,
            error=ctx.error(
                ToolError,
                f"the tool answered {status} without a Location header for "
                f"{ctx.where()}; fix the tool or the route. {_ran_note(status)}".rstrip(". ")
                + ".",
                status_code=status,
                body=_parsed(answer),
            ),
        )
    target = _join(answer.url, location)
    if target is None:
        return Decision(
            Action.RAISE,
            "unusable Location",
            status_code=status,
            error=_bad_url(ctx, "the Location of a redirect", status, _ran_note(status)),
        )
    if not cfg.same_origin(target):
        return Decision(
            Action.RAISE,
            "cross-origin redirect",
            status_code=status,
            error=_unsafe(ctx, target, "a redirect", status, _ran_note(status)),
        )
    return target


def _bad_url(ctx: CallContext, what: str, status: int | None, ran: str = "") -> ToolError:
    error = ctx.error(
        ToolError,
        f"{what} for {ctx.where()} is not a URL agentkey can send (unparseable, non-ASCII, "
        "control characters, or not http(s)); the tool must send absolute or relative "
        f"http(s) URLs, percent-encoded. {ran}".rstrip(),
        status_code=status,
    )
    assert isinstance(error, ToolError)
    return error


def _unsafe(
    ctx: CallContext, url: str, what: str, status: int | None, ran: str = ""
) -> UnsafeRedirect:
    return UnsafeRedirect(
        f"{what} for {ctx.where()} points at {origin_of(url) or 'an unusable URL'}, another "
        "origin; agentkey never sends the key or credentials there. If that origin is yours, "
        "add it to allowed_poll_origins (polls only); redirects of the step itself are never "
        f"followed across origins. {ran}".rstrip(),
        url=url,
        idempotency_key=ctx.idempotency_key,
        step=ctx.step,
        attempts=ctx.attempts,
        status_code=status,
    )


def classify(reply: Received, ctx: CallContext, cfg: ProtocolConfig) -> Decision:
    """Decide what one answer to the step's request means (contract section 3)."""
    if isinstance(reply, Failure):
        if reply.kind is FailureKind.UNSENDABLE:
            what, ran = "the request URL", ""
            if reply.description == BAD_LOCATION:
                what, ran = "the Location of the tool's redirect", f"If it was a 303: {_SEE_OTHER}"
            return Decision(Action.RAISE, reply.description, error=_bad_url(ctx, what, None, ran))
        in_doubt = reply.kind is FailureKind.IN_DOUBT
        return Decision(Action.RETRY, reply.description, in_doubt=in_doubt)

    if reply.oversize or reply.unreadable:
        return _unread(reply, ctx, "the tool")
    status = reply.status_code
    replayed = _marked(reply, cfg.markers) is not None
    if 200 <= status < 300:
        if status == 202:
            url = find_status_url(reply, cfg.strategies)
            if url is not None and not _usable(url):
                return Decision(
                    Action.RAISE,
                    "unusable status URL",
                    status_code=status,
                    error=_bad_url(ctx, "the status URL of a 202", status, _ACCEPTED),
                )
            if url is not None:
                return Decision(
                    Action.POLL, "accepted", url=url, replayed=replayed, status_code=status
                )
        return _done(status, replayed)

    body = _parsed(reply)
    reason = short_reason(body, ctx.idempotency_key)
    said = f" ({reason})" if reason else ""
    if status == 401:
        return Decision(
            Action.RAISE,
            "unauthorized",
            status_code=status,
            error=ctx.error(
                TokenRejected,
                f"the tool refused the credentials (401){said} for {ctx.where()}, even after "
                "the auth layer's refresh (a token provider renews a rejected token at most "
                "once per TokenPolicy.rejection_interval); check the token's scopes and audience"
                if cfg.has_auth
                else f"the tool answered 401{said} for {ctx.where()}: it wants credentials and "
                "the invoker has no auth=; pass a token provider such as "
                "agentkey.auth.ClientCredentials(...) or StaticToken(...) as auth=",
                status_code=status,
                body=body,
                reason=reason,
            ),
        )
    _code, meaning = problem_code(body)
    own = agentkey_problem(body)
    if own == IN_DOUBT_CODE:
        return _in_doubt_answer(status, body, ctx, reason, replayed)
    if replayed:
        cls = _final_class(status, meaning, reason, body)
        cls = cls if issubclass(cls, ToolError) else ToolError  # stored: never "resend later"
        return Decision(
            Action.RAISE,
            "replayed error",
            status_code=status,
            replayed=True,
            error=ctx.error(
                cls,
                f"the tool replayed the stored outcome {status}{said} of an earlier attempt of "
                f"{ctx.where()}; it is final: resending the same key replays it again. "
                "Inspect the error body and decide (a new step or args give a new key)",
                status_code=status,
                body=body,
                reason=reason,
            ),
        )
    if status == 303:
        target = _redirect_target(reply, ctx, cfg)
        if isinstance(target, Decision):
            return target
        return Decision(Action.FETCH, "see other", url=target, status_code=status)
    if status in _REDIRECTS:
        target = _redirect_target(reply, ctx, cfg)
        if isinstance(target, Decision):
            return target
        return Decision(
            Action.FOLLOW, f"redirect {status}", url=target, retry_after=0.0, status_code=status
        )
    in_flight = status in IN_FLIGHT_STATUSES and meaning in (None, Meaning.IN_FLIGHT)
    not_run = status == 503 and own in NOT_RUN_CODES and (ctx.honoured or _protected(reply))
    if status in cfg.retry_statuses and (in_flight or status not in IN_FLIGHT_STATUSES):
        if in_flight:
            label, in_doubt, hint = f"in flight ({status})", False, _retry_after(reply, ctx)
        elif not_run:
            label, in_doubt, hint = "refused, not run (503)", False, _retry_after(reply, ctx)
        elif status in (429, 503):
            # Sent and answered: a gateway answers 503 when the tool failed after it got
            # the request, and a tool may answer 429 after its side effect. May have run.
            label, in_doubt, hint = f"overloaded ({status})", True, _retry_after(reply, ctx)
        elif status >= 500:
            label, in_doubt, hint = f"server error {status}", True, None
        else:
            label, in_doubt, hint = f"status {status}", False, _retry_after(reply, ctx)
        return Decision(
            Action.RETRY,
            label,
            retry_after=hint,
            in_doubt=in_doubt,
            status_code=status,
            in_flight=in_flight,
            not_run=not_run,
        )
    if not_run:  # refused, and 503 is not retried here
        return Decision(
            Action.RAISE,
            "refused, not run (503)",
            status_code=status,
            not_run=True,
            error=ctx.error(
                ToolUnreachable,
                f"the tool's server refused {ctx.where()} before running it (503){said}; "
                "the step did not run, and 503 is not in retry_statuses. It is safe to call "
                "it again later with the same key",
                status_code=status,
                body=body,
                reason=reason,
            ),
        )
    return Decision(
        Action.RAISE,
        f"status {status}",
        status_code=status,
        error=_final(reply, body, ctx, reason, meaning),
    )


def _in_doubt_answer(
    status: int, body: object, ctx: CallContext, reason: str | None, replayed: bool
) -> Decision:
    """agentkey's server says the key is in doubt: final, at once (no resend, no wait)."""
    said = f" ({reason})" if reason else ""
    return Decision(
        Action.RAISE,
        f"in doubt ({status})",
        status_code=status,
        replayed=replayed,
        error=ctx.error(
            OutcomeUnknown,
            f"the tool's server answered {status} for {ctx.where()}: an earlier request with "
            f"this key may have started its side effect and did not finish{said}. Nothing "
            "runs under this key until the server settles it (its reconcile hook, or an "
            "operator), so agentkey did not send it again. Find out whether it ran; do not "
            "send it as a new step",
            status_code=status,
            body=body,
            reason=reason,
        ),
    )


def _unread(answer: Answer, ctx: CallContext, who: str) -> Decision:
    status = answer.status_code
    ran = (
        "the step ran; invoking it again with the same key replays the stored answer"
        if 200 <= status < 300 and status != 202
        else _ACCEPTED
        if status == 202
        else "the answer was not read"
    )
    if answer.unreadable:
        what = (
            f"with a body encoded as {answer.unreadable}, which agentkey refuses to decode "
            "(it decodes one gzip or deflate coding, within max_response_bytes)"
        )
        advice = "Fix the tool's compression"
    else:
        what = "with a body larger than max_response_bytes"
        advice = "Raise max_response_bytes on the invoker if such answers are expected"
    return Decision(
        Action.RAISE,
        "answer unreadable" if answer.unreadable else "answer too large",
        status_code=status,
        error=ctx.error(
            ToolError,
            f"{who} answered {status} for {ctx.where()} {what}, so agentkey did not read it "
            f"({ran}). {advice}",
            status_code=status,
        ),
    )


def _validation_only(body: object, reason: str | None) -> bool:
    """A 422 about the request's fields (FastAPI's list, a reason not about the key)."""
    if isinstance(body, dict) and isinstance(body.get("detail"), list):
        return True
    text = (reason or "").lower()
    return bool(text) and not any(w in text for w in ("idempot", "hash", "key", "payload"))


def _final_class(
    status: int, meaning: Meaning | None, reason: str | None, body: object
) -> type[InvokeError]:
    """The error class of a final 4xx (or 409/423 not retried)."""
    if meaning is Meaning.REUSED:
        return KeyReused
    if meaning is Meaning.MISMATCH:
        return PayloadMismatch
    if meaning is Meaning.KEY or (status == 400 and reason is None):
        return KeyRejected  # the key itself was refused, whatever the status (400, 422)
    if status == 422 and not _validation_only(body, reason):
        return PayloadMismatch
    if status in IN_FLIGHT_STATUSES and meaning in (None, Meaning.IN_FLIGHT):
        return StepInProgress
    if 400 <= status < 500:
        return ToolRejected
    if status >= 500:
        return OutcomeUnknown
    return ToolError


_ADVICE: dict[type[InvokeError], str] = {
    KeyReused: "the key is bound to another operation (route or tool), so its stored answer "
    "is not replayed here. Give each tool call its own step",
    PayloadMismatch: "the key was first used with another body. The key and body must come "
    "from the same Step; do not edit either",
    KeyRejected: "it rejected the Idempotency-Key itself. Check key_header_style ('raw', "
    "'sf-string', or 'uuid' for a server that accepts only UUIDs) and that the server "
    "accepts the key's format",
    StepInProgress: "the same key is still in flight and this status is not in "
    "retry_statuses; resend the same key later",
    ToolRejected: "the tool refused the request for a reason of its own; this is final "
    "(resending the same step gets the same answer). Change the arguments (a new key), the "
    "route or the permissions",
    OutcomeUnknown: "the status is not retried and the step may have run. Resending later "
    "with the same key is safe",
}


def _final(
    answer: Answer, body: object, ctx: CallContext, reason: str | None, meaning: Meaning | None
) -> InvokeError:
    status = answer.status_code
    cls = _final_class(status, meaning, reason, body)
    said = f": {reason}" if reason else ""
    advice = _ADVICE.get(cls, "this is final (not retried). See error.body")
    return ctx.error(
        cls,
        f"the tool answered {status} for {ctx.where()}{said}. {advice}",
        status_code=status,
        body=body,
        reason=reason,
    )


def budget_exhausted(
    last: Decision,
    ctx: CallContext,
    *,
    saw_in_doubt: bool,
    saw_in_flight: bool = False,
    honoured: bool = True,
) -> InvokeError:
    """The error once the retry budget ran out with ``last`` still asking for a retry.

    The message says only what the answers showed: a failure in doubt means the
    step may have run; an in-flight answer means some request with this key held it.
    It promises a safe resend only when the tool is known to honour the key
    (``honoured``).
    """
    if last.in_flight:
        mine = (
            " An earlier attempt of this very call may be that holder: its answer was lost."
            if saw_in_doubt
            else ""
        )
        lease = (
            f", and its last answer asked to wait {last.retry_after:g} s more"
            if last.retry_after is not None and last.retry_after < TOO_LONG
            else ""
        )
        return ctx.error(
            StepInProgress,
            f"{ctx.where()} was still in flight ({last.status_code}) after {ctx.attempts} "
            f"attempt(s): another request with this key holds it, or held it and died (the "
            f"server frees the key when that holder's lease ends{lease}).{mine} Resend the "
            "same key later to get its outcome",
            status_code=last.status_code,
        )
    if saw_in_doubt and saw_in_flight:
        what = (
            "the step may have run; an earlier answer also said another request with this "
            "key was in flight"
        )
    elif saw_in_doubt:
        what = "the step may have run"
    elif saw_in_flight:
        what = (
            "an earlier answer said another request with this key was in flight, so the step "
            "may be running or may have run"
        )
    else:
        what = "no answer showed the step running: each said the tool was unreachable or overloaded"
    if honoured:
        advice = (
            "Resending later with the same key is safe: the tool replays the stored outcome "
            "instead of running the step twice"
        )
    elif saw_in_doubt:
        advice = (
            "The tool is not known to honour Idempotency-Key: find out whether the step ran "
            "before sending it again, and settle it in the journal (agentkey journal settle)"
        )
    else:
        advice = "No answer showed the step running, so sending it again later is safe"
    return ctx.error(
        OutcomeUnknown,
        f"gave up on {ctx.where()} after {ctx.attempts} attempt(s), last: {last.reason}; "
        f"outcome unknown ({what}). {advice}",
        status_code=last.status_code,
    )


# --- 202 status URL strategies (contract section 4), tried in order ---------------------------


class StatusUrlStrategy(Protocol):
    """One way to find a 202's status URL. Strategies are tried in order."""

    @property
    def name(self) -> str: ...

    def can_poll(self, answer: Answer) -> bool: ...

    def status_url(self, answer: Answer) -> str: ...


@dataclass(frozen=True, slots=True)
class HeaderStrategy:
    """The status URL is in a header (``Operation-Location``, ``Location``, ...)."""

    name: str

    def can_poll(self, answer: Answer) -> bool:
        return bool((answer.header(self.name) or "").strip())

    def status_url(self, answer: Answer) -> str:
        value = (answer.header(self.name) or "").strip()
        return _join(answer.url, value) or value  # unusable: classify refuses it


@dataclass(frozen=True, slots=True)
class BodyFieldStrategy:
    """The status URL is a string field of the JSON body (``status_url``, ``operation.url``)."""

    name: str

    def _value(self, answer: Answer) -> str | None:
        node = parse_json(answer.content)
        for part in self.name.split("."):
            if not isinstance(node, dict):
                return None
            node = node.get(part)
        return node.strip() if isinstance(node, str) and node.strip() else None

    def can_poll(self, answer: Answer) -> bool:
        return self._value(answer) is not None

    def status_url(self, answer: Answer) -> str:
        value = self._value(answer) or ""
        return _join(answer.url, value) or value  # unusable: classify refuses it


DEFAULT_STATUS_URL_STRATEGIES: tuple[StatusUrlStrategy, ...] = (
    HeaderStrategy("Operation-Location"),
    HeaderStrategy("Azure-AsyncOperation"),
    HeaderStrategy("Location"),
    BodyFieldStrategy("status_url"),
    BodyFieldStrategy("href"),
    BodyFieldStrategy("operation.url"),
)


def find_status_url(answer: Answer, strategies: Sequence[StatusUrlStrategy]) -> str | None:
    """The status URL of a 202 answer, resolved against its URL, or None."""
    for strategy in strategies:
        if strategy.can_poll(answer):
            return strategy.status_url(answer)
    return None


def poll_target(url: str, ctx: CallContext, cfg: ProtocolConfig) -> bool:
    """Check a status URL: True when same-origin (auth applies), False when explicitly allowed.

    Raises :class:`UnsafeRedirect` for any other origin, :class:`ToolError` for a URL
    agentkey cannot send. Either way the step was accepted, and the message says so.
    """
    if not _usable(url):
        raise _bad_url(ctx, "the status URL", None, _ACCEPTED)
    origin = origin_of(url)
    if origin == cfg.base_origin:
        return True
    if origin is not None and origin in cfg.allowed_poll_origins:
        return False
    raise _unsafe(ctx, url, "the status URL", None, _ACCEPTED)


def _said(body: object, ctx: CallContext) -> str:
    reason = short_reason(body, ctx.idempotency_key)
    return f" ({reason})" if reason else ""


def _state(body: object) -> str | None:
    if not isinstance(body, dict):
        return None
    for name in ("status", "state"):
        value = body.get(name)
        if isinstance(value, str):
            return value.strip().lower().replace("-", "_").replace(" ", "_")
    return None


def interpret_poll(
    reply: Received, ctx: CallContext, cfg: ProtocolConfig, *, result_only: bool = False
) -> Decision:
    """Decide what one poll answer means (contract section 4).

    ``result_only`` is set after a ``303 See Other``: the answer is the result
    itself, whatever fields it has.
    """
    if isinstance(reply, Failure):
        if reply.kind is FailureKind.UNSENDABLE:
            return Decision(
                Action.RAISE,
                reply.description,
                error=_bad_url(ctx, "the status URL", None, _ACCEPTED),
            )
        return Decision(Action.WAIT, reply.description)
    if reply.oversize or reply.unreadable:
        return _unread(reply, ctx, "a poll")
    status = reply.status_code
    body = _parsed(reply)
    if status == 202:
        return Decision(Action.WAIT, "accepted", retry_after=_retry_after(reply, ctx))
    if status == 303 or status in _REDIRECTS:
        location = reply.header("location")
        if not location:
            return Decision(
                Action.RAISE,
                "redirect without Location",
                status_code=status,
                error=ctx.error(
                    ToolError,
                    f"a poll for {ctx.where()} answered {status} without a Location header",
                    status_code=status,
                    body=body,
                ),
            )
        target = _join(reply.url, location)
        if target is None:
            return Decision(
                Action.RAISE,
                "unusable Location",
                status_code=status,
                error=_bad_url(ctx, "the Location of a poll redirect", status, _ACCEPTED),
            )
        action = Action.FETCH if status == 303 else Action.FOLLOW
        return Decision(action, f"poll redirect {status}", url=target, status_code=status)
    if 200 <= status < 300:
        if result_only:
            return Decision(Action.DONE, "result", status_code=status)
        return _poll_state(reply, body, ctx)
    if status == 401:
        return classify(reply, ctx, cfg)
    if status in (408, 409, 423, 425, 429, 500, 502, 503, 504):
        return Decision(
            Action.WAIT,
            f"poll answered {status}",
            retry_after=_retry_after(reply, ctx),
            status_code=status,
        )
    return Decision(
        Action.RAISE,
        f"poll status {status}",
        status_code=status,
        error=ctx.error(
            ToolError,
            f"polling {ctx.where()} answered {status}{_said(body, ctx)}; the status URL is no "
            "longer usable. The step was accepted (202): ask the tool for the operation's "
            "outcome",
            status_code=status,
            body=body,
            reason=short_reason(body, ctx.idempotency_key),
        ),
    )


def _poll_state(answer: Answer, body: object, ctx: CallContext) -> Decision:
    state = _state(body)
    status = answer.status_code
    if state is None and isinstance(body, dict) and isinstance(body.get("done"), bool):
        if not body["done"]:
            return Decision(Action.WAIT, "running", retry_after=_retry_after(answer, ctx))
        state = "failed" if body.get("error") is not None else "succeeded"  # AIP-151
    if state is None or state in _SUCCEEDED:
        return Decision(Action.DONE, state or "done", status_code=status)
    if state in _FAILED:
        return Decision(
            Action.RAISE,
            state,
            status_code=status,
            error=ctx.error(
                StepFailed,
                f"the asynchronous operation of {ctx.where()} reported "
                f"{state!r}{_said(body, ctx)}; it is final. See the error body; a "
                "retry needs a new step or new arguments",
                status_code=status,
                body=body,
                reason=short_reason(body, ctx.idempotency_key),
            ),
        )
    # running, pending, queued, in_progress, notstarted, or a state we do not know yet
    return Decision(Action.WAIT, state, retry_after=_retry_after(answer, ctx))


# --- does the tool honour keys? (evidence an answer carries) -------------------------------

#: The header agentkey's middleware sets on every answer of a route it protects (and on an
#: OPTIONS answer of such a route): the route honours Idempotency-Key.
PROTECTED_HEADER = "Idempotency-Protected"
_PROTECTED_LOWER = PROTECTED_HEADER.lower()  # Answer.headers keys are lowercase


def _protected(answer: Answer) -> bool:
    """Whether ``answer`` carries ``Idempotency-Protected: true``: agentkey's middleware
    sent it for a route it protects (a ``not_run`` body alone may be a plain tool's or
    gateway's copy of a downstream service's answer, after its own side effect)."""
    said = answer.headers.get(_PROTECTED_LOWER)
    if not said:  # the usual answer: no such header
        return False
    return any(part.strip() in ("true", "?1", "1") for part in said.lower().split(","))


#: The kinds of evidence (:func:`key_evidence`) that show a route marks its replays: an
#: answer of such a route without a replay marker ran the step now.
MARKS_REPLAYS = frozenset({"protection header", "replay marker"})


def ran_marker(answer: Answer, cfg: ProtocolConfig) -> bool:
    """Whether ``answer`` itself says it ran the step now (it is no replay).

    Either the protection header (agentkey's middleware marks every replay), or a
    configured replay header present with another value (ichido's ``X-Ichido-Status:
    executed``, an ``Idempotent-Replayed: false``). Never when the invoker knows no
    replay header (``replay_headers=()``): a replay could not be seen then.
    """
    if not cfg.replay_headers:
        return False
    headers, present = answer.headers, False
    for name, value, _ in cfg.markers:  # one pass over the markers
        got = headers.get(name)
        if got is not None:
            if got.strip().lower() == value:
                return False  # a replay marker: the answer is a replay
            present = True
    return present or _protected(answer)


def key_evidence(answer: Answer, cfg: ProtocolConfig) -> str | None:
    """What in ``answer`` shows the tool honours Idempotency-Key, or None.

    Only explicit markers count (docs/journal.md has the table): the protection
    header, a configured replay marker, or a problem answer of a known idempotency
    dialect (:func:`dialect_marker`). Sentences never count, nor do generic codes
    (``{"error": "missing_key"}`` is as likely a missing JSON field, and
    ``{"code": "in_progress"}`` a tool's own state), nor a bare 409.
    """
    if _protected(answer):
        return "protection header"
    if _marked(answer, cfg.markers) is not None:
        return "replay marker"
    if answer.status_code >= 400 and answer.status_code != 401:
        code = dialect_marker(parse_json(answer.content))
        if code is not None:
            return f"key problem answer ({code})"
    return None


def dialect_marker(body: object) -> str | None:
    """The code of a problem answer that only an idempotency layer sends, or None.

    Either the RFC 9457 ``type`` is a URI of a known dialect's namespace
    (:data:`DIALECT_NAMESPACES`) whose code is known (:data:`PROBLEM_CODES`, or
    agentkey's own ``in_doubt``; not ``not_run``, which counts only with the
    protection header beside it), or a code in any of the places
    :func:`problem_code` reads names idempotency itself and is listed
    (Stripe's ``idempotency_error``, idemgate's ``idempotency_key_reused``, ...).
    """
    if not isinstance(body, dict):
        return None
    kind = body.get("type")
    if isinstance(kind, str) and kind.strip().startswith(DIALECT_NAMESPACES):
        code = _code_of(kind)
        known = code in PROBLEM_CODES or code == IN_DOUBT_CODE
        if code is not None and known:
            return code
    error = body.get("error")
    candidates = [kind, error, body.get("code")]
    if isinstance(error, dict):
        candidates += [error.get("code"), error.get("type")]
    for candidate in candidates:
        code = _code_of(candidate)
        if code is not None and "idempot" in code and code in PROBLEM_CODES:
            return code
    return None
