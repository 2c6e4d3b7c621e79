"""``agentkey check``: does a tool server honour the idempotency contract?

WARNING: the checker sends real requests. A correct server runs the tool four
times (a fresh call, a concurrent burst, changed arguments and the header-style
round trip); a broken one may run it more often. Point it at a test instance
or a tool whose side effect is harmless.

Each row is labelled with its scope:

- ``contract``: what any server following the IETF httpapi Idempotency-Key
  draft must do, whatever key format it expects (a duplicate is replayed,
  concurrent duplicates run once, a reused key with another body gets 422,
  the same key on another route is never answered with the first route's
  result). "Honours the contract" means these rows hold.
- ``agentkey``: what agentkey's own contract adds (replay headers, 409 with
  ``Retry-After``, the args hash in the key, 400 for a malformed or missing
  key, both header styles, 422 ``key_reused``). Reported, not required.

Executions are counted from what the answers show: a 2xx answer is a new
execution unless a replay header (any dialect) marks it or it repeats an
earlier answer's status and body exactly.

A target that cannot be reached (down, DNS, TLS) gives no verdict at all: the
report says "could not reach" with the cause. Neither does a fresh request the
tool refuses (a wrong ``--path``, ``--args`` or ``--token``: the report says
which to fix), nor a connection that fails mid-check twice (the second time on a
fresh connection): that is a transport problem, not the server's contract.

A refusal that is safe but not the draft's answer (a 409 for another body, where
the draft says 422) is a ``WARN``: a deviation, reported, never a failure.

All HTTP goes through ``_http``, which caps how much of an answer is read; each
request must be answered whole within ``timeout`` seconds (a server that drips
one byte at a time cannot hold the check). Everything a server says is printed
with its control characters replaced, and the token is cut out of whatever a
server said as it is printed, in any case or spelling (never out of an answer
before it is parsed: a token ``x`` must not turn "executions" into
"e***ecutions").
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import socket
import ssl
import unicodedata
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from .._canonical import canonical_json, to_jsonable
from .._clock import Clock, default_clock
from .._exceptions import ConfigurationError
from .._keys import HEADER_STYLES, HeaderStyle, StepKey, shown_key
from . import _clients, _http, _httpx2
from ._effects import Answer, Failure, FailureKind, Outgoing
from ._net import redact_url, require_secure
from ._protocol import (
    DEFAULT_REPLAY_HEADERS,
    IN_FLIGHT_STATUSES,
    Meaning,
    parse_json,
    problem_code,
    replay_header,
    retry_after,
    short_reason,
)

__all__ = [
    "CheckReport",
    "CheckResult",
    "Scope",
    "Verdict",
    "acheck_server",
    "check_options",
    "check_server",
]

Verdict = Literal["PASS", "FAIL", "WARN", "SKIP"]
Scope = Literal["contract", "agentkey"]

_TOKEN = re.compile(r"[\x21-\x7e]+")

#: Answers that refuse a duplicate for now (in flight, overloaded): not an execution.
_NOT_NOW = IN_FLIGHT_STATUSES | {425, 429, 503}
#: Read at most this much of any answer (decoded): the checker compares bodies, no more.
MAX_ANSWER_BYTES = 1024 * 1024
#: A Retry-After beyond this is no advice a client can follow.
_SANE_RETRY_AFTER = 3600.0
MAX_CONCURRENCY = 64


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One point of the contract: its verdict, what was seen, and whose rule it is."""

    name: str
    verdict: Verdict
    detail: str
    scope: Scope = "contract"
    #: The requests the row rests on, one line each: path, key (as a digest), answer.
    evidence: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class CheckReport:
    """Every point checked against one target.

    :attr:`ok` when the target was reached and no ``contract`` row failed;
    ``agentkey`` rows and ``WARN`` rows (deviations) are reported but not
    required. :attr:`unreachable` holds "could not reach <target>: <cause>" and
    :attr:`no_verdict` what else stopped the check (the fresh request refused,
    a transport problem mid-check): either means no verdict was given.
    """

    target: str
    style: HeaderStyle
    results: tuple[CheckResult, ...]
    unreachable: str | None = field(default=None)
    no_verdict: str | None = field(default=None)

    @property
    def ok(self) -> bool:
        return (
            self.unreachable is None
            and self.no_verdict is None
            and all(r.verdict != "FAIL" for r in self.results if r.scope == "contract")
        )

    def table(self) -> str:
        """A plain-text pass/fail table, then the verdict."""
        lines = [f"agentkey check {self.target}  (key header style: {self.style})", ""]
        if self.unreachable is not None:
            lines.append(self.unreachable)
            lines.append("")
            lines.append("no verdict: the contract was not checked")
            return "\n".join(lines)
        if self.results:
            width = max(len(r.name) for r in self.results)
            lines.append(f"  {'result':<6}  {'scope':<8}  {'check':<{width}}  detail")
            lines.append(f"  {'-' * 6}  {'-' * 8}  {'-' * width}  {'-' * 40}")
            lines += [
                f"  {r.verdict:<6}  {r.scope:<8}  {r.name:<{width}}  {r.detail}"
                for r in self.results
            ]
            lines.append("")
        if self.no_verdict is not None:
            lines.append(self.no_verdict)
            lines.append("")
            lines.append("no verdict: the contract was not (fully) checked")
            return "\n".join(lines)
        verdicts = ("PASS", "FAIL", "WARN", "SKIP")
        counts = {v: sum(r.verdict == v for r in self.results) for v in verdicts}
        extra = sum(r.verdict == "FAIL" and r.scope == "agentkey" for r in self.results)
        warned = f", {counts['WARN']} deviated" if counts["WARN"] else ""
        lines.append(
            f"{counts['PASS']} passed, {counts['FAIL']} failed{warned}, {counts['SKIP']} skipped"
        )
        deviated = (
            f"; {counts['WARN']} deviation(s) from the draft: safe, reported, not required"
            if counts["WARN"]
            else ""
        )
        if not self.ok:
            lines.append("-> the server does NOT honour the contract (a contract row failed)")
        elif extra:
            lines.append(
                "-> the server honours the idempotency contract (IETF draft); "
                f"{extra} agentkey-specific row(s) failed: reported, not required{deviated}"
            )
        else:
            lines.append(
                "-> the server honours the idempotency contract, agentkey's rows included"
                + deviated
            )
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class _Sent:
    status: int
    body: bytes
    oversize: bool
    replay_header: str | None  # the dialect header that said "true", if any
    retry_after: str | None
    code: str | None  # the problem code of an error body (RFC 9457, Stripe, agentkey)
    meaning: Meaning | None  # what that code says about the key, from _protocol's table
    secret: str | None = field(default=None, repr=False)  # the token, cut out of shown text

    def shown(self, text: str) -> str:
        """Something this server said, fit to print (the token redacted)."""
        return _redact(text, self.secret)

    def same_answer(self, other: _Sent) -> bool:
        """The same status and body: nothing here shows a second execution."""
        return (
            self.status == other.status
            and not self.oversize
            and not other.oversize
            and self.body == other.body
        )

    def ok(self) -> bool:
        return 200 <= self.status < 300


