"""Large request bodies: IdempotencyMiddleware on MemoryStore against the bare app.

Both sides serve the same Starlette handler (``POST /tools/charge``: read the JSON
body, answer 201 with a small JSON object) in this process, driven straight through
ASGI (no HTTP server, no sockets), one request after another; the body arrives in
64 KiB chunks, as uvicorn hands it over. A slot sends a batch of requests with fresh
keys and times them in thread CPU time; both sides run in the same thread, so the
figure is all server work.

- **bare**: the handler alone, which parses the body once (``await request.json()``);
- **middleware**: the same handler behind ``IdempotencyMiddleware`` on ``MemoryStore``
  (``shared_key_space=True``), every request a fresh key, so every one is claimed,
  run and recorded.

Rows, each at 1 KB, 100 KB and 1 MB of JSON arguments (records of ids, names,
prices and tags):

- ``agentkey key, canonical body``: what an agentkey client sends (the key's
  ``args_hash`` is the SHA-256 of the body's bytes);
- ``agentkey key, re-serialised body``: the same arguments sent as ``json.dumps``
  writes them by default (spaces, member order as built), so the bytes do not hash
  to the key and the middleware re-serialises the body to check it;
- ``opaque key (UUID)``: a key from an ordinary client; the middleware fingerprints
  the body by its bytes (the default ``body_fingerprint="bytes"``);
- ``opaque key (UUID), non-canonical body``: the ``json.dumps`` bytes, fingerprinted
  by their bytes as well; ``..., body_fingerprint='canonical'``: the opt-in, which
  parses and canonicalises every body to fingerprint it;
- ``... handler reads claim.json()``: the handler reads its arguments through
  ``current_claim().json()`` (parsed on demand) instead of ``request.json()``.

One row runs under uvicorn instead (``--uvicorn``, on by default when redis-server
is on PATH): ``opaque key, 1 MB non-canonical body, under uvicorn, on Redis``. Two
(three) uvicorn processes on loopback, one worker each, serve the bare handler, the
handler behind the middleware on ``RedisStore`` (a private redis-server), and with
``body_fingerprint="canonical"``; one keep-alive client sends each a slot of 1 MB
requests with fresh UUID keys, in palindromic rounds (bare, bytes, canonical,
canonical, bytes, bare). The figure is the server process's CPU per request
(``/proc/<pid>/stat``), middleware / bare, median of the per-round ratios.

Method: rounds of A B B A (A = bare, B = middleware); a round's ratio is
(B1 + B2) / (A1 + A2) of CPU per request. The table gives the median of the
per-round ratios, their interquartile range, min and max, and N (rounds).

    python bench/bench_body.py                # about 2 minutes, writes bench/results/body.json
    python bench/bench_body.py --smoke        # a few seconds, for CI (writes nothing)
    python bench/bench_body.py --profile 1MB  # cProfile of one 1 MB request, printed
    python bench/bench_body.py --sizes= --uvicorn-rounds 10  # the uvicorn row alone
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TypeAlias

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for bench._harness

from agentkey import PlanSession, canonical_json
from agentkey.server import IdempotencyMiddleware, MemoryStore, ServerOptions, current_claim
from bench._harness import (
    Server,
    machine,
    palindrome,
    proc_cpu,
    servers,
    spread,
    write_results,
)

Message: TypeAlias = MutableMapping[str, Any]
Receive: TypeAlias = Callable[[], Awaitable[Message]]
Send: TypeAlias = Callable[[Message], Awaitable[None]]
App: TypeAlias = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]
CHUNK = 64 * 1024  # what uvicorn hands an app per receive() at most
PATH = "/tools/charge"
SIZES = {"1KB": 1_000, "100KB": 100_000, "1MB": 1_000_000}


def arguments(size: int) -> dict[str, Any]:
    """Tool arguments whose canonical JSON is about ``size`` bytes."""
    rows: list[dict[str, Any]] = []
    args: dict[str, Any] = {"order": "ord_7f3a", "currency": "EUR", "lines": rows}
    while (length := len(canonical_json(args))) < size:
        # Add about what is missing (a line is about 100 bytes), then measure again.
        for _ in range(max(1, (size - length) // 120)):
            i = len(rows)
            rows.append(
                {
                    "sku": f"SKU-{i:06d}",
                    "name": f"widget {i} (blue, large)",
                    "price": round(1.25 * i + 0.99, 2),
                    "qty": i % 7 + 1,
                    "tags": ["sale", "eu"] if i % 3 else ["new"],
                }
            )
    return args


def handler(*, from_claim: bool) -> Callable[[Request], Awaitable[JSONResponse]]:
    async def charge(request: Request) -> JSONResponse:
        args = current_claim().json() if from_claim else await request.json()
        return JSONResponse({"charge_id": "ch_1", "lines": len(args["lines"])}, status_code=201)

    return charge


def app(*, from_claim: bool = False) -> Starlette:
    return Starlette(routes=[Route(PATH, handler(from_claim=from_claim), methods=["POST"])])


def protected(*, from_claim: bool = False, canonical: bool = False) -> App:
    return IdempotencyMiddleware(
        app(from_claim=from_claim),
        store=MemoryStore(),
        shared_key_space=True,
        options=ServerOptions(
            max_body_bytes=4 * 1024 * 1024, body_fingerprint="canonical" if canonical else "bytes"
        ),
    )


async def post(target: App, key: bytes, body: bytes) -> int:
    """One request through ASGI, the body in 64 KiB chunks; the answer's status."""
    chunks = [body[i : i + CHUNK] for i in range(0, len(body), CHUNK)] or [b""]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": PATH,
        "raw_path": PATH.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"tool.test"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"idempotency-key", key),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    left = iter(range(len(chunks)))
    status = 0

    async def receive() -> Message:
        i = next(left, None)
        if i is None:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": chunks[i], "more_body": i < len(chunks) - 1}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await target(scope, receive, send)
    return status


