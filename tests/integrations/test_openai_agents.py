"""OpenAI Agents SDK end to end: real Runner, ScriptedModel (no network), loopback tool server."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from agents import Agent, RunConfig, Runner, UserError
from agents.items import ToolCallOutputItem
from agents.run_config import ToolExecutionConfig
from agents.testing import ScriptedModel, assistant_message, function_call
from agents.usage import Usage
from pydantic import BaseModel, Field

from agentkey import AsyncToolInvoker, ConfigurationError, StepRepeated, ToolInvoker
from agentkey.integrations.openai_agents import remote_tool
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


def _agent(
    invoker: ToolInvoker | AsyncToolInvoker, *steps: Any, on_repeat: Any = "replay"
) -> Agent[Any]:
    tool = remote_tool(
        name="charge",
        description="Charge a card.",
        args_schema=Charge,
        invoker=invoker,
        on_repeat=on_repeat,
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


async def test_a_call_named_anew(server: tuple[str, ToolApp]) -> None:
    """A run started over with its trace_id, whose model names its call anew: the journal gives
    the call its first key back, the answer is marked as a repeat, and it runs once."""
    url, tools = server
    outputs = []
    with ToolInvoker(url, route_template="/tools/{tool}") as invoker:
        for call_id in ("call_1", "call_2"):
            step = [function_call("charge", {"amount": 5}, call_id=call_id)]
            agent = _agent(invoker, step, [assistant_message("paid")])
            outputs += _outputs(await Runner.run(agent, "pay", run_config=_config("t2")))
    first, again = outputs
    assert first.custom_data is not None
    assert again.custom_data is not None
    assert again.custom_data["repeat_of"] == first.custom_data["step"]
    assert again.custom_data["idempotency_key"] == first.custom_data["idempotency_key"]
    assert again.output.startswith("[repeat of")
    assert sum(tools.executions.values()) == 1


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


def _twins(*call_ids: str) -> list[Any]:
    return [function_call("charge", {"amount": 5}, call_id=c) for c in call_ids]


async def _close(invoker: ToolInvoker | AsyncToolInvoker) -> None:
    if isinstance(invoker, ToolInvoker):
        invoker.close()
    else:
        await invoker.aclose()


@pytest.mark.parametrize("concurrency", [None, 1], ids=["in parallel", "one at a time"])
@pytest.mark.parametrize("driver", ["sync", "async"])
async def test_identical_calls_in_one_response_run_twice(
    driver: str, concurrency: int | None, server: tuple[str, ToolApp]
) -> None:
    """Two identical calls in one model response (two tickets) are two operations: both run,
    under two keys, and neither answer carries a repeat note; also when the SDK runs them one
    after the other."""
    url, tools = server
    invoker = (ToolInvoker if driver == "sync" else AsyncToolInvoker)(
        url, route_template="/tools/{tool}"
    )
    config = _config("twins")
    if concurrency is not None:
        config.tool_execution = ToolExecutionConfig(max_function_tool_concurrency=concurrency)
    try:
        agent = _agent(invoker, _twins("a", "b"), [assistant_message("two tickets")])
        result = await Runner.run(agent, "two tickets", run_config=config)
    finally:
        await _close(invoker)
    first, second = _outputs(result)
    assert first.custom_data is not None
    assert second.custom_data is not None
    assert first.custom_data["idempotency_key"] != second.custom_data["idempotency_key"]
    assert first.custom_data["repeat_of"] is None
    assert second.custom_data["repeat_of"] is None
    assert not any(o.output.startswith("[repeat of") for o in (first, second))
    assert sum(tools.executions.values()) == 2


async def test_a_model_without_usage_marks_a_twin_run_after_its_sibling(
    server: tuple[str, ToolApp],
) -> None:
    """A model that reports no usage leaves usage.requests at 0, so a twin the SDK runs after
    its sibling answered cannot be told from a later turn's repeat: it is answered as a marked
    repeat (the documented limit), never run twice silently nor returned unmarked."""
    url, tools = server
    model = ScriptedModel([_twins("a", "b"), [assistant_message("done")]])
    model.set_default_usage(Usage(input_tokens=1))
    config = _config("no-usage")
    config.tool_execution = ToolExecutionConfig(max_function_tool_concurrency=1)
    with ToolInvoker(url, route_template="/tools/{tool}") as invoker:
        tool = remote_tool(
            name="charge", description="Charge a card.", args_schema=Charge, invoker=invoker
        )
        result = await Runner.run(
            Agent(name="shop", model=model, tools=[tool]), "pay", run_config=config
        )
    _first, second = _outputs(result)
    assert second.output.startswith("[repeat of")
    assert sum(tools.executions.values()) == 1


@pytest.mark.parametrize("policy", ["replay", "raise", "allow"])
async def test_a_repeat_at_a_later_turn_follows_on_repeat(
    policy: str, server: tuple[str, ToolApp]
) -> None:
    """A call the model asks for again after reading its answer: "replay" answers with it,
    marked, and sends nothing; "raise" stops the run with StepRepeated; "allow" runs it."""
    url, tools = server
    with ToolInvoker(url, route_template="/tools/{tool}") as invoker:
        tool = remote_tool(
            name="charge",
            description="Charge a card.",
            args_schema=Charge,
            invoker=invoker,
            on_repeat=policy,  # type: ignore[arg-type]
        )
        model = ScriptedModel([_twins("a"), _twins("b"), [assistant_message("paid")]])
        agent = Agent(name="shop", model=model, tools=[tool])
        if policy == "raise":
            with pytest.raises(UserError) as raised:
                await Runner.run(agent, "pay", run_config=_config(f"later-{policy}"))
            assert isinstance(raised.value.__cause__, StepRepeated)
            assert sum(tools.executions.values()) == 1
            return
        result = await Runner.run(agent, "pay", run_config=_config(f"later-{policy}"))
    first, second = _outputs(result)
    if policy == "replay":
        assert first.custom_data is not None
        assert second.custom_data is not None
        assert second.output.startswith("[repeat of")
        assert second.custom_data["repeat_of"] == first.custom_data["step"]
        assert second.custom_data["outcome"] == "replayed"
        assert sum(tools.executions.values()) == 1
        assert len(tools.seen) == 1  # the repeat was answered without a request
    else:
        assert not second.output.startswith("[repeat of")
        assert sum(tools.executions.values()) == 2


async def test_a_call_read_in_the_runs_input_is_a_repeat(server: tuple[str, ToolApp]) -> None:
    """The next turn of a conversation (the earlier items passed back in, same trace_id): a
    call the model read the answer of in that input is answered with it, marked, unsent."""
    url, tools = server
    with ToolInvoker(url, route_template="/tools/{tool}") as invoker:
        first = await Runner.run(
            _agent(invoker, _twins("a"), [assistant_message("paid")]),
            "pay",
            run_config=_config("conversation"),
        )
        history = [*first.to_input_list(), {"role": "user", "content": "did you pay?"}]
        later = await Runner.run(
            _agent(invoker, _twins("b"), [assistant_message("yes")]),
            history,  # type: ignore[arg-type]
            run_config=_config("conversation"),
        )
    (repeat,) = _outputs(later)
    assert repeat.output.startswith("[repeat of")
    assert sum(tools.executions.values()) == 1
    assert len(tools.seen) == 1


@pytest.mark.parametrize("policy", ["replay", "raise"])
@pytest.mark.parametrize("where", ["in the run", "in the run's input"])
async def test_a_refused_call_asked_again_is_a_new_call(
    where: str, policy: str, server: tuple[str, ToolApp]
) -> None:
    """The model read a refusal (the tool said 403), not a result: asking again sends a new
    call, which runs, whether the refusal is in this run or in the input it was given, and
    whatever on_repeat says (the journal, not the text the model read, says it was refused)."""
    url, tools = server
    tools.faults["charge"] = Faults(prelude=[(403, {})])
    with ToolInvoker(url, route_template="/tools/{tool}") as invoker:
        if where == "in the run":
            agent = _agent(
                invoker, _twins("a"), _twins("b"), [assistant_message("paid")], on_repeat=policy
            )
            result = await Runner.run(agent, "pay", run_config=_config("refused"))
        else:
            agent = _agent(invoker, _twins("a"), [assistant_message("refused")])
            first = await Runner.run(agent, "pay", run_config=_config("refused"))
            again = _agent(invoker, _twins("b"), [assistant_message("paid")], on_repeat=policy)
            history = [*first.to_input_list(), {"role": "user", "content": "try again"}]
            result = await Runner.run(again, history, run_config=_config("refused"))  # type: ignore[arg-type]
    answer = _outputs(result)[-1]
    assert not answer.output.startswith("[repeat of")
    assert "refused" not in answer.output
    assert sum(tools.executions.values()) == 1


def test_a_trace_or_group_id_holding_the_separator_is_never_read_as_another_scope() -> None:
    """Group "x in group g" never reads as group "g", nor trace "t in group g" as a trace of
    group "g": ambiguous contexts are their own turn and match no group."""
    from agentkey.integrations.openai_agents import _in_group, _turn

    assert not _in_group("openai-agents trace t in group x in group g", "g", "mine")
    assert not _in_group("openai-agents trace t in group g in group ", "g", "mine")
    assert _turn("openai-agents trace t in group g in group ") != "openai-agents trace t"
    assert _in_group("openai-agents trace t in group g", "g", "mine")