class _NoAnswer(Exception):
    """A request got no HTTP answer (its Failure is kept)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.description)
        self.failure = failure


class _Target:
    def __init__(
        self,
        client: _httpx2.AsyncClient,
        url: str,
        token: str | None,
        timeout: float,
        clock: Clock,
    ) -> None:
        self.client = client
        self.url = url
        self.token = token
        self.timeout = timeout
        self.clock = clock  # each exchange's deadline, and the wall time of Retry-After dates
        self.log: list[str] = []  # one line per request answered, for the rows' evidence

    async def post(self, body: bytes, key: str | None, *, url: str | None = None) -> _Sent:
        """One request, answered whole within ``timeout``.

        A request whose connection failed (a server that closed a kept-alive connection
        as it was reused) is sent once more on a fresh connection: its key makes that
        safe, and the one request without a key expects a refusal. Only a second
        failure raises :class:`_NoAnswer`; a request not answered within ``timeout`` is
        not resent.
        """
        headers = [("content-type", "application/json"), ("accept-encoding", "identity")]
        if key is not None:
            headers.append(("idempotency-key", key))
        if self.token is not None:
            headers.append(("authorization", f"Bearer {self.token}"))
        reply = await self._send(self.client, url or self.url, tuple(headers), body)
        if isinstance(reply, Failure) and not _timed_out(reply):
            async with _clients.make_async_client(_clients.make_timeout(self.timeout)) as fresh:
                reply = await self._send(fresh, url or self.url, tuple(headers), body)
        if isinstance(reply, Failure):
            if _timed_out(reply):
                reply = Failure(
                    reply.kind, f"no complete answer within --timeout ({self.timeout:g} s)"
                )
            raise _NoAnswer(reply)
        sent = _sent(reply, self.token)
        self.log.append(_evidence(url or self.url, key, sent))
        return sent

    async def _send(
        self,
        client: _httpx2.AsyncClient,
        url: str,
        headers: tuple[tuple[str, str], ...],
        body: bytes,
    ) -> Answer | Failure:
        deadline = self.clock.monotonic() + self.timeout  # the whole exchange, not each read
        out = Outgoing("POST", url, headers, body, same_origin=True, deadline=deadline)
        return await _http.send_async(
            client, out, auth=None, timeout=None, max_bytes=MAX_ANSWER_BYTES, clock=self.clock
        )


def _evidence(url: str, key: str | None, sent: _Sent) -> str:
    """One request and its answer, fit to print: the key as a digest, never whole."""
    path = urlsplit(url).path or "/"
    said = f"key {shown_key(key)}" if key is not None else "no key"
    marks = [f"{sent.replay_header}: true"] if sent.replay_header else []
    if sent.code:
        marks.append(sent.shown(sent.code))
    return _printable(f"POST {path} {said} -> {_status(sent)}" + "".join(f", {m}" for m in marks))


def _timed_out(failure: Failure) -> bool:
    return failure.description.startswith("the call's deadline")


def _sent(answer: Answer, token: str | None = None) -> _Sent:
    """What an answer showed, parsed as it came: nothing is redacted here (see _redact)."""
    marked = replay_header(answer, DEFAULT_REPLAY_HEADERS)
    error = not 200 <= answer.status_code < 300
    code, meaning = problem_code(parse_json(answer.content)) if error else (None, None)
    return _Sent(
        answer.status_code,
        answer.content,
        answer.oversize,
        marked,
        answer.header("retry-after"),
        code,
        meaning,
        token,
    )


#: A token at least this long is redacted wherever it appears in a server's text; a shorter
#: one only as a whole token, not inside a word or code (``x`` must not turn "executions"
#: into "e***ecutions", nor ``key`` "idempotency_key_missing" into "idempotency_***_missing").
_REDACT_ANYWHERE = 8


def _redact(text: str, token: str | None) -> str:
    """``text`` (something a server said) fit to print: the token cut out, then control
    characters replaced.

    Applied at output only, to the server's own words (a problem code, a reason, a header
    value, a transport error), never to an answer before it is parsed and never to the
    checker's own sentences. The token is matched in any case and with ``-`` and ``_``
    alike, as a problem code is normalised (lowercased, ``-`` read as ``_``).
    """
    if token:
        spelled = "".join("[-_]" if ch in "-_" else re.escape(ch) for ch in token)
        if len(token) < _REDACT_ANYWHERE:
            spelled = rf"(?<![A-Za-z0-9_-]){spelled}(?![A-Za-z0-9_-])"
        text = re.sub(spelled, "***", text, flags=re.IGNORECASE)
    return _printable(text)


def _printable(text: str) -> str:
    """``text`` fit for a terminal: control and format characters (escape sequences,
    bidirectional overrides) become ``?``."""
    return "".join("?" if unicodedata.category(ch) in ("Cc", "Cf") else ch for ch in text)


def _status(sent: _Sent) -> str:
    return f"{sent.status}" + (
        f" (over {MAX_ANSWER_BYTES // 1024} KiB, not read)" if sent.oversize else ""
    )


def _retry_after_problem(sent: _Sent, now: float) -> str | None:
    """Why a 409's Retry-After is no usable advice, or None when it is (``now``: wall time)."""
    value = sent.retry_after
    if value is None:
        return "no Retry-After"
    # Never raises: hundreds of digits read as "very long"; a date counts from now.
    seconds = retry_after(value, now)
    if seconds is None:
        return f"an unparseable Retry-After ({_clip(sent.shown(value))})"
    if seconds > _SANE_RETRY_AFTER:
        return f"an absurd Retry-After ({_clip(sent.shown(value))}: over {_SANE_RETRY_AFTER:g} s)"
    return None


