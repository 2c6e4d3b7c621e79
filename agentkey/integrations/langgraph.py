"""LangGraph: keys from the graph runtime, so re-executed tool calls replay.

LangGraph re-runs a node whenever its writes were not checkpointed: a node
retry, a resume after a crash, a resume after ``interrupt()``. Every tool call
inside it runs again. :func:`remote_tool` gives such a call the key it had the
first time, derived from what LangGraph checkpoints, never from the model:

- plan session id (:func:`thread_plan`): a UUIDv5 of the run's ``thread_id``
  and the id of the first message in the thread's state. ``add_messages``
  gives that message a fresh random id when a conversation starts, and the
  checkpoint keeps it, so a resumed run keeps its plan while a new
  conversation under a reused ``thread_id`` (a lost checkpointer, a deleted
  thread, the tutorials' ``"1"``) gets a new one. Inside a subgraph the
  parent's checkpoint namespace is folded in as well;
- step index (:func:`graph_step`): ``(superstep, slot, ordinal)``, e.g.
  ``step_012.2840093214.000``. The superstep is the checkpointed superstep
  the tool runs in; the slot is a 32-bit number derived from the graph node
  and the tool's name, so two tools, or two tool nodes in parallel branches,
  never share a step; the ordinal numbers the call among the identical calls
  (same tool, same normalised arguments) of the ``AIMessage`` that asked for
  it, so a re-asked model that returns the same calls in another order keeps
  their keys, and two identical calls in one message still get two.

A call the model repeats at a later turn (same plan, tool and arguments as
an earlier successful ``ToolMessage`` in the state) follows the tool's
``on_repeat`` policy: by default it is answered with the earlier result,
marked as a repeat, and nothing is sent.

Needs the ``langgraph`` extra (``pip install 'agentkey-idempotency[langgraph]'``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .._canonical import Profile, encode_jsonable, to_jsonable
from .._exceptions import AgentKeyError, ConfigurationError
from .._invoker import AsyncToolInvoker, ToolInvoker
from .._keys import StepKey
from .._plan import OnRepeat, PlanSession, Step
from ._common import code, missing_extra

try:
    import langgraph.prebuilt  # noqa: F401 - ToolNode injects the ToolRuntime we read
    from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
    from langchain_core.tools import StructuredTool
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise missing_extra(exc, "langgraph", "langgraph", "langgraph", "langchain_core") from None

from pydantic import BaseModel, ValidationError

from .langchain import PlanSource, StepIndexSource, ToolCallContext, build_tool

__all__ = ["earlier_result", "graph_step", "remote_tool", "thread_plan"]

# LangGraph's checkpoint namespace separator: "parent_node:<task id>|node:<task id>".
_NS_SEP = "|"
# Where LangGraph puts a task's state reader in its config (used when no ToolNode injects
# the state, e.g. tool.invoke(tool_call) in a custom node). Read defensively.
_READ = "__pregel_read"


def thread_plan(ctx: ToolCallContext, *, profile: Profile = "python") -> PlanSession:
    """The plan session of one lifetime of a LangGraph thread.

    A UUIDv5 of the ``thread_id`` and the id of the first message of the
    thread's message list (given by ``add_messages`` when the conversation
    started, and checkpointed): a resumed run keeps it, a new conversation
    under a reused ``thread_id`` gets another. Inside a subgraph the parent's
    checkpoint namespace (which names the parent task deterministically) is
    folded in, since each subgraph run counts its supersteps from zero.

    When no message in the state has an id (a ``@task``, a ``Send`` payload
    built by hand) the plan rests on the ``thread_id`` alone, and
    :func:`graph_step` puts the tool call's id into the step instead.
    Use ``functools.partial(thread_plan, profile="jcs")`` for the JCS profile.
    """
    configurable = ctx.config.get("configurable") or {}
    thread_id = configurable.get("thread_id")
    if thread_id is None or thread_id == "":
        raise ConfigurationError(
            f"tool {ctx.tool!r} has no plan session: the run config has no thread_id. "
            "Compile the graph with a checkpointer and run it with "
            "config={'configurable': {'thread_id': ...}} (the thread id is what makes a "
            "resumed run reuse its keys), or pass plan=PlanSession(...) to remote_tool"
        )
    metadata = ctx.config.get("metadata") or {}
    namespace = metadata.get("langgraph_checkpoint_ns") or ""
    parent = namespace.rpartition(_NS_SEP)[0] if isinstance(namespace, str) else ""
    # A JSON list keeps the parts unambiguous whatever characters they hold.
    name = json.dumps(["langgraph", str(thread_id), _lifetime(_state(ctx)), parent])
    return PlanSession.from_external_id(name, profile=profile)


def graph_step(ctx: ToolCallContext) -> tuple[int, int, int]:
    """``(superstep, slot, ordinal)`` of a call run inside a LangGraph graph.

    The superstep is ``config["metadata"]["langgraph_step"]``, which LangGraph
    checkpoints. The slot is a 32-bit number derived from the node
    (``langgraph_node``) and the tool name. The ordinal counts the call among
    the calls of its ``AIMessage`` with the same tool and the same normalised
    arguments. All three are the same when the node runs again from a
    checkpoint, or when a re-asked model returns the same calls in another
    order. When no message in the state holds the call (a ``@task``), or no
    message has an id to tell this conversation from an earlier one under the
    same thread id, the ordinal is derived from the tool call's id instead,
    which the checkpointed message keeps.
    """
    metadata = ctx.config.get("metadata") or {}
    superstep = metadata.get("langgraph_step")
    if isinstance(superstep, bool) or not isinstance(superstep, int) or superstep < 0:
        raise ConfigurationError(
            f"tool {ctx.tool!r} is not running inside a LangGraph graph (no langgraph_step "
            "in its config), so graph_step cannot name the step. Run it in a graph node "
            "(a ToolNode, or tool.invoke(tool_call) in your own node or task), or pass "
            "step_index= (an int, a tuple or a callable) to remote_tool"
        )
    if ctx.tool_call_id is None:
        raise ConfigurationError(
            f"tool {ctx.tool!r} ran at superstep {superstep} without a tool call id, so "
            "graph_step cannot tell its calls apart. Invoke it with the model's tool call "
            "(tool.invoke({'name': ..., 'args': ..., 'id': ..., 'type': 'tool_call'})) or "
            "through langgraph.prebuilt.ToolNode, or pass step_index= to remote_tool"
        )
    slot = code(json.dumps([str(metadata.get("langgraph_node") or ""), ctx.tool]))
    state = _state(ctx)
    message = _holder(state, ctx.tool_call_id)
    if message is not None:
        _check_unique(message, ctx, superstep)
    if message is None or _lifetime(state) is None:
        # No message to count in, or no message id to tell this conversation from an
        # earlier one under the same thread id: the call's own id names it.
        return superstep, slot, code(ctx.tool_call_id)
    return superstep, slot, _ordinal(message, ctx)


def earlier_result(ctx: ToolCallContext, step: Step) -> tuple[str, Mapping[str, Any]] | None:
    """The earliest successful ``ToolMessage`` in the state that ``step`` repeats.

    Same tool, same plan, same arguments hash, another step: the model asked
    again for a call that already succeeded. Returns its content and artifact.
    """
    for messages in _message_lists(_state(ctx)):
        for message in messages:
            if not (
                isinstance(message, ToolMessage)
                and message.status != "error"
                and message.name == ctx.tool
                and isinstance(message.artifact, Mapping)
            ):
                continue
            try:
                key = StepKey.parse(str(message.artifact.get("idempotency_key")))
            except AgentKeyError:
                continue
            if (
                key.plan_session_id == step.plan_session_id
                and key.args_hash == step.key.args_hash
                and key.index != step.index
            ):
                content = message.content
                text = content if isinstance(content, str) else json.dumps(content)
                # The step label comes from the parsed key, not from what the artifact says.
                return text, {**message.artifact, "step": key.label}
    return None


def _state(ctx: ToolCallContext) -> Any:
    """The graph state: injected by ToolNode, else read from the task's config."""
    if ctx.state is not None:
        return ctx.state
    read = (ctx.config.get("configurable") or {}).get(_READ)
    if not callable(read):
        return None
    try:
        messages = read("messages")
    except Exception:  # no such channel (a @task, a state without messages): nothing to read
        return None
    return {"messages": messages} if isinstance(messages, list) else None


