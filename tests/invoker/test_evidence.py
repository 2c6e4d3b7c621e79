"""What counts as evidence that a route honours keys, and what is resent (issue 34, 35).

A real plain tool on loopback (it honours no key), scripted per route, counts its
executions and the OPTIONS probes it gets. Every case is a duplicate the old code
made (2+ executions) or an answer it misread; both invokers.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agentkey import (
    AsyncToolInvoker,
    InvokeError,
    OutcomeUnknown,
    PlanSession,
    RetryPolicy,
    Step,
    StepInProgress,
    StepRepeated,
    ToolInvoker,
    ToolResult,
    ToolUnreachable,
)
from agentkey.journal import (
    CallRecord,
    CallState,
    HttpLookup,
    InDoubt,
    MemoryJournal,
    SQLiteJournal,
    Verdict,
)
from agentkey.journal._records import route_of
from agentkey.testing import FakeClock
from tests._loopback import serve

DRIVERS = ("sync", "async")
FAST = RetryPolicy(
    max_attempts=4, deadline=10.0, initial_backoff=0.001, max_backoff=0.01, max_retry_after=0.01
)
NOT_RUN = {"type": "urn:agentkey:problem:not_run", "detail": "no replica confirmed the claim"}
IN_DOUBT = {
    "type": "urn:agentkey:problem:in_doubt",
    "detail": "an earlier request may have started its side effect",
}

#: One answer of the tool: (runs the tool first?, status, JSON body, extra headers).
Reply = tuple[bool, int, Any, dict[str, str]]


def ran(status: int = 201, body: Any = None, **headers: str) -> Reply:
    return (True, status, body, headers)


def refused(status: int, body: Any = None, **headers: str) -> Reply:
    return (False, status, body, headers)


@dataclass
class Plain:
    """A tool that honours no key. ``script[path]``: the replies to its next POSTs (then
    201 after running); ``by_args``: a reply for a body with that ``kind`` argument;
    ``options``: what OPTIONS answers, given the Access-Control-Request-Method it got."""

    script: dict[str, list[Reply]] = field(default_factory=dict)
    by_args: dict[str, Reply] = field(default_factory=dict)
    options: Callable[[str | None], dict[str, str]] = lambda method: {}
    executions: Counter[str] = field(default_factory=Counter)
    probes: list[tuple[str, str | None]] = field(default_factory=list)
    later: list[Callable[[], None]] = field(default_factory=list)
    answers: dict[str, Any] = field(default_factory=dict)
    landed: threading.Event = field(default_factory=threading.Event)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client gave up before the whole request arrived: nothing runs
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if method == "OPTIONS":
            asked = headers.get("access-control-request-method")
            self.probes.append((path, asked))
            await _send(send, 204, None, self.options(asked))
            return
        if method == "GET" and path.startswith("/lookup/"):
            key = path.removeprefix("/lookup/")
            found = self.answers.get(key)
            await _send(send, 200 if found else 404, found or {"error": "no such call"}, {})
            return
        args = json.loads(body or b"{}")
        steps = self.script.get(path) or []
        kind = args.get("kind") if isinstance(args, dict) else None
        reply = self.by_args.get(kind) if isinstance(kind, str) else None
        if reply is None:
            reply = steps.pop(0) if steps else ran()
        run, status, answer, extra = reply
        if run:
            self.executions[path] += 1
            answer = answer if answer is not None else {"run": self.executions[path]}
            self.answers[headers.get("idempotency-key", "")] = {"run": self.executions[path]}
        await _send(send, status, answer, extra)


async def _send(send: Any, status: int, body: Any, headers: dict[str, str]) -> None:
    content = b"" if body is None else json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": content})


@pytest.fixture
def plain() -> Iterator[tuple[Plain, str]]:
    tool = Plain()
    with serve(tool) as url:
        yield tool, url


def invoke(
    driver: str, url: str, steps: list[Step], **options: Any
) -> list[ToolResult | InvokeError]:
    """Each step through one invoker of ``driver``: its result or its error."""
    options.setdefault("retry", FAST)
    options.setdefault("route_template", "/tools/{tool}")
    options.setdefault("hooks", ())
    options.setdefault("journal", MemoryJournal())
    extra = options.pop("invoke", {})
    ahead = options.pop("wall_ahead", 0.0)  # the invoker's wall clock, this much later
    options.setdefault("clock", FakeClock(wall=time.time() + ahead))
    out: list[ToolResult | InvokeError] = []
    if driver == "sync":
        with ToolInvoker(url, **options) as invoker:
            for step in steps:
                try:
                    out.append(invoker.invoke(step, **extra))
                except InvokeError as exc:  # noqa: PERF203 - a few calls
                    out.append(exc)
        return out

    async def main() -> None:
        async with AsyncToolInvoker(url, **options) as invoker:
            for step in steps:
                try:
                    out.append(await invoker.invoke(step, **extra))
                except InvokeError as exc:  # noqa: PERF203 - a few calls
                    out.append(exc)

    asyncio.run(main())
    return out


def charge(n: int = 0, **args: Any) -> Step:
    return PlanSession.new().step(n, "charge", {"amount": 1999, **args})


# --- no resend to a tool not known to honour keys, whatever the status --------------------


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("status", [503, 429, 500])
def test_an_answer_after_the_effect_is_not_resent_to_a_plain_tool(
    plain: tuple[Plain, str], status: int, driver: str
) -> None:
    """503/429 after the tool ran (a gateway after an upstream reset): 1 execution and
    OutcomeUnknown (before: 503 and 429 were resent, 2 executions, "executed")."""
    tool, url = plain
    tool.script["/tools/charge"] = [
        ran(status, {"error": "upstream reset"}, **{"Retry-After": "0"})
    ]
    [got] = invoke(driver, url, [charge()])
    assert isinstance(got, OutcomeUnknown), got
    assert "did not send it again" in str(got)
    assert "at most once" not in str(got)
    assert tool.executions["/tools/charge"] == 1


@pytest.mark.parametrize("driver", DRIVERS)
def test_agentkeys_not_run_is_resent_and_ends_safe_to_retry(
    plain: tuple[Plain, str], driver: str
) -> None:
    """agentkey's 503 not_run (nothing ran) is resent with the same key; refused to the end,
    the call ends ToolUnreachable "safe to retry", not OutcomeUnknown (before)."""
    tool, url = plain
    no = refused(503, NOT_RUN, **{"Retry-After": "0", "Idempotency-Protected": "true"})
    tool.script["/tools/charge"] = [no] * FAST.max_attempts
    step = charge()
    journal = MemoryJournal()
    [got] = invoke(driver, url, [step], journal=journal)
    assert isinstance(got, ToolUnreachable), got
    message = str(got)
    assert "did not run" in message
    assert "safe to call it again" in message
    assert "no replica confirmed the claim" in message
    assert step.idempotency_key not in message
    assert tool.executions["/tools/charge"] == 0
    assert journal.get(step.idempotency_key).state is CallState.NOT_SENT  # type: ignore[union-attr]
    tool.script["/tools/charge"] = [no]
    [again] = invoke(driver, url, [step], journal=journal)
    assert isinstance(again, ToolResult), again  # refused once, then run: once
    assert tool.executions["/tools/charge"] == 1


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_not_run_body_without_the_protection_header_is_not_believed(
    plain: tuple[Plain, str], driver: str
) -> None:
    """A plain tool (a gateway) that charged, then forwarded a downstream agentkey service's
    503 not_run body without Idempotency-Protected: "may have run", not resent, 1 execution
    (before: believed, resent with the same key, 2 executions)."""
    tool, url = plain
    tool.script["/tools/charge"] = [ran(503, NOT_RUN, **{"Retry-After": "0"})]
    step = charge()
    [got] = invoke(driver, url, [step], journal=MemoryJournal())
    assert isinstance(got, OutcomeUnknown), got
    assert "did not send it again" in str(got)
    assert tool.executions["/tools/charge"] == 1


@pytest.mark.parametrize("driver", DRIVERS)
def test_agentkeys_in_doubt_is_outcome_unknown_at_once(
    plain: tuple[Plain, str], driver: str
) -> None:
    """409 in_doubt: OutcomeUnknown at the first answer, with the server's reason (before:
    read as "in flight" and resent until the budget ended in StepInProgress)."""
    tool, url = plain
    tool.script["/tools/charge"] = [refused(409, IN_DOUBT)] * FAST.max_attempts
    step = charge()
    [got] = invoke(driver, url, [step], honours_keys=True)
    assert isinstance(got, OutcomeUnknown), got
    assert got.attempts == 1
    assert "may have started its side effect" in str(got)
    assert step.idempotency_key not in str(got)
    assert len(tool.script["/tools/charge"]) == FAST.max_attempts - 1  # sent once


# --- evidence is explicit -----------------------------------------------------------------

FALSE_EVIDENCE = {
    "missing-field": refused(400, {"error": "missing_key"}),
    "card-fingerprint": refused(402, {"detail": "card fingerprint does not match"}),
    "tool-in-progress": refused(409, {"code": "in_progress"}, **{"Retry-After": "0"}),
}


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("refusal", FALSE_EVIDENCE)
def test_a_plain_tools_own_refusals_are_not_evidence(
    plain: tuple[Plain, str], refusal: str, driver: str, tmp_path: Path
) -> None:
    """A plain tool's 400 missing_key, 402 "fingerprint does not match", 409 in_progress,
    then a 502 after a charge on the same route: 1 execution (before: the refusal was
    evidence for 30 days, shared through the journal, and the charge was resent)."""
    tool, url = plain
    tool.by_args["bad"] = FALSE_EVIDENCE[refusal]
    journal = SQLiteJournal(tmp_path / "journal.sqlite3")
    # The 409 is asked about again until the deadline: a short one, at a modest pace.
    retry = FAST.replace(deadline=2.0, initial_backoff=0.1, max_backoff=0.5)
    [first] = invoke(driver, url, [charge(kind="bad")], journal=journal, retry=retry)
    assert isinstance(first, StepInProgress if "progress" in refusal else InvokeError), first
    tool.script["/tools/charge"] = [ran(502, {"error": "bad gateway"})]
    [got] = invoke(driver, url, [charge(1)], journal=journal)  # another process, say
    assert isinstance(got, OutcomeUnknown), got
    assert tool.executions["/tools/charge"] == 1


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_redirects_evidence_is_not_the_targets(plain: tuple[Plain, str], driver: str) -> None:
    """A protected route answers 308 to an unprotected one, which charges and answers 502:
    1 execution (before: the 308's evidence was applied to the target, 2 executions)."""
    tool, url = plain
    moved = {"Location": "/tools/new", "Idempotency-Protected": "true"}
    tool.script["/tools/charge"] = [refused(308, None, **moved)] * 3
    tool.script["/tools/new"] = [ran(502, {"error": "bad gateway"})]
    [got] = invoke(driver, url, [charge()])
    assert isinstance(got, OutcomeUnknown), got
    assert tool.executions["/tools/new"] == 1
    assert ("/tools/new", "POST") in tool.probes  # the target's own route was asked


@pytest.mark.parametrize("driver", DRIVERS)
def test_the_probe_names_the_method_and_counts_only_for_it(
    plain: tuple[Plain, str], driver: str
) -> None:
    """A path protected for POST only (OPTIONS says so for the method the preflight names):
    a PATCH that may have run is not resent (before: no method named, the route counted as
    protected for PATCH, 2 executions)."""
    tool, url = plain

    def advertise(method: str | None) -> dict[str, str]:
        # Like agentkey's middleware before issue 34 when no method is named.
        return {"Idempotency-Protected": "true"} if method in (None, "POST") else {}

    tool.options = advertise
    tool.script["/tools/charge"] = [ran(502, {"error": "bad gateway"})]
    [got] = invoke(driver, url, [charge()], invoke={"method": "PATCH"})
    assert isinstance(got, OutcomeUnknown), got
    assert tool.probes == [("/tools/charge", "PATCH")]
    assert tool.executions["/tools/charge"] == 1


@pytest.mark.parametrize("driver", DRIVERS)
def test_the_probe_runs_once_per_route_per_invoker(plain: tuple[Plain, str], driver: str) -> None:
    """Five calls that may have run on one route: one OPTIONS probe (before: one per call)."""
    tool, url = plain
    tool.script["/tools/charge"] = [ran(502, {"error": "bad gateway"})] * 5
    got = invoke(driver, url, [charge(n) for n in range(5)])
    assert all(isinstance(g, OutcomeUnknown) for g in got), got
    assert len(tool.probes) == 1
    assert tool.executions["/tools/charge"] == 5  # each once


# --- a lookup's "not run" only once the request can no longer arrive -----------------------


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_lookup_that_answers_too_soon_does_not_resend(
    plain: tuple[Plain, str], driver: str
) -> None:
    """A gateway answers 504 while the request is still inside the tool (it charges after):
    the lookup's 404 is "cannot tell yet", the call stays in doubt, 1 execution (before:
    404 meant "not run", the call was sent again and charged twice). Asked again once
    not_run_after has passed on the invoker's clock, the lookup finds the charge."""
    tool, url = plain
    tool.script["/tools/charge"] = [refused(504, {"error": "gateway timeout"})]
    step = charge()
    journal = MemoryJournal()
    lookup = HttpLookup("/lookup/{key}")
    [got] = invoke(driver, url, [step], journal=journal, reconcile=lookup)
    assert isinstance(got, OutcomeUnknown), got
    assert "could still arrive" in str(got)
    assert tool.executions["/tools/charge"] == 0
    # The held request lands in the tool now.
    tool.executions["/tools/charge"] += 1
    tool.answers[step.idempotency_key] = {"run": 1}
    [later] = invoke(driver, url, [step], journal=journal, reconcile=lookup)
    assert isinstance(later, ToolResult), later
    assert later.source == "reconcile"
    assert tool.executions["/tools/charge"] == 1


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_lookups_not_run_is_believed_once_not_run_after_has_passed(
    plain: tuple[Plain, str], driver: str
) -> None:
    """The same 404, asked after not_run_after on the invoker's (injected) wall clock: the
    call did not run, and it is sent: 1 execution."""
    tool, url = plain
    tool.script["/tools/charge"] = [refused(504, {"error": "gateway timeout"})]
    step = charge()
    journal = MemoryJournal()
    lookup = HttpLookup("/lookup/{key}", not_run_after=30)
    [got] = invoke(driver, url, [step], journal=journal, reconcile=lookup)
    assert isinstance(got, OutcomeUnknown), got
    [later] = invoke(driver, url, [step], journal=journal, reconcile=lookup, wall_ahead=31.0)
    assert isinstance(later, ToolResult), later
    assert later.source == "tool"
    assert tool.executions["/tools/charge"] == 1


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_custom_hooks_not_run_said_too_soon_does_not_resend(
    plain: tuple[Plain, str], driver: str
) -> None:
    """A hand-written reconcile= hook that finds nothing while the request is still inside the
    tool: "cannot tell yet", 1 execution (before: believed at once, resent, 2 executions).
    The hook sees when the last request may have left; once not_run_after has passed on the
    invoker's (injected) wall clock, its "not run" is believed and the call is sent."""
    tool, url = plain
    tool.script["/tools/charge"] = [refused(504, {"error": "gateway timeout"})]
    step = charge()
    journal = MemoryJournal()
    asked: list[InDoubt] = []

    def finds_nothing(call: InDoubt) -> Verdict:
        asked.append(call)
        return Verdict.not_run()

    [got] = invoke(driver, url, [step], journal=journal, reconcile=finds_nothing)
    assert isinstance(got, OutcomeUnknown), got
    assert "could still arrive" in str(got)
    assert asked
    assert asked[-1].last_sent_at is not None
    assert asked[-1].last_sent_at <= time.time()
    tool.executions["/tools/charge"] += 1  # the held request lands in the tool now
    [same] = invoke(driver, url, [step], journal=journal, reconcile=finds_nothing)
    assert isinstance(same, OutcomeUnknown), same
    assert tool.executions["/tools/charge"] == 1
    # A tool known to have settled every request (the hook says so) after 61 s of quiet.
    step2 = charge(1)
    tool.script["/tools/charge"] = [refused(504, {"error": "gateway timeout"})]
    [first] = invoke(driver, url, [step2], journal=journal, reconcile=finds_nothing)
    assert isinstance(first, OutcomeUnknown), first
    [later] = invoke(driver, url, [step2], journal=journal, reconcile=finds_nothing, wall_ahead=61)
    assert isinstance(later, ToolResult), later
    assert later.source == "tool"
    assert tool.executions["/tools/charge"] == 2


# --- honest messages ----------------------------------------------------------------------


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_call_settled_as_run_says_so_not_that_its_answer_was_too_large(
    plain: tuple[Plain, str], driver: str
) -> None:
    """``journal settle --ran`` on a call in doubt, then the step again: StepRepeated that
    says an operator settled it and no answer was received; nothing sent (before: "its
    answer is larger than the journal keeps", which was false)."""
    tool, url = plain
    tool.script["/tools/charge"] = [ran(502, {"error": "bad gateway"})]
    step = charge()
    journal = MemoryJournal()
    [first] = invoke(driver, url, [step], journal=journal)
    assert isinstance(first, OutcomeUnknown), first
    journal.settle(step.idempotency_key, CallState.ANSWERED, reason="settled by an operator: ran")
    with pytest.raises(StepRepeated) as caught:
        invoke_raising(driver, url, step, journal=journal)
    message = str(caught.value)
    assert "an operator settled it as run" in message
    assert "no answer of it was ever received" in message
    assert "larger than the journal keeps" not in message
    assert step.idempotency_key not in message
    assert tool.executions["/tools/charge"] == 1


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_call_pending_under_a_live_process_says_what_may_have_happened(
    plain: tuple[Plain, str], driver: str
) -> None:
    """A record pending under another live process all deadline long (its finish may have
    failed): StepInProgress names both possibilities, nothing sent (before: "was being
    sent ... for the whole deadline", though it may have been answered long ago)."""
    tool, url = plain
    step = charge()
    journal = MemoryJournal()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        now = time.time()
        owner = f"{socket.gethostname()}:{sleeper.pid}:cafe:1"
        record = CallRecord(
            key=step.idempotency_key, plan=step.plan_session_id, step=step.label,
            tool="charge", args_hash=step.key.args_hash,
            route=route_of("POST", f"{url}/tools/charge"), created_at=now - 5,
            updated_at=now - 5, owner=owner, lease_until=now + 3600,
        )  # fmt: skip
        assert journal.begin(record).existing is None
        short = RetryPolicy(deadline=0.3, initial_backoff=0.01, max_backoff=0.05)
        with pytest.raises(StepInProgress) as caught:
            invoke_raising(driver, url, step, journal=journal, retry=short)
    finally:
        sleeper.kill()
        sleeper.wait(10)
    message = str(caught.value)
    assert "could not record how it ended" in message
    assert f"process {sleeper.pid}" in message
    assert step.idempotency_key not in message
    assert tool.executions["/tools/charge"] == 0


def invoke_raising(driver: str, url: str, step: Step, **options: Any) -> ToolResult:
    """One step through a fresh invoker of ``driver``; its error is raised."""
    [got] = invoke(driver, url, [step], **options)
    if isinstance(got, InvokeError):
        raise got
    return got


class CountingJournal(MemoryJournal):
    """A memory journal that counts what it was told about routes."""

    def __init__(self) -> None:
        super().__init__()
        self.learnt: list[tuple[str, str]] = []

    def learn(self, route: str, evidence: str, *, ttl: float | None = None) -> None:
        self.learnt.append((route, evidence))
        super().learn(route, evidence, ttl=ttl)

    async def alearn(self, route: str, evidence: str, *, ttl: float | None = None) -> None:
        self.learn(route, evidence, ttl=ttl)


@pytest.mark.parametrize("driver", DRIVERS)
def test_evidence_seen_again_is_refreshed_in_the_journal_once_a_while(
    plain: tuple[Plain, str], driver: str
) -> None:
    """A protected route's answers keep showing the header: one invoker tells the journal
    once per memory TTL (10 minutes on its injected clock), not once per call, and again
    after it (before: never again, so evidence in daily use expired after 30 days)."""
    tool, url = plain
    tool.script["/tools/charge"] = [ran(201, None, **{"Idempotency-Protected": "true"})] * 6
    journal = CountingJournal()
    clock = FakeClock()
    options: dict[str, Any] = {
        "route_template": "/tools/{tool}", "hooks": (), "journal": journal, "retry": FAST,
        "clock": clock,
    }  # fmt: skip
    learnt: list[int] = []
    if driver == "sync":
        with ToolInvoker(url, **options) as invoker:
            for n in range(6):
                if n == 3:
                    clock.advance(601.0)
                invoker.invoke(charge(n))
                learnt.append(len(journal.learnt))
    else:

        async def main() -> None:
            async with AsyncToolInvoker(url, **options) as invoker:
                for n in range(6):
                    if n == 3:
                        clock.advance(601.0)
                    await invoker.invoke(charge(n))
                    learnt.append(len(journal.learnt))

        asyncio.run(main())
    assert learnt == [1, 1, 1, 2, 2, 2]
    assert journal.learnt[0] == (f"POST {url}/tools/charge", "protection header")
