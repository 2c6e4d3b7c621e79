"""Google ADK: tools keyed by the session and the journal; a resumed or re-sent turn charges once.

:func:`remote_tool` turns a tool served over HTTP into an ADK ``BaseTool``. ADK
gives a tool its ``ToolContext`` (public API only): the ``session`` (its id,
``app_name``, ``user_id``, its ``events`` and ``state``), the model's
``function_call_id``, the ``invocation_id`` and the agent's ``branch``. A
session is what ADK keeps across a restart (a persistent session service:
``DatabaseSessionService``, ``SqliteSessionService``, Vertex AI), and the
function call event is in the session before the tool runs. So a call's
identity comes from:

- plan session id (:func:`session_plan`): a UUIDv5 of the session's
  ``app_name``, ``user_id`` and ``id``: one plan per session, across its
  invocations and processes;
- step index (:func:`call_step`): ``(slot, call)``, two 32-bit numbers of
  the tool name and of the model's ``function_call_id``;
- the invoker's journal (every call the plan sent, in any process) and what
  the model saw: the session's events visible on the agent's branch.

Then (``_identity``): the same call run again (an invocation resumed with
``runner.run_async(invocation_id=...)`` under ``ResumabilityConfig``, which
runs the unanswered call again with its id) keeps its key, and the tool
server replays; a call the model asks for again without ever having read its
answer (the user's message re-sent after a crash, a new invocation whose model
names its calls anew) gets the earlier call's key back and its answer is marked
as a repeat, so it does not run twice; a call the model asks for again after
reading its answer (a later turn of the session) follows ``on_repeat``.
Identical calls in one model response are two operations: both run. Calls on
another agent's branch (a ``ParallelAgent``'s sub-agents) are that branch's.

The call's record (``idempotency_key``, ``step``, ``outcome``, ``replayed``,
``repeat_of`` ...) goes to the session's state under ``agentkey:call:<function
call id>``, which the model does not read unless an instruction names it.

Needs the ``google-adk`` extra (``pip install 'agentkey-idempotency[google-adk]'``,
Python 3.11 or newer).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

from pydantic import BaseModel, ValidationError

from .._canonical import args_hash, encode_jsonable, to_jsonable
from .._exceptions import AgentKeyError, ConfigurationError, ToolError
from .._keys import StepKey
from .._plan import OnRepeat, PlanSession
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
)
from ._identity import CallSite, Seen
from ._settle import Chooser, Repeat

try:
    from google.adk.tools.base_tool import BaseTool
    from google.adk.tools.tool_context import ToolContext
    from google.genai import types
except ModuleNotFoundError as exc:  # pragma: no cover - exercised in a subprocess test
    raise missing_extra(exc, "google-adk", "google.adk", "google") from None

__all__ = ["call_step", "remote_tool", "session_plan"]

#: Where a call's record goes in the session's state: ``STATE_PREFIX + function_call_id``.
STATE_PREFIX = "agentkey:call:"

#: A plan session, or a callable choosing one from the call's ``ToolContext``.
PlanSource: TypeAlias = "PlanSession | Callable[[ToolContext], PlanSession]"
#: A step index, or a callable of the ``ToolContext``, tool name and normalised arguments.
StepIndexSource: TypeAlias = (
    "int | Sequence[int] | Callable[[ToolContext, str, Mapping[str, Any]], int | Sequence[int]]"
)


def session_plan(ctx: ToolContext) -> PlanSession:
    """The plan session of an ADK session: a UUIDv5 of its app name, user id and session id.

    Keep the session (a persistent session service) to resume after a crash: its
    calls get their keys again. A new conversation is a new session, and a new plan.
    """
    session = ctx.session
    if not session.id:
        raise ConfigurationError(
            "an ADK tool ran in a session without an id, so it has no plan session; run it "
            "through a Runner with a session service, or pass plan=PlanSession(...) to remote_tool"
        )
    return PlanSession.from_external_id(
        json.dumps(["google-adk", session.app_name, session.user_id, session.id])
    )


def call_step(ctx: ToolContext, tool: str, args: Mapping[str, Any]) -> tuple[int, int]:
    """``(slot, call)``: 32-bit numbers of the tool name and of the model's function call id."""
    if not ctx.function_call_id:
        raise ConfigurationError(
            f"tool {tool!r} ran without a function call id, so call_step cannot name its step; "
            "run it through an LlmAgent, or pass step_index= to remote_tool"
        )
    return code(tool), code(ctx.function_call_id)


