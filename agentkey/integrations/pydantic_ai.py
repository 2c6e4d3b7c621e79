"""PydanticAI: tools whose calls are keyed by the agent run, so a re-run replays.

:func:`remote_tool` turns a tool served over HTTP into a PydanticAI ``Tool``.
Each call gets its key from what PydanticAI gives the tool in its
``RunContext``, never from the model:

- plan session id (:func:`run_plan`): a UUIDv5 of the run's ``run_id``. Pass
  ``run_id=`` to ``agent.run(...)`` (and persist it with the job) so a run
  started again after a crash gets the same plan; without it PydanticAI draws
  a fresh UUID7 per run, and nothing survives a restart. Inside a durable
  workflow (Temporal, DBOS, Prefect) PydanticAI derives ``run_id`` from the
  workflow run, so it survives the engine's re-executions as is;
- step index (:func:`run_step`): ``(run_step, slot, ordinal)``, e.g.
  ``step_002.1180370474.000``. ``run_step`` is PydanticAI's count of model
  requests in the run; the slot is a 32-bit number of the tool name, so two
  tools never share a step; the ordinal numbers the call among the identical
  calls (same tool, same normalised arguments) of the ``ModelResponse`` that
  asked for it, so a re-asked model that returns the same calls in another
  order keeps their keys.

A call the model repeats (same tool and arguments as an earlier successful
call of this agentkey tool still in ``ctx.messages``, this run's or an earlier
run's of the conversation) follows the tool's ``on_repeat`` policy: by default
it is answered with the earlier result, marked as a repeat, and nothing is
sent. A tool's own refusal reaches the model as ``ToolFailed`` with the
server's short reason.

Needs the ``pydantic-ai`` extra (``pip install 'agentkey-idempotency[pydantic-ai]'``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

from pydantic import BaseModel, ValidationError

from .._canonical import encode_jsonable, to_jsonable
from .._exceptions import AgentKeyError, ConfigurationError, ToolError
from .._invoker import AsyncToolInvoker, ToolInvoker, ToolResult
from .._keys import StepKey
from .._plan import OnRepeat, PlanSession, Step
from ._common import (
    call_record,
    check_sources,
    check_tool,
    code,
    first_error,
    make_step,
    missing_extra,
    refusal,
    repeat_answer,
    repeat_note,
)

try:
    from pydantic_ai import ModelRetry, RunContext, Tool, ToolFailed, ToolReturn
    from pydantic_ai.messages import ModelResponse, ToolCallPart, ToolReturnPart
except ModuleNotFoundError as exc:  # pragma: no cover - exercised in a subprocess test
    raise missing_extra(exc, "pydantic-ai", "pydantic_ai") from None

__all__ = ["remote_tool", "run_plan", "run_step"]

#: A plan session, or a callable choosing one from the call's ``RunContext``.
PlanSource: TypeAlias = "PlanSession | Callable[[RunContext[Any]], PlanSession]"
#: A step index, or a callable of the ``RunContext``, tool name and normalised arguments.
StepIndexSource: TypeAlias = (
    "int | Sequence[int] | Callable[[RunContext[Any], str, Mapping[str, Any]], int | Sequence[int]]"
)


def run_plan(ctx: RunContext[Any]) -> PlanSession:
    """The plan session of one agent run: a UUIDv5 of ``ctx.run_id``.

    Run the agent with the same ``run_id=`` after a crash and its calls get
    their keys again; the server replays what already ran.
    """
    if not ctx.run_id:
        raise ConfigurationError(
            f"tool {ctx.tool_name!r} has no plan session: its RunContext has no run_id. Call it "
            "through agent.run(..., run_id=...) (persist the run id to resume after a crash), or "
            "pass plan=PlanSession(...) to remote_tool"
        )
    return PlanSession.from_external_id(json.dumps(["pydantic-ai", ctx.run_id]))


def run_step(
    ctx: RunContext[Any],
    tool: str,
    args: Mapping[str, Any],
    *,
    args_schema: type[BaseModel] | None = None,
) -> tuple[int, int, int]:
    """``(run_step, slot, ordinal)`` of a call: see the module's docstring.

    ``args`` are the call's normalised arguments; ``args_schema`` normalises
    the other calls of the response alike before they are compared. When no
    ``ModelResponse`` in ``ctx.messages`` holds the call (a tool run by hand),
    the ordinal is derived from the tool call's id instead.
    """
    if ctx.tool_call_id is None:
        raise ConfigurationError(
            f"tool {tool!r} ran at run step {ctx.run_step} without a tool call id, so run_step "
            "cannot tell its calls apart; run it through an Agent, or pass step_index= to "
            "remote_tool"
        )
    slot = code(tool)
    response = _holder(ctx.messages, ctx.tool_call_id)
    if response is None:
        return ctx.run_step, slot, code(ctx.tool_call_id)
    mine = encode_jsonable(to_jsonable(args), "python")
    same = []
    for part in response.parts:
        if not isinstance(part, ToolCallPart):
            continue
        if part.tool_call_id == ctx.tool_call_id or (
            part.tool_name == tool and _normalised(part, args_schema) == mine
        ):
            same.append(part.tool_call_id)
    if same.count(ctx.tool_call_id) > 1:
        raise ConfigurationError(
            f"tool {tool!r} at run step {ctx.run_step}: the model's response holds "
            f"{same.count(ctx.tool_call_id)} tool calls with the id {ctx.tool_call_id!r}, so "
            "they cannot be told apart; give each call a unique id, or pass step_index="
        )
    return ctx.run_step, slot, same.index(ctx.tool_call_id)


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
    ``step_index`` to :func:`run_step`; pass a value or a callable to choose
    them yourself. ``on_repeat`` is as in
    :func:`agentkey.integrations.langchain.remote_tool`.

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
    check_tool(name, description, args_schema, invoker)
    policy = check_sources(
        name,
        plan_source,
        run_step if step_index is None else step_index,
        on_repeat,
        "the RunContext",
    )
    options: dict[str, Any] = {"path": path, "method": method, "headers": headers}

    def prepare(ctx: RunContext[Any], raw: dict[str, Any]) -> Step | ToolReturn:
        try:
            values = to_jsonable(args_schema.model_validate(raw))
        except ValidationError as exc:
            # The model chose these arguments: it can correct them (the count, not the values).
            raise ModelRetry(
                f"the arguments do not match {args_schema.__name__} "
                f"({exc.error_count()} error(s)): {first_error(exc)}"
            ) from None
        index: int | Sequence[int]
        if step_index is None:
            index = run_step(ctx, name, values, args_schema=args_schema)
        else:
            index = step_index(ctx, name, values) if callable(step_index) else step_index
        step = make_step(plan_source, ctx, index, name, values, args_schema, policy)
        repeat = repeat_answer(step, policy, lambda: _earlier(ctx.messages, step))
        if repeat is None:
            return step
        label, content, record = repeat
        return ToolReturn(return_value=repeat_note(label) + content, metadata=record)

    def for_model(exc: ToolError) -> ToolFailed:
        """A tool's own refusal as ToolFailed for the model; anything else re-raised."""
        return ToolFailed(refusal(name, exc, errors_to_model))

    schema = args_schema.model_json_schema()
    if isinstance(invoker, ToolInvoker):
        sync_invoker = invoker

        def run(ctx: RunContext[Any], **raw: Any) -> ToolReturn:
            step = prepare(ctx, raw)
            if isinstance(step, ToolReturn):
                return step
            try:
                return _answer(sync_invoker.invoke(step, **options), step)
            except ToolError as exc:
                raise for_model(exc) from exc

        tool: Tool[Any] = Tool.from_schema(run, name, description, schema, takes_ctx=True)
        return tool

    async_invoker = invoker

    async def arun(ctx: RunContext[Any], **raw: Any) -> ToolReturn:
        step = prepare(ctx, raw)
        if isinstance(step, ToolReturn):
            return step
        try:
            return _answer(await async_invoker.invoke(step, **options), step)
        except ToolError as exc:
            raise for_model(exc) from exc

    atool: Tool[Any] = Tool.from_schema(arun, name, description, schema, takes_ctx=True)
    return atool


