"""PydanticAI: tools keyed by the agent run and the journal; a re-run charges nothing twice.

:func:`remote_tool` turns a tool served over HTTP into a PydanticAI ``Tool``.
Each call gets its key from what PydanticAI gives the tool in its
``RunContext`` and from the invoker's journal, never from the model:

- plan session id (:func:`run_plan`): a UUIDv5 of the run's ``run_id``. Give
  each job execution a run id of its own (``str(uuid.uuid4())``), persist it
  with the job, and pass it as ``run_id=`` to ``agent.run(...)`` when the job
  runs again after a crash; without it PydanticAI draws a fresh UUID7 per run,
  and nothing survives a restart. Inside a durable workflow (Temporal, DBOS,
  Prefect) PydanticAI derives ``run_id`` from the workflow run, so it survives
  the engine's re-executions as is;
- a run continued from its saved ``message_history`` (PydanticAI refuses the old
  ``run_id`` there and draws a new one): a call the history shows asked by an
  earlier run and never answered by the tool (PydanticAI runs it again; or
  ``repair_messages()`` made up its return and the prompt was sent again, so
  the model asks anew) keeps that run's plan and its key. A prompt sent again
  in the same ``conversation_id`` without the history finds an identical call
  another run of the conversation left unsettled in the journal;
- step index (:func:`call_step`): ``(slot, call)``, two 32-bit numbers of the
  tool name and of the model's tool call id, so a call's step never depends on
  the calls before it;
- the journal and ``ctx.messages`` then decide (``_identity``): the same call
  run again keeps its key; a call the model asks for again without ever having
  read its answer (a run started again after a crash, whose model may first
  call other tools and name its calls anew) gets the earlier call's key back,
  and its answer is marked as a repeat; a call the model asks for again after
  reading its answer (this run's, or an earlier run's whose messages the run was
  given) follows the tool's ``on_repeat`` policy.

A run id reused for another job (a literal ``"job-7"`` on a schedule) is the
same run to agentkey: its calls are answered with the earlier execution's
results, marked as repeats, and a warning says to give each execution its own
id.

A tool's own refusal reaches the model as ``ToolFailed`` with the server's
short reason.

Needs the ``pydantic-ai`` extra (``pip install 'agentkey-idempotency[pydantic-ai]'``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

from pydantic import BaseModel, ValidationError

from .._canonical import args_hash, encode_jsonable, to_jsonable
from .._exceptions import AgentKeyError, ConfigurationError, ToolError
from .._keys import StepKey
from .._plan import OnRepeat, PlanSession, Step
from ..client._flow import Pick
from ..client._invoker import AsyncToolInvoker, ToolInvoker, ToolResult
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
    from pydantic_ai import ModelRetry, RunContext, Tool, ToolFailed, ToolReturn
    from pydantic_ai.messages import (
        ModelRequest,
        ModelResponse,
        RetryPromptPart,
        ToolCallPart,
        ToolReturnPart,
    )
except ModuleNotFoundError as exc:  # pragma: no cover - exercised in a subprocess test
    raise missing_extra(exc, "pydantic-ai", "pydantic_ai") from None

__all__ = ["call_step", "remote_tool", "run_plan"]

#: A plan session, or a callable choosing one from the call's ``RunContext``.
PlanSource: TypeAlias = "PlanSession | Callable[[RunContext[Any]], PlanSession]"
#: A step index, or a callable of the ``RunContext``, tool name and normalised arguments.
StepIndexSource: TypeAlias = (
    "int | Sequence[int] | Callable[[RunContext[Any], str, Mapping[str, Any]], int | Sequence[int]]"
)


def run_plan(ctx: RunContext[Any]) -> PlanSession:
    """The plan session of one agent run: a UUIDv5 of ``ctx.run_id``.

    Run the agent with the same ``run_id=`` after a crash and its calls get
    their keys again; the server replays what already ran. Give each job
    execution its own run id: a run id reused for another job is the same run.
    """
    if not ctx.run_id:
        raise ConfigurationError(
            f"tool {ctx.tool_name!r} has no plan session: its RunContext has no run_id. Call it "
            "through agent.run(..., run_id=...) (persist the run id to resume after a crash), or "
            "pass plan=PlanSession(...) to remote_tool"
        )
    return _run_plan(ctx.run_id)


def _run_plan(run_id: str) -> PlanSession:
    return PlanSession.from_external_id(json.dumps(["pydantic-ai", run_id]))


def call_step(ctx: RunContext[Any], tool: str, args: Mapping[str, Any]) -> tuple[int, int]:
    """``(slot, call)``: 32-bit numbers of the tool name and of the model's tool call id.

    The same call keeps its step wherever it runs again; two calls never share
    one, and a call's step never depends on the calls before it.
    """
    if ctx.tool_call_id is None:
        raise ConfigurationError(
            f"tool {tool!r} ran without a tool call id, so call_step cannot name its step; run "
            "it through an Agent, or pass step_index= to remote_tool"
        )
    return code(tool), code(ctx.tool_call_id)


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
) -> Tool[Any]:
    """A PydanticAI ``Tool`` that sends each call through ``invoker`` with a deterministic key.

    ``args_schema`` is the schema the model sees, and it normalises the
    arguments before they are hashed; arguments that do not fit it go back to
    the model as a ``ModelRetry``. ``plan`` defaults to :func:`run_plan` and
    ``step_index`` to :func:`call_step`; pass a value or a callable to choose
    them yourself. Either way each call's key is settled against the invoker's
    journal and ``ctx.messages`` (module docstring). ``on_repeat`` says what a
    call the model already read the answer of gets when it is asked for again:
    ``"replay"`` (the default: the earlier answer, marked, nothing sent),
    ``"raise"`` (:class:`~agentkey.StepRepeated`) or ``"allow"`` (a new call).

    The tool returns the tool server's JSON body to the model, and the call's
    record (``idempotency_key``, ``step``, ``outcome``, ``replayed``,
    ``repeat_of``, ``attempts`` ...) as the ``ToolReturnPart``'s ``metadata``,
    which the model never sees. With ``errors_to_model`` a tool's own
    refusal (a 4xx that is not a key problem) raises PydanticAI's
    ``ToolFailed`` with the server's reason; every other agentkey error
    propagates and ends the run (re-running it with the same ``run_id`` is
    safe: the calls get the same keys).

    A :class:`~agentkey.ToolInvoker` gives a synchronous tool (PydanticAI runs
    it in a worker thread), an :class:`~agentkey.AsyncToolInvoker` an async one.
    """
    plan_source: PlanSource = run_plan if plan is None else plan
    step_source: StepIndexSource = call_step if step_index is None else step_index
    check_tool(name, description, args_schema, invoker)
    policy = check_sources(name, plan_source, step_source, on_repeat, "the RunContext")
    options: dict[str, Any] = {"path": path, "method": method, "headers": headers}

    def prepare(ctx: RunContext[Any], raw: dict[str, Any]) -> Chooser:
        try:
            values = to_jsonable(args_schema.model_validate(raw))
        except ValidationError as exc:
            # The model chose these arguments: it can correct them (the count, not the values).
            raise ModelRetry(
                f"the arguments do not match {args_schema.__name__} "
                f"({exc.error_count()} error(s)): {first_error(exc)}"
            ) from None
        default = plan_source is run_plan
        origin = _origin(ctx, name, values, args_schema) if default else None
        if origin is not None:  # the call of an earlier run this one continues
            session = _run_plan(origin[0])
        else:
            session = plan_source(ctx) if callable(plan_source) else plan_source
        if not isinstance(session, PlanSession):
            raise ConfigurationError(
                f"the plan callable of tool {name!r} returned {session!r}, not a PlanSession"
            )
        site = _site(ctx, session, name, values, args_schema)
        if step_source is call_step and origin is not None and origin[1] is not None:
            # The earlier call's key follows from its call id: known without the journal.
            index = (code(name), code(origin[1]))
            step = session.step(index, name, site.values, args_model=args_schema, on_repeat="allow")
            site = dataclasses.replace(site, known={**site.known, origin[1]: step.idempotency_key})
        digest = args_hash(values, profile=session.profile)
        conversation = getattr(ctx, "conversation_id", None)
        if default and origin is None and conversation and ctx.run_id:
            # A run of this conversation that died while it made this call (the journal
            # shows it unsettled) and that this history does not show: it is asked again.
            mine = _context(None, ctx.run_id)
            lost = unfinished_elsewhere(
                site,
                digest,
                unsettled(invoker),
                lambda context: _in_conversation(context, conversation, mine),
            )
            if lost is not None:
                site = adopted(site, lost)

        def derive() -> int | Sequence[int]:
            if callable(step_source):
                return step_source(ctx, name, site.values)
            return step_source

        return Chooser(
            site,
            args_hash=digest,
            on_repeat=policy,
            derive=derive,
            args_model=args_schema,
            unread="run_id",
            elsewhere=lambda: _elsewhere(ctx.messages, name, digest, site.plan.id),
        )

    def identity(rule: Chooser) -> dict[str, Any]:
        site = rule.site
        return {**options, "call_id": site.call_id, "context": site.context}

    def for_model(exc: ToolError) -> ToolFailed:
        """A tool's own refusal as ToolFailed for the model; anything else re-raised."""
        return ToolFailed(refusal(name, exc, errors_to_model))

    schema = args_schema.model_json_schema()
    if isinstance(invoker, ToolInvoker):
        sync_invoker = invoker

        def run(ctx: RunContext[Any], **raw: Any) -> ToolReturn:
            rule = prepare(ctx, raw)
            template = rule.template()
            try:
                result = sync_invoker._invoke_identified(template, rule, **identity(rule))
            except ToolError as exc:
                raise for_model(exc) from exc
            return _answer(result, template)

        tool: Tool[Any] = Tool.from_schema(run, name, description, schema, takes_ctx=True)
        return tool

    async_invoker = invoker

    async def arun(ctx: RunContext[Any], **raw: Any) -> ToolReturn:
        rule = prepare(ctx, raw)
        template = rule.template()
        try:
            result = await async_invoker._invoke_identified(template, rule, **identity(rule))
        except ToolError as exc:
            raise for_model(exc) from exc
        return _answer(result, template)

    atool: Tool[Any] = Tool.from_schema(arun, name, description, schema, takes_ctx=True)
    return atool


