"""The default hook's cost: ToolInvoker with its default LoggingHook against ``hooks=()``.

Both sides are the same invoker options (no journal, the tool declared to honour keys)
except ``hooks``: the default (``hooks=None``: one ``LoggingHook`` on the ``agentkey``
logger, at Python's default WARNING level, so a call that succeeds at its first
attempt logs nothing) against no hooks at all. Steps are built before any clock starts.
Rounds of A B B A (A = ``hooks=()``, B = the default); a round's figures sum both slots
of each side. Rows:

- **sync, in-process MockTransport**: thread CPU per call, all of it client work;
- **async, in-process ASGI tool**: ``AsyncToolInvoker`` over ``httpx.ASGITransport`` to a
  minimal ASGI tool in this process, one call after another, thread CPU per call;
- **sync, loopback uvicorn process**: against the bare tool in a process of its own
  (``bench/_apps.py``), client process CPU per call.

The figure of merit is the CPU each call adds (B - A, in microseconds, median over the
rounds, with its interquartile range); the ratio is shown beside it.

    python bench/bench_hooks.py            # about a minute, writes bench/results/hooks.json
    python bench/bench_hooks.py --smoke    # a few seconds, for CI (writes nothing)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for bench._harness

from agentkey import AsyncToolInvoker, PlanSession, Step, ToolInvoker
from bench._harness import machine, servers, write_results
from bench.bench_invoker import (
    NODELAY,
    Figures,
    Pairs,
    abba,
    async_abba,
    mock,
    row,
    sync_slot,
)


def make_steps(n: int) -> list[Step]:
    """Distinct calls (a repeated one would be sent as a repeat, and warn): steps 0 to n-1."""
    plan = PlanSession.new()
    return [plan.step(i, "charge", {"amount": 100 + i}) for i in range(n)]


OPTIONS: dict[str, Any] = {
    "route_template": "/tools/{tool}",
    "journal": False,
    "honours_keys": True,
}


def sync_pairs(
    base: str,
    transport: Callable[[], httpx.BaseTransport],
    n: int,
    rounds: int,
    clock: Callable[[], float],
) -> Pairs:
    """A = ``hooks=()``, B = the default hooks; the same steps, each invoker its own client."""
    steps = make_steps(n)
    with (
        httpx.Client(transport=transport()) as plain_http,
        httpx.Client(transport=transport()) as hooked_http,
        ToolInvoker(base, client=plain_http, hooks=(), **OPTIONS) as plain,
        ToolInvoker(base, client=hooked_http, **OPTIONS) as hooked,
    ):

        def call(invoker: ToolInvoker) -> Callable[[Step], None]:
            def one(step: Step) -> None:
                assert invoker.invoke(step).status_code == 201

            return one

        return abba(
            rounds,
            sync_slot(call(plain), steps, clock=clock),
            sync_slot(call(hooked), steps, clock=clock),
        )


async def tool(
    scope: MutableMapping[str, Any],
    receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
    send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
) -> None:
    """The smallest ASGI tool: read the body, answer 201 with a small JSON object."""
    while (await receive()).get("more_body", False):
        pass
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 201, "headers": headers})
    await send({"type": "http.response.body", "body": b'{"charge_id":"ch_1"}'})


async def asgi_pairs(n: int, rounds: int) -> Pairs:
    """The async twin over httpx's ASGI transport, one call after another, thread CPU."""
    steps = make_steps(n)
    base = "http://tool.test"
    async with (
        httpx.AsyncClient(transport=httpx.ASGITransport(app=tool)) as plain_http,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=tool)) as hooked_http,
        AsyncToolInvoker(base, client=plain_http, hooks=(), **OPTIONS) as plain,
        AsyncToolInvoker(base, client=hooked_http, **OPTIONS) as hooked,
    ):

        def slot(invoker: AsyncToolInvoker) -> Callable[[], Awaitable[Figures]]:
            async def run() -> Figures:
                cpu, wall = time.thread_time(), time.perf_counter()
                for step in steps:
                    assert (await invoker.invoke(step)).status_code == 201
                return float(len(steps)), time.perf_counter() - wall, time.thread_time() - cpu

            return run

        return await async_abba(rounds, slot(plain), slot(hooked))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few seconds, for CI")
    parser.add_argument("--rounds", type=int, default=15, help="ABBA rounds per row")
    parser.add_argument("--out", type=Path, help="where to write the JSON results")
    ns = parser.parse_args()
    if not ns.smoke and ns.rounds < 10:
        parser.error("a full run needs --rounds >= 10")
    at_start = machine()
    rounds = 1 if ns.smoke else ns.rounds
    n_mock, n_asgi, n_loop = (50, 50, 20) if ns.smoke else (2000, 1000, 400)
    level = logging.getLevelName(logging.getLogger("agentkey").getEffectiveLevel())
    print(
        f"bench_hooks: {rounds} ABBA rounds per row; ratio = default hooks / hooks=(), "
        f"median (IQR); the agentkey logger's level: {level}"
    )
    names = {"agentkey": "default hooks (LoggingHook)", "baseline": "hooks=()"}
    rows = [
        row(
            "sync, in-process MockTransport",
            sync_pairs("https://tool.test", mock, n_mock, rounds, time.thread_time),
            **names,
        ),
        row("async, in-process ASGI tool", asyncio.run(asgi_pairs(n_asgi, rounds)), **names),
    ]
    with servers(["bare"], {}) as running:
        url = f"http://127.0.0.1:{running['bare'].port}"

        def loopback() -> httpx.BaseTransport:
            return httpx.HTTPTransport(socket_options=NODELAY)

        rows.append(
            row(
                "sync, loopback uvicorn process",
                sync_pairs(url, loopback, n_loop, rounds, time.process_time),
                **names,
            )
        )
    if not ns.smoke or ns.out:
        path = write_results(
            "hooks",
            {
                "method": "ABBA rounds, A = hooks=(), B = the default hooks (one LoggingHook, "
                f"logger level {level}); client CPU from thread_time (in process) or "
                "process_time (loopback); journal=False and honours_keys=True on both sides",
                "logger_level": level,
                "rows": rows,
            },
            ns.out,
            at_start,
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
