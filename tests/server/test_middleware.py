"""IdempotencyMiddleware end to end: uvicorn on loopback, MemoryStore and a real Redis."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from agentkey import StepKey, StoreError, canonical_json
from agentkey._canonical import Profile
from agentkey.server import FileBlobStore, MemoryStore, RedisStore, Store
from agentkey.server._decide import Checked, OpaqueKey, _parse_key, check_body
from agentkey.server._decide import record_key as _record_key
from agentkey.server._records import StoredOutcome, decode_record
from tests._loopback import free_port
from tests.server._apps import tool_app
from tests.server._util import call, new_plan, request_for, serve_closing

StoreFactory = Callable[[], Store]


class Served:
    """A running tool app, its store, and a client for it."""

    def __init__(self, app: Any, store: Store, client: httpx.Client) -> None:
        self.app = app
        self.store = store
        self.client = client

    @property
    def runs(self) -> Any:
        return self.app.state.runs


@pytest.fixture
def served(make_store: StoreFactory, tmp_path: Any) -> Iterator[Callable[..., Served]]:
    """Start tool apps with given middleware options; stop them after the test."""
    stack: list[Any] = []

    def start(**options: Any) -> Served:
        store = make_store()
        options.setdefault("blob_store", FileBlobStore(tmp_path / "blobs"))
        app = tool_app(store, **options)
        cm = serve_closing(app, store)
        url = cm.__enter__()
        client = httpx.Client(base_url=url, timeout=30)
        stack.append((cm, client))
        return Served(app, store, client)

    yield start
    for cm, client in reversed(stack):
        client.close()
        cm.__exit__(None, None, None)


@pytest.mark.parametrize("path", ["/ok", "/ok-sync"], ids=["async handler", "sync handler"])
def test_duplicate_is_replayed_not_rerun(served: Callable[..., Served], path: str) -> None:
    """A second request with the same key replays status, body and content type, marked replayed."""
    s = served()
    headers, body = request_for({"amount": 5})
    status, first, h1 = call(s.client, path, headers, body)
    assert (status, first["run"], h1.get("idempotent-replayed")) == (201, 1, None)
    status, again, h2 = call(s.client, path, headers, body)
    assert (status, again) == (201, first)
    assert h2["idempotent-replayed"] == "true"
    assert h2["content-type"] == h1["content-type"]
    assert s.runs["ok"] == 1


def test_both_header_styles_name_one_record(served: Callable[..., Served]) -> None:
    """The same key sent raw and as an RFC 8941 sf-string is one operation."""
    s = served()
    plan = new_plan()
    headers, body = request_for({"a": 1}, plan=plan, style="sf-string")
    assert call(s.client, "/ok", headers, body)[0] == 201
    headers, body = request_for({"a": 1}, plan=plan, style="raw")
    status, _, h = call(s.client, "/ok", headers, body)
    assert (status, h["idempotent-replayed"], s.runs["ok"]) == (201, "true", 1)


def test_changed_args_are_a_new_operation(served: Callable[..., Served]) -> None:
    """Same plan and step with different arguments is a new key, so the tool runs again."""
    s = served()
    plan = new_plan()
    for region in ("ap-southeast-1", "us-east-1"):
        headers, body = request_for({"region": region}, plan=plan, step=3)
        status, got, h = call(s.client, "/ok", headers, body)
        assert (status, got["args"]["region"], h.get("idempotent-replayed")) == (201, region, None)
    assert s.runs["ok"] == 2


def _key_for(body: bytes) -> str:
    import hashlib

    return f"{new_plan()}:step_000:{hashlib.sha256(body).hexdigest()}"


# (name, header value, body, expected status, error code)
_GOOD = canonical_json({"amount": 5})
_REQUEST_TABLE: list[tuple[str, str | None, bytes, int, str]] = [
    ("missing key", None, _GOOD, 400, "idempotency_key_missing"),
    ("garbage agentkey-shaped key", "hel:step_lo:x", _GOOD, 400, "idempotency_key_invalid"),
    ("empty sf-string", '""', _GOOD, 400, "idempotency_key_invalid"),
    ("blank sf-string", '" "', _GOOD, 400, "idempotency_key_invalid"),
    ("uppercase hash", _key_for(_GOOD).upper(), _GOOD, 400, "idempotency_key_invalid"),
    ("bad sf-string escape", '"' + _key_for(_GOOD) + '\\x"', _GOOD, 400, "idempotency_key_invalid"),
    ("unterminated sf-string", '"' + _key_for(_GOOD), _GOOD, 400, "idempotency_key_invalid"),
    ("non-canonical step", "p:step_3:" + "0" * 64, _GOOD, 400, "idempotency_key_invalid"),
    ("long key", "p" * 2000 + ":step_000:" + "0" * 64, _GOOD, 400, "idempotency_key_invalid"),
    # Bodies that are not the key's exact bytes must parse as a JSON object (a body that
    # is the key's bytes is the handler's to read: tests/server/test_bodies.py).
    ("body not json", _key_for(_GOOD), b"{oops", 400, "body_not_json"),
    ("body is a list", _key_for(_GOOD), b"[1,2]", 400, "body_not_json"),
    ("body has NaN", _key_for(_GOOD), b'{"a":NaN}', 400, "body_not_json"),
    ("hash mismatch", _key_for(b'{"amount":6}'), _GOOD, 422, "args_hash_mismatch"),
    # Python keeps the last duplicate, other parsers the first: the hash must not vouch
    # for a body whose meaning depends on the parser.
    ("duplicate member", _key_for(_GOOD), b'{"amount":1,"amount":5}', 400, "body_not_json"),
    ("nested duplicate", _key_for(b'{"a":{"b":2}}'), b'{"a":{"b":1,"b":2}}', 400, "body_not_json"),
]


@pytest.mark.parametrize(
    ("header", "body", "expected", "code"),
    [row[1:] for row in _REQUEST_TABLE],
    ids=[row[0] for row in _REQUEST_TABLE],
)
def test_bad_requests_get_a_clear_4xx_and_never_run(
    served: Callable[..., Served], header: str | None, body: bytes, expected: int, code: str
) -> None:
    """Each malformed key or body gets its 4xx with an error code; the tool never runs."""
    s = served()
    headers = {"content-type": "application/json"}
    if header is not None:
        headers["idempotency-key"] = header
    status, got, h = call(s.client, "/ok", headers, body)
    assert (status, got["error"]) == (expected, code)
    assert got["detail"]
    # RFC 9457 problem details, with the "error" member kept for existing clients.
    assert h["content-type"] == "application/problem+json"
    assert (got["type"], got["status"]) == (f"urn:agentkey:problem:{code}", status)
    assert got["title"]
    assert s.runs["ok"] == 0


def test_equivalent_json_is_accepted_by_reserialising(served: Callable[..., Served]) -> None:
    """A body with other spacing and key order passes: the server re-serialises to the profile."""
    s = served()
    headers, _ = request_for({"b": 1, "a": [1, 2]})
    status, got, _ = call(s.client, "/ok", headers, b'{ "b": 1,\n "a": [1, 2] }')
    assert (status, got["args"]) == (201, {"a": [1, 2], "b": 1})


def test_oversized_body_gets_413(served: Callable[..., Served]) -> None:
    """A body over max_body_bytes is refused with 413 before anything is stored."""
    s = served(max_body_bytes=1000)
    args = {"pad": "x" * 2000}
    headers, body = request_for(args)
    status, got, _ = call(s.client, "/ok", headers, body)
    assert (status, got["error"], s.runs["ok"]) == (413, "body_too_large", 0)


def test_keyless_requests_pass_when_key_not_required(served: Callable[..., Served]) -> None:
    """require_key=False lets a request without a key through, unprotected, every time."""
    s = served(require_key=False)
    for _ in range(2):
        assert s.client.post("/ok", json={"a": 1}).status_code == 201
    assert s.runs["ok"] == 2


def test_second_principal_never_sees_first_principals_response(
    served: Callable[..., Served],
) -> None:
    """Another tenant reusing a key gets its own execution, never the first tenant's body."""
    s = served()
    headers, body = request_for({"amount": 5})
    _, alice, _ = call(s.client, "/ok", {**headers, "x-tenant": "alice"}, body)
    status, bob, h = call(s.client, "/ok", {**headers, "x-tenant": "bob"}, body)
    assert (status, bob["tenant"], h.get("idempotent-replayed")) == (201, "bob", None)
    assert alice["tenant"] == "alice"
    _, again, h = call(s.client, "/ok", {**headers, "x-tenant": "alice"}, body)
    assert (again, h["idempotent-replayed"]) == (alice, "true")


