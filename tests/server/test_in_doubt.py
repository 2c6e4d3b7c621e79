"""A started side effect is never forgotten: the in-doubt state, on real loopback servers.

Every test runs a real uvicorn server with the HTTP middleware and counts executions on
the server; the store is real (memory, Redis, PostgreSQL through ``make_store``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentkey import StepKey, StoreUnavailable
from agentkey.server import (
    IdempotencyMiddleware,
    MemoryStore,
    ReconcileContext,
    Reconciled,
    ServerOptions,
    Store,
    current_claim,
)
from agentkey.server._decide import Checked, check_body, record_key
from agentkey.server._records import (
    Binding,
    InProgress,
    decode_record,
    encode_in_progress,
)
from agentkey.server._stores import owner_prefix
from tests.server._util import request_for, serve_closing, with_options

StoreFactory = Callable[[], Store]
OWNER = "ab" * 16


def charging_app(store: Store, **options: Any) -> Starlette:
    """``/charge``: charges (counted), then answers as ``args["answer"]`` says: 201, 500,
    ``raise``, ``raise_before`` (fails before charging, saying nothing started), or ``mark``
    (awaits begin_mutation, then charges and answers 500)."""
    charges: Counter[str] = Counter()
    attempts: Counter[str] = Counter()

    async def charge(request: Request) -> Response:
        args = await request.json()
        answer = args.get("answer", "201")
        attempts["charge"] += 1
        if answer == "raise_before":
            current_claim().nothing_started()
            raise RuntimeError("the card was refused before anything was charged")
        if answer == "fail_before_mark":
            raise RuntimeError("validation failed before begin_mutation")
        if answer.startswith("mark"):
            await current_claim().begin_mutation()
        charges["charge"] += 1
        if answer in ("raise", "mark_raise"):
            raise RuntimeError("the ledger write failed after the charge")
        if answer in ("500", "mark"):
            if args.get("once") and attempts["charge"] > 1:
                return JSONResponse({"charged": charges["charge"]}, 201)
            return JSONResponse({"error": "downstream timeout"}, 500)
        return JSONResponse({"charged": charges["charge"]}, 201)

    app = Starlette(
        routes=[Route("/charge", charge, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                routes=["/charge"],
                shared_key_space=True,
                **with_options(options),
            )
        ],
    )
    app.state.charges = charges
    app.state.attempts = attempts
    return app


def _post(client: httpx.Client, headers: dict[str, str], body: bytes) -> httpx.Response:
    # uvicorn drops a connection whose app raised: each request on a connection of its own
    return client.post("/charge", headers={**headers, "connection": "close"}, content=body)


def _assert_in_doubt(answer: httpx.Response) -> None:
    assert answer.status_code == 409, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert "retry-after" not in answer.headers
    assert answer.headers["idempotency-protected"] == "true"
    doc = answer.json()
    assert doc["type"] == "urn:agentkey:problem:in_doubt"
    assert "may have started" in doc["detail"]
    assert "agentkey server settle" in doc["detail"]


@pytest.mark.parametrize("answer", ["500", "raise"])
def test_a_charge_then_500_runs_once_and_every_retry_gets_in_doubt(
    make_store: StoreFactory, answer: str
) -> None:
    """A handler that charges then answers 500 (or raises), without begin_mutation: one
    charge, and each of three retries gets 409 in_doubt (2-3 charges on the old code)."""
    store = make_store()
    app = charging_app(store)
    headers, body = request_for({"amount": 5, "answer": answer})
    with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
        first = _post(client, headers, body)
        retries = [_post(client, headers, body) for _ in range(3)]
    assert first.status_code == 500
    for retry in retries:
        _assert_in_doubt(retry)
    assert app.state.charges["charge"] == 1


def test_a_500_once_then_success_still_runs_once(make_store: StoreFactory) -> None:
    """The handler would answer 201 the second time: the retry never reaches it (1 charge;
    2 on the old code, the retry ran and charged again)."""
    store = make_store()
    app = charging_app(store)
    headers, body = request_for({"amount": 5, "answer": "500", "once": True})
    with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
        assert _post(client, headers, body).status_code == 500
        _assert_in_doubt(_post(client, headers, body))
    assert app.state.attempts["charge"] == 1
    assert app.state.charges["charge"] == 1


def test_a_handler_that_says_nothing_started_is_released_and_retried(
    make_store: StoreFactory,
) -> None:
    """claim.nothing_started() then a failure frees the key: the retry runs the handler."""
    store = make_store()
    app = charging_app(store)
    headers, body = request_for({"amount": 5, "answer": "raise_before"})
    with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
        assert _post(client, headers, body).status_code == 500
        assert _post(client, headers, body).status_code == 500
    assert app.state.attempts["charge"] == 2
    assert app.state.charges["charge"] == 0


def test_on_mark_a_failure_before_the_mark_is_released(make_store: StoreFactory) -> None:
    """mutation_starts="on_mark": a failure before begin_mutation frees the key (retried)."""
    store = make_store()
    app = charging_app(store, mutation_starts="on_mark")
    headers, body = request_for({"amount": 5, "answer": "fail_before_mark"})
    with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
        assert _post(client, headers, body).status_code == 500
        assert _post(client, headers, body).status_code == 500
    assert app.state.attempts["charge"] == 2


def test_on_mark_after_the_mark_a_500_is_failed_and_replayed(make_store: StoreFactory) -> None:
    """mutation_starts="on_mark": after await begin_mutation() a 500 is FAILED, replayed."""
    store = make_store()
    app = charging_app(store, mutation_starts="on_mark")
    headers, body = request_for({"amount": 5, "answer": "mark"})
    with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
        assert _post(client, headers, body).status_code == 500
        again = _post(client, headers, body)
    assert again.status_code == 500
    assert again.headers["idempotent-replayed"] == "true"
    assert app.state.charges["charge"] == 1


async def _plant(
    store: Store, key: str, body: bytes, *, phase: str, lease_end_ms: int, ttl_ms: int
) -> None:
    """Write the record a claimed request leaves behind when its process dies."""
    step = StepKey.parse(key)
    checked = check_body(step, ("POST", "/charge"), body)
    assert isinstance(checked, Checked)
    value = encode_in_progress(
        OWNER,
        lease_end_ms - 15_000,
        lease_end_ms=lease_end_ms,
        renew_ms=5_000,
        binding=checked.binding,
        phase=phase,  # type: ignore[arg-type]
        operation="POST /charge",
    )
    assert await store.claim(record_key("shared", step), value, ttl_ms=ttl_ms) is None


@pytest.mark.parametrize(
    ("phase", "lease_left_ms", "expect"),
    [
        ("started", -1, "in_doubt"),  # started, its lease lapsed: its process died
        ("started", 60_000, "in_progress"),  # started, its lease still runs: 409 in_progress
        ("in_doubt", 60_000, "in_doubt"),  # marked in doubt
    ],
)
def test_a_record_left_by_a_dead_process_answers_by_its_phase(
    make_store: StoreFactory, phase: str, lease_left_ms: int, expect: str
) -> None:
    """A started record whose lease lapsed is in doubt, never free (the old code ran it:
    its records lapsed with the lease); one still leased is in progress."""
    store = make_store()
    app = charging_app(store)
    headers, body = request_for({"amount": 5})
    key = headers["idempotency-key"]
    now = int(time.time() * 1000)
    with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
        # Planted through the server's own loop (a store belongs to the loop it runs on).
        asyncio.run(_plant_with(store, key, body, phase, now + lease_left_ms))
        answer = _post(client, headers, body)
    if expect == "in_doubt":
        _assert_in_doubt(answer)
    else:
        assert answer.status_code == 409
        assert answer.json()["type"] == "urn:agentkey:problem:in_progress"
    assert app.state.attempts["charge"] == 0


async def _plant_with(store: Store, key: str, body: bytes, phase: str, lease_end_ms: int) -> None:
    # A separate store object on the same backend, in this thread's own loop.
    fresh = _twin(store)
    try:
        await _plant(fresh, key, body, phase=phase, lease_end_ms=lease_end_ms, ttl_ms=3_600_000)
    finally:
        if fresh is not store:
            await fresh.aclose()


def _twin(store: Store) -> Store:
    """Another store object on ``store``'s backend (a MemoryStore is shared as it is)."""
    if isinstance(store, MemoryStore):
        return store
    from agentkey.server import PostgresStore, RedisStore

    if isinstance(store, RedisStore) and store._url is None:  # the long suite's cluster
        from redis.asyncio.cluster import RedisCluster

        from tests.server.conftest import ClusterStore

        nodes = store._client.nodes_manager.startup_nodes
        node = next(iter(nodes.values()))
        return ClusterStore(RedisCluster(host=node.host, port=node.port), prefix=store.prefix)
    if isinstance(store, RedisStore):
        return RedisStore(store._url or "", prefix=store.prefix)
    if isinstance(store, PostgresStore):
        return PostgresStore(str(store._pool.conninfo), table=store.table)
    return store  # pragma: no cover