def _clip(value: str, limit: int = 20) -> str:
    flat = "".join(ch if ch.isprintable() else "?" for ch in value)  # no escape reaches a tty
    return repr(flat if len(flat) <= limit else f"{flat[:limit]}... {len(flat)} chars")


def _other(style: HeaderStyle) -> HeaderStyle:
    return "sf-string" if style == "raw" else "raw"


@dataclass
class _Run:
    """The state the rows share: one plan, the first answer of step 0."""

    target: _Target
    plan: str
    body: bytes
    args: Mapping[str, Any]
    changed: Mapping[str, Any]
    style: HeaderStyle
    other_url: str
    first: _Sent | None = None
    marks_replays: bool = False  # the duplicate came back with a replay header

    def key(self, step: int, args: Mapping[str, Any], style: HeaderStyle | None = None) -> str:
        return StepKey.build(self.plan, step, args).header_value(style or self.style)


class _NoVerdict(Exception):
    """The check cannot go on, and that says nothing about the contract (the message why)."""


def _refused_fresh(first: _Sent, style: HeaderStyle) -> str:
    """Why a fresh request was not run, and which option to fix: no contract verdict."""
    status = first.status
    reason = short_reason(parse_json(first.body))
    said = f" ({first.shown(reason)})" if reason else ""
    head = f"the fresh request was answered {_status(first)}{said}, so the tool never ran: "
    if first.meaning is Meaning.KEY:
        others = " or ".join(f"--style {s}" for s in HEADER_STYLES if s != style)
        fix = f"the server refused the key itself; try {others}"
    elif status in (404, 405):
        fix = "no tool answers POST there; fix --path (and the base URL)"
    elif status in (401, 403):
        fix = "the credentials were refused; fix --token (or $AGENTKEY_CHECK_TOKEN)"
    elif 400 <= status < 500 and status not in _NOT_NOW:
        fix = "the tool refused the request; fix --path or --args (valid arguments for it)"
    elif status in _NOT_NOW:
        fix = "the server is busy or the key is in use; run the check again later"
    elif status >= 500:
        fix = "the tool failed; fix the tool or --args, then run the check again"
    else:
        fix = "expected a 2xx; fix --path"
    return head + fix


