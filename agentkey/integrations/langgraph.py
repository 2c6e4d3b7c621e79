"""LangGraph: keys from the graph runtime, so re-executed tool calls replay.

LangGraph re-runs a node whenever its writes were not checkpointed: a node
retry, a resume after a crash, a resume after ``interrupt()``. Every tool call
inside it runs again. :func:`remote_tool` gives such a call the key it had the
first time, derived from what LangGraph checkpoints, never from the model:

- plan session id: the run's ``thread_id``
  (:meth:`~agentkey.PlanSession.from_external_id`); inside a subgraph the
  parent's checkpoint namespace is folded in, so two runs of one subgraph in
  the same thread do not share steps;
- step index: ``(superstep, position)``, e.g. ``step_012.001``: the
  checkpointed superstep the tool node runs in, and the position of this
  call's id among the ``tool_calls`` of the ``AIMessage`` that asked for it.

So a re-executed call (same superstep, same message) gets the same key and the
server replays its stored answer; a second call in the same message gets
another position, and a later model turn another superstep.

Needs the ``langgraph`` extra (``pip install 'agentkey-idempotency[langgraph]'``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .._canonical import Profile
from .._exceptions import ConfigurationError, MissingExtra
from .._invoker import AsyncToolInvoker, ToolInvoker
from .._plan import PlanSession

try:
    import langgraph.prebuilt  # noqa: F401 - ToolNode injects the ToolRuntime we read
    from langchain_core.messages import AIMessage
    from langchain_core.tools import StructuredTool
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    if (exc.name or "").partition(".")[0] not in ("langgraph", "langchain_core"):
        raise
    raise MissingExtra("langgraph", "langgraph") from None

from pydantic import BaseModel

from .langchain import PlanSource, StepIndexSource, ToolCallContext
from .langchain import remote_tool as _langchain_remote_tool

__all__ = ["graph_step", "remote_tool", "thread_plan"]

# LangGraph's checkpoint namespace separator: "parent_node:<task id>|node:<task id>".
_NS_SEP = "|"


def thread_plan(ctx: ToolCallContext, *, profile: Profile = "python") -> PlanSession:
    """The plan session of a LangGraph run: its ``thread_id`` (plus the parent namespace).

    At the root graph the plan id is the ``thread_id`` itself when it is a
    valid plan id, else a UUIDv5 of it. Inside a subgraph the parent's
    checkpoint namespace (which names the parent task deterministically) is
    folded in, since each subgraph run counts its supersteps from zero.
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
    if not parent:
        return PlanSession.from_external_id(str(thread_id), profile=profile)
    # A JSON list keeps (thread, parent) unambiguous whatever characters either holds.
    nested = json.dumps(["langgraph-subgraph", str(thread_id), parent])
    return PlanSession.from_external_id(nested, profile=profile)


def graph_step(ctx: ToolCallContext) -> tuple[int, int]:
    """``(superstep, position)`` of a call run by LangGraph's ``ToolNode``.

    The superstep is ``config["metadata"]["langgraph_step"]``, which LangGraph
    checkpoints; the position is the index of the call's ``tool_call_id``
    among the ``tool_calls`` of the latest ``AIMessage`` in the graph state
    that contains it. Both are the same when the node runs again from a
    checkpoint, and they differ between calls.
    """
    metadata = ctx.config.get("metadata") or {}
    superstep = metadata.get("langgraph_step")
    if isinstance(superstep, bool) or not isinstance(superstep, int) or superstep < 0:
        raise ConfigurationError(
            f"tool {ctx.tool!r} is not running inside a LangGraph graph (no langgraph_step "
            "in its config), so graph_step cannot name the step. Run it through "
            "langgraph.prebuilt.ToolNode, or pass step_index= (an int, a tuple or a "
            "callable) to remote_tool"
        )
    if ctx.tool_call_id is None or ctx.state is None:
        raise ConfigurationError(
            f"tool {ctx.tool!r} ran at superstep {superstep} without a tool call id and "
            "graph state: graph_step needs the call to come from "
            "langgraph.prebuilt.ToolNode, which injects them. Call tools through a "
            "ToolNode, or pass step_index= to remote_tool"
        )
    return superstep, _position(ctx.state, ctx.tool_call_id, ctx.tool, superstep)


def _position(state: Any, tool_call_id: str, tool: str, superstep: int) -> int:
    for messages in _message_lists(state):
        for message in reversed(messages):
            if not isinstance(message, AIMessage):
                continue
            ids = [call.get("id") for call in message.tool_calls]
            if tool_call_id not in ids:
                continue
            if ids.count(tool_call_id) > 1:
                raise ConfigurationError(
                    f"tool {tool!r} at superstep {superstep}: the model's message holds "
                    f"{ids.count(tool_call_id)} tool calls with the id {tool_call_id!r}, so "
                    "their positions (and keys) cannot be told apart; give each tool call "
                    "a unique id, or pass step_index= to remote_tool"
                )
            return ids.index(tool_call_id)
    raise ConfigurationError(
        f"tool {tool!r} at superstep {superstep}: no AIMessage in the graph state holds "
        f"the tool call id {tool_call_id!r}, so its position is unknown; keep the model's "
        "messages in the state ToolNode reads, or pass step_index= to remote_tool"
    )


def _message_lists(state: Any) -> list[Sequence[Any]]:
    """The lists in the state that may hold messages, ``messages`` first."""
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
) -> StructuredTool:
    """A LangChain tool for LangGraph's ``ToolNode``, keyed by the graph runtime.

    Same as :func:`agentkey.integrations.langchain.remote_tool`, with
    LangGraph defaults: ``plan`` is :func:`thread_plan` (an explicit
    ``PlanSession`` or callable wins) and ``step_index`` is :func:`graph_step`.
    """
    return _langchain_remote_tool(
        name=name,
        description=description,
        args_schema=args_schema,
        invoker=invoker,
        plan=thread_plan if plan is None else plan,
        step_index=graph_step if step_index is None else step_index,
        path=path,
        method=method,
        headers=headers,
        return_direct=return_direct,
    )
