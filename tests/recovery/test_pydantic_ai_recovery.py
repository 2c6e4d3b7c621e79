"""Issue 23, case 6, PydanticAI: a run executed again with its run_id, with real processes killed.

A PydanticAI agent in a process of its own; the charge tool behind agentkey's middleware
on loopback, counting its executions. The process is SIGKILLed after the charge ran and
before its answer came back; the job then runs again with the same ``run_id``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("pydantic_ai", reason="PydanticAI needs Python 3.11+")

from tests.recovery._process import Recovery, recovery

pytestmark = [pytest.mark.realtime, pytest.mark.timeout(120)]


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Recovery]:
    with recovery("tests.recovery._pydantic_agent", tmp_path) as setup:
        yield setup


def test_a_rerun_that_reads_first_charges_once(job: Recovery) -> None:
    """Killed after the charge; the re-run with the same run_id reads the balance first (so
    PydanticAI's run_step shifts) and its model names the charge anew: one charge, its answer
    the tool's replay, marked as a repeat of the first call."""
    job.killed("--run-id", "0f5c2a9e-job-exec")
    returns, _ = job.again("--run-id", "0f5c2a9e-job-exec", "--read-first")
    assert job.tool.executions["charge"] == 1
    assert job.tool.executions["get_balance"] == 1
    (charge,) = [r for r in returns if r["tool"] == "charge"]
    assert charge["metadata"]["replayed"] is True
    assert charge["metadata"]["repeat_of"] == charge["metadata"]["step"]
    assert charge["content"].startswith("[repeat of ")


def test_a_fixed_run_id_reused_by_a_recurring_job_is_labelled(job: Recovery) -> None:
    """A job on a schedule that reuses a literal run id gets the earlier execution's charge,
    never silently: the answer is marked as a repeat and a warning names the fix. With a run
    id per execution (what the docs show) the next execution charges."""
    job.again("--run-id", "job-7")
    returns, stderr = job.again("--run-id", "job-7")
    assert job.tool.executions["charge"] == 1
    (charge,) = returns
    assert charge["metadata"]["repeat_of"] is not None
    assert charge["content"].startswith("[repeat of ")
    assert "give each job execution a run_id of its own" in stderr
    returns, stderr = job.again("--run-id", "job-7-2026-12-03")
    (charge,) = returns
    assert charge["metadata"]["repeat_of"] is None
    assert "run_id of its own" not in stderr
    assert job.tool.executions["charge"] == 2


# Issue 38: PydanticAI's own recipe, a run continued from its saved message_history.


@pytest.mark.parametrize("conversation", [None, pytest.param("conv-4f1c", marks=pytest.mark.long)])
def test_a_run_resumed_from_its_saved_history_charges_once(
    job: Recovery, tmp_path: Path, conversation: str | None
) -> None:
    """Killed after the charge; a new process continues from the message_history it saved
    (PydanticAI draws a new run_id, as it must), with or without conversation_id: PydanticAI
    runs the dangling call again and it gets its first key: one charge, the tool's replay."""
    extra = ["--history", str(tmp_path / "history.json")]
    extra += ["--conversation-id", conversation] if conversation else []
    job.killed(*extra)
    returns, _ = job.again(*extra)
    assert job.tool.executions["charge"] == 1
    (charge,) = [r for r in returns if r["tool"] == "charge"]
    assert charge["metadata"]["replayed"] is True


@pytest.mark.parametrize("conversation", [None, pytest.param("conv-9a2e", marks=pytest.mark.long)])
def test_a_repaired_history_with_the_prompt_re_sent_charges_once(
    job: Recovery, tmp_path: Path, conversation: str | None
) -> None:
    """Killed after the charge; the new process repairs the saved history
    (repair_messages() answers the dangling call with a made-up return) and sends the
    user's prompt again; its model names the charge anew. One charge, and the model reads
    the first call's answer marked as a repeat, never the made-up return as an answer."""
    extra = ["--history", str(tmp_path / "history.json")]
    extra += ["--conversation-id", conversation] if conversation else []
    job.killed(*extra)
    returns, _ = job.again(*extra, "--repair")
    assert job.tool.executions["charge"] == 1
    (charge,) = [r for r in returns if r["tool"] == "charge"]
    assert charge["metadata"]["replayed"] is True
    assert charge["content"].startswith("[repeat of ")


def test_a_prompt_re_sent_in_its_conversation_without_history_charges_once(
    job: Recovery,
) -> None:
    """Killed after the charge; the app kept only the conversation_id and sends the prompt
    again under it, in a new run (new run_id, no history): the journal's record of the
    unfinished earlier run of that conversation gives its key: one charge, marked a repeat."""
    job.killed("--conversation-id", "conv-77d0")
    returns, _ = job.again("--conversation-id", "conv-77d0")
    assert job.tool.executions["charge"] == 1
    (charge,) = [r for r in returns if r["tool"] == "charge"]
    assert charge["content"].startswith("[repeat of ")


def test_a_conversation_never_takes_the_lost_call_of_one_named_after_it(job: Recovery) -> None:
    """Conversation "a in conversation b" killed after the charge; a prompt in conversation
    "b" never takes its unsettled call (context ambiguous: missed, never adopted): two
    charges, "b"'s unmarked."""
    job.killed("--conversation-id", "a in conversation b")
    returns, _ = job.again("--conversation-id", "b")
    assert job.tool.executions["charge"] == 2
    (charge,) = [r for r in returns if r["tool"] == "charge"]
    assert not charge["content"].startswith("[repeat of ")
