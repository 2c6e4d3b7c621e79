"""OpenAI Agents SDK end to end: real Runner, ScriptedModel (no network), loopback tool server."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from agents import Agent, RunConfig, Runner, UserError
from agents.items import ToolCallOutputItem
from agents.testing import ScriptedModel, assistant_message, function_call
from pydantic import BaseModel, Field

from agentkey import AsyncToolInvoker, ConfigurationError, ToolInvoker
from agentkey.integrations.openai_agents import _session, remote_tool
from tests._loopback import serve
from tests.invoker._toolapp import Faults, ToolApp

pytestmark = pytest.mark.timeout(60)


class Charge(BaseModel):
    amount: int = Field(gt=0)


class Crash(Exception):
    """The process died after the tool ran, before the run finished."""


@pytest.fixture
def server() -> Iterator[tuple[str, ToolApp]]:
    tools = ToolApp()
    with serve(tools) as url:
        yield url, tools


def _config(trace_id: str | None) -> RunConfig:
    return RunConfig(trace_id=trace_id, tracing_disabled=True)


def _agent(invoker: ToolInvoker | AsyncToolInvoker, *steps: Any) -> Agent[Any]:
    tool = remote_tool(
        name="charge", description="Charge a card.", args_schema=Charge, invoker=invoker
    )
    return Agent(name="shop", model=ScriptedModel(list(steps)), tools=[tool])


def _outputs(result: Any) -> list[ToolCallOutputItem]:
    return [i for i in result.new_items if isinstance(i, ToolCallOutputItem)]


@pytest.mark.parametrize("driver", ["sync", "async"])
async def test_a_recorded_call_run_again_replays(driver: str, server: tuple[str, ToolApp]) -> None:
    """The same trace_id and recorded tool call (a durable replay) resend the key: one execution."""
    url, tools = server
    invoker = (ToolInvoker if driver == "sync" else AsyncToolInvoker)(
        url, route_template="/tools/{tool}"
    )
    recorded = [function_call("charge", {"amount": 5}, call_id="call_1")]
    try:
        with pytest.raises(Crash):
            await Runner.run(_agent(invoker, recorded, Crash()), "pay", run_config=_config("t1"))
        again = _agent(invoker, recorded, [assistant_message("paid")])
        result = await Runner.run(again, "pay", run_config=_config("t1"))
    finally:
        if isinstance(invoker, ToolInvoker):
            invoker.close()
        else:
            await invoker.aclose()
    (output,) = _outputs(result)
    assert output.custom_data is not None
    assert output.custom_data["replayed"] is True
    assert '"execution": 1' in output.output
    assert sum(tools.executions.values()) == 1


@pytest.mark.parametrize("restart", [False, True], ids=["same process", "after a restart"])
async def test_a_call_named_anew(restart: bool, server: tuple[str, ToolApp]) -> None:
    """A re-asked model names its call anew: the process's plan memory replays it; a restart
    loses that memory, and the call runs again (the documented limit)."""
    url, tools = server
    with ToolInvoker(url, route_template="/tools/{tool}") as invoker:
        for call_id in ("call_1", "call_2"):
            step = [function_call("charge", {"amount": 5}, call_id=call_id)]
            agent = _agent(invoker, step, [assistant_message("paid")])
            await Runner.run(agent, "pay", run_config=_config(f"t2-{restart}"))
            if restart:
                _session.cache_clear()  # what a new process starts with
    assert sum(tools.executions.values()) == (2 if restart else 1)


async def test_a_repeat_in_the_run_replays(server: tuple[str, ToolApp]) -> None:
    """A call the model repeats at a later turn resends the first call's key: one execution."""
    url, tools = server
    with ToolInvoker(url, route_template="/tools/{tool}") as invoker:
        agent = _agent(
            invoker,
            [function_call("charge", {"amount": 5}, call_id="a")],
            [function_call("charge", {"amount": 5}, call_id="b")],
            [assistant_message("paid")],
        )
        result = await Runner.run(agent, "pay", run_config=_config("t3"))
    first, second = _outputs(result)
    assert second.custom_data is not None
    assert first.custom_data is not None
    assert second.custom_data["repeat_of"] == first.custom_data["step"]
    assert second.output.startswith("[repeat of")
    assert sum(tools.executions.values()) == 1


async def test_a_run_without_a_trace_id_is_refused(server: tuple[str, ToolApp]) -> None:
    """No explicit trace_id: ConfigurationError (wrapped by the SDK), and nothing is sent."""
    url, tools = server
    with ToolInvoker(url, route_template="/tools/{tool}") as invoker:
        agent = _agent(invoker, [function_call("charge", {"amount": 5}, call_id="a")])
        with pytest.raises(UserError) as raised:
            await Runner.run(agent, "pay", run_config=_config(None))
    # The SDK wraps what a tool raises; the agentkey error is its cause.
    assert isinstance(raised.value.__cause__, ConfigurationError)
    assert "trace_id" in str(raised.value.__cause__)
    assert tools.seen == []


async def test_refusals_and_bad_arguments_reach_the_model(server: tuple[str, ToolApp]) -> None:
    """A 4xx and arguments outside the schema become error text for the model, without the key."""
    url, tools = server
    tools.faults["charge"] = Faults(prelude=[(403, {})])
    with ToolInvoker(url, route_template="/tools/{tool}") as invoker:
        agent = _agent(
            invoker,
            [function_call("charge", {"amount": 5}, call_id="a")],
            [function_call("charge", {"amount": -1}, call_id="b")],
            [assistant_message("cannot")],
        )
        result = await Runner.run(agent, "pay", run_config=_config("t4"))
    refused, invalid = _outputs(result)
    assert "refused this call" in refused.output
    assert ":step_" not in refused.output
    assert "do not match Charge" in invalid.output
    assert sum(tools.executions.values()) == 0


def test_missing_agents_sdk_names_the_extra() -> None:
    """Importing the adapter without the Agents SDK raises MissingExtra naming the extra."""
    code = (
        "import sys\nsys.modules['agents'] = None\nimport agentkey\n"
        "try:\n    import agentkey.integrations.openai_agents\n"
        "except agentkey.MissingExtra as exc:\n    print(exc.extra, exc.module)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "openai-agents agents"
