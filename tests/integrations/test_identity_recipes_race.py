"""Issue 38: two copies of one recovery racing, for each framework's own recipe.

A job crashed after its charge was sent (or before, the model's request saved); its
recovery is delivered twice at once (a queue's duplicate delivery, a retried webhook),
and each copy recovers the way its framework's docs teach:

- PydanticAI: the saved ``message_history`` repaired (``repair_messages()``) and the
  user's prompt sent again, each copy's model naming the charge anew;
- LangGraph's Functional API: the user's request sent again on the thread;
- OpenAI Agents SDK: the message sent again in the conversation's ``Session``, each copy
  under a trace of its own linked to the session (``group_id``), after a process that
  was really killed mid-charge.

Each copy has its own invoker on one SQLite journal, and a
:class:`~tests.integrations._race.Gate` makes them reach the journal together. The tool
behind agentkey's middleware on loopback counts what it ran: one execution per job.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentkey import AsyncToolInvoker, ToolInvoker
from agentkey.journal import SQLiteJournal
from tests.integrations._race import ARGS, FAST, Charge, Gate, tool_server

pytestmark = pytest.mark.timeout(300)

#: 2 trials in the default suite; 10 behind the long marker.
TRIALS = pytest.mark.parametrize(
    "trials", [2, pytest.param(10, marks=[pytest.mark.long, pytest.mark.timeout(900)])]
)
PROMPT = "Charge my order."


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[SQLiteJournal]:
    journal = SQLiteJournal(tmp_path / "journal.sqlite3")
    yield journal
    journal.close()


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:12]}"


def _in_threads(copy: Callable[..., list[dict[str, Any]]], *args: Any) -> list[dict[str, Any]]:
    url, journal, *rest = args
    meeting = threading.Barrier(2)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(copy, url, Gate(journal, meeting), *rest) for _ in range(2)]
        return [r for f in futures for r in f.result()]


def _one_key(records: list[dict[str, Any]]) -> None:
    assert len(records) == 2, records
    assert len({r["idempotency_key"] for r in records}) == 1, records


# --- PydanticAI: a repaired history, the prompt sent again --------------------------------


def _crashed_history() -> list[Any]:
    """What a run that died mid-charge saved (ModelMessagesTypeAdapter, after each step):
    the prompt, and the model's request for the charge, never answered."""
    from pydantic_ai.messages import ModelRequest, ModelResponse, ToolCallPart, UserPromptPart

    run_id, conversation = str(uuid.uuid4()), str(uuid.uuid4())
    return [
        ModelRequest([UserPromptPart(PROMPT)], run_id=run_id, conversation_id=conversation),
        ModelResponse(
            [ToolCallPart("charge", dict(ARGS), _call_id())],
            run_id=run_id,
            conversation_id=conversation,
        ),
    ]


async def _pydantic_copy(url: str, journal: Any, history: list[Any]) -> list[dict[str, Any]]:
    from pydantic_ai import Agent
    from pydantic_ai.messages import (
        ModelMessage,
        ModelRequest,
        ModelResponse,
        TextPart,
        ToolCallPart,
        ToolReturnPart,
        UserPromptPart,
        repair_messages,
    )
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    from agentkey.integrations.pydantic_ai import remote_tool

    def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        done = False
        for m in messages:
            if isinstance(m, ModelRequest):
                if any(isinstance(p, UserPromptPart) for p in m.parts):
                    done = False
                done |= any(
                    isinstance(p, ToolReturnPart) and isinstance(p.metadata, dict)
                    and "idempotency_key" in p.metadata
                    for p in m.parts
                )  # fmt: skip
        if done:
            return ModelResponse(parts=[TextPart("Charged.")])
        return ModelResponse(parts=[ToolCallPart("charge", dict(ARGS), _call_id())])

    options: dict[str, Any] = {"route_template": "/tools/{tool}", "retry": FAST}
    async with AsyncToolInvoker(url, journal=journal, **options) as invoker:
        tool = remote_tool(name="charge", description="charge", args_schema=Charge, invoker=invoker)
        agent = Agent(FunctionModel(answer), tools=[tool])
        result = await agent.run(PROMPT, message_history=repair_messages(history))
    return [
        p.metadata
        for m in result.new_messages()
        for p in getattr(m, "parts", ())
        if isinstance(p, ToolReturnPart) and isinstance(p.metadata, dict)
    ]


@TRIALS
async def test_pydantic_ai_copies_of_a_repaired_history_charge_once(
    journal: SQLiteJournal, trials: int
) -> None:
    """PydanticAI, one crashed job's saved history repaired and its prompt re-sent by two
    copies at once, each model naming the charge anew: one charge per job, one key."""
    pytest.importorskip("pydantic_ai", reason="PydanticAI needs Python 3.11+")
    runs: list[int] = []
    with tool_server() as (url, tool):
        for _ in range(trials):
            before, history = tool.executions["charge"], _crashed_history()
            meeting = threading.Barrier(2)
            both = await asyncio.gather(
                *(_pydantic_copy(url, Gate(journal, meeting), history) for _ in range(2))
            )
            runs.append(tool.executions["charge"] - before)
            _one_key([r for copy in both for r in copy])
    assert runs == [1] * trials


