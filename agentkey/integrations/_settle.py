"""From a runtime's view of a call to what is sent: what the PydanticAI and Agents SDK tools share.

Each of those integrations builds a :class:`~._identity.CallSite` from what its
runtime shows (PydanticAI's ``ctx.messages``; the Agents SDK's ``turn_input``
and the run's own calls in this process), reads the plan's earlier identical
calls from the invoker's journal, and then calls :func:`settle`, which asks
``_identity.decide`` and adds two rules of its own:

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
from ..client._invoker import AsyncToolInvoker, ToolInvoker
from ..journal._records import CallRecord, CallState
from ._adapter import repeat_note, repeat_record
from ._identity import CallSite, Earlier, Seen, Verdict, decide, earlier_of, step_of

__all__ = ["Repeat", "Send", "aearlier", "earlier", "settle"]

_logger = logging.getLogger("agentkey")

#: Journal states of a call whose answer, if the model read one, was not the tool's result.
_NOT_ANSWERED = frozenset({CallState.FAILED, CallState.NOT_SENT})


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


def earlier(
    invoker: ToolInvoker | AsyncToolInvoker, plan: str, tool: str, args_hash: str
) -> list[CallRecord]:
    """The plan's calls with this tool and arguments, oldest first, from the invoker's journal."""
    journal = invoker.journal
    return [] if journal is None else journal.find(plan, tool=tool, args_hash=args_hash)


async def aearlier(
    invoker: ToolInvoker | AsyncToolInvoker, plan: str, tool: str, args_hash: str
) -> list[CallRecord]:
    """:func:`earlier`, on the journal's asyncio client."""
    journal = invoker.journal
    return [] if journal is None else await journal.afind(plan, tool=tool, args_hash=args_hash)


def settle(
    site: CallSite,
    records: Sequence[CallRecord],
    *,
    args_hash: str,
    on_repeat: OnRepeat,
    derive: Callable[[], int | Sequence[int]],
    args_model: Any,
    run_id_name: str,
    elsewhere: Callable[[], tuple[str, str] | None] | None = None,
) -> Send | Repeat:
    """The step to send for ``site``, or the answer to a repeat of a call the model read.

    ``records`` are the journal's earlier calls (:func:`earlier`); ``derive`` gives
    a new call's step index; ``run_id_name`` names what the application passes
    (``"run_id"``) in the warning of an unread answer. ``elsewhere`` finds, for a
    new call, an identical answered call of another plan that the model read
    (``(content, key)``): it then follows ``on_repeat`` too.
    """
    site = _without_refusals(site, records)
    verdict = decide(site, earlier_of(records), on_repeat, args_hash)
    if verdict.content is not None and verdict.earlier is not None and on_repeat == "replay":
        found = verdict.earlier
        return Repeat(
            repeat_note(found.label, replayed=True) + verdict.content,
            repeat_record(site.tool, found.key, found.label),
        )
    verdict = _unread_answer(site, verdict, records, run_id_name)
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
    return dataclasses.replace(site, seen=Seen(answered, seen.contexts, seen.asked), known=known)


def _unread_answer(
    site: CallSite, verdict: Verdict, records: Sequence[CallRecord], run_id_name: str
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