@pytest.mark.parametrize(
    ("code", "stored"),
    [
        (200, True),
        (201, True),
        (202, True),
        (400, True),
        (404, True),
        (422, True),
        (401, False),
        (403, False),
        (408, False),
        (409, False),
        (429, False),
        (500, None),
        (502, None),
        (503, None),
        (303, True),
    ],
)
def test_storage_rule_for_each_status(
    served: Callable[..., Served], code: int, stored: bool | None
) -> None:
    """2xx and request 4xx are stored and replayed; 401/403/408/409/429 are released; a 5xx
    (the handler may have started its side effect) leaves the key in doubt."""
    s = served()
    headers, body = request_for({"status": code})
    first = s.client.post("/status", headers=headers, content=body)
    second = s.client.post("/status", headers=headers, content=body)
    assert first.status_code == code
    if stored is None:
        assert second.status_code == 409
        assert second.json()["error"] == "in_doubt"
        assert s.runs["status"] == 1
        return
    assert second.status_code == code
    if stored:
        assert second.headers["idempotent-replayed"] == "true"
        assert (second.content, s.runs["status"]) == (first.content, 1)
    else:
        assert "idempotent-replayed" not in second.headers
        assert s.runs["status"] == 2


@pytest.mark.parametrize("code", [401, 429, 500, 503])
def test_unstored_status_after_mutation_is_recorded_failed(
    served: Callable[..., Served], code: int
) -> None:
    """Once the mutation began, even a 5xx or 401 is final: it is replayed, not rerun."""
    s = served()
    headers, body = request_for({"status": code, "mutate": True})
    first = s.client.post("/status", headers=headers, content=body)
    second = s.client.post("/status", headers=headers, content=body)
    assert (first.status_code, second.status_code) == (code, code)
    assert second.headers["idempotent-replayed"] == "true"
    assert s.runs["status"] == 1