class _RemoteTool(BaseTool):
    """An ADK tool whose declaration is ``schema`` and whose calls go to ``run``."""

    def __init__(
        self,
        *,
        name: str,
        description: str,
        schema: dict[str, Any],
        run: Callable[[ToolContext, dict[str, Any]], Any],
    ) -> None:
        super().__init__(name=name, description=description)
        self._schema, self._run = schema, run

    def _get_declaration(self) -> types.FunctionDeclaration:
        # ADK's documented hook for a custom BaseTool: the declaration the model reads.
        return types.FunctionDeclaration(
            name=self.name, description=self.description, parameters_json_schema=self._schema
        )

    async def run_async(self, *, args: dict[str, Any], tool_context: ToolContext) -> Any:
        return await self._run(tool_context, args)


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
) -> BaseTool:
    """An ADK ``BaseTool`` that sends each call through ``invoker`` with a deterministic key.

    ``plan`` defaults to :func:`session_plan`, ``step_index`` to
    :func:`call_step`; pass a value or a callable of the ``ToolContext`` to
    choose them yourself. Either way each call's key is settled against the
    invoker's journal and the session's events (module docstring).
    ``on_repeat`` says what a call the model already read the answer of gets
    when it is asked for again: ``"replay"`` (the default: the earlier answer,
    marked, nothing sent), ``"raise"`` (:class:`~agentkey.StepRepeated`) or
    ``"allow"`` (a new call).

    The model reads the tool's JSON body (a body that is not a JSON object as
    ``{"result": ...}``); a repeat reads ``{"result": "[repeat of step_…] …"}``.
    Arguments that do not fit ``args_schema``, and with ``errors_to_model`` a
    tool's own refusal (a 4xx that is not a key problem), go back to the model
    as ``{"error": ...}`` with the reason; every other agentkey error propagates
    and fails the invocation (resuming it is safe: the calls keep their keys).

    ADK awaits tools on its event loop: an :class:`~agentkey.AsyncToolInvoker` is
    called directly, a :class:`~agentkey.ToolInvoker` (and its journal) in a
    worker thread.
    """
    plan_source: PlanSource = session_plan if plan is None else plan
    step_source: StepIndexSource = call_step if step_index is None else step_index
    check_tool(name, description, args_schema, invoker)
    policy = check_sources(name, plan_source, step_source, on_repeat, "the ToolContext")
    options: dict[str, Any] = {"path": path, "method": method, "headers": headers}

    async def run(ctx: ToolContext, raw: dict[str, Any]) -> dict[str, Any]:
        try:
            values = to_jsonable(args_schema.model_validate(raw))
        except ValidationError as exc:
            return {
                "error": f"Tool {name!r} was not called: the arguments do not match "
                f"{args_schema.__name__} ({first_error(exc)}). Correct them and call again."
            }
        session = plan_source(ctx) if callable(plan_source) else plan_source
        if not isinstance(session, PlanSession):
            raise ConfigurationError(
                f"the plan callable of tool {name!r} returned {session!r}, not a PlanSession"
            )
        site = _site(ctx, session, name, values, args_schema)

        def derive() -> int | Sequence[int]:
            return step_source(ctx, name, site.values) if callable(step_source) else step_source

        rule = Chooser(
            site,
            args_hash=args_hash(values, profile=session.profile),
            on_repeat=policy,
            derive=derive,
            args_model=args_schema,
            unread="session id",
        )
        template = rule.template()
        identity: dict[str, Any] = {**options, "call_id": site.call_id, "context": site.context}
        try:
            if isinstance(invoker, AsyncToolInvoker):
                result = await invoker._invoke_identified(template, rule, **identity)
            else:
                result = await asyncio.to_thread(
                    invoker._invoke_identified, template, rule, **identity
                )
        except ToolError as exc:
            return {"error": refusal(name, exc, errors_to_model)}
        if isinstance(result, Pick):
            repeat: Repeat = result.answer
            _keep(ctx, repeat.record)
            return {"result": repeat.content}
        _keep(ctx, call_record(result, template))
        return _response(result)

    return _RemoteTool(
        name=name, description=description, schema=args_schema.model_json_schema(), run=run
    )


