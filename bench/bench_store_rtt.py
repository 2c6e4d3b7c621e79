"""Where one request's time goes on Redis: CPU, and idle waiting for the answer.

At one connection a server's throughput is its CPU per request plus the time it sits
idle waiting for Redis. This bench takes the HTTP server out and times, in one process,
the two store round trips of a fresh request, one request at a time:

- A (baseline): redis-py, what the bench's naive handler sends: ``SET key "" NX EX``,
  then ``SET key result EX``;
- B: ``RedisStore.claim`` then ``RedisStore.finish`` (``SET … NX PX … GET``, then the
  fenced ``EVALSHA``), over the store's own pipelined connection;
- B': the same claim, then a plain ``SET`` on the same connection: what the finish would
  cost without the Lua fencing (Redis 8.4's ``SET … IFEQ`` would make it one command).

Method: ABBA rounds (A B B' B' B A), each slot a batch of pairs on fresh keys; wall time
and this process's CPU time per pair, and idle per round trip = (wall - CPU) / 2. The
table gives medians over the rounds and the ratio of wall times, B / A, per round
(median and IQR). Redis is a fresh ``redis-server`` on loopback.

    python bench/bench_store_rtt.py            # 10 rounds of 500 pairs
    python bench/bench_store_rtt.py --smoke    # a second or two, for CI
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests._loopback

from redis.asyncio import Redis

from agentkey.server import RedisStore
from tests._loopback import redis_server

Pair = Callable[[str], Awaitable[None]]
RESULT = b'{"charge_id":"ch_1","amount":100}'
OWNER = os.urandom(16).hex()
TTL_MS = 86_400_000


async def _slot(pair: Pair, tag: str, n: int) -> tuple[float, float]:
    """Wall and CPU seconds per pair over ``n`` pairs on fresh keys."""
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(n):
        await pair(f"{tag}-{i}")
    return (time.perf_counter() - wall) / n, (time.process_time() - cpu) / n


async def run(url: str, rounds: int, n: int) -> dict[str, dict[str, list[float]]]:
    store = RedisStore(url)
    client = Redis.from_url(url)
    run_id = os.urandom(4).hex()
    in_progress = (OWNER + ":in-progress").encode()

    async def naive(key: str) -> None:
        await client.set("naive:" + key, b"", nx=True, ex=86_400)
        await client.set("naive:" + key, RESULT, ex=86_400)

    async def agentkey(key: str) -> None:
        await store.claim(key, in_progress, ttl_ms=TTL_MS)
        await store.finish(key, OWNER, RESULT, ttl_ms=TTL_MS)

    async def plain_finish(key: str) -> None:
        await store.claim(key, in_progress, ttl_ms=TTL_MS)
        lean = store._lean
        assert lean is not None
        await lean.execute(b"SET", store.redis_key(key).encode(), RESULT, b"PX", b"%d" % TTL_MS)

    sides: dict[str, Pair] = {"naive": naive, "agentkey": agentkey, "plain": plain_finish}
    out: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in sides}
    try:
        for name, pair in sides.items():  # connect and warm every side
            await _slot(pair, f"{run_id}-warm-{name}", max(20, n // 10))
        order = ["naive", "agentkey", "plain", "plain", "agentkey", "naive"]
        for r in range(rounds):
            for s, name in enumerate(order):
                wall, cpu = await _slot(sides[name], f"{run_id}-{r}-{s}-{name}", n)
                out[name]["wall"].append(wall)
                out[name]["cpu"].append(cpu)
    finally:
        await store.aclose()
        await client.aclose()
    return out


def report(out: dict[str, dict[str, list[float]]]) -> None:
    def per_round(name: str) -> list[float]:  # each round's two slots, summed
        walls = out[name]["wall"]
        return [walls[i] + walls[i + 1] for i in range(0, len(walls), 2)]

    base = per_round("naive")
    print(f"{'side':48} {'wall/pair':>10} {'CPU/pair':>9} {'idle/RT':>8}  wall ratio (IQR)")
    labels = {
        "naive": "redis-py: SET NX EX, then SET EX (baseline)",
        "agentkey": "RedisStore: claim, then fenced finish (EVALSHA)",
        "plain": "RedisStore: claim, then a plain SET",
    }
    for name, label in labels.items():
        wall = statistics.median(out[name]["wall"]) * 1e6
        cpu = statistics.median(out[name]["cpu"]) * 1e6
        ratios = [b / a for a, b in zip(base, per_round(name), strict=True)]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        print(
            f"{label:48} {wall:8.0f}us {cpu:7.0f}us {(wall - cpu) / 2:6.0f}us"
            f"  {statistics.median(ratios):.2f}x ({q[0]:.2f}-{q[2]:.2f})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a second or two, for CI")
    parser.add_argument("--rounds", type=int, default=10, help="ABBA rounds")
    parser.add_argument("--pairs", type=int, default=500, help="request pairs per slot")
    args = parser.parse_args()
    rounds, pairs = (1, 50) if args.smoke else (args.rounds, args.pairs)
    with redis_server() as redis:
        out = asyncio.run(run(redis.url, rounds, pairs))
    print(f"bench_store_rtt: {rounds} rounds x 6 slots of {pairs} pairs, one at a time")
    report(out)


if __name__ == "__main__":
    main()
