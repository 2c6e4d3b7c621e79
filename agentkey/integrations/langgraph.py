"""LangGraph: keys from the graph runtime and the journal; a recovered run repeats nothing.

LangGraph re-runs a node whenever its writes were not checkpointed (a node
retry, a resume after a crash, a resume after ``interrupt()``), and
applications recover in ways of their own: they re-send the user's request
after a crash, keep the history themselves and send it each turn, reuse a
thread id for a new conversation. :func:`remote_tool` gives each call of a
tool run by LangGraph's ``ToolNode`` a key that survives all of these. It reads
what the tool's ``ToolRuntime`` gives (the graph state, the config and the
tool call id: LangGraph's public injection) and the invoker's journal:

- plan session id (:func:`thread_plan`): a UUIDv5 of the ``thread_id``, the id
  of the conversation's first user message (``add_messages`` draws it when the
  conversation starts and the checkpoint keeps it; a system prompt defined once
  and reused is skipped, since it keeps one id across conversations), and, in
  a subgraph, the names of the nodes it runs under;
- step index (:func:`graph_step`): ``(slot, call)``, two 32-bit numbers of the
  tool node and tool name, and of the model's tool call id;
- the journal and the state then decide (``_identity``): the same call run
  again keeps its key; a call the model asks for again without ever having
  read its answer (a re-sent request after a crash, a re-asked model) gets the
  earlier call's key back, and its answer is marked as a repeat; a call the
  model asks for again after reading its answer follows ``on_repeat``.

In a ``@task`` of the Functional API (or a node of your own) the tool sees no
history: the plan is the thread, and an identical call another run on the
thread made (a request re-sent after a crash) gives its key, while one of the
same run is a new operation. A request re-sent as a new message after a crash
that saved nothing (``durability="exit"``) takes the key of the identical call
the journal shows the earlier run on the thread never settled.

Needs the ``langgraph`` extra (``pip install 'agentkey-idempotency[langgraph]'``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .._canonical import Profile, encode_jsonable, to_jsonable
from .._exceptions import AgentKeyError, ConfigurationError
from .._keys import StepKey
from .._plan import OnRepeat, PlanSession
from ..client._invoker import AsyncToolInvoker, ToolInvoker
from ._adapter import code, missing_extra
from ._identity import CallSite, Seen

try:
    import langgraph.prebuilt  # noqa: F401 - ToolNode injects the ToolRuntime we read
    from langchain_core.messages import (
        AIMessage,
        BaseMessage,
        HumanMessage,
        RemoveMessage,
        SystemMessage,
        ToolMessage,
    )
    from langchain_core.runnables import RunnableConfig, RunnableLambda
    from langchain_core.tools import BaseTool, StructuredTool
    from langgraph.graph.message import REMOVE_ALL_MESSAGES
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise missing_extra(exc, "langgraph", "langgraph", "langgraph", "langchain_core") from None

from pydantic import BaseModel, ValidationError

from .langchain import PlanSource, StepIndexSource, ToolCallContext, build_tool

__all__ = [
    "call_step",
    "graph_step",
    "pending_calls_hook",
    "remote_tool",
    "thread_plan",
]

# LangGraph's checkpoint namespace: "parent_node:<task id>|node:<task id>".
_NS_SEP = "|"
# add_messages gives a message without an id ``str(uuid4())``; chat models name theirs
# ``run-<uuid>``. An id a program chose ("system-prompt") says nothing of a lifetime.
_DRAWN_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.I)


def _require_state(ctx: ToolCallContext, what: str) -> Any:
    if ctx.state is None:
        raise ConfigurationError(
            f"tool {ctx.tool!r} ran without LangGraph's ToolRuntime, so {what} cannot read "
            "the graph state: run it through langgraph.prebuilt.ToolNode (create_react_agent "
            "and the prebuilt agents use it), or pass plan= and step_index= to remote_tool "
            "(e.g. step_index=call_step, which needs only the tool call id)"
        )
    return ctx.state


def thread_plan(ctx: ToolCallContext, *, profile: Profile = "python") -> PlanSession:
    """The plan session of one conversation on a LangGraph thread.

    A UUIDv5 of the ``thread_id``, the id of the first user message in the
    state (what tells one conversation on a reused thread id from the next),
    and the names of the nodes a subgraph runs under. A state without such a
    message (a ``Send`` payload built by hand) gives a plan of the thread id alone;
    its calls are then keyed by their own ids and never taken for earlier ones. Use
    ``functools.partial(thread_plan, profile="jcs")`` for the JCS profile.
    """
    configurable = ctx.config.get("configurable") or {}
    thread_id = configurable.get("thread_id")
    if thread_id is None or thread_id == "":
        raise ConfigurationError(
            f"tool {ctx.tool!r} has no plan session: the run config has no thread_id. "
            "Run the graph with config={'configurable': {'thread_id': ...}} (the thread id "
            "is what makes a resumed run reuse its keys), or pass plan=PlanSession(...) to "
            "remote_tool"
        )
    return _thread_plan(ctx, _lifetime(_require_state(ctx, "thread_plan")), profile)


def _thread_plan(ctx: ToolCallContext, lifetime: str | None, profile: Profile) -> PlanSession:
    thread_id = (ctx.config.get("configurable") or {}).get("thread_id")
    metadata = ctx.config.get("metadata") or {}
    namespace = metadata.get("langgraph_checkpoint_ns") or ""
    nodes = _parent_nodes(namespace if isinstance(namespace, str) else "")
    name = json.dumps(["langgraph/2", str(thread_id), lifetime, nodes])
    return PlanSession.from_external_id(name, profile=profile)


def graph_step(ctx: ToolCallContext) -> tuple[int, int]:
    """``(slot, call)``: 32-bit numbers of the tool node and tool name, and of the call id.

    The same call keeps its step wherever it runs again; two calls never share
    one (a later turn, a subgraph, a parallel branch: each call has its own id).
    """
    if ctx.tool_call_id is None:
        raise ConfigurationError(
            f"tool {ctx.tool!r} ran without a tool call id, so graph_step cannot name its "
            "step. Invoke it with the model's tool call, or through ToolNode, or pass "
            "step_index= to remote_tool"
        )
    metadata = ctx.config.get("metadata") or {}
    slot = code(json.dumps([str(metadata.get("langgraph_node") or ""), ctx.tool]))
    return slot, code(ctx.tool_call_id)


def call_step(ctx: ToolCallContext) -> tuple[int, int]:
    """``(slot, call)`` of the tool name and the call id: a step index usable anywhere."""
    if ctx.tool_call_id is None:
        raise ConfigurationError(
            f"tool {ctx.tool!r} ran without a tool call id; invoke it with the model's tool "
            "call ({'name': ..., 'args': ..., 'id': ..., 'type': 'tool_call'})"
        )
    return code(ctx.tool), code(ctx.tool_call_id)


def _in_thread(ctx: ToolCallContext) -> bool:
    """Whether the call runs inside a LangGraph run on a thread (a ``@task``, a node)."""
    thread_id = (ctx.config.get("configurable") or {}).get("thread_id")
    metadata = ctx.config.get("metadata") or {}
    return thread_id not in (None, "") and bool(metadata.get("langgraph_checkpoint_ns"))


def _task_plan(ctx: ToolCallContext) -> PlanSession:
    """The plan of a call made in a ``@task`` or a node of your own (no ToolRuntime): the
    thread (the Functional API keeps no message state the tool could read)."""
    if not _in_thread(ctx):
        _require_state(ctx, "remote_tool")  # raises: say what to pass
    return _thread_plan(ctx, None, "python")


def _blind_site(ctx: ToolCallContext, plan: PlanSession, on_repeat: OnRepeat) -> CallSite:
    """A call the runtime shows no history of, made in a ``@task`` (of the Functional API,
    or called from a node): its turn is the run of what called the task (the first part of
    its checkpoint namespace: the entrypoint's run, drawn anew for each request, kept on a
    resume). An identical call another turn on the thread made is taken as asked again (a
    request re-sent after a crash); one of this turn never is (two identical calls of one
    response are two operations). ``on_repeat="allow"`` (a read): every call is new. A call
    in a node of the graph itself keeps the rule of its call id alone."""
    namespace = str((ctx.config.get("metadata") or {}).get("langgraph_checkpoint_ns") or "")
    if not _in_thread(ctx) or _NS_SEP not in namespace:
        # A node of the graph itself (a Send worker: parallel ones are one turn, each its
        # own namespace): the call id alone, as before.
        return CallSite(plan, ctx.tool, ctx.args, ctx.tool_call_id)
    thread = str((ctx.config.get("configurable") or {}).get("thread_id"))
    return CallSite(
        plan=plan,
        tool=ctx.tool,
        values=ctx.args,
        call_id=ctx.tool_call_id,
        context=f"{thread}#{namespace.split(_NS_SEP)[0]}",
        seen=Seen(shown=False),
        adopt=on_repeat != "allow",
    )


def _site(ctx: ToolCallContext, plan: PlanSession) -> CallSite:
    """The call as the graph state shows it (see ``_identity``)."""
    state = _require_state(ctx, "remote_tool")
    thread = str((ctx.config.get("configurable") or {}).get("thread_id", ""))
    lists = _message_lists(state)
    message = _holder(state, ctx.tool_call_id or "")
    siblings: tuple[str, ...] = ()
    context: str | None = None
    if message is not None and ctx.tool_call_id is not None:
        _check_unique(message, ctx)
        siblings = tuple(_identical(message, ctx))
        context = _context_of(lists, message, thread)
    answered: dict[str, str | None] = {}
    known: dict[str, str] = {}
    contexts: set[str] = set()
    asked: dict[str, tuple[int, int]] = {}
    position: tuple[int, int] | None = None
    for number, messages in enumerate(lists):
        for place, item in enumerate(messages):
            if isinstance(item, AIMessage):
                if item is message:
                    position = (number, place)
                for requested in item.tool_calls:
                    asked.setdefault(str(requested.get("id")), (number, place))
            elif isinstance(item, ToolMessage) and item.tool_call_id:
                answered[item.tool_call_id] = None if item.status == "error" else _text(item)
                key = _key_of(item, ctx.tool, plan.id)
                if key is not None and item.status != "error":
                    known[item.tool_call_id] = key
            elif isinstance(item, HumanMessage) and isinstance(item.id, str):
                contexts.add(f"{thread}#{item.id}")
    return CallSite(
        plan=plan,
        tool=ctx.tool,
        values=ctx.args,
        call_id=ctx.tool_call_id,
        siblings=siblings,
        context=context,
        seen=Seen(answered, frozenset(contexts), asked),
        position=position,
        # No user message with a drawn id: nothing tells this conversation from another
        # on the same thread id, so no earlier call is taken for this one.
        adopt=_lifetime(state) is not None,
        fresh_thread=thread if position is not None and _first_answer(lists, position) else None,
        known=known,
    )


def _first_answer(lists: list[Sequence[Any]], position: tuple[int, int]) -> bool:
    """Whether the model response at ``position`` is the conversation's first."""
    number, place = position
    return not any(isinstance(m, AIMessage) for m in lists[number][:place])


