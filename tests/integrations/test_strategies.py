"""The LangGraph step and plan strategies on their own: pure logic, no server."""

from __future__ import annotations

import subprocess
import sys
import uuid
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from pydantic import BaseModel

from agentkey import ConfigurationError, PlanSession, ToolInvoker
from agentkey._plan import OnRepeat
from agentkey.integrations._adapter import code
from agentkey.integrations._identity import CallSite, Earlier, Seen, Verdict, decide
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


@given(calls=st.lists(st.tuples(names, json_args), min_size=1, max_size=8))
def test_every_call_of_a_message_gets_its_own_stable_key(
    calls: list[tuple[str, dict[str, Any]]],
) -> None:
    """Calls of one message never share a key, whatever their tools and args; recomputing agrees."""
    message = AIMessage(
        "",
        tool_calls=[{"name": n, "args": a, "id": f"call_{i}"} for i, (n, a) in enumerate(calls)],
    )
    state = {"messages": [HumanMessage("go", id=_drawn("h1")), message]}

    def key(i: int) -> str:
        name, args = calls[i]
        ctx = _ctx(state, f"call_{i}", tool=name, args=args)
        return thread_plan(ctx).step(graph_step(ctx), name, args).idempotency_key

    keys = [key(i) for i in range(len(calls))]
    assert len(set(keys)) == len(keys)
    assert keys == [key(i) for i in range(len(calls))]


def test_graph_step_is_the_slot_and_the_call_id() -> None:
    """(slot, call): the tool node and tool name, and the call id; nothing else moves it."""
    state = {"messages": [_message("a")]}
    slot, call = graph_step(_ctx(state, "a"))
    assert call == code("a")
    assert graph_step(_ctx(state, "a", superstep=99)) == (slot, call)  # not the superstep
    assert graph_step(_ctx(None, "a")) == (slot, call)  # nor the state
    assert graph_step(_ctx(state, "a", tool="refund"))[0] != slot
    assert graph_step(_ctx(state, "a", node="tools_b"))[0] != slot
    with pytest.raises(ConfigurationError, match="step_index="):
        graph_step(_ctx(state, None))


def test_thread_plan_follows_the_conversation() -> None:
    """Same thread and first user message: one plan; a new conversation on the thread: another.

    A system prompt defined once and reused keeps the id add_messages gave it the first
    time, so it never tells one conversation from the next (issue 23, case 3).
    """
    prompt = SystemMessage("You take payments.", id=_drawn("system"))
    first = {"messages": [prompt, HumanMessage("hi", id=_drawn("m-1"))]}
    resumed = {"messages": [prompt, HumanMessage("hi", id=_drawn("m-1")), _message("a")]}
    new_life = {"messages": [prompt, HumanMessage("hi", id=_drawn("m-2"))]}
    plan = thread_plan(_ctx(first, None, thread="1"))
    assert plan == thread_plan(_ctx(resumed, None, thread="1"))
    assert plan != thread_plan(_ctx(new_life, None, thread="1"))
    assert plan != thread_plan(_ctx(first, None, thread="2"))
    assert thread_plan(_ctx(first, None, thread="t-7"), profile="jcs").profile == "jcs"


@given(thread=st.text(min_size=1, max_size=200), parent=st.text(min_size=1, max_size=40))
def test_thread_plan_is_valid_and_scoped_by_the_parent_nodes(thread: str, parent: str) -> None:
    """Any thread id gives a valid plan id; a subgraph's parent node names (not their task ids,
    which change each turn) give another one."""
    state = {"messages": [HumanMessage("hi", id=_drawn("m-1"))]}
    root = thread_plan(_ctx(state, None, thread=thread))
    node = parent.replace("|", "/").replace(":", "/")
    inner = thread_plan(_ctx(state, None, thread=thread, namespace=f"{node}:1|tools:2"))
    later = thread_plan(_ctx(state, None, thread=thread, namespace=f"{node}:9|tools:8"))
    assert inner == later  # another turn of the same subgraph: the same plan
    assert inner.id != root.id
    assert PlanSession(id=inner.id) == inner


@pytest.mark.parametrize("thread", [None, ""])
def test_thread_plan_without_thread_id_says_what_to_do(thread: object) -> None:
    """No thread_id: ConfigurationError naming the plan= remedy."""
    with pytest.raises(ConfigurationError, match=r"thread_id.*plan=PlanSession"):
        thread_plan(_ctx({"messages": []}, None, thread=thread))


def test_thread_plan_needs_the_tool_runtime() -> None:
    """Without LangGraph's ToolRuntime (no state) the defaults refuse, naming the fix."""
    with pytest.raises(ConfigurationError, match=r"ToolRuntime.*step_index="):
        thread_plan(_ctx(None, "a"))


