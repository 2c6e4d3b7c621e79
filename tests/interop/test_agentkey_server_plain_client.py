"""A plain httpx client with ordinary keys (UUIDs, ``ik_…``) against agentkey's middleware.

No agentkey client code: the requests are what any idempotency-aware client sends.
The tool behind the middleware counts its executions; the store is a real Redis.
"""

from __future__ import annotations

import concurrent.futures
import json
import secrets
import threading
import uuid
from collections.abc import Callable, Iterator

import httpx
import pytest

from ._support import Served

REPLAY_HEADER = "Idempotent-Replayed"  # the header agentkey's middleware marks a replay with

pytestmark = pytest.mark.redis


def bare(key: str) -> str:
    return key


def quoted(key: str) -> str:
    """The key as an RFC 8941 sf-string, as the IETF draft writes it."""
    return f'"{key}"'


#: The two header forms of one UUID key.
FORMS: dict[str, Callable[[str], str]] = {"uuid": bare, "quoted-uuid": quoted}
BODY = {"amount": 5, "currency": "eur"}
OTHER_BODY = {"amount": 7, "currency": "eur"}


@pytest.fixture
def client(agentkey_server: Served) -> Iterator[httpx.Client]:
    """A plain client for the served agentkey middleware."""
    with httpx.Client(base_url=agentkey_server.url, timeout=10) as plain:
        yield plain


def post(
    client: httpx.Client, path: str, key: str | None, body: object = BODY, *, raw: bytes = b""
) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["idempotency-key"] = key
    return client.post(path, content=raw or json.dumps(body).encode(), headers=headers)


def problem(response: httpx.Response) -> str:
    """The problem code of one of the middleware's own errors."""
    assert response.headers["content-type"] == "application/problem+json"
    code: str = response.json()["error"]
    return code


@pytest.mark.parametrize(
    "key",
    [str(uuid.uuid4()), f'"{uuid.uuid4()}"', "ik_" + secrets.token_hex(12)],
    ids=["uuid", "quoted-uuid", "stripe-ik"],
)
def test_ordinary_key_runs_once_then_replays(
    agentkey_server: Served, client: httpx.Client, key: str
) -> None:
    """A UUID, a quoted UUID or an ik_ key runs the tool once; the resend is a marked replay."""
    first = post(client, "/tools/charge", key)
    again = post(client, "/tools/charge", key)
    assert first.status_code == 201
    assert REPLAY_HEADER.lower() not in first.headers
    assert again.status_code == 201
    assert again.headers[REPLAY_HEADER] == "true"
    assert again.json() == first.json()
    assert agentkey_server.tool.executions() == 1


def test_quoted_and_bare_uuid_are_one_key(agentkey_server: Served, client: httpx.Client) -> None:
    """The sf-string form of a UUID and its bare form name one key: the second replays."""
    key = str(uuid.uuid4())
    first = post(client, "/tools/charge", f'"{key}"')
    again = post(client, "/tools/charge", key)
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.headers[REPLAY_HEADER] == "true"
    assert agentkey_server.tool.executions() == 1


def test_reserialised_json_body_is_refused(agentkey_server: Served, client: httpx.Client) -> None:
    """An opaque key is bound to the body's bytes: other spacing or member order is a 422."""
    key = str(uuid.uuid4())
    first = post(client, "/tools/charge", key, raw=b'{"amount": 5, "currency": "eur"}')
    again = post(client, "/tools/charge", key, raw=b'{ "currency":"eur","amount":5 }')
    same = post(client, "/tools/charge", key, raw=b'{"amount": 5, "currency": "eur"}')
    assert (first.status_code, again.status_code, same.status_code) == (201, 422, 201)
    assert problem(again) == "payload_mismatch"
    assert same.headers[REPLAY_HEADER] == "true"
    assert agentkey_server.tool.executions() == 1


@pytest.mark.parametrize("form", sorted(FORMS))
def test_same_key_with_another_body_gets_422(
    agentkey_server: Served, client: httpx.Client, form: str
) -> None:
    """Reusing an ordinary key with another body is refused with 422; the tool does not run."""
    key = FORMS[form](str(uuid.uuid4()))
    first = post(client, "/tools/charge", key, BODY)
    other = post(client, "/tools/charge", key, OTHER_BODY)
    assert first.status_code == 201
    assert other.status_code == 422
    assert problem(other) == "payload_mismatch"
    assert REPLAY_HEADER.lower() not in other.headers
    assert agentkey_server.tool.executions() == 1


@pytest.mark.parametrize("form", sorted(FORMS))
def test_same_key_on_another_route_gets_422_key_reused(
    agentkey_server: Served, client: httpx.Client, form: str
) -> None:
    """The same key and body on another route is refused with 422 key_reused, never replayed."""
    key = FORMS[form](str(uuid.uuid4()))
    first = post(client, "/tools/charge", key)
    elsewhere = post(client, "/v2/tools/charge", key)
    assert first.status_code == 201
    assert elsewhere.status_code == 422
    assert problem(elsewhere) == "key_reused"
    assert REPLAY_HEADER.lower() not in elsewhere.headers
    assert agentkey_server.tool.executions("/tools/charge") == 1
    assert agentkey_server.tool.executions("/v2/tools/charge") == 0


def test_missing_key_gets_400(agentkey_server: Served, client: httpx.Client) -> None:
    """A request without Idempotency-Key gets 400 and never reaches the tool."""
    answer = post(client, "/tools/charge", None)
    assert answer.status_code == 400
    assert problem(answer) == "idempotency_key_missing"
    assert agentkey_server.tool.executions() == 0


def test_duplicate_in_flight_gets_409_then_replays(
    agentkey_server: Served, client: httpx.Client
) -> None:
    """A duplicate of a running request gets 409 + Retry-After at once; after it, a replay."""
    key = str(uuid.uuid4())
    gate = agentkey_server.tool.gates["charge"] = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(post, client, "/tools/charge", key)
        try:
            assert agentkey_server.tool.entered("charge").wait(10)
            duplicate = post(client, "/tools/charge", key)
        finally:
            gate.set()
        ran = first.result(timeout=10)
    later = post(client, "/tools/charge", key)
    assert duplicate.status_code == 409
    assert problem(duplicate) == "in_progress"
    assert int(duplicate.headers["retry-after"]) >= 0
    assert ran.status_code == 201
    assert later.headers[REPLAY_HEADER] == "true"
    assert later.json() == ran.json()
    assert agentkey_server.tool.executions() == 1
