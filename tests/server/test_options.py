"""ServerOptions: one value, validated once, read alike by the HTTP and the MCP middleware.

The agreement table serves the same counting tool twice from one ``ServerOptions``:
behind ``IdempotencyMiddleware`` (Starlette under uvicorn on loopback, called with
httpx) and behind ``IdempotentToolsMiddleware`` (the MCP SDK's streamable HTTP app under
uvicorn, called through the SDK's client). Executions are counted on the server; what
each front end answered is read back in one vocabulary (``ran``, ``replay``, or the
refusal's MCP kind), so a row states one behaviour for both.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, cast

import anyio
import httpx
import pytest
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import RequestParamsMeta
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentkey import ConfigurationError
from agentkey.integrations.mcp import IdempotentToolsMiddleware, connect
from agentkey.integrations.mcp._wire import KEY_FIELD, REPLAYED_FIELD
from agentkey.server import IdempotencyMiddleware, MemoryStore, ServerOptions
from agentkey.server._records import InProgress, StoredOutcome, decode_record
from agentkey.testing import FakeClock
from tests._loopback import serve

pytestmark = pytest.mark.timeout(60)

# --- the validation table -------------------------------------------------------------

BAD: list[tuple[str, object]] = [
    ("require_key", 1),
    ("require_key", "yes"),
    ("key_format", "uuid"),
    ("hash_profile", "json"),
    ("body_fingerprint", "sha256"),
    ("lock_ttl", True),  # a bool is not one second
    ("lock_ttl", 0),
    ("lock_ttl", -1.0),
    ("lock_ttl", math.inf),
    ("lock_ttl", math.nan),
    ("lock_ttl", "15"),
    ("auto_renew", None),
    ("hold_in_flight", -0.5),
    ("hold_in_flight", 61),
    ("hold_in_flight", False),
    ("result_ttl", math.inf),
    ("result_ttl", 1.0),  # shorter than the lease (15 s)
    ("retry_after", 1.5),
    ("retry_after", -1),
    ("retry_after", True),
    ("max_body_bytes", -1),
    ("max_recorded_bytes", 1.5),
    ("max_inline_bytes", None),
    ("replay_header", "Idempotent Replayed"),
    ("mutation_starts", "sometimes"),
    ("reconcile_timeout", 0),
    ("reconcile_timeout", 301),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_a_bad_field_is_refused_by_name(field: str, value: object) -> None:
    """Each bad field (a bool for a number, negative, inf, NaN, wrong type) is a
    ConfigurationError naming ServerOptions.<field>, at construction and in replace()."""
    with pytest.raises(ConfigurationError, match=rf"ServerOptions\.{field}\b"):
        ServerOptions(**cast(dict[str, Any], {field: value}))
    with pytest.raises(ConfigurationError, match=rf"ServerOptions\.{field}\b"):
        ServerOptions().replace(**{field: value})


def test_a_wrong_type_is_named_by_its_type_only() -> None:
    """A str where seconds are expected is shown as its type: it may be a misplaced secret."""
    with pytest.raises(ConfigurationError) as caught:
        ServerOptions(lock_ttl=cast(Any, "hunter2-secret"))
    assert "hunter2" not in str(caught.value)
    assert "a str" in str(caught.value)


def test_the_value_is_frozen_and_replace_validates_and_names_unknown_fields() -> None:
    """Frozen and slotted; replace() derives a variant and refuses an unknown option."""
    options = ServerOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.lock_ttl = 1.0  # type: ignore[misc]
    assert not hasattr(options, "__dict__")
    longer = options.replace(lock_ttl=60, result_ttl=3600)
    assert (longer.lock_ttl_ms, longer.result_ttl_ms) == (60_000, 3_600_000)
    assert options.lock_ttl == 15.0  # the original is unchanged
    with pytest.raises(ConfigurationError, match="lock_tll"):
        options.replace(lock_tll=5)


@pytest.mark.parametrize("front", ["http", "mcp"])
def test_both_middlewares_refuse_options_that_are_not_a_server_options(front: str) -> None:
    """options= takes a ServerOptions only: a dict of keywords is refused, not half read."""
    with pytest.raises(ConfigurationError, match="ServerOptions"):
        _middleware(front, MemoryStore(), cast(Any, {"lock_ttl": 5}))


@pytest.mark.parametrize("front", ["http", "mcp"])
def test_both_middlewares_default_to_the_same_options(front: str) -> None:
    """No options: both middlewares read ServerOptions() (require_key True in both)."""
    middleware = _middleware(front, MemoryStore(), None)
    assert middleware.options == ServerOptions()
    assert middleware.options.require_key is True


@pytest.mark.parametrize("front", ["http", "mcp"])
def test_both_middlewares_stamp_records_on_their_injected_clock(front: str) -> None:
    """clock= is a Clock on both: a claim's record carries the FakeClock's wall time."""
    clock = FakeClock()
    clock.advance(1_000_000.0)
    middleware = _middleware(front, MemoryStore(), None, clock=clock)
    assert middleware._life.now_ms() == int(clock.time() * 1000)


def _middleware(
    front: str, store: MemoryStore, options: ServerOptions | None, **more: Any
) -> IdempotencyMiddleware | IdempotentToolsMiddleware:
    if front == "http":
        return IdempotencyMiddleware(
            Starlette(), store=store, options=options, shared_key_space=True, **more
        )
    return IdempotentToolsMiddleware(store, options=options, shared_key_space=True, **more)


# --- the agreement table: one ServerOptions, two front ends -----------------------------


class _Recording(MemoryStore):
    """A MemoryStore that notes the ttl_ms of every claim and finish it is asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.ttls: list[tuple[str, int]] = []
        self.written: list[bytes] = []  # the records claimed and finished, in order

    async def claim(self, key: str, value: bytes, *, ttl_ms: int) -> bytes | None:
        self.ttls.append(("claim", ttl_ms))
        self.written.append(value)
        return await super().claim(key, value, ttl_ms=ttl_ms)

    async def finish(self, key: str, owner: str, value: bytes, *, ttl_ms: int) -> bool:
        self.ttls.append(("finish", ttl_ms))
        self.written.append(value)
        return await super().finish(key, owner, value, ttl_ms=ttl_ms)


