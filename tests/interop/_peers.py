"""Other servers' idempotency layers, each in front of the counting tool, on a real Redis.

Each :class:`Peer` builds one ASGI app as that library's README sets it up, with its
defaults, its records in the session's redis-server (the one without a Redis store,
fastapi-idempotency 0.1.1, keeps them in memory), served by uvicorn on loopback.
What each sends was read from its source and is asserted on the wire by the tests:

| peer | replay marker | in flight | other body, same key | key refused |
|---|---|---|---|---|
| asgi-idempotency-header 0.2.0 | `Idempotent-Replayed: true` | 409 "already pending" | replayed (no fingerprint) | 422 unless a UUID (option) |
| ichido 0.1.0 | `X-Ichido-Status: replayed` | 409 `request_in_progress` | 422 `fingerprint_mismatch` | none |
| pyidempotent 0.1.0 | none | held up to 10 s, then the app's 409 | the app's 422 | none |
| fastapi-idempotency-key 0.1.1 | `Idempotency-Replayed: true` | 409 | 422 | none |
| fastidempotent 0.1.0 | `X-Idempotent-Replayed: true` | 409 | 422 | 400 over 256 characters |
| fastapi-idempotency 0.1.1 | `Idempotent-Replayed: true` | held up to 15 s, then 409 | 422 | 422 over 255 characters |
"""  # noqa: E501

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import version
from typing import Annotated, Any

import fastapi_idempotency
import fastapi_idempotency_key
import fastidempotent
import ichido
import pyidempotent
import pytest
import redis.asyncio as aioredis
from fastapi import Body, FastAPI, Request
from fastapi.responses import JSONResponse
from fastidempotent.backends.redis import RedisBackend as FastidempotentRedis
from idempotency_header_middleware import IdempotencyHeaderMiddleware
from idempotency_header_middleware.backends import RedisBackend as HeaderRedis
from pyidempotent.backends import RedisBackend as PyidempotentRedis
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.types import ASGIApp

from agentkey._keys import HeaderStyle
from tests._loopback import RedisServer
from tests.server._util import serve_closing

from ._support import Served, Tool, Wire

__all__ = ["DUPLICATE", "OTHER_BODY", "OTHER_ROUTE", "PEERS", "Peer", "serve_peer"]

#: The releases this suite proves (the interop dependency group pins them).
VERSIONS = {
    "asgi-idempotency-header": "0.2.0",
    "ichido": "0.1.0",
    "pyidempotent": "0.1.0",
    "fastapi-idempotency-key": "0.1.1",
    "fastidempotent": "0.1.0",
    "fastapi-idempotency": "0.1.1",
}
for _name, _pinned in VERSIONS.items():
    if version(_name) != _pinned:  # pragma: no cover
        raise pytest.UsageError(
            f"tests/interop proves {_name}=={_pinned}, found {version(_name)}; install the "
            "pinned interop dependency group"
        )


class _Closer:
    """What serve_closing closes inside the server's loop: the peer's redis client."""

    def __init__(self, client: aioredis.Redis | None = None) -> None:
        self.client = client

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()


Build = Callable[[Tool, str, str], tuple[ASGIApp, _Closer]]


@dataclass(frozen=True)
class Peer:
    """One idempotency library, and how a client must talk to it."""

    name: str
    build: Build  # (tool, redis url, unique prefix) -> (app, closer)
    style: HeaderStyle = "raw"  # the key header style it accepts
    replay_headers: tuple[str, ...] | None = None  # None: agentkey's defaults
    fingerprints: bool = True  # refuses another body under a used key
    mismatch_status: int = 422
    replay_marker: tuple[str, str] | None = ("idempotent-replayed", "true")
    #: False: it refuses every resend of a finished key (422 "different payload").
    replays: bool = True
    #: The draft's rules it breaks, as `agentkey check` names the rows.
    contract_fails: frozenset[str] = frozenset()
    #: It reads the record, then takes a lock: a duplicate that read before the first
    #: finished takes the freed lock after it and runs again (tests/interop/test_peer_races.py).
    races: bool = False
    #: It stores a response's body and status in two commands, and a duplicate that reads
    #: between them gets its 500 (``int(None)`` in its Redis backend). agentkey resends
    #: that 500 with the same key, and the resend is replayed.
    torn_reads: bool = False


def _starlette(tool: Tool, *middleware: Middleware) -> Starlette:
    return Starlette(routes=tool.routes, middleware=list(middleware))


def _asgi_idempotency_header(tool: Tool, url: str, prefix: str) -> tuple[ASGIApp, _Closer]:
    client = aioredis.Redis.from_url(url)
    backend = HeaderRedis(client, keys_key=f"{prefix}-keys", response_key=f"{prefix}-resp-")
    middleware = Middleware(
        IdempotencyHeaderMiddleware,  # type: ignore[arg-type]  # a dataclass: its app is typed loosely
        backend=backend,
        enforce_uuid4_formatting=True,
    )
    return _starlette(tool, middleware), _Closer(client)


