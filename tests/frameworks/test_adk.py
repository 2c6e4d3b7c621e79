"""Issue 38, Google ADK: the tool wrapper, in one process, on a real tool server.

An ADK ``Runner`` with a scripted ``BaseLlm`` (tests/frameworks/_adk.py) calls the charge tool
behind agentkey's middleware on loopback, which counts its executions.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

pytest.importorskip("google.adk", reason="the Google ADK tests run in `nox -s adk`")

from google.adk.runners import Runner
from google.adk.sessions import InMemorySessionService

from agentkey import AsyncToolInvoker, PlanSession, ToolInvoker
from agentkey.integrations.google_adk import remote_tool
from agentkey.journal import SQLiteJournal
from tests.frameworks._adk import FAST, Charge, app, records, turn
from tests.integrations._race import Gate, tool_server
from tests.journal._tools import PlainTool

pytestmark = pytest.mark.timeout(120)

#: Two copies of one job, 10 times (about a second in all).
TRIALS = 10


@pytest.fixture
def server() -> Iterator[tuple[str, PlainTool]]:
    with tool_server() as found:
        yield found


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[SQLiteJournal]:
    journal = SQLiteJournal(tmp_path / "journal.sqlite3")
    yield journal
    journal.close()


async def _shop(
    invoker: ToolInvoker | AsyncToolInvoker, session_id: str, tickets: int = 1
) -> tuple[Runner, InMemorySessionService]:
    service = InMemorySessionService()
    await service.create_session(app_name="shop", user_id="user-1", session_id=session_id)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner = Runner(app=app(invoker, tickets), session_service=service)
    return runner, service


@pytest.mark.parametrize("driver", ["sync", "async"])
async def test_a_turn_charges_once_and_records_the_call(
    driver: str, server: tuple[str, PlainTool], journal: SQLiteJournal
) -> None:
    """One turn: the charge runs once under a key of the session's plan; the model reads the
    tool's JSON body, and the session's state holds the call's record."""
    url, tool = server
    options: dict[str, Any] = {"route_template": "/tools/{tool}", "retry": FAST, "journal": journal}
    invoker: ToolInvoker | AsyncToolInvoker
    invoker = ToolInvoker(url, **options) if driver == "sync" else AsyncToolInvoker(url, **options)
    try:
        runner, service = await _shop(invoker, "s-1")
        (response,) = await turn(runner, "s-1")
    finally:
        if isinstance(invoker, ToolInvoker):
            invoker.close()
        else:
            await invoker.aclose()
    assert tool.executions["charge"] == 1
    assert response["response"]["run"] == 1
    record = (await records(service, "s-1"))[response["id"]]
    assert record["replayed"] is False
    assert record["repeat_of"] is None
    plan = PlanSession.from_external_id('["google-adk", "shop", "user-1", "s-1"]')
    assert record["idempotency_key"].startswith(plan.id)


async def test_a_later_turn_asking_again_is_answered_as_a_repeat(
    server: tuple[str, PlainTool], journal: SQLiteJournal
) -> None:
    """A second turn of the session whose model asks for the same charge after reading its
    answer: on_repeat="replay" answers with the earlier result, marked, and sends nothing; a
    new session is a new plan, and its charge runs."""
    url, tool = server
    async with AsyncToolInvoker(url, route_template="/tools/{tool}", retry=FAST) as invoker:
        runner, service = await _shop(invoker, "s-1")
        await turn(runner, "s-1")
        (again,) = await turn(runner, "s-1", "And charge it again.")
        assert tool.executions["charge"] == 1
        assert again["response"]["result"].startswith("[repeat of ")
        assert (await records(service, "s-1"))[again["id"]]["outcome"] == "replayed"
        other, _ = await _shop(invoker, "s-2")
        await turn(other, "s-2")
    assert tool.executions["charge"] == 2


