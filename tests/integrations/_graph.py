"""Real LangGraph pieces for the integration tests: a scripted model, a ToolNode graph, drivers."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command, Send, interrupt
from langgraph.types import RetryPolicy as NodeRetryPolicy
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentkey import AsyncToolInvoker, RetryPolicy, ToolInvoker
from agentkey.integrations.langgraph import remote_tool
from agentkey.server import IdempotencyMiddleware, MemoryStore, current_claim
from agentkey.testing import example_app
from tests._loopback import serve

__all__ = [
    "DRIVERS",
    "FAST",
    "LIMIT",
    "Command",
    "Crash",
    "Driver",
    "Order",
    "Recorder",
    "build_graph",
    "call",
    "close",
    "ledger_server",
    "make_invoker",
    "run",
    "running_server",
    "scripted",
    "tool_messages",
    "tools_for",
]

Driver = Literal["sync", "async"]
DRIVERS: tuple[Driver, ...] = ("sync", "async")
FAST = RetryPolicy(max_attempts=8, initial_backoff=0.01, max_backoff=0.05, max_retry_after=0.1)


class Order(BaseModel):
    """Arguments both example tools accept, so two tools can get identical args."""

    amount: int
    currency: str = "usd"
    region: str = "eu-west-1"


@contextmanager
def running_server() -> Iterator[tuple[str, Any]]:
    """agentkey's example tool server (MemoryStore) on loopback: (base URL, app)."""
    app = example_app(work_seconds=0.0)
    with serve(app) as url:
        yield url, app


LIMIT = 1000


def ledger_app() -> Starlette:
    """charge, refund and broken behind IdempotencyMiddleware, counting executions.

    ``charge`` and ``refund`` take the same arguments (``Order``), so one key
    sent to both would be answered with the other's result. ``charge`` refuses
    amounts over ``LIMIT`` with a problem detail ``amount over limit``;
    ``broken`` fails with 500 every time (an ambiguous answer).
    """
    executions: Counter[str] = Counter()

    def tool(name: str) -> Any:
        async def handler(request: Request) -> JSONResponse:
            args: dict[str, Any] = await request.json()
            if name == "broken":  # fails before its side effect: the claim is released
                executions[name] += 1
                return JSONResponse({"error": "internal"}, status_code=500)
            if name == "charge" and args.get("amount", 0) > LIMIT:
                return JSONResponse(
                    {
                        "type": "about:blank",
                        "title": "Payment Required",
                        "detail": "amount over limit",
                    },
                    status_code=402,
                )
            current_claim().begin_mutation()
            executions[name] += 1
            return JSONResponse({"id": f"{name}_{executions[name]:04d}", **args}, status_code=201)

        return handler

    app = Starlette(
        routes=[
            Route(f"/tools/{n}", tool(n), methods=["POST"]) for n in ("charge", "refund", "broken")
        ],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=MemoryStore(),
                routes=["/tools/*"],
                shared_key_space=True,
            )
        ],
    )
    app.state.executions = executions
    return app


@contextmanager
def ledger_server() -> Iterator[tuple[str, Any]]:
    """:func:`ledger_app` on loopback: (base URL, app)."""
    app = ledger_app()
    with serve(app) as url:
        yield url, app


def make_invoker(driver: Driver, base_url: str) -> ToolInvoker | AsyncToolInvoker:
    """An invoker of the driver's kind, routed to the example server's /tools/{tool}."""
    cls = ToolInvoker if driver == "sync" else AsyncToolInvoker
    return cls(base_url, route_template="/tools/{tool}", retry=FAST, hooks=())


def tools_for(
    invoker: ToolInvoker | AsyncToolInvoker, names: Sequence[str] = ("charge",), **options: Any
) -> list[Any]:
    """One agentkey tool per example-server tool name, LangGraph defaults for plan and step."""
    return [
        remote_tool(
            name=name,
            description=f"{name} an order",
            args_schema=Order,
            invoker=invoker,
            **options,
        )
        for name in names
    ]


def call(name: str, call_id: str, **args: Any) -> dict[str, Any]:
    """A tool call as a model emits it."""
    return {"name": name, "args": args, "id": call_id, "type": "tool_call"}


@dataclass
class Recorder:
    """A ToolNode wrapper: records each executed call's artifact; can crash or interrupt once."""

    crash_once: bool = False
    interrupt_once: bool = False
    artifacts: list[dict[str, Any]] = field(default_factory=list)
    _crashed: bool = False

    def _after(self, message: Any) -> Any:
        if isinstance(message, ToolMessage):
            self.artifacts.append(message.artifact)
        if self.crash_once and not self._crashed:
            self._crashed = True
            raise Crash("the process died after the tool ran, before the checkpoint")
        if self.interrupt_once:
            interrupt({"approve": message.content})
        return message

    def sync(self, request: ToolCallRequest, execute: Callable[[ToolCallRequest], Any]) -> Any:
        return self._after(execute(request))

    async def async_(
        self, request: ToolCallRequest, execute: Callable[[ToolCallRequest], Awaitable[Any]]
    ) -> Any:
        return self._after(await execute(request))


class Crash(RuntimeError):
    """Stands in for a process dying in the middle of a node."""


def build_graph(
    tools: Sequence[Any],
    model: GenericFakeChatModel,
    *,
    checkpointer: BaseCheckpointSaver[Any] | None,
    recorder: Recorder | None = None,
    node_retry: bool = False,
    fan_out: bool = False,
) -> Any:
    """agent -> tools -> agent ... with a scripted model and LangGraph's own ToolNode.

    ``fan_out`` sends each tool call to its own ToolNode task with ``Send`` (as
    ``create_react_agent(version="v2")`` does), instead of one task for all calls.
    """
    node = ToolNode(
        list(tools),
        wrap_tool_call=recorder.sync if recorder else None,
        awrap_tool_call=recorder.async_ if recorder else None,
    )

    def agent(state: MessagesState) -> dict[str, list[BaseMessage]]:
        return {"messages": [model.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node(
        "tools",
        node,
        retry_policy=NodeRetryPolicy(max_attempts=2, initial_interval=0.01, retry_on=Crash)
        if node_retry
        else None,
    )
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", send_each if fan_out else tools_condition, ["tools", END])
    graph.add_edge("tools", "agent")
    return graph.compile(checkpointer=checkpointer)


def send_each(state: MessagesState) -> Any:
    """Route every tool call of the last AIMessage to its own ToolNode task."""
    last = state["messages"][-1]
    if not isinstance(last, AIMessage) or not last.tool_calls:
        return END
    return [Send("tools", [tool_call]) for tool_call in last.tool_calls]


def scripted(*messages: AIMessage) -> GenericFakeChatModel:
    """A chat model that answers with the given messages, in order."""
    return GenericFakeChatModel(messages=iter(messages))


async def run(driver: Driver, graph: Any, graph_input: Any, config: Mapping[str, Any]) -> Any:
    """graph.invoke (in a worker thread) or graph.ainvoke, per driver."""
    if driver == "sync":
        return await asyncio.to_thread(graph.invoke, graph_input, config)
    return await graph.ainvoke(graph_input, config)


async def close(invoker: ToolInvoker | AsyncToolInvoker) -> None:
    """Close either kind of invoker."""
    if isinstance(invoker, AsyncToolInvoker):
        await invoker.aclose()
    else:
        invoker.close()


def tool_messages(state: dict[str, Any]) -> list[ToolMessage]:
    """The ToolMessages of a final graph state, in order."""
    return [m for m in state["messages"] if isinstance(m, ToolMessage)]
