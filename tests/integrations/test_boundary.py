"""The agent-runtime boundary: one step one tool, one plan per thread lifetime, repeats, errors.

Real LangGraph graphs with scripted chat models, real tools behind
IdempotencyMiddleware on loopback; every test counts executions on the server.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Annotated, Any

import pytest
from langchain_core.messages import (
    AIMessage,
    AnyMessage,
    HumanMessage,
    SystemMessage,
    ToolCall,
    ToolMessage,
)
from langchain_core.runnables import RunnableConfig
from langchain_core.tracers.base import BaseTracer
from langchain_core.tracers.schemas import Run
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.func import entrypoint, task
from langgraph.graph import START, MessagesState, StateGraph, add_messages
from langgraph.prebuilt import ToolNode
from langgraph.types import RetryPolicy as NodeRetryPolicy
from langgraph.types import Send
from typing_extensions import TypedDict

from agentkey import (
    ConfigurationError,
    OutcomeUnknown,
    PlanSession,
    StepKey,
    StepRepeated,
    ToolInvoker,
)
from agentkey.integrations import langchain as ak_langchain
from agentkey.integrations._adapter import code
from agentkey.integrations.langgraph import call_step
from tests.integrations._graph import (
    DRIVERS,
    LIMIT,
    Crash,
    Driver,
    Order,
    build_graph,
    call,
    close,
    ledger_server,
    make_invoker,
    run,
    scripted,
    tool_messages,
    tools_for,
)

pytestmark = pytest.mark.timeout(60)


def hello() -> dict[str, Any]:
    """A new conversation's first input (a fresh message: add_messages gives it its id)."""
    return {"messages": [HumanMessage("charge the order")]}


class LosingSaver(InMemorySaver):
    """While ``losing``, every checkpoint after the input is lost, as in a crash before the
    model's answer was saved (``durability="exit"``, or an asynchronous write cut short)."""

    losing = True

    def put(self, config: Any, checkpoint: Any, metadata: Any, new_versions: Any) -> Any:
        if self.losing and metadata.get("step", -1) >= 1:
            return {"configurable": {**config["configurable"], "checkpoint_id": checkpoint["id"]}}
        return super().put(config, checkpoint, metadata, new_versions)

    def put_writes(self, config: Any, writes: Any, task_id: str, task_path: str = "") -> None:
        if not self.losing:  # the model's answer, kept as a pending write, is lost too
            super().put_writes(config, writes, task_id, task_path)


@pytest.fixture
def ledger() -> Iterator[tuple[str, Any]]:
    """A fresh ledger server per test, so execution counts start at zero."""
    with ledger_server() as running:
        yield running


def _config(thread: str) -> RunnableConfig:
    return {"configurable": {"thread_id": thread}}


def _thread_only(ctx: ak_langchain.ToolCallContext) -> PlanSession:
    """A plan of the thread id alone: what a node of your own, without ToolRuntime, can use."""
    return PlanSession.from_external_id(str(ctx.config["configurable"]["thread_id"]))


def _text(message: ToolMessage) -> str:
    assert isinstance(message.content, str)
    return message.content


def _calls(state: MessagesState) -> list[ToolCall]:
    last = state["messages"][-1]
    assert isinstance(last, AIMessage)
    return last.tool_calls


async def _invoke(driver: Driver, tool: Any, tool_input: Any, config: Any = None) -> Any:
    if driver == "sync":
        return tool.invoke(tool_input, config)
    return await tool.ainvoke(tool_input, config)


def _lc_tool(name: str, invoker: Any, plan: PlanSession, index: int) -> Any:
    return ak_langchain.remote_tool(
        name=name,
        description=f"{name} an order",
        args_schema=Order,
        invoker=invoker,
        plan=plan,
        step_index=index,
    )


# --- 1. A key belongs to one tool ---------------------------------------------------------


