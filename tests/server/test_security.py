"""Server-side security (issue 24): key spaces, redacted keys, bounded answers, held requests,
redirects.

Each test here failed on the code before its fix. Where the defect is about the
network, the app runs under a real uvicorn on loopback and the side effects are
counted on the server.
"""

from __future__ import annotations

import asyncio
import logging
import tracemalloc
from collections import Counter
from collections.abc import AsyncIterator, MutableMapping
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from fastapi import Depends, FastAPI, HTTPException
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agentkey import ConfigurationError, StoreUnavailable
from agentkey._keys import shown_key
from agentkey.server import (
    Claim,
    DecisionEvent,
    IdempotencyMiddleware,
    MemoryStore,
    ServerOptions,
    current_claim,
    starlette_user_identity,
)
from agentkey.server._decide import is_storable
from agentkey.server._records import StoredOutcome, decode_record
from tests._loopback import serve
from tests.server._util import request_for
from tests.server.test_blob_files import GatedBlobs, blobs_in

TOKENS = {"tk-alice": "alice", "tk-bob": "bob"}


def _bearer(authorization: str | None) -> str | None:
    scheme, _, token = (authorization or "").partition(" ")
    return TOKENS.get(token) if scheme.lower() == "bearer" else None


# --- §1: a replay never crosses an authentication boundary ----------------------------


def test_a_middleware_that_cannot_tell_callers_apart_refuses_to_start() -> None:
    """Neither principal= nor shared_key_space=True: ConfigurationError naming both fixes."""
    with pytest.raises(ConfigurationError) as info:
        IdempotencyMiddleware(Starlette(), store=MemoryStore())
    assert "principal=" in str(info.value)
    assert "shared_key_space=True" in str(info.value)
    with pytest.raises(ConfigurationError, match="not both"):
        IdempotencyMiddleware(
            Starlette(),
            store=MemoryStore(),
            principal=starlette_user_identity,
            shared_key_space=True,
        )


def _dependency_auth_app(runs: Counter[str]) -> FastAPI:
    """FastAPI authenticating in a dependency (which runs after the middleware decided)."""

    def caller(request: Request) -> str:
        found = _bearer(request.headers.get("authorization"))
        if found is None:
            raise HTTPException(401, "unknown token")
        return found

    def principal(scope: Any) -> str | None:  # the same check, for the middleware
        return _bearer(Headers(scope=scope).get("authorization"))

    app = FastAPI()
    app.add_middleware(
        IdempotencyMiddleware, store=MemoryStore(), routes=["/tools/*"], principal=principal
    )

    @app.post("/tools/charge", status_code=201)
    async def charge(request: Request, who: str = Depends(caller)) -> dict[str, Any]:
        args = await request.json()
        current_claim().begin_mutation()
        runs[who] += 1
        return {"charged_for": who, "amount": args["amount"]}

    return app


def test_a_stored_answer_is_never_replayed_to_an_unauthenticated_caller() -> None:
    """Dependency-based auth: no token gets 401 (no replay, no 422), another user runs anew."""
    runs: Counter[str] = Counter()
    headers, body = request_for({"amount": 5})
    _, other_body = request_for({"amount": 6})
    with serve(_dependency_auth_app(runs)) as url, httpx.Client(base_url=url) as client:
        alice = client.post(
            "/tools/charge", headers={**headers, "authorization": "Bearer tk-alice"}, content=body
        )
        anonymous = client.post("/tools/charge", headers=headers, content=body)
        forged = client.post(
            "/tools/charge", headers={**headers, "authorization": "Bearer nope"}, content=body
        )
        probe = client.post("/tools/charge", headers=headers, content=other_body)
        bob = client.post(
            "/tools/charge", headers={**headers, "authorization": "Bearer tk-bob"}, content=body
        )
    assert alice.status_code == 201
    for refused in (anonymous, forged, probe):
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"] == "unauthenticated"
        assert "idempotent-replayed" not in refused.headers
        assert b"alice" not in refused.content
    assert bob.status_code == 201
    assert "idempotent-replayed" not in bob.headers
    assert bob.json() == {"charged_for": "bob", "amount": 5}
    assert runs == {"alice": 1, "bob": 1}


class _Tokens(AuthenticationBackend):
    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, SimpleUser] | None:
        user = _bearer(conn.headers.get("authorization"))
        return (AuthCredentials(["tools"]), SimpleUser(user)) if user else None


