"""Issue 34 item 5: two copies of one job racing run each call once, in every integration.

Each trial starts two copies of one job at once (same trace id, run id, thread and
message id, or saved plan), each with its own invoker on one journal, and a
:class:`~tests.integrations._race.Gate` makes them reach the journal together. The
tool behind agentkey's middleware on loopback counts what it ran: one execution per
trial, and both copies get the one call's answer, under one key. Before, the
framework adapters looked for earlier calls in the journal, decided, then recorded:
both copies found nothing, took a key each, and both ran.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentkey import PlanSession
from agentkey.journal import SQLiteJournal
from tests._loopback import RedisServer
from tests._postgres import PostgresServer, postgres_proc  # noqa: F401  (the fixture)
from tests.integrations import _race
from tests.integrations._race import Gate, tool_server

pytestmark = pytest.mark.timeout(120)

TRIALS = 10
#: 10 trials in the default suite; 200 more behind the long marker.
MANY = pytest.mark.parametrize(
    "trials", [TRIALS, pytest.param(200, marks=[pytest.mark.long, pytest.mark.timeout(900)])]
)


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[SQLiteJournal]:
    journal = SQLiteJournal(tmp_path / "journal.sqlite3")
    yield journal
    journal.close()


def _one_call(records: list[dict[str, Any]]) -> None:
    """Both copies answered by one call: one key, one execution, the other its replay."""
    assert len(records) == 2, records
    assert len({r["idempotency_key"] for r in records}) == 1, records
    assert sorted(bool(r["replayed"]) for r in records) == [False, True], records


def _in_threads(copy: Callable[..., list[dict[str, Any]]], *args: Any) -> list[dict[str, Any]]:
    """Two copies of one job in two threads, meeting at the journal."""
    url, journal, *rest = args
    meeting = threading.Barrier(2)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(copy, url, Gate(journal, meeting), *rest) for _ in range(2)]
        return [r for f in futures for r in f.result()]


@pytest.fixture(params=["sqlite", "redis", "postgres"])
def any_journal(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A SQLite journal file (one machine), or a Redis or PostgreSQL journal (a fleet)."""
    journal: Any
    if request.param == "sqlite":
        journal = SQLiteJournal(tmp_path / "journal.sqlite3")
    elif request.param == "postgres":
        from agentkey.journal import PostgresJournal

        pg: PostgresServer = request.getfixturevalue("postgres_proc")
        journal = PostgresJournal(pg.dsn, table=f"race{uuid.uuid4().hex[:10]}")
    else:
        from agentkey.journal import RedisJournal

        server: RedisServer = request.getfixturevalue("redis_proc")
        journal = RedisJournal(server.url, prefix=f"race{uuid.uuid4().hex[:10]}")
    yield journal
    journal.close()


@MANY
@pytest.mark.parametrize("middleware", [True, False], ids=["honoured", "plain"])
async def test_openai_agents_copies_with_one_trace_id_charge_once(
    any_journal: Any, middleware: bool, trials: int
) -> None:
    """OpenAI Agents SDK, one job's trace_id run twice at once (two tasks), each model naming
    its call anew: 10 trials, one charge each, on a tool behind the middleware (the second
    copy's send is replayed) or a plain one (the second copy waits, and the journal answers).
    Before, 8 to 10 of 10 trials charged twice."""
    journal = any_journal
    runs: list[int] = []
    answers: list[list[dict[str, Any]]] = []
    with tool_server(middleware=middleware) as (url, tool):
        try:
            for _ in range(trials):
                before, trace_id = tool.executions["charge"], f"trace_{uuid.uuid4().hex}"
                meeting = threading.Barrier(2)
                both = await asyncio.gather(
                    *(_race.agents_copy(url, Gate(journal, meeting), trace_id) for _ in range(2))
                )
                runs.append(tool.executions["charge"] - before)
                answers.append([r for copy in both for r in copy])
        finally:
            await journal.aclose()  # its asyncio client belongs to this test's loop
    assert runs == [1] * trials
    for records in answers:
        _one_call(records)


async def test_pydantic_ai_copies_with_one_run_id_charge_once(journal: SQLiteJournal) -> None:
    """PydanticAI, one job's run_id run twice at once (two tasks), each model drawing its own
    call id: 10 trials, one charge each (2 to 4 of 6 ran twice before)."""
    pytest.importorskip("pydantic_ai", reason="PydanticAI needs Python 3.11+")
    runs: list[int] = []
    answers: list[list[dict[str, Any]]] = []
    with tool_server() as (url, tool):
        for _ in range(TRIALS):
            before, run_id = tool.executions["charge"], str(uuid.uuid4())
            meeting = threading.Barrier(2)
            both = await asyncio.gather(
                *(_race.pydantic_copy(url, Gate(journal, meeting), run_id) for _ in range(2))
            )
            runs.append(tool.executions["charge"] - before)
            answers.append([r for copy in both for r in copy])
    assert runs == [1] * TRIALS
    for records in answers:
        _one_call(records)