async def _fresh_and_duplicate(run: _Run) -> list[CheckResult]:
    key = run.key(0, run.args)
    first = await run.target.post(run.body, key)
    if not first.ok():
        raise _NoVerdict(_refused_fresh(first, run.style))
    if first.replay_header:
        return [
            CheckResult(
                "fresh request runs",
                "FAIL",
                f"{_status(first)} with a replay header ({first.replay_header}) for a key "
                "never sent before: the answer of another request",
            ),
            CheckResult("duplicate is replayed", "SKIP", "no fresh result"),
            CheckResult("replays carry a replay header", "SKIP", "no fresh result", "agentkey"),
        ]
    run.first = first
    results = [CheckResult("fresh request runs", "PASS", _status(first))]
    again = await run.target.post(run.body, key)
    if again.same_answer(first) or (
        again.replay_header and again.status == first.status and first.oversize
    ):
        how = "same status and body" if not first.oversize else "same status, replay header"
        results.append(CheckResult("duplicate is replayed", "PASS", f"{again.status}, {how}"))
    else:
        problems = []
        if again.status != first.status:
            problems.append(f"status {_status(again)} != {first.status}")
        elif first.oversize or again.oversize:
            problems.append("the answers were too large to compare and carry no replay header")
        else:
            problems.append("the body differs from the first answer: the tool ran again")
        results.append(CheckResult("duplicate is replayed", "FAIL", "; ".join(problems)))
    run.marks_replays = again.replay_header is not None
    if again.replay_header:
        verdict: Verdict = "PASS"
        detail = f"{again.replay_header}: true"
    else:
        verdict, detail = (
            "FAIL",
            "the duplicate's answer carries no replay header (Idempotent-Replayed: true or "
            "a known dialect); clients then cannot tell a replay from a run",
        )
    results.append(CheckResult("replays carry a replay header", verdict, detail, "agentkey"))
    return results


async def _concurrent(run: _Run, n: int) -> list[CheckResult]:
    key = run.key(1, run.args)
    sent = await asyncio.gather(*(run.target.post(run.body, key) for _ in range(n)))
    done = [s for s in sent if s.ok()]
    # Refused duplicates (409 in flight, 429/503, or another 4xx such as a 422): nothing ran
    # for them. Which status a server should use is the in-flight row's point, not this one's.
    waiting = [s for s in sent if s.status in _NOT_NOW or 400 <= s.status < 500]
    # A 5xx may be a run that failed: it cannot count as a refusal.
    others = sorted({s.status for s in sent if not s.ok() and s not in waiting})
    # An execution shows as a 2xx answer that no replay header marks and that repeats no
    # other answer's body: replays under an unknown header name still count once.
    executed: list[_Sent] = []
    for s in done:
        if not s.replay_header and not any(s.same_answer(e) for e in executed):
            executed.append(s)
    replays = [s for s in done if s.replay_header]
    name = "concurrent duplicates run once"
    problems = []
    if not done:
        statuses = sorted({s.status for s in sent})
        stuck = (
            " (a key stuck in progress answers 409 forever)"
            if all(s.status in IN_FLIGHT_STATUSES for s in sent)
            else ""
        )
        problems.append(
            f"none of the {n} answers was a 2xx ({statuses}): the step never ran{stuck}"
        )
    if len(executed) > 1:
        problems.append(f"the answers show {len(executed)} executions of one key")
    if others:
        problems.append(f"statuses {others}, which may be runs that failed")
    if executed and any(not r.same_answer(executed[0]) for r in replays):
        problems.append("a replay's answer differs from the executed one")
    counts = (
        f"{n} at once: {len(executed)} ran, {len(done) - len(executed)} replayed, "
        f"{len(waiting)} refused ({sorted({s.status for s in waiting}) or 'none'})"
    )
    results = [CheckResult(name, "FAIL" if problems else "PASS", "; ".join(problems) or counts)]
    name = "in-flight duplicate gets 409 + Retry-After"
    if not waiting:
        results.append(
            CheckResult(
                name,
                "SKIP",
                "no duplicate was answered while the step was in flight (the tool finished "
                "first, or the server held the duplicates and replayed); use a slower tool",
                "agentkey",
            )
        )
        return results
    bad = sorted({s.status for s in waiting if s.status != 409})
    now = run.target.clock.time()
    advice = [
        p for p in (_retry_after_problem(s, now) for s in waiting if s.status in _NOT_NOW) if p
    ]
    problems = []
    if bad:
        problems.append(f"in-flight duplicates got {bad}, not 409")
    if advice:
        problems.append(f"a refusal came with {advice[0]}")
    detail = "; ".join(problems) or f"{len(waiting)} got 409 with a usable Retry-After"
    results.append(CheckResult(name, "FAIL" if problems else "PASS", detail, "agentkey"))
    return results


