"""OpenAI Agents SDK: function tools keyed by the run's trace id and the journal.

:func:`remote_tool` turns a tool served over HTTP into an Agents SDK
``FunctionTool``. The SDK gives a tool its ``ToolContext`` (public API only):
the model's ``tool_call_id``, the run's ``RunConfig``, ``usage`` (one object
per run, whose ``requests`` counts the run's model responses) and
``turn_input``, which holds the run's input: the items the application passed
to ``Runner.run`` (an earlier conversation's calls and their outputs, from
``to_input_list()`` or a session), never the items of the run itself. So a
call's identity comes from:

- plan session id (:func:`trace_plan`): a UUIDv5 of ``RunConfig.trace_id``,
  which you set (``RunConfig(trace_id=agents.gen_trace_id())``) for each job
  and persist with it. A run without an explicit ``trace_id`` is refused with
  :class:`~agentkey.ConfigurationError`: the SDK's own trace id is drawn
  afresh for every run (also for a ``RunState`` resume) and the SDK may be
  run with tracing off, so it names nothing that lasts;
- step index (:func:`call_step`): ``(slot, call)``, two 32-bit numbers of
  the tool name and of the model's ``tool_call_id``;
- the invoker's journal (every call the plan sent, in any process) and what
  the model saw: the outputs in ``turn_input``, and the calls this run made in
  this process, each answered to the model at the next model request. The
  identical calls of one model response (same ``usage.requests``) are
  siblings: two identical calls at once are two operations and both run.

With a ``Session``, link the run's trace to it with the SDK's
``RunConfig(group_id=session.session_id)``: a message sent again in the session
under a new trace after a crash then finds the identical calls another trace of
the group left unsettled in the journal, and takes their keys.

Then (``_identity``): the same call run again (a ``RunState`` resumed, a
durable runner replaying the recorded model response) keeps its key; a call
the model asks for again without having read its answer (a run started over
with the same ``trace_id`` in a new process after a crash, whose model names
its calls anew) gets the earlier call's key back and its answer is marked as
a repeat, so it does not run twice; a call the model asks for again after
reading its answer follows ``on_repeat``. A ``trace_id`` reused for another
job is the same run to agentkey: its calls are answered with the earlier
results, marked, and a warning says to give each job its own trace id.

Needs the ``openai-agents`` extra (``pip install 'agentkey-idempotency[openai-agents]'``).
"""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from pydantic import BaseModel, ValidationError

from .._canonical import args_hash, encode_jsonable, to_jsonable
from .._exceptions import ConfigurationError, ToolError
from .._plan import OnRepeat, PlanSession
from ..client._flow import Pick
from ..client._invoker import AsyncToolInvoker, ToolInvoker, ToolResult
from ..journal._records import CallRecord
from ._adapter import (
    call_record,
    check_sources,
    check_tool,
    code,
    first_error,
    missing_extra,
    refusal,
    repeat_note,
    unsettled,
)
from ._identity import CallSite, Seen, adopted, scope_parts, unfinished_elsewhere
from ._settle import Chooser, Repeat

try:
    from agents import FunctionTool
    from agents.tool import FunctionToolCustomDataContext
    from agents.tool_context import ToolContext
except ModuleNotFoundError as exc:  # pragma: no cover - exercised in a subprocess test
    raise missing_extra(exc, "openai-agents", "agents", "agents", "openai") from None

__all__ = ["call_step", "remote_tool", "trace_plan"]

#: A plan session, or a callable choosing one from the call's ``ToolContext``.
PlanSource: TypeAlias = "PlanSession | Callable[[ToolContext[Any]], PlanSession]"
#: A step index, or a callable of the ``ToolContext`` and the normalised arguments.
StepIndexSource: TypeAlias = (
    "int | Sequence[int] | Callable[[ToolContext[Any], Mapping[str, Any]], int | Sequence[int]]"
)

#: How many calls of one run this process remembers (a run past it forgets its oldest).
_MAX_CALLS_PER_RUN = 4096


