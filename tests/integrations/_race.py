"""Two copies of one job racing: the copies, the journal gate that makes them meet, the server.

A copy is one run of an agent framework (or a plain loop, or an MCP session) doing
one charge, with the ids its job gives it: the same ``trace_id`` (OpenAI Agents
SDK), ``run_id`` (PydanticAI), thread and user message id (LangGraph), saved plan
(a LangChain tool, a plain loop, an MCP session). The model of each copy draws its
own tool call ids, as real models do. Each copy has its own invoker, on one journal.

:class:`Gate` holds each copy's first journal operation (the look-up, or the record)
until the other copy's has come too, so the two meet at the journal on every trial,
however the machine schedules them. The tool is :class:`~tests.journal._tools.PlainTool`
behind agentkey's middleware on loopback: it counts what it ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import traceback
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel

from agentkey import AsyncToolInvoker, PlanSession, RetryPolicy, ToolInvoker
from agentkey.journal import SQLiteJournal
from agentkey.server import IdempotencyMiddleware, MemoryStore
from tests._loopback import serve
from tests.journal._tools import PassThrough, PlainTool

__all__ = [
    "ARGS",
    "Charge",
    "Gate",
    "agents_copy",
    "chain_copy",
    "copies_in_a_process",
    "graph_copy",
    "loop_copy",
    "pydantic_copy",
    "tool_server",
]

FAST = RetryPolicy(initial_backoff=0.01, max_backoff=0.05, deadline=30.0)
ARGS = {"amount": 5, "currency": "EUR"}


class Charge(BaseModel):
    """Charge the customer."""

    amount: int
    currency: str = "EUR"


class Meeting(Protocol):
    def wait(self, timeout: float | None = None) -> int: ...


class Gate(PassThrough):
    """A real journal whose first ``begin`` or ``find`` waits until the other copy's comes:
    the two copies of one job reach the journal together, on every trial."""

    def __init__(self, inner: Any, meeting: Meeting) -> None:
        super().__init__(inner)
        self.meeting, self.met = meeting, False

    def _meet(self) -> None:
        if self.met:
            return
        self.met = True
        with contextlib.suppress(threading.BrokenBarrierError):  # the other never came: go on
            self.meeting.wait(10)

    def begin(self, record: Any, **options: Any) -> Any:
        self._meet()
        return self.inner.begin(record, **options)

    def find(self, plan: str, **options: Any) -> Any:
        self._meet()
        return self.inner.find(plan, **options)

    async def abegin(self, record: Any, **options: Any) -> Any:
        await asyncio.to_thread(self._meet)
        return await self.inner.abegin(record, **options)

    async def afind(self, plan: str, **options: Any) -> Any:
        await asyncio.to_thread(self._meet)
        return await self.inner.afind(plan, **options)


@contextmanager
def tool_server(*, middleware: bool = True) -> Iterator[tuple[str, PlainTool]]:
    """The counting tool behind agentkey's middleware (or bare: a tool that does not honour
    keys), on loopback."""
    tool = PlainTool()
    app: Any = tool
    if middleware:
        app = IdempotencyMiddleware(
            tool, store=MemoryStore(), routes=["/tools/*"], shared_key_space=True
        )
    with serve(app) as url:
        yield url, tool


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:12]}"


# --- the copies: each returns the records of its tool answers -----------------------------


async def agents_copy(url: str, journal: Any, trace_id: str) -> list[dict[str, Any]]:
    """An OpenAI Agents SDK run with ``trace_id``; its model asks for one charge."""
    from agents import Agent, RunConfig, Runner
    from agents.items import ToolCallOutputItem
    from agents.testing import ScriptedModel, assistant_message, function_call

    from agentkey.integrations.openai_agents import remote_tool

    model = ScriptedModel(
        [[function_call("charge", ARGS, call_id=_call_id())], [assistant_message("Charged.")]]
    )
    options: dict[str, Any] = {"route_template": "/tools/{tool}", "retry": FAST}
    async with AsyncToolInvoker(url, journal=journal, **options) as invoker:
        tool = remote_tool(name="charge", description="charge", args_schema=Charge, invoker=invoker)
        agent = Agent(name="shop", model=model, tools=[tool])
        config = RunConfig(trace_id=trace_id, tracing_disabled=True)
        result = await Runner.run(agent, "Charge my order.", run_config=config)
    outputs = [i for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    return [dict(i.custom_data or {}) for i in outputs]


async def pydantic_copy(url: str, journal: Any, run_id: str) -> list[dict[str, Any]]:
    """A PydanticAI run with ``run_id``; its model asks for one charge."""
    from pydantic_ai import Agent
    from pydantic_ai.messages import (
        ModelMessage,
        ModelRequest,
        ModelResponse,
        TextPart,
        ToolCallPart,
        ToolReturnPart,
    )
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    from agentkey.integrations.pydantic_ai import remote_tool

    def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if any(
            isinstance(p, ToolReturnPart)
            for m in messages
            if isinstance(m, ModelRequest)
            for p in m.parts
        ):
            return ModelResponse(parts=[TextPart("Charged.")])
        return ModelResponse(parts=[ToolCallPart("charge", dict(ARGS), _call_id())])

    options: dict[str, Any] = {"route_template": "/tools/{tool}", "retry": FAST}
    async with AsyncToolInvoker(url, journal=journal, **options) as invoker:
        tool = remote_tool(name="charge", description="charge", args_schema=Charge, invoker=invoker)
        agent = Agent(FunctionModel(answer), tools=[tool])
        result = await agent.run("Charge my order.", run_id=run_id)
    return [
        p.metadata
        for m in result.all_messages()
        for p in getattr(m, "parts", ())
        if isinstance(p, ToolReturnPart)
    ]


def graph_copy(url: str, journal: Any, thread: str, message_id: str) -> list[dict[str, Any]]:
    """LangGraph's prebuilt agent on ``thread`` (a checkpointer of its own), sent the user's
    message with ``message_id``; its model asks for one charge."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langgraph.checkpoint.memory import InMemorySaver

    from agentkey.integrations.langgraph import remote_tool
    from tests.recovery._agent import ScriptedModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # create_react_agent's move to langchain.agents
        from langgraph.prebuilt import create_react_agent

    options: dict[str, Any] = {"route_template": "/tools/{tool}", "retry": FAST}
    with ToolInvoker(url, journal=journal, **options) as invoker:
        tool = remote_tool(name="charge", description="charge", args_schema=Charge, invoker=invoker)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            agent = create_react_agent(ScriptedModel(), [tool], checkpointer=InMemorySaver())
        message = HumanMessage("Charge my order.", id=message_id)
        config: Any = {"configurable": {"thread_id": thread}}
        final = agent.invoke({"messages": [message]}, config)
    return [m.artifact for m in final["messages"] if isinstance(m, ToolMessage)]


