"""Issue 23, LangGraph: the ways a real app recovers, with real processes killed.

LangGraph's prebuilt agent (``create_react_agent``) on a SQLite checkpointer in a
process of its own; the charge tool behind agentkey's middleware on loopback,
counting its executions. The agent process is SIGKILLed after the tool ran and
before its answer reached the checkpoint; the application then recovers the
usual way: it sends the user's request again, on the same thread.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage
from langgraph.checkpoint.sqlite import SqliteSaver

from agentkey.server import IdempotencyMiddleware, MemoryStore
from tests._loopback import serve
from tests.journal._tools import PlainTool

pytestmark = [pytest.mark.realtime, pytest.mark.timeout(120)]

TEXT = "Charge my order: 5 EUR."


@dataclass
class Setup:
    tool: PlainTool
    url: str
    db: Path
    journal: Path

    def env(self) -> dict[str, str]:
        return {**os.environ, "AGENTKEY_JOURNAL": str(self.journal), "PYTHONPATH": os.getcwd()}

    def args(self, thread: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "tests.recovery._agent", "--db", str(self.db),
                "--url", self.url, "--thread", thread, "--text", TEXT, *extra]  # fmt: skip

    def killed(self, thread: str, *extra: str) -> None:
        """An agent process that dies (SIGKILL) once the tool has run its side effect."""
        self.tool.modes["charge"] = "hold"
        child = subprocess.Popen(self.args(thread, *extra), env=self.env())
        try:
            assert self.tool.ran.wait(60), "the agent's call never reached the tool"
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(30)
        self.tool.release.set()  # the tool finishes; its answer goes to a dead connection
        self.tool.modes["charge"] = "ok"

    def again(self, thread: str, *extra: str) -> subprocess.CompletedProcess[str]:
        """The application recovers: the same request again, in a new process."""
        return subprocess.run(
            self.args(thread, *extra), env=self.env(), capture_output=True, text=True, timeout=90
        )

    def messages(self, thread: str) -> list[Any]:
        with SqliteSaver.from_conn_string(str(self.db)) as saver:
            found = saver.get_tuple({"configurable": {"thread_id": thread}})
        return [] if found is None else list(found.checkpoint["channel_values"]["messages"])


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    tool = PlainTool()
    app = IdempotencyMiddleware(
        tool, store=MemoryStore(), routes=["/tools/*"], shared_key_space=True
    )
    with serve(app) as url:
        yield Setup(tool, url, tmp_path / "checkpoints.sqlite3", tmp_path / "journal.sqlite3")


def _final(out: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def _lose_checkpoints_after_the_input(db: Path, thread: str) -> None:
    """Delete the checkpoints written after the user's input: a write cut short by the kill."""
    with SqliteSaver.from_conn_string(str(db)) as saver:
        history = list(saver.list({"configurable": {"thread_id": thread}}))
    lost = [
        c.checkpoint["id"]
        for c in history
        if any(isinstance(m, AIMessage) for m in c.checkpoint["channel_values"].get("messages", []))
    ]
    with closing(sqlite3.connect(db)) as conn, conn:  # `with conn` commits; closing() closes
        for checkpoint_id in lost:
            conn.execute("DELETE FROM checkpoints WHERE checkpoint_id = ?", (checkpoint_id,))
            conn.execute("DELETE FROM writes WHERE checkpoint_id = ?", (checkpoint_id,))


def test_resend_after_a_crash_with_the_call_checkpointed(setup: Setup) -> None:
    """Case 1, the model's request is in the checkpoint: with pending_calls_hook the re-sent
    request runs no second charge (the unanswered call is answered from its first key);
    without it LangGraph refuses the history loudly, and nothing runs twice either."""
    setup.killed("t1")
    dangling = [m for m in setup.messages("t1") if isinstance(m, AIMessage) and m.tool_calls]
    assert dangling, "durability='sync' checkpointed the model's request before the tool ran"
    refused = setup.again("t1")
    assert refused.returncode != 0
    assert "INVALID_CHAT_HISTORY" in refused.stderr
    final = _final(setup.again("t1", "--hook"))
    first, *later = [m for m in final if m["type"] == "tool"]
    assert first["tool_call_id"] == dangling[0].tool_calls[0]["id"]
    assert first["artifact"]["replayed"] is True  # the tool replayed its first answer
    # The model, reading the user's request again, may ask again: a marked repeat.
    assert all(m["artifact"]["repeat_of"] == first["artifact"]["step"] for m in later)
    assert final[-1]["content"] == "Charged."
    assert setup.tool.executions["charge"] == 1