async def test_two_identical_calls_in_one_response_run_twice(
    server: tuple[str, PlainTool], journal: SQLiteJournal
) -> None:
    """Two tickets at the same price in one model response are two charges: both run, under
    two keys, and neither answer carries a repeat note."""
    url, tool = server
    async with AsyncToolInvoker(
        url, route_template="/tools/{tool}", retry=FAST, journal=journal
    ) as invoker:
        runner, service = await _shop(invoker, "s-1", tickets=2)
        responses = await turn(runner, "s-1")
    assert tool.executions["charge"] == 2
    kept = await records(service, "s-1")
    assert len({kept[r["id"]]["idempotency_key"] for r in responses}) == 2
    assert not any("result" in r["response"] for r in responses)


async def test_arguments_that_do_not_fit_go_back_to_the_model(
    server: tuple[str, PlainTool],
) -> None:
    """Arguments that do not match the schema are not sent: the model reads an error that
    says what to correct, and nothing runs."""
    url, tool = server
    async with AsyncToolInvoker(url, route_template="/tools/{tool}", retry=FAST) as invoker:
        adk_tool = remote_tool(
            name="charge", description="charge", args_schema=Charge, invoker=invoker
        )
        answer = await adk_tool.run_async(args={"amount": "lots"}, tool_context=cast(Any, None))
    assert "do not match Charge" in answer["error"]
    assert tool.executions["charge"] == 0


async def test_two_copies_of_one_session_charge_once(
    server: tuple[str, PlainTool], journal: SQLiteJournal
) -> None:
    """One job (the same session id) delivered twice at once, each copy with its own session
    service, invoker and model drawing its own call id, on one journal: one charge per job,
    and both copies read that call's answer under one key."""
    url, tool = server
    runs: list[int] = []
    for _ in range(TRIALS):
        before, session_id = tool.executions["charge"], f"s-{uuid.uuid4().hex[:8]}"
        meeting = threading.Barrier(2)

        async def copy(meeting: threading.Barrier = meeting, session_id: str = session_id) -> Any:
            async with AsyncToolInvoker(
                url, route_template="/tools/{tool}", retry=FAST, journal=Gate(journal, meeting)
            ) as invoker:
                runner, service = await _shop(invoker, session_id)
                await turn(runner, session_id)
                return list((await records(service, session_id)).values())

        both = await asyncio.gather(copy(), copy())
        runs.append(tool.executions["charge"] - before)
        kept = [r for copy_records in both for r in copy_records]
        assert len({r["idempotency_key"] for r in kept}) == 1, kept
        assert sorted(bool(r["replayed"]) for r in kept) == [False, True], kept
    assert runs == [1] * TRIALS


@pytest.mark.parametrize("agents", ["parallel", "sequential"])
async def test_calls_on_two_branches_are_two_operations(
    agents: str, server: tuple[str, PlainTool], journal: SQLiteJournal
) -> None:
    """A ParallelAgent's two sub-agents each charge the same amount on a branch of their own:
    two operations, both run (neither answers the other's call). Two agents one after the
    other share one history: the second reads the first's answer, a marked repeat."""
    from google.adk.agents import LlmAgent, ParallelAgent, SequentialAgent

    from tests.frameworks._adk import ScriptedModel

    url, tool = server
    async with AsyncToolInvoker(
        url, route_template="/tools/{tool}", retry=FAST, journal=journal
    ) as invoker:
        charge = remote_tool(
            name="charge", description="charge", args_schema=Charge, invoker=invoker
        )
        desks = [LlmAgent(name=f"desk_{n}", model=ScriptedModel(), tools=[charge]) for n in (1, 2)]
        service = InMemorySessionService()
        await service.create_session(app_name="shop", user_id="user-1", session_id="s-1")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # both are deprecated in favour of Workflow
            root: Any = (
                ParallelAgent(name="shop", sub_agents=desks)
                if agents == "parallel"
                else SequentialAgent(name="shop", sub_agents=desks)
            )
            runner = Runner(app_name="shop", agent=root, session_service=service)
        responses = await turn(runner, "s-1")
    assert len(responses) == 2
    if agents == "parallel":
        assert tool.executions["charge"] == 2
        assert not any("result" in r["response"] for r in responses)
    else:
        assert tool.executions["charge"] == 1
        assert responses[1]["response"]["result"].startswith("[repeat of ")
