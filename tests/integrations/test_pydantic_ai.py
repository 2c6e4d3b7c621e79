"""PydanticAI end to end: real Agents with a FunctionModel, a real tool server on loopback."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("pydantic_ai", reason="PydanticAI needs Python 3.11+")

from pydantic import BaseModel, Field
from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from agentkey import (
    AsyncToolInvoker,
    ConfigurationError,
    KeyRejected,
    PlanSession,
    StepKey,
    StepRepeated,
    ToolInvoker,
)
from agentkey.integrations.pydantic_ai import remote_tool
from tests._loopback import serve
from tests.invoker._toolapp import Faults, ToolApp

pytestmark = pytest.mark.timeout(60)


class Charge(BaseModel):
    amount: int = Field(gt=0)
    currency: str = "usd"


class Crash(Exception):
    """The process died after the tool ran, before the run finished."""


@pytest.fixture
def server() -> Iterator[tuple[str, ToolApp]]:
    tools = ToolApp()
    with serve(tools) as url:
        yield url, tools


def _model(*turns: list[ToolCallPart], crash: bool = False) -> FunctionModel:
    """A model that answers with one list of tool calls per turn, then text (or crashes)."""
    calls = iter(turns)

    def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        parts = next(calls, None)
        if parts is not None:
            return ModelResponse(parts=list(parts))
        if crash:
            raise Crash
        return ModelResponse(parts=[TextPart("done")])

    return FunctionModel(answer)


def _returns(messages: list[ModelMessage]) -> list[Any]:
    """The tool return parts (typed Any: their content is the tool's JSON body)."""
    return [
        p
        for m in messages
        if isinstance(m, ModelRequest)
        for p in m.parts
        if isinstance(p, ToolReturnPart)
    ]


def _body(part: Any) -> Any:
    """The tool's JSON body in a return, after the repeat note of a marked repeat."""
    content = part.content
    if isinstance(content, str) and content.startswith("[repeat of "):
        return json.loads(content.split("] ", 1)[1])
    return content


def _tool(invoker: ToolInvoker | AsyncToolInvoker, **kw: Any) -> Any:
    return remote_tool(
        name="charge", description="Charge a card.", args_schema=Charge, invoker=invoker, **kw
    )


@pytest.mark.parametrize("driver", ["sync", "async"])
async def test_rerun_with_the_same_run_id_replays(driver: str, server: tuple[str, ToolApp]) -> None:
    """A run started again with its run_id, its model naming the call anew: the call gets its
    first key back from the journal, the server replays, and the answer is marked a repeat."""
    url, tools = server
    invoker = (ToolInvoker if driver == "sync" else AsyncToolInvoker)(
        url, route_template="/tools/{tool}"
    )
    try:
        tool = _tool(invoker)
        first = Agent(
            _model([ToolCallPart("charge", {"amount": 5}, "c1")], crash=True), tools=[tool]
        )
        with pytest.raises(Crash):
            await first.run("charge it", run_id="job-42")
        # The re-asked model names its call differently and passes "5" as a string.
        again = Agent(_model([ToolCallPart("charge", {"amount": "5"}, "c9")]), tools=[tool])
        result = await again.run("charge it", run_id="job-42")
    finally:
        if isinstance(invoker, ToolInvoker):
            invoker.close()
        else:
            await invoker.aclose()
    (returned,) = _returns(result.all_messages())
    assert returned.metadata["replayed"] is True
    assert (
        returned.metadata["repeat_of"] == StepKey.parse(returned.metadata["idempotency_key"]).label
    )
    assert _body(returned)["execution"] == 1
    assert sum(tools.executions.values()) == 1
    key = StepKey.parse(returned.metadata["idempotency_key"])
    assert key.plan_session_id == PlanSession.from_external_id('["pydantic-ai", "job-42"]').id


async def test_another_run_id_is_another_plan(server: tuple[str, ToolApp]) -> None:
    """The same call in a run with another run_id is a new operation and runs."""
    url, tools = server
    with ToolInvoker(url, route_template="/tools/{tool}") as invoker:
        tool = _tool(invoker)
        for run_id in ("a", "b"):
            agent = Agent(_model([ToolCallPart("charge", {"amount": 5}, "c1")]), tools=[tool])
            await agent.run("charge it", run_id=run_id)
    assert sum(tools.executions.values()) == 2


async def test_identical_calls_keep_their_keys_in_any_order(server: tuple[str, ToolApp]) -> None:
    """Two identical calls run twice; re-asked in another order under new ids, each gets one of
    the first keys back (in order) and replays."""
    url, tools = server
    calls = [
        ToolCallPart("charge", {"amount": 5}, "x1"),
        ToolCallPart("charge", {"amount": 7}, "x2"),
        ToolCallPart("charge", {"amount": 5}, "x3"),
    ]
    with ToolInvoker(url, route_template="/tools/{tool}") as invoker:
        tool = _tool(invoker)
        with pytest.raises(Crash):
            await Agent(_model(calls, crash=True), tools=[tool]).run("go", run_id="r")
        renamed = [ToolCallPart(c.tool_name, c.args, "y" + c.tool_call_id) for c in calls[::-1]]
        result = await Agent(_model(renamed), tools=[tool]).run("go", run_id="r")
    returns = _returns(result.all_messages())
    assert sorted(_body(p)["execution"] for p in returns) == [1, 1, 1]
    assert all(p.metadata["replayed"] and p.metadata["repeat_of"] for p in returns)
    assert sum(tools.executions.values()) == 3
    assert len({p.metadata["idempotency_key"] for p in returns}) == 3


async def test_a_repeat_at_a_later_step_is_answered_from_memory(
    server: tuple[str, ToolApp],
) -> None:
    """A call the model asks for again at a later turn is not sent: the earlier result answers."""
    url, tools = server
    with ToolInvoker(url, route_template="/tools/{tool}") as invoker:
        agent = Agent(
            _model(
                [ToolCallPart("charge", {"amount": 5}, "c1")],
                [ToolCallPart("charge", {"amount": 5}, "c2")],
            ),
            tools=[_tool(invoker)],
        )
        result = await agent.run("charge it", run_id="rep")
    first, second = _returns(result.all_messages())
    assert second.metadata["repeat_of"] == first.metadata["step"]
    assert second.content.startswith(f"[repeat of {first.metadata['step']}")
    assert sum(tools.executions.values()) == 1


async def test_a_refusal_reaches_the_model_with_the_reason(server: tuple[str, ToolApp]) -> None:
    """A tool's 4xx becomes a failed tool result the model reads; the key is not in it."""
    url, tools = server
    tools.faults["charge"] = Faults(prelude=[(403, {})])
    seen: list[str] = []

    def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart("charge", {"amount": 5}, "c1")])
        seen.extend(str(p.content) for p in messages[-1].parts)  # type: ignore[union-attr]
        return ModelResponse(parts=[TextPart("cannot")])

    with ToolInvoker(url, route_template="/tools/{tool}") as invoker:
        agent = Agent(FunctionModel(answer), tools=[_tool(invoker)])
        await agent.run("charge it", run_id="no")
    (said,) = seen
    assert "refused this call" in said
    assert ":step_" not in said