def test_resend_after_a_crash_that_lost_the_models_request(setup: Setup) -> None:
    """Case 1, the model's request never reached the checkpoint: the re-asked model calls the
    charge anew, and agentkey sends the first call's key (a marked repeat): one charge."""
    setup.killed("t2")  # durability "sync": the input is surely saved; the loss comes next
    _lose_checkpoints_after_the_input(setup.db, "t2")
    assert not any(isinstance(m, AIMessage) for m in setup.messages("t2"))
    final = _final(setup.again("t2", "--hook"))
    (answer,) = [m for m in final if m["type"] == "tool"]
    assert answer["artifact"]["repeat_of"] is not None
    assert answer["content"].startswith("[repeat of ")
    assert setup.tool.executions["charge"] == 1


def test_durability_exit_with_the_messages_own_id(setup: Setup) -> None:
    """Case 5, durability="exit" and a real SIGKILL: nothing was checkpointed. Re-sent with the
    message id the request had (what the docs ask), it is the same conversation: one charge."""
    setup.killed("t5", "--durability", "exit", "--message-id", "req-7f3a")
    assert setup.messages("t5") == []
    final = _final(setup.again("t5", "--durability", "exit", "--message-id", "req-7f3a"))
    (answer,) = [m for m in final if m["type"] == "tool"]
    assert answer["artifact"]["repeat_of"] is not None
    assert setup.tool.executions["charge"] == 1


def test_durability_exit_re_sent_as_a_new_message_charges_once(setup: Setup) -> None:
    """Case 5, re-sent as a new message (a new id): the journal shows the earlier run on the
    thread never settled its identical call, so the call takes its key: one charge (two
    before, with a warning), the model reads the tool's replay marked as a repeat."""
    setup.killed("t6", "--durability", "exit")
    final = _final(setup.again("t6", "--durability", "exit"))
    (answer,) = [m for m in final if m["type"] == "tool"]
    assert answer["artifact"]["repeat_of"] is not None
    assert answer["artifact"]["replayed"] is True
    assert answer["content"].startswith("[repeat of ")
    assert setup.tool.executions["charge"] == 1


def test_a_new_conversation_after_a_settled_one_runs_without_warning(setup: Setup) -> None:
    """Case 3's shape: a thread id reused after its history was deleted, the earlier
    conversation finished: the new one's charge runs, and no warning is given."""
    _final(setup.again("t7", "--durability", "exit"))
    with SqliteSaver.from_conn_string(str(setup.db)) as saver:
        saver.delete_thread("t7")
    out = setup.again("t7", "--durability", "exit")
    _final(out)
    assert "re-send the user's message" not in out.stderr
    assert setup.tool.executions["charge"] == 2


def test_a_thread_never_takes_the_lost_call_of_a_thread_named_after_it(setup: Setup) -> None:
    """Threads "acme" and "acme#bob": the call "acme#bob" left unsettled (killed) is never
    taken by "acme"'s new conversation: "acme" charges on its own, unmarked (the context
    "acme#bob#<message>" is ambiguous, so its recovery is missed, never adopted)."""
    setup.killed("acme#bob", "--durability", "exit")
    final = _final(setup.again("acme", "--durability", "exit"))
    (answer,) = [m for m in final if m["type"] == "tool"]
    assert answer["artifact"]["repeat_of"] is None
    assert not answer["content"].startswith("[repeat of ")
    assert setup.tool.executions["charge"] == 2
