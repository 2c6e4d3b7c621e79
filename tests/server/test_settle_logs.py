"""What the middleware logs when it settles a claim: an unawaited begin_mutation() under
``mutation_starts="on_mark"`` is reported, and "in doubt" is logged only when the record
was really marked so. Real loopback server (uvicorn) and a real MemoryStore."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentkey.server import IdempotencyMiddleware, MemoryStore, ServerOptions, current_claim
from agentkey.server._decide import Checked, check_body
from agentkey.server._records import encode_in_progress
from tests.server._util import request_for, serve_closing


def test_an_unawaited_mark_under_on_mark_is_logged_once_per_route(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """on_mark and claim.begin_mutation() without await: the mark never reached the store,
    and a WARNING says so, once for the route (the old code said nothing)."""
    charges: Counter[str] = Counter()

    async def charge(request: Request) -> Response:
        await request.json()
        current_claim().begin_mutation()  # not awaited: the mark stays in this process
        charges["charge"] += 1
        return JSONResponse({"charged": charges["charge"]}, 201)

    store = MemoryStore()
    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/charge", charge, methods=["POST"])]),
        store=store,
        shared_key_space=True,
        options=ServerOptions(mutation_starts="on_mark"),
    )
    with (
        caplog.at_level(logging.WARNING, logger="agentkey.server"),
        serve_closing(app, store) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        for amount in (1, 2):
            headers, body = request_for({"amount": amount})
            assert client.post("/charge", headers=headers, content=body).status_code == 201
    warned = [r for r in caplog.records if "without awaiting" in r.getMessage()]
    assert len(warned) == 1
    assert "POST /charge" in warned[0].getMessage()


def test_in_doubt_is_not_logged_when_another_request_owns_the_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A failed handler whose record another request took over is not marked in doubt,
    and the log does not say it is (the old code logged "the key is in doubt" anyway)."""
    store = MemoryStore()
    app = IdempotencyMiddleware(Starlette(), store=store, shared_key_space=True)
    headers, body = request_for({"amount": 1})
    from agentkey import StepKey

    checked = check_body(StepKey.parse(headers["idempotency-key"]), ("POST", "/charge"), body)
    assert isinstance(checked, Checked)
    life = app._life
    claim = life.new_claim(checked, "shared", None, "POST /charge")

    async def go() -> bool:
        other = encode_in_progress("cd" * 16, 1, lease_end_ms=2, phase="started")
        assert await store.claim(claim.record_key, other, ttl_ms=60_000) is None
        return await life._doubt(claim)

    with caplog.at_level(logging.DEBUG, logger="agentkey.server"):
        assert asyncio.run(go()) is False
    assert not [
        r for r in caplog.records if r.levelno >= logging.WARNING and "in doubt" in r.getMessage()
    ]
