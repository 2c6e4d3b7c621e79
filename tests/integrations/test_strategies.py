"""The LangGraph step and plan strategies on their own: pure logic, no server."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from pydantic import BaseModel

from agentkey import ConfigurationError, PlanSession, ToolInvoker
from agentkey.integrations.langchain import ToolCallContext
from agentkey.integrations.langgraph import graph_step, remote_tool, thread_plan
from tests.integrations._graph import Order


def _ctx(
    state: Any,
    call_id: str | None,
    *,
    superstep: object = 3,
    thread: object = "thread-1",
    namespace: str = "tools:5d1c",
) -> ToolCallContext:
    config = {
        "metadata": {"langgraph_step": superstep, "langgraph_checkpoint_ns": namespace},
        "configurable": {"thread_id": thread},
    }
    return ToolCallContext(tool="charge", args={}, config=config, tool_call_id=call_id, state=state)


def _message(*ids: str) -> AIMessage:
    return AIMessage("", tool_calls=[{"name": "t", "args": {}, "id": i} for i in ids])


names = st.sampled_from(["charge", "provision", "report", "refund"])
json_args = st.dictionaries(
    st.sampled_from(["amount", "region", "note"]),
    st.one_of(st.integers(-5, 5), st.sampled_from(["eu", "us", ""])),
    max_size=3,
)


@given(
    calls=st.lists(st.tuples(names, json_args), min_size=1, max_size=8),
    superstep=st.integers(0, 10_000),
)
def test_every_call_of_a_message_gets_its_own_stable_key(
    calls: list[tuple[str, dict[str, Any]]], superstep: int
) -> None:
    """Calls of one message never share a key, whatever their tools and args; recomputing agrees."""
    message = AIMessage(
        "",
        tool_calls=[{"name": n, "args": a, "id": f"call_{i}"} for i, (n, a) in enumerate(calls)],
    )
    state = {"messages": [HumanMessage("go"), message]}

    def key(i: int) -> str:
        ctx = _ctx(state, f"call_{i}", superstep=superstep)
        return thread_plan(ctx).step(graph_step(ctx), calls[i][0], calls[i][1]).idempotency_key

    keys = [key(i) for i in range(len(calls))]
    assert len(set(keys)) == len(keys)
    assert keys == [key(i) for i in range(len(calls))]
    assert all(f":step_{superstep:03d}.{i:03d}:" in k for i, k in enumerate(keys))


class PydanticState(BaseModel):
    """A graph state declared as a pydantic model, with messages under another name."""

    turns: list[Any]
    notes: list[str] = []


@pytest.mark.parametrize(
    "state",
    [
        [HumanMessage("a"), _message("x", "y", "z")],
        {"messages": [_message("x", "y", "z")], "other": 1},
        {"history": [_message("x", "y", "z")], "messages": []},
        PydanticState(turns=[_message("x", "y", "z")]),
    ],
    ids=["list", "dict", "other key", "pydantic"],
)
def test_position_is_found_in_any_state_shape(state: Any) -> None:
    """The call's position is read from a list, a dict or a model state."""
    assert graph_step(_ctx(state, "z")) == (3, 2)


def test_latest_message_holding_the_id_wins() -> None:
    """A model that reuses ids across turns: the latest AIMessage decides the position."""
    state = {"messages": [_message("a", "b"), ToolMessage("ok", tool_call_id="b"), _message("b")]}
    assert graph_step(_ctx(state, "b")) == (3, 0)


_REFUSED: list[tuple[str, ToolCallContext, str]] = [
    ("outside a graph", _ctx({"messages": [_message("a")]}, "a", superstep=None), "not running"),
    ("bool superstep", _ctx({"messages": [_message("a")]}, "a", superstep=True), "not running"),
    ("no tool call id", _ctx({"messages": [_message("a")]}, None), "ToolNode"),
    ("no state", _ctx(None, "a"), "ToolNode"),
    ("unknown id", _ctx({"messages": [_message("a")]}, "b"), "no AIMessage"),
    ("duplicate id", _ctx({"messages": [_message("a", "a")]}, "a"), "unique id"),
]


