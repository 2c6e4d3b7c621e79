"""The sans-I/O flow driven by hand: a fake clock, scripted replies, no socket and no sleeping."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from agentkey import (
    ConfigurationError,
    InvokeError,
    OutcomeUnknown,
    PollPolicy,
    PollTimeout,
    RetryPolicy,
)
from agentkey.client._drive import run_sync
from agentkey.client._effects import Emit, Outgoing, Sleep
from agentkey.client._flow import Call, Finished, Flow, Settings, invoke, resume
from agentkey.client._hooks import (
    AttemptEvent,
    CallEndEvent,
    CallStartEvent,
    GiveUpEvent,
    InvokeEvent,
    InvokeHook,
    PollEvent,
    RetryEvent,
)
from agentkey.client._net import origin_of
from agentkey.client._policies import DEFAULT_RETRY_STATUSES
from agentkey.client._protocol import Answer, Failure, FailureKind, ProtocolConfig, Received
from agentkey.testing import FakeClock

BASE = "https://tool.test"
KEY = "plan:step_004:" + "c" * 64
CALL = Call(f"{BASE}/tools/x", "POST", (), KEY, "step_004", KEY, b'{"a":1}')
CONFIG = ProtocolConfig(
    base_origin=origin_of(BASE),  # type: ignore[arg-type]
    retry_statuses=DEFAULT_RETRY_STATUSES,
)


@dataclass
class Run:
    """What one hand-driven flow did: its requests, its sleeps, its events."""

    clock: FakeClock = field(default_factory=lambda: FakeClock(start=1000.0, wall=1.7e9 + 1000.0))
    sent: list[Outgoing] = field(default_factory=list)
    events: list[InvokeEvent] = field(default_factory=list)

    @property
    def slept(self) -> list[float]:
        """The waits the flow asked for, in order (slept on the fake clock)."""
        return self.clock.sleeps

    def record(self, event: InvokeEvent) -> None:
        self.events.append(event)

    hooks: tuple[InvokeHook, ...] = ()

    def settings(
        self,
        retry: RetryPolicy,
        polling: PollPolicy,
        *hooks: InvokeHook,
        honours_keys: bool | None = True,
    ) -> Settings:
        self.hooks = (self.record, *hooks)
        return Settings(
            CONFIG,
            retry,
            polling,
            True,
            self.clock.monotonic,
            lambda: 1.0,  # the top of every jittered range (a FakeClock draws below 1)
            self.clock.time,
            honours_keys=honours_keys,
        )

    def drive(self, flow: Flow, replies: Sequence[Received], latency: float = 0.0) -> Finished:
        """Answer each request with the next reply, ``latency`` s later; sleep on the clock."""
        script = iter(replies)

        def carry(effect: object) -> object:
            if isinstance(effect, Sleep):
                self.clock.sleep(effect.seconds)
                return None
            if isinstance(effect, Emit):
                for hook in self.hooks:
                    hook(effect.event)
                return None
            assert isinstance(effect, Outgoing)
            self.sent.append(effect)
            self.clock.advance(latency)
            return next(script)

        return run_sync(flow, carry)

    def of(self, kind: type[Any]) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


def answer(status: int, body: object = None, url: str = CALL.url, **headers: str) -> Answer:
    content = b"" if body is None else json.dumps(body).encode()
    return Answer(
        status, {k.lower().replace("_", "-"): v for k, v in headers.items()}, content, url
    )


RETRY = RetryPolicy(initial_backoff=0.5, max_backoff=10.0, max_retry_after=30.0, deadline=120.0)
POLL = PollPolicy(initial_backoff=1.0, backoff_multiplier=2.0, max_backoff=5.0, deadline=600.0)


def test_retry_after_is_waited_capped_and_the_key_is_resent() -> None:
    """503 Retry-After 7 then 45 (capped at 30): two waits on the clock, three sends, one key."""
    run = Run()
    replies = [answer(503, retry_after="7"), answer(503, retry_after="45"), answer(201, {"id": 1})]
    done = run.drive(invoke(CALL, run.settings(RETRY, POLL)), replies)
    assert run.slept == [7.0, 30.0]
    assert (done.answer.status_code, done.attempts, done.elapsed) == (201, 3, 37.0)
    assert [dict(o.headers)["Idempotency-Key"] for o in run.sent] == [KEY] * 3
    assert [e.wait for e in run.of(RetryEvent)] == [7.0, 30.0]


def test_in_flight_409_is_asked_again_on_a_short_schedule() -> None:
    """409 in flight without Retry-After waits 0.5 s x1.5 up to 2 s: the replay comes soon."""
    run = Run()
    busy = answer(409, {"type": "urn:agentkey:problem:in_progress"})
    replay = answer(200, {"ok": True}, idempotent_replayed="true")
    done = run.drive(invoke(CALL, run.settings(RETRY, POLL)), [busy] * 5 + [replay])
    assert run.slept == [0.5, 0.75, 1.125, 1.6875, 2.0]
    assert done.replayed
    assert done.attempts == 6


def test_poll_schedule_grows_to_its_cap() -> None:
    """A 202 is polled after 1, 1, 2, 4, 5, 5 s (PollPolicy 1 s x2 up to 5 s), key on each poll."""
    run = Run()
    status = f"{BASE}/ops/7?sig=s3cret"
    running = answer(200, {"status": "running"}, url=status)
    replies = [answer(202, location=status), *[running] * 5, answer(200, {"status": "succeeded"})]
    done = run.drive(invoke(CALL, run.settings(RETRY, POLL)), replies)
    assert run.slept == [1.0, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert (done.polls, done.status_url, done.elapsed) == (6, status, 18.0)
    assert [o.method for o in run.sent] == ["POST"] + ["GET"] * 6
    assert all(dict(o.headers)["Idempotency-Key"] == KEY for o in run.sent)
    assert [e.poll for e in run.of(PollEvent)] == [0, 1, 2, 3, 4, 5]


def test_deadline_cuts_the_wait_and_stops_the_retries() -> None:
    """At 3 s per request a 20 s Retry-After is cut to the 7 s left; no send after the deadline."""
    run = Run()
    start = run.clock.monotonic()
    flow = invoke(CALL, run.settings(RETRY.replace(deadline=10.0), POLL))
    with pytest.raises(OutcomeUnknown) as caught:
        run.drive(flow, [answer(503, retry_after="20")] * 5, latency=3.0)
    assert run.slept == [7.0]
    assert len(run.sent) == 1
    assert run.sent[0].deadline == start + 10.0
    assert caught.value.attempts == 1
    assert [e.error for e in run.of(GiveUpEvent)] == ["OutcomeUnknown"]


def test_max_attempts_ends_the_retries() -> None:
    """Ambiguous failures are resent up to max_attempts, then OutcomeUnknown, no final sleep."""
    run = Run()
    flow = invoke(CALL, run.settings(RETRY.replace(max_attempts=3), POLL))
    with pytest.raises(OutcomeUnknown, match="may have run"):
        run.drive(flow, [Failure(FailureKind.IN_DOUBT, "ReadTimeout")] * 5)
    assert len(run.sent) == 3
    assert run.slept == [0.5, 1.0]


def test_poll_timeout_carries_the_status_url() -> None:
    """Past PollPolicy.deadline the flow raises PollTimeout with the status URL, key and step."""
    run = Run()
    status = f"{BASE}/ops/9?sig=s3cret"
    running = answer(200, {"status": "running"}, url=status)
    flow = invoke(CALL, run.settings(RETRY, POLL.replace(deadline=12.0)))
    with pytest.raises(PollTimeout) as caught:
        run.drive(flow, [answer(202, location=status), *[running] * 50])
    error = caught.value
    assert (error.status_url, error.idempotency_key, error.step) == (status, KEY, "step_004")
    assert "s3cret" not in str(error)
    assert sum(run.slept) == 12.0
    assert run.of(GiveUpEvent)[0].error == "PollTimeout"


def test_resume_polls_without_sending_the_step() -> None:
    """resume() only GETs the status URL, at once, and returns its result."""
    run = Run()
    status = f"{BASE}/ops/9"
    call = Call(status, "GET", (), KEY, "step_004", KEY, b"")
    done = run.drive(resume(call, run.settings(RETRY, POLL)), [answer(200, {"status": "done"})])
    assert ([o.method for o in run.sent], run.slept, done.polls) == (["GET"], [], 1)


def test_events_frame_the_call_and_hooks_add_trace_headers() -> None:
    """CallStart, one AttemptEvent per send (a hook adds traceparent), then CallEnd."""
    run = Run()

    def trace(event: InvokeEvent) -> None:
        if isinstance(event, AttemptEvent):
            event.headers["traceparent"] = f"00-{'a' * 32}-{event.attempt:016x}-01"

    settings = run.settings(RETRY, POLL, trace)
    run.drive(invoke(CALL, settings), [answer(502), answer(200, {"ok": 1})])
    kinds = [type(e).__name__ for e in run.events]
    assert kinds == ["CallStartEvent", "AttemptEvent", "RetryEvent", "AttemptEvent", "CallEndEvent"]
    assert run.of(CallStartEvent) == [CallStartEvent(KEY, "step_004", "POST", CALL.url)]
    assert [dict(o.headers)["traceparent"][-4:] for o in run.sent] == ["1-01", "2-01"]
    assert run.of(CallEndEvent) == [CallEndEvent(KEY, "step_004", "answered", 2, 0, 200, None)]


@pytest.mark.parametrize("name", ["Authorization", "idempotency-key", "Cookie", "Content-Type"])
def test_hooks_cannot_set_headers_agentkey_owns(name: str) -> None:
    """An AttemptEvent hook setting an owned header is refused before anything is sent."""
    run = Run()

    def forge(event: InvokeEvent) -> None:
        if isinstance(event, AttemptEvent):
            event.headers[name] = "x"

    with pytest.raises(ConfigurationError, match=name):
        run.drive(invoke(CALL, run.settings(RETRY, POLL, forge)), [answer(200)])
    assert run.sent == []
    assert run.of(CallEndEvent)[0].error == "ConfigurationError"


@pytest.mark.parametrize("failure", [KeyboardInterrupt, ConnectionError])
def test_call_end_names_what_the_driver_threw(failure: Callable[[], BaseException]) -> None:
    """A driver's own failure thrown into the flow ends it with a CallEndEvent naming it."""
    run = Run()
    flow = invoke(CALL, run.settings(RETRY, POLL))

    def carry(effect: object) -> object:
        if isinstance(effect, Emit):
            run.record(effect.event)
            return None
        raise failure()

    with pytest.raises(type(failure())):
        run_sync(flow, carry)
    end = run.of(CallEndEvent)
    assert [(e.outcome, e.error, e.attempts) for e in end] == [(None, type(failure()).__name__, 0)]


def test_poll_redirects_are_limited() -> None:
    """A status URL that redirects more than ten times in a row ends with an InvokeError."""
    run = Run()
    status = f"{BASE}/ops/1"
    loop = answer(307, url=status, location="/ops/1")
    with pytest.raises(InvokeError, match="redirected too often"):
        run.drive(
            invoke(CALL, run.settings(RETRY, POLL)), [answer(202, location=status)] + [loop] * 20
        )
    assert len(run.sent) == 1 + 11
    assert run.slept == [1.0]  # only the wait after the 202: redirects are followed at once
