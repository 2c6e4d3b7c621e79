"""Issue 38, CrewAI: the tool wrapper, in one process, on a real tool server.

A CrewAI crew with a scripted ``BaseLLM`` (tests/frameworks/_crewai.py) calls the charge tool
behind agentkey's middleware on loopback, which counts its executions.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

pytest.importorskip("crewai", reason="the CrewAI tests run in `nox -s crewai`")

from agentkey import AsyncToolInvoker, ConfigurationError, PlanSession, ToolInvoker
from agentkey.integrations.crewai import flow_plan, remote_tool
from agentkey.journal import SQLiteJournal
from tests.frameworks._crewai import FAST, Charge, crew, shop_flow
from tests.integrations._race import Gate, tool_server
from tests.journal._tools import PlainTool

pytestmark = pytest.mark.timeout(180)

#: Two copies of one job, 10 times.
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


@pytest.mark.parametrize("retry", ["guardrail", "max_retry_limit"])
def test_a_retry_of_the_task_charges_once(retry: str, server: tuple[str, PlainTool]) -> None:
    """The task's guardrail refuses the first answer (or the model fails after the charge and
    the agent's max_retry_limit runs the task again): CrewAI executes the task again, its model
    asking for the charge again, and the retry reads the first call's answer, marked as a
    repeat under the same key; nothing is sent. One charge (a plain CrewAI tool ran 2)."""
    url, tool_app = server
    options: dict[str, int] = (
        {"guardrail_retries": 1} if retry == "guardrail" else {"model_failures": 1}
    )
    with ToolInvoker(url, route_template="/tools/{tool}", retry=FAST) as invoker:
        tool = remote_tool(
            name="charge",
            description="Charge the customer's card.",
            args_schema=Charge,
            invoker=invoker,
            plan=PlanSession.new(),
        )
        crew(tool, **options).kickoff()
    assert tool_app.executions["charge"] == 1
    first, again = cast(Any, tool).records
    assert first["outcome"] == "executed"
    assert again["outcome"] == "replayed"
    assert again["repeat_of"] == first["step"]
    assert again["idempotency_key"] == first["idempotency_key"]


def test_a_flow_run_again_with_its_state_id_charges_once(server: tuple[str, PlainTool]) -> None:
    """The same flow job kicked off twice with one state id (flow_plan): the second run's call
    gets the first run's key, the tool server replays, and it is marked as a repeat; another
    state id is another job, and its charge runs."""
    url, tool_app = server
    with ToolInvoker(url, route_template="/tools/{tool}", retry=FAST) as invoker:
        for state_id in ("job-1", "job-1", "job-2"):
            flow = shop_flow(invoker)
            flow.kickoff(inputs={"id": state_id})
        (record,) = flow.state.records
    assert tool_app.executions["charge"] == 2
    assert record["replayed"] is False


async def test_the_tool_awaited_directly_is_keyed_too(server: tuple[str, PlainTool]) -> None:
    """tool.arun(...) (CrewAI's async entry) goes through the same rule: a second identical
    call of the plan is a marked repeat, nothing sent."""
    url, tool_app = server
    with ToolInvoker(url, route_template="/tools/{tool}", retry=FAST) as invoker:
        tool = remote_tool(
            name="charge",
            description="Charge.",
            args_schema=Charge,
            invoker=invoker,
            plan=PlanSession.new(),
        )
        await tool.arun(amount=5)
        again = await tool.arun(amount=5)
    assert tool_app.executions["charge"] == 1
    assert again.startswith("[repeat of ")


def test_bad_sources_are_refused(server: tuple[str, PlainTool]) -> None:
    """An AsyncToolInvoker (CrewAI calls tools from its threads) and a flow without a state id
    are refused with ConfigurationError, saying what to pass."""
    url, _ = server
    invoker = AsyncToolInvoker(url)
    with pytest.raises(ConfigurationError, match="pass a ToolInvoker"):
        remote_tool(
            name="charge",
            description="Charge.",
            args_schema=Charge,
            invoker=invoker,  # type: ignore[arg-type]
            plan=PlanSession.new(),
        )
    with pytest.raises(ConfigurationError, match="state id"):
        flow_plan(object())


def test_two_copies_of_one_job_charge_once(
    server: tuple[str, PlainTool], journal: SQLiteJournal
) -> None:
    """One job (one saved plan) delivered twice at once, each copy a crew in its own thread
    with its own invoker, on one journal: one charge per job, 10 trials, and both copies read
    that call's answer under one key."""
    url, tool_app = server
    runs: list[int] = []

    def copy(saved: str, meeting: threading.Barrier) -> list[dict[str, Any]]:
        gate = Gate(journal, meeting)
        with ToolInvoker(url, route_template="/tools/{tool}", retry=FAST, journal=gate) as inv:
            tool = remote_tool(
                name="charge",
                description="Charge the customer's card.",
                args_schema=Charge,
                invoker=inv,
                plan=PlanSession.from_json(saved),
            )
            crew(tool).kickoff()
        return list(cast(Any, tool).records)

    for _ in range(TRIALS):
        before, saved = tool_app.executions["charge"], PlanSession(id=str(uuid.uuid4())).to_json()
        meeting = threading.Barrier(2)
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            futures = [pool.submit(copy, saved, meeting) for _ in range(2)]
            kept = [r for f in futures for r in f.result()]
        runs.append(tool_app.executions["charge"] - before)
        assert len({r["idempotency_key"] for r in kept}) == 1, kept
        assert sorted(bool(r["replayed"]) for r in kept) == [False, True], kept
    assert runs == [1] * TRIALS


def test_two_jobs_on_one_tool_object_keep_their_own_answers(
    server: tuple[str, PlainTool],
) -> None:
    """Two jobs (plans) interleaving on one tool object, same arguments: each job's first call
    runs (2 charges), and each job's repeat reads its own job's answer, marked; never the other
    job's."""
    url, tool_app = server
    plans = {"A": PlanSession.new(), "B": PlanSession.new()}
    job = ["A"]
    with ToolInvoker(url, route_template="/tools/{tool}", retry=FAST) as invoker:
        tool = remote_tool(
            name="charge",
            description="Charge.",
            args_schema=Charge,
            invoker=invoker,
            plan=lambda: plans[job[0]],
        )
        answers: dict[str, list[str]] = {"A": [], "B": []}
        for name in ("A", "B", "B", "A"):
            job[0] = name
            answers[name].append(str(tool.run(amount=5)))
    assert tool_app.executions["charge"] == 2
    for name in ("A", "B"):
        first, again = answers[name]
        assert not first.startswith("[repeat of "), first
        assert again.startswith("[repeat of "), again
        assert again.endswith(first), (first, again)
    assert json.loads(answers["A"][0]) != json.loads(answers["B"][0])


def test_a_job_resumed_after_another_job_is_marked(
    server: tuple[str, PlainTool], journal: SQLiteJournal
) -> None:
    """Job B's call is answered, then its worker dies; a new worker runs job A on its tool
    object, then resumes job B: B's call keeps its key, the tool server replays B's own
    answer and it is marked as a repeat (on main it came back unmarked, as if new): 2 charges."""
    url, tool_app = server
    plans = {"A": PlanSession.new(), "B": PlanSession.new()}
    job = ["B"]

    def worker() -> Any:
        return remote_tool(
            name="charge",
            description="Charge.",
            args_schema=Charge,
            invoker=invoker,
            plan=lambda: plans[job[0]],
        )

    with ToolInvoker(url, route_template="/tools/{tool}", retry=FAST, journal=journal) as invoker:
        crashed = str(worker().run(amount=5))
        tool = worker()  # the new worker's tool object
        job[0] = "A"
        other = str(tool.run(amount=5))
        job[0] = "B"
        resumed = str(tool.run(amount=5))
    assert tool_app.executions["charge"] == 2
    assert not other.startswith("[repeat of ")
    assert json.loads(other) != json.loads(crashed)
    assert resumed.startswith("[repeat of "), resumed
    assert resumed.endswith(crashed), (crashed, resumed)
    *_, record = cast(Any, tool).records
    assert record["repeat_of"] is not None
    assert record["replayed"] is True


def test_two_jobs_in_threads_on_one_tool_object(server: tuple[str, PlainTool]) -> None:
    """Two jobs in two threads at once on one tool object, each calling the charge twice (both
    first calls answered before either repeat): 2 charges, and each repeat is its own job's
    answer, marked."""
    url, tool_app = server
    mine = threading.local()
    meeting = threading.Barrier(2)
    with ToolInvoker(url, route_template="/tools/{tool}", retry=FAST) as invoker:
        tool = remote_tool(
            name="charge",
            description="Charge.",
            args_schema=Charge,
            invoker=invoker,
            plan=lambda: cast(PlanSession, mine.plan),
        )

        def job() -> tuple[str, str]:
            mine.plan = PlanSession.new()
            first = str(tool.run(amount=5))
            meeting.wait(timeout=60)
            return first, str(tool.run(amount=5))

        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            done = [f.result() for f in [pool.submit(job) for _ in range(2)]]
    assert tool_app.executions["charge"] == 2
    assert {json.loads(first)["run"] for first, _ in done} == {1, 2}
    for first, again in done:
        assert again.startswith("[repeat of "), again
        assert again.endswith(first), (first, again)


def test_the_memory_keeps_a_bounded_number_of_plans() -> None:
    """The tool's memory keeps the most recently used plans only: the oldest plan's calls are
    dropped (its numbering starts again), the others' are kept."""
    from agentkey.integrations.crewai import _Memory

    memory = _Memory(plans=2)
    for plan in ("A", "B", "A", "C"):
        memory.next_id(plan, "charge", "d" * 64)
    assert memory.next_id("A", "charge", "d" * 64).endswith(":2")
    assert memory.next_id("B", "charge", "d" * 64).endswith(":0")
