"""Issue 38, Google ADK: a session resumed in a new process after a crash, by ADK's own recipes,
with real processes killed.

The agent runs in a process of its own (``tests.frameworks._adk_agent``) on a session kept
in a SQLite file by ADK's ``SqliteSessionService``; the charge tool behind agentkey's
middleware on loopback counts its executions. The process is SIGKILLed once the charge ran
(its answer held back, so it never reaches the agent), then the application recovers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("google.adk", reason="the Google ADK tests run in `nox -s adk`")

from tests.recovery._process import Recovery, recovery

pytestmark = [pytest.mark.realtime, pytest.mark.timeout(120)]

SESSION = "session-7f3a"


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Recovery]:
    with recovery("tests.frameworks._adk_agent", tmp_path) as setup:
        yield setup


def _args(run: Recovery, *extra: str) -> tuple[str, ...]:
    return ("--sessions", str(run.journal.parent / "sessions.db"), "--session", SESSION, *extra)


def test_a_resumed_invocation_charges_once(run: Recovery) -> None:
    """ADK's resumable invocation (ResumabilityConfig, run_async(invocation_id=...)) in a new
    process after a kill: the unanswered call runs again with its id, so under its key, and
    the tool server replays. One charge."""
    run.killed(*_args(run, "--resumable"))
    outputs, _ = run.again(*_args(run, "--resume"))
    assert run.tool.executions["charge"] == 1
    (output,) = outputs
    assert output["record"]["replayed"] is True
    assert output["record"].get("repeat_of") is None  # the same call, not a repeat of another
    assert output["response"]["run"] == 1


def test_the_users_message_re_sent_after_a_crash_charges_once(run: Recovery) -> None:
    """The user's message re-sent on the same session in a new process (a new invocation, the
    model naming its call anew): the journal gives the call the first call's key, the tool
    replays, and the model reads the answer marked as a repeat. One charge."""
    run.killed(*_args(run))
    outputs, _ = run.again(*_args(run))
    assert run.tool.executions["charge"] == 1
    (output,) = outputs
    assert output["record"]["replayed"] is True
    assert output["record"]["repeat_of"] == output["record"]["step"]
    assert output["response"]["result"].startswith("[repeat of ")


def test_two_tickets_re_sent_after_a_crash_charge_twice(run: Recovery) -> None:
    """Two identical charges in one model response ran, then the process was killed; the
    message re-sent, the two new calls take back one earlier key each: two charges in all,
    not one, not four."""
    run.killed(*_args(run, "--tickets", "2"), count=2)
    outputs, _ = run.again(*_args(run, "--tickets", "2"))
    assert run.tool.executions["charge"] == 2
    assert len({o["record"]["idempotency_key"] for o in outputs}) == 2
    assert all(o["record"]["replayed"] for o in outputs)