def _answer(result: ToolResult | Pick, step: Step) -> ToolReturn:
    """The model reads the tool's JSON body; the metadata records how agentkey got it."""
    if isinstance(result, Pick):  # a repeat of a call the model read: answered, not sent
        repeat: Repeat = result.answer
        return ToolReturn(return_value=repeat.content, metadata=repeat.record)
    body: Any = result.body
    if result.repeat_of is not None:
        note = repeat_note(result.repeat_of, replayed=result.replayed)
        body = note + json.dumps(body, ensure_ascii=False)
    return ToolReturn(return_value=body, metadata=call_record(result, step))


_IN = " in conversation "


def _context(conversation_id: str | None, run_id: str) -> str:
    """The journal's ``context`` of a call: the run (the turn) it was asked for in, and the
    conversation the run belongs to."""
    turn = f"pydantic-ai run {run_id}"
    if _IN in turn:  # ambiguous with a conversation or without: never matched (scope_parts)
        return f"{turn}{_IN}{conversation_id or ''}"
    return turn if conversation_id is None else f"{turn}{_IN}{conversation_id}"


def _turn(context: str) -> str:
    """The run a context names (the turn ``Seen.contexts`` holds); an ambiguous context (a run
    or conversation id holding the separator) is its own turn, never another run's."""
    parts = scope_parts(context, _IN)
    return context if parts is None else parts[0]