def _text(message: ToolMessage) -> str:
    content = message.content
    return content if isinstance(content, str) else json.dumps(content)


def _key_of(message: ToolMessage, tool: str, plan_id: str) -> str | None:
    """The key an agentkey ToolMessage's artifact records, if it is this tool's and plan's."""
    artifact = message.artifact
    if message.name != tool or not isinstance(artifact, Mapping):
        return None
    try:
        key = StepKey.parse(str(artifact.get("idempotency_key")))
    except AgentKeyError:
        return None
    return key.format() if key.plan_session_id == plan_id else None


def _parent_nodes(namespace: str) -> list[str]:
    """The node names of a checkpoint namespace's parents, without their task ids."""
    parents = namespace.split(_NS_SEP)[:-1]
    return [part.partition(":")[0] for part in parents]


def _lifetime(state: Any) -> str | None:
    """The id of the conversation's first user message (any id: add_messages draws one,
    an application may give its own); else of its first other message with a drawn id.

    System messages never count: a prompt defined once and reused keeps the id
    add_messages gave it the first time, in every conversation.
    """
    drawn: str | None = None
    for messages in _message_lists(state):
        for message in messages:
            if not isinstance(message, BaseMessage) or isinstance(message, SystemMessage):
                continue
            if isinstance(message, HumanMessage) and isinstance(message.id, str) and message.id:
                return message.id
            if drawn is None and isinstance(message.id, str) and _DRAWN_ID.search(message.id):
                drawn = message.id
    return drawn


