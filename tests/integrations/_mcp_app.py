"""A real MCP server for the MCP tests: the SDK's streamable HTTP app under uvicorn on loopback.

The ASGI wrapper around the SDK's app can lose answers after the tool ran
(``drop``: the response starts, then the connection is cut, so the client never
reads the result), and can play a bearer-token resource server whose first
token gets revoked (``tokens``). ``Counter`` counts tool executions on the server.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread
import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from starlette.types import Message, Receive, Scope, Send

from agentkey.integrations.mcp import IdempotentToolsMiddleware
from agentkey.server import Store, current_claim
from tests.server._util import with_options

__all__ = ["Lab", "running"]


@dataclass
class Lab:
    """The server's knobs and counters, shared with the test thread."""

    runs: Counter[str] = field(default_factory=Counter)
    #: tools/call answers still to lose, per tool name
    drop: Counter[str] = field(default_factory=Counter)
    #: when set, /mcp wants a bearer token and /token issues t1, t2...; ``revoked`` get 401
    tokens: bool = False
    issued: int = 0
    revoked: set[str] = field(default_factory=set)
    seen_tokens: list[str] = field(default_factory=list)
    #: hold_charge sets ``holding`` when it starts, then waits for ``gate``
    holding: threading.Event = field(default_factory=threading.Event)
    gate: threading.Event = field(default_factory=threading.Event)
    #: when set, a tools/list request waits for ``gate`` before it is answered
    stall_list: bool = False
    #: set by a lost answer when ``down_after_drop``: every request then fails (HTTP 500)
    #: until the test restarts the server, as a server that crashed after running the tool
    down_after_drop: bool = False
    down: bool = False
    #: what ``lookup`` reads, per name
    values: dict[str, str] = field(default_factory=dict)
    url: str = ""


def build_server(lab: Lab, middleware: IdempotentToolsMiddleware | None) -> MCPServer[Any]:
    @asynccontextmanager
    async def lifespan(_: MCPServer[Any]) -> AsyncIterator[dict[str, Any]]:
        try:
            yield {}
        finally:  # the store's connections belong to this server's event loop
            if middleware is not None:
                await middleware.store.aclose()

    server: MCPServer[Any] = MCPServer(
        "agentkey-test",
        middleware=[] if middleware is None else [middleware],
        lifespan=lifespan,
    )

    @server.tool()
    def create_vm(region: str, size: int = 1) -> dict[str, Any]:
        """Create a VM (counted)."""
        lab.runs["create_vm"] += 1
        return {"id": f"vm-{lab.runs['create_vm']}", "region": region, "size": size}

    @server.tool()
    def delete_vm(region: str, size: int = 1) -> str:
        """Delete a VM (counted)."""
        lab.runs["delete_vm"] += 1
        return "deleted"

    @server.tool()
    async def slow_charge(amount: int) -> str:
        """A charge that takes a while, so two callers overlap (counted)."""
        await anyio.sleep(0.5)
        lab.runs["slow_charge"] += 1
        return f"charged {amount}"

    @server.tool()
    async def hold_charge(amount: int) -> str:
        """A charge that runs until the test opens the gate (counted)."""
        lab.holding.set()
        await anyio.to_thread.run_sync(lab.gate.wait, 30.0)
        lab.runs["hold_charge"] += 1
        return f"charged {amount}"

    @server.tool()
    def lookup(name: str) -> str:
        """A read: the current value of ``name`` (counted)."""
        lab.runs["lookup"] += 1
        return lab.values.get(name, "")

    @server.tool()
    def checkout(cart: str, meta: dict[str, Any] | None = None) -> str:
        """A UCP-style checkout tool: its key travels in ``meta["idempotency-key"]`` (counted)."""
        lab.runs["checkout"] += 1
        return f"order {lab.runs['checkout']} for {cart}"

    @server.tool()
    def transfer(amount: int, idempotency_key: str | None = None) -> str:
        """A tool with a plain ``idempotency_key`` argument (counted)."""
        lab.runs["transfer"] += 1
        return f"transfer {lab.runs['transfer']} of {amount}"

    @server.tool()
    def fragile(amount: int) -> str:
        """Fails after its side effect began: recorded FAILED, replayed as an error."""
        current_claim().begin_mutation()
        lab.runs["fragile"] += 1
        raise RuntimeError("the card network timed out after the debit")

    @server.tool()
    def forward_charge(amount: int) -> str:
        """A plain gateway tool: it charges, then (the first time) passes on a downstream
        agentkey service's bare "unavailable" refusal, with no protected marker (counted)."""
        lab.runs["forward_charge"] += 1
        if lab.runs["forward_charge"] == 1:
            raise MCPError(-32603, "downstream unavailable", {"type": "io.agentkey/unavailable"})
        return f"charged {amount}"

    return server


def wrap(inner: Any, lab: Lab) -> Any:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await inner(scope, receive, send)
            return
        if scope["path"] == "/token":
            await _token(lab, send)
            return
        if lab.tokens and not await _authorized(scope, lab, send):
            return
        if lab.down:
            raise ConnectionAbortedError("the server is down (test)")
        if scope["method"] != "POST":
            await inner(scope, receive, send)
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        replayed = False

        async def receive_once() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        if lab.stall_list and b'"tools/list"' in body:
            await anyio.to_thread.run_sync(lab.gate.wait, 30)
        victim = next((n for n in lab.drop if lab.drop[n] > 0 and f'"{n}"'.encode() in body), None)
        if victim is None or b'"tools/call"' not in body:
            await inner(scope, receive_once, send)
            return
        lab.drop[victim] -= 1

        async def start_only(message: Message) -> None:
            if message["type"] == "http.response.start":
                await send(message)

        await inner(scope, receive_once, start_only)  # the tool runs, its answer goes nowhere
        lab.down = lab.down_after_drop
        raise ConnectionAbortedError("answer lost after commit (test proxy)")

    return app


async def _token(lab: Lab, send: Send) -> None:
    lab.issued += 1
    body = f'{{"access_token":"t{lab.issued}","token_type":"Bearer","expires_in":3600}}'.encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _authorized(scope: Scope, lab: Lab, send: Send) -> bool:
    headers = dict(scope["headers"])
    token = headers.get(b"authorization", b"").decode().removeprefix("Bearer ")
    lab.seen_tokens.append(token)
    if token and token not in lab.revoked:
        return True
    await send({"type": "http.response.start", "status": 401, "headers": []})
    await send({"type": "http.response.body", "body": b""})
    return False


@contextmanager
def running(
    store: Store | None, lab: Lab | None = None, *, port: int = 0, **options: Any
) -> Iterator[Lab]:
    """Serve the test tools (behind the middleware when ``store`` is given) on 127.0.0.1
    (on ``port``, to restart a server where it was)."""
    lab = lab or Lab()
    lab.down = False
    if "principal" not in options:  # the lab's bearer check is not the SDK's OAuth
        options.setdefault("shared_key_space", True)
    middleware = (
        None if store is None else IdempotentToolsMiddleware(store, **with_options(options))
    )
    app = wrap(build_server(lab, middleware).streamable_http_app(), lab)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="critical", lifespan="on", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start on loopback within 10 s")
        time.sleep(0.01)
    lab.url = f"http://127.0.0.1:{port}"
    try:
        yield lab
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