@pytest.mark.parametrize(("ctx", "match"), [c[1:] for c in _REFUSED], ids=[c[0] for c in _REFUSED])
def test_graph_step_refuses_what_it_cannot_name(ctx: ToolCallContext, match: str) -> None:
    """Without a superstep, an id, state or a unique position: ConfigurationError with advice."""
    with pytest.raises(ConfigurationError, match=match) as caught:
        graph_step(ctx)
    assert "step_index=" in str(caught.value)


def test_thread_plan_uses_the_thread_id_at_the_root() -> None:
    """At the root graph the plan id is the thread_id itself."""
    assert thread_plan(_ctx(None, None, thread="t-7")).id == "t-7"
    assert thread_plan(_ctx(None, None, thread="t-7"), profile="jcs").profile == "jcs"


@given(thread=st.text(min_size=1, max_size=200), parent=st.text(min_size=1, max_size=40))
def test_thread_plan_is_valid_deterministic_and_scoped_by_parent(thread: str, parent: str) -> None:
    """Any thread id gives a valid plan id; a subgraph's parent namespace gives another one."""
    root = thread_plan(_ctx(None, None, thread=thread))
    nested = f"{parent.replace('|', '/')}:1|tools:2"
    inner = thread_plan(_ctx(None, None, thread=thread, namespace=nested))
    assert root == thread_plan(_ctx(None, None, thread=thread))
    assert inner == thread_plan(_ctx(None, None, thread=thread, namespace=nested))
    assert inner.id != root.id
    assert PlanSession(id=inner.id) == inner


@pytest.mark.parametrize("thread", [None, ""])
def test_thread_plan_without_thread_id_says_what_to_do(thread: object) -> None:
    """No thread_id: ConfigurationError naming the checkpointer and plan= remedies."""
    with pytest.raises(ConfigurationError, match=r"thread_id.*plan=PlanSession"):
        thread_plan(_ctx(None, None, thread=thread))


def test_langgraph_tool_outside_a_graph_is_refused() -> None:
    """A LangGraph-default tool invoked directly cannot name its step and sends nothing."""
    with ToolInvoker("https://tools.example.com") as invoker:
        tool = remote_tool(name="charge", description="charge", args_schema=Order, invoker=invoker)
        with pytest.raises(ConfigurationError, match="not running inside a LangGraph graph"):
            tool.invoke({"amount": 5}, {"configurable": {"thread_id": "t"}})


def test_injected_runtime_stays_out_of_the_model_schema() -> None:
    """The model sees exactly the args_schema fields, never config or runtime."""
    with ToolInvoker("https://tools.example.com") as invoker:
        tool = remote_tool(name="charge", description="charge", args_schema=Order, invoker=invoker)
        schema = tool.tool_call_schema
        assert isinstance(schema, type)
        assert issubclass(schema, BaseModel)
        assert set(schema.model_fields) == {"amount", "currency", "region"}


_BLOCKED = (
    "import sys\n"
    "sys.modules[{module!r}] = None\n"
    "import agentkey, agentkey.integrations\n"
    "try:\n"
    "    import agentkey.integrations.{name}\n"
    "except agentkey.MissingExtra as exc:\n"
    "    print(exc.extra, exc.module)\n"
)


@pytest.mark.parametrize(
    ("name", "module", "expected"),
    [
        ("langchain", "langchain_core", "langchain langchain_core"),
        ("langgraph", "langgraph", "langgraph langgraph"),
    ],
)
def test_missing_framework_names_the_extra(name: str, module: str, expected: str) -> None:
    """Importing an integration without its framework raises MissingExtra naming the extra."""
    code = _BLOCKED.format(module=module, name=name)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected


def test_integrations_package_imports_no_framework() -> None:
    """import agentkey.integrations pulls in neither langchain_core nor langgraph."""
    code = (
        "import sys, agentkey.integrations; "
        "print([m for m in ('langchain_core', 'langgraph') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