def test_exception_before_mutation_releases_the_key(served: Callable[..., Served]) -> None:
    """A handler that fails before its side effect leaves the key free: a retry runs again
    (mutation_starts="on_mark": nothing may have started before begin_mutation)."""
    s = served(mutation_starts="on_mark")
    headers, body = request_for({"mutate": False})
    headers["connection"] = "close"  # uvicorn drops a connection whose app raised
    assert s.client.post("/fail", headers=headers, content=body).status_code == 500
    again = s.client.post("/fail", headers=headers, content=body)
    assert again.status_code == 500
    assert "idempotent-replayed" not in again.headers
    assert s.runs["fail"] == 2


def test_exception_after_mutation_is_replayed_as_failed(served: Callable[..., Served]) -> None:
    """A handler that fails after its side effect began records FAILED; retries replay it."""
    s = served()
    headers, body = request_for({"mutate": True})
    headers["connection"] = "close"  # uvicorn drops a connection whose app raised
    assert s.client.post("/fail", headers=headers, content=body).status_code == 500
    again = s.client.post("/fail", headers=headers, content=body)
    assert (again.status_code, again.headers["idempotent-replayed"]) == (500, "true")
    assert again.json()["error"] == "step_failed"
    assert s.runs["fail"] == 1


def test_large_response_goes_to_the_blob_store(
    served: Callable[..., Served], tmp_path: Any
) -> None:
    """A body over max_inline_bytes goes to the blob store and is replayed whole."""
    s = served(max_inline_bytes=1000)
    plan = new_plan()
    headers, body = request_for({"size": 150_000}, plan=plan)
    first = s.client.post("/big", headers=headers, content=body)
    again = s.client.post("/big", headers=headers, content=body)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert len(first.content) > 150_000
    assert s.runs["big"] == 1
    assert len(list((tmp_path / "blobs").glob("*.blob"))) == 1
    small_headers, small_body = request_for({"size": 10}, plan=plan, step=1)
    s.client.post("/big", headers=small_headers, content=small_body)
    assert len(list((tmp_path / "blobs").glob("*.blob"))) == 1


async def test_blob_record_keeps_only_the_uri(make_store: StoreFactory, tmp_path: Any) -> None:
    """The stored record of a large answer has an empty inline body and a file:// URI."""
    store = make_store()
    app = tool_app(store, blob_store=FileBlobStore(tmp_path), max_inline_bytes=10)
    headers, body = request_for({"size": 100})
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        assert (await client.post("/big", headers=headers, content=body)).status_code == 200
    key = StepKey.parse(headers["idempotency-key"])
    raw = await store.get(f"anonymous:{key}")
    assert raw is not None
    record = decode_record(raw, key="k")
    assert isinstance(record, StoredOutcome)
    assert record.body == b""
    assert record.blob_uri is not None
    assert record.blob_uri.startswith("file://")
    await store.aclose()