def _in_conversation(context: str | None, conversation: str, mine: str) -> bool:
    """Whether ``context`` surely names another run of ``conversation`` than ``mine``: an
    ambiguous context is never matched (a missed recovery, never another conversation's)."""
    parts = scope_parts(context, _IN)
    return parts is not None and parts[1] == conversation and parts[0] != mine


def _synthesized(part: ToolReturnPart) -> bool:
    """A return PydanticAI made up for a call left without one (``repair_messages()``): the
    tool never answered it."""
    metadata = part.metadata
    return isinstance(metadata, Mapping) and bool(
        metadata.get("pydantic_ai_synthesized_tool_return")
    )


def _origin(
    ctx: RunContext[Any], tool: str, values: Mapping[str, Any], schema: type[BaseModel]
) -> tuple[str, str | None] | None:
    """``(run id, call id)`` of the oldest call in the history, asked for by an earlier run,
    that this call continues: this very call (a run resumed from a saved history runs the
    calls its last response left unanswered), or an identical call (same tool, normalised
    arguments) the tool never answered (a history repaired with ``repair_messages()``, the
    user's prompt sent again). None: the call belongs to this run.
    """
    messages = ctx.messages
    answered: set[str] = set()
    for message in messages:
        for part in getattr(message, "parts", ()):
            if isinstance(part, ToolReturnPart) and not _synthesized(part):
                answered.add(part.tool_call_id)
            elif isinstance(part, RetryPromptPart) and part.tool_call_id:
                answered.add(part.tool_call_id)  # refused: nothing ran, asking again is new
    mine = encode_jsonable(to_jsonable(values), "python")
    for message in messages:
        run_id = getattr(message, "run_id", None)
        if not isinstance(message, ModelResponse) or run_id == ctx.run_id:
            continue
        for part in message.parts:
            if not isinstance(part, ToolCallPart) or part.tool_call_id in answered:
                continue
            if part.tool_call_id != ctx.tool_call_id and (
                part.tool_name != tool or _normalised(part, schema) != mine
            ):
                continue
            if not run_id:
                raise _unattributed(ctx, tool, part.tool_call_id)
            return run_id, (None if part.tool_call_id == ctx.tool_call_id else part.tool_call_id)
    return None


