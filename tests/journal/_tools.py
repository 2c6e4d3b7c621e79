"""A tool server that does NOT honour Idempotency-Key, and a faulty network in front of it.

Every POST to ``/tools/{name}`` of :class:`PlainTool` runs the tool (its side
effect counted in ``executions``), whatever key it carries. ``GET /lookup/{key}``
says whether a key's call ran: 200 with its answer, or 404 (what an ``HttpLookup``
reconcile hook asks). :class:`FaultOnce` sits in front (of the plain tool, or of the
tool behind agentkey's middleware) and spoils the first answer of a tool after the
server has finished with it: lost, late, or replaced by a proxy's 502.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from agentkey.journal import Journal

__all__ = ["FaultOnce", "PassThrough", "PlainTool"]


class FaultOnce:
    """An ASGI layer that spoils the first answer of each tool named in ``faults``.

    - ``drop``: the answer is lost (the connection closes without it);
    - ``slow``: the answer comes ``delay`` seconds late (past the client's read timeout);
    - ``502``: a proxy answers 502 Bad Gateway instead.
    The server behind runs and finishes either way: these are faults of the way back.
    """

    def __init__(self, app: Any, faults: dict[str, str], *, delay: float = 1.0) -> None:
        self.app, self.faults, self.delay = app, dict(faults), delay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = scope["path"].rsplit("/", 1)[-1] if scope["type"] == "http" else ""
        fault = self.faults.pop(name, None) if scope.get("method") == "POST" else None
        if fault is None:
            await self.app(scope, receive, send)
            return
        held: list[Any] = []

        async def keep(message: Any) -> None:
            held.append(message)

        await self.app(scope, receive, keep)
        if fault == "slow":
            await asyncio.sleep(self.delay)
            for message in held:
                await send(message)
        elif fault == "502":
            await send({"type": "http.response.start", "status": 502, "headers": []})
            await send({"type": "http.response.body", "body": b"bad gateway"})
        # "drop": nothing is sent; the server closes the connection


class PlainTool:
    """The ASGI app. Modes per tool name:

    - ``ok`` (the default): run, answer 201;
    - ``502-before``: answer 502 without running (the tool crashed first);
    - ``hold``: run, then wait for ``release`` before answering.
    """

    def __init__(self) -> None:
        self.executions: Counter[str] = Counter()
        self.answers: dict[str, dict[str, Any]] = {}
        self.modes: dict[str, str] = {}
        self.ran = threading.Event()
        self.release = threading.Event()
        self._lock = threading.Lock()
        self.app = Starlette(
            routes=[
                Route("/tools/{name}", self.tool, methods=["POST"]),
                Route("/lookup/{key}", self.lookup, methods=["GET"]),
            ]
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)

    async def _run(self, name: str, request: Request) -> dict[str, Any]:
        args = json.loads(await request.body())
        key = request.headers.get("idempotency-key", "")
        with self._lock:
            self.executions[name] += 1
            answer = {"tool": name, "run": self.executions[name], "args": args}
            self.answers[key] = answer
        self.ran.set()
        return answer

    async def tool(self, request: Request) -> Response:
        name = request.path_params["name"]
        mode = self.modes.get(name, "ok")
        if mode == "502-before":
            return JSONResponse({"error": "bad gateway"}, status_code=502)
        answer = await self._run(name, request)
        if mode == "hold":
            await asyncio.to_thread(self.release.wait, 30)
        return JSONResponse(answer, status_code=201)

    async def lookup(self, request: Request) -> Response:
        answer = self.answers.get(request.path_params["key"])
        if answer is None:
            return JSONResponse({"error": "no such call"}, status_code=404)
        return JSONResponse(answer)


class PassThrough:
    """A real journal with every operation passed on to it; a subclass overrides the ones
    it changes (to force an interleaving)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.supports_sync, self.supports_async = inner.supports_sync, inner.supports_async

    def __getattr__(self, name: str) -> Any:  # max_body_bytes and the like
        return getattr(self.inner, name)


def _passed_on(name: str) -> Any:
    def method(self: PassThrough, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.inner, name)(*args, **kwargs)

    return method


# On the class, not only through __getattr__: isinstance(x, Journal) looks the members up
# statically from Python 3.12 on.
for _name in dir(Journal):
    if not _name.startswith("_"):
        setattr(PassThrough, _name, _passed_on(_name))