def test_streamed_response_is_stored_whole(served: Callable[..., Served]) -> None:
    """A streaming response reaches the client chunk by chunk and replays byte for byte."""
    s = served()
    headers, body = request_for({"n": 5})
    with s.client.stream("POST", "/stream", headers=headers, content=body) as response:
        first = b"".join(response.iter_bytes())
    again = s.client.post("/stream", headers=headers, content=body)
    assert first.startswith(b"chunk-0-run-1;")
    assert first.endswith(b"chunk-4-run-1;")
    assert (again.content, again.headers["idempotent-replayed"]) == (first, "true")
    assert s.runs["stream"] == 1


def _in_thread(fn: Callable[[], httpx.Response]) -> concurrent.futures.Future[httpx.Response]:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    future = pool.submit(fn)
    pool.shutdown(wait=False)
    return future


def _wait_entered(s: Served, gate: str) -> None:
    event = s.app.state.entered.setdefault(gate, threading.Event())
    assert event.wait(10), "the handler never started"


def test_in_progress_gets_409_with_retry_after_at_once(served: Callable[..., Served]) -> None:
    """While a key runs, a duplicate gets 409 + Retry-After at once, not after the first."""
    s = served(retry_after=2)
    headers, body = request_for({"gate": "g409"})
    first = _in_thread(lambda: s.client.post("/wait", headers=headers, content=body))
    _wait_entered(s, "g409")
    dup = s.client.post("/wait", headers=headers, content=body)
    assert (dup.status_code, dup.headers["retry-after"], dup.json()["error"]) == (
        409,
        "2",
        "in_progress",
    )
    assert not first.done()  # the duplicate did not wait for the first to finish
    s.app.state.gates.setdefault("g409", threading.Event()).set()
    assert first.result(timeout=10).status_code == 200
    assert s.runs["wait"] == 1


@pytest.mark.parametrize("finishes", [True, False], ids=["first finishes", "hold runs out"])
def test_hold_in_flight_replays_when_the_first_finishes(
    served: Callable[..., Served], finishes: bool
) -> None:
    """With hold_in_flight, a duplicate waits and replays the first answer; else a late 409."""
    s = served(hold_in_flight=0.6 if not finishes else 10)
    headers, body = request_for({"gate": f"hold-{finishes}"})
    first = _in_thread(lambda: s.client.post("/wait", headers=headers, content=body))
    _wait_entered(s, f"hold-{finishes}")
    dup = _in_thread(lambda: s.client.post("/wait", headers=headers, content=body))
    if finishes:
        time.sleep(0.3)
        assert not dup.done()  # held, not answered 409
        s.app.state.gates.setdefault(f"hold-{finishes}", threading.Event()).set()
        got = dup.result(timeout=10)
        assert (got.status_code, got.headers["idempotent-replayed"]) == (200, "true")
        assert got.content == first.result(timeout=10).content
    else:
        got = dup.result(timeout=10)
        assert got.status_code == 409  # the hold's length: test_server_clock.py, on a FakeClock
        s.app.state.gates.setdefault(f"hold-{finishes}", threading.Event()).set()
        assert first.result(timeout=10).status_code == 200
    assert s.runs["wait"] == 1


def test_expired_lease_cannot_overwrite_the_new_owner(served: Callable[..., Served]) -> None:
    """A handler whose lease expired finishes late; the second owner's record survives.

    This is the documented cost of a lease that is not renewed (auto_renew=False) on a
    handler that says when its side effect starts (mutation_starts="on_mark"): the step
    runs twice. (By default the lapsed lease leaves the key in doubt: test_in_doubt.py.)
    """
    s = served(lock_ttl=0.3, auto_renew=False, mutation_starts="on_mark")
    plan = new_plan()
    headers, body = request_for({"gate": "slow"}, plan=plan)
    first = _in_thread(lambda: s.client.post("/wait", headers=headers, content=body))
    _wait_entered(s, "slow")
    time.sleep(0.6)  # the lease (0.3 s) expires while the first handler still runs
    s.app.state.entered["slow"].clear()
    second = _in_thread(lambda: s.client.post("/wait", headers=headers, content=body))
    _wait_entered(s, "slow")  # the second request claimed the key and runs the handler
    s.app.state.gates.setdefault("slow", threading.Event()).set()
    one, two = first.result(timeout=10), second.result(timeout=10)
    assert {one.json()["run"], two.json()["run"]} == {1, 2}
    assert s.runs["wait"] == 2
    replay = s.client.post("/wait", headers=headers, content=body)
    assert replay.headers["idempotent-replayed"] == "true"
    # Whichever handler finished last, the record is the second owner's answer.
    assert replay.content == two.content