# --- LangGraph's Functional API: the request sent again on the thread ----------------------


def _functional_copy(url: str, journal: Any, thread: str) -> list[dict[str, Any]]:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.func import entrypoint, task

    from agentkey.integrations.langgraph import remote_tool
    from tests.recovery._agent import ScriptedModel

    options: dict[str, Any] = {"route_template": "/tools/{tool}", "retry": FAST}
    with ToolInvoker(url, journal=journal, **options) as invoker:
        tool = remote_tool(name="charge", description="charge", args_schema=Charge, invoker=invoker)
        model = ScriptedModel()

        @task
        def call_model(messages: list[Any]) -> Any:
            return model.invoke(messages)

        @task
        def call_tool(call: dict[str, Any]) -> Any:
            return tool.invoke(call)

        @entrypoint(checkpointer=InMemorySaver())
        def agent(messages: list[Any]) -> list[Any]:
            response = call_model(messages).result()
            while response.tool_calls:
                results = [call_tool(c).result() for c in response.tool_calls]
                messages = [*messages, response, *results]
                response = call_model(messages).result()
            return [*messages, response]

        final = agent.invoke([HumanMessage(PROMPT)], {"configurable": {"thread_id": thread}})
    return [m.artifact for m in final if isinstance(m, ToolMessage)]


@TRIALS
def test_langgraph_functional_copies_of_one_request_charge_once(
    journal: SQLiteJournal, trials: int
) -> None:
    """LangGraph's Functional API, one request on one thread run twice at once (two threads),
    each model drawing its own call id: one charge per job, one key."""
    runs: list[int] = []
    with tool_server() as (url, tool):
        for _ in range(trials):
            before, thread = tool.executions["charge"], f"thread-{uuid.uuid4().hex[:8]}"
            records = _in_threads(_functional_copy, url, journal, thread)
            runs.append(tool.executions["charge"] - before)
            _one_key(records)
    assert runs == [1] * trials


# --- OpenAI Agents SDK: the message sent again in the session, after a real kill ----------


async def _session_copy(url: str, journal: Any, db: Path, session_id: str) -> list[dict[str, Any]]:
    from agents import Agent, RunConfig, Runner, SQLiteSession, gen_trace_id
    from agents.items import ToolCallOutputItem
    from agents.testing import ScriptedModel, assistant_message, function_call

    from agentkey.integrations.openai_agents import remote_tool

    model = ScriptedModel(
        [[function_call("charge", ARGS, call_id=_call_id())], [assistant_message("Charged.")]]
    )
    session = SQLiteSession(session_id, db)
    options: dict[str, Any] = {"route_template": "/tools/{tool}", "retry": FAST}
    try:
        async with AsyncToolInvoker(url, journal=journal, **options) as invoker:
            tool = remote_tool(
                name="charge", description="charge", args_schema=Charge, invoker=invoker
            )
            agent = Agent(name="shop", model=model, tools=[tool])
            config = RunConfig(trace_id=gen_trace_id(), group_id=session_id, tracing_disabled=True)
            result = await Runner.run(agent, PROMPT, run_config=config, session=session)
    finally:
        # Its connections, left to the collector, warn on Python 3.13 (ResourceWarning, an
        # error under this suite's filterwarnings) inside whichever test runs next.
        session.close()
    outputs = [i for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    return [dict(i.custom_data or {}) for i in outputs]


@pytest.mark.realtime
@TRIALS
async def test_openai_agents_copies_re_sent_in_one_session_charge_once(
    tmp_path: Path, trials: int
) -> None:
    """OpenAI Agents SDK: a run killed mid-charge (a real process), then its message re-sent
    in the session by two copies at once, each under a trace of its own linked to the
    session: one charge per job, one key."""
    from tests.recovery._process import recovery

    with recovery("tests.recovery._openai_agent", tmp_path) as job:
        journal = SQLiteJournal(job.journal)
        try:
            for trial in range(trials):
                db, session_id = tmp_path / f"session{trial}.sqlite3", f"conv-{trial}"
                killed = ["--trace-id", f"trace_{uuid.uuid4().hex}", "--session", str(db)]
                count = job.tool.executions["charge"] + 1
                job.tool.release.clear()  # the tool holds this trial's charge again
                job.killed(*killed, "--session-id", session_id, "--group", count=count)
                before = job.tool.executions["charge"]
                meeting = threading.Barrier(2)
                both = await asyncio.gather(
                    *(_session_copy(job.url, Gate(journal, meeting), db, session_id)
                      for _ in range(2))
                )  # fmt: skip
                assert job.tool.executions["charge"] == before  # the killed run's charge only
                _one_key([r for copy in both for r in copy])
        finally:
            journal.close()
    assert job.tool.executions["charge"] == trials
