"""Where one request's time goes on Redis, and what redis-py's parsers, pipelines and WAIT cost.

The HTTP server is taken out: in one process, each side runs the two store round trips of
a fresh request on fresh keys, as pairs, either one pair at a time (``c=1``) or 64 pairs
at once (``c=64``):

- naive (the baseline): redis-py's ``execute_command`` per command, what the bench's naive
  handler sends: ``SET key "" NX EX``, then ``SET key result EX``;
- RedisStore: ``claim`` (``SET … NX PX … GET``), then ``finish`` (the fenced ``EVALSHA``),
  through redis-py's public client: alone a command goes out with ``execute_command``,
  and while others are in flight they leave together in one non-transactional pipeline;
- each of those with redis-py's pure-Python RESP parser and with hiredis's (when the
  ``hiredis`` package is installed);
- RedisStore with ``replicas=1``: each write followed by ``WAIT 1`` in the same pipeline.

Redis is a fresh ``redis-server`` on loopback with one replica attached, for every side.
Method: palindromic rounds (each side once forward, once backward), each slot a batch of
pairs; wall time and this process's CPU time per pair. The table gives medians over the
rounds and the ratio of wall times and of CPU times to the naive side with the same
parser, per round (median and IQR).

    python bench/bench_store_rtt.py            # 6 rounds of 400 pairs per slot
    python bench/bench_store_rtt.py --smoke    # a few seconds, for CI
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests._loopback

import redis
from redis.asyncio import Redis

from agentkey.server import RedisStore
from bench._harness import load_line, machine
from tests._loopback import redis_server

Pair = Callable[[str], Awaitable[None]]
RESULT = b'{"charge_id":"ch_1","amount":100}'
OWNER = os.urandom(16).hex()
TTL_MS = 86_400_000
IN_PROGRESS = f"P:{OWNER}:1".encode()


def _parsers() -> dict[str, Any]:
    """redis-py's asyncio parsers by name (bench only: the store takes redis-py's default)."""
    from redis._parsers import _AsyncHiredisParser, _AsyncRESP2Parser
    from redis.utils import HIREDIS_AVAILABLE

    found: dict[str, Any] = {"python": _AsyncRESP2Parser}
    if HIREDIS_AVAILABLE:
        found["hiredis"] = _AsyncHiredisParser
    return found


@contextmanager
def replica_of(port: int) -> Iterator[None]:
    """A redis-server on loopback replicating the one on ``port``, in sync when yielded."""
    with redis.Redis(port=port) as master:
        master.config_set("repl-diskless-sync-delay", 0)  # 5 s by default
    with redis_server("--replicaof", "127.0.0.1", str(port)):
        deadline = time.monotonic() + 20
        with redis.Redis(port=port) as master:
            while master.info("replication").get("slave0", {}).get("state") != "online":
                if time.monotonic() > deadline:
                    raise RuntimeError("the replica did not attach")
                time.sleep(0.05)
        yield


async def _slot(pair: Pair, tag: str, n: int, width: int) -> tuple[float, float]:
    """Wall and CPU seconds per pair over ``n`` pairs, ``width`` at a time."""
    wall, cpu = time.perf_counter(), time.process_time()
    for start in range(0, n, width):
        if width == 1:
            await pair(f"{tag}-{start}")
        else:
            await asyncio.gather(*(pair(f"{tag}-{start + i}") for i in range(width)))
    done = n - n % width if width > 1 else n
    return (time.perf_counter() - wall) / done, (time.process_time() - cpu) / done


async def run(url: str, rounds: int, n: int, width: int) -> dict[str, dict[str, list[float]]]:
    clients: list[Any] = []
    stores: list[RedisStore] = []
    sides: dict[str, Pair] = {}

    def naive(client: Any) -> Pair:
        async def pair(key: str) -> None:
            await client.execute_command("SET", "naive:" + key, b"", "NX", "EX", 86_400)
            await client.execute_command("SET", "naive:" + key, RESULT, "EX", 86_400)

        return pair

    def agentkey(store: RedisStore) -> Pair:
        async def pair(key: str) -> None:
            await store.claim(key, IN_PROGRESS, ttl_ms=TTL_MS)
            await store.finish(key, OWNER, RESULT, ttl_ms=TTL_MS)

        return pair

    for name, parser in _parsers().items():
        client = Redis.from_url(url, parser_class=parser)
        clients.append(client)
        sides[f"naive, {name}"] = naive(client)
        for replicas in (0, 1) if name == "python" else (0,):
            client = Redis.from_url(url, parser_class=parser)
            clients.append(client)
            store = RedisStore(client, prefix=f"s{replicas}{name}", replicas=replicas)
            stores.append(store)
            label = f"RedisStore, {name}" + (", replicas=1" if replicas else "")
            sides[label] = agentkey(store)
    run_id = os.urandom(4).hex()
    out: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in sides}
    try:
        for name, pair in sides.items():  # connect and warm every side
            await _slot(pair, f"{run_id}-warm-{name}", max(width * 4, n // 10), width)
        order = [*sides, *reversed(sides)]
        for r in range(rounds):
            for s, name in enumerate(order):
                wall, cpu = await _slot(sides[name], f"{run_id}-{r}-{s}-{name}", n, width)
                out[name]["wall"].append(wall)
                out[name]["cpu"].append(cpu)
    finally:
        for store in stores:
            await store.aclose()
        for client in clients:
            await client.aclose()
    return out


def report(out: dict[str, dict[str, list[float]]], width: int) -> None:
    def per_round(name: str, what: str) -> list[float]:  # each round's two slots, summed
        values = out[name][what]
        return [values[i] + values[i + 1] for i in range(0, len(values), 2)]

    def ratio(name: str, base: str, what: str) -> str:
        ratios = [b / a for a, b in zip(per_round(base, what), per_round(name, what), strict=True)]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        return f"{statistics.median(ratios):.2f}x ({q[0]:.2f}-{q[2]:.2f})"

    print(f"c={width}")
    head = f"  {'side':36} {'wall/pair':>10} {'CPU/pair':>9}  {'wall ratio (IQR)':18}"
    print(head, "CPU ratio (IQR)")
    for name in out:
        base = "naive, " + ("hiredis" if "hiredis" in name else "python")
        wall = statistics.median(out[name]["wall"]) * 1e6
        cpu = statistics.median(out[name]["cpu"]) * 1e6
        print(
            f"  {name:36} {wall:8.0f}us {cpu:7.0f}us  {ratio(name, base, 'wall'):18} "
            f"{ratio(name, base, 'cpu')}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few seconds, for CI")
    parser.add_argument("--rounds", type=int, default=6, help="palindromic rounds")
    parser.add_argument("--pairs", type=int, default=400, help="request pairs per slot")
    args = parser.parse_args()
    rounds, pairs = (1, 64) if args.smoke else (args.rounds, args.pairs)
    at_start = machine()
    with redis_server() as server, replica_of(server.port):
        for width in (1, 64):
            out = asyncio.run(run(server.url, rounds, pairs, width))
            if width == 1:
                print(f"bench_store_rtt: {rounds} rounds, {pairs} pairs a slot; sides "
                      "against naive with the same parser")  # fmt: skip
            report(out, width)
    print(load_line(at_start))


if __name__ == "__main__":
    main()
