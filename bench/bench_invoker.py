"""Invoker cost: ToolInvoker.invoke against httpx posting the same step, interleaved.

Both sides send the same key and canonical body; steps (and their keys) are built
before any clock starts, so only the call path is measured, and every step has arguments
of its own (a fresh call, never a repeat of an earlier step). The invoker runs its plain
path (``journal=False, hooks=()``: the journal and the hooks have benches of their own)
except in the journal-hit row. Blocks, each in ABBA rounds (A = plain httpx, B =
agentkey), ratio per round = B / A; each row prints its baseline and the load average:

- **sync, in-process**: ``httpx.Client.post`` vs ``ToolInvoker.invoke`` over an
  ``httpx.MockTransport``: thread CPU per call, all of it client work;
- **sync, loopback**: the same against the bare tool in a uvicorn process of its own
  (``bench/_apps.py``): wall time and client CPU per call (the server's CPU is not ours);
- **sync, journal hit**: steps a SQLite journal has answered already (the tool marks no
  replays), answered again from it without sending, vs posting them to the tool;
- **async, 100 and 1,000 concurrent**: ``httpx.AsyncClient.post`` vs
  ``AsyncToolInvoker.invoke`` from that many tasks against the same server, each side
  with httpx's default pool (100 connections): client CPU per call and throughput;
- **sniffio**: the async plain-httpx path at 100 concurrent with ``sniffio`` importable
  vs absent (hidden from the import system). httpcore imports it on every request
  (``current_async_library``); anyio >= 4.16 no longer installs it, so an environment
  with only agentkey's dependencies pays a failed import several times per request.

    python bench/bench_invoker.py            # about 2 minutes, writes bench/results/invoker.json
    python bench/bench_invoker.py --smoke    # a few seconds, for CI (writes nothing)
    python bench/bench_invoker.py --instructions   # instructions per call (cachegrind)

``--instructions`` counts instead of timing (the figure that does not move with load):
the sync in-process row (``httpx.MockTransport``), each side run in a process of its own
under ``valgrind --tool=cachegrind --cache-sim=no``, once with ``n`` calls and once with
``2n`` (the same ``2n`` steps built in both), so instructions per call = the difference
over ``n`` (start-up, imports and warm-up cancel out). It prints each side's
instructions per call and the invoker's added instructions against the target (issue
39: <= 15 us added, about 25k instructions on the machine it was set on). Writes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeAlias

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for bench._harness

from agentkey import AsyncToolInvoker, PlanSession, Step, ToolInvoker
from agentkey.journal import SQLiteJournal
from bench._harness import instructions, machine, palindrome, servers, spread, write_results

NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]  # no Nagle + delayed-ACK stalls
PATH = "/tools/charge"
#: The invoker's plain path: no journal, no hooks (each is measured by its own bench).
PLAIN_PATH: dict[str, Any] = {"journal": False, "hooks": ()}


def make_steps(n: int) -> list[Step]:
    """``n`` fresh steps: distinct arguments, so no call repeats an earlier one (a repeat
    is answered from the journal, or waits for it: it would time a journal hit as a call)."""
    plan = PlanSession.new()
    return [plan.step(i, "charge", {"amount": 100 + i}) for i in range(n)]


def headers(step: Step) -> dict[str, str]:
    return {"Idempotency-Key": step.idempotency_key, "Content-Type": "application/json"}


# --------------------------------------------------------------------------- paired rounds


Figures: TypeAlias = tuple[float, float, float]  # calls, wall seconds, client CPU seconds
Pairs: TypeAlias = list[tuple[Figures, Figures]]


def add(slots: list[Figures]) -> Figures:
    return (sum(s[0] for s in slots), sum(s[1] for s in slots), sum(s[2] for s in slots))


def abba(rounds: int, plain: Callable[[], Figures], ours: Callable[[], Figures]) -> Pairs:
    """Per round: (plain, ours), each summed over the round's two slots (A B B A)."""
    plain()
    ours()  # warm-up: connections, caches
    out: Pairs = []
    for _ in range(rounds):
        got: dict[str, list[Figures]] = {"A": [], "B": []}
        for side in palindrome(["A", "B"]):
            got[side].append(plain() if side == "A" else ours())
        out.append((add(got["A"]), add(got["B"])))
    return out


async def async_abba(
    rounds: int,
    plain: Callable[[], Awaitable[Figures]],
    ours: Callable[[], Awaitable[Figures]],
) -> Pairs:
    """:func:`abba` for slots that are awaited."""
    await plain()
    await ours()
    out: Pairs = []
    for _ in range(rounds):
        got: dict[str, list[Figures]] = {"A": [], "B": []}
        for side in palindrome(["A", "B"]):
            got[side].append(await (plain() if side == "A" else ours()))
        out.append((add(got["A"]), add(got["B"])))
    return out