@pytest.mark.parametrize("driver", DRIVERS)
async def test_one_step_index_is_never_given_to_two_tools(
    driver: Driver, ledger: tuple[str, Any]
) -> None:
    """Step 3 given to charge, then to refund (also after a restore): refused, never replayed."""
    url, app = ledger
    plan = PlanSession.new()
    invoker = make_invoker(driver, url)
    await _invoke(driver, _lc_tool("charge", invoker, plan, 3), call("charge", "a", amount=5))
    restored = PlanSession.from_json(plan.to_json())
    for session in (plan, restored):
        refund = _lc_tool("refund", invoker, session, 3)
        with pytest.raises(ConfigurationError, match=r"step_003 to tool 'charge'.*'refund'"):
            await _invoke(driver, refund, call("refund", "b", amount=5))
    await close(invoker)
    assert dict(app.state.executions) == {"charge": 1}


class Branches(TypedDict):
    """Two agents side by side, each with its own message list."""

    a_messages: Annotated[list[AnyMessage], add_messages]
    b_messages: Annotated[list[AnyMessage], add_messages]


@pytest.mark.parametrize("driver", DRIVERS)
async def test_parallel_tool_nodes_with_equal_calls_both_run(
    driver: Driver, ledger: tuple[str, Any]
) -> None:
    """Two ToolNodes in parallel branches, one superstep, equal calls: two keys, two charges."""
    url, app = ledger
    invoker = make_invoker(driver, url)
    tools = tools_for(invoker)

    def agent(channel: str, call_id: str) -> Any:
        return lambda state: {
            channel: [AIMessage("", tool_calls=[call("charge", call_id, amount=5)])]
        }

    builder = StateGraph(Branches)
    for branch in ("a", "b"):
        builder.add_node(f"{branch}_agent", agent(f"{branch}_messages", f"{branch}1"))
        builder.add_node(f"{branch}_tools", ToolNode(tools, messages_key=f"{branch}_messages"))
        builder.add_edge(START, f"{branch}_agent")
        builder.add_edge(f"{branch}_agent", f"{branch}_tools")
    graph = builder.compile(checkpointer=InMemorySaver())
    start = {"a_messages": [HumanMessage("a")], "b_messages": [HumanMessage("b")]}
    final = await run(driver, graph, start, _config(f"branches-{driver}"))
    await close(invoker)

    done = [m for m in final["a_messages"] + final["b_messages"] if isinstance(m, ToolMessage)]
    keys = [StepKey.parse(m.artifact["idempotency_key"]) for m in done]
    assert len({k.format() for k in keys}) == 2
    assert app.state.executions["charge"] == 2
    assert not any(m.artifact["replayed"] for m in done)


async def test_send_tasks_with_their_own_messages_do_not_share_keys(
    ledger: tuple[str, Any],
) -> None:
    """Two Sends to one ToolNode, each with its own id-less message and equal call: both run."""
    url, app = ledger
    invoker = make_invoker("sync", url)
    tools = tools_for(invoker)

    def route(state: MessagesState) -> list[Send]:
        asks = [AIMessage("", tool_calls=[call("charge", f"x{i}", amount=5)]) for i in range(2)]
        return [Send("tools", {"messages": [ask]}) for ask in asks]

    builder = StateGraph(MessagesState)
    builder.add_node("tools", ToolNode(tools))
    builder.add_conditional_edges(START, route, ["tools"])
    graph = builder.compile(checkpointer=InMemorySaver())
    final = await run("sync", graph, hello(), _config("own-messages"))
    invoker.close()  # type: ignore[union-attr]
    assert [m.artifact["outcome"] for m in tool_messages(final)] == ["executed", "executed"]
    assert app.state.executions["charge"] == 2


