"""From a runtime's view of a call to what is sent: the one identity rule every integration runs.

Each integration builds a :class:`~._identity.CallSite` from what its runtime
shows (PydanticAI's ``ctx.messages``; the Agents SDK's ``turn_input`` and the
run's own calls in this process; LangGraph's state) and hands a
:class:`Chooser` to the invoker (``invoker._invoke_identified``). The flow asks
the chooser for a key with the plan's identical calls that the journal holds,
and records the call under that key in the same journal step that looks for
them (``Journal.begin(..., repeats=True, known=...)``): when an identical call
it has not seen appeared meanwhile (a copy of the same job, racing), nothing is
written and the chooser decides again, seeing it. So the key is decided once, and
it never changes after that step. An adapter reads the journal only for the calls
left unsettled by a run that died (``_adapter.unsettled``), to choose the plan.

The chooser asks ``_identity.decide`` and adds two rules of its own:

- a call whose journal record is a refusal (or was never sent) was not
  answered, whatever text the model read for it: asking again is a new call;
- an earlier call that was **answered** and whose answer the model of this
  execution never read (a job run again with the same run id, after a crash or
  on a schedule) keeps its key, so nothing runs twice, but its answer is
  labelled a repeat and a warning names the fix: one run id per job execution.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .._exceptions import StepRepeated
from .._keys import StepKey
from .._plan import OnRepeat, Step
from ..client._flow import Pick
from ..journal._records import CallRecord, CallState
from ._adapter import repeat_note, repeat_record
from ._identity import CallSite, Earlier, Verdict, decide, earlier_of, step_of

__all__ = ["NOT_SENT", "Chooser", "Repeat", "Send", "settle"]

_logger = logging.getLogger("agentkey")

#: Journal states of a call whose answer, if the model read one, was not the tool's result.
_NOT_ANSWERED = frozenset({CallState.FAILED, CallState.NOT_SENT})

#: A chooser's answer (``sent_only``) for a call the journal never saw sent.
NOT_SENT = "not sent"
#: A chooser's answer before it saw the journal, when the history alone would refuse the call.
_LOOK_FIRST = "look first"


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``step``, with the runtime's ``call_id`` and ``context`` for the journal."""

    step: Step
    call_id: str | None
    context: str | None


@dataclass(frozen=True, slots=True)
class Repeat:
    """Answer without sending: ``content`` for the model, ``record`` for the runtime's record."""

    content: str
    record: dict[str, Any]


class Chooser:
    """One runtime call's identity rule, asked by the flow (``agentkey.client._flow.Identity``).

    ``site`` gives the call as the runtime shows it (a callable is read again at each
    choice: siblings that arrived meanwhile count too); the rest is :func:`settle`'s.
    ``unread`` names what the application passes (``"run_id"``) when the rule of an
    answer this model never read applies (None: it does not). ``sent_only``: answer
    :data:`NOT_SENT` unless the journal holds this very call (a call a crash left
    unanswered, sent again only if it was sent before).
    """

    __slots__ = (
        "_site",
        "args_hash",
        "args_model",
        "derive",
        "elsewhere",
        "on_repeat",
        "sent_only",
        "unread",
        "warned",
    )

    def __init__(
        self,
        site: CallSite | Callable[[], CallSite],
        *,
        args_hash: str,
        on_repeat: OnRepeat,
        derive: Callable[[], int | Sequence[int]],
        args_model: Any,
        unread: str | None = None,
        elsewhere: Callable[[], tuple[str, str] | None] | None = None,
        sent_only: bool = False,
    ) -> None:
        self._site = site
        self.args_hash, self.on_repeat, self.derive = args_hash, on_repeat, derive
        self.args_model, self.unread, self.elsewhere = args_model, unread, elsewhere
        self.sent_only = sent_only
        self.warned: set[str] = set()  # keys whose unread answer was warned about

    @property
    def site(self) -> CallSite:
        return self._site() if callable(self._site) else self._site

    def decided(self, earlier: Sequence[CallRecord]) -> Send | Repeat:
        """The step to send, or the answer without sending, given the journal's ``earlier``."""
        return settle(
            self.site, earlier, args_hash=self.args_hash, on_repeat=self.on_repeat,
            derive=self.derive, args_model=self.args_model, run_id_name=self.unread,
            elsewhere=self.elsewhere, warned=self.warned,
        )  # fmt: skip

    def choose(self, earlier: Sequence[CallRecord], looked: bool) -> Pick:
        site = self.site
        if self.sent_only and not any(r.call_id == site.call_id for r in earlier):
            return Pick(answer=NOT_SENT)
        try:
            found = self.decided(earlier)
        except StepRepeated:
            if looked:
                raise
            # The history alone says it repeats: the journal may say otherwise (a refusal is
            # no answer), so the flow looks there first and asks again.
            return Pick(answer=_LOOK_FIRST)
        if isinstance(found, Repeat):
            return Pick(answer=found)
        return Pick(key=found.step.idempotency_key, repeat_of=found.step.repeat_of)

    def template(self) -> Step:
        """A step of this call (its plan, tool and arguments) for the invoker to prepare;
        the flow gives it its key."""
        site, model = self.site, self.args_model
        args = model.model_validate(site.values) if model is not None else site.values
        return Step(
            plan_session_id=site.plan.id, index=0, tool=site.tool, args=args,
            profile=site.plan.profile,
        )  # fmt: skip


