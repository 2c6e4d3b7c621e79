"""Issue 23, case 7, OpenAI Agents SDK: identical calls in one turn, and a run restarted in a
new process with its trace_id, with real processes killed.

The SDK's ``Runner`` with its ``ScriptedModel`` in a process of its own; the charge tool
behind agentkey's middleware on loopback, counting its executions.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.recovery._process import Recovery, recovery

pytestmark = [pytest.mark.realtime, pytest.mark.timeout(120)]

TRACE = "trace_4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Recovery]:
    with recovery("tests.recovery._openai_agent", tmp_path) as setup:
        yield setup


def test_two_identical_calls_in_one_turn_run_twice(run: Recovery) -> None:
    """Two tickets at the same price in one model response are two charges: both run, under
    two keys, and neither answer carries a repeat note."""
    outputs, _ = run.again("--trace-id", TRACE, "--tickets", "2")
    assert run.tool.executions["charge"] == 2
    assert len({o["record"]["idempotency_key"] for o in outputs}) == 2
    assert all(o["record"]["repeat_of"] is None for o in outputs)
    assert not any(o["output"].startswith("[repeat of") for o in outputs)


def test_a_run_restarted_in_a_new_process_charges_once(run: Recovery) -> None:
    """Killed after the charge ran; the run started over in a new process with its trace_id,
    its model naming the call anew: the journal gives it the first key, the tool replays, and
    the answer is marked as a repeat. One charge."""
    run.killed("--trace-id", TRACE)
    outputs, _ = run.again("--trace-id", TRACE)
    assert run.tool.executions["charge"] == 1
    (output,) = outputs
    assert output["record"]["replayed"] is True
    assert output["record"]["repeat_of"] == output["record"]["step"]
    assert output["output"].startswith("[repeat of ")


def test_two_tickets_restarted_in_a_new_process_charge_twice(run: Recovery) -> None:
    """Killed after both charges of one response ran; started over, the two identical calls
    take back one earlier key each: two charges in all, not one, not four."""
    run.killed("--trace-id", TRACE, "--tickets", "2", count=2)
    outputs, _ = run.again("--trace-id", TRACE, "--tickets", "2")
    assert run.tool.executions["charge"] == 2
    assert len({o["record"]["idempotency_key"] for o in outputs}) == 2
    assert all(o["record"]["replayed"] for o in outputs)


# Issue 38: a conversation kept in the SDK's Session, the message re-sent under a new trace.

OTHER = "trace_0af7651916cd43dd8448eb211c80319c"


@pytest.mark.parametrize("tickets", [1, pytest.param(2, marks=pytest.mark.long)])
def test_a_message_re_sent_in_its_session_under_a_new_trace_charges_once(
    run: Recovery, tmp_path: Path, tickets: int
) -> None:
    """Killed after the charge(s) ran; the app sends the user's message again in the same
    SQLiteSession, under a new trace_id, its trace linked to the session
    (RunConfig(group_id=session.session_id)): the journal's unsettled calls of the earlier
    trace in that group give their keys: each charge runs once (twice before), marked."""
    session = ["--session", str(tmp_path / "session.sqlite3"), "--group", "--tickets", str(tickets)]
    run.killed("--trace-id", TRACE, *session, count=tickets)
    outputs, _ = run.again("--trace-id", OTHER, *session)
    assert run.tool.executions["charge"] == tickets
    assert len({o["record"]["idempotency_key"] for o in outputs}) == tickets
    assert all(o["record"]["replayed"] for o in outputs)
    assert all(o["output"].startswith("[repeat of ") for o in outputs)


@pytest.mark.long
def test_a_new_message_in_the_session_after_a_finished_run_charges_again(
    run: Recovery, tmp_path: Path
) -> None:
    """No crash: a second request in the session under a new trace, after the first run
    finished, is a new charge (the earlier call was settled: nothing to take over)."""
    session = ["--session", str(tmp_path / "session.sqlite3"), "--group"]
    run.again("--trace-id", TRACE, *session)
    outputs, _ = run.again("--trace-id", OTHER, *session)
    assert run.tool.executions["charge"] == 2
    assert all(o["record"]["repeat_of"] is None for o in outputs)


def test_a_session_never_takes_the_lost_call_of_a_group_named_after_it(
    run: Recovery, tmp_path: Path
) -> None:
    """Group "x in group g" killed after the charge; a message in group "g" (another
    session) never takes its unsettled call (context ambiguous: missed, never adopted):
    two charges, "g"'s unmarked."""
    run.killed("--trace-id", TRACE, "--session", str(tmp_path / "a.sqlite3"), "--group",
               "--session-id", "x in group g")  # fmt: skip
    outputs, _ = run.again("--trace-id", OTHER, "--session", str(tmp_path / "b.sqlite3"),
                           "--group", "--session-id", "g")  # fmt: skip
    assert run.tool.executions["charge"] == 2
    assert all(o["record"]["repeat_of"] is None for o in outputs)


def test_a_session_never_takes_the_lost_call_of_a_trace_named_after_it(
    run: Recovery, tmp_path: Path
) -> None:
    """Trace "<id> in group g" (no group) killed after the charge; a message in group "g"
    never takes its unsettled call (its context reads as a trace of "g" before): two
    charges, "g"'s unmarked."""
    run.killed("--trace-id", f"{TRACE} in group g")
    outputs, _ = run.again("--trace-id", OTHER, "--session", str(tmp_path / "b.sqlite3"),
                           "--group", "--session-id", "g")  # fmt: skip
    assert run.tool.executions["charge"] == 2
    assert all(o["record"]["repeat_of"] is None for o in outputs)