# --- 2. A plan id belongs to one lifetime of a thread -------------------------------------


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("lost", ["new checkpointer", "deleted thread"])
async def test_reused_thread_id_after_lost_history_runs_again(
    driver: Driver, lost: str, ledger: tuple[str, Any]
) -> None:
    """thread_id "1" reused once its history is gone: the new charge runs, no stale receipt."""
    url, app = ledger
    invoker = make_invoker(driver, url)
    saver = InMemorySaver()
    answers = []
    for conversation in range(2):
        if conversation and lost == "new checkpointer":
            saver = InMemorySaver()
        elif conversation:
            saver.delete_thread("1")
        model = scripted(
            AIMessage("", tool_calls=[call("charge", "call_1", amount=5)]), AIMessage("Charged.")
        )
        graph = build_graph(tools_for(invoker), model, checkpointer=saver)
        final = await run(driver, graph, hello(), _config("1"))
        answers.append(tool_messages(final)[0].artifact)
    await close(invoker)
    assert [a["outcome"] for a in answers] == ["executed", "executed"]
    assert answers[0]["idempotency_key"] != answers[1]["idempotency_key"]
    assert app.state.executions["charge"] == 2


async def test_a_fixed_system_prompt_id_does_not_make_two_conversations_one(
    ledger: tuple[str, Any],
) -> None:
    """A first message with a program-chosen id (the same every time) is no lifetime marker."""
    url, app = ledger
    invoker = make_invoker("sync", url)
    answers = []
    for _ in range(2):
        model = scripted(
            AIMessage("", tool_calls=[call("charge", "call_1", amount=5)]), AIMessage("Charged.")
        )
        graph = build_graph(tools_for(invoker), model, checkpointer=InMemorySaver())
        prompt = SystemMessage("You take payments.", id="system-prompt")
        start = {"messages": [prompt, HumanMessage("charge the order")]}
        final = await run("sync", graph, start, _config("1"))
        answers.append(tool_messages(final)[0].artifact)
    await close(invoker)
    assert [a["outcome"] for a in answers] == ["executed", "executed"]
    assert app.state.executions["charge"] == 2


async def test_explicit_plan_keeps_the_old_thread_keyed_behaviour(ledger: tuple[str, Any]) -> None:
    """plan= a session of the thread id alone: a reused thread replays (the documented opt-in)."""
    url, app = ledger
    invoker = make_invoker("sync", url)
    outcomes = []
    for _ in range(2):
        model = scripted(
            AIMessage("", tool_calls=[call("charge", "c1", amount=5)]), AIMessage("ok")
        )
        tools = tools_for(invoker, plan=lambda ctx: PlanSession.from_external_id("1"))
        graph = build_graph(tools, model, checkpointer=InMemorySaver())
        final = await run("sync", graph, hello(), _config("1"))
        outcomes.append(tool_messages(final)[0].artifact["outcome"])
    await close(invoker)
    assert outcomes == ["executed", "replayed"]
    assert app.state.executions["charge"] == 1


# --- 3. A call's position survives a re-asked model ---------------------------------------


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("fan_out", [False, True], ids=["one task", "send per call"])
async def test_reasked_model_reordering_its_calls_runs_nothing_twice(
    driver: Driver, fan_out: bool, ledger: tuple[str, Any]
) -> None:
    """The model node re-run from a checkpoint answers the same calls in another order."""
    url, app = ledger
    first = AIMessage(
        "",
        tool_calls=[
            call("charge", "a1", amount=5),
            call("refund", "a2", amount=7),
            call("charge", "a3", amount=5),
        ],
    )
    reordered = AIMessage(
        "",
        tool_calls=[
            call("refund", "b2", amount=7),
            call("charge", "b3", amount=5),
            call("charge", "b1", amount=5),
        ],
    )
    model = scripted(first, AIMessage("done"), reordered, AIMessage("done again"))
    invoker = make_invoker(driver, url)
    tools = tools_for(invoker, ("charge", "refund"))
    saver = LosingSaver()
    graph = build_graph(tools, model, checkpointer=saver, fan_out=fan_out)
    config = _config(f"reask-{driver}-{fan_out}")
    before = tool_messages(await run(driver, graph, hello(), config))
    # Only the input's checkpoint survived: resuming runs the model node again, and the
    # re-asked model answers the same calls in another order.
    saver.losing = False
    after = tool_messages(await run(driver, graph, None, config))
    await close(invoker)

    keys = sorted(m.artifact["idempotency_key"] for m in before)
    assert sorted(m.artifact["idempotency_key"] for m in after) == keys
    assert len(set(keys)) == 3  # the two identical charges still have two keys
    assert all(m.artifact["replayed"] for m in after)
    assert dict(app.state.executions) == {"charge": 2, "refund": 1}