def _unattributed(ctx: RunContext[Any], tool: str, call_id: str) -> ConfigurationError:
    """The refusal of a call whose earlier unanswered twin no run can be named for."""
    return ConfigurationError(
        f"tool {tool!r}: the message history holds the same call (tool call id {call_id!r}, "
        "same arguments), asked for by an earlier run and never answered by the tool, but "
        "its message carries no run_id, so agentkey cannot tell which key it was sent under "
        "or whether it ran; nothing was sent. Pass the history as PydanticAI saved it "
        "(ModelMessagesTypeAdapter keeps each message's run_id), or give the tool a plan "
        "kept with the job: remote_tool(..., plan=PlanSession.from_external_id(job_id))"
    )


def _site(
    ctx: RunContext[Any],
    plan: PlanSession,
    tool: str,
    values: Mapping[str, Any],
    schema: type[BaseModel],
) -> CallSite:
    """The call as ``ctx.messages`` shows it (see ``_identity``)."""
    messages = ctx.messages
    call_id = ctx.tool_call_id
    conversation = getattr(ctx, "conversation_id", None)
    siblings: tuple[str, ...] = ()
    position: tuple[int, int] | None = None
    found = _holder(messages, call_id) if call_id is not None else None
    if found is not None:
        position = (0, found[0])
        siblings = tuple(_identical(found[1], ctx, tool, values, schema))
    answered: dict[str, str | None] = {}
    known: dict[str, str] = {}
    contexts: set[str] = set()
    asked: dict[str, tuple[int, int]] = {}
    for place, message in enumerate(messages):
        if message.run_id:
            contexts.add(_turn(_context(conversation, message.run_id)))
        if isinstance(message, ModelResponse):
            for part in message.parts:
                if isinstance(part, ToolCallPart):
                    asked.setdefault(part.tool_call_id, (0, place))
            continue
        for part in getattr(message, "parts", ()):  # a ModelRequest
            if isinstance(part, ToolReturnPart) and not _synthesized(part):
                ok = part.outcome == "success"
                answered[part.tool_call_id] = _text(part) if ok else None
                key = _key_of(part, tool) if ok else None
                if key is not None and key.plan_session_id == plan.id:
                    known[part.tool_call_id] = key.format()
            elif isinstance(part, RetryPromptPart) and part.tool_call_id:
                answered[part.tool_call_id] = None  # the model read an error: a new call
    context = _context(conversation, ctx.run_id) if ctx.run_id else None
    if context is not None:
        contexts.add(_turn(context))
    return CallSite(
        plan=plan,
        tool=tool,
        values=values,
        call_id=call_id,
        siblings=siblings,
        context=context,
        seen=Seen(answered, frozenset(contexts), asked, _turn),
        position=position,
        known=known,
    )


