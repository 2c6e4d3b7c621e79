"""Opaque keys are bound to the body's bytes by default; canonical JSON on request.

Every store kind (MemoryStore, a real Redis, a real PostgreSQL), through uvicorn on
loopback; executions are counted on the server. Records written by a version that
fingerprinted the canonical body are seeded into the store as that version wrote them.
"""

from __future__ import annotations

import gc
import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentkey import ConfigurationError, canonical_json
from agentkey.server import (
    FileBlobStore,
    IdempotencyMiddleware,
    MemoryStore,
    ServerOptions,
    Store,
    current_claim,
)
from agentkey.server._decide import OpaqueKey, record_key
from agentkey.server._records import (
    Binding,
    StoredOutcome,
    digest,
    encode_in_progress,
    encode_outcome,
)
from tests.server._apps import tool_app
from tests.server._util import serve_closing, with_options

StoreFactory = Callable[[], Store]
SEED_PATH = "/__seed"
# Not canonical (spaces, members out of order), and the same arguments re-serialised.
SENT = b'{"currency": "eur", "amount": 5}'
RESENT = b'{"amount":5,"currency":"eur"}'


def _old_fingerprint(body: bytes) -> str:
    """The body fingerprint the previous version stored for a JSON-object body."""
    return digest(b"json:" + canonical_json(json.loads(body)))