def _authenticated_app(runs: Counter[str], *, misplaced: bool) -> Starlette:
    async def charge(request: Request) -> JSONResponse:
        runs[request.user.display_name if request.user.is_authenticated else "anonymous"] += 1
        current_claim().begin_mutation()
        return JSONResponse({"for": request.user.display_name}, status_code=201)

    app = Starlette(routes=[Route("/tools/charge", charge, methods=["POST"])])
    store = MemoryStore()
    if misplaced:  # the last added runs first: idempotency outside the authentication
        app.add_middleware(AuthenticationMiddleware, backend=_Tokens())
        app.add_middleware(IdempotencyMiddleware, store=store, principal=starlette_user_identity)
    else:
        app.add_middleware(IdempotencyMiddleware, store=store, principal=starlette_user_identity)
        app.add_middleware(AuthenticationMiddleware, backend=_Tokens())
    return app


def test_inside_starlette_authentication_each_user_has_a_key_space() -> None:
    """starlette_user_identity: alice's answer is hers; no credentials is a 401, nothing runs."""
    runs: Counter[str] = Counter()
    headers, body = request_for({"amount": 5})
    signed = {**headers, "authorization": "Bearer tk-alice"}
    with (
        serve(_authenticated_app(runs, misplaced=False)) as url,
        httpx.Client(base_url=url) as client,
    ):
        first = client.post("/tools/charge", headers=signed, content=body)
        again = client.post("/tools/charge", headers=signed, content=body)
        anonymous = client.post("/tools/charge", headers=headers, content=body)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json() == {"for": "alice"}
    assert anonymous.status_code == 401
    assert runs == {"alice": 1}


def test_a_middleware_outside_the_authentication_fails_closed() -> None:
    """Added after AuthenticationMiddleware (so outermost): every request fails, none runs."""
    runs: Counter[str] = Counter()
    headers, body = request_for({"amount": 5})
    signed = {**headers, "authorization": "Bearer tk-alice", "connection": "close"}
    with (
        serve(_authenticated_app(runs, misplaced=True)) as url,
        httpx.Client(base_url=url) as client,
    ):
        answer = client.post("/tools/charge", headers=signed, content=body)
    assert answer.status_code == 500
    assert runs == {}


