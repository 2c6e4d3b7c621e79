"""Middleware overhead: a tool app behind IdempotencyMiddleware vs the bare app, over loopback.

One run serves the same Starlette handler three ways — bare, behind the
middleware on MemoryStore, and on a private redis-server (when one is on
PATH) — and sends the same sequential requests (each a fresh key) to each,
then replays. It prints requests per second and the ratio to the bare app.

    python bench/bench_server.py            # full run
    python bench/bench_server.py --smoke    # a quick run for CI
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests._loopback

from agentkey import PlanSession
from agentkey.server import IdempotencyMiddleware, MemoryStore, RedisStore, Store
from tests._loopback import redis_server, serve


def tool_app(store: Store | None) -> Any:
    async def charge(request: Request) -> JSONResponse:
        args = await request.json()
        return JSONResponse({"charge_id": "ch_1", "amount": args["amount"]}, status_code=201)

    app: Any = Starlette(routes=[Route("/tools/charge", charge, methods=["POST"])])
    if store is not None:
        app = IdempotencyMiddleware(app, store=store)
    return app


def run(url: str, n: int, *, replay: bool) -> float:
    """Requests per second for ``n`` sequential requests (fresh keys, or one key replayed)."""
    plan = PlanSession.new()
    steps = [plan.step(0 if replay else i, "charge", {"amount": 100}) for i in range(n)]
    with httpx.Client(base_url=url) as client:
        first = steps[0]
        client.post(
            "/tools/charge",
            headers={"idempotency-key": first.idempotency_key},
            content=first.body,
        )  # warm-up: connection, scripts
        started = time.perf_counter()
        for step in steps:
            response = client.post(
                "/tools/charge",
                headers={"idempotency-key": step.idempotency_key},
                content=step.body,
            )
            assert response.status_code == 201, response.text
        elapsed = time.perf_counter() - started
    return n / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a quick run for CI")
    ns = parser.parse_args()
    n = 50 if ns.smoke else 2000

    with ExitStack() as stack:
        variants: list[tuple[str, Callable[[], Store | None]]] = [
            ("bare app", lambda: None),
            ("middleware + MemoryStore", MemoryStore),
        ]
        if shutil.which("redis-server"):
            redis = stack.enter_context(redis_server())
            variants.append(("middleware + RedisStore", lambda: RedisStore(redis.url)))
        print(f"{n} sequential requests per row, one client, uvicorn on loopback")
        print(f"{'variant':<28} {'fresh req/s':>12} {'ratio':>7} {'replay req/s':>13} {'ratio':>7}")
        base_fresh = base_replay = 0.0
        for name, make in variants:
            with serve(tool_app(make())) as url:
                fresh = run(url, n, replay=False)
                replay = run(url, n, replay=True)
            if name == "bare app":
                base_fresh, base_replay = fresh, replay
            print(
                f"{name:<28} {fresh:>12.0f} {fresh / base_fresh:>7.2f} "
                f"{replay:>13.0f} {replay / base_replay:>7.2f}"
            )
        # Redis clients opened in the server threads are dropped with their loops.


if __name__ == "__main__":
    main()
