"""What remembering "may have started" costs: store operations per request (issue 35).

Each store operation (claim, renew, finish, release, get) is one round trip on RedisStore
and on PostgresStore; a transaction's own statements (BEGIN, the handler's INSERT, the
seal, COMMIT) are counted apart by PostgreSQL's ``xact_commit`` and by the store's
``transaction`` entries. Requests go through IdempotencyMiddleware in this process (an
ASGI transport: no HTTP server, so only the store's traffic is counted) against a real
redis-server and a real PostgreSQL on loopback:

- ``fresh 201``, ``replay``: a handler that answers 201;
- ``500``, ``retry after 500``: a handler that answers 500 (before: released and run
  again; now: in doubt, and the retry is answered from the claim's read);
- ``on_mark fresh 201``: ``mutation_starts="on_mark"`` and ``await claim.begin_mutation()``;
- ``transactional 201``: PostgresStore.transaction, default and ``on_mark``.

    python bench/bench_in_doubt.py                  # prints the table, writes results/in_doubt.json
    python bench/bench_in_doubt.py --out FILE       # writes FILE instead (the "before" run)
    python bench/bench_in_doubt.py --smoke          # the same counts, for CI (writes nothing)

Run it on an older checkout (with its own ``agentkey`` first on ``PYTHONPATH``) for the
"before" column: options that did not exist then are left out and marked ``n/a``.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests._loopback

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import agentkey.server
from agentkey import PlanSession
from agentkey.server import IdempotencyMiddleware, current_claim

_HAS_MODES = (
    hasattr(agentkey.server, "ServerOptions")
    or "mutation_starts" in inspect.signature(IdempotencyMiddleware).parameters
)


class Counting:
    """A Store that counts the operations the middleware asks of it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.ops: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def claim(self, key: str, value: bytes, *, ttl_ms: int) -> bytes | None:
        self.ops["claim"] += 1
        result: bytes | None = await self.inner.claim(key, value, ttl_ms=ttl_ms)
        return result

    async def renew(self, key: str, owner: str, *, ttl_ms: int) -> bool:
        self.ops["renew"] += 1
        return bool(await self.inner.renew(key, owner, ttl_ms=ttl_ms))

    async def finish(self, key: str, owner: str, value: bytes, *, ttl_ms: int) -> bool:
        self.ops["finish"] += 1
        return bool(await self.inner.finish(key, owner, value, ttl_ms=ttl_ms))

    async def release(self, key: str, owner: str) -> bool:
        self.ops["release"] += 1
        return bool(await self.inner.release(key, owner))

    async def get(self, key: str) -> bytes | None:
        self.ops["get"] += 1
        result: bytes | None = await self.inner.get(key)
        return result

    async def aclose(self) -> None:
        await self.inner.aclose()


def _app(store: Counting, pg: Any, **options: Any) -> Any:
    async def ok(request: Request) -> Response:
        await request.json()
        if options.get("mutation_starts") == "on_mark":
            await current_claim().begin_mutation()
        return JSONResponse({"ok": True}, status_code=201)

    async def fail(request: Request) -> Response:
        await request.json()
        return JSONResponse({"error": "downstream"}, status_code=500)

    async def tx(request: Request) -> Response:
        await request.json()
        async with pg.inner.transaction(current_claim()) as t:
            await t.connection.execute("SELECT 1")
            response: Response = await t.complete(JSONResponse({"ok": True}, status_code=201))
            return response

    routes = [
        Route("/ok", ok, methods=["POST"]),
        Route("/fail", fail, methods=["POST"]),
        Route("/tx", tx, methods=["POST"]),
    ]
    # Only a tree with ServerOptions is given options (a --before tree has none).
    extra: dict[str, Any] = {"options": agentkey.server.ServerOptions(**options)} if options else {}
    return IdempotencyMiddleware(
        Starlette(routes=routes), store=store, shared_key_space=True, **extra
    )


async def _measure(store: Counting, path: str, options: dict[str, Any]) -> list[int]:
    """Operations of the first request of a fresh key, then of its repeat."""
    app = _app(store, store, **options)
    step = PlanSession.new().step(0, "t", {"n": uuid.uuid4().hex})
    headers = {"idempotency-key": step.idempotency_key}
    counts = []
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://bench"
    ) as client:
        for _ in range(2):
            store.ops.clear()
            await client.post(path, headers=headers, content=step.body)
            counts.append(sum(store.ops.values()))
    return counts


async def _run(redis_url: str, dsn: str) -> dict[str, dict[str, Any]]:
    from agentkey.server import PostgresStore, RedisStore

    rows: dict[str, dict[str, Any]] = {}
    for name, make in (
        ("redis", lambda: RedisStore(redis_url, prefix=f"b{uuid.uuid4().hex[:8]}")),
        ("postgres", lambda: PostgresStore(dsn, table=f"b{uuid.uuid4().hex[:8]}")),
    ):
        store = Counting(make())
        try:
            await store.get("warm")  # connect (and create the table) before counting
            cases: list[tuple[str, str, dict[str, Any]]] = [
                ("fresh 201 / replay", "/ok", {}),
                ("500 / retry after 500", "/fail", {}),
                ("on_mark fresh 201 / replay", "/ok", {"mutation_starts": "on_mark"}),
            ]
            if name == "postgres":
                cases += [
                    ("transactional 201 / replay", "/tx", {}),
                    ("transactional on_mark / replay", "/tx", {"mutation_starts": "on_mark"}),
                ]
            for label, path, options in cases:
                if options and not _HAS_MODES:
                    rows[f"{name}: {label}"] = {"ops": "n/a"}
                    continue
                first, second = await _measure(store, path, options)
                rows[f"{name}: {label}"] = {"ops": f"{first} / {second}"}
        finally:
            await store.aclose()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "in_doubt.json"))
    parser.add_argument("--smoke", action="store_true", help="for CI: print, write nothing")
    ns = parser.parse_args()
    from tests._loopback import redis_server
    from tests._postgres import postgres_server

    with redis_server() as redis, postgres_server() as pg:
        rows = asyncio.run(_run(redis.url, pg.dsn))
    width = max(len(k) for k in rows)
    print(f"{'case':<{width}}  store operations (first request / repeat)")
    for case, row in rows.items():
        print(f"{case:<{width}}  {row['ops']}")
    if not ns.smoke:
        Path(ns.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
