"""The LangGraph step and plan strategies on their own: pure logic, no server."""

from __future__ import annotations

import subprocess
import sys
import uuid
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from pydantic import BaseModel

from agentkey import ConfigurationError, PlanSession, ToolInvoker
from agentkey.integrations.langchain import ToolCallContext
from agentkey.integrations.langgraph import earlier_result, graph_step, remote_tool, thread_plan
from tests.integrations._graph import Order


def _ctx(
    state: Any,
    call_id: str | None,
    *,
    superstep: object = 3,
    thread: object = "thread-1",
    namespace: str = "tools:5d1c",
    tool: str = "charge",
    args: dict[str, Any] | None = None,
    node: str = "tools",
) -> ToolCallContext:
    config = {
        "metadata": {
            "langgraph_step": superstep,
            "langgraph_checkpoint_ns": namespace,
            "langgraph_node": node,
        },
        "configurable": {"thread_id": thread},
    }
    return ToolCallContext(
        tool=tool, args=args or {}, config=config, tool_call_id=call_id, state=state
    )


def _message(*ids: str) -> AIMessage:
    calls = [{"name": "charge", "args": {}, "id": i} for i in ids]
    return AIMessage("", id=_drawn("ai-" + "-".join(ids)), tool_calls=calls)


def _drawn(name: str) -> str:
    """A UUID-shaped message id, like the ones add_messages and chat models draw."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, name))


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
    state = {"messages": [HumanMessage("go", id=_drawn("h1")), message]}

    def key(i: int, where: dict[str, Any]) -> str:
        name, args = calls[i]
        ctx = _ctx(where, f"call_{i}", superstep=superstep, tool=name, args=args)
        return thread_plan(ctx).step(graph_step(ctx), name, args).idempotency_key

    keys = [key(i, state) for i in range(len(calls))]
    assert len(set(keys)) == len(keys)
    assert keys == [key(i, state) for i in range(len(calls))]
    assert all(f":step_{superstep:03d}." in k for k in keys)
    # A re-asked model answering the same calls in reverse order: the same set of keys.
    reordered = AIMessage("", tool_calls=list(reversed(message.tool_calls)))
    again = {"messages": [HumanMessage("go", id=_drawn("h1")), reordered]}
    assert sorted(key(i, again) for i in range(len(calls))) == sorted(keys)


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
    """The call's ordinal among identical calls is read from a list, a dict or a model state."""
    superstep, slot, ordinal = graph_step(_ctx(state, "z"))
    assert (superstep, ordinal) == (3, 2)
    assert slot == graph_step(_ctx(state, "x"))[1]


def test_latest_message_holding_the_id_wins() -> None:
    """A model that reuses ids across turns: the latest AIMessage decides the ordinal."""
    state = {"messages": [_message("a", "b"), ToolMessage("ok", tool_call_id="b"), _message("b")]}
    assert graph_step(_ctx(state, "b"))[2] == 0


def test_slot_separates_tools_and_nodes() -> None:
    """Another tool, or the same tool in another node, gets another step in the same superstep."""
    state = {"messages": [_message("a")]}
    steps = {
        graph_step(_ctx(state, "a")),
        graph_step(_ctx(state, "a", tool="refund")),
        graph_step(_ctx(state, "a", node="tools_b")),
    }
    assert len(steps) == 3
    assert {s[0] for s in steps} == {3}


def test_call_without_its_message_is_keyed_by_its_id() -> None:
    """No message holds the call (a @task, a Send payload): the call id names it, stably."""
    one, again, other = (graph_step(_ctx(None, i)) for i in ("c1", "c1", "c2"))
    assert one == again != other
    assert one[:2] == other[:2]


def test_messages_without_ids_key_calls_by_their_ids() -> None:
    """No message id tells this conversation apart: identical calls are keyed by their call ids."""
    bare = AIMessage("", tool_calls=[{"name": "charge", "args": {}, "id": i} for i in "ab"])
    state = {"messages": [bare]}
    a, b = (graph_step(_ctx(state, i)) for i in "ab")
    assert a != b
    assert a[2] not in (0, 1)


_REFUSED: list[tuple[str, ToolCallContext, str]] = [
    ("outside a graph", _ctx({"messages": [_message("a")]}, "a", superstep=None), "not running"),
    ("bool superstep", _ctx({"messages": [_message("a")]}, "a", superstep=True), "not running"),
    ("no tool call id", _ctx({"messages": [_message("a")]}, None), "tool call"),
    ("duplicate id", _ctx({"messages": [_message("a", "a")]}, "a"), "unique id"),
]


@pytest.mark.parametrize(("ctx", "match"), [c[1:] for c in _REFUSED], ids=[c[0] for c in _REFUSED])
def test_graph_step_refuses_what_it_cannot_name(ctx: ToolCallContext, match: str) -> None:
    """Without a superstep, an id, state or a unique position: ConfigurationError with advice."""
    with pytest.raises(ConfigurationError, match=match) as caught:
        graph_step(ctx)
    assert "step_index=" in str(caught.value)


def test_thread_plan_follows_the_thread_lifetime() -> None:
    """Same thread and first message: one plan; a new conversation under the same id: another."""
    first = {"messages": [HumanMessage("hi", id=_drawn("m-1"))]}
    resumed = {"messages": [HumanMessage("hi", id=_drawn("m-1")), _message("a")]}
    new_life = {"messages": [HumanMessage("hi", id=_drawn("m-2"))]}
    plan = thread_plan(_ctx(first, None, thread="1"))
    assert plan == thread_plan(_ctx(resumed, None, thread="1"))
    assert plan != thread_plan(_ctx(new_life, None, thread="1"))
    assert plan != thread_plan(_ctx(first, None, thread="2"))
    assert thread_plan(_ctx(first, None, thread="t-7"), profile="jcs").profile == "jcs"


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


def test_a_repeat_takes_its_step_label_from_the_key_not_the_artifact() -> None:
    """An earlier ToolMessage whose artifact lost its "step" still names the step it repeats."""
    plan = PlanSession.new()
    earlier = plan.step((1, 7, 0), "charge", {"amount": 5})
    done = ToolMessage(
        "charged",
        tool_call_id="c1",
        name="charge",
        artifact={"idempotency_key": earlier.idempotency_key},  # pruned: no "step"
    )
    again = PlanSession(id=plan.id).step((3, 7, 0), "charge", {"amount": 5}, on_repeat="allow")
    found = earlier_result(_ctx({"messages": [done]}, "c2"), again)
    assert found is not None
    assert found[1]["step"] == earlier.label
