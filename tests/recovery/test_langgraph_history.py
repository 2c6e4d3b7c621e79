"""Issue 23, LangGraph cases 2 and 3: stateless history and a constant system prompt.

Real graphs (LangGraph's ToolNode), the ledger tool behind agentkey's middleware on
loopback, executions counted on the server; both drivers from one table.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langgraph.checkpoint.memory import InMemorySaver

from tests.integrations._graph import (
    DRIVERS,
    Driver,
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


@pytest.fixture
def ledger() -> Iterator[tuple[str, Any]]:
    with ledger_server() as running:
        yield running


def _config(thread: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread}}


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("on_repeat", ["allow", "replay"])
async def test_stateless_history_a_later_turn_is_never_an_unlabelled_old_answer(
    driver: Driver, on_repeat: str, ledger: tuple[str, Any]
) -> None:
    """Case 2: no checkpointer; the app keeps the history and sends it each turn (same
    thread_id, supersteps restarting at the same numbers). A later turn's identical call
    is a new operation ("allow") or a labelled repeat ("replay"), never the old answer
    passed off as fresh."""
    url, app = ledger
    model = scripted(
        AIMessage("", tool_calls=[call("charge", "t1", amount=5)]),
        AIMessage("Charged."),
        AIMessage("", tool_calls=[call("charge", "t2", amount=5)]),
        AIMessage("Charged again."),
    )
    invoker = make_invoker(driver, url)
    graph = build_graph(tools_for(invoker, on_repeat=on_repeat), model, checkpointer=None)
    history: list[Any] = [HumanMessage("charge 5")]
    first = await run(driver, graph, {"messages": history}, _config("stateless"))
    history = [*first["messages"], HumanMessage("charge 5 again")]
    second = await run(driver, graph, {"messages": history}, _config("stateless"))
    await close(invoker)
    before, after = tool_messages(second)
    assert before.artifact["outcome"] == "executed"
    if on_repeat == "allow":
        assert after.artifact["idempotency_key"] != before.artifact["idempotency_key"]
        assert after.artifact["outcome"] == "executed"
        assert app.state.executions["charge"] == 2
    else:
        assert after.artifact["repeat_of"] == before.artifact["step"]
        assert str(after.content).startswith("[repeat of ")
        assert app.state.executions["charge"] == 1


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_constant_system_prompt_does_not_join_two_conversations(
    driver: Driver, ledger: tuple[str, Any]
) -> None:
    """Case 3: one SystemMessage object, first in every conversation. add_messages stamps it
    with an id on first use and it keeps it; a new user's conversation on a reused thread id
    must still charge anew, never get the first user's receipt."""
    url, app = ledger
    system = SystemMessage("You take payments.")  # defined once, as apps do
    invoker = make_invoker(driver, url)
    receipts = []
    for user in ("alice", "bob"):
        model = scripted(
            AIMessage("", tool_calls=[call("charge", "call_1", amount=5)]), AIMessage("Charged.")
        )
        saver = InMemorySaver()  # the thread's history is gone: a new checkpointer
        graph = build_graph(tools_for(invoker), model, checkpointer=saver)
        start = {"messages": [system, HumanMessage(f"{user}: charge 5")]}
        final = await run(driver, graph, start, _config("1"))
        receipts.append(tool_messages(final)[0].artifact)
    await close(invoker)
    assert system.id is not None  # stamped once, reused: the trap of case 3
    assert [r["outcome"] for r in receipts] == ["executed", "executed"]
    assert receipts[0]["idempotency_key"] != receipts[1]["idempotency_key"]
    assert app.state.executions["charge"] == 2
