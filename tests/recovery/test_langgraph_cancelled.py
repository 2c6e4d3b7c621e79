"""Issue 23, case 1 in one process, on the async path: a run cancelled after the tool ran.

A web app runs the agent with ``ainvoke`` under a request timeout; the timeout cancels the
run after the charge reached the tool and before its answer was checkpointed. The app then
sends the user's request again on the same thread. ``pending_calls_hook`` answers the
unanswered call from its first key (the middleware replays it): one charge, on the
``AsyncToolInvoker`` and on a sync ``ToolInvoker`` driven from ``ainvoke``.
"""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver

from agentkey import AsyncToolInvoker, RetryPolicy, ToolInvoker
from agentkey.integrations.langgraph import pending_calls_hook, remote_tool
from agentkey.server import IdempotencyMiddleware, MemoryStore
from tests._loopback import serve
from tests.journal._tools import PlainTool
from tests.recovery._agent import Charge, ScriptedModel

pytestmark = [pytest.mark.realtime, pytest.mark.timeout(120)]

TEXT = "Charge my order: 5 EUR."


def _agent(invoker: Any, saver: InMemorySaver) -> Any:
    warnings.simplefilter("ignore")  # create_react_agent's move to langchain.agents
    from langgraph.prebuilt import create_react_agent

    tools = [remote_tool(name="charge", description="charge", args_schema=Charge, invoker=invoker)]
    return create_react_agent(
        ScriptedModel(), tools, checkpointer=saver, pre_model_hook=pending_calls_hook(tools)
    )


async def _cancelled_then_resent(tool: PlainTool, url: str, kind: str) -> list[Any]:
    retry = RetryPolicy(initial_backoff=0.01, max_backoff=0.05)
    options: dict[str, Any] = {"route_template": "/tools/{tool}", "retry": retry, "timeout": 30}
    invoker: Any = (
        AsyncToolInvoker(url, **options) if kind == "async" else ToolInvoker(url, **options)
    )
    saver = InMemorySaver()
    agent = _agent(invoker, saver)
    config: RunnableConfig = {"configurable": {"thread_id": f"thread-{kind}"}}
    tool.modes["charge"] = "hold"
    run = asyncio.ensure_future(
        agent.ainvoke({"messages": [HumanMessage(TEXT)]}, config, durability="sync")
    )
    assert await asyncio.to_thread(tool.ran.wait, 60), "the call never reached the tool"
    run.cancel()  # the request timeout: the answer never reaches the checkpoint
    with pytest.raises(asyncio.CancelledError):
        await run
    tool.release.set()  # the tool finishes; its answer goes to a closed connection
    tool.modes["charge"] = "ok"
    state = await agent.aget_state(config)
    dangling = [m for m in state.values["messages"] if isinstance(m, AIMessage) and m.tool_calls]
    assert dangling, "durability='sync' checkpointed the model's request before the tool ran"
    assert not any(isinstance(m, ToolMessage) for m in state.values["messages"])
    final = await agent.ainvoke({"messages": [HumanMessage(TEXT)]}, config)
    if kind == "async":
        await invoker.aclose()
    else:
        invoker.close()
    answers = [m for m in final["messages"] if isinstance(m, ToolMessage)]
    assert answers[0].tool_call_id == dangling[0].tool_calls[0]["id"]
    return answers


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_a_cancelled_run_resent_charges_once(kind: str) -> None:
    """The unanswered call is answered from its first key: replayed, and one charge only."""
    tool = PlainTool()
    app = IdempotencyMiddleware(
        tool, store=MemoryStore(), routes=["/tools/*"], shared_key_space=True
    )
    with serve(app) as url:
        first, *later = asyncio.run(_cancelled_then_resent(tool, url, kind))
    assert first.artifact["replayed"] is True
    # The model, reading the user's request again, may ask again: a marked repeat.
    assert all(m.artifact["repeat_of"] == first.artifact["step"] for m in later)
    assert tool.executions["charge"] == 1