async def _changed_args(run: _Run) -> list[CheckResult]:
    changed_body = canonical_json(run.changed)
    sent = await run.target.post(changed_body, run.key(0, run.changed))
    results = []
    name = "changed args are a new operation"
    if sent.ok() and not sent.replay_header:
        results.append(CheckResult(name, "PASS", _status(sent)))
    else:
        why = "replayed the old answer" if sent.replay_header else f"answered {_status(sent)}"
        results.append(
            CheckResult(
                name,
                "FAIL",
                f"same step, new args_hash: the server {why}; if the tool rejects the changed "
                "arguments, pass --changed-args with a variant it accepts",
            )
        )
    # The key of step 0 was used with `args`; the same key now carries another body.
    reused = await run.target.post(changed_body, run.key(0, run.args))
    results.append(_expect_mismatch("same key, other body is refused (422)", reused, "contract"))
    name = "hash does not match body gets 422"
    if run.style == "uuid":
        # A UUID key carries no args_hash: no server can compare it with the body.
        results.append(
            CheckResult(
                name,
                "SKIP",
                "--style uuid: a UUID key carries no args hash to compare with the body",
                "agentkey",
            )
        )
        return results
    # A fresh key, in the style the server took, whose args_hash names `args` while the
    # body is `changed`.
    mismatched = await run.target.post(changed_body, run.key(3, run.args))
    results.append(_expect_mismatch(name, mismatched, "agentkey"))
    return results


def _expect_mismatch(name: str, sent: _Sent, scope: Scope) -> CheckResult:
    """422, or a 4xx whose problem code means "another body" in a known dialect (Stripe's).

    Any other refusal (a 409, a 400) is safe, as nothing ran: a deviation (the draft
    says SHOULD), never a failure. A 2xx ran or replayed a body the key was not made
    for: that fails.
    """
    code = f" {sent.shown(sent.code)}" if sent.code else ""
    if 400 <= sent.status < 500 and sent.meaning is Meaning.KEY:
        # "must be a v4 UUID": the server refused the key itself and never looked at the
        # body, so this says nothing about the point of the row.
        reason = short_reason(parse_json(sent.body))
        said = f" ({sent.shown(reason)})" if reason else ""
        if scope == "agentkey":
            return CheckResult(
                name,
                "SKIP",
                f"{sent.status}{code}{said}: the key itself was refused, so the body was "
                "never compared (not tested)",
                scope,
            )
        return CheckResult(
            name,
            "WARN",
            f"{sent.status}{code}{said}: the key it took before was refused as malformed; "
            "nothing ran, but the draft says 422 for another body",
            scope,
        )
    if sent.status == 422:
        return CheckResult(name, "PASS", f"422{code}", scope)
    if 400 <= sent.status < 500 and sent.meaning is Meaning.MISMATCH:
        return CheckResult(
            name, "PASS", f"{sent.status}{code} (a mismatch dialect; the draft says 422)", scope
        )
    if 400 <= sent.status < 500:
        return CheckResult(
            name,
            "WARN",
            f"{sent.status}{code}: refused, so nothing ran twice, but the draft says 422; "
            "clients may read it as something else (a 409 as 'in flight')",
            scope,
        )
    ran = " (the tool ran or replayed with a body its key was not made for)" if sent.ok() else ""
    return CheckResult(name, "FAIL", f"{_status(sent)}; expected 422{ran}", scope)