# The two renewal tests run on the real clock: the lease expires in the store (Redis and
# PostgreSQL keep their own time). Renewals come every lock_ttl/3 = 0.4 s, so a renewal may
# be late by up to 0.8 s (a loaded machine) before the lease lapses.
@pytest.mark.realtime
def test_keep_alive_renews_the_lease_past_lock_ttl(served: Callable[..., Served]) -> None:
    """claim.keep_alive() renews every lock_ttl/3, so a long handler keeps its key."""
    s = served(lock_ttl=1.2, auto_renew=False)
    headers, body = request_for({"gate": "long", "keep_alive": True})
    first = _in_thread(lambda: s.client.post("/wait", headers=headers, content=body))
    _wait_entered(s, "long")
    time.sleep(2.4)  # two lock_ttls
    assert s.client.post("/wait", headers=headers, content=body).status_code == 409
    s.app.state.gates.setdefault("long", threading.Event()).set()
    assert first.result(timeout=10).json() == {"run": 1, "gate": "long", "lost": False}
    assert s.runs["wait"] == 1


@pytest.mark.realtime
def test_lease_is_renewed_automatically_by_default(served: Callable[..., Served]) -> None:
    """Without keep_alive, a handler running two leases keeps its key: a duplicate gets 409."""
    s = served(lock_ttl=1.2)
    headers, body = request_for({"gate": "auto"})
    first = _in_thread(lambda: s.client.post("/wait", headers=headers, content=body))
    _wait_entered(s, "auto")
    time.sleep(2.4)  # two lock_ttls
    assert s.client.post("/wait", headers=headers, content=body).status_code == 409
    s.app.state.gates.setdefault("auto", threading.Event()).set()
    assert first.result(timeout=10).json() == {"run": 1, "gate": "auto", "lost": False}
    assert s.runs["wait"] == 1


def test_result_ttl_expires_records(served: Callable[..., Served]) -> None:
    """After result_ttl a finished record is gone and the key runs as new."""
    s = served(lock_ttl=0.1, result_ttl=0.4)
    headers, body = request_for({"a": 1})
    call(s.client, "/ok", headers, body)
    time.sleep(0.6)
    _, got, h = call(s.client, "/ok", headers, body)
    assert (got["run"], h.get("idempotent-replayed")) == (2, None)


def test_redis_down_fails_closed_with_503() -> None:
    """With Redis unreachable the answer is 503 + Retry-After and the handler never runs."""
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", connect_timeout=0.5)
    app = tool_app(store, retry_after=3)
    headers, body = request_for({"amount": 1})
    with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
        response = client.post("/ok", headers=headers, content=body)
    assert (response.status_code, response.headers["retry-after"]) == (503, "3")
    assert response.json()["error"] == "not_run"
    assert app.state.runs["ok"] == 0


async def test_ten_megabyte_key_is_rejected_cheaply() -> None:
    """A 10 MB Idempotency-Key gets 400 from the middleware without touching the store."""
    store = MemoryStore()
    app = tool_app(store)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        response = await client.post(
            "/ok", headers={"idempotency-key": "k" * 10_000_000}, content=_GOOD
        )
    assert response.status_code == 400
    assert len(response.content) < 1000  # the key is not echoed back
    assert await store.get("anything") is None
    assert app.state.runs["ok"] == 0


def test_ten_megabyte_key_over_loopback_gets_4xx(served: Callable[..., Served]) -> None:
    """Over a real socket the server refuses a 10 MB header with a 4xx (or drops the connection)."""
    s = served()
    try:
        response = s.client.post(
            "/ok", headers={"idempotency-key": "k" * 10_000_000}, content=_GOOD
        )
    except httpx.TransportError:
        pass  # uvicorn closed the connection on the oversized header: also a refusal
    else:
        assert 400 <= response.status_code < 500
    assert s.runs["ok"] == 0


class _BrokenBlobStore:
    """A blob store whose writes always fail (a full disk, a lost mount)."""

    async def put(self, data: bytes) -> str:
        raise StoreError("blob volume is full")

    async def get(self, uri: str) -> bytes:
        raise StoreError("nothing stored")

    async def delete(self, uri: str) -> None:
        return None