def _seeding(app: Any, store: Store) -> Any:
    """``app`` plus ``POST /__seed``, which writes a record into ``store`` as sent (claim,
    then finish for an outcome): the store's own loop and connections, no middleware."""

    async def shim(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != SEED_PATH:
            await app(scope, receive, send)
            return
        request = Request(scope, receive)
        doc = await request.json()
        key, value = doc["key"], bytes.fromhex(doc["value"])
        owner = "0" * 32
        claimed = encode_in_progress(owner, 1, lease_end_ms=2**50, renew_ms=0, binding=None)
        if value.startswith(b"P:"):
            assert await store.claim(key, value, ttl_ms=600_000) is None
        else:
            assert await store.claim(key, claimed, ttl_ms=600_000) is None
            assert await store.finish(key, owner, value, ttl_ms=600_000)
        await Response(status_code=204)(scope, receive, send)

    return shim


@pytest.fixture
def served(make_store: StoreFactory, tmp_path: Any) -> Iterator[Callable[..., Any]]:
    """Start tool apps (shared key space) with given middleware options; yields (app, client)."""
    stack: list[Any] = []

    def start(**options: Any) -> tuple[Any, httpx.Client]:
        store = make_store()
        options.setdefault("blob_store", FileBlobStore(tmp_path / "blobs"))
        app = tool_app(store, principal=None, shared_key_space=True, **options)
        cm = serve_closing(_seeding(app, store), store)
        client = httpx.Client(base_url=cm.__enter__(), timeout=30)
        stack.append((cm, client))
        return app, client

    yield start
    for cm, client in reversed(stack):
        client.close()
        cm.__exit__(None, None, None)


def _post(client: httpx.Client, key: str, body: bytes) -> httpx.Response:
    headers = {"idempotency-key": key, "content-type": "application/json"}
    return client.post("/ok", headers=headers, content=body)


def _seed(client: httpx.Client, key: str, value: bytes) -> None:
    record = record_key("shared", OpaqueKey(key))
    answer = client.post(SEED_PATH, json={"key": record, "value": value.hex()})
    assert answer.status_code == 204, answer.text


def _old_outcome(body: bytes, fingerprint: str) -> bytes:
    """A COMPLETED record as the previous version stored it for ``POST /ok``."""
    answer = json.dumps({"run": 1, "args": json.loads(body), "tenant": "old"}).encode()
    binding = Binding(digest(b"POST /ok"), fingerprint)
    headers = (("content-type", "application/json"),)
    return encode_outcome(StoredOutcome("COMPLETED", 201, headers, answer, None, 1, binding))


def test_a_reserialised_retry_gets_422_and_never_runs_twice(served: Callable[..., Any]) -> None:
    """By default an opaque key's retry with other spacing or member order is a 422, one run."""
    app, client = served()
    key = str(uuid.uuid4())
    first = _post(client, key, SENT)
    resent = _post(client, key, RESENT)
    again = _post(client, key, SENT)
    assert first.status_code == 201
    assert resent.status_code == 422, resent.text
    assert resent.json()["error"] == "payload_mismatch"
    assert "idempotent-replayed" not in resent.headers
    assert (again.status_code, again.headers["idempotent-replayed"]) == (201, "true")
    assert again.content == first.content
    assert app.state.runs["ok"] == 1


def test_canonical_option_replays_equivalent_json(served: Callable[..., Any]) -> None:
    """body_fingerprint="canonical": equivalent JSON is one body (a replay); another is a 422."""
    app, client = served(body_fingerprint="canonical")
    key = str(uuid.uuid4())
    first = _post(client, key, SENT)
    resent = _post(client, key, RESENT)
    other = _post(client, key, b'{"amount":6,"currency":"eur"}')
    assert (first.status_code, resent.status_code) == (201, 201)
    assert resent.headers["idempotent-replayed"] == "true"
    assert resent.content == first.content
    assert other.status_code == 422
    assert other.json()["error"] == "payload_mismatch"
    assert app.state.runs["ok"] == 1


@pytest.mark.parametrize("body", [SENT, RESENT], ids=["as first sent", "re-serialised"])
def test_a_record_of_the_previous_version_replays_the_same_body(
    served: Callable[..., Any], body: bytes
) -> None:
    """A record stored under the old canonical fingerprint replays the same arguments, no run."""
    app, client = served()
    key = str(uuid.uuid4())
    stored = _old_outcome(SENT, _old_fingerprint(SENT))
    _seed(client, key, stored)
    again = _post(client, key, body)
    assert again.status_code == 201, again.text
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == {"run": 1, "args": {"currency": "eur", "amount": 5}, "tenant": "old"}
    assert app.state.runs["ok"] == 0


def test_a_record_of_the_previous_version_refuses_another_body(
    served: Callable[..., Any],
) -> None:
    """An old canonical record never answers another body: 422, nothing runs, then it replays."""
    app, client = served()
    key = str(uuid.uuid4())
    _seed(client, key, _old_outcome(SENT, _old_fingerprint(SENT)))
    other = _post(client, key, b'{"amount":6,"currency":"eur"}')
    not_json = _post(client, key, b"amount=5")
    assert (other.status_code, not_json.status_code) == (422, 422)
    assert other.json()["error"] == not_json.json()["error"] == "payload_mismatch"
    assert _post(client, key, SENT).headers["idempotent-replayed"] == "true"
    assert app.state.runs["ok"] == 0


def test_an_old_claim_in_flight_is_a_409_not_a_422(served: Callable[..., Any]) -> None:
    """A claim the previous version holds (canonical fingerprint) answers the same body 409."""
    app, client = served()
    key = str(uuid.uuid4())
    binding = Binding(digest(b"POST /ok"), _old_fingerprint(SENT))
    far = 2**50  # a lease that has not ended
    claim = encode_in_progress("1" * 32, 1, lease_end_ms=far, renew_ms=5000, binding=binding)
    _seed(client, key, claim)
    busy = _post(client, key, SENT)
    assert busy.status_code == 409, busy.text
    assert busy.json()["error"] == "in_progress"
    assert _post(client, key, b'{"amount":6}').status_code == 422
    assert app.state.runs["ok"] == 0


def test_switching_to_canonical_keeps_the_bytes_records(served: Callable[..., Any]) -> None:
    """A record stored under bytes fingerprints still replays its bytes after opting in."""
    app, client = served(body_fingerprint="canonical")
    key = str(uuid.uuid4())
    _seed(client, key, _old_outcome(SENT, digest(b"bytes:" + SENT)))
    again = _post(client, key, SENT)
    assert again.headers["idempotent-replayed"] == "true"
    assert _post(client, key, b'{"amount":6,"currency":"eur"}').status_code == 422
    assert app.state.runs["ok"] == 0


@pytest.mark.parametrize("value", ["raw", "", None, True, "Canonical"])
def test_body_fingerprint_is_checked_at_construction(value: object) -> None:
    """An unknown body_fingerprint is a ConfigurationError naming the two choices."""
    with pytest.raises(ConfigurationError, match="body_fingerprint must be 'bytes'"):
        IdempotencyMiddleware(
            Starlette(),
            store=MemoryStore(),
            shared_key_space=True,
            options=ServerOptions(body_fingerprint=value),  # type: ignore[arg-type]
        )


def _held_dicts(marker: str) -> int:
    """How many live dicts carry the member ``marker`` (the parsed request body)."""
    return sum(1 for o in gc.get_objects() if type(o) is dict and marker in o)


@pytest.mark.parametrize("kind", ["opaque key", "canonical option", "agentkey key, re-serialised"])
def test_no_parsed_body_is_held_while_the_handler_runs(kind: str) -> None:
    """The handler runs with no parsed copy of the body alive; claim.json() parses on demand."""
    marker = "m" + uuid.uuid4().hex
    # Built as bytes only: the test itself holds no dict with the marker.
    body = ('{ "%s": [1, 2, {"x": 3}], "a": 1 }' % marker).encode()  # noqa: UP031
    seen: list[tuple[int, int]] = []

    async def tool(request: Request) -> Response:
        before = _held_dicts(marker)
        args = current_claim().json()
        seen.append((before, _held_dicts(marker)))
        return JSONResponse({"n": len(args)}, status_code=201)

    options: dict[str, Any] = {}
    if kind == "canonical option":
        options["body_fingerprint"] = "canonical"
    store = MemoryStore()
    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/t", tool, methods=["POST"])]),
        store=store,
        shared_key_space=True,
        **with_options(options),
    )
    if kind.startswith("agentkey"):
        from agentkey import StepKey

        key = StepKey.build("plan-1", 0, json.loads(body)).format()
    else:
        key = str(uuid.uuid4())
    with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
        answer = client.post("/t", headers={"idempotency-key": key}, content=body)
    assert answer.status_code == 201, answer.text
    assert seen == [(0, 1)]  # none before claim.json(), its own after
