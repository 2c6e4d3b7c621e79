"""Issue 38, LangGraph's Functional API (``@entrypoint``/``@task``), with real processes killed.

The agent of LangGraph's docs: a ``@task`` asks the model, a ``@task`` per tool call runs
the tool, on a SQLite checkpointer, in a process of its own; the charge tool behind
agentkey's middleware on loopback, counting its executions. The process is SIGKILLed
after the charge ran and before its answer came back; the application then sends the
user's request again on the same thread, in a new process, and the model names its
charge anew.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.recovery._process import Recovery, recovery

pytestmark = [pytest.mark.realtime, pytest.mark.timeout(120)]

TEXT = "Charge my order: 5 EUR."


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Recovery]:
    with recovery("tests.recovery._functional_agent", tmp_path) as setup:
        yield setup


def _args(tmp_path: Path, thread: str, *extra: str) -> list[str]:
    return ["--db", str(tmp_path / "checkpoints.sqlite3"), "--thread", thread, "--text", TEXT,
            *extra]  # fmt: skip


def _tool_messages(job: Recovery, *args: str) -> list[dict[str, Any]]:
    lines, _ = job.again(*args)
    return [m for m in lines if m["type"] == "tool"]


@pytest.mark.parametrize("durability", [pytest.param("async", marks=pytest.mark.long), "exit"])
def test_a_request_re_sent_after_a_crash_charges_once(
    job: Recovery, tmp_path: Path, durability: str
) -> None:
    """The re-sent request's model names the charge anew: the journal's unsettled call of the
    earlier run on the thread gives its key (the tool replays): one charge, marked a repeat."""
    args = _args(tmp_path, "f1", "--durability", durability)
    job.killed(*args)
    (answer,) = _tool_messages(job, *args)
    assert job.tool.executions["charge"] == 1
    assert answer["artifact"]["repeat_of"] is not None
    assert answer["artifact"]["replayed"] is True
    assert answer["content"].startswith("[repeat of ")


@pytest.mark.long
def test_the_recipe_with_plan_and_step_index_given_charges_once(
    job: Recovery, tmp_path: Path
) -> None:
    """The recipe agentkey's docs gave before (plan= the thread, step_index=call_step): the same
    rule, one charge (two before: a new call id, a new key, no warning)."""
    args = _args(tmp_path, "f2", "--explicit")
    job.killed(*args)
    (answer,) = _tool_messages(job, *args)
    assert job.tool.executions["charge"] == 1
    assert answer["artifact"]["repeat_of"] is not None


@pytest.mark.long
def test_a_later_request_on_the_thread_is_a_labelled_repeat_or_a_new_charge(
    job: Recovery, tmp_path: Path
) -> None:
    """No crash: a second request on the thread for the same charge is the earlier call's
    answer marked as a repeat (on_repeat="replay"), never passed off as new; with
    on_repeat="allow" it is a new charge."""
    args = _args(tmp_path, "f3")
    (first,) = _tool_messages(job, *args)
    assert first["artifact"]["repeat_of"] is None
    answers = _tool_messages(job, *args)
    assert answers[-1]["content"].startswith("[repeat of ")
    assert job.tool.executions["charge"] == 1
    _tool_messages(job, *_args(tmp_path, "f3", "--on-repeat", "allow"))
    assert job.tool.executions["charge"] == 2
    assert json.dumps(answers)  # printed as JSON