# --- the decision, on its own: a table of what the journal and the history say ------------

PLAN = PlanSession(id="plan-1")
HASH = "a" * 64


def _earlier(call_id: str, step: int, context: str | None = "h1") -> Earlier:
    return Earlier(f"plan-1:step_{step:03d}:{HASH}", call_id, context)


def _site(
    call_id: str,
    *,
    siblings: tuple[str, ...] | None = None,
    answered: dict[str, str | None] | None = None,
    asked: dict[str, tuple[int, int]] | None = None,
    position: tuple[int, int] | None = (0, 9),
    seen: bool = True,
    adopt: bool = True,
    context: str | None = "h1",
) -> CallSite:
    history = Seen(answered or {}, frozenset({"h1"}), asked or {}) if seen else None
    return CallSite(
        PLAN, "charge", {}, call_id, siblings or (call_id,), context, history, position, adopt
    )


_DECISIONS: list[tuple[str, CallSite, list[Earlier], OnRepeat, str]] = [
    ("the same call again", _site("c1"), [_earlier("c1", 1)], "replay", "key:1"),
    ("a new call", _site("c2"), [], "replay", "new"),
    ("asked again, never answered", _site("c2"), [_earlier("c1", 1)], "replay", "key:1 repeat"),
    (
        "an identical sibling",
        _site("c2", siblings=("c1", "c2")),
        [_earlier("c1", 1)],
        "replay",
        "new",
    ),
    (
        "second of two asked again",
        _site("b2", siblings=("b1", "b2")),
        [_earlier("a1", 1), _earlier("a2", 2)],
        "replay",
        "key:2 repeat",
    ),
    (
        "answered: replay",
        _site("c2", answered={"c1": "ok"}),
        [_earlier("c1", 1)],
        "replay",
        "repeat:ok",
    ),
    ("answered: allow", _site("c2", answered={"c1": "ok"}), [_earlier("c1", 1)], "allow", "new"),
    (
        "answered with an error",
        _site("c2", answered={"c1": None}),
        [_earlier("c1", 1)],
        "replay",
        "new",
    ),
    (
        "another conversation's call",
        _site("c2"),
        [_earlier("c1", 1, context="old-user-turn")],
        "replay",
        "new",
    ),
    (
        "a parallel branch's own call",
        _site("c2", asked={"c1": (1, 3)}, position=(0, 3)),
        [_earlier("c1", 1)],
        "replay",
        "new",
    ),
    (
        "an earlier request left unanswered",
        _site("c2", asked={"c1": (0, 2)}, position=(0, 5)),
        [_earlier("c1", 1)],
        "replay",
        "key:1 repeat",
    ),
    ("conversation unknown", _site("c2", adopt=False), [_earlier("c1", 1)], "replay", "new"),
    ("no history at all", _site("c2", seen=False), [_earlier("c1", 1)], "replay", "new"),
    ("no history, same call", _site("c1", seen=False), [_earlier("c1", 1)], "replay", "key:1"),
]


@pytest.mark.parametrize(
    ("site", "earlier", "on_repeat", "expected"),
    [d[1:] for d in _DECISIONS],
    ids=[d[0] for d in _DECISIONS],
)
def test_decide(site: CallSite, earlier: list[Earlier], on_repeat: OnRepeat, expected: str) -> None:
    """Which key a call gets from the journal and the history (issue 23's one mechanism)."""
    verdict = decide(site, earlier, on_repeat, HASH)
    if expected == "new":
        assert (verdict.key, verdict.content) == (None, None)
    elif expected.startswith("repeat:"):
        assert verdict.content == expected.removeprefix("repeat:")
    else:
        step = int(expected.split()[0].removeprefix("key:"))
        assert verdict.key == f"plan-1:step_{step:03d}:{HASH}"
        assert (verdict.repeat_of is not None) == expected.endswith("repeat")


def test_decide_ignores_other_plans_and_args() -> None:
    """Records of another plan or other arguments never decide a call."""
    other = [
        Earlier(f"plan-2:step_001:{HASH}", "c1", "h1"),
        Earlier(f"plan-1:step_001:{'b' * 64}", "c1", "h1"),
    ]
    assert decide(_site("c1"), other, "replay", HASH) == Verdict()


def test_langgraph_tool_outside_a_graph_is_refused() -> None:
    """A LangGraph-default tool invoked directly cannot name its step and sends nothing."""
    with ToolInvoker("https://tools.example.com") as invoker:
        tool = remote_tool(name="charge", description="charge", args_schema=Order, invoker=invoker)
        with pytest.raises(ConfigurationError, match="ToolRuntime"):
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