def _ichido(tool: Tool, url: str, prefix: str) -> tuple[ASGIApp, _Closer]:
    client = aioredis.Redis.from_url(url)
    store = ichido.RedisIdempotencyStore(client)
    config = ichido.IchidoConfig(key_prefix=f"{prefix}:")
    return _starlette(tool, Middleware(ichido.IchidoMiddleware, store=store, config=config)), (
        _Closer(client)
    )


def _pyidempotent(
    tool: Tool, url: str, prefix: str, *, wait_on_processing: bool = True
) -> tuple[ASGIApp, _Closer]:
    """pyidempotent is a decorator: the app maps its exceptions to answers, as its README
    shows (409 for a request in progress, 422 for another payload, 400 for no key).
    ``wait_on_processing=False`` (its option) answers a duplicate 409 at once."""
    client = aioredis.Redis.from_url(url)
    backend = PyidempotentRedis(client, prefix=f"{prefix}:")
    app = FastAPI()

    async def tool_route(
        request: Request, name: str, args: Annotated[dict[str, Any], Body()]
    ) -> Any:
        key = request.headers.get("idempotency-key")
        return await tool.run(name, request.url.path, key, args)

    decorate = pyidempotent.idempotent(backend, wait_on_processing=wait_on_processing)
    protected = decorate(tool_route)
    for path in ("/tools/{name}", "/v2/tools/{name}"):
        app.post(path, status_code=201)(protected)
    statuses = {
        pyidempotent.IdempotencyKeyMissing: 400,
        pyidempotent.IdempotencyProcessing: 409,
        pyidempotent.IdempotencyConflict: 422,
    }
    for error, status in statuses.items():

        async def handler(request: Request, exc: Exception, status: int = status) -> JSONResponse:
            return JSONResponse({"detail": str(exc)}, status_code=status)

        app.add_exception_handler(error, handler)
    return app, _Closer(client)


def _fastapi_idempotency_key(tool: Tool, url: str, prefix: str) -> tuple[ASGIApp, _Closer]:
    backend = fastapi_idempotency_key.RedisBackend(redis_url=url, prefix=f"{prefix}:")
    middleware = Middleware(fastapi_idempotency_key.IdempotencyMiddleware, backend=backend)
    return _starlette(tool, middleware), _Closer(getattr(backend, "redis", None))


def _fastidempotent(tool: Tool, url: str, prefix: str) -> tuple[ASGIApp, _Closer]:
    client = aioredis.Redis.from_url(url)
    backend = FastidempotentRedis(url=url, key_prefix=f"{prefix}:", client=client)
    middleware = Middleware(fastidempotent.IdempotencyMiddleware, backend=backend)
    return _starlette(tool, middleware), _Closer(client)


def _fastapi_idempotency(tool: Tool, url: str, prefix: str) -> tuple[ASGIApp, _Closer]:
    """No Redis store in 0.1.1 (memory, or Tortoise ORM): its MemoryStore, one process."""
    middleware = Middleware(fastapi_idempotency.IdempotencyMiddleware)
    return _starlette(tool, middleware), _Closer()


OTHER_BODY = "same key, other body is refused (422)"
OTHER_ROUTE = "key on another route is never replayed"
DUPLICATE = "duplicate is replayed"

PEERS: tuple[Peer, ...] = (
    # Keys are global (no route, no body): another body or route gets the first answer.
    Peer(
        "asgi-idempotency-header",
        _asgi_idempotency_header,
        style="uuid",
        fingerprints=False,
        torn_reads=True,
        contract_fails=frozenset({OTHER_BODY, OTHER_ROUTE}),
    ),
    Peer("ichido", _ichido, replay_marker=("x-ichido-status", "replayed")),
    # Its fingerprint is the handler's arguments (not the route): /v2 gets /tools' answer.
    Peer(
        "pyidempotent",
        _pyidempotent,
        replay_headers=(),
        replay_marker=None,
        contract_fails=frozenset({OTHER_ROUTE}),
    ),
    # 0.1.1 stores a finished record with an empty fingerprint (both backends), so every
    # resend of a finished key is refused with 422 "different request payload".
    Peer(
        "fastapi-idempotency-key",
        _fastapi_idempotency_key,
        replay_marker=("idempotency-replayed", "true"),
        replays=False,
        contract_fails=frozenset({DUPLICATE}),
    ),
    Peer(
        "fastidempotent",
        _fastidempotent,
        replay_marker=("x-idempotent-replayed", "true"),
        races=True,
    ),
    Peer("fastapi-idempotency", _fastapi_idempotency),
)


@contextmanager
def serve_peer(peer: Peer, redis: RedisServer) -> Iterator[Served]:
    """``peer`` in front of a fresh counting tool, its records in ``redis``, on loopback."""
    tool = Tool()
    app, closer = peer.build(tool, redis.url, f"{peer.name}-{uuid.uuid4().hex[:12]}")
    wire = Wire(app)
    with serve_closing(wire, closer) as url:  # type: ignore[arg-type]  # only aclose() is used
        yield Served(url, tool, wire, None)  # type: ignore[arg-type]  # no events: not idemkit