async def _other_route(run: _Run) -> list[CheckResult]:
    """The key of step 0, already used on the tool's route, sent to another route."""
    first = run.first
    if first is None:
        return [
            CheckResult("key on another route is never replayed", "SKIP", "no fresh result"),
            CheckResult(
                "key on another route gets 422 key_reused", "SKIP", "no fresh result", "agentkey"
            ),
        ]
    sent = await run.target.post(run.body, run.key(0, run.args), url=run.other_url)
    # A server that marked the duplicate as a replay would mark this one too, so an
    # unmarked answer ran anew even when a deterministic tool answers byte for byte alike.
    if sent.ok() and sent.replay_header is not None:
        contract = CheckResult(
            "key on another route is never replayed",
            "FAIL",
            f"{sent.status} {sent.replay_header}: true: the other route was answered with the "
            "first route's stored result, a silent wrong answer",
        )
    elif sent.ok() and not run.marks_replays and sent.same_answer(first):
        contract = CheckResult(
            "key on another route is never replayed",
            "FAIL",
            f"{sent.status}: the other route gave the first route's answer byte for byte and "
            "the server marks no replays, so it looks like a silent wrong answer; if this tool "
            "answers identically every time, name one that does not with --other-path",
        )
    else:
        seen = "ran as its own operation" if sent.ok() else f"answered {_status(sent)}"
        contract = CheckResult("key on another route is never replayed", "PASS", seen)
    name = "key on another route gets 422 key_reused"
    if sent.status == 422 and sent.meaning is Meaning.REUSED:
        mine = CheckResult(name, "PASS", "422 key_reused", "agentkey")
    elif sent.status == 422:
        mine = CheckResult(name, "FAIL", "422, but not the problem type key_reused", "agentkey")
    else:
        hint = (
            "; if that path is no protected route, name one with --other-path"
            if sent.status in (404, 405)
            else ""
        )
        mine = CheckResult(
            name, "FAIL", f"{_status(sent)}; expected 422 key_reused{hint}", "agentkey"
        )
    return [contract, mine]


def _malformed_key(plan: str) -> str:
    """The malformed-key probe of one run: agentkey's shape (three parts, the last 64 hex)
    with a step that is no step, so it is malformed for agentkey's server whatever else
    it accepts, and for a UUID-only one; new per run (its plan), so a server that
    remembers keys never sees it twice."""
    return f"{plan}:step_malformed:{hashlib.sha256(plan.encode()).hexdigest()}"


async def _malformed(run: _Run) -> list[CheckResult]:
    results = []
    for name, key in (
        ("malformed key gets 400", _malformed_key(run.plan)),
        ("missing key gets 400", None),
    ):
        sent = await run.target.post(run.body, key)
        code = f" {sent.shown(sent.code)}" if sent.code else ""
        verdict: Verdict
        if sent.status == 400:
            verdict, detail = "PASS", f"400{code}"
        elif 400 <= sent.status < 500 and sent.meaning is Meaning.KEY:
            verdict = "WARN"
            detail = (
                f"{sent.status}{code}: refused as a key problem, so nothing ran, but agentkey "
                "answers 400"
            )
        else:
            ran = " (the tool ran or replayed without a usable key)" if sent.ok() else ""
            verdict, detail = "FAIL", f"{_status(sent)}; expected 400{ran}"
        results.append(CheckResult(name, verdict, detail, "agentkey"))
    return results


async def _styles(run: _Run) -> CheckResult:
    name = "both header styles accepted"
    if run.style == "uuid":
        return CheckResult(
            name, "SKIP", "--style uuid: the raw and sf-string forms are other keys", "agentkey"
        )
    key = StepKey.build(run.plan, 2, run.args)
    other = _other(run.style)
    first = await run.target.post(run.body, key.header_value(other))
    if not first.ok():
        return CheckResult(
            name, "FAIL", f"{other} style answered {_status(first)}; expected 2xx", "agentkey"
        )
    second = await run.target.post(run.body, key.header_value(run.style))
    if second.same_answer(first) or (second.replay_header and second.status == first.status):
        return CheckResult(
            name, "PASS", f"{other} ran, {run.style} replayed it: one key", "agentkey"
        )
    return CheckResult(
        name,
        "FAIL",
        f"{other} then {run.style} with the same key: the second answer ({_status(second)}) was "
        "not a replay, so the styles are not treated as one key",
        "agentkey",
    )


def _shown(url: str) -> str:
    """``url`` fit to print: no user info, query or fragment."""
    return redact_url(url) + ("?<query hidden>" if "?" in url else "")