class Case:
    """One row: the body, a source of fresh keys, and the two apps."""

    def __init__(self, what: str, size: str, body: bytes, keys: Callable[[int], bytes], *,
                 from_claim: bool = False, canonical: bool = False) -> None:  # fmt: skip
        self.what, self.size, self.body, self.keys = what, size, body, keys
        self.bare = app()
        self.ours = protected(from_claim=from_claim, canonical=canonical)
        self.sent = 0

    async def slot(self, target: App, n: int) -> float:
        """Thread CPU seconds per request over ``n`` requests with fresh keys."""
        keys = [self.keys(self.sent + i) for i in range(n)]
        self.sent += n
        cpu = time.thread_time()
        for key in keys:
            status = await post(target, key, self.body)
            if status != 201:
                raise RuntimeError(f"{self.what} {self.size}: answered {status}, not 201")
        return (time.thread_time() - cpu) / n


_RESERIALISED = "agentkey key, re-serialised body"
_FROM_CLAIM = "handler reads claim.json()"


def cases(sizes: list[str]) -> list[Case]:
    out: list[Case] = []
    for size in sizes:
        args = arguments(SIZES[size])
        plan = PlanSession.new()
        canonical = plan.step(0, "charge", args).body
        loose = json.dumps(args).encode()
        args_hash = plan.step(0, "charge", args).key.args_hash

        def agentkey_key(i: int, plan_id: str = plan.id, args_hash: str = args_hash) -> bytes:
            return f"{plan_id}:step_{i:03d}:{args_hash}".encode()

        def opaque_key(i: int) -> bytes:
            return str(uuid.uuid4()).encode()

        out += [
            Case("agentkey key, canonical body", size, canonical, agentkey_key),
            Case(_RESERIALISED, size, loose, agentkey_key),
            Case(f"{_RESERIALISED}, {_FROM_CLAIM}", size, loose, agentkey_key, from_claim=True),
            Case("opaque key (UUID)", size, canonical, opaque_key),
            Case(f"opaque key (UUID), {_FROM_CLAIM}", size, canonical, opaque_key, from_claim=True),
            Case("opaque key (UUID), non-canonical body", size, loose, opaque_key),
            Case(
                "opaque key (UUID), non-canonical body, body_fingerprint='canonical'",
                size,
                loose,
                opaque_key,
                canonical=True,
            ),
        ]
    return out


def batch(size: str, smoke: bool) -> int:
    """Requests per slot: about 0.2 s of work (a few when smoke testing)."""
    if smoke:
        return 2
    return {"1KB": 400, "100KB": 40, "1MB": 6}[size]