def trace_plan(ctx: ToolContext[Any]) -> PlanSession:
    """The plan session of a run: a UUIDv5 of the ``trace_id`` you set in its ``RunConfig``."""
    trace_id = _trace_id(ctx)
    if not trace_id:
        raise ConfigurationError(
            f"tool {ctx.tool_name!r} has no plan session: the run has no explicit trace_id. "
            "Run it with Runner.run(..., run_config=RunConfig(trace_id=gen_trace_id())) and "
            "persist the trace id with the job (running it again with it keeps the keys), or "
            "pass plan=PlanSession(...) to remote_tool"
        )
    return PlanSession.from_external_id(json.dumps(["openai-agents", trace_id]))


def call_step(ctx: ToolContext[Any], args: Mapping[str, Any]) -> tuple[int, int]:
    """``(slot, call)``: 32-bit numbers of the tool name and of the model's tool call id."""
    if not ctx.tool_call_id:
        raise ConfigurationError(
            f"tool {ctx.tool_name!r} ran without a tool call id, so call_step cannot name its "
            "step; pass step_index= to remote_tool"
        )
    return code(ctx.tool_name), code(ctx.tool_call_id)


def remote_tool(
    *,
    name: str,
    description: str,
    args_schema: type[BaseModel],
    invoker: ToolInvoker | AsyncToolInvoker,
    plan: PlanSource | None = None,
    step_index: StepIndexSource | None = None,
    path: str | None = None,
    method: str = "POST",
    headers: Mapping[str, str] | None = None,
    on_repeat: OnRepeat = "replay",
    errors_to_model: bool = True,
) -> FunctionTool:
    """An Agents SDK ``FunctionTool`` that sends each call through ``invoker`` with a key.

    ``plan`` defaults to :func:`trace_plan`, ``step_index`` to
    :func:`call_step`; pass a value or a callable of the ``ToolContext`` to
    choose them yourself. Either way each call's key is settled against the
    invoker's journal and what the model saw (module docstring). ``on_repeat``
    says what a call the model already read the answer of gets when it is asked
    for again: ``"replay"`` (the default: the earlier answer, marked, nothing
    sent), ``"raise"`` (:class:`~agentkey.StepRepeated`) or ``"allow"`` (a new
    call).

    The model reads the tool's JSON body as text; the call's record
    (``idempotency_key``, ``step``, ``outcome``, ``replayed``, ``repeat_of``,
    ``attempts`` ...) is the output item's ``custom_data``, which the SDK never
    sends to the model. Arguments that do not fit ``args_schema``, and with
    ``errors_to_model`` a tool's own refusal (a 4xx that is not a key
    problem), go back to the model as an error text with the reason; every
    other agentkey error propagates and fails the run.

    The SDK awaits tools on its event loop: an :class:`~agentkey.AsyncToolInvoker`
    is called directly, a :class:`~agentkey.ToolInvoker` (and its journal) in a
    worker thread.
    """
    plan_source: PlanSource = trace_plan if plan is None else plan
    step_source: StepIndexSource = call_step if step_index is None else step_index
    check_tool(name, description, args_schema, invoker)
    policy = check_sources(name, plan_source, step_source, on_repeat, "the ToolContext")
    options: dict[str, Any] = {"path": path, "method": method, "headers": headers}
    records: dict[str, dict[str, Any]] = {}  # call id -> record, until the SDK picks it up
    default = plan_source is trace_plan

    def _lost(ctx: ToolContext[Any], site: CallSite, digest: str) -> CallRecord | None:
        """An identical call another trace of this run's group (its conversation: a
        session's id) sent and never settled: the request re-sent after a crash."""
        group = _group_id(ctx)
        if group is None:
            return None
        mine = _turn(_context(ctx) or "")
        return unfinished_elsewhere(
            site,
            digest,
            unsettled(invoker),
            lambda context: _in_group(context, group, mine),
        )

    def chooser(ctx: ToolContext[Any], values: Mapping[str, Any], call: _Call) -> Chooser:
        session = plan_source(ctx) if callable(plan_source) else plan_source
        if not isinstance(session, PlanSession):
            raise ConfigurationError(
                f"the plan callable of tool {name!r} returned {session!r}, not a PlanSession"
            )

        def derive() -> int | Sequence[int]:
            return step_source(ctx, values) if callable(step_source) else step_source

        digest = args_hash(values, profile=session.profile)
        lost = _lost(ctx, _site(ctx, session, call, values), digest) if default else None

        def site() -> CallSite:
            if lost is not None:
                return adopted(_site(ctx, session, call, values), lost)
            return _site(ctx, session, call, values)

        # The site is read at each choice, inside the flow: siblings that arrived meanwhile
        # count too.
        return Chooser(
            site,
            args_hash=digest,
            on_repeat=policy,
            derive=derive,
            args_model=args_schema,
            unread="trace_id",
        )

    async def on_invoke(ctx: ToolContext[Any], raw: str) -> str:
        try:
            values = to_jsonable(args_schema.model_validate_json(raw or "{}"))
        except ValidationError as exc:
            return (
                f"Tool {name!r} was not called: the arguments do not match "
                f"{args_schema.__name__} ({first_error(exc)}). Correct them and call again."
            )
        call = _register(ctx, name, values)
        rule = chooser(ctx, values, call)
        template = rule.template()
        identity: dict[str, Any] = {**options, "call_id": ctx.tool_call_id or None}
        identity["context"] = _context(ctx)
        try:
            if isinstance(invoker, AsyncToolInvoker):
                result = await invoker._invoke_identified(template, rule, **identity)
            else:
                result = await asyncio.to_thread(
                    invoker._invoke_identified, template, rule, **identity
                )
        except ToolError as exc:
            text = refusal(name, exc, errors_to_model)
            call.answered(None, None)
            return text
        if isinstance(result, Pick):
            send: Repeat = result.answer
            call.answered(send.content, send.record.get("idempotency_key"))
            _keep(records, ctx.tool_call_id, send.record)
            return send.content
        text = _text(result)
        call.answered(text, result.idempotency_key)
        _keep(records, ctx.tool_call_id, call_record(result, template))
        return text

    def custom_data(data: FunctionToolCustomDataContext) -> Mapping[str, Any] | None:
        return records.pop(data.tool_context.tool_call_id, None)

    return FunctionTool(
        name=name,
        description=description,
        params_json_schema=args_schema.model_json_schema(),
        on_invoke_tool=on_invoke,
        strict_json_schema=False,  # the schema is the server's, not rewritten for strict mode
        custom_data_extractor=custom_data,
    )


