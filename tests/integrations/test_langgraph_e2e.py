"""LangGraph end to end: real graphs, ToolNode, InMemorySaver, the example server on loopback.

Every scenario runs twice, from one table: ``graph.invoke`` with a
ToolInvoker and ``graph.ainvoke`` with an AsyncToolInvoker.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph

from agentkey import ConfigurationError, StepKey
from agentkey.integrations._adapter import code
from tests.integrations._graph import (
    DRIVERS,
    Command,
    Crash,
    Driver,
    Recorder,
    build_graph,
    call,
    close,
    make_invoker,
    run,
    running_server,
    scripted,
    tool_messages,
    tools_for,
)

pytestmark = pytest.mark.timeout(60)

HELLO = {"messages": [HumanMessage("charge the order")]}


@pytest.fixture
def server() -> Iterator[tuple[str, Any]]:
    """A fresh example server per test, so execution counts start at zero."""
    with running_server() as running:
        yield running


def _config(thread: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread}}


def _key(artifact: dict[str, Any]) -> StepKey:
    return StepKey.parse(artifact["idempotency_key"])


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("fan_out", [False, True], ids=["one task", "send per call"])
@pytest.mark.parametrize("failure", ["process crash and resume", "node retry", "interrupt"])
async def test_reexecuted_tool_node_replays(
    driver: Driver, failure: str, fan_out: bool, server: tuple[str, Any]
) -> None:
    """A tool node run again after the tool ran resends the same key; the server replays."""
    if failure == "interrupt" and driver == "async" and sys.version_info < (3, 11):
        pytest.skip(
            "LangGraph's interrupt() inside an async ToolNode needs contextvars to follow "
            "asyncio tasks, which Python 3.10 does not do (a LangGraph limitation)"
        )
    url, app = server
    model = scripted(AIMessage("", tool_calls=[call("charge", "c1", amount=5)]), AIMessage("done"))
    saver = InMemorySaver()
    recorder = Recorder(crash_once=failure != "interrupt", interrupt_once=failure == "interrupt")
    config = _config(f"t-{driver}-{failure.split()[0]}-{fan_out}")
    invoker = make_invoker(driver, url)
    graph = build_graph(
        tools_for(invoker),
        model,
        checkpointer=saver,
        recorder=recorder,
        node_retry=failure == "node retry",
        fan_out=fan_out,
    )
    if failure == "process crash and resume":
        with pytest.raises(Crash):
            await run(driver, graph, HELLO, config)
        await close(invoker)
        # A new process: new invoker and graph, the same checkpointer and thread.
        invoker = make_invoker(driver, url)
        recorder.crash_once = False
        graph = build_graph(
            tools_for(invoker), model, checkpointer=saver, recorder=recorder, fan_out=fan_out
        )
        final = await run(driver, graph, None, config)
    elif failure == "interrupt":
        first = await run(driver, graph, HELLO, config)
        assert "__interrupt__" in first
        recorder.interrupt_once = False
        final = await run(driver, graph, Command(resume="approved"), config)
    else:
        final = await run(driver, graph, HELLO, config)
    await close(invoker)

    first_run, second_run = recorder.artifacts
    assert first_run["outcome"] == "executed"
    assert second_run["outcome"] == "replayed"
    assert first_run["idempotency_key"] == second_run["idempotency_key"]
    assert app.state.executions["charge"] == 1
    (message,) = tool_messages(final)
    assert message.artifact["replayed"] is True
    assert message.artifact["idempotency_key"] == first_run["idempotency_key"]
    key = _key(message.artifact)
    assert key.plan_session_id != config["configurable"]["thread_id"]  # thread + lifetime
    assert key.index[1] == code("c1")  # the step is the model's call id's: (slot, call)


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("fan_out", [False, True], ids=["one task", "send per call"])
async def test_two_tools_with_identical_args_in_one_message_both_run(
    driver: Driver, fan_out: bool, server: tuple[str, Any]
) -> None:
    """Two different tools called with identical args in one AIMessage get different keys."""
    url, app = server
    args = {"amount": 5, "currency": "usd", "region": "eu-west-1"}
    model = scripted(
        AIMessage("", tool_calls=[call("charge", "c1", **args), call("provision", "c2", **args)]),
        AIMessage("done"),
    )
    invoker = make_invoker(driver, url)
    graph = build_graph(
        tools_for(invoker, ("charge", "provision")),
        model,
        checkpointer=InMemorySaver(),
        fan_out=fan_out,
    )
    final = await run(driver, graph, HELLO, _config(f"pair-{driver}"))
    await close(invoker)

    charge, provision = (_key(m.artifact) for m in tool_messages(final))
    assert charge.args_hash == provision.args_hash  # identical arguments ...
    assert charge.index != provision.index  # ... but each call has its own step
    assert dict(app.state.executions) == {"charge": 1, "provision": 1}  # ... both executed
    assert not any(m.artifact["replayed"] for m in tool_messages(final))


@pytest.mark.parametrize("driver", DRIVERS)
async def test_new_model_turns_execute_anew(driver: Driver, server: tuple[str, Any]) -> None:
    """A later model turn is a new step: changed args run, and same args too under "allow"."""
    url, app = server
    model = scripted(
        AIMessage("", tool_calls=[call("charge", "c1", amount=5)]),
        AIMessage("", tool_calls=[call("charge", "c2", amount=7)]),
        AIMessage("done"),
        AIMessage("", tool_calls=[call("charge", "c3", amount=7)]),
        AIMessage("done again"),
    )
    invoker = make_invoker(driver, url)
    tools = tools_for(invoker, on_repeat="allow")
    graph = build_graph(tools, model, checkpointer=InMemorySaver())
    config = _config(f"turns-{driver}")
    await run(driver, graph, HELLO, config)
    final = await run(driver, graph, {"messages": [HumanMessage("once more")]}, config)
    await close(invoker)

    keys = [_key(m.artifact) for m in tool_messages(final)]
    assert [k.index[1] for k in keys] == [code("c1"), code("c2"), code("c3")]  # one per call
    assert keys[2].index[0] == keys[1].index[0]  # same tool node and tool: same slot
    assert keys[0].args_hash != keys[1].args_hash
    assert keys[1].args_hash == keys[2].args_hash
    assert len({k.format() for k in keys}) == 3
    assert app.state.executions["charge"] == 3


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("on_repeat", ["replay", "allow"])
async def test_a_call_repeated_inside_a_subgraph_is_a_repeat(
    driver: Driver, on_repeat: str, server: tuple[str, Any]
) -> None:
    """Issue 23 case 4: a later run of an agent subgraph asking the same call gets the repeat
    protection the top level has (a labelled replay), or runs anew under "allow"."""
    url, app = server
    model = scripted(
        AIMessage("", tool_calls=[call("charge", "a1", amount=5)]),
        AIMessage("first done"),
        AIMessage("", tool_calls=[call("charge", "b1", amount=5)]),
        AIMessage("second done"),
    )
    invoker = make_invoker(driver, url)
    team = build_graph(tools_for(invoker, on_repeat=on_repeat), model, checkpointer=None)

    def again(state: MessagesState) -> str:
        done = [m for m in state["messages"] if isinstance(m, AIMessage) and not m.tool_calls]
        return "team" if len(done) < 2 else "__end__"

    parent = StateGraph(MessagesState)
    parent.add_node("team", team)
    parent.add_edge(START, "team")
    parent.add_conditional_edges("team", again)
    graph = parent.compile(checkpointer=InMemorySaver())
    final = await run(driver, graph, HELLO, _config(f"nested-{driver}-{on_repeat}"))
    await close(invoker)

    first, second = tool_messages(final)
    if on_repeat == "replay":
        assert second.artifact["repeat_of"] == _key(first.artifact).label
        assert str(second.content).startswith("[repeat of ")
        assert app.state.executions["charge"] == 1
    else:
        assert _key(first.artifact) != _key(second.artifact)
        assert app.state.executions["charge"] == 2


@pytest.mark.parametrize("driver", DRIVERS)
async def test_no_thread_id_is_a_configuration_error(
    driver: Driver, server: tuple[str, Any]
) -> None:
    """Without a plan= and without a thread_id the call fails before any request."""
    url, app = server
    model = scripted(AIMessage("", tool_calls=[call("charge", "c1", amount=5)]))
    invoker = make_invoker(driver, url)
    graph = build_graph(tools_for(invoker), model, checkpointer=None)
    with pytest.raises(ConfigurationError, match="no thread_id"):
        await run(driver, graph, HELLO, {})
    await close(invoker)
    assert not app.state.executions


async def test_async_invoker_refuses_a_sync_graph(server: tuple[str, Any]) -> None:
    """A tool built on an AsyncToolInvoker, run by graph.invoke, says to use ainvoke."""
    url, app = server
    model = scripted(AIMessage("", tool_calls=[call("charge", "c1", amount=5)]))
    invoker = make_invoker("async", url)
    graph = build_graph(tools_for(invoker), model, checkpointer=InMemorySaver())
    with pytest.raises(ConfigurationError, match=r"AsyncToolInvoker.*ainvoke"):
        await run("sync", graph, HELLO, _config("wrong-kind"))
    await close(invoker)
    assert not app.state.executions


async def test_sync_invoker_serves_an_async_graph(server: tuple[str, Any]) -> None:
    """graph.ainvoke runs a ToolInvoker tool in a worker thread (no nested event loop)."""
    url, app = server
    model = scripted(AIMessage("", tool_calls=[call("charge", "c1", amount=5)]), AIMessage("ok"))
    invoker = make_invoker("sync", url)
    graph = build_graph(tools_for(invoker), model, checkpointer=InMemorySaver())
    final = await run("async", graph, HELLO, _config("sync-in-async"))
    await close(invoker)
    (message,) = tool_messages(final)
    assert message.artifact["outcome"] == "executed"
    assert app.state.executions["charge"] == 1


@pytest.mark.parametrize("driver", DRIVERS)
async def test_duplicate_tool_call_ids_are_refused(driver: Driver, server: tuple[str, Any]) -> None:
    """Two calls sharing one id in a message cannot be told apart: refused, nothing runs."""
    url, app = server
    model = scripted(
        AIMessage(
            "", tool_calls=[call("charge", "same", amount=5), call("provision", "same", amount=5)]
        )
    )
    invoker = make_invoker(driver, url)
    graph = build_graph(
        tools_for(invoker, ("charge", "provision")), model, checkpointer=InMemorySaver()
    )
    with pytest.raises(ConfigurationError, match="unique id"):
        await run(driver, graph, HELLO, _config(f"dup-{driver}"))
    await close(invoker)
    assert not app.state.executions