def _context_of(lists: list[Sequence[Any]], holder: AIMessage, thread: str) -> str | None:
    """``<thread>#<id>`` of the last user message before the model response ``holder``."""
    for messages in lists:
        last: str | None = None
        for message in messages:
            if message is holder:
                return last
            if isinstance(message, HumanMessage) and isinstance(message.id, str):
                last = f"{thread}#{message.id}"
    return None


def _holder(state: Any, tool_call_id: str) -> AIMessage | None:
    """The latest AIMessage in the state that holds this call's id."""
    for messages in _message_lists(state):
        for message in reversed(messages):
            if isinstance(message, AIMessage) and any(
                call.get("id") == tool_call_id for call in message.tool_calls
            ):
                return message
    return None


def _check_unique(message: AIMessage, ctx: ToolCallContext) -> None:
    count = [call.get("id") for call in message.tool_calls].count(ctx.tool_call_id)
    if count > 1:
        raise ConfigurationError(
            f"tool {ctx.tool!r}: the model's message holds {count} tool calls with the id "
            f"{ctx.tool_call_id!r}, so they cannot be told apart; give each tool call a "
            "unique id, or pass step_index= to remote_tool"
        )


def _identical(message: AIMessage, ctx: ToolCallContext) -> list[str]:
    """The ids of the calls of ``message`` identical to this one (tool and normalised args)."""
    mine = encode_jsonable(to_jsonable(ctx.args), "python")
    return [
        str(call.get("id"))
        for call in message.tool_calls
        if call.get("id") == ctx.tool_call_id
        or (call.get("name") == ctx.tool and _normalised(call.get("args"), ctx) == mine)
    ]


