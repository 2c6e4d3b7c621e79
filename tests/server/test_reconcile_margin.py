"""The reconcile hook on real loopback servers: a "not run" never runs a step beside a
handler that may still be alive, the hook finds the downstream call by ``key_for``, a
plain-function hook runs off the event loop, and a "ran" answer is checked and bounded.

Every test runs a real uvicorn server with the HTTP middleware and counts executions on
the server. Time on the server is an injected clock the test moves by hand.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import Counter
from typing import Any

import anyio.to_thread
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentkey import ConfigurationError
from agentkey.server import (
    FileBlobStore,
    IdempotencyMiddleware,
    MemoryStore,
    ReconcileContext,
    Reconciled,
    current_claim,
)
from agentkey.testing import FakeClock
from tests.server._util import request_for, serve_closing, with_options


def _post(client: httpx.Client, headers: dict[str, str], body: bytes) -> httpx.Response:
    return client.post("/charge", headers={**headers, "connection": "close"}, content=body)


def _server(
    hook: Any, *, gate: threading.Event | None = None, **options: Any
) -> tuple[IdempotencyMiddleware, Counter[str], list[str], FakeClock]:
    """``/charge`` behind the middleware on an injected clock; the first run waits for
    ``gate`` (a provider call in flight) before it charges; ``seen`` gets the handler's
    ``claim.key_for("payments")``."""
    charges: Counter[str] = Counter()
    seen: list[str] = []
    entered = threading.Event()
    loop: list[int] = []

    async def charge(request: Request) -> Response:
        args = await request.json()
        loop.append(threading.get_ident())  # the event loop's thread
        seen.append(current_claim().key_for("payments"))
        charges["runs"] += 1
        if gate is not None and charges["runs"] == 1:
            entered.set()
            await anyio.to_thread.run_sync(gate.wait, 30)
        charges["charge"] += 1
        if args.get("answer") == "500":
            return JSONResponse({"error": "downstream timeout"}, 500)
        return JSONResponse({"charged": charges["charge"]}, 201)

    clock = FakeClock(wall=1_900_000_000.0)  # the server's clock, moved by the test
    store = MemoryStore(clock=clock)
    middleware = IdempotencyMiddleware(
        Starlette(routes=[Route("/charge", charge, methods=["POST"])]),
        store=store,
        shared_key_space=True,
        reconcile=hook,
        clock=clock,
        **with_options(options),
    )
    middleware.state = {"entered": entered, "store": store, "loop": loop}  # type: ignore[attr-defined]
    return middleware, charges, seen, clock


def test_not_run_for_a_lapsed_lease_waits_until_its_handler_can_no_longer_run() -> None:
    """The review's F1 race: the lease of a live handler lapsed (renewals off, as when the
    store is down); a hook that finds nothing at the provider yet answers not_run. The
    step is not run beside it (the old code ran it: 2 charges); it stays in doubt."""
    asked: list[ReconcileContext] = []

    def hook(context: ReconcileContext) -> Reconciled:
        asked.append(context)
        return Reconciled.not_run()  # nothing at the provider yet: the charge is in flight

    gate = threading.Event()
    middleware, charges, _, clock = _server(hook, gate=gate, lock_ttl=1, auto_renew=False)
    headers, body = request_for({"amount": 5})
    with (
        serve_closing(middleware, middleware.state["store"]) as url,  # type: ignore[attr-defined]
        httpx.Client(base_url=url, timeout=60) as client,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        try:
            first = pool.submit(_post, client, headers, body)
            assert middleware.state["entered"].wait(30)  # type: ignore[attr-defined]
            clock.advance(1.5)  # the lease (1 s) lapsed 0.5 s ago; its handler still runs
            second = _post(client, headers, body)
        finally:
            gate.set()
        assert first.result(30).status_code == 201
        assert second.status_code == 409, second.text
        assert second.json()["type"] == "urn:agentkey:problem:in_doubt"
        third = _post(client, headers, body)  # the first handler's answer is recorded
    assert charges["charge"] == 1
    assert third.status_code == 201
    assert third.headers["idempotent-replayed"] == "true"
    assert asked[0].why == "lease lapsed"
    assert asked[0].doubt_for_ms == 500


def test_not_run_for_a_lapsed_lease_runs_once_its_handler_cannot_be_running() -> None:
    """One lock_ttl after the lease lapsed, a not_run is believed (the step runs now), and
    the hook is told the key is in doubt because its lease lapsed, and since when."""
    asked: list[ReconcileContext] = []

    def hook(context: ReconcileContext) -> Reconciled:
        asked.append(context)
        return Reconciled.not_run()

    gate = threading.Event()
    middleware, charges, _, clock = _server(hook, gate=gate, lock_ttl=1, auto_renew=False)
    headers, body = request_for({"amount": 5})
    with (
        serve_closing(middleware, middleware.state["store"]) as url,  # type: ignore[attr-defined]
        httpx.Client(base_url=url, timeout=60) as client,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        try:
            first = pool.submit(_post, client, headers, body)
            assert middleware.state["entered"].wait(30)  # type: ignore[attr-defined]
            clock.advance(2.001)  # lease end (1 s) + one lock_ttl (1 s) has passed
            second = _post(client, headers, body)
        finally:
            gate.set()
        first.result(30)
    assert second.status_code == 201, second.text
    assert charges["runs"] == 2
    assert (asked[0].why, asked[0].doubt_for_ms) == ("lease lapsed", 1_001)


def test_a_key_its_handler_put_in_doubt_is_run_at_once_on_not_run() -> None:
    """A 500 after the start (the handler is done) is "failed after start": not_run runs
    the step at once, and the hook looks it up by the handler's own key_for()."""
    asked: list[ReconcileContext] = []

    def hook(context: ReconcileContext) -> Reconciled:
        asked.append(context)
        return Reconciled.not_run()

    middleware, charges, seen, clock = _server(hook)
    headers, body = request_for({"amount": 5, "answer": "500"})
    with (
        serve_closing(middleware, middleware.state["store"]) as url,  # type: ignore[attr-defined]
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        assert _post(client, headers, body).status_code == 500
        clock.advance(7)
        assert _post(client, headers, body).status_code == 500  # it ran again, at once
    assert charges["runs"] == 2
    context = asked[0]
    assert (context.why, context.doubt_for_ms) == ("failed after start", 7000)
    assert context.key_for("payments") == seen[0] == seen[1]
    assert context.key_for("payments") != context.idempotency_key
    assert "why='failed after start'" in repr(context)


def test_a_plain_function_hook_runs_off_the_event_loop_and_is_bounded() -> None:
    """A blocking plain-function hook is cut at reconcile_timeout (the key stays in doubt)
    and does not stall the worker: the old code ran it on the event loop, unbounded."""
    release = threading.Event()
    threads: list[int] = []

    def hook(context: ReconcileContext) -> Reconciled:
        threads.append(threading.get_ident())
        release.wait(20)  # a blocking call to a slow provider
        return Reconciled.not_run()

    middleware, charges, _, _ = _server(hook, reconcile_timeout=0.2)
    headers, body = request_for({"amount": 5, "answer": "500"})
    try:
        with (
            serve_closing(middleware, middleware.state["store"]) as url,  # type: ignore[attr-defined]
            httpx.Client(base_url=url, timeout=60) as client,
        ):
            assert _post(client, headers, body).status_code == 500
            second = _post(client, headers, body)
    finally:
        release.set()
    assert second.status_code == 409, second.text
    assert second.json()["type"] == "urn:agentkey:problem:in_doubt"
    assert charges["runs"] == 1
    assert len(threads) == 1
    assert threads[0] != middleware.state["loop"][0]  # type: ignore[attr-defined]


def test_a_ran_answer_over_max_recorded_bytes_is_not_stored_inline() -> None:
    """A hook's "ran" answer goes through the handler's size limit: a body over
    max_recorded_bytes is recorded as the small response_too_large failure (the old code
    stored any size inline)."""
    big = {"charges": ["x" * 100] * 100}  # ~10 kB
    middleware, charges, _, _ = _server(
        lambda context: Reconciled.ran(big, status=201), max_recorded_bytes=2_000
    )
    headers, body = request_for({"amount": 5, "answer": "500"})
    with (
        serve_closing(middleware, middleware.state["store"]) as url,  # type: ignore[attr-defined]
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        assert _post(client, headers, body).status_code == 500
        second = _post(client, headers, body)
    assert second.status_code == 500
    assert "max_recorded_bytes" in second.text
    assert charges["runs"] == 1


def test_a_large_ran_answer_goes_to_the_blob_store(tmp_path: Any) -> None:
    """A "ran" answer over max_inline_bytes is offloaded like a handler's and replayed whole."""
    big = {"charges": ["x" * 100] * 100}
    blobs = FileBlobStore(tmp_path, ttl=86_400)
    middleware, _, _, _ = _server(
        lambda context: Reconciled.ran(big, status=201), max_inline_bytes=1_000, blob_store=blobs
    )
    headers, body = request_for({"amount": 5, "answer": "500"})
    with (
        serve_closing(middleware, middleware.state["store"]) as url,  # type: ignore[attr-defined]
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        assert _post(client, headers, body).status_code == 500
        second = _post(client, headers, body)
        third = _post(client, headers, body)
    assert second.status_code == third.status_code == 201
    assert second.json() == third.json() == big
    assert len(list(tmp_path.glob("*.blob"))) == 1


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("ran", 503), "final status"),
        (("ran", True), "final status"),
        (("maybe",), "outcome"),
        (("ran", 200, (), "text"), "bytes"),
        (("ran", 200, [("a", "b")]), "headers"),
    ],
)
def test_a_reconciled_built_directly_is_checked(args: tuple[Any, ...], words: str) -> None:
    """Reconciled(...) built without ran() is validated as ran() is (the old code took a
    "ran" 503 and recorded it as the key's outcome)."""
    with pytest.raises(ConfigurationError, match=words):
        Reconciled(*args)