# --- 4. The model repeats a call that already succeeded -----------------------------------


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("policy", ["default", "replay", "raise", "allow"])
async def test_model_repeating_a_finished_call_at_a_later_turn(
    driver: Driver, policy: str, ledger: tuple[str, Any]
) -> None:
    """A later turn asks again for a charge that succeeded: on_repeat decides; default replays."""
    url, app = ledger
    model = scripted(
        AIMessage("", tool_calls=[call("charge", "c1", amount=5)]),
        AIMessage("Charged."),
        AIMessage("", tool_calls=[call("charge", "c2", amount=5)]),
        AIMessage("Charged again?"),
    )
    invoker = make_invoker(driver, url)
    options = {} if policy == "default" else {"on_repeat": policy}
    graph = build_graph(tools_for(invoker, **options), model, checkpointer=InMemorySaver())
    config = _config(f"repeat-{driver}-{policy}")
    await run(driver, graph, hello(), config)
    again = {"messages": [HumanMessage("charge it")]}
    if policy == "raise":
        with pytest.raises(StepRepeated) as caught:
            await run(driver, graph, again, config)
        await close(invoker)
        assert caught.value.tool == "charge"
        assert caught.value.previous_step.endswith(f".{code('c1')}")  # the first call's step
        assert app.state.executions["charge"] == 1
        return
    final = await run(driver, graph, again, config)
    await close(invoker)
    first, second = tool_messages(final)
    if policy == "allow":
        assert second.artifact["outcome"] == "executed"
        assert app.state.executions["charge"] == 2
        return
    assert second.artifact["repeat_of"] == first.artifact["step"]
    assert second.artifact["idempotency_key"] == first.artifact["idempotency_key"]
    assert second.artifact["replayed"] is True
    assert _text(second).startswith(f"[repeat of {first.artifact['step']}:")
    assert _text(second).endswith(_text(first))
    assert app.state.executions["charge"] == 1


@pytest.mark.parametrize("driver", DRIVERS)
async def test_custom_loop_plan_remembers_its_steps_across_a_restore(
    driver: Driver, ledger: tuple[str, Any]
) -> None:
    """A PlanSession restored from to_json() answers a repeated call with the earlier step."""
    url, app = ledger
    plan = PlanSession.new()
    invoker = make_invoker(driver, url)
    charge = {"amount": 5, "currency": "usd", "region": "eu-west-1"}

    async def send(step: Any) -> Any:
        if isinstance(invoker, ToolInvoker):
            return invoker.invoke(step)
        return await invoker.invoke(step)

    first = await send(plan.step(0, "charge", charge))
    restored = PlanSession.from_json(plan.to_json())  # the orchestrator restarted
    again = restored.step(4, "charge", charge)
    assert again.repeat_of == "step_000"
    repeat = await send(again)
    with pytest.raises(StepRepeated, match="step_000"):
        restored.step(5, "charge", charge, on_repeat="raise")
    allowed = await send(restored.step(6, "charge", charge, on_repeat="allow"))
    await close(invoker)
    assert repeat.replayed
    assert repeat.body == first.body
    assert allowed.outcome == "executed"
    assert app.state.executions["charge"] == 2  # step 0, and step 6 that was allowed


# --- 5. Errors the model and LangChain can use --------------------------------------------


