"""Policies: frozen, keyword-only, validated, one vocabulary; errors translated; the log hook."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import httpx
import pytest

from agentkey import ConfigurationError, LoggingHook, PollEvent, PollPolicy, RetryEvent, RetryPolicy
from agentkey._schedule import Backoff
from agentkey.auth import TokenPolicy
from agentkey.client._hooks import AttemptEvent, CallEndEvent, CallStartEvent
from agentkey.client._protocol import FailureKind
from agentkey.client._translate import translate


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
        PollPolicy().replace(backoff_multiplier=0.5)


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
    """Poll waits grow by backoff_multiplier from initial_backoff and stop at max_backoff."""
    policy = PollPolicy(initial_backoff=1.0, backoff_multiplier=2.0, max_backoff=5.0)
    assert [policy.wait(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    with pytest.raises(ConfigurationError):
        PollPolicy(initial_backoff=10.0, max_backoff=1.0)


@pytest.mark.parametrize(
    ("cls", "old"),
    [
        (PollPolicy, "interval"),
        (PollPolicy, "backoff"),
        (PollPolicy, "max_interval"),
        (TokenPolicy, "attempts"),
        (TokenPolicy, "backoff"),
        (TokenPolicy, "max_wait"),
    ],
)
def test_old_option_names_are_gone(cls: type[Any], old: str) -> None:
    """The pre-release option names are refused by the constructor, replace() and reads."""
    with pytest.raises(TypeError, match=old):
        cls(**{old: 1.0})
    with pytest.raises(ConfigurationError, match=f"no option.*{old}"):
        cls().replace(**{old: 1.0})
    assert not hasattr(cls(), old)
    schedule = cls().schedule
    assert isinstance(schedule, Backoff)
    assert (schedule.initial, schedule.cap) == (cls().initial_backoff, cls().max_backoff)


def test_every_policy_speaks_one_vocabulary() -> None:
    """Retry, poll and token policies share the backoff names and the one Backoff formula."""
    shared = {"initial_backoff", "max_backoff", "backoff_multiplier", "max_retry_after", "jitter"}
    for cls in (RetryPolicy, PollPolicy, TokenPolicy):
        assert shared | {"deadline"} <= {f.name for f in dataclasses.fields(cls)}
    assert {"max_attempts"} <= {f.name for f in dataclasses.fields(TokenPolicy)}
    assert RetryPolicy().schedule == Backoff(0.5, 10.0, 2.0, True, 30.0)
    assert PollPolicy().schedule == Backoff(1.0, 30.0, 1.5, False, 30.0, 0.5)


def test_polls_have_a_floor() -> None:
    """Retry-After: 0 on a status URL still waits PollPolicy.min_interval (0.5 s by default)."""
    assert PollPolicy().schedule.delay(3, 0.0) == 0.5
    assert PollPolicy(initial_backoff=0.0, max_backoff=0.0).wait(1) == 0.5
    assert PollPolicy(min_interval=0.0).schedule.delay(1, 0.0) == 0.0  # an explicit opt-out
    with pytest.raises(ConfigurationError, match="min_interval"):
        PollPolicy(min_interval=-1.0)


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (httpx.ConnectError("x"), FailureKind.NOT_SENT),
        (httpx.ConnectTimeout("x"), FailureKind.NOT_SENT),
        (httpx.PoolTimeout("x"), FailureKind.NOT_SENT),
        (httpx.ReadTimeout("x"), FailureKind.IN_DOUBT),
        (httpx.WriteTimeout("x"), FailureKind.IN_DOUBT),
        (httpx.ReadError("x"), FailureKind.IN_DOUBT),
        (httpx.WriteError("x"), FailureKind.IN_DOUBT),
        (httpx.RemoteProtocolError("x"), FailureKind.IN_DOUBT),
        (httpx.ProxyError("x"), FailureKind.IN_DOUBT),
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


def test_logging_hook_logs_call_start_and_end_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    """CallStart/CallEnd log at DEBUG only (no URL, no headers); AttemptEvent logs nothing."""
    hook = LoggingHook()
    key = "p:step_001:" + "a" * 64
    caplog.set_level(logging.INFO, logger="agentkey")
    hook(CallStartEvent(key, "step_001", "POST", "https://x/tools/t?sig=SECRET"))
    hook(CallEndEvent(key, "step_001", "executed", 1, 0, 200, None))
    assert caplog.records == []
    caplog.set_level(logging.DEBUG, logger="agentkey")
    hook(CallStartEvent(key, "step_001", "POST", "https://x/tools/t?sig=SECRET"))
    hook(AttemptEvent(key, "step_001", 1, "POST", "https://x/t", {"traceparent": "SECRET"}))
    hook(CallEndEvent(key, "step_001", None, 3, 0, 503, "OutcomeUnknown"))
    assert [r.levelno for r in caplog.records] == [logging.DEBUG, logging.DEBUG]
    assert "error=OutcomeUnknown" in caplog.text
    assert "SECRET" not in caplog.text