async def measure(case: Case, rounds: int, n: int) -> dict[str, Any]:
    await case.slot(case.bare, n)
    await case.slot(case.ours, n)  # warm-up
    pairs: list[tuple[float, float]] = []
    for _ in range(rounds):
        got: dict[str, list[float]] = {"A": [], "B": []}
        for side in palindrome(["A", "B"]):
            got[side].append(await case.slot(case.bare if side == "A" else case.ours, n))
        pairs.append((sum(got["A"]) / 2, sum(got["B"]) / 2))
    ratio = spread([b / a for a, b in pairs])
    row = {
        "what": case.what,
        "size": case.size,
        "body_bytes": len(case.body),
        "N": rounds,
        "requests_per_slot": n,
        "cpu_ratio": ratio,
        "bare_cpu_us": round(statistics.median(a for a, _ in pairs) * 1e6, 1),
        "middleware_cpu_us": round(statistics.median(b for _, b in pairs) * 1e6, 1),
        "added_cpu_us": spread([(b - a) * 1e6 for a, b in pairs]),
    }
    print(
        f"  {case.what:<72} {case.size:>6} {ratio['median']:.2f}x "
        f"({ratio['iqr'][0]:.2f}-{ratio['iqr'][1]:.2f}, {ratio['min']:.2f}-{ratio['max']:.2f}) "
        f"{row['middleware_cpu_us']:>9.1f} / {row['bare_cpu_us']:<9.1f} us  N={rounds}"
    )
    return row


# --- the uvicorn row ---------------------------------------------------------------

UVICORN_ROW = "opaque key, 1 MB non-canonical body, under uvicorn, on Redis"
_UVICORN_CONFIGS = {"bare": "bare", "bytes": "redis", "canonical": "redis, canonical"}


def uvicorn_app() -> Any:
    """The app one uvicorn process serves (``--factory``), named by ``BENCH_APP``:
    ``bare``, ``redis`` or ``redis, canonical`` (``BENCH_REDIS`` names the Redis)."""
    config = os.environ["BENCH_APP"]
    if config == "bare":
        return app()
    from agentkey.server import RedisStore

    # The option only when asked for: --before serves this file from a tree without it.
    options: dict[str, Any] = (
        {"body_fingerprint": "canonical"} if config.endswith("canonical") else {}
    )
    return IdempotencyMiddleware(
        app(),
        store=RedisStore(os.environ["BENCH_REDIS"]),
        shared_key_space=True,
        options=ServerOptions(max_body_bytes=4 * 1024 * 1024, **options),
    )


def uvicorn_rows(rounds: int, n: int, before: Path | None = None) -> list[dict[str, Any]]:
    """Server CPU per 1 MB request under uvicorn: bytes and canonical fingerprints vs bare.

    ``before``: another checkout (an older commit, with this file copied into its
    ``bench/``) whose middleware is served too, in the same rounds: a before/after pair
    measured side by side rather than in two runs at two loads.
    """
    from tests._loopback import redis_server

    body = json.dumps(arguments(SIZES["1MB"])).encode()  # json.dumps: not canonical
    configs = dict(_UVICORN_CONFIGS)
    with ExitStack() as stack:
        redis = stack.enter_context(redis_server())
        names = list(configs.values())
        env = {"BENCH_REDIS": redis.url}
        running = stack.enter_context(servers(names, env, app="bench.bench_body:uvicorn_app"))
        if before is not None:
            configs["before"] = f"before ({before})"
            old = Server("redis", env, app="bench.bench_body:uvicorn_app", root=before.resolve())
            stack.callback(old.stop)
            old.start()
            old.wait_ready()
            running[configs["before"]] = old
            names.append(configs["before"])
        clients = {
            name: stack.enter_context(
                httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=60)
            )
            for name, server in running.items()
        }

        def slot(name: str) -> float:
            """Server CPU seconds per request over ``n`` requests with fresh keys."""
            client, pid = clients[name], running[name].pid
            before = proc_cpu(pid)
            for _ in range(n):
                headers = {"idempotency-key": str(uuid.uuid4()), "content-type": "application/json"}
                answer = client.post(PATH, content=body, headers=headers)
                if answer.status_code != 201 or "idempotent-replayed" in answer.headers:
                    raise RuntimeError(f"{name}: answered {answer.status_code} {answer.text[:200]}")
            return (proc_cpu(pid) - before) / n

        for name in names:  # warm-up: imports, connections, the first allocations
            slot(name)
        per_round: list[dict[str, float]] = []
        for _ in range(rounds):
            got: dict[str, list[float]] = {name: [] for name in names}
            for name in palindrome(names):
                got[name].append(slot(name))
            per_round.append({name: sum(v) / len(v) for name, v in got.items()})
    rows = []
    for label in configs:
        if label == "bare":
            continue
        ours = configs[label]
        ratio = spread([r[ours] / r["bare"] for r in per_round])
        row = {
            "what": UVICORN_ROW
            + {"bytes": "", "canonical": ", body_fingerprint='canonical'"}.get(label, f", {ours}"),
            "size": "1MB",
            "body_bytes": len(body),
            "N": rounds,
            "requests_per_slot": n,
            "cpu_ratio": ratio,
            "bare_cpu_us": round(statistics.median(r["bare"] for r in per_round) * 1e6, 1),
            "middleware_cpu_us": round(statistics.median(r[ours] for r in per_round) * 1e6, 1),
            "added_cpu_us": spread([(r[ours] - r["bare"]) * 1e6 for r in per_round]),
            "loadavg_after": list(os.getloadavg()),
        }
        print(
            f"  {row['what']:<72} {ratio['median']:.2f}x "
            f"({ratio['iqr'][0]:.2f}-{ratio['iqr'][1]:.2f}, {ratio['min']:.2f}-{ratio['max']:.2f}) "
            f"{row['middleware_cpu_us']:>9.1f} / {row['bare_cpu_us']:<9.1f} us  N={rounds}  "
            f"load {os.getloadavg()[0]:.1f}"
        )
        rows.append(row)
    return rows