def _text(part: ToolReturnPart) -> str:
    """What the model read of a tool's return."""
    content = part.content
    return content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)


def _key_of(part: ToolReturnPart, tool: str) -> StepKey | None:
    """The key an agentkey tool's return records in its metadata, if it is this tool's."""
    if part.tool_name != tool or not isinstance(part.metadata, Mapping):
        return None
    try:
        return StepKey.parse(str(part.metadata.get("idempotency_key")))
    except AgentKeyError:
        return None


def _elsewhere(
    messages: Sequence[Any], tool: str, digest: str, plan_id: str
) -> tuple[str, str] | None:
    """``(content, key)`` of the earliest successful return, read by the model, of this tool
    with the same arguments in another plan (an earlier run whose messages this run was given)."""
    for message in messages:
        if not isinstance(message, ModelRequest):
            continue
        for part in message.parts:
            if not isinstance(part, ToolReturnPart) or part.outcome != "success":
                continue
            key = _key_of(part, tool)
            if key is not None and key.args_hash == digest and key.plan_session_id != plan_id:
                return _text(part), key.format()
    return None


def _holder(messages: Sequence[Any], tool_call_id: str) -> tuple[int, ModelResponse] | None:
    """The latest ModelResponse that holds this call's id, with its position."""
    for place in range(len(messages) - 1, -1, -1):
        message = messages[place]
        if isinstance(message, ModelResponse) and any(
            isinstance(p, ToolCallPart) and p.tool_call_id == tool_call_id for p in message.parts
        ):
            return place, message
    return None


def _identical(
    response: ModelResponse,
    ctx: RunContext[Any],
    tool: str,
    args: Mapping[str, Any],
    schema: type[BaseModel] | None,
) -> list[str]:
    """The ids of the calls of ``response`` identical to this one (tool, normalised args)."""
    mine = encode_jsonable(to_jsonable(args), "python")
    same = [
        part.tool_call_id
        for part in response.parts
        if isinstance(part, ToolCallPart)
        and (
            part.tool_call_id == ctx.tool_call_id
            or (part.tool_name == tool and _normalised(part, schema) == mine)
        )
    ]
    if same.count(ctx.tool_call_id or "") > 1:
        raise ConfigurationError(
            f"tool {tool!r} at run step {ctx.run_step}: the model's response holds "
            f"{same.count(ctx.tool_call_id or '')} tool calls with the id {ctx.tool_call_id!r}, "
            "so they cannot be told apart; give each call a unique id, or pass step_index="
        )
    return same


def _normalised(part: ToolCallPart, schema: type[BaseModel] | None) -> bytes | None:
    """Another call's arguments as this tool would hash them, or None if they do not fit."""
    try:
        args: Any = part.args_as_dict()
        values = schema.model_validate(args) if schema is not None else args
        return encode_jsonable(to_jsonable(values), "python")
    except (ValueError, AgentKeyError):  # ValidationError is a ValueError
        return None
