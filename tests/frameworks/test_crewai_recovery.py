"""Issue 38, CrewAI: a persisted Flow resumed in a new process after a crash, by CrewAI's own
recipe (``@persist``, ``kickoff(inputs={"id": state_id})``), with real processes killed.

The job runs in a process of its own (``tests.frameworks._crewai_agent``); the charge tool
behind agentkey's middleware on loopback counts its executions. The process is SIGKILLed once
the charge ran (its answer held back, so it never reaches the agent), then run again.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("crewai", reason="the CrewAI tests run in `nox -s crewai`")

from tests.recovery._process import Recovery, recovery

pytestmark = [pytest.mark.realtime, pytest.mark.timeout(180)]

STATE_ID = "2f0c6d1e-5b7a-4c1e-9a53-6d7f0e8b9c41"


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Recovery]:
    with recovery("tests.frameworks._crewai_agent", tmp_path) as setup:
        yield setup


def test_a_persisted_flow_resumed_in_a_new_process_charges_once(run: Recovery) -> None:
    """Killed after the charge ran; the flow kicked off again with its state id in a new
    process, its agent asking for the charge again: the call is the crashed run's first
    identical call, so it goes under that call's key and the tool server replays. One charge."""
    args = ("--flows", str(run.journal.parent / "flows.db"), "--state-id", STATE_ID)
    run.killed(*args)
    outputs, _ = run.again(*args)
    assert run.tool.executions["charge"] == 1
    (output,) = outputs
    assert output["record"]["replayed"] is True
    assert output["record"]["outcome"] == "replayed"
