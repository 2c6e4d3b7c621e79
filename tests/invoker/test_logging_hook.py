"""The default LoggingHook costs only what it logs: events it would not log are never built."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from agentkey import AsyncToolInvoker, LoggingHook, ToolInvoker
from agentkey.client._hooks import (
    EVENT_TYPES,
    AttemptEvent,
    CallEndEvent,
    CallStartEvent,
    InvokeEvent,
    RetryEvent,
    listened,
)

from ._support import BASE, DRIVERS, FAST_RETRY, Driver, Recorder, Script, make_step, run_invoke

RETRY_ONCE = [httpx.Response(503, headers={"Retry-After": "0"}), httpx.Response(201, json={})]


@pytest.fixture
def heard(monkeypatch: pytest.MonkeyPatch) -> list[type]:
    """The type of every event that reaches a LoggingHook, in order (it still logs them)."""
    got: list[type] = []
    logs = LoggingHook.__call__

    def spy(self: LoggingHook, event: InvokeEvent) -> None:
        got.append(type(event))
        logs(self, event)

    monkeypatch.setattr(LoggingHook, "__call__", spy)
    return got


# (logger level, answers, the events the flow builds for the default LoggingHook)
LEVELS = [
    (logging.ERROR, [httpx.Response(201, json={})], []),
    (logging.ERROR, RETRY_ONCE, []),
    (logging.WARNING, [httpx.Response(201, json={})], []),
    (logging.WARNING, RETRY_ONCE, [RetryEvent]),
    (logging.INFO, [httpx.Response(201, json={})], []),
    (logging.INFO, RETRY_ONCE, [RetryEvent]),
    (logging.DEBUG, [httpx.Response(201, json={})], [CallStartEvent, CallEndEvent]),
    (logging.DEBUG, RETRY_ONCE, [CallStartEvent, RetryEvent, CallEndEvent]),
]


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize(
    ("level", "answers", "built"),
    LEVELS,
    ids=[f"{logging.getLevelName(lv)}-{len(a)} answers" for lv, a, _ in LEVELS],
)
def test_the_default_hook_gets_only_what_its_logger_would_log(
    driver: Driver,
    level: int,
    answers: list[httpx.Response],
    built: list[type],
    heard: list[type],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """At each level only the events the logger would log are built; a retry still warns."""
    caplog.set_level(level, logger="agentkey")
    result = run_invoke(driver, Script(list(answers)), make_step(), hooks=None)
    assert result.status_code == 201
    assert heard == built
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    retried = len(answers) > 1 and level <= logging.WARNING
    assert [m.split(" ")[0] for m in warned] == (["retrying"] if retried else [])


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_logger_turned_up_or_down_is_heard_on_the_next_call(
    driver: Driver, heard: list[type], caplog: pytest.LogCaptureFixture
) -> None:
    """One invoker: each call builds the events of the logger's level at that moment."""
    levels = (logging.WARNING, logging.DEBUG, logging.WARNING)
    transport = httpx.MockTransport(Script([httpx.Response(201, json={}) for _ in levels]))
    options: dict[str, Any] = {"retry": FAST_RETRY, "honours_keys": True}
    seen: list[list[type]] = []

    def call_at(level: int, invoke: Callable[[], object]) -> None:
        caplog.set_level(level, logger="agentkey")
        heard.clear()
        invoke()
        seen.append(list(heard))

    if driver == "sync":
        with (
            httpx.Client(transport=transport) as http,
            ToolInvoker(BASE, client=http, **options) as sync,
        ):
            for level in levels:
                call_at(level, lambda: sync.invoke(make_step(), path="/tools/create_db"))
    else:

        async def main() -> None:
            async with (
                httpx.AsyncClient(transport=transport) as http,
                AsyncToolInvoker(BASE, client=http, **options) as tools,
            ):
                for level in levels:
                    caplog.set_level(level, logger="agentkey")
                    heard.clear()
                    await tools.invoke(make_step(), path="/tools/create_db")
                    seen.append(list(heard))

        asyncio.run(main())
    assert seen == [[], [CallStartEvent, CallEndEvent], []]
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG]
    assert [r.getMessage().split(" ")[0] for r in debug] == ["calling", "called"]


class _LouderHook(LoggingHook):
    """A subclass may log more than LoggingHook does: it is not second-guessed."""


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("other", [Recorder, _LouderHook])
def test_any_other_hook_still_gets_every_event(
    driver: Driver, other: type, caplog: pytest.LogCaptureFixture
) -> None:
    """Beside the default hook, a hook of your own (or a subclass) receives every event."""
    caplog.set_level(logging.WARNING, logger="agentkey")
    got: list[InvokeEvent] = []
    hooks: tuple[Any, ...] = (LoggingHook(), other(), got.append)
    run_invoke(driver, Script(list(RETRY_ONCE)), make_step(), hooks=hooks)
    kinds = [type(e) for e in got]
    assert kinds == [
        CallStartEvent, AttemptEvent, RetryEvent, AttemptEvent, CallEndEvent,
    ]  # fmt: skip
    assert listened(hooks) == EVENT_TYPES
