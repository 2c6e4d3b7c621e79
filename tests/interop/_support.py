"""Real servers and both invoker drivers for the interop suite.

Every server here runs one counting :class:`Tool` (``POST /tools/{name}`` and
``POST /v2/tools/{name}``) behind the idempotency layer under test: idemkit's ASGI
middleware in one of its two modes, or agentkey's own. A :class:`Wire` in front of
it all records each answer as it leaves and can lose one after commit, as a proxy
or a client read timeout would. Stores are a real redis-server; servers are uvicorn
on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentkey import AsyncToolInvoker, InvokeError, RetryPolicy, Step, ToolInvoker, ToolResult
from agentkey.server import IdempotencyMiddleware, RedisStore, Store
from tests._loopback import RedisServer
from tests.server._util import serve_closing, with_options

try:
    import idemkit
    from idemkit import Decision, HttpConfig, IdempotencyEvent, RedisBackend
except ImportError:  # pragma: no cover - a missing library fails the suite, never skips it
    raise pytest.UsageError(
        "tests/interop needs idemkit: install the interop dependency group "
        "(pip install --group interop)"
    ) from None

__all__ = [
    "DRIVERS",
    "FAST",
    "IDEMKIT_VERSION",
    "MODES",
    "STALL_SECONDS",
    "Decision",
    "Driver",
    "Events",
    "Mode",
    "Served",
    "StartIdemkit",
    "Tool",
    "Wire",
    "invoke_all",
    "serve_agentkey",
    "serve_idemkit",
]

#: The idemkit release this suite proves (the interop dependency group pins it).
IDEMKIT_VERSION = "1.0.2"
if idemkit.__version__ != IDEMKIT_VERSION:  # pragma: no cover
    raise pytest.UsageError(
        f"tests/interop proves idemkit=={IDEMKIT_VERSION}, found {idemkit.__version__}; "
        "install the pinned interop dependency group"
    )

Mode = Literal["default", "stripe"]
MODES: tuple[Mode, ...] = ("default", "stripe")
Driver = Literal["sync", "async"]
DRIVERS: tuple[Driver, ...] = ("sync", "async")
Loss = Literal["drop", "stall"]

#: How long a stalled answer is held back: past the 0.5 s read timeout the tests use.
STALL_SECONDS = 1.5
#: Quick waits, so a test spends its time on the server, not in backoff.
FAST = RetryPolicy(
    max_attempts=50, deadline=10.0, initial_backoff=0.01, max_backoff=0.05, max_retry_after=0.05
)


@dataclass(frozen=True)
class Run:
    """One execution of the tool: its path and the Idempotency-Key header it carried."""

    path: str
    key: str | None


class Tool:
    """The counting tool. ``gates[name]`` holds tool ``name`` mid-run until it is set;
    ``entered(name)`` is set once a request for ``name`` is inside the handler."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.runs: list[Run] = []
        self.gates: dict[str, threading.Event] = {}
        self._entered: dict[str, threading.Event] = {}
        self.delay = 0.0
        self.routes = [
            Route(path, self._tool, methods=["POST"])
            for path in ("/tools/{name}", "/v2/tools/{name}")
        ]

    async def _tool(self, request: Request) -> Response:
        args = await request.json()
        name = request.path_params["name"]
        key = request.headers.get("idempotency-key")
        return JSONResponse(await self.run(name, request.url.path, key, args), status_code=201)

    async def run(self, name: str, path: str, key: str | None, args: object) -> dict[str, Any]:
        """One execution of tool ``name`` on ``path``: counted, then its answer."""
        self.entered(name).set()
        gate = self.gates.get(name)
        if gate is not None:  # waits in a worker thread: the server loop stays free
            await asyncio.to_thread(gate.wait, 10)
        if self.delay:
            await asyncio.sleep(self.delay)
        with self._lock:
            self.runs.append(Run(path, key))
            count = sum(r.path == path for r in self.runs)
        return {"tool": name, "route": path, "args": args, "execution": count}

    def entered(self, name: str) -> threading.Event:
        with self._lock:
            return self._entered.setdefault(name, threading.Event())

    def executions(self, path: str | None = None) -> int:
        """Executions so far: on ``path``, or on every route."""
        with self._lock:
            return sum(path is None or r.path == path for r in self.runs)

    def seen_keys(self) -> list[str | None]:
        """The Idempotency-Key header of each execution, in order."""
        with self._lock:
            return [r.key for r in self.runs]

    def most_runs_per_key(self) -> int:
        """The most executions of one operation: one key (either header style) on one route."""
        with self._lock:
            keyed = Counter((r.path, r.key.strip('"')) for r in self.runs if r.key is not None)
        assert keyed, "the tool never ran with a key"
        return max(keyed.values())


@dataclass(frozen=True)
class Answer:
    """One answer as it left the server: status, headers (lowercase names), monotonic time."""

    path: str
    status: int
    headers: dict[str, str]
    at: float = field(default_factory=time.monotonic)


