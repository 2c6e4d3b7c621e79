"""Policies: frozen, keyword-only, validated; tenacity waits capped and bounded by the deadline."""

from __future__ import annotations

import dataclasses
import logging

import httpx
import pytest
import tenacity
from hypothesis import given
from hypothesis import strategies as st

from agentkey import ConfigurationError, LoggingHook, PollEvent, PollPolicy, RetryEvent, RetryPolicy
from agentkey._http import translate
from agentkey._policy import retry_engine
from agentkey._protocol import Action, Decision, FailureKind


def test_policies_are_frozen_and_keyword_only() -> None:
    """Policies cannot be mutated or built positionally."""
    policy = RetryPolicy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.max_attempts = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        RetryPolicy(3)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        PollPolicy(1.0)  # type: ignore[call-arg]


def test_replace_validates() -> None:
    """replace() returns a validated copy and names unknown options."""
    policy = RetryPolicy().replace(max_attempts=3, retry_statuses=[503])
    assert policy.max_attempts == 3
    assert policy.retry_statuses == frozenset({503})
    with pytest.raises(ConfigurationError, match="max_tries"):
        RetryPolicy().replace(max_tries=3)
    with pytest.raises(ConfigurationError):
        PollPolicy().replace(backoff=0.5)


@pytest.mark.parametrize(
    "bad",
    [
        {"max_attempts": 0},
        {"max_attempts": True},
        {"deadline": 0},
        {"deadline": float("inf")},
        {"initial_backoff": -1},
        {"initial_backoff": 2.0, "max_backoff": 1.0},
        {"max_retry_after": float("nan")},
        {"retry_statuses": [200]},
        {"retry_statuses": ["503"]},
        {"retry_statuses": "503"},
    ],
)
def test_retry_policy_rejects_bad_values(bad: dict[str, object]) -> None:
    """Nonsense options raise ConfigurationError at construction."""
    with pytest.raises(ConfigurationError):
        RetryPolicy(**bad)  # type: ignore[arg-type]


def test_poll_policy_backoff() -> None:
    """Poll waits grow by backoff from interval and stop at max_interval."""
    policy = PollPolicy(interval=1.0, backoff=2.0, max_interval=5.0)
    assert [policy.wait(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    with pytest.raises(ConfigurationError):
        PollPolicy(interval=10.0, max_interval=1.0)


def _run_to_sleep(policy: RetryPolicy, decision: Decision) -> object:
    engine, state = retry_engine(policy)
    assert isinstance(engine.iter(state), tenacity.DoAttempt)
    state.set_result(decision)
    return engine.iter(state)


@given(hint=st.one_of(st.none(), st.floats(0, 1e9)), cap=st.floats(0, 100))
def test_waits_are_capped(hint: float | None, cap: float) -> None:
    """A wait never exceeds max_retry_after (hint) or max_backoff (fallback)."""
    policy = RetryPolicy(max_retry_after=cap, initial_backoff=0.1, max_backoff=2.0)
    action = _run_to_sleep(policy, Decision(Action.RETRY, "x", retry_after=hint))
    assert isinstance(action, tenacity.DoSleep)
    wait = float(action)
    assert 0 <= wait <= (cap if hint is not None else 2.0)
    if hint is not None:
        assert wait == min(hint, cap)


def test_no_wait_runs_past_the_deadline() -> None:
    """A Retry-After longer than the remaining deadline is clipped to the deadline."""
    policy = RetryPolicy(deadline=0.5, max_retry_after=100.0)
    action = _run_to_sleep(policy, Decision(Action.RETRY, "x", retry_after=60.0))
    assert isinstance(action, tenacity.DoSleep)
    assert float(action) <= 0.5


def test_engine_stops_after_max_attempts_and_returns_last_decision() -> None:
    """After max_attempts the engine hands back the last decision instead of sleeping."""
    engine, state = retry_engine(RetryPolicy(max_attempts=2, initial_backoff=0, max_backoff=0))
    last = Decision(Action.RETRY, "second")
    for decision in (Decision(Action.RETRY, "first"), last):
        assert isinstance(engine.iter(state), tenacity.DoAttempt)
        state.set_result(decision)
        action = engine.iter(state)
        if isinstance(action, tenacity.DoSleep):
            state.prepare_for_next_attempt()
    assert action is last


def test_engine_returns_final_decisions_at_once() -> None:
    """A decision that does not retry comes straight back."""
    done = Decision(Action.DONE, "done")
    assert _run_to_sleep(RetryPolicy(), done) is done


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (httpx.ConnectError("x"), FailureKind.NOT_SENT),
        (httpx.ConnectTimeout("x"), FailureKind.NOT_SENT),
        (httpx.PoolTimeout("x"), FailureKind.NOT_SENT),
        (httpx.ReadTimeout("x"), FailureKind.AMBIGUOUS),
        (httpx.WriteTimeout("x"), FailureKind.AMBIGUOUS),
        (httpx.ReadError("x"), FailureKind.AMBIGUOUS),
        (httpx.WriteError("x"), FailureKind.AMBIGUOUS),
        (httpx.RemoteProtocolError("x"), FailureKind.AMBIGUOUS),
        (httpx.ProxyError("x"), FailureKind.AMBIGUOUS),
    ],
)
def test_transport_errors_translate(exc: httpx.RequestError, kind: FailureKind) -> None:
    """httpx errors become 'not sent' or 'ambiguous' in one place."""
    assert translate(exc).kind is kind


def test_unusable_request_is_a_configuration_error() -> None:
    """An unsupported scheme is a configuration problem, not a retry."""
    with pytest.raises(ConfigurationError):
        translate(httpx.UnsupportedProtocol("ftp"))


def test_logging_hook_logs_key_never_token(caplog: pytest.LogCaptureFixture) -> None:
    """The default hook logs key, step, attempt and wait, and nothing secret."""
    hook = LoggingHook()
    caplog.set_level(logging.INFO, logger="agentkey")
    hook(RetryEvent("p:step_001:" + "a" * 64, "step_001", 2, "ReadTimeout", 0.25, None))
    hook(PollEvent("p:step_001:" + "a" * 64, "step_001", 1, "https://x/ops?sig=SECRET", "run", 1))
    text = caplog.text
    assert "key=p:step_001:" in text
    assert "attempt=2" in text
    assert "wait=0.250s" in text
    assert "SECRET" not in text
    with pytest.raises(dataclasses.FrozenInstanceError):
        RetryEvent("k", None, 1, "r", 0.0, None).wait = 1.0  # type: ignore[misc]


def test_logging_hook_cannot_be_made_to_forge_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    """A poll state chosen by the server is logged on one line, truncated, control chars masked."""
    hook = LoggingHook()
    caplog.set_level(logging.INFO, logger="agentkey")
    state = "running\nCRITICAL agentkey: payment approved\r" + "x" * 500
    hook(PollEvent("p:step_001:" + "a" * 64, "step_001", 1, "https://x/ops/1", state, 1))
    (record,) = caplog.records
    message = record.getMessage()
    assert "\n" not in message
    assert "\r" not in message
    assert "state=running?CRITICAL" in message
    assert len(message) < 250
