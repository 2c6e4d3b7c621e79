"""Answers are read up to max_response_bytes: a huge (or gzip-bombed) body is a ToolError,
not an out-of-memory orchestrator, and the connection is closed either way."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agentkey import AsyncToolInvoker, ConfigurationError, ToolError, ToolInvoker, ToolResult
from tests._loopback import serve

from ._support import DRIVERS, FAST_POLL, FAST_RETRY, Driver, make_step
from .test_cancel import Counting

LIMIT = 100_000
BIG = json.dumps({"blob": "x" * (LIMIT * 3)}).encode()
SMALL = json.dumps({"blob": "x" * (LIMIT - 100)}).encode()


async def _chunks() -> AsyncIterator[bytes]:
    for _ in range(30):
        yield b"x" * 10_000  # 300 kB, no Content-Length


def _app() -> Starlette:
    async def big(request: Request) -> Response:
        return Response(BIG, media_type="application/json")

    async def small(request: Request) -> Response:
        return Response(SMALL, media_type="application/json")

    async def chunked(request: Request) -> Response:
        return StreamingResponse(_chunks(), media_type="application/json")

    async def bomb(request: Request) -> Response:
        packed = gzip.compress(BIG)
        assert len(packed) < LIMIT  # small on the wire, large once decoded
        return Response(packed, media_type="application/json", headers={"Content-Encoding": "gzip"})

    async def job(request: Request) -> Response:
        return JSONResponse({"status": "accepted"}, 202, headers={"Location": "/big-poll"})

    async def big_poll(request: Request) -> Response:
        return Response(BIG, media_type="application/json")

    return Starlette(
        routes=[
            Route("/big", big, methods=["POST"]),
            Route("/small", small, methods=["POST"]),
            Route("/chunked", chunked, methods=["POST"]),
            Route("/bomb", bomb, methods=["POST"]),
            Route("/job", job, methods=["POST"]),
            Route("/big-poll", big_poll, methods=["GET"]),
        ]
    )


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    """The oversize tool served on loopback."""
    with serve(_app()) as url:
        yield url


def _invoke(driver: Driver, base: str, path: str, transport: Counting) -> ToolResult:
    options: dict[str, Any] = {
        "retry": FAST_RETRY,
        "polling": FAST_POLL,
        "hooks": (),
        "max_response_bytes": LIMIT,
    }
    step = make_step()
    if driver == "sync":
        with (
            httpx.Client(transport=transport) as client,
            ToolInvoker(base, client=client, **options) as invoker,
        ):
            return invoker.invoke(step, path=path)

    async def main() -> ToolResult:
        async with (
            httpx.AsyncClient(transport=transport) as client,
            AsyncToolInvoker(base, client=client, **options) as invoker,
        ):
            return await invoker.invoke(step, path=path)

    return asyncio.run(main())


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize(
    ("path", "status"),
    [("/big", 200), ("/chunked", 200), ("/bomb", 200), ("/job", 200)],
    ids=["content-length", "chunked", "gzip-bomb", "poll-answer"],
)
def test_oversize_answer_is_a_tool_error(driver: Driver, base: str, path: str, status: int) -> None:
    """A body over max_response_bytes raises ToolError (no retry) and leaves nothing open."""
    transport = Counting()
    with pytest.raises(ToolError, match="max_response_bytes") as info:
        _invoke(driver, base, path, transport)
    assert info.value.status_code == status
    assert info.value.attempts == 1
    assert transport.open == 0


@pytest.mark.parametrize("driver", DRIVERS)
def test_answer_under_the_limit_is_read(driver: Driver, base: str) -> None:
    """A body just under max_response_bytes is read and parsed as usual."""
    transport = Counting()
    result = _invoke(driver, base, "/small", transport)
    assert result.body == json.loads(SMALL)
    assert transport.open == 0


@pytest.mark.parametrize("limit", [0, -1, 1.5, True, "1MB", None])
def test_bad_limit(limit: object) -> None:
    """max_response_bytes must be a positive int."""
    with pytest.raises(ConfigurationError, match="max_response_bytes"):
        ToolInvoker("https://tool.test", max_response_bytes=limit)  # type: ignore[arg-type]