def _text(result: ToolResult) -> str:
    """What the model reads: the tool's JSON body, after the repeat note of a marked repeat."""
    text = json.dumps(result.body, ensure_ascii=False)
    if result.repeat_of is None:
        return text
    return repeat_note(result.repeat_of, replayed=result.replayed) + text


def _keep(records: dict[str, dict[str, Any]], call_id: str, record: dict[str, Any]) -> None:
    if len(records) >= 1024:  # a run that failed before the SDK read its record
        records.pop(next(iter(records)))
    records[call_id] = record


# --- the calls of a run, in this process ------------------------------------------------


@dataclass(slots=True)
class _Call:
    """One call of a run as this process made it."""

    call_id: str
    tool: str
    args: bytes  # the normalised arguments' canonical JSON
    turn: int  # usage.requests when it was asked: the model response it came in
    text: str | None = None  # what the model reads of its answer (None: an error)
    key: str | None = None
    done: bool = False  # answered to the SDK: the model reads it at the next request

    def answered(self, text: str | None, key: Any) -> None:
        self.text, self.key, self.done = text, key if isinstance(key, str) else None, True


@dataclass(slots=True)
class _Run:
    calls: dict[str, _Call] = field(default_factory=dict)


#: The runs of this process, by the id of their ``Usage`` (one object per run, shared by
#: every ToolContext of it); an entry goes when its Usage does.
_RUNS: dict[int, _Run] = {}