def test_missing_pydantic_ai_names_the_extra() -> None:
    """Importing the adapter without PydanticAI raises MissingExtra naming the extra."""
    code = (
        "import sys\nsys.modules['pydantic_ai'] = None\nimport agentkey\n"
        "try:\n    import agentkey.integrations.pydantic_ai\n"
        "except agentkey.MissingExtra as exc:\n    print(exc.extra, exc.module)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "pydantic-ai pydantic_ai"


async def test_a_key_problem_ends_the_run(server: tuple[str, ToolApp]) -> None:
    """A 400 about the key is not the model's to fix: KeyRejected leaves agent.run."""
    url, tools = server
    tools.faults["charge"] = Faults(prelude=[(400, {})])
    with ToolInvoker(url, route_template="/tools/{tool}") as invoker:
        agent = Agent(_model([ToolCallPart("charge", {"amount": 5}, "c1")]), tools=[_tool(invoker)])
        with pytest.raises(KeyRejected) as raised:
            await agent.run("charge it", run_id="bad")
    assert raised.value.__cause__ is None


@pytest.mark.parametrize("policy", ["replay", "raise", "allow"])
@pytest.mark.parametrize("driver", ["sync", "async"])
async def test_a_repeat_the_model_read_follows_on_repeat(
    driver: str, policy: str, server: tuple[str, ToolApp]
) -> None:
    """A call the model asks for again after reading its answer: "replay" answers with it,
    marked, and sends nothing; "raise" ends the run with StepRepeated; "allow" runs it."""
    url, tools = server
    invoker = (ToolInvoker if driver == "sync" else AsyncToolInvoker)(
        url, route_template="/tools/{tool}"
    )
    model = _model(
        [ToolCallPart("charge", {"amount": 5}, "c1")],
        [ToolCallPart("charge", {"amount": 5}, "c2")],
    )
    agent = Agent(model, tools=[_tool(invoker, on_repeat=policy)])
    try:
        if policy == "raise":
            with pytest.raises(StepRepeated) as raised:
                await agent.run("charge it", run_id=f"policy-{driver}")
            assert raised.value.previous_step.startswith("step_")
            assert sum(tools.executions.values()) == 1
            return
        result = await agent.run("charge it", run_id=f"policy-{driver}")
    finally:
        if isinstance(invoker, ToolInvoker):
            invoker.close()
        else:
            await invoker.aclose()
    first, second = _returns(result.all_messages())
    if policy == "replay":
        assert second.metadata["repeat_of"] == first.metadata["step"]
        assert second.content.startswith("[repeat of ")
        assert len(tools.seen) == 1  # answered without a request
    else:
        assert second.metadata["repeat_of"] is None
        assert sum(tools.executions.values()) == 2


@pytest.mark.parametrize("policy", ["replay", "raise"])
async def test_a_repeat_of_an_earlier_runs_call_in_the_history(
    policy: str, server: tuple[str, ToolApp]
) -> None:
    """The next run of a conversation (its own run_id, the earlier messages given): a call the
    model read the answer of in those messages is answered with it, marked, and not sent (or
    raises StepRepeated naming the earlier step, under "raise")."""
    url, tools = server
    with ToolInvoker(url, route_template="/tools/{tool}") as invoker:
        tool = _tool(invoker, on_repeat=policy)
        first = await Agent(
            _model([ToolCallPart("charge", {"amount": 5}, "c1")]), tools=[tool]
        ).run("charge it", run_id="turn-1")
        (earlier,) = _returns(first.all_messages())
        later = Agent(_model([ToolCallPart("charge", {"amount": 5}, "c2")]), tools=[tool])
        history = first.all_messages()
        if policy == "raise":
            with pytest.raises(StepRepeated) as raised:
                await later.run("did you?", run_id="turn-2", message_history=history)
            assert raised.value.previous_step == earlier.metadata["step"]
            assert raised.value.idempotency_key == earlier.metadata["idempotency_key"]
        else:
            result = await later.run("did you?", run_id="turn-2", message_history=history)
            _, repeat = _returns(result.all_messages())
            assert repeat.content.startswith("[repeat of ")
            assert repeat.metadata["idempotency_key"] == earlier.metadata["idempotency_key"]
    assert sum(tools.executions.values()) == 1
    assert len(tools.seen) == 1


def test_a_history_that_lost_its_run_ids_is_refused_loudly() -> None:
    """Issue 38: a history whose unanswered earlier charge carries no run_id (rebuilt by hand,
    or by a UI) is refused with what to pass, and nothing reaches the tool; the same history
    as PydanticAI saved it (run ids kept) is served, under the earlier call's key."""
    import uuid

    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelRequest, ModelResponse, UserPromptPart, repair_messages

    from tests.integrations._race import ARGS, FAST, Charge, tool_server

    def history(run_id: str | None) -> list[Any]:
        prompt = ModelRequest([UserPromptPart("Charge my order.")], run_id=run_id)
        asked = ModelResponse([ToolCallPart("charge", dict(ARGS), "call_lost")], run_id=run_id)
        return repair_messages([prompt, asked])

    def model(messages: list[Any], info: Any) -> ModelResponse:
        answered = [  # a return of the tool (not one repair_messages() made up)
            p
            for p in getattr(messages[-1], "parts", ())
            if isinstance(p, ToolReturnPart) and "idempotency_key" in (p.metadata or {})
        ]
        if answered:
            return ModelResponse(parts=[TextPart("Charged.")])
        return ModelResponse(parts=[ToolCallPart("charge", dict(ARGS), f"c{uuid.uuid4().hex}")])

    with (
        tool_server() as (url, tool),
        ToolInvoker(url, route_template="/tools/{tool}", retry=FAST) as invoker,
    ):
        charge = remote_tool(name="charge", description="c", args_schema=Charge, invoker=invoker)
        agent = Agent(FunctionModel(model), tools=[charge])
        with pytest.raises(ConfigurationError, match="carries no run_id") as refused:
            agent.run_sync("Charge my order.", message_history=history(None))
        assert "ModelMessagesTypeAdapter" in str(refused.value)
        assert tool.executions["charge"] == 0
        result = agent.run_sync("Charge my order.", message_history=history(str(uuid.uuid4())))
        assert tool.executions["charge"] == 1
        (record,) = [
            p.metadata
            for m in result.new_messages()
            for p in getattr(m, "parts", ())
            if isinstance(p, ToolReturnPart)
        ]
        assert record["repeat_of"] is not None


def test_a_run_or_conversation_id_holding_the_separator_is_never_read_as_another_scope() -> None:
    """Run "r in conversation b" (no conversation) never reads as run "r" of conversation
    "b", nor conversation "a in conversation b" as conversation "b": ambiguous contexts are
    their own turn and match no conversation; plain ones still match theirs."""
    from agentkey.integrations.pydantic_ai import _context, _in_conversation, _turn

    other = _context(None, "other")
    odd_run = _context(None, "r in conversation b")
    assert _turn(odd_run) != _turn(_context("b", "r"))
    assert not _in_conversation(odd_run, "b", other)
    assert not _in_conversation(_context("a in conversation b", "r"), "b", other)
    assert _in_conversation(_context("b", "r"), "b", other)
    assert not _in_conversation(_context("b", "r"), "b", _context(None, "r"))