@pytest.mark.parametrize("driver", DRIVERS)
async def test_tool_refusal_reaches_the_model_with_the_reason_never_the_key(
    driver: Driver, ledger: tuple[str, Any]
) -> None:
    """A 4xx becomes an error ToolMessage with the server's reason; the model answers; no key."""
    url, app = ledger
    model = scripted(
        AIMessage("", tool_calls=[call("charge", "c1", amount=LIMIT + 1)]),
        AIMessage("Sorry, that amount is over the limit."),
    )
    invoker = make_invoker(driver, url)
    graph = build_graph(tools_for(invoker), model, checkpointer=InMemorySaver())
    final = await run(driver, graph, hello(), _config(f"refused-{driver}"))
    await close(invoker)
    (message,) = tool_messages(final)
    assert message.status == "error"
    text = _text(message)
    assert "amount over limit" in text
    assert "step_" not in text
    assert ":" not in text.partition("refused this call:")[2].partition("(")[0]
    assert final["messages"][-1].content.startswith("Sorry")
    assert not app.state.executions


@pytest.mark.parametrize("driver", DRIVERS)
async def test_outcome_unknown_stays_fatal(driver: Driver, ledger: tuple[str, Any]) -> None:
    """An ambiguous failure is not shown to the model as a refusal: the run stops."""
    url, app = ledger
    model = scripted(AIMessage("", tool_calls=[call("broken", "c1", amount=5)]))
    invoker = make_invoker(driver, url)
    graph = build_graph(tools_for(invoker, ("broken",)), model, checkpointer=InMemorySaver())
    with pytest.raises(OutcomeUnknown):
        await run(driver, graph, hello(), _config(f"unknown-{driver}"))
    await close(invoker)
    assert app.state.executions["broken"] >= 1


def test_run_without_config_names_the_fix(ledger: tuple[str, Any]) -> None:
    """tool.run() outside a graph (config=None) is a ConfigurationError naming step_index=."""
    url, app = ledger
    invoker = make_invoker("sync", url)
    (tool,) = tools_for(invoker)
    with pytest.raises(ConfigurationError, match="step_index="):
        tool.run({"amount": 5})
    invoker.close()  # type: ignore[union-attr]
    assert not app.state.executions


@pytest.mark.parametrize("driver", DRIVERS)
async def test_tool_invoked_in_a_custom_node_replays_after_a_retry(
    driver: Driver, ledger: tuple[str, Any]
) -> None:
    """tool.invoke(tool_call) in your own node, with a plan and call_step: a retry replays."""
    url, app = ledger
    invoker = make_invoker(driver, url)
    (tool,) = tools_for(invoker, plan=_thread_only, step_index=call_step)
    model = scripted(
        AIMessage("", tool_calls=[call("charge", "c1", amount=5), call("charge", "c2", amount=5)]),
        AIMessage("done"),
    )
    crashed: list[bool] = []

    def after(out: list[Any]) -> dict[str, Any]:
        if not crashed:
            crashed.append(True)
            raise Crash("died after the tools ran")
        return {"messages": out}

    def act(state: MessagesState) -> dict[str, Any]:
        return after([tool.invoke(c) for c in _calls(state)])

    async def aact(state: MessagesState, config: RunnableConfig) -> dict[str, Any]:
        # Python 3.10's asyncio tasks do not carry the run's context, so LangGraph's
        # async nodes must hand their config on explicitly there (as LangGraph documents).
        return after([await tool.ainvoke(c, config) for c in _calls(state)])

    builder = StateGraph(MessagesState)
    builder.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
    builder.add_node(
        "act",
        act if driver == "sync" else aact,
        retry_policy=NodeRetryPolicy(max_attempts=2, initial_interval=0.01, retry_on=Crash),
    )
    builder.add_edge(START, "agent")
    builder.add_conditional_edges(
        "agent", lambda s: "act" if s["messages"][-1].tool_calls else "__end__"
    )
    builder.add_edge("act", "agent")
    graph = builder.compile(checkpointer=InMemorySaver())
    final = await run(driver, graph, hello(), _config(f"custom-{driver}"))
    await close(invoker)
    done = tool_messages(final)
    assert [m.artifact["outcome"] for m in done] == ["replayed", "replayed"]
    assert len({m.artifact["idempotency_key"] for m in done}) == 2
    assert app.state.executions["charge"] == 2