# LangGraph's add_messages gives a message without an id ``str(uuid4())``; chat models name
# theirs ``run-<uuid>``. An id a program chose (``"system-prompt"``) is the same in every
# conversation, so it cannot tell one lifetime of a thread from the next.
_DRAWN_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.I)


def _lifetime(state: Any) -> str | None:
    """The first randomly drawn message id in the state's message lists, messages first."""
    ids = (
        m.id
        for lst in _message_lists(state)
        for m in lst
        if _is_message(m) and isinstance(m.id, str) and _DRAWN_ID.search(m.id)
    )
    return next(ids, None)


def _holder(state: Any, tool_call_id: str) -> AIMessage | None:
    """The latest AIMessage in the state that holds this call's id."""
    for messages in _message_lists(state):
        for message in reversed(messages):
            if isinstance(message, AIMessage) and any(
                call.get("id") == tool_call_id for call in message.tool_calls
            ):
                return message
    return None


def _check_unique(message: AIMessage, ctx: ToolCallContext, superstep: int) -> None:
    count = [call.get("id") for call in message.tool_calls].count(ctx.tool_call_id)
    if count > 1:
        raise ConfigurationError(
            f"tool {ctx.tool!r} at superstep {superstep}: the model's message holds "
            f"{count} tool calls with the id {ctx.tool_call_id!r}, so they cannot be told "
            "apart; give each tool call a unique id, or pass step_index= to remote_tool"
        )


