"""Which key a runtime's tool call gets: the one mechanism every agent integration shares.

An agent runtime recovers in ways a plain retry loop never sees: a resumed
checkpoint re-runs a tool node, a web app re-sends the user's request after a
crash, a stateless app replays its history, a model asked again names its calls
anew. Deriving the key from the runtime's counters alone gets some of these
wrong (a key shifted by an unrelated call runs a charge twice; a counter that
restarts gives a later turn an earlier turn's key). So a call's key is decided
from two records instead:

- the **journal**, which holds every call this plan sent, with the runtime's id
  of the call (``call_id``) and the conversation turn it answered (``context``);
- the runtime's **history**, which says what the model saw: the calls it asked
  for and the answers it read.

```
this call id in the journal ............... the same key (the call itself, run again)
an identical call (same tool and args) the model never saw answered,
  asked in this conversation, not a sibling ... its key: it is asked again (repeat_of)
an identical call the model saw answered ..... on_repeat: replay the answer it read,
                                                 raise, or allow a new call
otherwise ..................................... a new key, from the call's own id
```

Two recoveries change what the rule is given, not the rule:

- a runtime that shows no history (LangGraph's ``@task``: ``Seen(shown=False)``)
  takes an identical call of another turn as asked again, whatever the model
  saw, and one of its own turn never;
- a run that starts over under a new plan (a new run id or trace in the same
  conversation, a request re-sent as a new message) is moved, by the adapter,
  to the plan of an identical call its thread or conversation left unsettled
  in the journal (:func:`unfinished_elsewhere`, :func:`adopted`): there the rule
  gives it that call's key.

A sibling is an identical call in the same model response: two identical
calls at once mean two operations. Identical calls asked again are matched
to earlier ones in order (the second of this response to the second unseen
one), so a re-asked model that repeats two charges gets both keys back.
Without a journal (``journal=False``) the earlier calls come from the history
alone: repeats of answered calls are still caught, calls asked again are not.

Where it runs: inside the invoker's call, never in an adapter. The adapter hands
the invoker a :class:`~._settle.Chooser` holding this rule and its
:class:`CallSite`; the flow (``agentkey.client._flow.identified``) asks it for a
key with the plan's identical calls the journal holds, and records the call
under that key in the same journal step that looks for them
(``Journal.begin(record, repeats=True, known=...)``). When an identical call the
rule did not see is there (a copy of the same job, racing), nothing is written
and the rule decides again, seeing it: two copies never both take a new key for
one call. The key decided then is the one sent, and it never changes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .._keys import StepKey
from .._plan import OnRepeat, PlanSession, Step, repeated_error
from ..journal._records import CallRecord

__all__ = [
    "CallSite",
    "Earlier",
    "Seen",
    "Verdict",
    "adopted",
    "decide",
    "earlier_of",
    "in_thread",
    "lost_turns",
    "scope_parts",
    "step_of",
    "unfinished_elsewhere",
]


@dataclass(frozen=True, slots=True)
class Seen:
    """What the model saw, per the runtime's history.

    ``answered`` maps the id of each call whose result is in the history to the
    text the model read (None for an error it read: asking again is a new call);
    ``contexts`` holds the ids of the user turns in it.
    """

    answered: Mapping[str, str | None] = field(default_factory=dict)
    contexts: frozenset[str] = frozenset()
    #: Where each requested call stands in the history: (message list, position).
    asked: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    #: The turn a journal ``context`` names, as ``contexts`` holds it (None: the context
    #: itself); a runtime whose contexts carry more than the turn (PydanticAI's name the
    #: conversation beside the run) strips the rest here.
    turn_of: Callable[[str], str] | None = None
    #: False when the runtime shows no history (LangGraph's Functional API: a ``@task``
    #: sees only its own call): an identical call of another turn is then taken as asked
    #: again whatever its state (nothing says the model read its answer), and one of this
    #: turn (``CallSite.context``) never is (a sibling, or a later request of this turn).
    shown: bool = True

    def knows(self, context: str) -> bool:
        """Whether the turn ``context`` names is in this history."""
        return (self.turn_of(context) if self.turn_of else context) in self.contexts


@dataclass(frozen=True, slots=True)
class Earlier:
    """An earlier call of the plan with the same tool and arguments (from the journal)."""

    key: str
    call_id: str | None
    context: str | None

    @property
    def label(self) -> str:
        return StepKey.parse(self.key).label


@dataclass(frozen=True, slots=True)
class CallSite:
    """One tool call as the runtime presents it.

    ``siblings`` are the ids of the identical calls (same tool, same normalised
    arguments) of this call's model response, in order, this one included;
    ``context`` is the user turn the response answers; ``seen`` is None when the
    runtime shows no history.
    """

    plan: PlanSession
    tool: str
    values: Mapping[str, Any]
    call_id: str | None
    siblings: tuple[str, ...] = ()
    context: str | None = None
    seen: Seen | None = None
    #: Where this call's model response stands in the history: (message list, position).
    position: tuple[int, int] | None = None
    #: Whether an unseen earlier call may be taken for this one (False when the history
    #: cannot tell this conversation from another on the same plan).
    adopt: bool = True
    #: Set to the thread id when this call's model response is the first of its
    #: conversation: an unsettled identical call left on the same thread by another
    #: conversation is then worth a warning (a request re-sent after a crash whose
    #: checkpoint was lost, e.g. durability="exit").
    fresh_thread: str | None = None
    #: Keys the history itself records for answered calls (call id -> key), so a run
    #: without a journal, or with another one, still knows the calls the model saw.
    known: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do with the call: send ``key`` (``repeat_of`` when it is an earlier call's),
    answer with ``content`` without sending (a repeat), or make a new step (both None)."""

    key: str | None = None
    repeat_of: str | None = None
    content: str | None = None
    earlier: Earlier | None = None


