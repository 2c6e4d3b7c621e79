"""What agentkey adds to one MCP tools/call: client wrapper + server middleware vs plain call_tool.

Run: ``.venv/bin/python -m tests.integrations._mcp_overhead [calls] [inproc|http]``.

``inproc`` (default) connects the SDK's ``Client`` to the server in-process, so the
figures are the CPU cost of the SDK plus agentkey without network noise; ``http`` uses
the SDK's streamable HTTP app under uvicorn on 127.0.0.1 (the server in a thread).
Calls alternate between the variants, so load on the machine hits them alike; medians
are printed in microseconds. The store is a MemoryStore (a RedisStore adds its round
trips: one SET NX to claim and one Lua call to finish).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, cast

from mcp import Client, ClientSession
from mcp.server.context import HandlerResult, ServerRequestContext

from agentkey import PlanSession
from agentkey.integrations.mcp import IdempotentSession, IdempotentToolsMiddleware, connect
from agentkey.integrations.mcp._wire import KEY_FIELD
from agentkey.server import MemoryStore
from tests.integrations._mcp_app import Lab, build_server, running

ARGS: dict[str, Any] = {"region": "eu-west-1", "size": 1}


@asynccontextmanager
async def sessions(mode: str) -> AsyncIterator[tuple[ClientSession, ClientSession]]:
    """(plain server's session, guarded server's session)."""
    async with AsyncExitStack() as stack:
        if mode == "http":
            bare = stack.enter_context(running(None))
            guarded = stack.enter_context(running(MemoryStore()))
            plain = await stack.enter_async_context(connect(bare.url + "/mcp"))
            wrapped = await stack.enter_async_context(connect(guarded.url + "/mcp"))
        else:
            middleware = IdempotentToolsMiddleware(MemoryStore(), shared_key_space=True)
            bare_client = Client(build_server(Lab(), None))
            guarded_client = Client(build_server(Lab(), middleware))
            plain = (await stack.enter_async_context(bare_client)).session
            wrapped = (await stack.enter_async_context(guarded_client)).session
        yield plain, wrapped


async def timed(samples: list[float], call: Awaitable[object]) -> None:
    start = time.perf_counter()
    await call
    samples.append(time.perf_counter() - start)


async def measure(calls: int, mode: str) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"plain": [], "agentkey, new key": [], "agentkey, replay": []}
    async with sessions(mode) as (plain, wrapped):
        plan = PlanSession(id=str(uuid.uuid4()))
        tools = IdempotentSession(wrapped, plan, hooks=(), on_repeat="allow")  # new keys
        for _ in range(20):  # warm up both paths
            await plain.call_tool("create_vm", ARGS)
        await tools.call_tool("create_vm", ARGS, step=10**6)
        for i in range(calls):
            # The variants take turns being first: whatever a call leaves for the event
            # loop to finish lands in the next one, so a fixed order would bias the figures.
            first_plain = i % 2 == 0
            if first_plain:
                await timed(times["plain"], plain.call_tool("create_vm", ARGS))
            await timed(times["agentkey, new key"], tools.call_tool("create_vm", ARGS, step=i))
            await timed(times["agentkey, replay"], tools.call_tool("create_vm", ARGS, step=i))
            if not first_plain:
                await timed(times["plain"], plain.call_tool("create_vm", ARGS))
    return times


def client_side(calls: int) -> float:
    """Median seconds the client wrapper spends before sending: plan step, key, _meta."""
    plan = PlanSession(id=str(uuid.uuid4()))
    samples = []
    for i in range(calls):
        start = time.perf_counter()
        step = plan.step(i, "create_vm", ARGS, on_repeat="allow")
        _ = {"io.agentkey/idempotency-key": step.idempotency_key}
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


async def server_side(calls: int) -> tuple[float, float, float]:
    """Median seconds of (a bare handler, the middleware on a new key, the middleware replaying)."""
    middleware = IdempotentToolsMiddleware(MemoryStore(), shared_key_space=True)
    plan = PlanSession(id=str(uuid.uuid4()))
    answer = {"content": [{"type": "text", "text": "ok"}], "isError": False}

    async def handler(ctx: ServerRequestContext[Any, Any]) -> HandlerResult:
        return answer

    bare: list[float] = []
    new: list[float] = []
    replay: list[float] = []
    for i in range(calls):
        step = plan.step(i, "create_vm", ARGS, on_repeat="allow")  # a new key each time
        meta = {KEY_FIELD: step.idempotency_key}
        ctx: ServerRequestContext[Any, Any] = ServerRequestContext(
            session=cast(Any, None),
            lifespan_context={},
            protocol_version="2025-11-25",
            method="tools/call",
            params={"name": "create_vm", "arguments": ARGS, "_meta": meta},
            request_id=i,
        )
        start = time.perf_counter()
        await handler(ctx)
        bare.append(time.perf_counter() - start)
        for samples in (new, replay):  # the first claims and stores, the second replays
            start = time.perf_counter()
            await middleware(ctx, handler)
            samples.append(time.perf_counter() - start)
    return statistics.median(bare), statistics.median(new), statistics.median(replay)


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    mode = sys.argv[2] if len(sys.argv) > 2 else "inproc"
    times = asyncio.run(measure(calls, mode))
    base = statistics.median(times["plain"])
    print(f"{mode}, {calls} calls each, medians:")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"  {name:18s} {median * 1e6:8.0f} us  (+{(median - base) * 1e6:5.0f} us)")
    print(f"isolated, {calls} calls each, medians:")
    print(f"  client: plan step + key + _meta    {client_side(calls) * 1e6:6.0f} us")
    bare, new, replay = asyncio.run(server_side(calls))
    print(f"  server: middleware, new key        {(new - bare) * 1e6:6.0f} us (MemoryStore)")
    print(f"  server: middleware, replay         {(replay - bare) * 1e6:6.0f} us (MemoryStore)")


if __name__ == "__main__":
    main()