def row(
    what: str,
    pairs: Pairs,
    *,
    agentkey: str,
    baseline: str,
) -> dict[str, Any]:
    """Each side's slot gives (calls, wall seconds, client CPU seconds)."""

    def cpu_us(side: Figures) -> float:
        return side[2] / side[0] * 1e6

    def wall_us(side: Figures) -> float:
        return side[1] / side[0] * 1e6

    out: dict[str, Any] = {
        "what": what,
        "agentkey": agentkey,
        "baseline": baseline,
        "N": len(pairs),
        "client_cpu_per_call_ratio": spread([cpu_us(b) / cpu_us(a) for a, b in pairs]),
        "throughput_ratio": spread([wall_us(a) / wall_us(b) for a, b in pairs]),
        "agentkey_client_cpu_us": round(statistics.median(cpu_us(b) for _, b in pairs), 1),
        "baseline_client_cpu_us": round(statistics.median(cpu_us(a) for a, _ in pairs), 1),
        "added_client_cpu_us": spread([cpu_us(b) - cpu_us(a) for a, b in pairs]),
        "agentkey_calls_per_s": round(statistics.median(1e6 / wall_us(b) for _, b in pairs)),
        "baseline_calls_per_s": round(statistics.median(1e6 / wall_us(a) for a, _ in pairs)),
        "calls": int(sum(a[0] + b[0] for a, b in pairs)),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    a, b = out["client_cpu_per_call_ratio"], out["added_client_cpu_us"]
    print(
        f"  {what}\n    {agentkey} vs {baseline}: cpu/call {a['median']:.2f}x "
        f"({a['iqr'][0]:.2f}-{a['iqr'][1]:.2f}) "
        f"{out['agentkey_client_cpu_us']:.1f}/{out['baseline_client_cpu_us']:.1f} us "
        f"({b['median']:+.1f} us)  thr {out['throughput_ratio']['median']:.2f}x  "
        f"{out['agentkey_calls_per_s']}/{out['baseline_calls_per_s']} calls/s  N={out['N']}  "
        f"load {out['loadavg'][0]:.1f}"
    )
    return out


# --------------------------------------------------------------------------- sync


def sync_slot(
    call: Callable[[Step], Any], steps: list[Step], *, clock: Callable[[], float]
) -> Callable[[], Figures]:
    def slot() -> Figures:
        cpu, wall = clock(), time.perf_counter()
        for step in steps:
            call(step)
        return float(len(steps)), time.perf_counter() - wall, clock() - cpu

    return slot


def sync_pairs(
    base: str,
    transport: Callable[[], httpx.BaseTransport],
    n: int,
    rounds: int,
    clock: Callable[[], float],
) -> Pairs:
    steps = make_steps(n)
    with (
        httpx.Client(base_url=base, transport=transport()) as client,
        httpx.Client(transport=transport()) as inner,
        ToolInvoker(base, client=inner, route_template="/tools/{tool}", **PLAIN_PATH) as invoker,
    ):

        def plain(step: Step) -> None:
            response = client.post(PATH, headers=headers(step), content=step.body)
            assert response.status_code == 201
            response.json()

        def ours(step: Step) -> None:
            assert invoker.invoke(step).status_code == 201

        return abba(
            rounds, sync_slot(plain, steps, clock=clock), sync_slot(ours, steps, clock=clock)
        )


def journal_hit_pairs(base: str, n: int, rounds: int, folder: Path) -> Pairs:
    """Steps the SQLite journal has answered already (invoked once before any clock starts),
    answered again from it, against ``httpx.Client.post`` of the same steps to the tool."""
    steps = make_steps(n)
    options: dict[str, Any] = {"route_template": "/tools/{tool}", "hooks": ()}
    with (
        httpx.Client(base_url=base, transport=loopback()) as client,
        httpx.Client(transport=loopback()) as inner,
        ToolInvoker(
            base, client=inner, journal=SQLiteJournal(folder / "hits.sqlite3"), **options
        ) as invoker,
    ):
        for step in steps:  # the tool marks no replays: a repeat is the journal's to answer
            assert invoker.invoke(step).source == "tool"

        def plain(step: Step) -> None:
            response = client.post(PATH, headers=headers(step), content=step.body)
            assert response.status_code == 201
            response.json()

        def hit(step: Step) -> None:
            assert invoker.invoke(step).source == "journal"

        clock = time.process_time
        return abba(
            rounds, sync_slot(plain, steps, clock=clock), sync_slot(hit, steps, clock=clock)
        )


def loopback() -> httpx.BaseTransport:
    return httpx.HTTPTransport(socket_options=NODELAY)


def mock() -> httpx.BaseTransport:
    return httpx.MockTransport(lambda r: httpx.Response(201, json={"charge_id": "ch_1"}))


# --------------------------------------------------------------------------- async


async def async_slot(
    call: Callable[[Step], Awaitable[None]], steps: list[Step], tasks: int, seconds: float
) -> Figures:
    loop = asyncio.get_running_loop()
    source = itertools.cycle(steps)
    done = [0]
    end = loop.time() + seconds

    async def worker() -> None:
        while loop.time() < end:
            await call(next(source))
            done[0] += 1

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(tasks)))
    return float(done[0]), time.perf_counter() - wall, time.process_time() - cpu


