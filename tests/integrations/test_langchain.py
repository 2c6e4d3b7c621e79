"""LangChain without LangGraph: explicit plan and step, real tools against the example server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from langchain_core.messages import ToolMessage
from pydantic import BaseModel

from agentkey import (
    AsyncToolInvoker,
    ConfigurationError,
    InvalidKey,
    PlanSession,
    StepKey,
    ToolError,
    ToolInvoker,
)
from agentkey.integrations.langchain import ToolCallContext, remote_tool
from tests.integrations._graph import DRIVERS, Driver, Order, close, make_invoker, running_server

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server() -> Iterator[tuple[str, Any]]:
    """A fresh example server per test, so execution counts start at zero."""
    with running_server() as running:
        yield running


async def _invoke(driver: Driver, tool: Any, tool_input: Any, config: Any = None) -> Any:
    if driver == "sync":
        return tool.invoke(tool_input, config)
    return await tool.ainvoke(tool_input, config)


def _tool_call(call_id: str, **args: Any) -> dict[str, Any]:
    return {"name": "charge", "args": args, "id": call_id, "type": "tool_call"}


@pytest.mark.parametrize("driver", DRIVERS)
async def test_retried_call_replays_and_model_reads_the_body(
    driver: Driver, server: tuple[str, Any]
) -> None:
    """The same step sent twice runs once; the second ToolMessage is marked replayed."""
    url, app = server
    plan = PlanSession.new()
    invoker = make_invoker(driver, url)
    tool = remote_tool(
        name="charge",
        description="charge an order",
        args_schema=Order,
        invoker=invoker,
        plan=plan,
        step_index=(4, 1),
    )
    first = await _invoke(driver, tool, _tool_call("a", amount=5))
    second = await _invoke(driver, tool, _tool_call("b", amount="5"))  # coerced by the schema
    content = await _invoke(driver, tool, {"amount": 5})  # plain dict input: content only
    await close(invoker)

    assert isinstance(first, ToolMessage)
    assert isinstance(second, ToolMessage)
    assert first.artifact["outcome"] == "executed"
    assert second.artifact["replayed"] is True
    assert first.artifact["idempotency_key"] == second.artifact["idempotency_key"]
    key = StepKey.parse(first.artifact["idempotency_key"])
    assert (key.plan_session_id, key.label) == (plan.id, "step_004.001")
    assert "charge_id" in first.content
    assert first.content == second.content == content
    assert "headers" not in first.artifact
    assert app.state.executions["charge"] == 1


@pytest.mark.parametrize("driver", DRIVERS)
async def test_step_index_callable_reads_the_loop_position(
    driver: Driver, server: tuple[str, Any]
) -> None:
    """A plan-and-execute loop passes its step through the config; each step runs once."""
    url, app = server
    plan = PlanSession.from_external_id("run-42")
    seen: list[ToolCallContext] = []

    def plan_step(ctx: ToolCallContext) -> int:
        seen.append(ctx)
        step: int = ctx.config["metadata"]["plan_step"]
        return step

    invoker = make_invoker(driver, url)
    tool = remote_tool(
        name="charge",
        description="charge an order",
        args_schema=Order,
        invoker=invoker,
        plan=lambda ctx: plan,
        step_index=plan_step,
    )
    for step in (0, 1, 1):  # step 1 retried after, say, an orchestrator restart
        await _invoke(
            driver, tool, _tool_call(f"s{step}", amount=5 + step), {"metadata": {"plan_step": step}}
        )
    await close(invoker)

    assert seen[0].args == {"amount": 5, "currency": "usd", "region": "eu-west-1"}
    assert seen[0].tool == "charge"
    assert seen[0].state is None
    assert app.state.executions["charge"] == 2


@pytest.mark.parametrize("driver", DRIVERS)
async def test_final_tool_errors_propagate_typed(driver: Driver, server: tuple[str, Any]) -> None:
    """With errors_to_model=False a 4xx raises agentkey's ToolError carrying the key and step."""
    url, _ = server
    invoker = make_invoker(driver, url)
    tool = remote_tool(
        name="charge",
        description="charge an order",
        args_schema=Order,
        invoker=invoker,
        plan=PlanSession.from_external_id("errs"),
        step_index=7,
        errors_to_model=False,
    )
    with pytest.raises(ToolError) as caught:
        await _invoke(driver, tool, {"amount": -1})
    await close(invoker)
    assert caught.value.status_code == 400
    assert caught.value.step == "step_007"
    assert caught.value.idempotency_key is not None


async def test_async_invoker_refuses_sync_invoke(server: tuple[str, Any]) -> None:
    """tool.invoke on an AsyncToolInvoker tool raises ConfigurationError and sends nothing."""
    url, app = server
    invoker = AsyncToolInvoker(url, route_template="/tools/{tool}")
    tool = remote_tool(
        name="charge",
        description="charge an order",
        args_schema=Order,
        invoker=invoker,
        plan=PlanSession.new(),
        step_index=0,
    )
    with pytest.raises(ConfigurationError, match="ainvoke"):
        tool.invoke({"amount": 5})
    await invoker.aclose()
    assert not app.state.executions


class Clashing(BaseModel):
    """A schema using a name LangChain passes to the tool function itself."""

    config: str


_GOOD: dict[str, Any] = {
    "name": "charge",
    "description": "charge an order",
    "args_schema": Order,
    "plan": PlanSession.new(),
    "step_index": 0,
}
_BAD: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("empty name", {"name": ""}, ConfigurationError, "name"),
    ("blank description", {"description": "  "}, ConfigurationError, "description"),
    ("schema not a model", {"args_schema": dict}, ConfigurationError, "BaseModel"),
    ("reserved field", {"args_schema": Clashing}, ConfigurationError, "config"),
    ("plan not a session", {"plan": "plan-1"}, ConfigurationError, "PlanSession"),
    ("negative step", {"step_index": -1}, InvalidKey, ">= 0"),
    ("empty step", {"step_index": ()}, InvalidKey, "empty"),
    ("invoker missing", {"invoker": object()}, ConfigurationError, "ToolInvoker"),
]


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [case[1:] for case in _BAD],
    ids=[case[0] for case in _BAD],
)
def test_bad_options_fail_at_construction(
    change: dict[str, Any], error: type[Exception], match: str
) -> None:
    """Every wrong option is a typed error when the tool is built, not when it is called."""
    with ToolInvoker("https://tools.example.com") as invoker, pytest.raises(error, match=match):
        remote_tool(**{**_GOOD, "invoker": invoker, **change})


def test_plan_callable_must_return_a_session() -> None:
    """A plan callable returning something else is a ConfigurationError before any request."""
    with ToolInvoker("https://tools.example.com") as invoker:
        tool = remote_tool(**{**_GOOD, "invoker": invoker, "plan": lambda ctx: "plan-1"})
        with pytest.raises(ConfigurationError, match="not a PlanSession"):
            tool.invoke({"amount": 5})