def _run_of(usage: object) -> _Run:
    """The memory of the run ``usage`` belongs to (a fresh one, kept nowhere, when ``usage``
    cannot be watched: then each call sees only the journal and the run's input)."""
    run = _RUNS.get(id(usage))
    if run is None:
        run = _Run()
        try:
            weakref.finalize(usage, _RUNS.pop, id(usage), None)
        except TypeError:  # not weakly referenceable: an id could be reused once it is gone
            return run
        _RUNS[id(usage)] = run
    return run


def _register(ctx: ToolContext[Any], tool: str, values: Mapping[str, Any]) -> _Call:
    """This call, in its run's memory (the same object when the SDK runs the call again)."""
    calls = _run_of(ctx.usage).calls
    call = calls.get(ctx.tool_call_id)
    if call is None:
        if len(calls) >= _MAX_CALLS_PER_RUN:
            calls.pop(next(iter(calls)))
        args = encode_jsonable(to_jsonable(values), "python")
        call = calls[ctx.tool_call_id] = _Call(ctx.tool_call_id, tool, args, ctx.usage.requests)
    return call


def _together(other: _Call, call: _Call) -> bool:
    """Whether ``other`` came in the same model response as ``call``.

    A call not yet answered did (the SDK asks the model again only once every call
    of a response is answered); an answered one when the run's count of model
    requests had not moved. A model that reports no usage leaves the count at 0:
    an answered identical call then counts as read, and its repeat is marked.
    """
    if not other.done:
        return True
    return other.turn == call.turn and call.turn > 0


def _trace_id(ctx: ToolContext[Any]) -> str | None:
    trace_id = ctx.run_config.trace_id if ctx.run_config is not None else None
    return trace_id or None


def _group_id(ctx: ToolContext[Any]) -> str | None:
    group_id = ctx.run_config.group_id if ctx.run_config is not None else None
    return group_id or None


_IN = " in group "


def _context(ctx: ToolContext[Any]) -> str | None:
    """The journal's ``context`` of a call: the run (its trace) it was asked for in, and the
    group (the conversation, e.g. the session's id) the trace belongs to."""
    trace_id = _trace_id(ctx)
    if not trace_id:
        return None
    group = _group_id(ctx)
    turn = f"openai-agents trace {trace_id}"
    if _IN in turn:  # ambiguous with a group or without: never matched (scope_parts)
        return f"{turn}{_IN}{group or ''}"
    return turn if group is None else f"{turn}{_IN}{group}"


def _turn(context: str | None) -> str:
    """The run (trace) a context names; an ambiguous context (a trace or group id holding the
    separator) is its own turn, never another trace's."""
    parts = scope_parts(context, _IN)
    return (context or "") if parts is None else parts[0]


def _in_group(context: str | None, group: str, mine: str) -> bool:
    """Whether ``context`` surely names another trace of ``group`` than ``mine``: an ambiguous
    context is never matched (a missed recovery, never another conversation's)."""
    parts = scope_parts(context, _IN)
    return parts is not None and parts[1] == group and parts[0] != mine


def _site(
    ctx: ToolContext[Any], plan: PlanSession, call: _Call, values: Mapping[str, Any]
) -> CallSite:
    """The call as the run's input and this process's memory of the run show it."""
    calls = _run_of(ctx.usage).calls
    # A copy first: a ToolInvoker's flow reads this in a worker thread while the loop adds.
    same = [c for c in list(calls.values()) if c.tool == call.tool and c.args == call.args]
    siblings = tuple(c.call_id for c in same if c is call or _together(c, call))
    answered: dict[str, str | None] = {}
    for item in ctx.turn_input:
        if isinstance(item, Mapping) and item.get("type") == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)
            answered[str(item.get("call_id"))] = text
    known: dict[str, str] = {}
    for other in same:
        if other.done and other.call_id not in siblings:
            answered[other.call_id] = other.text
            if other.text is not None and other.key is not None:
                known[other.call_id] = other.key
    context = _context(ctx)
    return CallSite(
        plan=plan,
        tool=call.tool,
        values=values,
        call_id=call.call_id,
        siblings=siblings,
        context=context,
        seen=Seen(answered, frozenset({_turn(context)} if context else ()), turn_of=_turn),
        known=known,
    )