# --- reconcile -----------------------------------------------------------------------


def _reconciling_app(store: Store, verdict: Callable[[ReconcileContext], Any]) -> Starlette:
    asked: list[ReconcileContext] = []

    async def hook(context: ReconcileContext) -> Reconciled:
        asked.append(context)
        result = verdict(context)
        if asyncio.iscoroutine(result):
            result = await result
        assert isinstance(result, Reconciled) or result is None
        return result  # type: ignore[return-value]

    app = charging_app(store, reconcile=hook, reconcile_timeout=0.5)
    app.state.asked = asked
    return app


def test_reconcile_ran_records_its_answer_and_replays_it(make_store: StoreFactory) -> None:
    """The hook says it ran: its answer is recorded and replayed to this and later requests."""
    store = make_store()
    app = _reconciling_app(
        store, lambda ctx: Reconciled.ran({"charged": "from-ledger"}, status=201)
    )
    headers, body = request_for({"amount": 5, "answer": "500"})
    with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
        assert _post(client, headers, body).status_code == 500
        second = _post(client, headers, body)
        third = _post(client, headers, body)
    for answer in (second, third):
        assert answer.status_code == 201
        assert answer.json() == {"charged": "from-ledger"}
        assert answer.headers["idempotent-replayed"] == "true"
    assert len(app.state.asked) == 1  # the third request met the recorded answer
    context = app.state.asked[0]
    assert (context.method, context.route) == ("POST", "/charge")
    assert json.loads(context.body)["amount"] == 5
    assert context.idempotency_key == headers["idempotency-key"]
    assert app.state.charges["charge"] == 1