def earlier_of(records: Sequence[CallRecord]) -> list[Earlier]:
    """The journal's records as earlier calls, oldest first."""
    return [Earlier(r.key, r.call_id, r.context) for r in records]


def decide(
    site: CallSite, earlier: Sequence[Earlier], on_repeat: OnRepeat, args_hash: str
) -> Verdict:
    """Which key ``site`` gets, given the plan's ``earlier`` calls with its tool and arguments."""
    plan_id = site.plan.id
    # A key the history knows for a call the journal holds under another call id (a repeat
    # of it, recorded by a copy of this job) still names that call: both count.
    journalled = {(e.key, e.call_id) for e in earlier}
    earlier = [
        *earlier,
        *(Earlier(k, c, None) for c, k in site.known.items() if (k, c) not in journalled),
    ]
    earlier = [e for e in earlier if _same_call(e.key, plan_id, args_hash)]
    if site.call_id is not None:
        for record in earlier:
            if record.call_id == site.call_id:
                return Verdict(key=record.key)  # this very call, run again
    if site.seen is None:
        return Verdict()
    seen = site.seen
    others = [e for e in earlier if e.call_id not in site.siblings]
    unseen = [e for e in others if site.adopt and _asked_again(site, seen, e)]
    if not seen.shown:  # a key this turn already took again is not taken twice
        taken = {e.key for e in others if e.context == site.context}
        unseen = [e for e in unseen if e.key not in taken]
    once: dict[str, Earlier] = {}  # each key once, where it first comes
    for e in unseen:
        once.setdefault(e.key, e)
    unseen = list(once.values())
    ordinal = site.siblings.index(site.call_id) if site.call_id in site.siblings else 0
    if ordinal < len(unseen):
        record = unseen[ordinal]
        return Verdict(key=record.key, repeat_of=record.label, earlier=record)
    answered = [e for e in others if seen.answered.get(e.call_id or "") is not None]
    if not answered or on_repeat == "allow":
        return Verdict()
    record = answered[0]
    return Verdict(content=seen.answered[record.call_id or ""], earlier=record)


def lost_turns(site: CallSite, args_hash: str, unsettled: Sequence[CallRecord]) -> list[str]:
    """Steps of identical calls another conversation on this thread left unsettled.

    ``unsettled`` are the journal's calls in doubt (or pending, their sender gone).
    """
    thread = site.fresh_thread
    if thread is None:
        return []
    return [
        r.step or r.key
        for r in unsettled
        if r.tool == site.tool
        and r.args_hash == args_hash
        and r.plan != site.plan.id
        and _in_thread(r.context, thread)
    ]


def scope_parts(context: str | None, separator: str) -> tuple[str, str] | None:
    """The two sides of a journal ``context`` made as ``f"{a}{separator}{b}"`` (a thread and
    a message id, a run and its conversation), or None when ``separator`` does not occur in
    it exactly once: an id holding the separator makes the context ambiguous (thread ``acme``
    with message ``bob#m1`` reads as thread ``acme#bob`` with ``m1``), and an ambiguous
    context is never matched to a scope: its recovery is missed, never taken across scopes."""
    if context is None:
        return None
    parts = context.split(separator)
    return (parts[0], parts[1]) if len(parts) == 2 else None