def _ssl_context() -> ssl.SSLContext:
    try:
        import certifi  # httpx's own CA bundle, so the diagnosis sees what httpx saw

        return ssl.create_default_context(cafile=certifi.where())
    except ImportError:  # pragma: no cover - certifi comes with httpx
        return ssl.create_default_context()


async def _why_unreachable(
    url: str, failure: Failure, timeout: float, token: str | None = None
) -> str:
    """The cause of a failed first request: DNS, refused, TLS, or no answer."""
    said = _redact(failure.description, token)
    if failure.kind is FailureKind.IN_DOUBT:
        return (
            f"connected, but no HTTP answer came ({said}); the server "
            "closed the connection or took longer than --timeout"
        )
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    loop = asyncio.get_running_loop()
    try:
        await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout)
    except socket.gaierror as exc:
        return f"the DNS lookup of {host} failed ({exc.strerror})"
    except (TimeoutError, asyncio.TimeoutError):
        return f"the DNS lookup of {host} timed out"
    tls = _ssl_context() if parts.scheme == "https" else None
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=tls, server_hostname=host if tls else None),
            timeout,
        )
    except ssl.SSLCertVerificationError as exc:
        return f"the TLS certificate was refused ({exc.verify_message})"
    except ssl.SSLError as exc:
        return f"the TLS handshake failed ({exc.reason or type(exc).__name__})"
    except ConnectionRefusedError:
        return f"connection refused on port {port} (is the server running?)"
    except (TimeoutError, asyncio.TimeoutError):
        return f"connecting to port {port} timed out"
    except OSError as exc:
        return f"cannot connect to port {port} ({exc.strerror or type(exc).__name__})"
    writer.close()
    return f"the request failed before it was sent ({said})"


def _validate(
    base_url: str,
    path: str,
    token: str | None,
    style: str,
    concurrency: int,
    timeout: float,
    other_path: str | None,
) -> tuple[str, str]:
    """The tool URL and the other-route URL; ConfigurationError before any request."""
    joined = str(base_url).rstrip("/") + "/" + str(path).lstrip("/")
    try:
        parts = urlsplit(joined)
        host, _port = parts.hostname, parts.port  # the port is checked when read
    except (ValueError, TypeError):
        raise ConfigurationError(
            f"the target must be an http(s) URL and a path, got {_shown(str(base_url))!r} "
            f"and {str(path)!r}"
        ) from None
    if "@" in parts.netloc:
        # Neither printed nor sent: httpx would send it as Basic auth to whoever answers.
        raise ConfigurationError(
            "the target URL carries a user name or password (user:password@host); it was "
            "not sent and is not shown: drop it, and pass a bearer token with --token or "
            "$AGENTKEY_CHECK_TOKEN"
        )
    if parts.scheme not in ("http", "https") or not host:
        base = str(base_url)
        hint = f"; did you mean 'http://{base}'?" if "://" not in base else ""
        raise ConfigurationError(
            f"the target must be an http(s) URL such as http://127.0.0.1:8000, got "
            f"{_shown(base)!r}{hint}"
        )
    if token is not None and not _TOKEN.fullmatch(token):
        # Checked here, never echoed: httpx would fail deep inside with the token in
        # the exception (UnicodeEncodeError carries the whole header value).
        raise ConfigurationError(
            "the token (--token, $AGENTKEY_CHECK_TOKEN) must be printable ASCII without "
            "spaces or line breaks (a bearer token as issued); it was not sent"
        )
    if token is not None:
        require_secure(joined, what="a bearer token (--token, $AGENTKEY_CHECK_TOKEN)")
    if style not in HEADER_STYLES:
        raise ConfigurationError(
            f"unknown key header style {style!r}; use 'raw', 'sf-string' or 'uuid'"
        )
    if (
        isinstance(concurrency, bool)
        or not isinstance(concurrency, int)
        or not 2 <= concurrency <= MAX_CONCURRENCY
    ):
        raise ConfigurationError(
            f"concurrency must be a whole number from 2 to {MAX_CONCURRENCY}, got {concurrency!r}"
        )
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0 < timeout < float("inf")
    ):
        raise ConfigurationError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if other_path is None:
        other = parts.path.rstrip("/") + "/agentkey-check-other-route"
    else:
        other = "/" + str(other_path).lstrip("/")
        if other == parts.path:
            raise ConfigurationError(
                "other_path (--other-path) must name another route than path (--path)"
            )
    return joined, urlunsplit(parts._replace(path=other))


def check_options(
    base_url: str,
    *,
    path: str,
    token: str | None = None,
    style: str = "raw",
    other_path: str | None = None,
) -> None:
    """Refuse an unusable target, path, token or style (ConfigurationError), sending nothing."""
    _validate(base_url, path, token, style, 8, 30.0, other_path)


