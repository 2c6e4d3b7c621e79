"""Helpers for the server tests: stores of both kinds, apps on loopback, keys."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import httpx

from agentkey import Clock, StepKey, StoreUnavailable, canonical_json
from agentkey.server import MemoryStore, ServerOptions, Store
from tests._loopback import serve

__all__ = [
    "CLOSE_PATH",
    "call",
    "new_plan",
    "request_for",
    "serve_closing",
    "with_options",
]

CLOSE_PATH = "/__test_close_store__"

_FIELDS = frozenset(ServerOptions.__dataclass_fields__)


def with_options(arguments: dict[str, Any]) -> dict[str, Any]:
    """A test helper's keyword arguments for a middleware: the :class:`ServerOptions` fields
    among them folded into ``options=`` (so helpers keep taking ``lock_ttl=...``)."""
    fields = {name: value for name, value in arguments.items() if name in _FIELDS}
    rest = {name: value for name, value in arguments.items() if name not in _FIELDS}
    if fields:
        base = rest.pop("options", None) or ServerOptions()
        rest["options"] = base.replace(**fields)
    return rest


@contextmanager
def serve_closing(
    app: Any, store: Store, *, also: Sequence[Callable[[], Awaitable[Any]]] = ()
) -> Iterator[str]:
    """Serve ``app`` on loopback; close ``store`` inside the server's own event loop at the end.

    A redis.asyncio client belongs to the loop that opened its connections, so it
    must be closed there; ``also`` lists further closers (a pool passed in by the test).
    The store is closed once the requests still running have ended, as a server's shutdown
    does: a client that gave up does not stop its request, and one still retrying a store
    that fails over would open a connection after the close, left for the loop to find.
    """
    running: set[asyncio.Task[Any]] = set()

    async def shim(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == CLOSE_PATH:
            if running:
                await asyncio.wait(running, timeout=60)
            await store.aclose()
            for close in also:
                await close()
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        task = asyncio.current_task()
        assert task is not None
        running.add(task)
        try:
            await app(scope, receive, send)
        finally:
            running.discard(task)

    with serve(shim) as url:
        try:
            yield url
        finally:
            httpx.post(url + CLOSE_PATH, timeout=90)


def new_plan() -> str:
    """A fresh plan session id, so tests never share keys."""
    return "t-" + uuid.uuid4().hex[:20]


def request_for(
    args: dict[str, Any], *, plan: str | None = None, step: int = 0, style: str = "raw"
) -> tuple[dict[str, str], bytes]:
    """Headers and body of one correct step request."""
    key = StepKey.build(plan or new_plan(), step, args)
    value = key.header_value("sf-string" if style == "sf-string" else "raw")
    return {"idempotency-key": value, "content-type": "application/json"}, canonical_json(args)


def call(
    client: httpx.Client, path: str, headers: dict[str, str], body: bytes
) -> tuple[int, Any, httpx.Headers]:
    """POST and return status, parsed JSON (or raw text) and headers."""
    response = client.post(path, headers=headers, content=body)
    try:
        parsed: Any = response.json()
    except json.JSONDecodeError:
        parsed = response.text
    return response.status_code, parsed, response.headers


class FailingFinish(MemoryStore):
    """A MemoryStore whose next ``failures`` finish calls raise StoreUnavailable."""

    def __init__(self, failures: int, *, clock: Clock | None = None) -> None:
        super().__init__(clock=clock)
        self.failures = failures
        self.finishes = 0

    async def finish(self, key: str, owner: str, value: bytes, *, ttl_ms: int) -> bool:
        self.finishes += 1
        if self.failures > 0:
            self.failures -= 1
            raise StoreUnavailable("the store is down (test)")
        return await super().finish(key, owner, value, ttl_ms=ttl_ms)