def test_reconcile_not_run_runs_the_step_under_a_fresh_claim(make_store: StoreFactory) -> None:
    """The hook says it did not run: the request that asked runs it, once."""
    store = make_store()
    app = _reconciling_app(store, lambda ctx: Reconciled.not_run())
    headers, body = request_for({"amount": 5, "answer": "500", "once": True})
    with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
        assert _post(client, headers, body).status_code == 500
        second = _post(client, headers, body)
        third = _post(client, headers, body)
    assert second.status_code == 201
    assert "idempotent-replayed" not in second.headers
    assert third.status_code == 201
    assert third.headers["idempotent-replayed"] == "true"
    assert app.state.attempts["charge"] == 2


async def _never(context: ReconcileContext) -> Reconciled:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def _boom(context: ReconcileContext) -> Reconciled:
    raise RuntimeError("the ledger is down")


@pytest.mark.parametrize(
    "verdict",
    [lambda ctx: Reconciled.in_doubt(), _boom, _never, lambda ctx: "ran"],
    ids=["in doubt", "raises", "times out", "not a Reconciled"],
)
def test_reconcile_in_doubt_or_broken_keeps_the_key_in_doubt(
    verdict: Callable[[ReconcileContext], Any],
) -> None:
    """Still unknown, a hook that raises, hangs past its timeout or answers nonsense: the
    request gets in_doubt, never a crash and never a run."""
    store = MemoryStore()
    app = _reconciling_app(store, verdict)
    headers, body = request_for({"amount": 5, "answer": "500"})
    with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
        assert _post(client, headers, body).status_code == 500
        _assert_in_doubt(_post(client, headers, body))
    assert app.state.charges["charge"] == 1


# --- refused before anything ran: 503 not_run -------------------------------------------


class _DownStore(MemoryStore):
    async def claim(self, key: str, value: bytes, *, ttl_ms: int) -> bytes | None:
        raise StoreUnavailable("the store is down (test)")


def test_a_claim_the_store_refused_is_503_not_run() -> None:
    """Refused before the handler ran: 503 with Retry-After and code not_run (was
    store_unavailable, which now means only "the stored answer cannot be read")."""
    store = _DownStore()
    app = charging_app(store)
    headers, body = request_for({"amount": 5})
    with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
        answer = _post(client, headers, body)
    assert answer.status_code == 503
    assert answer.headers["retry-after"] == "1"
    assert answer.json()["type"] == "urn:agentkey:problem:not_run"
    assert answer.headers["idempotency-protected"] == "true"  # a client believes it only so
    assert app.state.attempts["charge"] == 0


