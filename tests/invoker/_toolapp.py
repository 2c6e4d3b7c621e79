"""A small scripted, fault-injecting tool server for the end-to-end tests.

It implements the server half of the contract itself (no agentkey.server):
claim a key (409 + Retry-After while in flight), run the tool once, store the
answer, replay it with ``Idempotent-Replayed: true``. Faults are set per tool
name on :class:`ToolApp.faults` before a test invokes:

- ``prelude``: answers (status, headers) given before the tool is even claimed;
- ``delay``: seconds the tool runs while holding the claim;
- ``after_commit``: ``"drop"`` (close the connection after storing the answer)
  or ``"stall"`` (store the answer, then hold the response past the client's
  read timeout);
- ``status``: the status the tool answers with (a 500 is stored, then replayed);
- ``async_polls``: answer 202 + Location, and report ``running`` that many times.

Every answer says ``Idempotency-Protected: true`` (set ``advertise`` False for a tool
that honours keys without saying so).

Every execution is counted per key in :attr:`ToolApp.executions`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

__all__ = ["Faults", "Seen", "ToolApp"]

REPLAY = {"Idempotent-Replayed": "true"}


@dataclass
class Faults:
    prelude: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    delay: float = 0.0
    after_commit: str | None = None
    stall: float = 2.0
    status: int = 200
    async_polls: int | None = None
    final_state: str = "succeeded"
    status_origin: str = ""  # put the status URL on another origin


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    headers: dict[str, str]


class ToolApp:
    """The tool server: ``app`` is the ASGI callable to serve."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.executions: Counter[str] = Counter()
        self.records: dict[str, tuple[int, dict[str, str], bytes]] = {}
        self.in_flight: set[str] = set()
        self.faults: dict[str, Faults] = {}
        self.seen: list[Seen] = []
        self.request_seen = threading.Event()
        self.operations: dict[str, list[str]] = {}
        self._ids = itertools.count(1)
        #: Say on every answer that the routes honour Idempotency-Key, as the contract's
        #: servers do (agentkey's middleware sends the same header).
        self.advertise = True
        self.app = Starlette(
            routes=[
                Route("/tools/{name}", self.tool, methods=["POST"]),
                Route("/old/{name}", self.moved, methods=["POST"]),
                Route("/operations/{op}", self.operation, methods=["GET"]),
            ]
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.advertise:
            await self.app(scope, receive, send)
            return

        async def advertised(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), (b"idempotency-protected", b"true")]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, advertised)

    def _see(self, request: Request) -> None:
        with self.lock:
            self.seen.append(Seen(request.method, request.url.path, dict(request.headers)))
        self.request_seen.set()

    async def moved(self, request: Request) -> Response:
        self._see(request)
        return Response(
            status_code=307, headers={"Location": f"/tools/{request.path_params['name']}"}
        )

    async def tool(self, request: Request) -> Response:
        self._see(request)
        name = request.path_params["name"]
        faults = self.faults.setdefault(name, Faults())
        key = request.headers.get("idempotency-key")
        if not key:
            return JSONResponse({"error": "missing Idempotency-Key"}, status_code=400)
        args = json.loads(await request.body())
        with self.lock:
            if faults.prelude:
                status, headers = faults.prelude.pop(0)
                return JSONResponse({"error": status}, status_code=status, headers=headers)
            if key in self.records:
                status, headers, body = self.records[key]
                return Response(body, status_code=status, headers={**headers, **REPLAY})
            if key in self.in_flight:
                return JSONResponse({"error": "in flight"}, 409, headers={"Retry-After": "1"})
            self.in_flight.add(key)
        try:
            await asyncio.sleep(faults.delay)
            with self.lock:
                self.executions[key] += 1
                count = self.executions[key]
            status, headers, body = self._answer(faults, name, args, count)
            with self.lock:
                self.records[key] = (status, headers, body)
        finally:
            with self.lock:
                self.in_flight.discard(key)
        if faults.after_commit == "drop":
            return _Dropped()
        if faults.after_commit == "stall":
            await asyncio.sleep(faults.stall)
        return Response(body, status_code=status, headers=headers)

    def _answer(
        self, faults: Faults, name: str, args: Any, count: int
    ) -> tuple[int, dict[str, str], bytes]:
        headers = {"content-type": "application/json"}
        if faults.async_polls is not None:
            op = f"op{next(self._ids)}"
            with self.lock:
                self.operations[op] = ["running"] * faults.async_polls + [faults.final_state]
            headers["location"] = f"{faults.status_origin}/operations/{op}"
            return 202, headers, json.dumps({"status": "accepted"}).encode()
        body = {"tool": name, "args": args, "execution": count}
        return faults.status, headers, json.dumps(body).encode()

    async def operation(self, request: Request) -> Response:
        self._see(request)
        with self.lock:
            states = self.operations.get(request.path_params["op"])
            if states is None:
                return JSONResponse({"error": "no such operation"}, status_code=404)
            state = states.pop(0) if len(states) > 1 else states[0]
        return JSONResponse({"status": state, "result": {"id": request.path_params["op"]}})


class _Dropped(Response):
    """Starts a response, then returns without finishing it: uvicorn closes the connection."""

    def __init__(self) -> None:
        super().__init__()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"100")]}
        )
        await send({"type": "http.response.body", "body": b'{"partial', "more_body": True})