async def async_pairs(
    url: str, tasks: int, seconds: float, rounds: int, *, sniffio_b: bool = False
) -> Pairs:
    """Plain httpx vs AsyncToolInvoker; with ``sniffio_b``, plain httpx without sniffio as B."""
    steps = make_steps(2000)
    transport = httpx.AsyncHTTPTransport(socket_options=NODELAY)
    async with (
        httpx.AsyncClient(base_url=url, transport=transport) as client,
        httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(socket_options=NODELAY)) as inner,
        AsyncToolInvoker(
            url, client=inner, route_template="/tools/{tool}", **PLAIN_PATH
        ) as invoker,
    ):

        async def plain(step: Step) -> None:
            response = await client.post(PATH, headers=headers(step), content=step.body)
            assert response.status_code == 201
            response.json()

        async def ours(step: Step) -> None:
            assert (await invoker.invoke(step)).status_code == 201

        async def with_plain() -> Figures:
            return await async_slot(plain, steps, tasks, seconds)

        async def with_ours() -> Figures:
            return await async_slot(ours, steps, tasks, seconds)

        async def without_sniffio() -> Figures:
            with sniffio_hidden():
                return await async_slot(plain, steps, tasks, seconds)

        return await async_abba(rounds, with_plain, without_sniffio if sniffio_b else with_ours)


@contextmanager
def sniffio_hidden() -> Iterator[None]:
    """Make ``import sniffio`` fail as it does where sniffio is not installed.

    The path-based finder of sniffio's directory forgets the name (the cost of the
    failed import is then the real one: every ``sys.path`` entry is searched).
    """
    spec = importlib.util.find_spec("sniffio")
    if spec is None or spec.origin is None:
        yield  # not installed: already the case being measured
        return
    directory = os.path.dirname(os.path.dirname(spec.origin))
    finder: Any = sys.path_importer_cache.get(directory)
    if finder is None or not hasattr(finder, "_path_cache"):
        raise RuntimeError(f"cannot hide sniffio: no path finder cached for {directory}")
    module = sys.modules.pop("sniffio", None)
    finder._path_cache.discard("sniffio")
    try:
        yield
        if "sniffio" in sys.modules:
            raise RuntimeError("sniffio was imported while hidden: the sniffio row is invalid")
    finally:
        finder._path_cache.add("sniffio")
        if module is not None:
            sys.modules["sniffio"] = module


def failed_import_us(n: int = 2000) -> float:
    """Microseconds for one ``import sniffio`` that fails (what httpcore pays per call)."""

    def attempt() -> None:
        with suppress(ImportError):
            import sniffio  # noqa: F401

    with sniffio_hidden():
        started = time.perf_counter()
        for _ in range(n):
            attempt()
        return (time.perf_counter() - started) / n * 1e6


# --------------------------------------------------------------------------- instructions

#: Issue 39's plain-path target (<= 15 us added in process) by instruction count: the
#: plain path measured +19.7 us and +38.5k instructions in the same stop (about 1.9k/us).
ADDED_INSTRUCTIONS_TARGET = 25_000


def cg_target(arg: str) -> Callable[[int], None]:
    """:func:`bench._harness.instructions`' target: ``arg`` is ``side:total``, the side
    (``httpx`` or ``invoker``) and how many steps to build first, so that the runs of ``n``
    and ``2n`` calls build the same ones."""
    side, total = arg.split(":")
    steps = iter(make_steps(int(total)))
    client = httpx.Client(base_url="https://tool.test", transport=mock())
    invoker = ToolInvoker(
        "https://tool.test",
        client=httpx.Client(transport=mock()),
        route_template="/tools/{tool}",
        **PLAIN_PATH,
    )

    def call_httpx(step: Step) -> None:
        response = client.post(PATH, headers=headers(step), content=step.body)
        assert response.status_code == 201
        response.json()

    def call_invoker(step: Step) -> None:
        assert invoker.invoke(step).status_code == 201

    call = call_httpx if side == "httpx" else call_invoker

    def run(n: int) -> None:
        for _ in range(n):
            call(next(steps))

    return run


