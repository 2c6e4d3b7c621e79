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