@dataclass
class _Front:
    """One front end on loopback: ``call(key)`` answers ``ran``, ``replay`` or a refusal kind
    (with its retry-after, when it gives one); ``runs`` counts the tool's executions."""

    call: Callable[[str | None], Awaitable[tuple[str, float | None]]]
    runs: Counter[str]
    middleware: IdempotencyMiddleware | IdempotentToolsMiddleware
    gate: threading.Event  # the tool waits on it when ``hold`` is set
    entered: threading.Event  # set once the tool runs
    hold: bool = False


_HTTP_KINDS = {"idempotency_key_missing": "key-required", "in_progress": "in-progress"}


@asynccontextmanager
async def _http(
    options: ServerOptions, store: MemoryStore, clock: FakeClock | None = None
) -> AsyncIterator[_Front]:
    runs: Counter[str] = Counter()
    gate, entered = threading.Event(), threading.Event()
    front: _Front

    async def charge(request: Request) -> JSONResponse:
        await request.json()
        runs["charge"] += 1
        entered.set()
        if front.hold:
            await anyio.to_thread.run_sync(gate.wait, 30)
        return JSONResponse({"run": runs["charge"]}, status_code=201)

    middleware = IdempotencyMiddleware(
        Starlette(routes=[Route("/tools/charge", charge, methods=["POST"])]),
        store=store,
        options=options,
        shared_key_space=True,
        clock=clock,
    )
    async with AsyncExitStack() as stack:
        url = stack.enter_context(serve(middleware))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=30))

        async def call(key: str | None) -> tuple[str, float | None]:
            headers = {} if key is None else {"Idempotency-Key": key}
            answer = await client.post("/tools/charge", json={"amount": 5}, headers=headers)
            if answer.status_code == 201:
                replayed = answer.headers.get("idempotent-replayed") == "true"
                return ("replay" if replayed else "ran"), None
            retry_after = answer.headers.get("retry-after")
            kind = _HTTP_KINDS.get(answer.json()["error"], answer.json()["error"])
            return kind, None if retry_after is None else float(retry_after)

        front = _Front(call, runs, middleware, gate, entered)
        yield front


@asynccontextmanager
async def _mcp(
    options: ServerOptions, store: MemoryStore, clock: FakeClock | None = None
) -> AsyncIterator[_Front]:
    runs: Counter[str] = Counter()
    gate, entered = threading.Event(), threading.Event()
    middleware = IdempotentToolsMiddleware(
        store, options=options, shared_key_space=True, clock=clock
    )
    server: MCPServer[Any] = MCPServer("options-test", middleware=[middleware])
    front: _Front

    @server.tool()
    async def charge(amount: int) -> str:
        """Charges once per key."""
        runs["charge"] += 1
        entered.set()
        if front.hold:
            await anyio.to_thread.run_sync(gate.wait, 30)
        return f"run {runs['charge']}"

    async with AsyncExitStack() as stack:
        url = stack.enter_context(serve(server.streamable_http_app(), lifespan="on"))
        session = await stack.enter_async_context(connect(url + "/mcp"))

        async def call(key: str | None) -> tuple[str, float | None]:
            meta = None if key is None else cast(RequestParamsMeta, {KEY_FIELD: key})
            try:
                result = await session.call_tool("charge", {"amount": 5}, meta=meta)
            except MCPError as exc:
                data = exc.error.data
                assert isinstance(data, dict)
                kind = str(data["type"]).removeprefix("io.agentkey/")
                return kind, data.get("retryAfter")
            assert not result.is_error, result
            replayed = bool((result.meta or {}).get(REPLAYED_FIELD))
            return ("replay" if replayed else "ran"), None

        front = _Front(call, runs, middleware, gate, entered)
        yield front


FRONTS = {"http": _http, "mcp": _mcp}


def _key() -> str:
    return f"ik_{uuid.uuid4().hex}"