def instructions_main(n: int) -> None:
    print(
        f"bench_invoker --instructions: sync in-process (MockTransport), {n} and {2 * n} "
        f"calls per side under cachegrind; load {os.getloadavg()[0]:.1f} (counts do not "
        "move with it)"
    )
    total = WARMUP + 2 * n
    base = instructions(CG_TARGET, n, arg=f"httpx:{total}", warmup=WARMUP).total
    ours = instructions(CG_TARGET, n, arg=f"invoker:{total}", warmup=WARMUP).total
    added = ours - base
    met = "met" if added <= ADDED_INSTRUCTIONS_TARGET else "NOT met"
    print(
        f"  httpx.Client.post + .json(): {base:,.0f} instructions per call\n"
        f"  ToolInvoker.invoke (journal=False, hooks=()): {ours:,.0f} per call\n"
        f"  added: {added:+,.0f} ({ours / base:.3f}x); target <= "
        f"{ADDED_INSTRUCTIONS_TARGET:,} added: {met}"
    )


CG_TARGET = "bench.bench_invoker:cg_target"
WARMUP = 20


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few seconds, for CI")
    parser.add_argument("--rounds", type=int, default=10, help="ABBA rounds per row")
    parser.add_argument("--seconds", type=float, default=0.5, help="length of one async slot")
    parser.add_argument("--out", type=Path, help="where to write the JSON results")
    parser.add_argument(
        "--instructions", action="store_true", help="count instructions (cachegrind) instead"
    )
    parser.add_argument("--calls", type=int, default=300, help="n for --instructions")
    ns = parser.parse_args()
    if ns.instructions:
        instructions_main(ns.calls)
        return
    at_start = machine()
    smoke = ns.smoke
    rounds, seconds = (1, 0.1) if smoke else (ns.rounds, ns.seconds)
    n_mock, n_loop = (50, 20) if smoke else (1500, 400)

    sniffio_installed = importlib.util.find_spec("sniffio") is not None
    print(
        f"bench_invoker: {rounds} ABBA rounds per row; ratio = agentkey / plain httpx, "
        f"median (IQR); sniffio {'installed' if sniffio_installed else 'NOT installed'}"
    )
    rows = [
        row(
            "sync, in-process MockTransport",
            sync_pairs("https://tool.test", mock, n_mock, rounds, time.thread_time),
            agentkey="ToolInvoker.invoke",
            baseline="httpx.Client.post",
        )
    ]
    with servers(["bare"], {}) as running:
        url = f"http://127.0.0.1:{running['bare'].port}"

        rows.append(
            row(
                "sync, loopback uvicorn process",
                sync_pairs(url, loopback, n_loop, rounds, time.process_time),
                agentkey="ToolInvoker.invoke",
                baseline="httpx.Client.post",
            )
        )
        with tempfile.TemporaryDirectory() as folder:
            rows.append(
                row(
                    "sync, journal hit (SQLite), loopback: answered without sending",
                    journal_hit_pairs(url, n_loop, rounds, Path(folder)),
                    agentkey="ToolInvoker.invoke from its journal",
                    baseline="httpx.Client.post",
                )
            )
        rows += [
            row(
                f"async, {tasks} concurrent, loopback",
                asyncio.run(async_pairs(url, tasks, seconds, rounds)),
                agentkey="AsyncToolInvoker.invoke",
                baseline="httpx.AsyncClient.post",
            )
            for tasks in (100, 1000)
        ]
        rows.append(
            row(
                "async httpx, 100 concurrent: sniffio absent / present",
                asyncio.run(async_pairs(url, 100, seconds, rounds, sniffio_b=True)),
                agentkey="httpx.AsyncClient.post without sniffio",
                baseline="httpx.AsyncClient.post with sniffio",
            )
        )
    failed = failed_import_us()
    print(f"  one failed `import sniffio`: {failed:.1f} us")

    if not smoke or ns.out:
        path = write_results(
            "invoker",
            {
                "method": "ABBA rounds, ratio per round = B/A; fresh steps (arguments of their "
                "own); the invoker with journal=False, hooks=() except in the journal-hit row "
                "(SQLite, steps answered once before the clock starts); client CPU from "
                "thread_time (in-process) or process_time (loopback); the server is a separate "
                "uvicorn process (1 worker, loopback); loadavg per row",
                "sniffio_installed": sniffio_installed,
                "failed_sniffio_import_us": round(failed, 1),
                "rows": rows,
            },
            ns.out,
            at_start,
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
