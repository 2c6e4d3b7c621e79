"""The invoker's state machine across answers, without I/O (like ``httpx.Auth.auth_flow``).

A flow is a generator of the effects in ``_effects``: it yields one (send this
request, sleep, give an event to the hooks, write to the journal, ask the
reconcile hook) and receives what carrying it out gave. It returns
:class:`Finished`. It reads time only through the injected clocks, so a test
drives it with a fake clock and no socket. The decisions about one answer are
``_protocol``'s; the waits are ``_schedule``'s; the drivers in ``_drive`` only
carry effects out.

:func:`attempts` is the client's one retry loop (send, judge, wait, send
again): the step, its polls and the token endpoint (``auth._endpoint``) each
give it an :class:`Exchange`, their request and their classifier.

```
(identity rule ⇄ journal: begin(repeats=True, known=) until it records: the key, once)
CallStart ─▶ (journal: begin ─▶ earlier record of the key? settle it first)
          ─▶ (Attempt ─▶ send ─▶ classify ─▶ [in doubt: honoured? resend | ask | stop])*
          ─▶ (Sleep ─▶ poll)* ─▶ journal: finish ─▶ CallEnd
```

Three rules carry the weight:

- **No blind resend.** A request that may have run (a read timeout after
  sending, a reset, a 5xx) is sent again only to a route known to honour
  Idempotency-Key: declared (``honours_keys=True``), or shown by an answer
  (:func:`~agentkey.client._protocol.key_evidence`), or by the route's answer to a
  harmless ``OPTIONS`` asked once. Otherwise the user's reconcile hook decides,
  or the call ends :class:`~agentkey.OutcomeUnknown` and stays in doubt in the
  journal.
- **The journal first.** With a journal, the call is recorded before its
  first byte leaves, and its end after; a call found in the journal is
  settled from there (answered: its answer, to a tool that does not honour
  keys; in doubt: resent only where that is safe).
- **One deadline.** Every wait is cut to the time left, and no new request or
  poll starts once it has passed; waiting on a request of the same key in
  flight elsewhere is bounded by the deadline, not by ``max_attempts``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeAlias, TypeVar

from .._exceptions import (
    ConfigurationError,
    InvokeError,
    KeyReused,
    OutcomeUnknown,
    PayloadMismatch,
    PollTimeout,
    StepInProgress,
    StepRepeated,
    ToolError,
    ToolUnreachable,
)
from .._keys import StepKey, shown_key
from .._schedule import Backoff
from ..journal._records import Begun, CallRecord, CallState, ended, pending, route_of
from ..journal._verify import HttpLookup, InDoubt, Verdict, not_run_after, not_yet
from ._effects import (
    Answer,
    Effect,
    Emit,
    Failure,
    FailureKind,
    Journaled,
    Outgoing,
    Received,
    Reconcile,
    Sleep,
)
from ._evidence import RouteMemory
from ._honours import Declarations
from ._hooks import (
    EVENT_TYPES,
    AttemptEvent,
    CallEndEvent,
    CallStartEvent,
    GiveUpEvent,
    PollEvent,
    RepeatEvent,
    ReplayEvent,
    RetryEvent,
    _one_line,
)
from ._net import origin_of, redact_url, scrub_json
from ._policies import PollPolicy, RetryPolicy
from ._protocol import (
    MARKS_REPLAYS,
    PROTECTED_HEADER,
    Action,
    CallContext,
    Decision,
    ProtocolConfig,
    budget_exhausted,
    classify,
    interpret_poll,
    key_evidence,
    parse_json,
    poll_target,
    ran_marker,
    short_reason,
)

__all__ = [
    "HOOK_OWNED",
    "KEY_HEADER",
    "Again",
    "Call",
    "Exchange",
    "Finished",
    "Flow",
    "Identity",
    "Pick",
    "Settings",
    "attempts",
    "check_headers",
    "identified",
    "invoke",
    "resume",
]

KEY_HEADER = "Idempotency-Key"
#: The verdicts on how a step's answer came about: it ran the step now, it replayed an
#: earlier run's outcome, or it answered and nothing showed which (the tool marks no
#: replays, and the invoker has not seen it mark one).
OUTCOMES = ("executed", "replayed", "answered")
#: The header of the OPTIONS probe that names the call's method (a CORS preflight's).
PREFLIGHT_HEADER = "Access-Control-Request-Method"
MAX_POLL_REDIRECTS = 10
#: Sends in a row that all failed before reaching the tool, after which it is unreachable.
MAX_UNREACHABLE = 3
#: The longest wait between two questions about a request of the same key in flight.
IN_FLIGHT_CAP = 2.0
#: How often a runtime's call chooses its key again because an identical call appeared.
MAX_CHOICES = 32
#: Slack on a pending record's lease beyond the call's deadline (seconds).
LEASE_SLACK = 30.0
#: Header names agentkey sets itself; an AttemptEvent hook may add any other (``traceparent``).
HOOK_OWNED = frozenset(
    {
        "idempotency-key",
        "authorization",
        "proxy-authorization",
        "cookie",
        "host",
        "accept",
        "accept-encoding",
        "transfer-encoding",
    }
)
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 field-name
_FIELD_VALUE = re.compile(r"(?:[\x21-\x7e](?:[\x20-\x7e\t]*[\x21-\x7e])?)?")  # visible ASCII

#: A reconcile hook: a callable of the call in doubt, or an HTTP lookup run by the flow.
Reconciler: TypeAlias = "HttpLookup | Callable[[InDoubt], Any]"


@dataclass(slots=True)  # not frozen: built on every call (see _effects.Outgoing)
class Call:
    """Everything one logical call needs, computed once before the first send."""

    url: str
    method: str
    headers: tuple[tuple[str, str], ...] = field(repr=False)  # the user's (checked)
    key: str  # the raw key, for events, errors and the journal
    label: str | None  # the step label, e.g. step_003
    key_value: str  # the Idempotency-Key header value in the configured style
    body: bytes = field(repr=False)
    tool: str | None = None  # the step's tool, for events and the journal
    plan: str = ""  # the plan session id
    args_hash: str | None = None
    call_id: str | None = None  # the agent runtime's id of this call (a tool call id)
    context: str | None = None  # the conversation turn it answers (a user message's id)
    owner: str = ""  # this process, as the journal names it
    repeat_of: str | None = None  # the label of the step this call repeats (on_repeat)
    reconcile: Reconciler | None = None  # the reconcile hook of this call's tool
    on_repeat: str = "replay"  # the step's policy for a repeat the journal finds
    key_style: str = "raw"  # how the key's header value is written (for a repeat's key)
    #: An agent runtime's rule for this call's key (:func:`identified`); None: the key above.
    identity: Identity | None = None


@dataclass(frozen=True, slots=True)
class Pick:
    """What a runtime's identity rule chose for a call: send it under ``key``
    (``repeat_of``: the label of the earlier call whose key it is), or answer it with
    ``answer`` (the rule's own value, returned as is) and send nothing."""

    key: str | None = None
    repeat_of: str | None = None
    answer: Any = None


class Identity(Protocol):
    """An agent runtime's rule for which key a call gets (``agentkey.integrations._identity``).

    ``choose`` is given the plan's calls with the same tool and arguments that the
    journal holds: all of them when ``looked`` is true, none read yet otherwise (a key
    chosen then is checked against the journal in the same step that records it). It
    is asked again whenever the journal shows an identical call it did not see.
    """

    def choose(self, earlier: Sequence[CallRecord], looked: bool) -> Pick: ...


@dataclass(frozen=True, slots=True)
class Settings:
    """One invoker's fixed inputs to every flow: config, policies, journal, clocks."""

    protocol: ProtocolConfig
    retry: RetryPolicy
    polling: PollPolicy
    hooks: bool  # whether any hook listens (no hook: no event is built)
    clock: Callable[[], float]  # monotonic seconds: deadlines and waits
    rng: Callable[[], float]  # uniform in [0, 1): backoff jitter
    wall: Callable[[], float]  # Unix seconds: journal records outlive processes
    journal: bool = False  # whether a journal records the calls
    journal_max_body: int = 0  # answers larger than this are not kept in the journal
    honours_keys: bool | None = None  # declared; None: learnt from the tool's answers
    #: ``honours_keys=`` given as a mapping of origins and route patterns (then the bool
    #: above is None: what the mapping does not name is learnt).
    declarations: Declarations | None = field(default=None, compare=False)
    #: The event types the hooks listen to (only these are built); none without hooks.
    events: frozenset[type] = EVENT_TYPES
    #: What this invoker's flows learnt about its routes (shared by them: one probe a route).
    memory: RouteMemory = field(default_factory=RouteMemory, compare=False)
    steps: Backoff = field(init=False)
    polls: Backoff = field(init=False)
    in_flight: Backoff = field(init=False)

    def declared(self, url: str) -> bool | None:
        """What the invoker was told about ``url``'s route honouring keys (None: nothing)."""
        if self.declarations is not None:
            return self.declarations.of(url)
        return self.honours_keys

    def __post_init__(self) -> None:
        retry = self.retry
        if not self.hooks:
            object.__setattr__(self, "events", frozenset())
        object.__setattr__(self, "steps", retry.schedule)
        object.__setattr__(self, "polls", self.polling.schedule)
        cap = min(retry.max_backoff, IN_FLIGHT_CAP)
        waits = Backoff(min(retry.initial_backoff, cap), cap, 1.5, False, cap)
        object.__setattr__(self, "in_flight", waits)


@dataclass(slots=True)  # not frozen: built on every call (see _effects.Outgoing)
class Finished:
    """The answer that ends a flow, and how the flow got there.

    ``source`` is where the answer came from: ``"tool"`` (an HTTP answer),
    ``"journal"`` (kept from an earlier run of this call; nothing was sent) or
    ``"reconcile"`` (the reconcile hook found the call had run). ``outcome`` is the
    verdict (:data:`OUTCOMES`): ``"replayed"``, ``"executed"``, or ``"answered"`` when
    nothing showed which (``replayed`` is ``outcome == "replayed"``).
    """

    answer: Answer
    key: str
    label: str | None
    replayed: bool
    attempts: int
    polls: int
    elapsed: float
    status_url: str | None
    source: str = "tool"
    repeat_of: str | None = None
    outcome: str = "answered"


Flow: TypeAlias = Generator[Effect, Any, Finished]


# --- the engine: one retry loop for every front end ----------------------------------------

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


@dataclass(frozen=True, slots=True)
class Again:
    """A front end's verdict on one reply: not the end, send again.

    ``wait``: the seconds to sleep first (from :meth:`Backoff.within
    <agentkey._schedule.Backoff.within>`, the one deadline rule), or None to send
    again at once; ``event``: given to the hooks before the wait.
    """

    wait: float | None = None
    event: Any = None


class Exchange(Protocol[T_co]):
    """One front end's part of :func:`attempts`: what it asks and what each reply means.

    ``request`` gives the effect to carry out (an ``Outgoing``; the journal's
    ``begin``); ``judge`` is the front end's classifier of what that gave: it
    returns the exchange's result, or :class:`Again`; it raises the front end's
    error when the reply is final or the budget (attempts, deadline) is spent.
    Both may yield effects of their own.
    """

    def request(self) -> Generator[Effect, Any, Effect]: ...

    def judge(self, reply: Any) -> Generator[Effect, Any, T_co | Again]: ...


def attempts(exchange: Exchange[T]) -> Generator[Effect, Any, T]:
    """The one retry loop of the client: ask, judge the reply, wait, ask again.

    Tool calls (:func:`invoke`), their polls, the journal's wait for a send of the
    same key in flight elsewhere, and token requests (``auth._endpoint``) all run
    on it, each with a classifier of its own; the MCP client runs the tool call's.
    What it yields, the drivers in ``_drive`` carry out.
    """
    while True:
        out = yield from exchange.request()
        verdict = yield from exchange.judge((yield out))
        if not isinstance(verdict, Again):
            return verdict
        yield from _pause(verdict)


def _pause(again: Again) -> Generator[Effect, Any, None]:
    """Between two asks of the loop: the event of the reply, then the wait."""
    if again.event is not None:
        yield Emit(again.event)
    if again.wait is not None:
        yield Sleep(again.wait)


def invoke(call: Call, settings: Settings) -> Flow:
    """The flow of one step: send it (same key on every resend), then poll a 202 to its end.

    With a journal, a call that may repeat an earlier step of its plan is identified
    first, by the plan's rule (:class:`_PlanRepeats`), in the same journal step that
    records it.
    """
    run = _Run(call, settings)
    if run.looks_for_repeats():
        return run.repeats_first()
    return run.observed(run.step())


def identified(call: Call, settings: Settings) -> Generator[Effect, Any, Finished | Pick]:
    """The flow of one agent runtime's call: its identity rule (``call.identity``) decides
    its key in one journal step, then the step's flow runs under that key, never another.

    Returns the rule's :class:`Pick` when it answers the call without sending it.
    """
    run = _Run(call, settings)
    assert call.identity is not None
    pick = yield from run.identify(call.identity)
    if pick is not None:
        return pick
    return (yield from run.observed(run.step()))


@dataclass(slots=True)  # not frozen: one a journaled call (see _effects.Outgoing)
class _PlanRepeats:
    """Your own loop's identity rule, for a call without a runtime call id: an identical call
    (same tool and arguments) of the plan at another step, made without a runtime call id,
    gives its key, the oldest first (``on_repeat="raise"``: :class:`~agentkey.StepRepeated`);
    otherwise the call keeps the key of its step."""

    call: Call

    def choose(self, earlier: Sequence[CallRecord], looked: bool) -> Pick:
        call = self.call
        same = [r for r in earlier if r.key != call.key and r.call_id is None]
        if not same:
            return Pick(key=call.key, repeat_of=call.repeat_of)
        first = StepKey.parse(min(same, key=lambda r: (r.created_at, r.key)).key)
        if call.on_repeat == "raise":
            raise StepRepeated(
                f"tool {call.tool!r} was already called with these arguments at {first.label} "
                f"of plan {call.plan!r} (the journal shows it); {call.label} would run it a "
                "second time. If the model asked again by mistake, tell it the call is done; "
                "if it really is a new operation, change an argument or use on_repeat='allow'",
                tool=call.tool or "",
                previous_step=first.label,
                idempotency_key=first.format(),
            )
        return Pick(key=first.format(), repeat_of=first.label)


def resume(call: Call, settings: Settings) -> Flow:
    """The flow that finishes polling ``call.url`` after a PollTimeout, sending no step."""
    run = _Run(call, settings)
    return run.observed(run.resumed())


def check_headers(
    headers: Mapping[str, str],
    owned: frozenset[str],
    who: str,
    owned_prefixes: tuple[str, ...] = (),
) -> tuple[tuple[str, str], ...]:
    """``headers`` as pairs, each a valid HTTP field; names agentkey owns are refused.

    ``owned`` holds lowercase names, ``owned_prefixes`` lowercase prefixes (``content-``).
    """
    out = []
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise ConfigurationError(f"{who} must map str names to str values")
        if not _TOKEN.fullmatch(name):
            raise ConfigurationError(
                f"{who} holds {name!r}, which is not a valid HTTP header name "
                "(letters, digits and !#$%&'*+-.^_`|~ only)"
            )
        if not _FIELD_VALUE.fullmatch(value):
            # The value is never echoed: headers= is where API keys travel.
            raise ConfigurationError(
                f"the value of header {name!r} holds a character HTTP cannot carry (a line "
                "break, a control character or non-ASCII text); encode it (e.g. base64 or "
                "percent-encoding) before passing it"
            )
        lower = name.lower()
        if lower in owned or lower.startswith(owned_prefixes):
            raise ConfigurationError(
                f"{who} cannot set {name!r}: agentkey sets it (the key comes from the step "
                "or idempotency_key=, credentials from auth=, the body is canonical JSON, and "
                "answers are decoded by agentkey with a size limit)"
            )
        out.append((name, value))
    return tuple(out)


class _Run:
    """The state of one flow: what was sent, what came back, on which clock."""

    def __init__(self, call: Call, settings: Settings) -> None:
        self.call, self.s = call, settings
        self.start = settings.clock()
        self.deadline = self.start + settings.retry.deadline  # bounds every send and poll
        self.attempts = self.polls = 0
        self.reached = False  # some request reached the tool (or may have)
        self.record: CallRecord | None = None  # this call's journal record, while it owns it
        self.target = call.url  # where the step is sent now (a same-origin 307/308 moves it)
        self.declared = settings.declared(call.url)  # honours_keys= for the target's route
        self.evidence: str | None = None  # how the target's route showed it honours keys
        self.probed = False  # the target's route was asked (or is known) this run
        self.refused = 0  # answers that said the server refused the request, nothing ran
        self.refusal: str | None = None  # the server's reason for the last such refusal
        self.doubted: float | None = None  # when the last attempt that may have run ended
        self.unsure: str | None = None  # why the reconcile hook could not tell
        self.recall()
        self.asked_last = False  # the last question before the deadline about a key in flight
        #: The identity rule's begin (its record and what the journal said), for begin().
        self.begun: tuple[CallRecord, Begun] | None = None

    def ctx(self) -> CallContext:
        call = self.call
        return CallContext(
            call.key, call.label, self.attempts, self.polls, self.s.wall(), self.honoured()
        )

    def observed(self, flow: Flow) -> Flow:
        """``flow`` between a CallStartEvent and a CallEndEvent that says how it ended.

        The drivers throw their own failures (a cancellation, a request that cannot be
        built, a hook that raised) into the flow, so the CallEndEvent names those too.
        When no hook listens to either event, ``flow`` itself: there is nothing to add.
        """
        events = self.s.events
        if CallStartEvent not in events and CallEndEvent not in events:
            return flow
        return self._observing(flow)

    def _observing(self, flow: Flow) -> Flow:
        call, ends = self.call, CallEndEvent in self.s.events
        if CallStartEvent in self.s.events:
            yield Emit(CallStartEvent(call.key, call.label, call.method, call.url, call.tool))
        try:
            done = yield from flow
        except GeneratorExit:
            raise
        except BaseException as exc:
            if ends:
                status = getattr(exc, "status_code", None)
                error = type(exc).__name__
                yield Emit(
                    CallEndEvent(
                        call.key, call.label, None, self.attempts, self.polls, status, error
                    )
                )
            raise
        if ends:
            status = done.answer.status_code
            yield Emit(
                CallEndEvent(
                    call.key, call.label, done.outcome, done.attempts, done.polls, status, None
                )
            )
        return done

    # --- small pieces ----------------------------------------------------------------------

    def outgoing(
        self,
        method: str,
        url: str,
        headers: tuple[tuple[str, str], ...],
        body: bytes | None,
        same_origin: bool,
        number: int,
    ) -> Generator[Effect, Any, Outgoing]:
        """The request to send, after the AttemptEvent hooks added their headers."""
        if AttemptEvent in self.s.events:
            extra: dict[str, str] = {}
            yield Emit(AttemptEvent(self.call.key, self.call.label, number, method, url, extra))
            if extra:
                hooked = check_headers(extra, HOOK_OWNED, "an AttemptEvent hook", ("content-",))
                headers = (*headers, *hooked)
        return Outgoing(method, url, headers, body, same_origin, self.deadline)

    def wait(
        self, schedule: Backoff, tries: int, hint: float | None, deadline: float
    ) -> float | None:
        """The wait after ``tries`` tries, cut to ``deadline``; None once it has passed."""
        return schedule.within(tries, hint, left=deadline - self.s.clock(), rng=self.s.rng)

    def wait_in_flight(self, tries: int, hint: float | None) -> float | None:
        """The wait before asking again about a request of this key in flight elsewhere.

        The tool's ``Retry-After`` is an upper bound, not a floor to sleep through (a
        peer may send its whole lease), so the answer comes soon after the holder ends;
        nor does it shorten the schedule's own growing wait (``Retry-After: 0`` would
        spin). The last question is asked before the deadline, not after it.
        """
        left = self.deadline - self.s.clock()
        if left <= 0 or self.asked_last:
            return None
        schedule = self.s.in_flight
        wait = schedule.delay(tries)  # never sooner: a Retry-After of 0 cannot make it spin
        if hint is not None:
            wait = max(wait, min(hint, schedule.cap))
        margin = min(1.0, left / 2)  # time for the last question's own answer
        if wait >= left - margin:
            self.asked_last = True
            return max(0.0, left - margin)
        return wait

    def give_up(self, reason: str, error: InvokeError) -> Generator[Effect, Any, InvokeError]:
        if GiveUpEvent in self.s.events:
            call = self.call
            yield Emit(
                GiveUpEvent(
                    call.key, call.label, self.attempts, self.polls, reason, type(error).__name__
                )
            )
        return error

    def finish(
        self,
        answer: Answer,
        outcome: str,
        status_url: str | None,
        source: str = "tool",
    ) -> Finished:
        """The flow's end: ``answer``, and the verdict on it (one of :data:`OUTCOMES`)."""
        elapsed = self.s.clock() - self.start
        call = self.call
        return Finished(
            answer,
            call.key,
            call.label,
            outcome == "replayed",
            self.attempts,
            self.polls,
            elapsed,
            status_url,
            source,
            call.repeat_of,
            outcome,
        )

    def verdict(self, answer: Answer, replayed: bool, after_in_flight: bool) -> str:
        """How the step's final ``answer`` came about (one of :data:`OUTCOMES`).

        A replay marker says "replayed"; an answer that says it ran (the protection
        header, a replay header with another value), or one from a route that has
        shown it marks its replays, says "executed". To a tool declared to mark no
        replays (``replay_headers=()``), an answer after one that said the same key was
        in flight (409/423) in this call is the earlier attempt's outcome: "replayed".
        Anything else is "answered": the tool may have run the step now or replayed
        it, and said neither. (Where the tool may mark replays, an unmarked answer
        after a 409 may be a second run: a server that races, or a holder that failed
        and freed the key; it is never called a replay then.)
        """
        if replayed:
            return "replayed"
        cfg = self.s.protocol
        if not cfg.replay_headers:
            return "replayed" if after_in_flight else "answered"
        if ran_marker(answer, cfg) or self.evidence in MARKS_REPLAYS:
            return "executed"
        return "answered"

    def honoured(self) -> bool:
        """Whether a request of this call that may have run can be sent again."""
        declared = self.declared
        return declared is True or (declared is None and self.evidence is not None)

    # --- the journal -----------------------------------------------------------------------

    def new_record(self) -> CallRecord:
        call, now = self.call, self.s.wall()
        return pending(
            call.key, call.plan, call.label, call.tool, call.args_hash,
            route_of(call.method, call.url), call.call_id, call.context, now, call.owner,
            now + self.s.retry.deadline + LEASE_SLACK,
        )  # fmt: skip

    def taken_from(self, earlier: CallRecord) -> CallRecord:
        """This flow's pending record in place of ``earlier``: the call keeps its identity
        (when it was first recorded, the runtime's call id and turn); the sender changes."""
        return self.new_record().with_(
            created_at=earlier.created_at, call_id=earlier.call_id, context=earlier.context
        )

    def route(self) -> str:
        """The route the step is sent to now: evidence belongs to it alone."""
        return route_of(self.call.method, self.target)

    def recall(self) -> None:
        """What this invoker learnt lately about the target's route (probed: asked)."""
        known, evidence = self.s.memory.get(self.route(), self.s.clock())
        self.probed = known
        self.evidence = _stronger(self.evidence, evidence)

    def follow(self, url: str) -> None:
        """The step moves to ``url`` (a same-origin redirect): what the first route showed
        is that route's, never the target's."""
        self.target, self.evidence = url, None
        self.declared = self.s.declared(url)
        self.recall()

    def learn(self, answer: Answer) -> Iterable[Effect]:
        """Remember what ``answer`` shows about its route honouring keys (that method and
        that route only: a redirect's evidence is the redirecting route's). Most answers
        show nothing: then no generator is made."""
        found = key_evidence(answer, self.s.protocol)
        return () if found is None else self._learnt(answer, found)

    def _learnt(self, answer: Answer, found: str) -> Generator[Effect, Any, None]:
        route, now = route_of(self.call.method, answer.url), self.s.clock()
        if route == self.route():
            self.evidence = _stronger(self.evidence, found)
        known, remembered = self.s.memory.get(route, now)
        if known and remembered is not None and _stronger(remembered, found) == remembered:
            return  # learnt lately: the journal heard it then (refreshed once a TTL)
        self.s.memory.put(route, found, now)
        if self.s.journal:  # refreshes the journal's "last seen" too
            yield Journaled("learn", (route, found))

    def close_record(
        self, state: CallState, *, answer: Answer | None = None, error: BaseException | None = None,
        outcome: str | None = None, status_url: str | None = None, source: str = "tool",
    ) -> Iterable[Effect]:  # fmt: skip
        """Write how the call ended over its pending record (none: nothing, no generator)."""
        record = self.record
        if record is None:
            return ()
        self.record = None
        return self._closing(record, state, answer, error, outcome, status_url, source)

    def _closing(
        self, record: CallRecord, state: CallState, answer: Answer | None,
        error: BaseException | None, outcome: str | None, status_url: str | None, source: str,
    ) -> Generator[Effect, Any, None]:  # fmt: skip
        status, size, body = record.status_code, record.body_size, record.body
        failed, reason = record.error, record.reason
        if answer is not None:
            size = len(answer.content)
            status = answer.status_code
            body = answer.content if size <= self.s.journal_max_body else None
        if isinstance(error, BaseException):
            failed = type(error).__name__
            status = getattr(error, "status_code", None)
            reason = getattr(error, "reason", None)
        closed = ended(
            record, state, self.s.wall(), self.attempts, status, outcome, source, failed, reason,
            self.honoured(), body, size, status_url,
        )  # fmt: skip
        yield Journaled("finish", (closed,))

    def looks_for_repeats(self) -> bool:
        """Whether the journal is asked for this call at another step of the plan.

        The plan itself catches a repeat among the steps it handed out (``repeat_of``);
        the journal catches one whatever the plan remembered (a plan saved before the
        first step was handed out, restored after it was sent). A runtime's call id, a
        key of the caller's own and ``on_repeat="allow"`` make every call a new one.
        """
        call = self.call
        return (
            self.s.journal
            and call.identity is None  # a runtime's call: its own rule looks
            and call.repeat_of is None
            and call.call_id is None
            and call.args_hash is not None
            and call.on_repeat != "allow"
        )

    def repeats_first(self) -> Flow:
        """The step's flow, after the plan's rule found whether it repeats an earlier step."""
        pick = yield from self.identify(_PlanRepeats(self.call))
        assert pick is None  # the plan's rule never answers without sending
        return (yield from self.observed(self.step()))

    def begin(self) -> Generator[Effect, Any, Finished | None]:
        """Record the call in the journal, or settle the record of an earlier send of it.

        A send of the same key in flight elsewhere (another task, another process) is
        waited for, within the deadline, when the tool is not known to honour keys: its
        answer then comes from the journal.
        """
        beginning = _Beginning(self)
        if self.begun is not None:  # the identity rule's begin, made already: judge it first
            beginning.record, first = self.begun
            self.begun = None
            verdict = yield from beginning.judge(first)
            if not isinstance(verdict, Again):
                return verdict
            yield from _pause(verdict)
        return (yield from attempts(beginning))

    # --- the identity of a runtime's call ---------------------------------------------------

    def identify(self, identity: Identity) -> Generator[Effect, Any, Pick | None]:
        """Decide the call's key by ``identity`` (a runtime's rule, or the plan's own for your
        loop: :class:`_PlanRepeats`), and record it, in one journal step.

        The rule chooses from the plan's identical calls it has seen; the journal records
        the call under the chosen key only if no identical call beyond those appeared
        (``begin(..., known=...)``), else the rule chooses again with all of them. So two
        copies of one job racing (tasks, threads, processes on one journal) never both
        record a new key for one call: the second finds the first and takes its key.
        Returns the rule's :class:`Pick` when it answers without sending; None when the
        call is to go on under ``self.call.key`` (recorded: ``self.begun``).
        """
        journal = self.s.journal
        earlier: tuple[CallRecord, ...] = ()
        looked = not journal  # without a journal, the runtime's history alone decides
        for _ in range(MAX_CHOICES):
            pick = identity.choose(earlier, looked)
            if pick.answer is not None:
                if looked:
                    return pick
                earlier, looked = (yield from self.identical()), True
                continue
            self.rekey(pick)
            if not journal:
                return None
            record = self.new_record()
            known = tuple([r.key for r in earlier]) if earlier else ()
            begun: Begun = yield Journaled("begin", (record,), {"repeats": True, "known": known})
            if begun.earlier:  # an identical call it has not seen: choose again, seeing all
                earlier, looked = (yield from self.identical()), True
                continue
            if not looked and begun.existing is not None:
                # The only identical call is the one under this key: choose again with it.
                earlier, looked = (begun.existing,), True
                again = identity.choose(earlier, True)
                if again.answer is not None or again.key != self.call.key:
                    continue
                self.rekey(again)
            self.begun = (record, begun)
            return None
        call = self.call
        raise StepInProgress(
            f"{_where(call)}: the journal showed a new identical call (same tool, same "
            f"arguments) each of the {MAX_CHOICES} times this call chose its key, so it was "
            "not recorded and nothing was sent. Call again once the other senders of this "
            "plan have recorded their calls",
            idempotency_key=call.key,
            step=call.label,
        )

    def identical(self) -> Generator[Effect, Any, tuple[CallRecord, ...]]:
        """The plan's calls with this call's tool and arguments, from the journal."""
        call = self.call
        options = {"tool": call.tool, "args_hash": call.args_hash}
        found = yield Journaled("find", (call.plan,), options)
        return tuple(found)

    def rekey(self, pick: Pick) -> None:
        """Make ``pick``'s key (an identity rule's choice) this call's."""
        call = self.call
        if pick.key == call.key and pick.repeat_of == call.repeat_of:
            return
        key = StepKey.parse(pick.key or "")
        if key.plan_session_id != call.plan or key.args_hash != call.args_hash:
            raise ConfigurationError(  # a rule that chose another call's key: a bug
                f"the identity rule of tool {call.tool!r} chose the key {shown_key(key.format())} "
                f"of another plan or other arguments for {_where(call)}; nothing was sent"
            )
        self.call = replace(
            call,
            key=key.format(),
            label=key.label,
            key_value=key.header_value(call.key_style),  # type: ignore[arg-type]
            repeat_of=pick.repeat_of,
        )

    def settle_earlier(
        self, earlier: CallRecord, live: bool
    ) -> Generator[Effect, Any, Finished | None]:
        """Decide what a record of this key found in the journal means for this call.

        Returns the call's answer when it is known without sending (or raises); None
        when the call is to be sent, with ``self.record`` set when this flow took the
        record over.
        """
        call, now = self.call, self.s.wall()
        honoured = self.honoured()
        if earlier.state is CallState.ANSWERED and not honoured:
            if earlier.body is None:
                raise _already_ran(call, earlier, self.s.journal_max_body)
            answer = Answer(earlier.status_code or 200, {}, earlier.body, call.url)
            if ReplayEvent in self.s.events:
                yield Emit(ReplayEvent(call.key, call.label, answer.status_code))
            return self.finish(answer, "replayed", earlier.status_url, "journal")
        if earlier.state is CallState.FAILED and not honoured:
            raise _already_failed(call, earlier)
        if earlier.state is CallState.PENDING and live:
            return None  # honoured (step() waits otherwise): the tool arbitrates, 409 in flight
        in_doubt = earlier.state in (CallState.IN_DOUBT, CallState.PENDING)
        if in_doubt and not honoured:
            verdict = yield from self.reconcile(earlier, self.quiet_since(earlier))
            if verdict is None and self.declared is None:
                yield from self.probe()
                honoured = self.honoured()
            if verdict is not None and verdict.happened is True:
                return (yield from self.settle_reconciled(earlier, verdict))
            if verdict is None and not honoured:
                raise _in_doubt(call, earlier, None, now)
            if verdict is not None and verdict.happened is None:
                raise _in_doubt(call, earlier, verdict, now)
        taken = self.taken_from(earlier)
        if (yield Journaled("take_over", (taken, earlier))):
            self.record = taken
            return None
        raise _TakenOver(
            f"{_where(call)} was taken over by another sender while this one read it from "
            "the journal; call again to get its outcome",
            idempotency_key=call.key,
            step=call.label,
        )

    def quiet_since(self, record: CallRecord) -> float:
        """Seconds since a request of ``record``'s call may last have left (wall clock).

        In doubt: when its sender closed it. Pending (its sender gone): the sender's own
        deadline, or now if that is later (when it died is not known).
        """
        now = self.s.wall()
        if record.state is CallState.PENDING:
            last = min(now, record.lease_until - LEASE_SLACK)
        else:
            last = record.updated_at or record.created_at
        return max(0.0, now - last)

    def reconcile(
        self, record: CallRecord, quiet: float | None
    ) -> Generator[Effect, Any, Verdict | None]:
        """Ask the reconcile hook (``reconcile=``) whether the call in doubt ran; None: no hook.

        ``quiet``: seconds since the call's last request may have left (None: long
        enough); any hook's "not run" before its ``not_run_after`` (60 s unless the hook
        sets its own) is "cannot tell yet": the request could still arrive.
        """
        call = self.call
        hook = call.reconcile
        if hook is None:
            return None
        doubt = InDoubt(
            idempotency_key=call.key,
            plan=call.plan,
            step=call.label,
            tool=call.tool,
            args=_args(call.body),
            method=call.method,
            url=call.url,
            sent_at=record.created_at,
            attempts=record.attempts or self.attempts,
            last_sent_at=None if quiet is None else self.s.wall() - quiet,
        )
        if isinstance(hook, HttpLookup):
            url = hook.url(call.url, doubt)
            request = (*call.headers, ("Accept", "application/json"))
            reply = yield Outgoing("GET", url, request, None, True, self.deadline)
            return hook.verdict(reply, quiet)
        verdict = yield Reconcile(doubt, hook)
        if not isinstance(verdict, Verdict):
            raise ConfigurationError(
                f"the reconcile= hook returned {type(verdict).__name__}, not a Verdict; return "
                "Verdict.ran(...), Verdict.not_run() or Verdict.in_doubt(...)"
            )
        return not_yet(verdict, quiet, not_run_after(hook), "the reconcile= hook")

    def settle_reconciled(
        self, earlier: CallRecord, verdict: Verdict
    ) -> Generator[Effect, Any, Finished]:
        """The call ran, says the reconcile hook: its answer, recorded as the call's."""
        answer = Answer(verdict.status_code, {}, verdict.content(), self.call.url)
        taken = self.taken_from(earlier)
        if (yield Journaled("take_over", (taken, earlier))):
            self.record = taken
            yield from self.close_record(
                CallState.ANSWERED, answer=answer, outcome="replayed", source="reconcile"
            )
        return self.finish(answer, "replayed", None, "reconcile")

    def probe(self) -> Generator[Effect, Any, None]:
        """Ask the route, with a harmless OPTIONS, whether it honours keys for this method.

        Once per route per invoker: an answer without evidence is remembered in memory
        for a while (``RouteMemory``), evidence in the journal too. The request names
        the call's method as a CORS preflight does (``Access-Control-Request-Method``):
        agentkey's middleware says ``Idempotency-Protected: true`` only for a method
        it protects at that path.
        """
        if self.probed or self.s.clock() >= self.deadline:
            return
        self.probed = True
        call, route = self.call, self.route()
        known, evidence = self.s.memory.get(route, self.s.clock())
        if known:  # another call of this invoker asked (or learnt) lately
            self.evidence = _stronger(self.evidence, evidence)
            return
        headers = (*call.headers, (PREFLIGHT_HEADER, call.method))
        reply = yield Outgoing("OPTIONS", self.target, headers, None, True, self.deadline)
        if isinstance(reply, Answer):
            yield from self.learn(reply)
            if self.evidence is None:
                self.s.memory.put(route, None, self.s.clock())

    # --- the step --------------------------------------------------------------------------

    def step(self) -> Flow:
        """The step's flow: announced when it repeats an earlier step, recorded in the
        journal first. Without either, :meth:`send_step` itself (a generator less)."""
        call = self.call
        if not self.s.journal and (call.repeat_of is None or RepeatEvent not in self.s.events):
            return self.send_step()  # no record to close: what _step adds is a no-op
        return self._step()

    def _step(self) -> Flow:
        call = self.call
        if call.repeat_of is not None and RepeatEvent in self.s.events:  # the plan's repeat
            yield Emit(RepeatEvent(call.key, call.label, call.repeat_of, call.tool))
        if self.s.journal:
            begun = self.begun
            if begun is not None and begun[1].existing is None:
                # The identity rule's begin recorded the call: the usual fresh call, and
                # all that judging it does (no generator for it).
                self.begun = None
                self.evidence = _stronger(self.evidence, begun[1].evidence)
                self.record = begun[0]
            else:
                known = yield from self.begin()
                if known is not None:
                    return known
        try:
            done = yield from self.send_step()
        except InvokeError as error:
            yield from self.close_record(_state_after(error, self.reached), error=error)
            raise
        return done

    def send_step(self) -> Flow:
        """Send the step until an answer is final (same key on every send), then finish it."""
        call, s = self.call, self.s
        sending = _Sending(self)
        verdict = yield from attempts(sending)
        if isinstance(verdict, Finished):
            return verdict  # the reconcile hook says it ran
        decision, reply = verdict, sending.reply
        if decision.replayed and ReplayEvent in s.events:
            assert isinstance(reply, Answer)
            yield Emit(ReplayEvent(call.key, call.label, reply.status_code))
        if decision.action is Action.RAISE:
            assert decision.error is not None
            raise decision.error
        assert isinstance(reply, Answer)
        outcome = self.verdict(reply, decision.replayed, sending.in_flight)
        if decision.action is Action.DONE:
            yield from self.close_record(CallState.ANSWERED, answer=reply, outcome=outcome)
            return self.finish(reply, outcome, None)
        assert decision.url is not None
        if decision.action is Action.FETCH:  # 303: the result is there already
            done = yield from self.poll(decision.url, outcome, result_only=True)
        else:
            hint = interpret_poll(reply, self.ctx(), s.protocol).retry_after
            done = yield from self.poll(decision.url, outcome, wait_first=True, hint=hint)
        yield from self.close_record(
            CallState.ANSWERED, answer=done.answer, outcome=outcome, status_url=done.status_url
        )
        return done

    def unhonoured_doubt(self, decision: Decision) -> Generator[Effect, Any, Finished | bool]:
        """A request that may have run, to a route not known to honour keys.

        True: resend (the route showed it honours keys after all, or the reconcile hook
        says the call did not run); a Finished: the hook says it ran; False: stop.
        """
        if self.declared is None:
            yield from self.probe()
            if self.honoured():
                return True
        if self.call.reconcile is None:
            return False
        wait = self.wait(self.s.steps, self.attempts, decision.retry_after, self.deadline)
        if wait is None:
            return False
        yield Sleep(wait)  # a request still running on the tool gets time to land first
        record = self.record or self.new_record()
        quiet = None if self.doubted is None else self.s.clock() - self.doubted
        verdict = yield from self.reconcile(record.with_(attempts=self.attempts), quiet)
        if verdict is None or verdict.happened is None:
            self.unsure = verdict.reason if verdict is not None else None
            return False
        if verdict.happened:
            answer = Answer(verdict.status_code, {}, verdict.content(), self.call.url)
            yield from self.close_record(
                CallState.ANSWERED, answer=answer, outcome="replayed", source="reconcile"
            )
            return self.finish(answer, "replayed", None, "reconcile")
        return True

    def stop_in_doubt(self, decision: Decision) -> Generator[Effect, Any, InvokeError]:
        """The error that ends a call in doubt which agentkey must not send again."""
        call = self.call
        ctx = self.ctx()
        declared = self.declared is False
        why = (
            "the invoker was told the tool does not honour Idempotency-Key (honours_keys=False)"
            if declared
            else "the tool has not shown that it honours Idempotency-Key (no replay marker, "
            f"no {PROTECTED_HEADER} header, no key problem answer)"
        )
        asked = f" The reconcile= hook could not tell ({self.unsure})." if self.unsure else ""
        error = ctx.error(
            OutcomeUnknown,
            f"{_where(call)} may have run: {decision.reason} after the request was sent, and "
            f"{why}, so agentkey did not send it again (a second send could run it twice).{asked} "
            "Find out whether it ran, then settle it in the journal (agentkey journal settle), "
            "or give the invoker a reconcile= hook; if the tool does honour the key, say so with "
            f"honours_keys=True, or once for its origin: honours_keys={{{_origin(self.target)!r}: "
            "True}, or record a passing check: agentkey check <url> --remember",
            status_code=decision.status_code,
        )
        return (yield from self.give_up(decision.reason, error))

    # --- polling ---------------------------------------------------------------------------

    def resumed(self) -> Flow:
        """Finish polling after a PollTimeout; the journal's record, if any, gets the answer."""
        earlier: CallRecord | None = None
        if self.s.journal:
            earlier = yield Journaled("get", (self.call.key,))
        known = earlier.outcome if earlier is not None else None
        done = yield from self.poll(self.call.url, known if known in OUTCOMES else "answered")
        if earlier is not None:
            taken = self.taken_from(earlier)
            if (yield Journaled("take_over", (taken, earlier))):
                self.record = taken
                yield from self.close_record(
                    CallState.ANSWERED, answer=done.answer, outcome=earlier.outcome,
                    status_url=done.status_url,
                )  # fmt: skip
        return done

    def poll(
        self,
        status_url: str,
        outcome: str,
        *,
        wait_first: bool = False,
        hint: float | None = None,
        result_only: bool = False,
    ) -> Flow:
        """Poll ``status_url``; ``wait_first``: wait (``hint``: the 202's Retry-After) first."""
        # Polls end at the poll deadline or the caller's deadline, whichever comes first.
        call, s = self.call, self.s
        deadline = min(s.clock() + s.polling.deadline, self.deadline)
        polling = _Polling(self, status_url, outcome, deadline, result_only)
        wait = self.wait(s.polls, 1, hint, deadline) if wait_first else None
        if wait is not None:
            if PollEvent in s.events:  # the wait between the 202 and the first poll
                yield Emit(PollEvent(call.key, call.label, 0, status_url, "accepted", wait))
            yield Sleep(wait)
        return (yield from attempts(polling))

    def _timeout(
        self, status_url: str, decision: Decision, deadline: float, polling: _Polling | None = None
    ) -> PollTimeout:
        s, ctx = self.s, self.ctx()
        which = (
            f"the call's deadline (RetryPolicy.deadline={s.retry.deadline:g} s)"
            if deadline >= self.deadline
            else f"the poll deadline (PollPolicy.deadline={s.polling.deadline:g} s)"
        )
        if polling is not None and polling.unreached:
            message = polling.unreachable(ctx.where(), which)
        else:
            message = (
                f"{ctx.where()} was still {_one_line(decision.reason)!r} at "
                f"{redact_url(status_url)} after {self.polls} poll(s) and {which}; it has not "
                "failed. Call invoker.resume_poll(error.status_url, error.idempotency_key) "
                "later to finish it without sending the step again"
            )
        return PollTimeout(
            message,
            status_url=status_url,
            idempotency_key=ctx.idempotency_key,
            step=ctx.step,
            attempts=ctx.attempts,
            status_code=decision.status_code,
        )


class _Sending(Exchange["Decision | Finished"]):
    """The step's exchange: one request, resent with the same key, and its classifier.

    ``judge`` returns the final :class:`~agentkey.client._protocol.Decision` (the answer is
    in ``reply``), a :class:`Finished` when the reconcile hook settled a call in
    doubt, or :class:`Again`; it raises when the budget is spent.
    """

    __slots__ = (
        "decision",
        "headers",
        "held",
        "in_doubt",
        "in_flight",
        "reply",
        "run",
        "unreachable",
        "url",
        "waited",
    )

    def __init__(self, run: _Run) -> None:
        call = run.call
        self.run = run
        self.url = call.url
        self.headers = (
            *call.headers,
            ("Content-Type", "application/json"),
            ("Accept", "application/json"),
            (KEY_HEADER, call.key_value),
        )
        self.in_doubt = self.in_flight = False  # some answer left it in doubt / in flight
        self.waited = 0  # waits for a request of the same key in flight elsewhere
        self.unreachable = 0  # sends in a row that never reached the tool
        self.held: Decision | None = None  # the last answer that said the key is in flight
        self.decision: Decision | None = None  # the last answer's meaning
        self.reply: Received | None = None  # the last answer

    def request(self) -> Generator[Effect, Any, Outgoing]:
        run, call = self.run, self.run.call
        if run.attempts and run.s.clock() >= run.deadline:
            return self.expired()  # the deadline passed during the wait
        return run.outgoing(call.method, self.url, self.headers, call.body, True, run.attempts + 1)

    def expired(self) -> Generator[Effect, Any, Outgoing]:
        raise (yield from self.spent())

    def judge(self, reply: Received) -> Generator[Effect, Any, Decision | Finished | Again]:
        run, call, s = self.run, self.run.call, self.run.s
        run.attempts += 1
        not_sent = isinstance(reply, Failure) and reply.kind is FailureKind.NOT_SENT
        self.unreachable = self.unreachable + 1 if not_sent else 0
        if isinstance(reply, Answer):
            yield from run.learn(reply)
        decision = classify(reply, run.ctx(), s.protocol)
        if decision.not_run and isinstance(reply, Answer):
            run.refused += 1
            body = scrub_json(parse_json(reply.content), reply.sent_secrets)
            run.refusal = short_reason(body, call.key)
        run.reached = run.reached or not (not_sent or decision.not_run)
        if decision.in_doubt:
            run.doubted = s.clock()
        self.reply = reply
        if self.held is not None and isinstance(reply, Failure) and s.clock() >= run.deadline:
            # A question about the key in flight was cut by the deadline: the holder's
            # answer stands (an in-flight key runs nothing for a duplicate).
            self.decision = self.held
            raise (yield from self.spent())
        self.decision = decision
        self.in_doubt = self.in_doubt or decision.in_doubt
        self.in_flight = self.in_flight or decision.in_flight
        if decision.in_flight:
            self.held = decision
        if not decision.retry:
            return decision
        if decision.in_doubt and not run.honoured():
            found = yield from run.unhonoured_doubt(decision)
            if isinstance(found, Finished):
                return found
            if not found:  # no resend: the call stays in doubt
                raise (yield from run.stop_in_doubt(decision))
        if decision.action is Action.FOLLOW and decision.url:
            self.url = decision.url
            run.follow(decision.url)
        if decision.in_flight:
            self.waited += 1
            wait = run.wait_in_flight(self.waited, decision.retry_after)
        else:
            tries = run.attempts - self.waited
            wait = run.wait(s.steps, tries, decision.retry_after, run.deadline)
            if tries >= s.retry.max_attempts or (not_sent and self.unreachable >= MAX_UNREACHABLE):
                wait = None
        if wait is None:
            raise (yield from self.spent())
        if RetryEvent not in s.events:
            return Again(wait)
        honoured = run.honoured()
        event = RetryEvent(
            call.key,
            call.label,
            run.attempts,
            decision.reason,
            wait,
            decision.status_code,
            honoured,
        )
        return Again(wait, event)

    def spent(self) -> Generator[Effect, Any, InvokeError]:
        """The error that ends a step whose budget (attempts, deadline) ran out."""
        run, decision = self.run, self.decision
        assert decision is not None
        assert self.reply is not None
        error: InvokeError
        if not run.reached:
            error = _unreachable(run.call, run, self.reply)
        else:
            error = budget_exhausted(
                decision,
                run.ctx(),
                saw_in_doubt=self.in_doubt,
                saw_in_flight=self.in_flight,
                honoured=run.honoured(),
            )
        return (yield from run.give_up(decision.reason, error))


class _Beginning(Exchange["Finished | None"]):
    """The journal's ``begin``, asked again while a send of the same key is in flight elsewhere.

    ``judge`` returns None when this flow recorded the call (it is to be sent), the
    call's answer when the journal settles it, or :class:`Again`.
    """

    __slots__ = ("record", "reread", "retaken", "run", "waited")

    def __init__(self, run: _Run) -> None:
        self.run = run
        self.record: CallRecord | None = None  # the record this flow asks to begin
        self.waited = 0  # waits for the send in flight elsewhere
        self.reread = False  # a pending record whose sender looked gone was read again
        self.retaken = False  # a record another sender took over first was read again

    def request(self) -> Generator[Effect, Any, Effect]:
        self.record = self.run.new_record()
        yield from ()
        return Journaled("begin", (self.record,))

    def judge(self, begun: Begun) -> Generator[Effect, Any, Finished | Again | None]:
        run, record = self.run, self.record
        assert record is not None
        run.evidence = _stronger(run.evidence, begun.evidence)
        earlier = begun.existing
        if earlier is None:
            run.record = record
            return None
        if earlier.route != record.route and earlier.state is not CallState.NOT_SENT:
            raise _other_route(run.call, earlier)  # (one never sent may go elsewhere)
        if _other_args(earlier, record):
            raise _mismatch(run.call, earlier)  # never another call's answer
        if earlier.state is CallState.PENDING and not begun.live and not self.reread:
            # The record was read before its sender was seen gone: a sender that finished
            # in between (another task of this process, a process that just exited) wrote
            # its outcome after this read. Read once more before calling the call in doubt.
            self.reread = True
            return Again()
        if begun.live and not run.honoured() and run.declared is None:
            yield from run.probe()  # a send in flight elsewhere: ask the route first
        if not (begun.live and not run.honoured()):
            try:
                return (yield from run.settle_earlier(earlier, begun.live))
            except _TakenOver:
                if self.retaken:
                    raise
                # Another sender (a copy of this job) took the record over first: read it
                # again, now in flight there, and wait for it or send under its key.
                self.retaken = True
                return Again()
        self.waited += 1
        wait = run.wait_in_flight(self.waited, None)
        if wait is None:
            raise _still_pending(run.call, earlier, run.s.wall())
        return Again(wait)


class _TakenOver(StepInProgress):
    """Another sender took over the record this flow meant to take over."""


def _origin(url: str) -> str:
    """``scheme://host[:port]`` of ``url`` as a user writes it (the default port left out)."""
    origin = origin_of(url)
    if origin is None:
        return redact_url(url)
    default = 443 if origin.scheme == "https" else 80
    host = f"[{origin.host}]" if ":" in origin.host else origin.host
    port = "" if origin.port == default else f":{origin.port}"
    return f"{origin.scheme}://{host}{port}"


def _stronger(known: str | None, found: str | None) -> str | None:
    """The evidence to keep of ``known`` and ``found``: the first seen, unless only the
    other shows that the route marks its replays (:data:`MARKS_REPLAYS`)."""
    if known is None or (found in MARKS_REPLAYS and known not in MARKS_REPLAYS):
        return found
    return known


#: A request that failed this close to the call's deadline (seconds) was ended by it.
_DEADLINE_SLACK = 0.01


class _Polling(Exchange[Finished]):
    """A status URL's exchange: GET it until the operation ends, and its classifier."""

    __slots__ = (
        "deadline",
        "hops",
        "outcome",
        "result_only",
        "run",
        "same_origin",
        "status_url",
        "told",
        "unreached",
        "url",
    )

    def __init__(
        self, run: _Run, status_url: str, outcome: str, deadline: float, result_only: bool
    ) -> None:
        self.run, self.status_url, self.outcome = run, status_url, outcome
        self.deadline, self.result_only = deadline, result_only
        self.url, self.hops = status_url, 0
        self.same_origin = poll_target(status_url, run.ctx(), run.s.protocol)  # or UnsafeRedirect
        # What the last polls said about the status URL, for the error at the deadline: the
        # last decision that was about it (a poll the call's deadline kept from being sent
        # says nothing), and how many polls in a row could not connect (``told``'s reason).
        self.told: Decision | None = None
        self.unreached = 0

    def _note(self, reply: Received, decision: Decision) -> None:
        if isinstance(reply, Failure):
            if self.run.deadline - self.run.s.clock() <= _DEADLINE_SLACK:
                return  # the call's deadline, not the status URL, ended this one
            self.unreached = self.unreached + 1 if reply.kind is FailureKind.NOT_SENT else 0
        else:
            self.unreached = 0
        self.told = decision

    def unreachable(self, where: str, which: str) -> str:
        """The message of a poll deadline reached while the status URL could not be reached."""
        origin = origin_of(self.url)
        shown = str(origin) if origin is not None else redact_url(self.url)
        cause = _one_line(self.told.reason) if self.told is not None else "not connected"
        if self.same_origin:
            check = f"Check that the tool at {shown} is up"
        else:
            check = (
                f"Check that this process reaches {shown}: polls to an allowed status origin "
                "go through a client of their own (without your credentials or cookies), so "
                "if your client reaches that origin through its transport, mounts, proxy or "
                "certificates, pass a client set up that way as poll_client="
            )
        return (
            f"{where} was accepted (202), but its status URL could not be reached: the last "
            f"{self.unreached} poll(s) could not connect to {shown} ({cause}) until {which}. "
            f"The step may still be running or done; it has not failed. {check}, then call "
            "invoker.resume_poll(error.status_url, error.idempotency_key) to finish it "
            "without sending the step again"
        )

    def request(self) -> Generator[Effect, Any, Outgoing]:
        run, call = self.run, self.run.call
        # Same origin: the step's key goes along so the tool can correlate the poll; any
        # other (explicitly allowed) origin gets neither key, credentials nor user headers.
        headers = (
            (*call.headers, ("Accept", "application/json"), (KEY_HEADER, call.key_value))
            if self.same_origin
            else (("Accept", "application/json"),)
        )
        return (
            yield from run.outgoing("GET", self.url, headers, None, self.same_origin, run.polls + 1)
        )

    def judge(self, reply: Received) -> Generator[Effect, Any, Finished | Again]:
        run, call, s = self.run, self.run.call, self.run.s
        run.polls += 1
        decision = interpret_poll(reply, run.ctx(), s.protocol, result_only=self.result_only)
        self._note(reply, decision)
        if decision.action is Action.DONE:
            assert isinstance(reply, Answer)
            return run.finish(reply, self.outcome, self.status_url)
        if decision.action is Action.RAISE:
            assert decision.error is not None
            raise decision.error
        if decision.action in (Action.FOLLOW, Action.FETCH):
            assert decision.url is not None
            self.hops += 1
            if self.hops > MAX_POLL_REDIRECTS:
                raise run.ctx().error(
                    InvokeError, f"polling {run.ctx().where()} redirected too often"
                )
            self.url = decision.url
            self.same_origin = poll_target(self.url, run.ctx(), s.protocol)
            self.result_only = self.result_only or decision.action is Action.FETCH
            return Again()  # at once
        wait = run.wait(s.polls, run.polls, decision.retry_after, self.deadline)
        if wait is None:
            error = run._timeout(self.status_url, self.told or decision, self.deadline, self)
            yield from run.close_record(CallState.ACCEPTED, error=error, status_url=self.status_url)
            raise (yield from run.give_up(decision.reason, error))
        if PollEvent not in s.events:
            return Again(wait)
        return Again(
            wait, PollEvent(call.key, call.label, run.polls, self.url, decision.reason, wait)
        )


# --- helpers -------------------------------------------------------------------------------


def _args(body: bytes) -> dict[str, Any]:
    parsed = parse_json(body)
    return parsed if isinstance(parsed, dict) else {}


def _where(call: Call) -> str:
    tool = f" of tool {call.tool!r}" if call.tool else ""
    return f"{call.label or 'the call'}{tool} (key {shown_key(call.key)})"


def _owner(record: CallRecord) -> str:
    host, _, rest = (record.owner or "?").partition(":")
    return f"process {rest.partition(':')[0]} on {host}"


def _ago(now: float, then: float) -> str:
    return f"{max(0.0, now - then):.1f} s ago"


def _state_after(error: InvokeError, reached: bool) -> CallState:
    """The journal state of a call that ended with ``error``."""
    if isinstance(error, ToolUnreachable) or not reached:
        return CallState.NOT_SENT
    if isinstance(error, (OutcomeUnknown, StepInProgress)):
        return CallState.IN_DOUBT
    if isinstance(error, PollTimeout):
        return CallState.ACCEPTED
    return CallState.FAILED


def _already_ran(call: Call, record: CallRecord, max_body: int) -> StepRepeated:
    """A call that ran, whose answer the journal does not hold: why not, truthfully."""
    if record.body_size is not None and record.body_size > max_body:
        what = (
            f"already ran (answered {record.status_code}), and its answer "
            f"({record.body_size} bytes) is larger than the journal keeps"
        )
        advice = (
            "Use the first answer, raise the journal's max_body_bytes, or make a new step "
            "if a second run is meant"
        )
    else:
        said = f" ({record.reason})" if record.reason else ""
        who = "an operator settled it as run" if record.source == "operator" else "it ran"
        what = (
            f"ran: {who}{said}, but no answer of it was ever received, so the journal "
            "has none to give"
        )
        advice = (
            "Treat the call as done without its answer (tell the model it already ran), or "
            "ask the tool for its outcome; make a new step only if a second run is meant"
        )
    return StepRepeated(
        f"{_where(call)} {what}. The tool is not known to honour Idempotency-Key, so it was "
        f"not sent again: a second send could run it twice. {advice}",
        tool=call.tool or "",
        previous_step=record.step or (call.label or ""),
        idempotency_key=call.key,
    )


def _other_route(call: Call, record: CallRecord) -> KeyReused:
    return KeyReused(
        f"{_where(call)} is in the journal as a call to another route "
        f"({_route_shown(record.route)}), and a key names one operation: its answer there "
        "is not this call's. Give this call its own step (or plan), or send it where the "
        "journal says it went",
        idempotency_key=call.key,
        step=call.label,
    )


def _other_args(earlier: CallRecord, record: CallRecord) -> bool:
    """Whether ``record`` sends other arguments under the key of ``earlier`` (one never
    sent ran nowhere: its key may go with other arguments)."""
    return (
        earlier.state is not CallState.NOT_SENT
        and earlier.args_hash is not None
        and record.args_hash is not None
        and earlier.args_hash != record.args_hash
    )


def _mismatch(call: Call, record: CallRecord) -> PayloadMismatch:
    when = f" (sent by {record.step})" if record.step and record.step != call.label else ""
    return PayloadMismatch(
        f"{_where(call)} is in the journal with other arguments{when}: the key names that "
        "call, so its answer is not this call's, and this call was not sent. Use a key with "
        "the arguments it was made for (the step's own key), or make a new step for these "
        "arguments",
        idempotency_key=call.key,
        step=call.label,
    )


def _route_shown(route: str) -> str:
    method, _, url = route.partition(" ")
    return f"{method} {redact_url(url)}"


def _still_pending(call: Call, record: CallRecord, now: float) -> StepInProgress:
    """A call pending in the journal under a sender that is still alive, all deadline long."""
    return StepInProgress(
        f"{_where(call)} has been pending in the journal since "
        f"{_ago(now, record.created_at)}, recorded by {_owner(record)}, which is still "
        "running: that process is sending it, or sent it and could not record how it ended "
        "(a journal failure at its finish). The tool is not known to honour "
        "Idempotency-Key, so it was not sent a second time. Call again later (an answer that "
        "process records ends the wait), or, once you know that process is done with it, "
        "find out whether it ran and settle it (agentkey journal settle)",
        idempotency_key=call.key,
        step=call.label,
    )


def _already_failed(call: Call, record: CallRecord) -> ToolError:
    said = f": {record.reason}" if record.reason else ""
    return ToolError(
        f"{_where(call)} already ended with a final error ({record.error or 'an error'}, "
        f"status {record.status_code}{said}); the journal keeps that outcome, and the tool "
        "is not known to honour Idempotency-Key, so it is not sent again. Change the "
        "arguments or the step to make a new call",
        idempotency_key=call.key,
        step=call.label,
        status_code=record.status_code,
        reason=record.reason,
    )


def _in_doubt(
    call: Call, record: CallRecord, verdict: Verdict | None, now: float
) -> OutcomeUnknown:
    asked = (
        f" The reconcile= hook could not tell ({verdict.reason or 'unknown'})."
        if verdict is not None
        else ""
    )
    return OutcomeUnknown(
        f"{_where(call)} was sent {_ago(now, record.created_at)} and may have run: "
        "its sender never recorded an answer (it was stopped, or gave up after the request "
        "left), and the tool is not known to honour Idempotency-Key, so agentkey will not "
        f"send it again blindly.{asked} Find out whether it ran and settle it (agentkey "
        "journal settle), pass reconcile=, or honours_keys=True if the tool honours the key",
        idempotency_key=call.key,
        step=call.label,
        attempts=record.attempts,
    )


def _unreachable(call: Call, run: _Run, reply: Received) -> ToolUnreachable:
    origin = run.s.protocol.base_origin
    if run.refused:
        said = f": {run.refusal}" if run.refusal else ""
        unsent = run.attempts - run.refused
        also = f", {unsent} more never reached it" if unsent else ""
        return ToolUnreachable(
            f"the tool's server refused {_where(call)} before running it, {run.refused} "
            f"time(s) (503 not run{said}){also}; {run.attempts} attempt(s) in all, and none "
            "ran the step, so it did not run. It is safe to call it again later with the "
            "same key",
            idempotency_key=call.key,
            step=call.label,
            attempts=run.attempts,
            status_code=reply.status_code if isinstance(reply, Answer) else None,
        )
    what = reply.description if isinstance(reply, Failure) else "no answer"
    return ToolUnreachable(
        f"the tool at {origin.host}:{origin.port} could not be reached for {_where(call)} "
        f"({what}, {run.attempts} attempt(s)); nothing was sent, so the step did not run. "
        "Check that the tool server is up and the URL is right, then call again",
        idempotency_key=call.key,
        step=call.label,
        attempts=run.attempts,
    )
