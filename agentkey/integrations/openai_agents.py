"""OpenAI Agents SDK: function tools whose calls carry a key from the run.

:func:`remote_tool` turns a tool served over HTTP into an Agents SDK
``FunctionTool``. The SDK gives a tool its ``ToolContext``: the tool call's
``tool_call_id`` and the run's ``RunConfig``, but no public step counter. So
the identity rule is:

- plan session id (:func:`trace_plan`): a UUIDv5 of ``RunConfig.trace_id``,
  which you set (``RunConfig(trace_id=agents.gen_trace_id())``) and persist
  with the job. A run without an explicit ``trace_id`` is refused with
  :class:`~agentkey.ConfigurationError`: the SDK's own trace id is drawn
  afresh for every run (also for a ``RunState`` resume) and the SDK may be
  run with tracing off, so it names nothing that lasts;
- step index (:func:`call_step`): ``(slot, call)``, two 32-bit numbers, of
  the tool name and of the model's ``tool_call_id``.

What this keeps: every resend of the invoker (one key per call), and every
re-execution of a call the run already recorded: a ``RunState`` resumed after
an interruption (``needs_approval``), a durable runner that replays the
recorded model response (the SDK's Temporal integration). What it cannot
keep: a run started over from its input with the same ``trace_id`` asks the
model again, which names its calls anew, so those calls get new keys and run
again. Use :mod:`agentkey.integrations.langgraph` or
:mod:`agentkey.integrations.pydantic_ai` when that is the failure you expect,
or pass ``step_index=`` from your own checkpointed step counter.

Within one process the plan also remembers its calls, so a call the model
repeats at a later turn (same tool, same arguments) follows ``on_repeat``;
by default it resends the earlier call's key and the server replays it.

Needs the ``openai-agents`` extra (``pip install 'agentkey-idempotency[openai-agents]'``).
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

from pydantic import BaseModel, ValidationError

from .._canonical import to_jsonable
from .._exceptions import ConfigurationError, ToolError
from .._invoker import AsyncToolInvoker, ToolInvoker, ToolResult
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
    repeat_note,
)

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


@functools.lru_cache(maxsize=1024)
def _session(trace_id: str) -> PlanSession:
    """One PlanSession per trace id in this process, so repeats within a run are seen."""
    return PlanSession.from_external_id(json.dumps(["openai-agents", trace_id]))


def trace_plan(ctx: ToolContext[Any]) -> PlanSession:
    """The plan session of a run: a UUIDv5 of the ``trace_id`` you set in its ``RunConfig``."""
    trace_id = ctx.run_config.trace_id if ctx.run_config is not None else None
    if not trace_id:
        raise ConfigurationError(
            f"tool {ctx.tool_name!r} has no plan session: the run has no explicit trace_id. "
            "Run it with Runner.run(..., run_config=RunConfig(trace_id=gen_trace_id())) and "
            "persist the trace id with the job (resuming the run with it keeps the keys), or "
            "pass plan=PlanSession(...) to remote_tool"
        )
    return _session(trace_id)


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
    choose them yourself. The model reads the tool's JSON body as text; the
    call's record (``idempotency_key``, ``step``, ``outcome``, ``replayed``,
    ``repeat_of``, ``attempts`` ...) is the output item's ``custom_data``,
    which the SDK never sends to the model. Arguments that do not fit
    ``args_schema``, and with ``errors_to_model`` a tool's own refusal (a 4xx
    that is not a key problem), go back to the model as an error text with the
    reason; every other agentkey error propagates and fails the run.

    The SDK awaits tools on its event loop: an :class:`~agentkey.AsyncToolInvoker`
    is called directly, a :class:`~agentkey.ToolInvoker` in a worker thread.
    """
    plan_source: PlanSource = trace_plan if plan is None else plan
    step_source: StepIndexSource = call_step if step_index is None else step_index
    check_tool(name, description, args_schema, invoker)
    policy = check_sources(name, plan_source, step_source, on_repeat, "the ToolContext")
    options: dict[str, Any] = {"path": path, "method": method, "headers": headers}
    records: dict[str, dict[str, Any]] = {}  # call id -> record, until the SDK picks it up

    def prepare(ctx: ToolContext[Any], raw: str) -> Step | str:
        try:
            values = to_jsonable(args_schema.model_validate_json(raw or "{}"))
        except ValidationError as exc:
            return (
                f"Tool {name!r} was not called: the arguments do not match "
                f"{args_schema.__name__} ({first_error(exc)}). Correct them and call again."
            )
        index = step_source(ctx, values) if callable(step_source) else step_source
        return make_step(plan_source, ctx, index, name, values, args_schema, policy)

    async def on_invoke(ctx: ToolContext[Any], raw: str) -> str:
        step = prepare(ctx, raw)
        if isinstance(step, str):
            return step
        try:
            if isinstance(invoker, AsyncToolInvoker):
                result = await invoker.invoke(step, **options)
            else:
                result = await asyncio.to_thread(_invoke, invoker, step, options)
        except ToolError as exc:
            return refusal(name, exc, errors_to_model)
        if len(records) >= 1024:  # a run that failed before the SDK read its record
            records.pop(next(iter(records)))
        records[ctx.tool_call_id] = call_record(result, step)
        text = json.dumps(result.body, ensure_ascii=False)
        return text if step.repeat_of is None else repeat_note(step.repeat_of, replayed=result.replayed) + text

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


def _invoke(invoker: ToolInvoker, step: Step, options: Mapping[str, Any]) -> ToolResult:
    return invoker.invoke(step, **options)
