"""Shared test helpers: a scripted MockTransport, a bearer auth, and a runner for both drivers."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from agentkey import PlanSession, Step
from agentkey.client._hooks import InvokeEvent, RetryEvent
from agentkey.client._invoker import AsyncToolInvoker, ToolInvoker, ToolResult
from agentkey.client._policies import PollPolicy, RetryPolicy

__all__ = [
    "BASE",
    "DRIVERS",
    "FAST_POLL",
    "FAST_RETRY",
    "Bearer",
    "Driver",
    "Recorder",
    "Script",
    "make_step",
    "run_invoke",
]

BASE = "https://tool.test"
Driver = Literal["sync", "async"]
DRIVERS: tuple[Driver, ...] = ("sync", "async")

#: Waits in the microsecond range so the table runs fast; Retry-After capped at 50 ms.
FAST_RETRY = RetryPolicy(
    max_attempts=8, deadline=10.0, initial_backoff=0.001, max_backoff=0.002, max_retry_after=0.05
)
FAST_POLL = PollPolicy(
    initial_backoff=0.001,
    backoff_multiplier=1.0,
    max_backoff=0.002,
    max_retry_after=0.002,
    deadline=10.0,
    min_interval=0.001,
)

Event = InvokeEvent
Answer = httpx.Response | Exception | Callable[[httpx.Request], httpx.Response]


class Bearer(httpx.Auth):
    """A fixed bearer token: lets tests see where credentials go."""

    def __init__(self, token: str = "s3cret-token") -> None:  # noqa: S107 - a test token
        self.token = token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = f"Bearer {self.token}"
        yield request


@dataclass
class Script:
    """Answers requests in order and records them; running out of answers fails the test."""

    answers: list[Answer]
    requests: list[httpx.Request] = field(default_factory=list)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if not self.answers:
            raise AssertionError(f"unexpected extra request {request.method} {request.url}")
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        if isinstance(answer, httpx.Response):  # a fresh copy: rows are shared by both drivers
            return httpx.Response(
                answer.status_code, headers=answer.headers, content=answer.content
            )
        return answer(request)

    def posts(self) -> list[httpx.Request]:
        return [r for r in self.requests if r.method == "POST"]

    def gets(self) -> list[httpx.Request]:
        return [r for r in self.requests if r.method == "GET"]

    def probes(self) -> list[httpx.Request]:
        """The OPTIONS requests agentkey sent to learn whether the route honours keys."""
        return [r for r in self.requests if r.method == "OPTIONS"]


@dataclass
class Recorder:
    """A hook that keeps every event."""

    events: list[Event] = field(default_factory=list)

    def __call__(self, event: Event) -> None:
        self.events.append(event)

    def retries(self) -> list[RetryEvent]:
        return [e for e in self.events if isinstance(e, RetryEvent)]


def make_step(index: int = 3, tool: str = "create_db", **args: Any) -> Step:
    """A step with fixed arguments in a fresh plan."""
    return PlanSession.new().step(index, tool, args or {"region": "eu-west-1", "gb": 20})


def run_invoke(
    driver: Driver,
    handler: Callable[[httpx.Request], httpx.Response],
    step: Step,
    *,
    resume: Sequence[str] | None = None,
    **options: Any,
) -> ToolResult:
    """Invoke ``step`` through ``driver`` over a MockTransport (or resume a poll if ``resume``)."""
    transport = httpx.MockTransport(handler)
    options.setdefault("retry", FAST_RETRY)
    options.setdefault("polling", FAST_POLL)
    options.setdefault("hooks", ())
    # The contract's table is about tools that honour keys; rows about other tools say so.
    options.setdefault("honours_keys", True)
    if driver == "sync":
        with (
            httpx.Client(transport=transport) as client,
            ToolInvoker(BASE, client=client, **options) as invoker,
        ):
            if resume is not None:
                return invoker.resume_poll(resume[0], resume[1])
            return invoker.invoke(step, path="/tools/create_db")

    async def main() -> ToolResult:
        async with (
            httpx.AsyncClient(transport=transport) as client,
            AsyncToolInvoker(BASE, client=client, **options) as invoker,
        ):
            if resume is not None:
                return await invoker.resume_poll(resume[0], resume[1])
            return await invoker.invoke(step, path="/tools/create_db")

    return asyncio.run(main())
