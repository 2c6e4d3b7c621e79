"""An operator's tools against a call that is being sent right now (issue 34).

A real invoker in a thread, blocked inside a real loopback tool that does not honour keys
(it ran the side effect and holds its answer); executions counted on the tool. ``settle``
and ``prune`` must not touch that call, and a sender whose record was changed under it
says so instead of losing its answer, so the step never runs twice.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from agentkey import JournalError, PlanSession, RetryPolicy, ToolInvoker, ToolResult
from agentkey._keys import shown_key
from agentkey.journal import CallRecord, CallState, SQLiteJournal
from agentkey.testing import FakeClock
from tests._loopback import serve
from tests.journal._tools import PlainTool

ROOT = Path(__file__).resolve().parents[2]
RETRY = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.05, deadline=60.0)
DAY = 24 * 3600.0


def _invoke(url: str, journal: Any, step: Any) -> ToolResult:
    with ToolInvoker(
        url, journal=journal, retry=RETRY, timeout=60.0, route_template="/tools/{tool}"
    ) as invoker:
        return invoker.invoke(step)


@contextmanager
def sending(
    journal: Any,
) -> Iterator[tuple[PlainTool, str, Any, concurrent.futures.Future[ToolResult]]]:
    """A charge being sent: the tool ran it and holds its answer until ``release`` is set."""
    plain = PlainTool()
    plain.modes["charge"] = "hold"
    step = PlanSession.new().step(0, "charge", {"amount": 1999, "currency": "EUR"})
    with serve(plain) as url, concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        sent = pool.submit(_invoke, url, journal, step)
        try:
            assert plain.ran.wait(30), "the request never reached the tool"
            record = journal.get(step.idempotency_key)
            assert record is not None
            assert record.state is CallState.PENDING
            yield plain, url, step, sent
        finally:
            plain.release.set()


def test_settle_and_prune_leave_a_call_that_is_being_sent_alone(
    journal_factory: Callable[..., Any],
) -> None:
    """While its sender is alive, a call cannot be settled (either way, even with force) nor
    pruned (even with include_unsettled, a day later); once it ended, settle refuses to
    overturn it unless forced. The tool runs the charge once (twice on the old code: the
    --not-run verdict let the next call send it again)."""
    journal = journal_factory(clock=FakeClock(wall=time.time() + DAY))  # every record looks old
    with sending(journal) as (plain, url, step, sent):
        key = step.idempotency_key
        for state in (CallState.NOT_SENT, CallState.ANSWERED):
            for force in (False, True):
                with pytest.raises(JournalError, match="is still being sent") as caught:
                    journal.settle(key, state, reason="checked the ledger", force=force)
                assert caught.value.sent is True
                assert key not in str(caught.value)
                assert shown_key(key) in str(caught.value)
        assert journal.prune(older_than=3600) == 0
        assert journal.prune(older_than=3600, include_unsettled=True) == 0
        assert journal.get(key).state is CallState.PENDING
        plain.release.set()
        assert sent.result(timeout=30).status_code == 201
        again = _invoke(url, journal, step)  # the tool does not honour keys: the journal answers
    assert (again.source, again.status_code) == ("journal", 201)
    with pytest.raises(JournalError, match=r"already ended \(answered, status 201\)") as caught:
        journal.settle(key, CallState.NOT_SENT, reason="wrong ledger")
    assert "--force" in str(caught.value)
    assert journal.get(key).state is CallState.ANSWERED
    forced = journal.settle(key, CallState.NOT_SENT, reason="refunded by hand", force=True)
    assert forced is not None
    assert forced.state is CallState.NOT_SENT
    assert plain.executions["charge"] == 1


def _verdict_by_the_old_command(journal: Any, key: str) -> CallRecord:
    """What `journal settle --not-run` wrote over a live call before it checked the sender."""
    current: CallRecord = journal.get(key)
    verdict = current.with_(state=CallState.NOT_SENT, owner=None, source="operator",
                            reason="settled by an operator: did not run",
                            updated_at=current.updated_at + 1)  # fmt: skip
    assert journal.take_over(verdict, current)
    return verdict


def test_a_finish_after_an_operators_verdict_says_so_and_records_what_happened(
    journal_factory: Callable[..., Any],
) -> None:
    """An operator's "did not run" lands on a call still being sent: the sender's finish
    matches no record of its own. It raises JournalError (sent=True) saying so, and records
    the tool's answer over the verdict, so the next call of the step is answered from the
    journal: 1 execution (2 on the old code, which dropped the finish silently)."""
    journal = journal_factory()
    with sending(journal) as (plain, url, step, sent):
        _verdict_by_the_old_command(journal, step.idempotency_key)
        plain.release.set()
        with pytest.raises(JournalError, match="settled by an operator as not_sent") as caught:
            sent.result(timeout=30)
        assert caught.value.sent is True
        assert step.idempotency_key not in str(caught.value)
        stored = journal.get(step.idempotency_key)
        assert (stored.state, stored.status_code) == (CallState.ANSWERED, 201)
        again = _invoke(url, journal, step)
    assert again.source == "journal"
    assert plain.executions["charge"] == 1


def test_a_finish_after_another_sender_took_over_says_the_tool_may_have_run_twice(
    journal_factory: Callable[..., Any],
) -> None:
    """Another sender took the record over while this one was still sending (its lease ran
    out): the finish raises JournalError naming that, and leaves the other sender's record."""
    journal = journal_factory()
    with sending(journal) as (plain, _url, step, sent):
        current = journal.get(step.idempotency_key)
        theirs = current.with_(owner="another-host:1:x:1", updated_at=current.updated_at + 1)
        assert journal.take_over(theirs, current)
        plain.release.set()
        with pytest.raises(JournalError, match="taken over by another sender") as caught:
            sent.result(timeout=30)
    assert caught.value.sent is True
    assert journal.get(step.idempotency_key) == theirs


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "import sys; from agentkey.cli import main; sys.exit(main())",
         "journal", *argv],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def test_the_command_in_another_process_refuses_to_settle_a_live_call(tmp_path: Path) -> None:
    """`agentkey journal settle --not-run`, run as its own process, sees the sender's
    process alive and exits 3 saying so; the call ends answered and runs once."""
    path = tmp_path / "journal.sqlite3"
    journal = SQLiteJournal(path)
    with sending(journal) as (plain, _url, step, sent):
        shown = shown_key(step.idempotency_key)
        refused = _cli("--journal", str(path), "settle", shown, "--not-run")
        assert refused.returncode == 3, refused.stderr
        assert "is still being sent" in refused.stderr
        forced = _cli("--journal", str(path), "settle", shown, "--not-run", "--force")
        assert forced.returncode == 3
        plain.release.set()
        assert sent.result(timeout=30).status_code == 201
    listed = _cli("--journal", str(path), "--json", "show", shown)
    assert json.loads(listed.stdout)["state"] == "answered"
    assert plain.executions["charge"] == 1