def _in_thread(context: str | None, thread: str) -> bool:
    """Whether ``context`` (``f"{thread}#{message id}"``) surely names a turn of ``thread``."""
    parts = scope_parts(context, "#")
    return parts is not None and parts[0] == thread


def in_thread(thread: str) -> Callable[[str | None], bool]:
    """The ``same_scope`` test of :func:`unfinished_elsewhere` for a LangGraph thread."""
    return lambda context: _in_thread(context, thread)


def unfinished_elsewhere(
    site: CallSite,
    args_hash: str,
    unsettled: Sequence[CallRecord],
    same_scope: Callable[[str | None], bool],
) -> CallRecord | None:
    """The oldest identical call (same tool and arguments) of another plan, in the same thread
    or conversation (``same_scope`` of its ``context``), that the journal shows never settled.

    ``unsettled`` are the journal's calls in doubt, or pending with their sender gone: a run
    that died while it made the call. When a run that starts over under a new plan (a request
    re-sent with a new message id, a new run id in the same conversation) asks for the same
    call, it is that call asked again: :func:`adopted` gives it its key.
    """
    found = [
        r
        for r in unsettled
        if r.tool == site.tool
        and r.args_hash == args_hash
        and r.plan != site.plan.id
        and same_scope(r.context)
    ]
    return min(found, key=lambda r: (r.created_at, r.key)) if found else None


def adopted(site: CallSite, record: CallRecord) -> CallSite:
    """``site`` moved to the plan of ``record``, an unfinished identical call of its thread or
    conversation (:func:`unfinished_elsewhere`), with ``record``'s turn counted as one this
    history continues: :func:`decide` then takes ``record``'s key for it, as asked again."""
    plan = PlanSession(id=record.plan, profile=site.plan.profile)
    seen = site.seen if site.seen is not None else Seen()
    contexts = set(seen.contexts)
    if record.context is not None:
        contexts.add(seen.turn_of(record.context) if seen.turn_of else record.context)
    return replace(
        site,
        plan=plan,
        seen=replace(seen, contexts=frozenset(contexts)),
        adopt=True,
        known={},  # keys of the history's own plan: not this plan's
    )


def _asked_again(site: CallSite, seen: Seen, earlier: Earlier) -> bool:
    """Whether ``site`` asks again for ``earlier``, a call whose answer the model never read.

    Not when its answer is in the history, nor when it answered another turn of the
    conversation (its user message is not in this history). When its request is in the
    history, only if that request came earlier in the same message list: a request in
    another list is a parallel branch's own call.
    """
    if earlier.call_id in seen.answered:
        return False
    if not seen.shown:
        return earlier.context is None or earlier.context != site.context
    if earlier.context is not None and site.context is not None and not seen.knows(earlier.context):
        return False
    where = seen.asked.get(earlier.call_id or "")
    if where is None or site.position is None:
        return True  # the history lost its request (a crash before the checkpoint)
    return where[0] == site.position[0] and where[1] < site.position[1]


def _same_call(key: str, plan_id: str, args_hash: str) -> bool:
    try:
        parsed = StepKey.parse(key)
    except ValueError:
        return False
    return parsed.plan_session_id == plan_id and parsed.args_hash == args_hash


def step_of(
    site: CallSite,
    verdict: Verdict,
    derive: Callable[[], int | Sequence[int]],
    args_model: Any,
    on_repeat: OnRepeat,
) -> Step:
    """The step to send: an earlier call's (a verdict with a key), or a new one.

    A repeat of an answered call under ``on_repeat="raise"`` raises
    :class:`~agentkey.StepRepeated` here; under ``"replay"`` the caller answers
    with ``verdict.content`` and never asks for a step.
    """
    plan = site.plan
    index = derive() if verdict.key is None else StepKey.parse(verdict.key).index
    step = plan.step(index, site.tool, site.values, args_model=args_model, on_repeat="allow")
    if verdict.content is not None and verdict.earlier is not None and on_repeat == "raise":
        raise repeated_error(step, verdict.earlier.label)
    if verdict.repeat_of is None:
        return step
    return Step._made(
        step.plan_session_id,
        step.index,
        step.idempotency_key,
        step.tool,
        step.args,
        step.profile,
        step.body,
        repeat_of=verdict.repeat_of,
    )