# --- records ------------------------------------------------------------------------


def test_the_claim_carries_may_have_started_in_its_one_write(make_store: StoreFactory) -> None:
    """By default the claim's own record says "may have started" and lives as long as a
    result: no extra write, and a lapsed lease is remembered."""
    store = make_store()
    seen: list[bytes | None] = []

    async def peek(request: Request) -> Response:
        claim = current_claim()
        seen.append(await store.get(claim.record_key))
        return JSONResponse({}, 201)

    app = Starlette(
        routes=[Route("/charge", peek, methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, store=store, shared_key_space=True)],
    )
    headers, body = request_for({"amount": 1})
    with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
        assert _post(client, headers, body).status_code == 201
    assert seen[0] is not None
    record = decode_record(seen[0], key="k")
    assert isinstance(record, InProgress)
    assert record.phase == "started"
    assert record.operation == "POST /charge"


def test_an_in_doubt_record_round_trips_and_is_fenced_by_its_owner() -> None:
    """The in-doubt record keeps the owner prefix, so settling it is a compare-and-set."""
    binding = Binding("A" * 22)
    value = encode_in_progress(
        OWNER, 1, lease_end_ms=2, binding=binding, phase="in_doubt", operation="POST /a:b"
    )
    assert value.startswith(owner_prefix(OWNER))
    record = decode_record(value + b"", key="k")
    assert isinstance(record, InProgress)
    assert record.phase == "in_doubt"
    assert record.operation == "POST /a:b"
    assert record.in_doubt(0)


def test_a_held_duplicate_of_a_request_that_fails_after_it_started_gets_in_doubt() -> None:
    """hold_in_flight: a duplicate held while the first request charges and answers 500 is
    woken with in_doubt, never run (the old code released the key and ran it again)."""
    import concurrent.futures
    import threading

    import anyio.to_thread

    charges: Counter[str] = Counter()
    entered, gate = threading.Event(), threading.Event()

    async def charge(request: Request) -> Response:
        await request.json()
        charges["charge"] += 1
        entered.set()
        await anyio.to_thread.run_sync(gate.wait, 30)
        return JSONResponse({"error": "downstream timeout"}, 500)

    store = MemoryStore()
    middleware = IdempotencyMiddleware(
        Starlette(routes=[Route("/charge", charge, methods=["POST"])]),
        store=store,
        shared_key_space=True,
        options=ServerOptions(hold_in_flight=30),
    )
    headers, body = request_for({"amount": 5})
    with (
        serve_closing(middleware, store) as url,
        httpx.Client(base_url=url, timeout=60) as client,
        concurrent.futures.ThreadPoolExecutor(2) as pool,
    ):
        first = pool.submit(_post, client, headers, body)
        assert entered.wait(30)
        second = pool.submit(_post, client, headers, body)
        deadline = time.monotonic() + 30
        while middleware._life._holding == 0:  # the duplicate is held
            assert time.monotonic() < deadline
            time.sleep(0.01)
        gate.set()
        assert first.result(30).status_code == 500
        _assert_in_doubt(second.result(30))
    assert charges["charge"] == 1


def test_a_plain_function_is_a_reconcile_hook_too() -> None:
    """A sync reconcile hook is called as it is (the convention of principal=)."""
    store = MemoryStore()
    app = charging_app(store, reconcile=lambda context: Reconciled.not_run())
    headers, body = request_for({"amount": 5, "answer": "500", "once": True})
    with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
        assert _post(client, headers, body).status_code == 500
        assert _post(client, headers, body).status_code == 201
    assert app.state.charges["charge"] == 2  # settled "not run" by the hook: it ran now


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mutation_starts": "sometimes"}, "mutation_starts"),
        ({"reconcile": "yes"}, "reconcile"),
        ({"reconcile_timeout": 0}, "reconcile_timeout"),
    ],
)
def test_bad_options_are_refused_at_construction(options: dict[str, Any], message: str) -> None:
    """A misspelt mode, a hook that is not callable, a timeout of 0: ConfigurationError."""
    from agentkey import ConfigurationError

    with pytest.raises(ConfigurationError, match=message):
        IdempotencyMiddleware(
            Starlette(), store=MemoryStore(), shared_key_space=True, **with_options(options)
        )
