"""agentkey's invokers (sync and async) against idemkit 1.0.2 on Redis, in both of its modes.

Every test counts executions in the tool handler and checks what each call reported.
What idemkit sends, by mode (from its source, and asserted on the wire below):

| mode    | replay header                | in flight            | same key, other body |
|---------|------------------------------|----------------------|----------------------|
| default | Idempotency-Replayed: true   | 423 + Retry-After 30 | 422 problem+json     |
| stripe  | Idempotent-Replayed: true    | 409 + Retry-After 30 | 409 problem+json     |

idemkit first holds a duplicate of an in-flight request (10 s by default) and replays
the first one's answer when it finishes; only after that does it answer "in flight".
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from agentkey import (
    KeyReused,
    PayloadMismatch,
    PlanSession,
    RetryPolicy,
    Step,
    StepInProgress,
    ToolResult,
)

from ._support import (
    DRIVERS,
    MODES,
    STALL_SECONDS,
    Decision,
    Driver,
    Mode,
    Served,
    StartIdemkit,
    invoke_all,
)

REPLAY_HEADER = {"default": "idempotency-replayed", "stripe": "idempotent-replayed"}
IN_FLIGHT = {"default": 423, "stripe": 409}
MISMATCH = {"default": 422, "stripe": 409}
BURST = 4

pytestmark = [
    pytest.mark.redis,
    pytest.mark.parametrize("driver", DRIVERS),
    pytest.mark.parametrize("mode", MODES),
]


def result(outcome: object) -> ToolResult:
    """The outcome as a ToolResult; a failure shows the error the call raised instead."""
    assert isinstance(outcome, ToolResult), f"the call raised {outcome!r}"
    return outcome


def step_of(tool: str) -> Step:
    return PlanSession.new().step(0, tool, {"region": "eu-west-1", "gb": 20})


def burst(
    served: Served, driver: Driver, step: Step, held: Decision, **options: object
) -> list[ToolResult]:
    """BURST invokes of ``step`` at once; the tool runs once idemkit has BURST-1 ``held``."""
    gate = served.tool.gates[step.tool] = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(invoke_all, driver, served.url, [step] * BURST, **options)
        try:
            served.events.wait_for(held, BURST - 1)
        finally:
            gate.set()
        return [result(o) for o in future.result(timeout=30)]


def test_fresh_call_then_replays(idemkit_server: StartIdemkit, mode: Mode, driver: Driver) -> None:
    """A fresh call runs once; resending the key (raw or sf-string) is reported replayed."""
    step = step_of("create_db")
    with idemkit_server(mode) as served:
        (first,) = invoke_all(driver, served.url, [step])
        (again,) = invoke_all(driver, served.url, [step])
        (quoted,) = invoke_all(driver, served.url, [step], key_header_style="sf-string")
    first, again, quoted = result(first), result(again), result(quoted)
    assert (first.status_code, first.replayed) == (201, False)
    assert (again.status_code, again.replayed) == (201, True)
    assert (quoted.status_code, quoted.replayed) == (201, True)
    assert first.body == again.body == quoted.body
    assert served.tool.executions() == 1
    assert served.tool.seen_keys() == [step.idempotency_key]
    _, *replays = served.wire.on("/tools/create_db")
    assert [a.headers.get(REPLAY_HEADER[mode]) for a in replays] == ["true", "true"]


def test_concurrent_duplicates_held_then_replayed(
    idemkit_server: StartIdemkit, mode: Mode, driver: Driver
) -> None:
    """Duplicates idemkit holds while the first runs come back replayed: one execution."""
    step = step_of("provision")
    with idemkit_server(mode) as served:
        results = burst(served, driver, step, Decision.IN_FLIGHT_WAIT)
    assert sorted(r.replayed for r in results) == [False] + [True] * (BURST - 1)
    assert all(r.body == results[0].body for r in results)
    assert served.tool.executions() == 1
    answers = served.wire.on("/tools/provision")
    assert [a.status for a in answers] == [201] * BURST  # held, never told "in flight"
    assert sum(a.headers.get(REPLAY_HEADER[mode]) == "true" for a in answers) == BURST - 1
    assert all(r.attempts == 1 for r in results)


def test_in_flight_answer_is_waited_out_then_replayed(
    idemkit_server: StartIdemkit, mode: Mode, driver: Driver
) -> None:
    """423/409 + Retry-After is "in flight": duplicates resend the key and get the replay."""
    step = step_of("provision")
    with idemkit_server(mode, wait_timeout=0.05) as served:  # answers "in flight" at once
        results = burst(served, driver, step, Decision.CONFLICT)
    in_flight = [a for a in served.wire.on("/tools/provision") if a.status == IN_FLIGHT[mode]]
    assert len(in_flight) >= BURST - 1
    assert {a.headers.get("retry-after") for a in in_flight} == {"30"}
    assert sorted(r.replayed for r in results) == [False] + [True] * (BURST - 1)
    assert sum(r.attempts for r in results) == len(served.wire.on("/tools/provision"))
    assert all(r.body == results[0].body for r in results)
    assert served.tool.executions() == 1


def test_in_flight_wait_ends_at_the_callers_deadline(
    idemkit_server: StartIdemkit, mode: Mode, driver: Driver
) -> None:
    """Retry-After: 30 past a 0.5 s deadline ends in StepInProgress at once; later, a replay."""
    step = step_of("provision")
    # max_retry_after stays at its default (30 s): only the caller's deadline cuts the wait.
    short = RetryPolicy(deadline=0.5, initial_backoff=0.01, max_backoff=0.05)
    with idemkit_server(mode, wait_timeout=0.05) as served:
        gate = served.tool.gates["provision"] = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            first = pool.submit(invoke_all, driver, served.url, [step])
            try:
                served.events.wait_for(Decision.NEW, 1)  # the first call holds the key
                started = time.monotonic()
                (error,) = invoke_all(driver, served.url, [step], retry=short)
                elapsed = time.monotonic() - started
            finally:
                gate.set()
            (ran,) = first.result(timeout=30)
        (later,) = invoke_all(driver, served.url, [step])
    assert isinstance(error, StepInProgress), f"the call gave {error!r}"
    assert (error.status_code, error.idempotency_key) == (IN_FLIGHT[mode], step.idempotency_key)
    assert elapsed < 5  # not the 30 s the server asked for
    statuses = [a.status for a in served.wire.on("/tools/provision")]
    assert sorted(set(statuses)) == sorted({201, IN_FLIGHT[mode]})
    assert not result(ran).replayed
    assert result(later).replayed
    assert result(later).body == result(ran).body
    assert served.tool.executions() == 1


def test_changed_body_with_the_same_key_is_a_payload_mismatch(
    idemkit_server: StartIdemkit, mode: Mode, driver: Driver
) -> None:
    """The same key with another body raises PayloadMismatch at once; the tool does not run."""
    plan = PlanSession.new()
    step = plan.step(0, "charge", {"amount": 5})
    changed = plan.step(0, "charge", {"amount": 7})  # a replan of the same step
    with idemkit_server(mode) as served:
        (first,) = invoke_all(driver, served.url, [step])
        started = time.monotonic()
        # No journal: the server decides (with one, the journal refuses it before sending:
        # tests/interop/test_journal_other_args.py).
        (error,) = invoke_all(
            driver, served.url, [changed], idempotency_key=step.idempotency_key, journal=False
        )
        elapsed = time.monotonic() - started
    assert not result(first).replayed
    assert isinstance(error, PayloadMismatch), f"the call gave {error!r}"
    assert not isinstance(error, KeyReused)
    assert (error.status_code, error.attempts) == (MISMATCH[mode], 1)
    assert error.idempotency_key == step.idempotency_key
    assert elapsed < 2  # no waiting out a "conflict"
    assert served.tool.executions() == 1
    last = served.wire.on("/tools/charge")[-1]
    assert (last.status, last.headers["content-type"]) == (
        MISMATCH[mode],
        "application/problem+json",
    )


@pytest.mark.parametrize("loss", ["drop", "stall"])
def test_answer_lost_after_commit_is_replayed(
    idemkit_server: StartIdemkit, mode: Mode, driver: Driver, loss: str
) -> None:
    """The tool ran and idemkit stored it, then the answer was lost: the retry is a replay."""
    step = step_of("create_db")
    with idemkit_server(mode) as served:
        served.wire.lose["/tools/create_db"] = "drop" if loss == "drop" else "stall"
        timeout = STALL_SECONDS / 3 if loss == "stall" else None  # a read timeout, or a drop
        (outcome,) = invoke_all(driver, served.url, [step], timeout=timeout)
    answer = result(outcome)
    assert answer.replayed
    assert answer.attempts == 2 if loss == "drop" else answer.attempts >= 2
    assert answer.body == {
        "tool": "create_db",
        "route": "/tools/create_db",
        "args": step.args,
        "execution": 1,
    }
    assert served.tool.executions() == 1