def test_langgraph_copies_with_one_thread_and_message_charge_once(journal: SQLiteJournal) -> None:
    """LangGraph's prebuilt agent, one request (same thread id, same user message id) run twice
    at once in two threads, each model drawing its own call id: 10 trials, one charge each."""
    runs: list[int] = []
    answers: list[list[dict[str, Any]]] = []
    with tool_server() as (url, tool):
        for _ in range(TRIALS):
            before = tool.executions["charge"]
            thread, message_id = f"thread-{uuid.uuid4().hex[:8]}", str(uuid.uuid4())
            records = _in_threads(_race.graph_copy, url, journal, thread, message_id)
            runs.append(tool.executions["charge"] - before)
            answers.append(records)
    assert runs == [1] * TRIALS
    for records in answers:
        _one_call(records)


def test_langchain_tool_copies_of_one_saved_plan_charge_once(journal: SQLiteJournal) -> None:
    """A LangChain tool, its step from the model's call id, on one job's saved plan run twice
    at once in two threads: 10 trials, one charge each."""
    runs: list[int] = []
    answers: list[list[dict[str, Any]]] = []
    with tool_server() as (url, tool):
        for _ in range(TRIALS):
            before, saved = tool.executions["charge"], PlanSession.new().to_json()
            records = _in_threads(_race.chain_copy, url, journal, saved)
            runs.append(tool.executions["charge"] - before)
            answers.append(records)
    assert runs == [1] * TRIALS
    for records in answers:
        _one_call(records)


def test_plain_loop_copies_of_one_saved_plan_charge_once(journal: SQLiteJournal) -> None:
    """A plain loop on one job's saved plan run twice at once in two threads: 10 trials, one
    charge each (the loop's own path, which got the race right already)."""
    runs: list[int] = []
    answers: list[list[dict[str, Any]]] = []
    with tool_server() as (url, tool):
        for _ in range(TRIALS):
            before, saved = tool.executions["charge"], PlanSession.new().to_json()
            records = _in_threads(_race.loop_copy, url, journal, saved)
            runs.append(tool.executions["charge"] - before)
            answers.append([{**r, "replayed": r["outcome"] == "replayed"} for r in records])
    assert runs == [1] * TRIALS
    for records in answers:
        _one_call(records)


async def test_mcp_client_copies_of_one_plan_create_once(journal: SQLiteJournal) -> None:
    """Two MCP client sessions of one job (one plan) call the same tool at once, keys derived
    by the client: 10 trials, one execution each, counted by the MCP server."""
    from agentkey.integrations.mcp import IdempotentSession, connect
    from agentkey.server import MemoryStore
    from tests.integrations._mcp_app import running

    runs: list[int] = []
    answers: list[list[Any]] = []
    with running(MemoryStore(), retry_after=1) as lab:
        for _ in range(TRIALS):
            before = lab.runs["create_vm"]
            plan_id, meeting = str(uuid.uuid4()), threading.Barrier(2)

            async def copy(plan_id: str = plan_id, meeting: Any = meeting) -> Any:
                async with connect(lab.url + "/mcp") as session:
                    tools = IdempotentSession(
                        session, PlanSession(id=plan_id), journal=Gate(journal, meeting),
                        policy=_race.FAST,
                    )  # fmt: skip
                    return await tools.call_tool("create_vm", {"region": "eu", "size": 1})

            answers.append(list(await asyncio.gather(copy(), copy())))
            runs.append(lab.runs["create_vm"] - before)
    assert runs == [1] * TRIALS
    for results in answers:
        assert len({r.idempotency_key for r in results}) == 1
        assert sorted(r.replayed for r in results) == [False, True]


@MANY
@pytest.mark.realtime
@pytest.mark.parametrize(
    ("framework", "store"),
    [
        ("openai-agents", "sqlite"),
        ("pydantic-ai", "sqlite"),
        ("langgraph", "sqlite"),
        ("openai-agents", "postgres"),
        ("langgraph", "postgres"),
    ],
)
def test_copies_in_two_processes_on_one_journal_charge_once(
    request: pytest.FixtureRequest, tmp_path: Path, framework: str, store: str, trials: int
) -> None:
    """Two processes on one SQLite journal file (or one PostgreSQL journal table), each
    running one copy of the same 10 jobs (same trace id, run id, or thread and message id),
    the two copies of each job at once: 10 charges in all, none doubled (before, 8 to 10 of
    the 10 OpenAI Agents jobs charged twice)."""
    if framework == "pydantic-ai":
        pytest.importorskip("pydantic_ai", reason="PydanticAI needs Python 3.11+")
    context = multiprocessing.get_context("spawn")
    meeting = context.Barrier(2)
    job_ids = [str(uuid.uuid4()) for _ in range(trials)]
    path, table = str(tmp_path / "shared.sqlite3"), None
    if store == "postgres":
        pg: PostgresServer = request.getfixturevalue("postgres_proc")
        path, table = pg.dsn, f"race{uuid.uuid4().hex[:10]}"
    with tool_server() as (url, tool):
        processes = [
            context.Process(
                target=_race.copies_in_a_process,
                args=(framework, url, path, meeting, job_ids, table, str(tmp_path / f"fail{n}")),
            )
            for n in range(2)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join(100 + 2 * trials)
        failures = [f.read_text() for f in sorted(tmp_path.glob("fail*"))]
        assert [p.exitcode for p in processes] == [0, 0], "\n".join(failures)
        assert tool.executions["charge"] == trials
        assert len(tool.answers) == trials  # one key per job