@dataclass
class Wire:
    """The outermost ASGI layer: records answers; loses one after commit on request.

    ``lose[path] = "drop"``: the next request on ``path`` runs and commits, then its
    answer starts and the connection closes mid-body. ``"stall"``: the answer is held
    back :data:`STALL_SECONDS` (past the client's read timeout), then dropped.
    """

    app: ASGIApp
    answers: list[Answer] = field(default_factory=list)
    lose: dict[str, Loss] = field(default_factory=dict)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loss = self.lose.pop(scope["path"], None)

        async def record(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = {
                    k.decode("latin-1").lower(): v.decode("latin-1")
                    for k, v in message.get("headers", ())
                }
                self.answers.append(Answer(scope["path"], int(message["status"]), headers))
            if loss is None:
                await send(message)

        await self.app(scope, receive, record)  # returns once the outcome is stored
        if loss == "stall":
            await asyncio.sleep(STALL_SECONDS)
        if loss is not None:
            start = [(b"content-type", b"application/json"), (b"content-length", b"100")]
            await send({"type": "http.response.start", "status": 201, "headers": start})
            await send({"type": "http.response.body", "body": b'{"partial', "more_body": True})

    def on(self, path: str) -> list[Answer]:
        """The answers given on ``path``, in order."""
        return [a for a in list(self.answers) if a.path == path]


class Events:
    """idemkit's observability events: shows on the server that duplicates are waiting."""

    def __init__(self) -> None:
        self._seen: list[Decision] = []
        self._changed = threading.Condition()

    def __call__(self, event: IdempotencyEvent) -> None:
        with self._changed:
            self._seen.append(event.decision)
            self._changed.notify_all()

    def wait_for(self, decision: Decision, count: int, timeout: float = 10.0) -> None:
        """Block until idemkit has emitted ``decision`` at least ``count`` times."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._seen.count(decision) >= count, timeout):
                seen = [d.value for d in self._seen]
                raise AssertionError(f"idemkit emitted {seen}; expected {count} x {decision.value}")


@dataclass(frozen=True)
class Served:
    """A running server: its base URL, the tool behind it and the wire in front of it."""

    url: str
    tool: Tool
    wire: Wire
    events: Events


#: The ``idemkit_server`` fixture: ``start(mode, wait_timeout=10.0, require_key=False)``.
StartIdemkit = Callable[..., AbstractContextManager[Served]]


@contextmanager
def serve_idemkit(
    redis: RedisServer, mode: Mode, *, wait_timeout: float, require_key: bool
) -> Iterator[Served]:
    """idemkit's middleware on ``redis`` in ``mode``, in front of a fresh counting tool."""
    tool, events = Tool(), Events()
    backend = RedisBackend.from_url(redis.url, namespace=f"ik{uuid.uuid4().hex[:12]}")
    config = HttpConfig(
        compat_mode=mode,
        scope_mode="single_tenant",  # one caller: the test
        wait_timeout_seconds=wait_timeout,
        require_key_for_mutations=require_key,
        event_handlers=(events,),
    )
    middleware = Middleware(idemkit.IdempotencyMiddleware, backend=backend, config=config)
    wire = Wire(Starlette(routes=tool.routes, middleware=[middleware]))
    # serve_closing only calls aclose(), which RedisBackend has: it closes the redis
    # client inside the server's own event loop.
    with serve_closing(wire, cast(Store, backend)) as url:
        yield Served(url, tool, wire, events)


@contextmanager
def serve_agentkey(redis: RedisServer, **options: Any) -> Iterator[Served]:
    """agentkey's IdempotencyMiddleware on ``redis`` (with ``options``), in front of a
    fresh counting tool."""
    tool = Tool()
    store = RedisStore(redis.url, prefix=f"ak{uuid.uuid4().hex[:12]}")
    options.setdefault("shared_key_space", True)
    middleware = Middleware(IdempotencyMiddleware, store=store, **with_options(options))
    wire = Wire(Starlette(routes=tool.routes, middleware=[middleware]))
    with serve_closing(wire, store) as url:
        yield Served(url, tool, wire, Events())


#: What one call gave: its result, or the error it raised.
Called = ToolResult | InvokeError


def invoke_all(driver: Driver, url: str, steps: Sequence[Step], **options: Any) -> list[Called]:
    """Invoke ``steps`` at once through one invoker of ``driver``; a result or error each.

    ``options`` go to the invoker, except ``idempotency_key`` which goes to every invoke.
    """
    options.setdefault("retry", FAST)
    options.setdefault("route_template", "/tools/{tool}")
    options.setdefault("hooks", ())
    # The peers here honour keys without saying so on a first answer; a user says so.
    options.setdefault("honours_keys", True)
    key = options.pop("idempotency_key", None)
    if driver == "sync":
        with ToolInvoker(url, **options) as invoker:

            def one(step: Step) -> Called:
                try:
                    return invoker.invoke(step, idempotency_key=key)
                except InvokeError as exc:
                    return exc

            with concurrent.futures.ThreadPoolExecutor(max_workers=len(steps)) as pool:
                return list(pool.map(one, steps))

    async def main() -> list[Called]:
        async with AsyncToolInvoker(url, **options) as invoker:

            async def one(step: Step) -> Called:
                try:
                    return await invoker.invoke(step, idempotency_key=key)
                except InvokeError as exc:
                    return exc

            return list(await asyncio.gather(*(one(s) for s in steps)))

    return asyncio.run(main())