@pytest.mark.parametrize("front", ["http", "mcp"])
async def test_a_keyless_call_is_refused_by_default_and_runs_nothing(front: str) -> None:
    """ServerOptions() (require_key=True): a keyless call is refused as key-required and the
    tool never runs, in both front ends (the MCP middleware ran it on the old code)."""
    async with FRONTS[front](ServerOptions(), MemoryStore()) as tool:
        assert await tool.call(None) == ("key-required", None)
        assert await tool.call(None) == ("key-required", None)
    assert tool.runs["charge"] == 0


@pytest.mark.parametrize("front", ["http", "mcp"])
async def test_require_key_false_lets_keyless_calls_run_unprotected(front: str) -> None:
    """require_key=False, one value for both: each keyless call runs (twice is twice), and a
    keyed call still runs once and is replayed after."""
    options = ServerOptions(require_key=False)
    async with FRONTS[front](options, MemoryStore()) as tool:
        assert [await tool.call(None) for _ in range(2)] == [("ran", None)] * 2
        key = _key()
        assert [await tool.call(key) for _ in range(2)] == [("ran", None), ("replay", None)]
    assert tool.runs["charge"] == 3


@pytest.mark.parametrize("front", ["http", "mcp"])
async def test_the_lease_and_the_record_ttl_reach_the_store(front: str) -> None:
    """lock_ttl and result_ttl from one value: both front ends claim for the lease
    (on_mark: nothing has started yet) and record the result for result_ttl."""
    options = ServerOptions(lock_ttl=7, result_ttl=3600, mutation_starts="on_mark")
    store = _Recording()
    async with FRONTS[front](options, store) as tool:
        key = _key()
        assert [await tool.call(key) for _ in range(2)] == [("ran", None), ("replay", None)]
    assert tool.runs["charge"] == 1
    assert store.ttls[:2] == [("claim", 7_000), ("finish", 3_600_000)]


@pytest.mark.parametrize("front", ["http", "mcp"])
@pytest.mark.parametrize("hold", [0.0, 30.0])
async def test_a_duplicate_in_flight_is_refused_or_held_alike(front: str, hold: float) -> None:
    """A duplicate of a call in flight: hold_in_flight=0 refuses it as in-progress with the
    options' retry_after; hold_in_flight=30 holds it and it gets the replay. One run either
    way (the MCP middleware never held a duplicate on the old code)."""
    options = ServerOptions(hold_in_flight=hold, retry_after=7)
    async with FRONTS[front](options, MemoryStore()) as tool:
        tool.hold = True
        key = _key()
        async with anyio.create_task_group() as tg:
            answers: list[tuple[str, float | None]] = []

            async def first() -> None:
                answers.append(await tool.call(key))

            tg.start_soon(first)
            assert await anyio.to_thread.run_sync(tool.entered.wait, 30)
            if hold:
                duplicate: list[tuple[str, float | None]] = []

                async def second() -> None:
                    duplicate.append(await tool.call(key))

                tg.start_soon(second)
                life = tool.middleware._life
                while life._holding == 0:  # noqa: ASYNC110 - a count on the server's thread
                    await anyio.sleep(0.01)  # the duplicate is not held yet
                tool.gate.set()
            else:
                duplicate = [await tool.call(key)]
                tool.gate.set()
    assert answers == [("ran", None)]
    assert duplicate == ([("replay", None)] if hold else [("in-progress", 7.0)])
    assert tool.runs["charge"] == 1


@pytest.mark.parametrize("front", ["http", "mcp"])
async def test_records_are_stamped_on_the_middlewares_clock(front: str) -> None:
    """clock= (a Clock) reaches the records: the claim and the result carry the FakeClock's
    wall time, in both front ends (the HTTP middleware took no clock on the old code)."""
    clock = FakeClock(wall=1_800_000_000.0)
    store = _Recording()
    async with FRONTS[front](ServerOptions(auto_renew=False), store, clock) as tool:
        assert await tool.call(_key()) == ("ran", None)
    claimed, finished = (decode_record(value, key="k") for value in store.written[:2])
    assert isinstance(claimed, InProgress)
    assert isinstance(finished, StoredOutcome)
    assert claimed.started_ms == finished.finished_ms == 1_800_000_000_000


async def test_methods_given_as_a_generator_are_all_protected() -> None:
    """methods=(a generator): checking it no longer uses it up, so POST stays protected (on
    the old code the check consumed it, nothing was protected, and a keyless POST ran)."""
    runs: Counter[str] = Counter()

    async def charge(request: Request) -> JSONResponse:
        runs["charge"] += 1
        return JSONResponse({"run": runs["charge"]}, status_code=201)

    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/charge", charge, methods=["POST"])]),
        store=MemoryStore(),
        shared_key_space=True,
        methods=(method for method in ["POST"]),
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        answer = await client.post("/charge", json={"amount": 5})
    assert answer.status_code == 400
    assert runs["charge"] == 0


def test_an_empty_methods_is_refused() -> None:
    """methods=[] would protect nothing, silently: a ConfigurationError instead."""
    with pytest.raises(ConfigurationError, match="methods"):
        IdempotencyMiddleware(Starlette(), store=MemoryStore(), shared_key_space=True, methods=[])