def _answer(result: ToolResult, step: Step) -> ToolReturn:
    """The model reads the tool's JSON body; the metadata records how agentkey got it."""
    body: Any = result.body
    if step.repeat_of is not None:
        body = repeat_note(step.repeat_of) + json.dumps(body, ensure_ascii=False)
    return ToolReturn(return_value=body, metadata=call_record(result, step))


def _earlier(messages: Sequence[Any], step: Step) -> tuple[str, Mapping[str, Any]] | None:
    """The earliest successful return of this tool, with the same arguments, at another step."""
    for message in messages:
        for part in getattr(message, "parts", ()):
            if not (
                isinstance(part, ToolReturnPart)
                and part.tool_name == step.tool
                and part.outcome == "success"
                and isinstance(part.metadata, Mapping)
            ):
                continue
            try:
                key = StepKey.parse(str(part.metadata.get("idempotency_key")))
            except AgentKeyError:
                continue
            if key.args_hash == step.key.args_hash and key.format() != step.idempotency_key:
                content = part.content
                text = content if isinstance(content, str) else json.dumps(content)
                # The step label comes from the parsed key, not from what the metadata says.
                return text, {**part.metadata, "step": key.label}
    return None


def _holder(messages: Sequence[Any], tool_call_id: str) -> ModelResponse | None:
    """The latest ModelResponse that holds this call's id."""
    for message in reversed(messages):
        if isinstance(message, ModelResponse) and any(
            isinstance(p, ToolCallPart) and p.tool_call_id == tool_call_id for p in message.parts
        ):
            return message
    return None


def _normalised(part: ToolCallPart, schema: type[BaseModel] | None) -> bytes | None:
    """Another call's arguments as this tool would hash them, or None if they do not fit."""
    try:
        args: Any = part.args_as_dict()
        values = schema.model_validate(args) if schema is not None else args
        return encode_jsonable(to_jsonable(values), "python")
    except (ValueError, AgentKeyError):  # ValidationError is a ValueError
        return None