def chain_copy(url: str, journal: Any, saved_plan: str) -> list[dict[str, Any]]:
    """A LangChain tool on the job's saved plan, its step from the model's tool call id."""
    from agentkey.integrations._adapter import code
    from agentkey.integrations.langchain import remote_tool

    options: dict[str, Any] = {"route_template": "/tools/{tool}", "retry": FAST}
    with ToolInvoker(url, journal=journal, **options) as invoker:
        tool = remote_tool(
            name="charge",
            description="charge",
            args_schema=Charge,
            invoker=invoker,
            plan=PlanSession.from_json(saved_plan),
            step_index=lambda ctx: (code(ctx.tool), code(ctx.tool_call_id or "")),
        )
        message = tool.invoke(
            {"name": "charge", "args": ARGS, "id": _call_id(), "type": "tool_call"}
        )
    return [message.artifact]


def loop_copy(url: str, journal: Any, saved_plan: str) -> list[dict[str, Any]]:
    """A plain agent loop on the job's saved plan: step 1 is the charge."""
    options: dict[str, Any] = {"route_template": "/tools/{tool}", "retry": FAST}
    with ToolInvoker(url, journal=journal, **options) as invoker:
        step = PlanSession.from_json(saved_plan).step(1, "charge", ARGS)
        result = invoker.invoke(step)
    return [result.model_dump(mode="json", exclude={"headers", "body"})]


def copies_in_a_process(
    framework: str,
    url: str,
    journal_path: str,
    meeting: Meeting,
    job_ids: list[str],
    table: str | None = None,
    failure: str | None = None,
) -> None:
    """A process running one copy of each job in ``job_ids`` (its trace id, run id, or thread
    and message id), one after the other; the other process runs the other copies
    (``multiprocessing`` target). Each copy opens the shared SQLite journal file itself, or
    with ``table``, a PostgresJournal on that table of the database ``journal_path`` names.
    A copy that fails writes its traceback to the file ``failure`` (the test shows it)."""
    try:
        _copies(framework, url, journal_path, meeting, job_ids, table)
    except BaseException:
        if failure is not None:
            Path(failure).write_text(traceback.format_exc())
        raise


def _copies(
    framework: str,
    url: str,
    journal_path: str,
    meeting: Meeting,
    job_ids: list[str],
    table: str | None,
) -> None:
    for job_id in job_ids:
        journal: Any
        if table is None:
            journal = SQLiteJournal(Path(journal_path))
        else:
            from agentkey.journal import PostgresJournal

            journal = PostgresJournal(journal_path, table=table)
        gate = Gate(journal, meeting)

        async def closing(copy: Any, journal: Any = journal) -> None:
            try:
                await copy
            finally:
                await journal.aclose()  # its asyncio pool belongs to this loop

        try:
            if framework == "openai-agents":
                trace_id = f"trace_{job_id.replace('-', '')}"
                asyncio.run(closing(agents_copy(url, gate, trace_id)))
            elif framework == "pydantic-ai":
                asyncio.run(closing(pydantic_copy(url, gate, job_id)))
            else:
                graph_copy(url, gate, f"thread-{job_id}", job_id)
        finally:
            journal.close()
