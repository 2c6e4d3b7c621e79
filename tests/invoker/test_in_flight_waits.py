"""Waits on a key in flight (409/423), on a fake clock: bounded by the deadline, asked often.

The same behaviours run against real servers in ``tests/interop/test_in_flight.py``;
here the exact waits are pinned.
"""

from __future__ import annotations

import pytest

from agentkey import StepInProgress
from agentkey.client._flow import invoke
from agentkey.client._protocol import Answer

from .test_flow import CALL, POLL, RETRY, Run, answer

BUSY = {"type": "urn:agentkey:problem:in_progress"}


def busy(status: int = 409, retry_after: str = "30") -> Answer:
    return answer(status, BUSY, retry_after=retry_after)


def replay() -> Answer:
    return answer(200, {"ok": True}, idempotent_replayed="true")


def test_in_flight_answers_do_not_spend_max_attempts() -> None:
    """max_attempts=1, twelve 409s, then the replay: the duplicate waits them all out, each
    wait Retry-After (1 s) or the backoff's own growing wait (0.5 s by 1.5, to 2 s) if longer."""
    run = Run()
    flow = invoke(CALL, run.settings(RETRY.replace(max_attempts=1), POLL))
    done = run.drive(flow, [busy(retry_after="1")] * 12 + [replay()])
    assert done.replayed
    assert done.attempts == 13
    assert run.slept == [1.0, 1.0, 1.125, 1.6875] + [2.0] * 8


def test_retry_after_zero_does_not_shorten_the_backoff() -> None:
    """Retry-After: 0 on a key in flight: the waits grow as without it, 0.5 s by 1.5 to 2 s
    (before: initial_backoff each time; with a small one, a request every few ms)."""
    run = Run()
    flow = invoke(CALL, run.settings(RETRY.replace(max_attempts=1), POLL))
    done = run.drive(flow, [busy(retry_after="0")] * 6 + [replay()])
    assert done.replayed
    assert run.slept == [0.5, 0.75, 1.125, 1.6875, 2.0, 2.0]


@pytest.mark.parametrize("status", [409, 423])
def test_long_retry_after_is_an_upper_bound(status: int) -> None:
    """Retry-After: 30 (a peer's whole lease) within a 30 s deadline: asked again every 2 s."""
    run = Run()
    flow = invoke(CALL, run.settings(RETRY.replace(deadline=30.0), POLL))
    done = run.drive(flow, [busy(status)] * 3 + [replay()])
    assert done.replayed
    assert run.slept == [2.0, 2.0, 2.0]  # not 30 s, nor the 29 s left
    assert done.elapsed == 6.0


def test_last_question_is_asked_before_the_deadline() -> None:
    """Deadline 4.5 s: waits 2 s, then 1.5 s to a last question 1 s before it; no sleep to it."""
    run = Run()
    start = run.clock.monotonic()
    flow = invoke(CALL, run.settings(RETRY.replace(deadline=4.5), POLL))
    with pytest.raises(StepInProgress) as caught:
        run.drive(flow, [busy()] * 10)
    assert run.slept == [2.0, 1.5]
    assert len(run.sent) == 3
    assert run.clock.monotonic() - start == 3.5  # it ended at the last answer, not at the deadline
    assert caught.value.attempts == 3
    assert caught.value.status_code == 409


def test_last_question_gets_the_replay() -> None:
    """The first call ends between the last two questions: the last one, before the deadline,
    gets the replay."""
    run = Run()
    flow = invoke(CALL, run.settings(RETRY.replace(deadline=4.5), POLL))
    done = run.drive(flow, [busy(), busy(), replay()])
    assert done.replayed
    assert done.elapsed == 3.5 < 4.5


def test_deadline_shorter_than_the_wait_still_leaves_one_more_question() -> None:
    """Deadline 1.5 s with Retry-After 30: one wait of half the time left, then a last question."""
    run = Run()
    flow = invoke(CALL, run.settings(RETRY.replace(deadline=1.5), POLL))
    with pytest.raises(StepInProgress):
        run.drive(flow, [busy(423)] * 10)
    assert run.slept == [0.75]
    assert len(run.sent) == 2


def test_last_question_leaves_time_for_its_own_answer() -> None:
    """Answers take 0.4 s: the last question leaves 1 s before the deadline, its answer in time."""
    run = Run()
    start = run.clock.monotonic()
    flow = invoke(CALL, run.settings(RETRY.replace(deadline=5.0), POLL))
    with pytest.raises(StepInProgress):
        run.drive(flow, [busy()] * 10, latency=0.4)
    assert run.slept == pytest.approx([2.0, 1.2])  # sent at 0, 2.4 and 4.0 s
    assert len(run.sent) == 3
    assert run.clock.monotonic() - start == pytest.approx(
        4.4
    )  # the last answer, before the deadline
    assert run.sent[-1].deadline == start + 5.0