def test_keys_are_redacted_in_logs_events_and_claims(caplog: pytest.LogCaptureFixture) -> None:
    """A log line, a DecisionEvent's repr and a Claim's repr show shown_key, never the key."""

    class Down(MemoryStore):
        async def claim(self, key: str, value: bytes, *, ttl_ms: int) -> bytes | None:
            raise StoreUnavailable("the store is down (test)")

    async def tool(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("must not run")

    headers, body = request_for({"amount": 5})
    key = headers["idempotency-key"]
    events: list[DecisionEvent] = []
    app = IdempotencyMiddleware(tool, store=Down(), shared_key_space=True, hooks=[events.append])

    async def post() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return (await client.post("/x", headers=headers, content=body)).status_code

    with caplog.at_level(logging.ERROR, logger="agentkey.server"):
        assert anyio.run(post) == 503
    assert shown_key(key) in caplog.text
    assert key not in caplog.text
    [event] = events
    assert event.idempotency_key == key  # the attribute keeps it whole, for correlation
    assert key not in repr(event)
    assert shown_key(key) in repr(event)
    claim = Claim(
        key=None, idempotency_key=key, principal="p", record_key="p:k", owner="o", store=Down(),
        lock_ttl_ms=1000,
    )  # fmt: skip
    assert key not in repr(claim)


_HASH = "ab" * 32


@pytest.mark.parametrize(
    "key",
    [
        f"plan-1:step_1:{_HASH}",  # non-canonical step
        f"plan-1:step_001:{_HASH[:-1]}X",  # a hash that is not hex
        f'"plan-1:step_01:{_HASH}"',  # sf-string form
        '"ik_secret-value-123\\q"',  # an opaque sf-string with a bad escape
    ],
)
def test_a_malformed_keys_problem_detail_does_not_quote_it(key: str) -> None:
    """The 400 for a malformed key names it by shown_key: a problem detail may reach a log."""
    app = IdempotencyMiddleware(_answer_201, store=MemoryStore(), shared_key_space=True)
    with serve(app) as url:
        answer = httpx.post(url + "/x", headers={"idempotency-key": key}, content=b"{}")
    assert answer.status_code == 400
    detail = answer.json()["detail"]
    assert _HASH[:40] not in detail
    assert "secret" not in detail
    assert "#" in detail  # the redacted form stands in its place


# --- §2: recorded answers have a size cap ----------------------------------------------

_CHUNK = 256 * 1024


def _big_answers(runs: Counter[str]) -> Starlette:
    async def stream(request: Request) -> Response:
        args = await request.json()
        current_claim().begin_mutation()
        runs["stream"] += 1

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(int(args["chunks"])):
                yield b"x" * _CHUNK

        return StreamingResponse(chunks(), media_type="application/octet-stream")

    async def whole(request: Request) -> Response:
        args = await request.json()
        runs["whole"] += 1
        return Response(b"y" * int(args["size"]), media_type="application/octet-stream")

    return Starlette(
        routes=[
            Route("/stream", stream, methods=["POST"]),
            Route("/whole", whole, methods=["POST"]),
        ]
    )


def test_an_answer_over_the_cap_is_delivered_but_never_stored_or_run_again() -> None:
    """Over max_recorded_bytes: the client gets it whole; every resend a 500, no second run."""
    runs: Counter[str] = Counter()
    app = IdempotencyMiddleware(
        _big_answers(runs),
        store=MemoryStore(),
        shared_key_space=True,
        options=ServerOptions(max_recorded_bytes=1 << 20),
    )
    streamed = request_for({"chunks": 8})  # 2 MiB in 256 KiB chunks
    whole = request_for({"size": 3 << 20})  # 3 MiB in one body
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        first = client.post("/stream", headers=streamed[0], content=streamed[1])
        again = client.post("/stream", headers=streamed[0], content=streamed[1])
        one = client.post("/whole", headers=whole[0], content=whole[1])
        one_again = client.post("/whole", headers=whole[0], content=whole[1])
    assert first.status_code == one.status_code == 200
    assert len(first.content) == 8 * _CHUNK
    assert len(one.content) == 3 << 20
    for resent in (again, one_again):
        assert resent.status_code == 500
        assert resent.headers["idempotent-replayed"] == "true"
        assert resent.json()["error"] == "response_too_large"
        assert "max_recorded_bytes" in resent.json()["detail"]
    assert runs == {"stream": 1, "whole": 1}


async def test_a_streamed_answer_over_the_cap_is_never_buffered() -> None:
    """A 24 MiB stream through the middleware raises peak memory by far less than its size."""
    runs: Counter[str] = Counter()
    app = IdempotencyMiddleware(
        _big_answers(runs),
        store=MemoryStore(),
        shared_key_space=True,
        options=ServerOptions(max_recorded_bytes=1 << 20),
    )
    headers, body = request_for({"chunks": 96})
    received = 0
    requests = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if requests:
            return requests.pop()
        await asyncio.Event().wait()  # the client stays: no disconnect
        raise AssertionError("unreachable")

    async def send(message: MutableMapping[str, Any]) -> None:
        nonlocal received
        received += len(message.get("body", b""))

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/stream",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }
    tracemalloc.start()
    try:
        await app(scope, receive, send)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert received == 96 * _CHUNK
    assert peak < 6 << 20, f"peak {peak / (1 << 20):.1f} MiB for a 24 MiB stream"


# --- §2: a blob is written once per claim, an orphan is deleted ---------------------------


async def test_a_request_cancelled_during_its_blob_write_leaves_one_blob(tmp_path: Path) -> None:
    """Cancelled while its blob is written: the settle waits for that write, no second copy."""
    blobs = GatedBlobs(tmp_path)
    store = MemoryStore()

    async def tool(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        current_claim().begin_mutation()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"z" * 200_000})

    app = IdempotencyMiddleware(tool, store=store, shared_key_space=True, blob_store=blobs)
    headers, body = request_for({"n": 1})
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/x",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        pass

    task = asyncio.ensure_future(app(scope, receive, send))
    await asyncio.to_thread(blobs.writing.wait, 10)
    task.cancel()
    await asyncio.sleep(0.05)  # the shielded settle starts and finds the write in flight
    blobs.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert blobs.writes == 1
    [name] = blobs_in(tmp_path)
    raw = await store.get(f"shared:{headers['idempotency-key']}")
    assert raw is not None
    record = decode_record(raw, key="k")
    assert isinstance(record, StoredOutcome)
    assert record.blob_uri is not None
    assert record.blob_uri.endswith(name)


