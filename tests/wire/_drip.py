"""A server that answers one byte every 100 ms, for deadline tests (served with tests._loopback)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

__all__ = ["dripping_app"]


def dripping_app(seconds: float = 10.0) -> Starlette:
    """Every path answers 200 with a JSON body sent one byte per 100 ms for ``seconds``."""

    async def drip(request: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            yield b'{"access_token": "'
            for _ in range(int(seconds * 10)):
                await asyncio.sleep(0.1)
                yield b"a"
            yield b'"}'

        return StreamingResponse(body(), media_type="application/json")

    return Starlette(routes=[Route("/{path:path}", drip, methods=["GET", "POST"])])
