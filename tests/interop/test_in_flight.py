"""A duplicate of a step still running waits for it, within the caller's deadline (issue 26 §1).

Real servers on loopback, each on the session's Redis: agentkey's middleware (409 with
``Retry-After: 1``) and idemkit 1.0.2 told to answer "in flight" at once (423, or 409 in
Stripe mode, with ``Retry-After: 30``, its lease). The tool counts its executions and
holds the first call at a gate, so the test decides when the first call ends. The
duplicate keeps asking however many times the server says "in flight" (``max_attempts``
does not bound that wait; the deadline does), reads a long ``Retry-After`` as an upper
bound, asks a last question before its deadline, and gets the replay soon after the
first call ends. The exact waits are pinned on a fake clock in
``tests/invoker/test_in_flight_waits.py``; ``bench/bench_inflight.py`` measures the delay.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from agentkey import PlanSession, RetryPolicy, Step, StepInProgress, ToolResult

from ._support import DRIVERS, MODES, Answer, Called, Decision, Driver, Mode, Served, StartIdemkit
from ._support import invoke_all as _invoke_all

PATH = "/tools/provision"
IN_FLIGHT = {"default": 423, "stripe": 409}

pytestmark = [pytest.mark.redis, pytest.mark.parametrize("driver", DRIVERS)]


def step_of() -> Step:
    return PlanSession.new().step(0, "provision", {"region": "eu-west-1", "gb": 20})


def timed(driver: Driver, url: str, step: Step, **options: Any) -> tuple[Called, float]:
    """One invoke of ``step``: what it gave, and the monotonic time it returned."""
    (outcome,) = _invoke_all(driver, url, [step], **options)
    return outcome, time.monotonic()


def result(outcome: Called) -> ToolResult:
    assert isinstance(outcome, ToolResult), f"the call raised {outcome!r}"
    return outcome


def answered(served: Served, status: int, count: int, timeout: float = 20.0) -> list[Answer]:
    """Block until the server has sent ``count`` answers of ``status`` on PATH; those."""
    limit = time.monotonic() + timeout
    while True:
        seen = [a for a in served.wire.on(PATH) if a.status == status]
        if len(seen) >= count:
            return seen
        assert time.monotonic() < limit, f"the server sent {len(seen)} x {status}, not {count}"
        time.sleep(0.01)


@contextmanager
def first_call_held(
    served: Served, driver: Driver, step: Step
) -> Iterator[concurrent.futures.Future[tuple[Called, float]]]:
    """The first call of ``step``, held inside the tool until the block ends."""
    gate = served.tool.gates["provision"] = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(timed, driver, served.url, step)
        try:
            assert served.tool.entered("provision").wait(10), "the first call never ran"
            yield first
        finally:
            gate.set()


def test_agentkey_duplicate_waits_past_max_attempts(
    agentkey_server: Served, driver: Driver
) -> None:
    """max_attempts=1: the duplicate waits out more 409s than that and gets the replay; one run."""
    served, step = agentkey_server, step_of()
    patient = RetryPolicy(max_attempts=1, deadline=30.0)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        with first_call_held(served, driver, step) as first:
            duplicate = pool.submit(timed, driver, served.url, step, retry=patient)
            busy = answered(served, 409, 2)  # already one more than max_attempts allows
        (ran, _), (copy, _) = first.result(timeout=30), duplicate.result(timeout=30)
    assert {a.headers.get("retry-after") for a in busy} == {"1"}
    copy = result(copy)
    assert copy.replayed
    assert not result(ran).replayed
    assert copy.body == result(ran).body
    in_flight = len([a for a in served.wire.on(PATH) if a.status == 409])
    assert copy.attempts == in_flight + 1 > patient.max_attempts
    assert served.tool.executions() == 1


@pytest.mark.realtime
@pytest.mark.parametrize("mode", MODES)
def test_idemkit_retry_after_30_is_an_upper_bound(
    idemkit_server: StartIdemkit, mode: Mode, driver: Driver
) -> None:
    """Retry-After: 30, deadline 30 s: the replay comes seconds after the first call ends."""
    step = step_of()
    with (
        idemkit_server(mode, wait_timeout=0.05) as served,
        concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool,
    ):
        with first_call_held(served, driver, step) as first:
            duplicate = pool.submit(
                timed, driver, served.url, step, retry=RetryPolicy(deadline=30.0)
            )
            served.events.wait_for(Decision.CONFLICT, 1)  # the duplicate was told "in flight"
        (ran, ended), (copy, replayed_at) = first.result(30), duplicate.result(40)
    busy = [a for a in served.wire.on(PATH) if a.status == IN_FLIGHT[mode]]
    assert busy
    assert {a.headers.get("retry-after") for a in busy} == {"30"}
    copy = result(copy)
    assert copy.replayed
    assert copy.body == result(ran).body
    # One in-flight wait is at most 2 s; 10 s leaves room for a loaded machine, and is far
    # from the 30 s the server asked for (or the deadline).
    assert replayed_at - ended < 10
    assert served.tool.executions() == 1


@pytest.mark.realtime
def test_idemkit_last_question_before_a_short_deadline_gets_the_replay(
    idemkit_server: StartIdemkit, driver: Driver
) -> None:
    """Retry-After: 30 past a 2 s deadline: a last question before it, not a sleep to it, and
    the first call, ended by then, is replayed."""
    step, deadline = step_of(), 2.0
    with (
        idemkit_server("default", wait_timeout=0.05) as served,
        concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool,
    ):
        with first_call_held(served, driver, step) as first:
            started = time.monotonic()
            duplicate = pool.submit(
                timed, driver, served.url, step, retry=RetryPolicy(deadline=deadline)
            )
            served.events.wait_for(Decision.CONFLICT, 1)
        (ran, _), (copy, _) = first.result(30), duplicate.result(30)
    copy = result(copy)
    assert copy.replayed
    assert copy.body == result(ran).body
    assert copy.attempts >= 2
    assert all(a.at < started + deadline for a in served.wire.on(PATH))
    assert served.tool.executions() == 1


@pytest.mark.realtime
def test_idemkit_first_call_outlasting_the_deadline_is_asked_twice(
    idemkit_server: StartIdemkit, driver: Driver
) -> None:
    """The first call outlasts a 2 s deadline: two questions, both before it, then
    StepInProgress with the key; a later call gets the replay."""
    step, deadline = step_of(), 2.0
    with idemkit_server("default", wait_timeout=0.05) as served:
        with first_call_held(served, driver, step) as first:
            started = time.monotonic()
            error, _ = timed(driver, served.url, step, retry=RetryPolicy(deadline=deadline))
        ran, _ = first.result(30)
        later, _ = timed(driver, served.url, step)
    busy = [a for a in served.wire.on(PATH) if a.status == 423]
    assert isinstance(error, StepInProgress), f"the call gave {error!r}"
    assert (error.idempotency_key, error.status_code) == (step.idempotency_key, 423)
    assert error.attempts == len(busy) >= 2
    assert all(a.at < started + deadline for a in busy)
    assert result(later).replayed
    assert result(later).body == result(ran).body
    assert served.tool.executions() == 1
