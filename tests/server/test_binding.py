"""A key belongs to one operation: method + route path (and, for opaque keys, the body).

Every store kind, through uvicorn on loopback; executions are counted on the server.
"""

from __future__ import annotations

import concurrent.futures
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from agentkey.server import FileBlobStore, Store
from tests.server._apps import tool_app
from tests.server._util import request_for, serve_closing

StoreFactory = Callable[[], Store]


@pytest.fixture
def served(make_store: StoreFactory, tmp_path: Any) -> Iterator[Callable[..., Any]]:
    """Start tool apps with given middleware options; yields (app, client)."""
    stack: list[Any] = []

    def start(**options: Any) -> tuple[Any, httpx.Client]:
        store = make_store()
        options.setdefault("blob_store", FileBlobStore(tmp_path / "blobs"))
        app = tool_app(store, **options)
        cm = serve_closing(app, store)
        client = httpx.Client(base_url=cm.__enter__(), timeout=30)
        stack.append((cm, client))
        return app, client

    yield start
    for cm, client in reversed(stack):
        client.close()
        cm.__exit__(None, None, None)


def _problem(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert "idempotent-replayed" not in response.headers
    doc = response.json()
    assert (doc["type"], doc["status"], doc["error"]) == (
        f"urn:agentkey:problem:{code}",
        status,
        code,
    )


def test_key_on_another_route_is_refused_never_replayed(served: Callable[..., Any]) -> None:
    """The same agentkey key on another route gets 422 key_reused; the first route still replays."""
    app, client = served()
    headers, body = request_for({"status": 201, "amount": 5})
    assert client.post("/ok", headers=headers, content=body).status_code == 201
    _problem(client.post("/status", headers=headers, content=body), 422, "key_reused")
    again = client.post("/ok", headers=headers, content=body)
    assert again.headers["idempotent-replayed"] == "true"
    assert (app.state.runs["ok"], app.state.runs["status"]) == (1, 0)


def test_key_with_another_method_is_refused(served: Callable[..., Any]) -> None:
    """The same key with another method on the same path is another operation: 422 key_reused."""
    app, client = served(methods=["POST", "PUT"])
    headers, body = request_for({"amount": 5})
    assert client.post("/ok", headers=headers, content=body).status_code == 201
    _problem(client.put("/ok", headers=headers, content=body), 422, "key_reused")
    assert app.state.runs["ok"] == 1


def test_key_in_flight_on_another_route_is_refused_not_409(served: Callable[..., Any]) -> None:
    """While a key runs, the same key on another route gets 422 key_reused, not a 409."""
    app, client = served()
    headers, body = request_for({"gate": "bind", "status": 201})
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    first = pool.submit(client.post, "/wait", headers=headers, content=body)
    entered = app.state.entered.setdefault("bind", threading.Event())
    assert entered.wait(10)
    try:
        _problem(client.post("/status", headers=headers, content=body), 422, "key_reused")
        assert client.post("/wait", headers=headers, content=body).status_code == 409
    finally:
        app.state.gates.setdefault("bind", threading.Event()).set()
        assert first.result(timeout=10).status_code == 200
        pool.shutdown()
    assert (app.state.runs["wait"], app.state.runs["status"]) == (1, 0)


def test_failed_record_is_bound_too(served: Callable[..., Any]) -> None:
    """A FAILED step's key on another route is refused too, never replayed as its failure."""
    app, client = served()
    headers, body = request_for({"status": 503, "mutate": True})
    assert client.post("/status", headers=headers, content=body).status_code == 503
    _problem(client.post("/ok", headers=headers, content=body), 422, "key_reused")
    assert app.state.runs["ok"] == 0


# --- opaque keys (a UUID, a Stripe-style ik_..., a quoted UUID) ---------------------


@pytest.mark.parametrize(
    "style", ["uuid", "stripe", "sf-string uuid"], ids=["uuid", "ik_", "quoted uuid"]
)
def test_opaque_keys_are_accepted_and_replayed(served: Callable[..., Any], style: str) -> None:
    """Keys that are not agentkey keys run once and replay, like agentkey keys."""
    app, client = served()
    value = str(uuid.uuid4())
    header = {"uuid": value, "stripe": "ik_" + uuid.uuid4().hex, "sf-string uuid": f'"{value}"'}
    headers = {"idempotency-key": header[style], "content-type": "application/json"}
    first = client.post("/ok", headers=headers, content=b'{"amount": 5}')
    again = client.post("/ok", headers=headers, content=b'{"amount": 5}')  # the same bytes
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert app.state.runs["ok"] == 1


def test_quoted_and_raw_opaque_key_name_one_record(served: Callable[..., Any]) -> None:
    """An sf-string "<uuid>" and the raw <uuid> are one key."""
    app, client = served()
    value = str(uuid.uuid4())
    body = b'{"amount":5}'
    assert client.post("/ok", headers={"idempotency-key": f'"{value}"'}, content=body).is_success
    again = client.post("/ok", headers={"idempotency-key": value}, content=body)
    assert again.headers["idempotent-replayed"] == "true"
    assert app.state.runs["ok"] == 1


def test_opaque_key_with_another_body_or_route_gets_422(served: Callable[..., Any]) -> None:
    """An opaque key reused with another body gets payload_mismatch, on another route key_reused."""
    app, client = served()
    headers = {"idempotency-key": str(uuid.uuid4())}
    assert client.post("/ok", headers=headers, content=b'{"amount":5}').status_code == 201
    _problem(client.post("/ok", headers=headers, content=b'{"amount":6}'), 422, "payload_mismatch")
    _problem(client.post("/ok", headers=headers, content=b"amount=5"), 422, "payload_mismatch")
    _problem(client.post("/status", headers=headers, content=b'{"amount":5}'), 422, "key_reused")
    assert app.state.runs["ok"] == 1


def test_opaque_keys_are_scoped_by_principal(served: Callable[..., Any]) -> None:
    """Another tenant's identical UUID key is its own operation, never the first one's answer."""
    app, client = served()
    key = str(uuid.uuid4())
    body = b'{"amount":5}'
    alice = client.post("/ok", headers={"idempotency-key": key, "x-tenant": "alice"}, content=body)
    bob = client.post("/ok", headers={"idempotency-key": key, "x-tenant": "bob"}, content=body)
    assert "idempotent-replayed" not in bob.headers
    assert (alice.json()["tenant"], bob.json()["tenant"]) == ("alice", "bob")
    assert app.state.runs["ok"] == 2


def test_opaque_key_failed_step_is_replayed(served: Callable[..., Any]) -> None:
    """A FAILED outcome under an opaque key replays like any other: the rules are unchanged."""
    app, client = served()
    headers = {"idempotency-key": "ik_" + uuid.uuid4().hex}
    body = b'{"status":503,"mutate":true}'
    assert client.post("/status", headers=headers, content=body).status_code == 503
    again = client.post("/status", headers=headers, content=body)
    assert (again.status_code, again.headers["idempotent-replayed"]) == (503, "true")
    assert app.state.runs["status"] == 1


def test_agentkey_format_can_be_required(served: Callable[..., Any]) -> None:
    """With key_format="agentkey" a UUID key gets 400; a missing key keeps its 400 either way."""
    app, client = served(key_format="agentkey")
    body = b'{"amount":5}'
    _problem(
        client.post("/ok", headers={"idempotency-key": str(uuid.uuid4())}, content=body),
        400,
        "idempotency_key_invalid",
    )
    _problem(client.post("/ok", content=body), 400, "idempotency_key_missing")
    assert app.state.runs["ok"] == 0


def test_agentkey_keys_keep_their_hash_check_on_first_use(served: Callable[..., Any]) -> None:
    """An agentkey key whose hash does not cover the body is refused on its very first use."""
    app, client = served()
    headers, _ = request_for({"amount": 5})
    _problem(
        client.post("/ok", headers=headers, content=b'{"amount":6}'), 422, "args_hash_mismatch"
    )
    assert app.state.runs["ok"] == 0
