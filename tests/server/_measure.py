"""Server CPU per request: the middleware vs a bare endpoint vs a naive Redis guard.

Each variant of :func:`tests.server._apps.charge_app` runs in its own uvicorn
process; a raw asyncio HTTP/1.1 client (keep-alive connections, prebuilt
requests, each with a fresh key) loads one variant at a time. Rounds alternate
the order (ABBA), and every figure is the median over rounds of the ratio
within a round, with its spread: the machine is shared, so only paired ratios
mean anything. CPU per request is read from ``/proc/<pid>/stat`` of the server.

    .venv/bin/python -m tests.server._measure --rounds 10 --requests 3000 --concurrency 64
    .venv/bin/python -m tests.server._measure --before /tmp/before   # + variants on old code

``--before DIR`` adds the same middleware variants run from another checkout's
``agentkey`` package (``git archive HEAD agentkey | tar -x -C DIR``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

from tests._loopback import free_port, redis_server

ROOT = Path(__file__).resolve().parents[2]
BODY = b'{"amount":100}'
HASH = hashlib.sha256(BODY).hexdigest()
TICK = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def _start(stack: ExitStack, variant: str, redis_url: str, path: str) -> tuple[int, int]:
    port = free_port()
    env = {**os.environ, "AGENTKEY_BENCH_VARIANT": variant, "AGENTKEY_BENCH_REDIS": redis_url}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path, str(ROOT)) if p)
    # Not run from ROOT: ``-m`` puts the working directory first on sys.path, and
    # ``path`` (another checkout's agentkey) must come first.
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", "tests.server._apps:bench_app",
         "--port", str(port), "--log-level", "warning", "--no-access-log"],
        cwd=tempfile.gettempdir(), env=env,
    )  # fmt: skip
    stack.callback(proc.wait, 10)
    stack.callback(proc.terminate)
    return proc.pid, port


async def _load(port: int, n: int, concurrency: int) -> float:
    """Send ``n`` fresh-key requests over ``concurrency`` connections; the wall time."""
    plan = "m-" + uuid.uuid4().hex[:16]
    requests = [
        (
            f"POST /tools/charge HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            f"idempotency-key: {plan}:step_{i:03d}:{HASH}\r\ncontent-length: {len(BODY)}\r\n\r\n"
        ).encode()
        + BODY
        for i in range(n)
    ]
    todo = iter(requests)

    async def worker() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for request in todo:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 201"):
                raise RuntimeError(head.decode(errors="replace"))
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
        writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started


def _wait_up(port: int) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            asyncio.run(_load(port, 20, 2))  # also warms scripts and pools
            return
        except OSError:  # noqa: PERF203 - waiting for the server to listen
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--before", default="", help="a checkout holding the old agentkey")
    parser.add_argument("--hiredis", default="", help="a --target dir holding hiredis")
    ns = parser.parse_args()
    variants = [("bare", "bare", ""), ("naive", "naive", ""), ("redis", "redis", ""),
                ("memory", "memory", "")]  # fmt: skip
    if ns.before:
        variants += [("redis-before", "redis", ns.before), ("memory-before", "memory", ns.before)]
    if ns.hiredis:
        variants += [("redis+hiredis", "redis", ns.hiredis), ("naive+hiredis", "naive", ns.hiredis)]
    with ExitStack() as stack:
        redis = stack.enter_context(redis_server())
        url = f"redis://127.0.0.1:{redis.port}/0"
        servers = {name: _start(stack, v, url, path) for name, v, path in variants}
        for _, port in servers.values():
            _wait_up(port)
        rows: dict[str, list[tuple[float, float, float]]] = {name: [] for name in servers}
        for r in range(ns.rounds):
            order = list(servers) if r % 2 == 0 else list(reversed(servers))
            for name in order:
                pid, port = servers[name]
                cpu0, client0 = _cpu(pid), time.process_time()
                wall = asyncio.run(_load(port, ns.requests, ns.concurrency))
                cpu, client = _cpu(pid) - cpu0, time.process_time() - client0
                rows[name].append((cpu / ns.requests * 1e6, ns.requests / wall, client / wall))
            print(f"round {r + 1}/{ns.rounds} done", file=sys.stderr)
    report: dict[str, object] = {}
    for name, runs in rows.items():
        report[name] = {
            "server_cpu_us_per_request": round(statistics.median(x[0] for x in runs), 1),
            "requests_per_second": round(statistics.median(x[1] for x in runs)),
            "load_generator_cpu_share": round(statistics.median(x[2] for x in runs), 2),
        }
    pairs = [("redis", "bare"), ("redis", "naive"), ("memory", "bare"), ("naive", "bare")]
    pairs += [(f"{a}-before", b) for a, b in pairs if f"{a}-before" in rows]
    pairs += [("redis", "redis-before"), ("memory", "memory-before")]
    pairs += [
        ("redis+hiredis", "bare"),
        ("redis+hiredis", "naive+hiredis"),
        ("redis+hiredis", "redis"),
    ]
    for a, b in pairs:
        if a in rows and b in rows:
            ratios = sorted(x[1] / y[1] for x, y in zip(rows[a], rows[b], strict=True))
            cpu_ratios = sorted(x[0] / y[0] for x, y in zip(rows[a], rows[b], strict=True))
            report[f"{a} / {b}"] = {
                "throughput_ratio_median": round(statistics.median(ratios), 3),
                "throughput_ratio_range": [round(ratios[0], 3), round(ratios[-1], 3)],
                "cpu_per_request_ratio_median": round(statistics.median(cpu_ratios), 3),
            }
    print(json.dumps({"rounds": ns.rounds, "requests": ns.requests,
                      "concurrency": ns.concurrency, **report}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