async def acheck_server(
    base_url: str,
    *,
    path: str,
    args: Mapping[str, Any],
    changed_args: Mapping[str, Any] | None = None,
    token: str | None = None,
    style: HeaderStyle = "raw",
    concurrency: int = 8,
    timeout: float = 30.0,
    other_path: str | None = None,
    progress: Callable[[CheckResult], None] | None = None,
    clock: Clock | None = None,
) -> CheckReport:
    """Check every point of the contract against ``base_url + path``. Real side effects!

    ``other_path`` is a second route the step's key is sent to (default: ``path`` plus
    ``/agentkey-check-other-route``, a route no tool serves that a prefix rule such as
    ``/tools/*`` still protects). ``progress`` is called with each row as soon as it is
    decided (the CLI prints them on a terminal while the check runs). ``clock`` (an
    :class:`agentkey.Clock`; default: the system's) measures each request's ``timeout``
    and the ``Retry-After`` dates.
    """
    url, other_url = _validate(base_url, path, token, style, concurrency, timeout, other_path)
    if clock is not None and not isinstance(clock, Clock):
        raise ConfigurationError(
            f"clock must be an agentkey.Clock, or None for the system clock; got {clock!r}"
        )
    clock = clock if clock is not None else default_clock()
    plain = to_jsonable(args)
    changed = (
        to_jsonable(changed_args, root="changed_args")
        if changed_args is not None
        else {**plain, "agentkey_check_nonce": uuid.uuid4().hex}
    )
    if canonical_json(changed) == canonical_json(plain):
        raise ConfigurationError("changed_args must differ from args")
    plan = "agentkey-check-" + uuid.uuid4().hex[:16]
    shown = _shown(url)
    results: list[CheckResult] = []
    no_verdict = None
    async with _clients.make_async_client(_clients.make_timeout(timeout)) as client:
        target = _Target(client, url, token, float(timeout), clock)
        run = _Run(target, plan, canonical_json(plain), plain, changed, style, other_url)
        try:
            results += _done(await _fresh_and_duplicate(run), target, progress)
        except _NoAnswer as exc:
            if run.first is None:  # nothing answered yet
                cause = await _why_unreachable(url, exc.failure, float(timeout), token)
                why = _printable(f"could not reach {shown}: {cause}")
                return CheckReport(shown, style, (), unreachable=why)
            return CheckReport(shown, style, (), no_verdict=_transport(shown, exc, token))
        except _NoVerdict as exc:
            return CheckReport(shown, style, (), no_verdict=_printable(str(exc)))
        steps: Sequence[Any] = (
            lambda: _concurrent(run, concurrency),
            lambda: _changed_args(run),
            lambda: _other_route(run),
            lambda: _malformed(run),
            lambda: _styles(run),
        )
        for step in steps:
            try:
                produced = await step()
            except _NoAnswer as exc:
                no_verdict = _transport(shown, exc, token)
                break
            results += _done(
                produced if isinstance(produced, list) else [produced], target, progress
            )
    return CheckReport(shown, style, tuple(results), no_verdict=no_verdict)


def _done(
    rows: list[CheckResult], target: _Target, progress: Callable[[CheckResult], None] | None
) -> list[CheckResult]:
    """The rows of one step, fit to print, with the step's requests as their evidence."""
    evidence, target.log = tuple(target.log), []
    done = [CheckResult(r.name, r.verdict, _printable(r.detail), r.scope, evidence) for r in rows]
    if progress is not None:
        for row in done:
            progress(row)
    return done


def _transport(shown: str, exc: _NoAnswer, token: str | None) -> str:
    return _printable(
        f"a transport problem in mid-check: no answer from {shown} "
        f"({_redact(exc.failure.description, token)}), twice (the second time on a fresh "
        "connection). That says nothing about the contract; run the check again"
    )


def check_server(
    base_url: str,
    *,
    path: str,
    args: Mapping[str, Any],
    changed_args: Mapping[str, Any] | None = None,
    token: str | None = None,
    style: HeaderStyle = "raw",
    concurrency: int = 8,
    timeout: float = 30.0,
    other_path: str | None = None,
    progress: Callable[[CheckResult], None] | None = None,
    clock: Clock | None = None,
) -> CheckReport:
    """Blocking form of :func:`acheck_server`."""
    return asyncio.run(
        acheck_server(
            base_url,
            path=path,
            args=args,
            changed_args=changed_args,
            token=token,
            style=style,
            concurrency=concurrency,
            timeout=timeout,
            other_path=other_path,
            progress=progress,
            clock=clock,
        )
    )