def profile(size: str) -> None:
    """cProfile of one request with an agentkey key and of one with an opaque key."""
    for case in cases([size]):
        if _FROM_CLAIM in case.what:
            continue
        asyncio.run(case.slot(case.ours, 2))  # warm
        profiler = cProfile.Profile()
        profiler.enable()
        asyncio.run(case.slot(case.ours, 1))
        profiler.disable()
        print(f"\n=== {case.what}, {size}")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(14)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few seconds, for CI")
    parser.add_argument("--rounds", type=int, default=10, help="ABBA rounds per row")
    parser.add_argument("--sizes", default="1KB,100KB,1MB", help="comma-separated sizes")
    parser.add_argument("--profile", metavar="SIZE", help="profile one request and exit")
    parser.add_argument("--out", type=Path, help="where to write the JSON results")
    parser.add_argument(
        "--uvicorn-rounds",
        type=int,
        default=10,
        help="rounds of the uvicorn row (0: skip it; it needs redis-server on PATH)",
    )
    parser.add_argument(
        "--before",
        type=Path,
        help="also serve the uvicorn row's middleware from this checkout (an older "
        "commit with this file copied into its bench/), in the same rounds",
    )
    ns = parser.parse_args()
    if ns.profile:
        profile(ns.profile)
        return
    if not ns.smoke and ns.rounds < 10:
        parser.error("a full run needs --rounds >= 10")
    at_start = machine()
    rounds = 1 if ns.smoke else ns.rounds
    sizes = [s for s in ns.sizes.split(",") if s]
    print(
        f"bench_body: {rounds} ABBA rounds per row; ratio = middleware / bare app, "
        "CPU per request, median (IQR, min-max)"
    )
    rows = [asyncio.run(measure(case, rounds, batch(case.size, ns.smoke))) for case in cases(sizes)]
    if ns.uvicorn_rounds and shutil.which("redis-server"):
        print(f"  under uvicorn: server process CPU per request (load {os.getloadavg()[0]:.1f})")
        rounds = 1 if ns.smoke else ns.uvicorn_rounds
        rows += uvicorn_rows(rounds, 1 if ns.smoke else 8, ns.before)
    elif ns.uvicorn_rounds:
        print("redis-server is not on PATH: the uvicorn row is skipped")
    if not ns.smoke or ns.out:
        path = write_results(
            "body",
            {
                "method": "in-process ASGI, one request at a time, body in 64 KiB chunks; "
                "ABBA rounds, ratio per round = (B1+B2)/(A1+A2) of thread CPU per request; "
                "A = bare Starlette handler (await request.json()), B = the same behind "
                "IdempotencyMiddleware on MemoryStore, fresh keys",
                "rows": rows,
            },
            ns.out,
            at_start,
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