def _normalised(args: Any, ctx: ToolCallContext) -> bytes | None:
    """Another call's arguments as this tool would hash them, or None if they do not fit."""
    try:
        values = ctx.args_schema.model_validate(args) if ctx.args_schema else args
        return encode_jsonable(to_jsonable(values), "python")
    except (ValidationError, AgentKeyError):
        return None


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
    """A LangChain tool for LangGraph's ToolNode, keyed by the graph runtime and the journal.

    Same as :func:`agentkey.integrations.langchain.remote_tool`, with LangGraph
    defaults: ``plan`` is :func:`thread_plan`, ``step_index`` is
    :func:`graph_step`, and each call's key is settled against the invoker's
    journal and the graph state (module docstring). ``on_repeat`` decides what a
    call the model already saw answered gets when it is asked for again:
    ``"replay"`` (the default: the earlier answer, marked, nothing sent),
    ``"raise"`` or ``"allow"`` (a new call).
    """
    plan_source = thread_plan if plan is None else plan

    def identity(ctx: ToolCallContext) -> CallSite:
        if plan is None and ctx.state is None:  # a @task: the thread is the plan
            session = _task_plan(ctx)
        else:
            session = plan_source(ctx) if callable(plan_source) else plan_source
        if not isinstance(session, PlanSession):
            raise ConfigurationError(
                f"the plan callable of tool {name!r} returned {session!r}, not a PlanSession"
            )
        if ctx.state is None:  # a @task, your own node: no history to read
            return _blind_site(ctx, session, on_repeat)
        return _site(ctx, session)

    return build_tool(
        name=name,
        description=description,
        args_schema=args_schema,
        invoker=invoker,
        plan=plan_source,
        step_index=graph_step if step_index is None else step_index,
        options={"path": path, "method": method, "headers": headers},
        return_direct=return_direct,
        on_repeat=on_repeat,
        errors_to_model=errors_to_model,
        identity=identity,
    )


# --- after a crash: answer the calls a checkpoint left without an answer ----------------


_UNKNOWN = (
    "The outcome of this call is unknown: the run stopped while it was being made, and the "
    "tool does not say what happened. Check before asking for it again."
)
_NOT_MADE = (
    "This call was not made: the run stopped before it was sent. Ask for it again if it is "
    "still needed."
)


