"""Edge cases: cancellation settles the claim; a bad or ambiguous principal fails closed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, BaseUser
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentkey import ConfigurationError, StepKey
from agentkey.server import (
    IdempotencyMiddleware,
    MemoryStore,
    ServerOptions,
    Store,
    current_claim,
    starlette_user_identity,
)
from agentkey.server import _lifecycle as lifecycle_module
from agentkey.server._decide import record_key as _record_key
from agentkey.server._records import InProgress, StoredOutcome, decode_record
from tests._loopback import serve
from tests.server._util import request_for

StoreFactory = Callable[[], Store]


@pytest.mark.parametrize(
    ("mutate", "starts"),
    [(True, "on_run"), (False, "on_mark"), (None, "on_run")],
    ids=["after mutation", "before mutation", "may have started"],
)
async def test_cancelled_handler_settles_its_claim(
    make_store: StoreFactory, mutate: bool | None, starts: str
) -> None:
    """Cancelled from outside, a claim records FAILED after its mutation, frees the key
    before it (on_mark), and by default (it may have started) leaves the key in doubt."""
    store = make_store()
    started = anyio.Event()

    async def tool(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        if mutate:
            current_claim().begin_mutation()
        started.set()
        await anyio.sleep_forever()

    app = IdempotencyMiddleware(
        tool,
        store=store,
        principal=lambda scope: "alice",
        options=ServerOptions(mutation_starts=starts),  # type: ignore[arg-type]
    )
    headers, body = request_for({"amount": 1})
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/charge",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await anyio.sleep_forever()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Any) -> None:
        return None

    async with anyio.create_task_group() as tg:
        tg.start_soon(app, scope, receive, send)
        await started.wait()
        tg.cancel_scope.cancel()

    key = StepKey.parse(headers["idempotency-key"])
    raw = await store.get(_record_key("alice", key))
    try:
        if mutate:
            assert raw is not None
            record = decode_record(raw, key="k")
            assert isinstance(record, StoredOutcome)
            assert record.state == "FAILED"
        elif mutate is None:
            assert raw is not None
            doubt = decode_record(raw, key="k")
            assert isinstance(doubt, InProgress)
            assert doubt.phase == "in_doubt"
        else:
            assert raw is None  # released at once, not locked until lock_ttl
    finally:
        await store.aclose()


class _SlowFinish(MemoryStore):
    """A store whose first ``hangs`` writes of an outcome never answer (until cancelled)."""

    def __init__(self, hangs: int) -> None:
        super().__init__()
        self.hangs = hangs
        self.calls = 0
        self.waiting = asyncio.Event()

    async def finish(self, key: str, owner: str, value: bytes, *, ttl_ms: int) -> bool:
        self.calls += 1
        if self.calls <= self.hangs:
            self.waiting.set()
            await asyncio.Event().wait()
        return await super().finish(key, owner, value, ttl_ms=ttl_ms)


class _GatedFinish(MemoryStore):
    """A store whose outcome writes wait until ``gate`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def finish(self, key: str, owner: str, value: bytes, *, ttl_ms: int) -> bool:
        await self.gate.wait()
        return await super().finish(key, owner, value, ttl_ms=ttl_ms)


async def _answer_201(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 201, "headers": []})
    await send({"type": "http.response.body", "body": b'{"ok":true}', "more_body": False})


def _charge(
    store: Store,
    tool: Any = _answer_201,
    principal: Any = lambda scope: "alice",
    on_send: Callable[[Any], None] = lambda message: None,
    *,
    crowded: bool = False,
) -> tuple[Any, StepKey, list[Any]]:
    """A request to the middleware over ``tool`` (not yet awaited), its key, and the
    messages it sends (each also passed to ``on_send``).

    ``crowded``: another request of the same middleware stays in flight (held inside
    the app) while this one runs, so the settle runs beside the app, as under load;
    alone, a request settles inside the app's send.
    """
    entered = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["path"] != "/hold":
            await tool(scope, receive, send)
            return
        entered.set()
        await asyncio.Event().wait()  # until cancelled

    # on_mark: the request held in the app and cancelled there frees its key with no write
    # that the tests counting this store's writes would see.
    middleware = IdempotencyMiddleware(
        app,
        store=store,
        principal=principal,
        options=ServerOptions(mutation_starts="on_mark"),
    )
    headers, body = request_for({"amount": 1})
    request, sent = _exchange(middleware, headers, body, on_send)
    if crowded:
        request = _beside(request, middleware, entered)
    return request, StepKey.parse(headers["idempotency-key"]), sent


async def _beside(request: Any, middleware: Any, entered: asyncio.Event) -> None:
    """Await ``request`` while a second request is held inside the app."""
    headers, body = request_for({"amount": 2})
    held = asyncio.ensure_future(_exchange(middleware, headers, body, path="/hold")[0])
    try:
        await asyncio.wait_for(entered.wait(), 5)
        await request
    finally:
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)


def _exchange(
    app: Any,
    headers: dict[str, str],
    body: bytes,
    on_send: Callable[[Any], None] = lambda message: None,
    *,
    path: str = "/charge",
) -> tuple[Any, list[Any]]:
    """``app`` called with one POST (not yet awaited), and the messages it sends."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)
        on_send(message)

    return app(scope, receive, send), sent


@pytest.mark.parametrize("bad", [b"Bearer s3cret-token", 42])
async def test_bad_principal_fails_closed_without_echoing_it(bad: object) -> None:
    """A principal function returning neither a str nor None fails before the handler, unquoted."""
    runs: list[int] = []

    async def tool(scope: Any, receive: Any, send: Any) -> None:
        runs.append(1)

    request, _, _ = _charge(MemoryStore(), tool, principal=lambda scope: bad)
    with pytest.raises(ConfigurationError, match="principal function") as info:
        await request
    assert "s3cret" not in str(info.value)
    assert runs == []


class _NamedOnly(BaseUser):
    """An authenticated user with a display name but an empty identity (no id on file)."""

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def display_name(self) -> str:
        return self.name

    @property
    def identity(self) -> str:
        return ""


class _TokenAuth(AuthenticationBackend):
    """Authenticates ``Bearer <user>`` as a user with only a display name."""

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, BaseUser] | None:
        token = conn.headers.get("authorization", "").removeprefix("Bearer ")
        return (AuthCredentials(["tools"]), _NamedOnly("John")) if token else None


def test_default_principal_never_scopes_by_display_name() -> None:
    """Two users who share a display name are not one principal: without an identity it fails."""
    store = MemoryStore()
    runs: list[str] = []

    async def charge(request: Request) -> JSONResponse:
        runs.append(request.headers["authorization"])
        return JSONResponse({"charged_for": request.headers["authorization"]}, status_code=201)

    app = Starlette(
        routes=[Route("/charge", charge, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=_TokenAuth()),
            Middleware(IdempotencyMiddleware, store=store, principal=starlette_user_identity),
        ],
    )
    headers, body = request_for({"amount": 1})
    headers["connection"] = "close"  # uvicorn drops a connection whose app raised
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        alice = client.post(
            "/charge", headers={**headers, "authorization": "Bearer alice"}, content=body
        )
        mallory = client.post(
            "/charge", headers={**headers, "authorization": "Bearer mallory"}, content=body
        )
    assert alice.status_code == mallory.status_code == 500  # fails closed, runs nothing
    assert b"alice" not in mallory.content
    assert runs == []


def test_headers_given_as_a_one_shot_iterable_reach_the_client_and_the_replay() -> None:
    """ASGI lets an app send headers as any iterable; a generator is not consumed before sending."""

    async def tool(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        headers = ((name, value) for name, value in [(b"x-charge-id", b"ch_1")])
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    app = IdempotencyMiddleware(tool, store=MemoryStore(), shared_key_space=True)
    headers, body = request_for({"amount": 1})
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        first = client.post("/charge", headers=headers, content=body)
        again = client.post("/charge", headers=headers, content=body)
    assert first.headers.get("x-charge-id") == "ch_1"
    assert again.headers.get("x-charge-id") == "ch_1"
    assert again.headers["idempotent-replayed"] == "true"


_CROWDED = pytest.mark.parametrize(
    "crowded", [False, True], ids=["alone: inside the send", "crowded: beside the app"]
)


@_CROWDED
async def test_a_cancel_during_the_outcome_write_still_records_it(crowded: bool) -> None:
    """A task cancelled while its outcome's write is in flight writes it again, shielded.

    The handler ran: were the outcome left unwritten, the key would free itself after
    the lease and a retry would run the side effect twice. The cancellation still
    propagates, and the answer, held back until it is recorded, is not sent.
    """
    store = _SlowFinish(hangs=1)
    request, key, sent = _charge(store, crowded=crowded)
    task = asyncio.ensure_future(request)
    await store.waiting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert store.calls == 2
    raw = await store.get(_record_key("alice", key))
    assert raw is not None
    record = decode_record(raw, key="k")
    assert isinstance(record, StoredOutcome)
    assert (record.state, record.status) == ("COMPLETED", 201)
    assert sent == []


@pytest.mark.realtime
async def test_the_shielded_settle_of_a_cancelled_request_is_bounded(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A store that never answers cannot hold a cancelled request beyond the settle budget."""
    monkeypatch.setattr(lifecycle_module, "SETTLE_SECONDS", 0.2)
    store = _SlowFinish(hangs=2)
    request, _, _ = _charge(store)
    task = asyncio.ensure_future(request)
    await store.waiting.wait()
    task.cancel()
    with (
        caplog.at_level("ERROR", logger="agentkey.server"),
        anyio.fail_after(5),
        pytest.raises(asyncio.CancelledError),
    ):
        await task
    assert store.calls == 2
    assert any("did not finish within" in r.getMessage() for r in caplog.records)


@_CROWDED
@pytest.mark.parametrize("streamed", [False, True], ids=["one body", "streamed"])
async def test_the_answer_leaves_only_once_its_outcome_is_recorded(
    streamed: bool, crowded: bool
) -> None:
    """Nothing of a one-body answer reaches the client before its record is written.

    A client holding a result the store does not know would retry into a second run
    if the write then failed. A streamed answer goes out as it comes; only its last
    chunk waits for the record.
    """
    store = _GatedFinish()
    release = store.gate

    async def tool(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 201, "headers": []})
        if streamed:
            await send({"type": "http.response.body", "body": b"[1,", "more_body": True})
        await send({"type": "http.response.body", "body": b"2]", "more_body": False})

    request, _, sent = _charge(store, tool, crowded=crowded)
    task = asyncio.ensure_future(request)
    for _ in range(20):
        await asyncio.sleep(0)
    assert [m.get("body") for m in sent] == ([None, b"[1,"] if streamed else [])
    release.set()
    await task
    assert [m.get("body") for m in sent] == ([None, b"[1,", b"2]"] if streamed else [None, b"2]"])
    assert sent[0]["status"] == 201


@_CROWDED
async def test_the_settle_runs_beside_the_app_while_others_are_in_flight(crowded: bool) -> None:
    """With other requests in flight, the settle runs beside the app, not inside its send:
    the app's call stack unwinds while the store answers (so a request waiting on the
    store holds no more than the middleware's own frames, and the garbage collector,
    run by the others' allocations, walks less). Alone, it runs inside the send, which
    saves the answer a few loop iterations. Either way the request ends only once the
    answer is recorded and sent, and nothing is sent before."""
    store = _GatedFinish()
    returned = asyncio.Event()

    async def tool(scope: Any, receive: Any, send: Any) -> None:
        await _answer_201(scope, receive, send)
        returned.set()

    request, key, sent = _charge(store, tool, crowded=crowded)
    task = asyncio.ensure_future(request)
    if crowded:
        await asyncio.wait_for(returned.wait(), 5)
    else:
        for _ in range(20):
            await asyncio.sleep(0)
        assert not returned.is_set()  # its send waits on the store
    assert not task.done()
    assert sent == []  # held until recorded
    store.gate.set()
    await task
    assert returned.is_set()
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    raw = await store.get(_record_key("alice", key))
    assert raw is not None
    assert decode_record(raw, key="k").state == "COMPLETED"  # type: ignore[union-attr]


async def test_a_cancel_pending_when_the_app_finishes_still_records_the_outcome() -> None:
    """The request's cancellation is already pending when the app finishes its answer.

    The settle task must still run: a task cancelled before its first step never runs
    its coroutine, so the outcome of a handler that ran would stay unrecorded and a
    retry after the lease would run the side effect again. (asyncio runs the settle's
    first step before the request sees its cancellation; the middleware does not
    cancel a settle that has not begun either.)
    """
    store = _SlowFinish(hangs=0)

    async def tool(scope: Any, receive: Any, send: Any) -> None:
        await _answer_201(scope, receive, send)
        task = asyncio.current_task()
        assert task is not None
        task.cancel()  # delivered at the request's next wait: the settle has not run yet

    request, key, sent = _charge(store, tool, crowded=True)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.ensure_future(request)
    raw = await store.get(_record_key("alice", key))
    assert raw is not None
    assert decode_record(raw, key="k").state == "COMPLETED"  # type: ignore[union-attr]
    assert [m["type"] for m in sent] in ([], ["http.response.start", "http.response.body"])


@_CROWDED
async def test_a_background_task_does_not_hold_back_the_answer(crowded: bool) -> None:
    """Starlette runs a response's background task after the app's send returns. The
    answer is recorded and delivered while the background task still runs, and the
    request ends when both are done."""
    store = _SlowFinish(hangs=0)
    delivered = asyncio.Event()
    ran: list[str] = []

    async def after() -> None:
        await asyncio.wait_for(delivered.wait(), 5)  # the client has the answer first
        ran.append("background")

    async def charge(request: Request) -> JSONResponse:
        await request.json()
        return JSONResponse({"ok": True}, status_code=201, background=BackgroundTask(after))

    def on_send(message: Any) -> None:
        if message["type"] == "http.response.body":
            delivered.set()

    tool = Starlette(routes=[Route("/charge", charge, methods=["POST"])])
    request, key, sent = _charge(store, tool, on_send=on_send, crowded=crowded)
    await asyncio.wait_for(request, 10)
    assert ran == ["background"]
    assert sent[0]["status"] == 201
    raw = await store.get(_record_key("alice", key))
    assert raw is not None
    assert decode_record(raw, key="k").state == "COMPLETED"  # type: ignore[union-attr]


@_CROWDED
async def test_an_app_failing_after_its_answer_still_records_and_sends_it(crowded: bool) -> None:
    """An error after the final body (a failing background task) reaches the server, but
    only once the answer it follows has been recorded and sent."""
    store = _SlowFinish(hangs=0)

    async def tool(scope: Any, receive: Any, send: Any) -> None:
        await _answer_201(scope, receive, send)
        raise RuntimeError("the background work failed")

    request, key, sent = _charge(store, tool, crowded=crowded)
    with pytest.raises(RuntimeError, match="background work failed"):
        await request
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    raw = await store.get(_record_key("alice", key))
    assert raw is not None
    assert decode_record(raw, key="k").state == "COMPLETED"  # type: ignore[union-attr]


def test_off_asyncio_the_settle_runs_inside_the_apps_send() -> None:
    """On trio (through anyio) no asyncio loop can run the settle beside the app: it runs
    inside the app's send, and a fresh request then its replay behave as on asyncio."""
    pytest.importorskip("trio")
    store = _SlowFinish(hangs=0)  # not a plain MemoryStore, which always settles inline
    app = IdempotencyMiddleware(
        _answer_201,
        store=store,
        principal=lambda scope: "alice",
        options=ServerOptions(auto_renew=False),
    )
    headers, body = request_for({"amount": 1})

    async def main() -> list[list[Any]]:
        answers: list[list[Any]] = []
        for _ in range(2):
            request, sent = _exchange(app, headers, body)
            await request
            answers.append(sent)
        return answers

    first, second = anyio.run(main, backend="trio")
    assert [m["type"] for m in first] == ["http.response.start", "http.response.body"]
    assert first[0]["status"] == second[0]["status"] == 201
    assert (b"idempotent-replayed", b"true") in second[0]["headers"]
    assert (b"idempotent-replayed", b"true") not in first[0]["headers"]
    assert first[1]["body"] == second[1]["body"] == b'{"ok":true}'