def settle(
    site: CallSite,
    records: Sequence[CallRecord],
    *,
    args_hash: str,
    on_repeat: OnRepeat,
    derive: Callable[[], int | Sequence[int]],
    args_model: Any,
    run_id_name: str | None,
    elsewhere: Callable[[], tuple[str, str] | None] | None = None,
    warned: set[str] | None = None,
) -> Send | Repeat:
    """The step to send for ``site``, or the answer to a repeat of a call the model read.

    ``records`` are the journal's calls of the plan with this tool and arguments;
    ``derive`` gives a new call's step index; ``run_id_name`` names what the
    application passes (``"run_id"``) in the warning of an unread answer (None: no
    such rule, nor the rule of refused calls). ``elsewhere`` finds, for a new call,
    an identical answered call of another plan that the model read (``(content,
    key)``): it then follows ``on_repeat`` too. ``warned``: keys already warned about.
    """
    if run_id_name is not None:
        site = _without_refusals(site, records)
    verdict = decide(site, earlier_of(records), on_repeat, args_hash)
    if verdict.content is not None and verdict.earlier is not None and on_repeat == "replay":
        found = verdict.earlier
        return Repeat(
            repeat_note(found.label, replayed=True) + verdict.content,
            repeat_record(site.tool, found.key, found.label),
        )
    if run_id_name is not None:
        verdict = _unread_answer(site, verdict, records, run_id_name, warned)
    step = step_of(site, verdict, derive, args_model, on_repeat)
    if verdict.key is None and verdict.content is None and elsewhere is not None:
        other = elsewhere() if on_repeat != "allow" else None
        if other is not None:
            content, key = other
            label = StepKey.parse(key).label
            if on_repeat == "raise":
                raise StepRepeated(
                    f"tool {site.tool!r} was already called with these arguments at {label} of "
                    "an earlier run whose messages this run was given, and the model read its "
                    f"answer; {step.label} would run it a second time. If the model asked again "
                    "by mistake, tell it the call is done; if it really is a new operation, "
                    "change an argument or use on_repeat='allow' for this tool",
                    tool=site.tool,
                    previous_step=label,
                    idempotency_key=key,
                )
            return Repeat(
                repeat_note(label, replayed=True) + content, repeat_record(site.tool, key, label)
            )
    return Send(step, site.call_id, site.context)


def _without_refusals(site: CallSite, records: Sequence[CallRecord]) -> CallSite:
    """``site`` with the calls the journal shows refused (or never sent) marked unanswered."""
    seen = site.seen
    if seen is None:
        return site
    refused = {
        r.call_id for r in records if r.state in _NOT_ANSWERED and r.call_id in seen.answered
    }
    if not refused:
        return site
    answered = {k: (None if k in refused else v) for k, v in seen.answered.items()}
    known = {k: v for k, v in site.known.items() if k not in refused}
    return dataclasses.replace(site, seen=dataclasses.replace(seen, answered=answered), known=known)


def _unread_answer(
    site: CallSite,
    verdict: Verdict,
    records: Sequence[CallRecord],
    run_id_name: str,
    warned: set[str] | None,
) -> Verdict:
    """Label, and warn about, a key whose call was answered where this model never read it."""
    if verdict.key is None:
        return verdict
    record = next((r for r in records if r.key == verdict.key), None)
    if record is None or record.state is not CallState.ANSWERED:
        return verdict
    if site.seen is not None and record.call_id in site.seen.answered:
        return verdict
    found = verdict.earlier or Earlier(record.key, record.call_id, record.context)
    if warned is not None and record.key in warned:
        return dataclasses.replace(verdict, repeat_of=found.label, earlier=found)
    if warned is not None:
        warned.add(record.key)
    _logger.warning(
        "agentkey: tool %r was asked for a call this run (same %s, same plan) already made "
        "and got answered at %s, in an earlier execution whose answer the model of this one "
        "never read. It keeps that call's key, so it does not run twice, and the model reads "
        "its answer marked as a repeat. That is right when the job runs again after a "
        "failure; if this is a new job that reuses the %s, give each job execution a %s of "
        "its own and persist it with the job",
        site.tool,
        run_id_name,
        found.label,
        run_id_name,
        run_id_name,
    )
    return dataclasses.replace(verdict, repeat_of=found.label, earlier=found)