def pending_calls_hook(tools: Sequence[BaseTool]) -> RunnableLambda[Any, dict[str, Any]]:
    """A ``pre_model_hook`` that answers the tool calls a crash left without an answer.

    When a process dies after a tool ran and before its answer was checkpointed,
    the thread's history ends with the model's request and no answer. An
    application that recovers by sending the user's request again (not
    ``invoke(None)``) then makes the prebuilt agent refuse the history
    (``INVALID_CHAT_HISTORY``), or would have the model ask again. Give this hook
    to ``create_react_agent(..., pre_model_hook=pending_calls_hook(tools))``:
    before the model is asked, each unanswered call of an agentkey tool that the
    journal shows was sent is sent again under its first key (the tool, or the
    journal, answers with what happened: nothing runs twice), and its answer goes
    right after the request that asked for it. A call the journal never saw sent
    is answered "not made"; a call of another tool "outcome unknown".
    """
    by_name = {tool.name: tool for tool in tools}

    def plan(state: Any) -> list[tuple[int, Mapping[str, Any], BaseTool | None]]:
        """The unanswered calls: (position after which the answer goes, call, tool)."""
        messages = list(_message_lists(state)[0]) if _message_lists(state) else []
        answered = {m.tool_call_id for m in messages if isinstance(m, ToolMessage)}
        todo: list[tuple[int, Mapping[str, Any], BaseTool | None]] = []
        for position, message in enumerate(messages):
            if isinstance(message, AIMessage):
                todo.extend(
                    (position, call, by_name.get(str(call.get("name"))))
                    for call in message.tool_calls
                    if call.get("id") not in answered
                )
        return todo

    def rebuilt(state: Any, answers: Mapping[int, list[ToolMessage]]) -> dict[str, Any]:
        if not answers:
            return {}
        messages = list(_message_lists(state)[0])
        out: list[Any] = []
        for position, message in enumerate(messages):
            out.append(message)
            out += answers.get(position, [])
        return {"messages": [RemoveMessage(id=REMOVE_ALL_MESSAGES), *out]}

    def sync(state: Any, config: RunnableConfig) -> dict[str, Any]:
        answers: dict[int, list[ToolMessage]] = {}
        for position, call, tool in plan(state):
            answers.setdefault(position, []).append(_answer_sync(tool, call, state, config))
        return rebuilt(state, answers)

    async def asynchronous(state: Any, config: RunnableConfig) -> dict[str, Any]:
        answers: dict[int, list[ToolMessage]] = {}
        for position, call, tool in plan(state):
            message = await _answer_async(tool, call, state, config)
            answers.setdefault(position, []).append(message)
        return rebuilt(state, answers)

    return RunnableLambda(sync, afunc=asynchronous, name="agentkey_pending_calls")


def _maker(tool: BaseTool | None) -> Any:
    maker = getattr(tool, "agentkey_call", None) if tool is not None else None
    return maker if maker is not None and getattr(maker, "_identity", None) else None


def _unknown(call: Mapping[str, Any], text: str) -> ToolMessage:
    return ToolMessage(
        text, tool_call_id=str(call.get("id")), name=str(call.get("name")), status="error"
    )


def _answer_sync(
    tool: BaseTool | None, call: Mapping[str, Any], state: Any, config: Any
) -> ToolMessage:
    maker = _maker(tool)
    if maker is None:
        return _unknown(call, _UNKNOWN)
    pending = maker.context_of(call.get("args") or {}, config, str(call.get("id")), state)
    message: ToolMessage | None = maker.message(pending)
    return _unknown(call, _NOT_MADE) if message is None else message


async def _answer_async(
    tool: BaseTool | None, call: Mapping[str, Any], state: Any, config: Any
) -> ToolMessage:
    maker = _maker(tool)
    if maker is None:
        return _unknown(call, _UNKNOWN)
    pending = maker.context_of(call.get("args") or {}, config, str(call.get("id")), state)
    message: ToolMessage | None = await maker.amessage(pending)
    return _unknown(call, _NOT_MADE) if message is None else message
