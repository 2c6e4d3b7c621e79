"""LangChainHook: the invoker's retries, polls and replays reach the tool's LangChain run."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from uuid import UUID

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.tracers.run_collector import RunCollectorCallbackHandler
from pydantic import BaseModel

from agentkey import (
    AsyncToolInvoker,
    InvokeHook,
    LoggingHook,
    PlanSession,
    PollPolicy,
    RetryPolicy,
    ToolInvoker,
)
from agentkey.integrations._adapter import code
from agentkey.integrations.langchain import LangChainHook, remote_tool
from agentkey.integrations.langgraph import call_step
from agentkey.integrations.langgraph import remote_tool as graph_tool
from tests._loopback import serve
from tests.invoker._toolapp import Faults, ToolApp

pytestmark = pytest.mark.timeout(60)

FAST = RetryPolicy(initial_backoff=0.01, max_backoff=0.02, jitter=False)
POLL = PollPolicy(initial_backoff=0.01, max_backoff=0.02)


class Build(BaseModel):
    image: str


class Recorder(BaseCallbackHandler):
    """Records tool runs and the custom events each run received."""

    def __init__(self) -> None:
        self.tool_runs: list[UUID] = []
        self.events: list[tuple[str, dict[str, Any], UUID]] = []

    def on_tool_start(self, serialized: Any, input_str: str, *, run_id: UUID, **kw: Any) -> None:
        self.tool_runs.append(run_id)

    def on_custom_event(self, name: str, data: Any, *, run_id: UUID, **kw: Any) -> None:
        self.events.append((name, data, run_id))


@pytest.fixture
def server() -> Iterator[tuple[str, ToolApp]]:
    tools = ToolApp()
    with serve(tools) as url:
        yield url, tools


def _tool(invoker: Any, plan: PlanSession, index: int) -> Any:
    return remote_tool(
        name="build",
        description="Build an image.",
        args_schema=Build,
        invoker=invoker,
        plan=plan,
        step_index=index,
    )


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_retries_polls_and_replays_reach_the_tool_run(
    kind: str, server: tuple[str, ToolApp]
) -> None:
    """A 503, a 202 polled once, then a replay: custom events on each tool's own run."""
    url, tools = server
    tools.faults["build"] = Faults(prelude=[(503, {"Retry-After": "0"})], async_polls=1)
    recorder, collector = Recorder(), RunCollectorCallbackHandler()
    config: Any = {"callbacks": [recorder, collector]}
    plan = PlanSession.new()
    hooks: list[InvokeHook] = [LoggingHook(), LangChainHook()]
    if kind == "sync":
        with ToolInvoker(url, route_template="/tools/{tool}", retry=FAST, polling=POLL,
                         hooks=hooks) as invoker:  # fmt: skip
            for _ in range(2):
                _tool(invoker, plan, 0).invoke({"image": "api"}, config=config)
    else:
        async with AsyncToolInvoker(url, route_template="/tools/{tool}", retry=FAST,
                                    polling=POLL, hooks=hooks) as ainvoker:  # fmt: skip
            for _ in range(2):
                await _tool(ainvoker, plan, 0).ainvoke({"image": "api"}, config=config)
    first_run, second_run = recorder.tool_runs
    by_run: dict[UUID, list[str]] = {}
    for name, data, run_id in recorder.events:
        by_run.setdefault(run_id, []).append(name)
        assert data["idempotency_key"] == plan.step(0, "build", {"image": "api"}).idempotency_key
    assert by_run[first_run][0] == "agentkey_retry"
    assert "agentkey_poll" in by_run[first_run]
    assert by_run[second_run][0] == "agentkey_replay"
    assert sum(tools.executions.values()) == 1
    # Tracers that keep runs (LangSmith's) get them as events of the tool's run.
    traced = {run.id: [e["name"] for e in run.events] for run in collector.traced_runs}
    assert [n for n in traced[first_run] if n.startswith("agentkey_")] == by_run[first_run]
    assert [n for n in traced[second_run] if n.startswith("agentkey_")] == by_run[second_run]


def test_outside_a_langchain_run_the_hook_does_nothing(server: tuple[str, ToolApp]) -> None:
    """A direct invoke with the hook installed sends and returns as without it."""
    url, tools = server
    tools.faults["build"] = Faults(prelude=[(503, {"Retry-After": "0"})])
    step = PlanSession.new().step(0, "build", {"image": "api"})
    with ToolInvoker(url, route_template="/tools/{tool}", retry=FAST,
                     hooks=[LangChainHook()]) as invoker:  # fmt: skip
        assert invoker.invoke(step).attempts == 2


def test_a_refused_runtime_call_is_traced_under_the_step_the_flow_decided(
    server: tuple[str, ToolApp],
) -> None:
    """A LangGraph-keyed tool refused by the tool (403): the tool run's metadata names the key
    and step the flow decided for the call, never the placeholder step it was prepared with."""
    url, tools = server
    tools.faults["build"] = Faults(prelude=[(403, {})])
    collector = RunCollectorCallbackHandler()
    plan = PlanSession.new()
    with ToolInvoker(url, route_template="/tools/{tool}", retry=FAST) as invoker:
        tool = graph_tool(
            name="build",
            description="Build an image.",
            args_schema=Build,
            invoker=invoker,
            plan=plan,
            step_index=call_step,
        )
        call = {"name": "build", "args": {"image": "api"}, "id": "call-1", "type": "tool_call"}
        message = tool.invoke(call, config={"callbacks": [collector]})
    assert message.status == "error"
    (run,) = collector.traced_runs
    metadata = run.extra["metadata"]
    step = PlanSession(id=plan.id).step((code("build"), code("call-1")), "build", {"image": "api"})
    assert metadata["agentkey_step"] == step.label != "step_000"
    assert metadata["agentkey_idempotency_key"] == step.idempotency_key
