"""The call journal's cost: ToolInvoker with a journal against the same invoker without one.

Every slot sends fresh steps (a new plan each time), so each call really writes its
start and its end; both sides talk to the same bare tool in a uvicorn process of its
own. Rows, each in ABBA rounds (A = ``journal=False``, B = the journal), ratio per
round = B / A:

- **SQLite** (the default journal, WAL, ``synchronous=NORMAL``), sync and async;
- **Redis** (a fresh ``redis-server`` on loopback), sync and async, with the Redis
  round trips of one call counted from the server's own command statistics.

Each row gives the client CPU per call with the journal and without it (the same calls,
interleaved), their ratio, the wall time, and the load average. The goal (issue 39): the
client CPU of a loopback call with the journal at most 1.25x the same call without one on
SQLite, 1.5x on Redis.

    python bench/bench_journal.py            # about a minute, writes bench/results/journal.json
    python bench/bench_journal.py --smoke    # a few seconds, for CI (writes nothing)
    python bench/bench_journal.py --instructions   # instructions per call (cachegrind)

``--instructions`` counts instead of timing (the figure that does not move with load):
each journal (none, SQLite, Redis), sync and async x10, invoked over an
``httpx.MockTransport`` in a process of its own under ``valgrind --tool=cachegrind
--cache-sim=no``, with ``n`` and ``2n`` calls (the same ``2n`` steps built in both), so
instructions per call = the difference over ``n``. It prints each journal's instructions
per call, what it adds over ``journal=False`` and the ratio. The issue's targets are
ratios of a loopback call's CPU (kernel time included), which the timed rows measure:
these counts show where the client's own instructions go. Writes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for bench._harness

from agentkey import AsyncToolInvoker, PlanSession, Step, ToolInvoker
from agentkey.journal import RedisJournal, SQLiteJournal
from bench._harness import instructions, machine, palindrome, servers, spread, write_results
from tests._loopback import redis_server

NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
Figures = tuple[float, float, float]  # calls, wall seconds, client CPU seconds


def fresh_steps(n: int) -> list[Step]:
    plan = PlanSession.new()
    # Distinct arguments: the same arguments at a new index would be a repeat of the earlier
    # step (answered from the journal, or waiting for it), not a fresh call.
    return [plan.step(i, "charge", {"amount": 100 + i}) for i in range(n)]


def summed(slots: list[Figures]) -> Figures:
    return (sum(s[0] for s in slots), sum(s[1] for s in slots), sum(s[2] for s in slots))


def row(what: str, pairs: list[tuple[Figures, Figures]], extra: dict[str, Any]) -> dict[str, Any]:
    def wall_us(f: Figures) -> float:
        return f[1] / f[0] * 1e6

    def cpu_us(f: Figures) -> float:
        return f[2] / f[0] * 1e6

    out = {
        "what": what,
        "N": len(pairs),
        "client_cpu_per_call_ratio": spread([cpu_us(b) / cpu_us(a) for a, b in pairs]),
        "journal_cpu_us": round(statistics.median(cpu_us(b) for _, b in pairs), 1),
        "none_cpu_us": round(statistics.median(cpu_us(a) for a, _ in pairs), 1),
        "added_cpu_us": spread([cpu_us(b) - cpu_us(a) for a, b in pairs]),
        "wall_per_call_ratio": spread([wall_us(b) / wall_us(a) for a, b in pairs]),
        "journal_wall_us": round(statistics.median(wall_us(b) for _, b in pairs), 1),
        "none_wall_us": round(statistics.median(wall_us(a) for a, _ in pairs), 1),
        "added_wall_us": spread([wall_us(b) - wall_us(a) for a, b in pairs]),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        **extra,
    }
    c, w = out["client_cpu_per_call_ratio"], out["wall_per_call_ratio"]
    print(
        f"  {what}\n    with the journal vs journal=False: cpu/call {c['median']:.3f}x "
        f"({c['iqr'][0]:.3f}-{c['iqr'][1]:.3f}) {out['journal_cpu_us']:.0f}/"
        f"{out['none_cpu_us']:.0f} us ({out['added_cpu_us']['median']:+.0f} us)  "
        f"wall/call {w['median']:.3f}x {out['journal_wall_us']:.0f}/{out['none_wall_us']:.0f} us "
        f"({out['added_wall_us']['median']:+.0f} us)  N={out['N']}  load {out['loadavg'][0]:.1f}"
        + "".join(f"  {k}={v}" for k, v in extra.items())
    )
    return out


def sync_rounds(url: str, journal: Any, n: int, rounds: int) -> list[tuple[Figures, Figures]]:
    options: dict[str, Any] = {"route_template": "/tools/{tool}", "hooks": ()}
    with (
        httpx.Client(transport=httpx.HTTPTransport(socket_options=NODELAY)) as a_client,
        httpx.Client(transport=httpx.HTTPTransport(socket_options=NODELAY)) as b_client,
        ToolInvoker(url, client=a_client, journal=False, **options) as plain,
        ToolInvoker(url, client=b_client, journal=journal, **options) as journalled,
    ):

        def slot(invoker: ToolInvoker) -> Figures:
            steps = fresh_steps(n)
            cpu, wall = time.process_time(), time.perf_counter()
            for step in steps:
                assert invoker.invoke(step).status_code == 201
            return float(n), time.perf_counter() - wall, time.process_time() - cpu

        slot(plain)
        slot(journalled)  # warm-up
        out = []
        for _ in range(rounds):
            got: dict[str, list[Figures]] = {"A": [], "B": []}
            for side in palindrome(["A", "B"]):
                got[side].append(slot(plain if side == "A" else journalled))
            out.append((summed(got["A"]), summed(got["B"])))
        return out


async def async_rounds(
    url: str, journal: Any, n: int, rounds: int, tasks: int = 10
) -> list[tuple[Figures, Figures]]:
    options: dict[str, Any] = {"route_template": "/tools/{tool}", "hooks": ()}
    async with (
        httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(socket_options=NODELAY)) as a_c,
        httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(socket_options=NODELAY)) as b_c,
        AsyncToolInvoker(url, client=a_c, journal=False, **options) as plain,
        AsyncToolInvoker(url, client=b_c, journal=journal, **options) as journalled,
    ):

        async def slot(invoker: AsyncToolInvoker) -> Figures:
            steps = fresh_steps(n)

            async def worker(mine: list[Step]) -> None:
                for step in mine:
                    assert (await invoker.invoke(step)).status_code == 201

            cpu, wall = time.process_time(), time.perf_counter()
            await asyncio.gather(*(worker(steps[i::tasks]) for i in range(tasks)))
            return float(n), time.perf_counter() - wall, time.process_time() - cpu

        await slot(plain)
        await slot(journalled)
        out = []
        for _ in range(rounds):
            got: dict[str, list[Figures]] = {"A": [], "B": []}
            for side in palindrome(["A", "B"]):
                got[side].append(await slot(plain if side == "A" else journalled))
            out.append((summed(got["A"]), summed(got["B"])))
        return out


#: What the counting client itself sends (its connection's handshake, its statistics).
_NOT_THE_CALLS = frozenset({"HELLO", "CLIENT", "INFO"})


def redis_round_trips(
    url: str, call: Callable[[], None] | Callable[[], Awaitable[None]]
) -> tuple[int, list[str]]:
    """Commands of one call, from the server's own statistics (those its scripts ran
    included), and the commands the client sent (MONITOR, scripts' own calls left out)."""
    client = redis.Redis.from_url(url)
    sent: list[str] = []
    started = threading.Event()

    def watch() -> None:
        with redis.Redis.from_url(url) as watcher, watcher.monitor() as feed:
            started.set()
            for each in feed.listen():
                command = str(each["command"])
                if command == "ECHO bench-journal-end":
                    return
                name = command.split()[0].upper()
                if each.get("client_type") != "lua" and name not in _NOT_THE_CALLS:
                    sent.append(name)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    started.wait(10)
    before = client.info("stats")["total_commands_processed"]
    result = call()
    if asyncio.iscoroutine(result):
        asyncio.run(result)
    after = client.info("stats")["total_commands_processed"]
    client.echo("bench-journal-end")
    thread.join(10)
    client.close()
    return int(after - before - 1), sent  # minus the INFO itself


def cg_target(arg: str) -> Callable[[int], None]:
    """:func:`bench._harness.instructions`' target: ``arg`` is
    ``journal:driver:total:redis_url``; ``total`` fresh steps are built first (so that the
    runs of ``n`` and ``2n`` calls build the same ones), and each ``run(n)`` makes ``n``
    calls over a MockTransport (async: ten at a time, on one event loop)."""
    journal, driver, total, redis_url = arg.split(":", 3)
    steps = iter(fresh_steps(int(total)))
    options: dict[str, Any] = {"route_template": "/tools/{tool}", "hooks": ()}
    chosen: Any = False
    if journal == "sqlite":
        chosen = SQLiteJournal(Path(tempfile.mkdtemp(prefix="bench-journal-")) / "j.sqlite3")
    elif journal == "redis":
        chosen = RedisJournal(redis_url)
    if driver == "sync":
        invoker = ToolInvoker(URL, client=httpx.Client(transport=mock()), journal=chosen, **options)

        def run(n: int) -> None:
            for _ in range(n):
                assert invoker.invoke(next(steps)).status_code == 201

        return run

    loop = asyncio.new_event_loop()
    ainvoker = AsyncToolInvoker(
        URL, client=httpx.AsyncClient(transport=mock()), journal=chosen, **options
    )

    async def worker(mine: list[Step]) -> None:
        for step in mine:
            assert (await ainvoker.invoke(step)).status_code == 201

    async def batch(n: int) -> None:
        mine = [next(steps) for _ in range(n)]
        await asyncio.gather(*(worker(mine[i::10]) for i in range(10)))

    def run_async(n: int) -> None:
        loop.run_until_complete(batch(n))

    return run_async


URL = "https://tool.test"


def mock() -> httpx.MockTransport:
    return httpx.MockTransport(lambda r: httpx.Response(201, json={"charge_id": "ch_1"}))


def instructions_main(n: int) -> None:
    print(
        f"bench_journal --instructions: MockTransport, {n} and {2 * n} calls per side under "
        f"cachegrind; load {os.getloadavg()[0]:.1f} (counts do not move with it)"
    )
    total = CG_WARMUP + 2 * n
    with ExitStack() as stack:
        url = ""
        journals = ["none", "sqlite"]
        if shutil.which("redis-server"):
            url = stack.enter_context(redis_server()).url
            journals.append("redis")
        for driver in ("sync", "async"):
            per = {
                j: instructions(
                    CG_TARGET, n, arg=f"{j}:{driver}:{total}:{url}", warmup=CG_WARMUP
                ).total
                for j in journals
            }
            label = "sync" if driver == "sync" else "async x10"
            print(f"  {label}: journal=False {per['none']:,.0f} instructions per call")
            for j in journals[1:]:
                print(
                    f"    {j}: {per[j]:,.0f} per call, added {per[j] - per['none']:+,.0f} "
                    f"({per[j] / per['none']:.3f}x)"
                )


CG_TARGET = "bench.bench_journal:cg_target"
CG_WARMUP = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few seconds, for CI")
    parser.add_argument("--rounds", type=int, default=10, help="ABBA rounds per row")
    parser.add_argument("--out", type=Path, help="where to write the JSON results")
    parser.add_argument(
        "--instructions", action="store_true", help="count instructions (cachegrind) instead"
    )
    parser.add_argument("--calls", type=int, default=200, help="n for --instructions")
    ns = parser.parse_args()
    if ns.instructions:
        instructions_main(ns.calls)
        return
    at_start = machine()
    rounds, n = (1, 20) if ns.smoke else (ns.rounds, 300)
    print(f"bench_journal: {rounds} ABBA rounds per row; ratio = with journal / journal=False")
    rows = []
    with ExitStack() as stack:
        running = stack.enter_context(servers(["bare"], {}))
        url = f"http://127.0.0.1:{running['bare'].port}"
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        sqlite = SQLiteJournal(folder / "journal.sqlite3")
        rows.append(row("SQLite, sync, loopback", sync_rounds(url, sqlite, n, rounds), {}))
        rows.append(
            row(
                "SQLite, async x10, loopback", asyncio.run(async_rounds(url, sqlite, n, rounds)), {}
            )
        )
        if shutil.which("redis-server"):
            server = stack.enter_context(redis_server())

            counted = ToolInvoker(
                url, route_template="/tools/{tool}", hooks=(), journal=RedisJournal(server.url)
            )
            first, second = fresh_steps(2)
            counted.invoke(first)  # connects (HELLO, CLIENT SETINFO): not a call's cost

            def one_sync() -> None:
                counted.invoke(second)

            trips, sent = redis_round_trips(server.url, one_sync)
            counted.close()
            print(
                f"  Redis: one fresh call sends {' '.join(sent)}"
                f" ({trips} commands with its scripts')"
            )
            rows.append(
                row(
                    "Redis, sync, loopback",
                    sync_rounds(url, RedisJournal(server.url), n, rounds),
                    {"redis_commands_per_call": trips, "redis_client_commands": sent},
                )
            )
            rows.append(
                row(
                    "Redis, async x10, loopback",
                    asyncio.run(async_rounds(url, RedisJournal(server.url), n, rounds)),
                    {"redis_commands_per_call": trips, "redis_client_commands": sent},
                )
            )
        else:
            print("redis-server is not on PATH: the Redis rows are skipped")
    if not ns.smoke or ns.out:
        path = write_results(
            "journal",
            {
                "method": "ABBA rounds of fresh steps, ratio per round = journal / journal=False; "
                "the tool is a bare uvicorn process (1 worker, loopback); client CPU from "
                "process_time; Redis commands per call from INFO stats (those the scripts "
                "run included) and the commands the client sends from MONITOR (the start "
                "of a call is one round trip, its end another)",
                "rows": rows,
            },
            ns.out,
            at_start,
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