def _response(result: ToolResult) -> dict[str, Any]:
    """What the model reads: the JSON body (an object as is), after a marked repeat's note."""
    body: Any = result.body
    if result.repeat_of is not None:
        note = repeat_note(result.repeat_of, replayed=result.replayed)
        return {"result": note + json.dumps(body, ensure_ascii=False)}
    return body if isinstance(body, dict) else {"result": body}


def _keep(ctx: ToolContext, record: dict[str, Any]) -> None:
    """The call's record in the session's state (saved with the function response's event)."""
    if ctx.function_call_id:
        ctx.state[STATE_PREFIX + ctx.function_call_id] = record


def _text(response: Any) -> str | None:
    """What the model read of a function response; None for an error it read."""
    if not isinstance(response, Mapping):
        return json.dumps(response, ensure_ascii=False, default=str)
    if set(response) == {"error"}:
        return None
    if set(response) == {"result"} and isinstance(response["result"], str):
        return str(response["result"])
    return json.dumps(response, ensure_ascii=False, default=str)


def _visible(branch: str | None, event_branch: str | None) -> bool:
    """Whether an event on ``event_branch`` is in the history of an agent on ``branch``
    (ADK's rule: no branch, the same branch, or an ancestor's)."""
    if not branch or not event_branch:
        return True
    return branch == event_branch or branch.startswith(event_branch + ".")


def _site(
    ctx: ToolContext,
    plan: PlanSession,
    tool: str,
    values: Mapping[str, Any],
    schema: type[BaseModel],
) -> CallSite:
    """The call as the session's events show it (see ``_identity``).

    The events of this agent's branch (and its ancestors') are one message list; the
    calls of another branch are that branch's own (a list of its own), and their
    answers were never read here.
    """
    call_id = ctx.function_call_id or None
    branch = ctx.branch
    mine = encode_jsonable(to_jsonable(values), "python")
    siblings: tuple[str, ...] = ()
    position: tuple[int, int] | None = None
    answered: dict[str, str | None] = {}
    asked: dict[str, tuple[int, int]] = {}
    for place, event in enumerate(ctx.session.events):
        visible = _visible(branch, event.branch)
        where = (0 if visible else 1 + code(event.branch or ""), place)
        parts = event.content.parts if event.content is not None else None
        calls = [p.function_call for p in parts or () if p.function_call is not None]
        if call_id is not None and any(c.id == call_id for c in calls):
            position = where
            siblings = tuple(
                str(c.id)
                for c in calls
                if c.id == call_id or (c.name == tool and _normalised(c.args, schema) == mine)
            )
        for call in calls:
            if call.id:
                asked.setdefault(call.id, where)
        if not visible:
            continue
        for part in parts or ():
            response = part.function_response
            if response is not None and response.id:
                answered[response.id] = _text(response.response)
    if call_id is not None and siblings.count(call_id) > 1:
        raise ConfigurationError(
            f"tool {tool!r}: the model's response holds {siblings.count(call_id)} function calls "
            f"with the id {call_id!r}, so they cannot be told apart; give each call a unique "
            "id, or pass step_index="
        )
    return CallSite(
        plan=plan,
        tool=tool,
        values=values,
        call_id=call_id,
        siblings=siblings or ((call_id,) if call_id else ()),
        # ADK names no turn that two deliveries of one request share (each run_async draws
        # a new invocation id): the session is the conversation, and the plan already is.
        context=None,
        seen=Seen(answered, frozenset(), asked),
        position=position,
        known=_known(ctx, plan, tool, answered),
    )


def _known(
    ctx: ToolContext, plan: PlanSession, tool: str, answered: Mapping[str, str | None]
) -> dict[str, str]:
    """Keys the session's state records for answered calls of this tool and plan."""
    known: dict[str, str] = {}
    state = ctx.state
    for call_id, text in answered.items():
        if text is None:
            continue
        record = state.get(STATE_PREFIX + call_id)
        if not isinstance(record, Mapping) or record.get("tool") != tool:
            continue
        try:
            key = StepKey.parse(str(record.get("idempotency_key")))
        except AgentKeyError:
            continue
        if key.plan_session_id == plan.id:
            known[call_id] = key.format()
    return known


def _normalised(args: Any, schema: type[BaseModel]) -> bytes | None:
    """Another call's arguments as this tool would hash them, or None if they do not fit."""
    try:
        return encode_jsonable(to_jsonable(schema.model_validate(args or {})), "python")
    except (ValueError, AgentKeyError):  # ValidationError is a ValueError
        return None