def _ordinal(message: AIMessage, ctx: ToolCallContext) -> int:
    mine = encode_jsonable(to_jsonable(ctx.args), "python")
    same = [
        call.get("id")
        for call in message.tool_calls
        if call.get("id") == ctx.tool_call_id
        or (call.get("name") == ctx.tool and _normalised(call.get("args"), ctx) == mine)
    ]
    return same.index(ctx.tool_call_id)


def _normalised(args: Any, ctx: ToolCallContext) -> bytes | None:
    """Another call's arguments as this tool would hash them, or None if they do not fit."""
    try:
        values = ctx.args_schema.model_validate(args) if ctx.args_schema else args
        return encode_jsonable(to_jsonable(values), "python")
    except (ValidationError, AgentKeyError):
        return None


def _is_message(value: object) -> bool:
    return isinstance(value, BaseMessage)


def _message_lists(state: Any) -> list[Sequence[Any]]:
    """The lists in the state that may hold messages, ``messages`` first."""
    if state is None:
        return []
    if isinstance(state, list):
        return [state]
    if isinstance(state, BaseModel):
        fields: Mapping[str, Any] = dict(state)
    elif isinstance(state, Mapping):
        fields = state
    else:
        fields = getattr(state, "__dict__", {})
    first = fields.get("messages")
    lists: list[Sequence[Any]] = [first] if isinstance(first, list) else []
    lists += [v for k, v in fields.items() if k != "messages" and isinstance(v, list)]
    return lists


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
    return_direct: bool = False,
    on_repeat: OnRepeat = "replay",
    errors_to_model: bool = True,
) -> StructuredTool:
    """A LangChain tool for LangGraph, keyed by the graph runtime.

    Same as :func:`agentkey.integrations.langchain.remote_tool`, with
    LangGraph defaults: ``plan`` is :func:`thread_plan` (an explicit
    ``PlanSession`` or callable wins) and ``step_index`` is :func:`graph_step`.
    It runs under ``ToolNode``, and also as ``tool.invoke(tool_call)`` in your
    own node, ``@task`` or ``Send`` worker. Repeats are found in the earlier
    ``ToolMessages`` of the state (:func:`earlier_result`) and handled by
    ``on_repeat`` (default ``"replay"``: the earlier result, marked, nothing sent).
    """
    return build_tool(
        name=name,
        description=description,
        args_schema=args_schema,
        invoker=invoker,
        plan=thread_plan if plan is None else plan,
        step_index=graph_step if step_index is None else step_index,
        options={"path": path, "method": method, "headers": headers},
        return_direct=return_direct,
        on_repeat=on_repeat,
        errors_to_model=errors_to_model,
        memory=earlier_result,
    )