def test_large_response_stays_replayable_when_the_blob_store_fails(
    served: Callable[..., Served],
) -> None:
    """A failed blob write keeps the large answer inline, so a retry replays it, never reruns."""
    s = served(max_inline_bytes=1000, blob_store=_BrokenBlobStore())
    headers, body = request_for({"size": 5000})
    first = s.client.post("/big", headers=headers, content=body)
    again = s.client.post("/big", headers=headers, content=body)
    assert (first.status_code, again.status_code) == (200, 200)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert s.runs["big"] == 1


@pytest.mark.parametrize(
    "short",
    [
        "!sha256-" + hashlib.sha256(("p" * 200).encode()).hexdigest(),
        "sha256-" + hashlib.sha256(("p" * 200).encode()).hexdigest(),
    ],
)
def test_a_short_principal_cannot_spell_a_long_principals_record(short: str) -> None:
    """Long principals are hashed under a prefix no short principal can produce after quoting."""
    key = StepKey.build(new_plan(), 0, {"a": 1})
    assert _record_key(short, key) != _record_key("p" * 200, key)


@given(st.text(min_size=1, max_size=300), st.text(min_size=1, max_size=300))
def test_distinct_principals_never_share_a_record_key(one: str, two: str) -> None:
    """Any two different principals (unicode, surrogates, ':' and braces included) get two keys."""
    assume(one != two)
    key = StepKey.build("plan", 0, {"a": 1})
    assert _record_key(one, key) != _record_key(two, key)
    assert "{" not in _record_key(one, key)  # never breaks the Redis Cluster hash tag


class _ResendingStore:
    """A real store behind a client library that re-sends every write once (a retry after a
    timeout whose first attempt had in fact succeeded); it reports the second answer."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner

    async def claim(self, key: str, value: bytes, *, ttl_ms: int) -> bytes | None:
        await self.inner.claim(key, value, ttl_ms=ttl_ms)
        return await self.inner.claim(key, value, ttl_ms=ttl_ms)

    async def renew(self, key: str, owner: str, *, ttl_ms: int) -> bool:
        return await self.inner.renew(key, owner, ttl_ms=ttl_ms)

    async def finish(self, key: str, owner: str, value: bytes, *, ttl_ms: int) -> bool:
        await self.inner.finish(key, owner, value, ttl_ms=ttl_ms)
        return await self.inner.finish(key, owner, value, ttl_ms=ttl_ms)

    async def release(self, key: str, owner: str) -> bool:
        return await self.inner.release(key, owner)

    async def get(self, key: str) -> bytes | None:
        return await self.inner.get(key)

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_writes_resent_by_the_client_library_still_claim_and_record(
    make_store: StoreFactory, tmp_path: Any
) -> None:
    """A re-sent claim reads back its own owner (not a 409) and a re-sent finish keeps its blob."""
    store = _ResendingStore(make_store())
    app = tool_app(store, blob_store=FileBlobStore(tmp_path), max_inline_bytes=1000)
    headers, body = request_for({"size": 5000})
    with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
        first = client.post("/big", headers=headers, content=body)
        again = client.post("/big", headers=headers, content=body)
    assert first.status_code == 200
    assert (again.status_code, again.headers.get("idempotent-replayed")) == (200, "true")
    assert again.content == first.content
    assert app.state.runs["big"] == 1
    assert len(list(tmp_path.glob("*.blob"))) == 1


_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
    max_leaves=20,
)


@given(st.binary(max_size=400))
def test_any_key_header_bytes_give_a_key_or_a_400_message(raw: bytes) -> None:
    """Whatever bytes a hostile client sends as the key, parsing returns a key or a message."""
    parsed = _parse_key([raw])
    assert isinstance(parsed, (StepKey, OpaqueKey, str))
    assert isinstance(_parse_key([raw], opaque=False), (StepKey, str))


@given(
    st.one_of(st.binary(max_size=200), _JSONISH.map(lambda v: json.dumps(v).encode())),
    st.sampled_from(["python", "jcs"]),
)
def test_any_body_is_accepted_or_refused_never_crashes(body: bytes, profile: Profile) -> None:
    """Any body bytes are either verified or answered with a 4xx; the check never raises."""
    checked = check_body(
        StepKey.build("plan", 0, {"a": 1}), ("POST", "/x"), body, hash_profile=profile
    )
    assert isinstance(checked, Checked) or checked.status in (400, 422)
