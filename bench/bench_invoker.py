"""Invoker overhead: ToolInvoker.invoke vs a plain httpx POST of the same step, in one run.

Both send the same key and canonical body to the same bare Starlette tool on a
loopback uvicorn (sync and async), and, to isolate agentkey's own CPU cost,
to an in-process ``httpx.MockTransport``. Steps (and their keys) are built
before timing, so only the call path is measured. The ratio is agentkey's
price for the protocol flow: tenacity's engine, answer classification,
replay detection and the ToolResult model.

    python bench/bench_invoker.py            # full run
    python bench/bench_invoker.py --smoke    # a quick run for CI
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests._loopback

from agentkey import AsyncToolInvoker, PlanSession, Step, ToolInvoker
from tests._loopback import serve  # uvicorn on loopback with TCP_NODELAY

NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]  # no Nagle + delayed-ACK stalls


def tool_app() -> Any:
    async def charge(request: Request) -> JSONResponse:
        args = await request.json()
        return JSONResponse({"charge_id": "ch_1", "amount": args["amount"]}, status_code=201)

    return Starlette(routes=[Route("/tools/charge", charge, methods=["POST"])])


def steps(n: int) -> list[Step]:
    plan = PlanSession.new()
    return [plan.step(i, "charge", {"amount": 100 + i}) for i in range(n)]


def plain_sync(client: httpx.Client, batch: list[Step]) -> None:
    for step in batch:
        response = client.post(
            "/tools/charge",
            headers={"Idempotency-Key": step.idempotency_key, "Content-Type": "application/json"},
            content=step.body,
        )
        assert response.status_code == 201
        response.json()


def agentkey_sync(invoker: ToolInvoker, batch: list[Step]) -> None:
    for step in batch:
        assert invoker.invoke(step).status_code == 201


def timed(fn: Callable[[list[Step]], None], n: int) -> float:
    batch = steps(n)  # keys derived before the clock starts
    started = time.perf_counter()
    fn(batch)
    return (time.perf_counter() - started) / n * 1e6


def best_of(repeats: int, fn: Callable[[], float]) -> float:
    return min(fn() for _ in range(repeats))


def sync_pair(url: str | None, n: int, repeats: int) -> tuple[float, float]:
    """Microseconds per call: (plain httpx, agentkey), over loopback or a MockTransport."""

    def transport() -> httpx.BaseTransport:
        if url is None:
            return httpx.MockTransport(lambda r: httpx.Response(201, json={"charge_id": "ch_1"}))
        return httpx.HTTPTransport(socket_options=NODELAY)

    base = url or "https://tool.test"
    with (
        httpx.Client(base_url=base, transport=transport()) as client,
        httpx.Client(transport=transport()) as inner,
        ToolInvoker(base, client=inner, route_template="/tools/{tool}", hooks=()) as invoker,
    ):
        warm = steps(5)
        plain_sync(client, warm)
        agentkey_sync(invoker, warm)
        plain = best_of(repeats, lambda: timed(lambda b: plain_sync(client, b), n))
        ours = best_of(repeats, lambda: timed(lambda b: agentkey_sync(invoker, b), n))
    return plain, ours


async def async_pair(url: str, n: int, repeats: int) -> tuple[float, float]:
    """Microseconds per call over loopback with the async client and invoker."""
    async with (
        httpx.AsyncClient(
            base_url=url, transport=httpx.AsyncHTTPTransport(socket_options=NODELAY)
        ) as client,
        httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(socket_options=NODELAY)) as inner,
        AsyncToolInvoker(url, client=inner, route_template="/tools/{tool}", hooks=()) as invoker,
    ):

        async def plain(batch: list[Step]) -> float:
            started = time.perf_counter()
            for step in batch:
                response = await client.post(
                    "/tools/charge",
                    headers={
                        "Idempotency-Key": step.idempotency_key,
                        "Content-Type": "application/json",
                    },
                    content=step.body,
                )
                assert response.status_code == 201
                response.json()
            return (time.perf_counter() - started) / len(batch) * 1e6

        async def ours(batch: list[Step]) -> float:
            started = time.perf_counter()
            for step in batch:
                assert (await invoker.invoke(step)).status_code == 201
            return (time.perf_counter() - started) / len(batch) * 1e6

        await plain(steps(5))
        await ours(steps(5))
        plain_us = min([await plain(steps(n)) for _ in range(repeats)])
        ours_us = min([await ours(steps(n)) for _ in range(repeats)])
    return plain_us, ours_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a quick run for CI")
    smoke = parser.parse_args().smoke
    n, repeats = (30, 2) if smoke else (1000, 5)

    rows: list[tuple[str, float, float]] = []
    mock_plain, mock_ours = sync_pair(None, n * 3, repeats)
    rows.append(("sync, in-process MockTransport", mock_plain, mock_ours))
    with serve(tool_app()) as url:
        rows.append(("sync, loopback uvicorn", *sync_pair(url, n, repeats)))
        rows.append(("async, loopback uvicorn", *asyncio.run(async_pair(url, n, repeats))))

    print(f"bench_invoker ({n} sequential calls x {repeats}, best run, microseconds per call)")
    print(f"  {'path':32} {'plain httpx':>12} {'agentkey':>10} {'overhead':>10} {'ratio':>7}")
    for name, plain, ours in rows:
        print(
            f"  {name:32} {plain:10.1f}us {ours:8.1f}us {ours - plain:8.1f}us {ours / plain:6.2f}x"
        )


if __name__ == "__main__":
    main()