# --- §2: hold_in_flight does not multiply store traffic ----------------------------------


class _Counting(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.claimed = asyncio.Event()

    async def claim(self, key: str, value: bytes, *, ttl_ms: int) -> bytes | None:
        self.calls["claim"] += 1
        self.claimed.set()
        return await super().claim(key, value, ttl_ms=ttl_ms)

    async def get(self, key: str) -> bytes | None:
        self.calls["get"] += 1
        return await super().get(key)


async def _hold_burst(leader_app: Any, held_app: Any, store: _Counting, n: int) -> list[int]:
    """A first request on ``leader_app`` held at a gate for 2 s while ``n`` duplicates
    are held by ``held_app``; their statuses, the first's first."""
    headers, body = request_for({"amount": 5})
    gate = asyncio.Event()

    async def gated(scope: Any, receive: Any, send: Any) -> None:
        await gate.wait()
        await _answer_201(scope, receive, send)

    leader_app.app = gated

    async def post(app: Any) -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            return (await c.post("/x", headers=headers, content=body)).status_code

    leader = asyncio.ensure_future(post(leader_app))
    await store.claimed.wait()
    followers = [asyncio.ensure_future(post(held_app)) for _ in range(n)]
    await asyncio.sleep(2.0)  # all held; at one ask per 0.1 s each they used to ask 20 times
    gate.set()
    return [await leader, *[await f for f in followers]]


@pytest.mark.realtime
async def test_held_duplicates_wait_for_a_notification_not_a_poll_each() -> None:
    """300 held duplicates of one key: about two store calls each, not one per 0.1 s each."""
    store = _Counting()
    app = IdempotencyMiddleware(
        _answer_201, store=store, shared_key_space=True, options=ServerOptions(hold_in_flight=30)
    )
    statuses = await _hold_burst(app, app, store, 300)
    assert statuses == [201] * 301
    total = store.calls["claim"] + store.calls["get"]
    assert total < 2 * 301 + 30, store.calls  # a first ask and an ask after the wake, each


@pytest.mark.realtime
async def test_a_key_held_elsewhere_is_polled_by_one_duplicate() -> None:
    """The first request runs in another process: one duplicate polls, the rest are woken."""
    store = _Counting()
    elsewhere = IdempotencyMiddleware(_answer_201, store=store, shared_key_space=True)
    here = IdempotencyMiddleware(
        _answer_201, store=store, shared_key_space=True, options=ServerOptions(hold_in_flight=30)
    )
    statuses = await _hold_burst(elsewhere, here, store, 200)
    assert statuses == [201] * 201
    total = store.calls["claim"] + store.calls["get"]
    assert total < 2 * 201 + 30, store.calls


async def _answer_201(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 201, "headers": []})
    await send({"type": "http.response.body", "body": b'{"ok":true}'})


# --- §3: a redirect that resends the request is never recorded ----------------------------


@pytest.mark.parametrize("status", [307, 308])
def test_redirects_that_resend_the_request_are_not_storable(status: int) -> None:
    """307 and 308 send the same request elsewhere: not final for the key."""
    assert not is_storable(status)
    assert is_storable(303)


def test_a_trailing_slash_redirect_is_not_recorded_under_the_key() -> None:
    """POST /tools/charge/ → 307; the resend to Location with the same key runs, not 422."""
    runs: list[int] = []

    async def charge(request: Request) -> JSONResponse:
        current_claim().begin_mutation()
        runs.append(1)
        return JSONResponse({"charge": len(runs)}, status_code=201)

    app = Starlette(
        routes=[Route("/tools/charge", charge, methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore(), shared_key_space=True)],
    )
    headers, body = request_for({"amount": 5})
    with serve(app) as url, httpx.Client(base_url=url, follow_redirects=False) as client:
        moved = client.post("/tools/charge/", headers=headers, content=body)
        assert moved.status_code == 307
        location = moved.headers["location"]
        followed = client.post(location, headers=headers, content=body)
        again = client.post(location, headers=headers, content=body)
    assert followed.status_code == 201, followed.text
    assert again.headers["idempotent-replayed"] == "true"
    assert runs == [1]