class Fan(TypedDict):
    """A map-reduce state: the calls to make and the results gathered."""

    calls: list[dict[str, Any]]
    results: Annotated[list[Any], operator.add]


async def test_tool_invoked_in_send_workers_and_tasks(ledger: tuple[str, Any]) -> None:
    """Send workers and @task functions calling tool.invoke(tool_call), with a plan: both work."""
    url, app = ledger
    invoker = make_invoker("sync", url)
    (tool,) = tools_for(invoker, plan=_thread_only, step_index=call_step)
    calls = [call("charge", "m1", amount=5), call("charge", "m2", amount=5)]

    builder = StateGraph(Fan)
    builder.add_node("worker", lambda s: {"results": [tool.invoke(s["calls"][0])]})
    builder.add_conditional_edges(
        START, lambda s: [Send("worker", {"calls": [c], "results": []}) for c in s["calls"]]
    )
    graph = builder.compile(checkpointer=InMemorySaver())
    config = _config("fan")
    mapped = graph.invoke(Fan(calls=calls, results=[]), config)["results"]

    crashed: list[bool] = []

    retry = NodeRetryPolicy(max_attempts=2, initial_interval=0.01, retry_on=Crash)

    @task(retry_policy=retry)  # type: ignore[arg-type]  # the factory overload binds P to Never
    def charge_task(tool_call: dict[str, Any]) -> ToolMessage:
        message: ToolMessage = tool.invoke(tool_call)
        if not crashed:
            crashed.append(True)
            raise Crash("died after the tool ran")
        return message

    @entrypoint(checkpointer=InMemorySaver())
    def flow(todo: list[dict[str, Any]]) -> list[ToolMessage]:
        return [charge_task(c).result() for c in todo]  # type: ignore[arg-type]

    done = flow.invoke([call("charge", "t1", amount=6)], _config("task"))
    assert isinstance(done, list)
    (tasked,) = done
    invoker.close()  # type: ignore[union-attr]

    assert len({m.artifact["idempotency_key"] for m in mapped}) == 2
    assert all(m.artifact["outcome"] == "executed" for m in mapped)
    assert tasked.artifact["replayed"]  # the retried task sent the same key
    assert app.state.executions["charge"] == 3  # two mapped, one task (its retry replayed)


class Runs(BaseTracer):
    """A tracer keeping every finished tool run, as LangSmith would receive it."""

    def __init__(self) -> None:
        super().__init__()
        self.tool_runs: list[Run] = []

    def _persist_run(self, run: Run) -> None:
        pass

    def _on_tool_end(self, run: Run) -> None:
        self.tool_runs.append(run)


@pytest.mark.parametrize("driver", DRIVERS)
async def test_key_outcome_and_replay_are_in_the_traced_run(
    driver: Driver, ledger: tuple[str, Any]
) -> None:
    """The tool run's metadata carries the key, the outcome and the replay flag."""
    url, _ = ledger
    invoker = make_invoker(driver, url)
    tool = _lc_tool("charge", invoker, PlanSession.new(), 2)
    tracer = Runs()
    for call_id in ("a", "b"):
        await _invoke(driver, tool, call("charge", call_id, amount=5), {"callbacks": [tracer]})
    await close(invoker)
    first, second = (run.metadata for run in tracer.tool_runs)
    assert first["agentkey_outcome"] == "executed"
    assert (second["agentkey_outcome"], second["agentkey_replayed"]) == ("replayed", True)
    assert first["agentkey_idempotency_key"] == second["agentkey_idempotency_key"]
    assert first["agentkey_idempotency_key"].split(":")[1] == "step_002"
