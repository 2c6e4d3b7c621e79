"""Other agent libraries' keys with ':' against agentkey's middleware (issue 37, item 4).

Each key is built exactly as its library builds it (justonce 0.2.0 ``operation_key``,
deduplex 0.1.0 ``derive_key``, DBOS's ``<workflow id>:<step>``), sent by a plain HTTP
client to agentkey's IdempotencyMiddleware on a real Redis, served by uvicorn; the tool
counts its executions. A key that does not claim agentkey's own format is opaque; one
that does (three parts, a ``step_`` middle or a 64-hex last part) must parse as one.
"""

from __future__ import annotations

import hashlib
import json
import uuid

import httpx
import pytest

from agentkey import PlanSession
from agentkey.server._decide import parse_key
from tests._loopback import RedisServer

from ._support import serve_agentkey

pytestmark = pytest.mark.redis


def _deduplex_key(*parts: object, namespace: str) -> str:
    """deduplex 0.1.0 ``derive_key``: ``<namespace>:<sha256 of the canonical parts>``."""
    canonical = json.dumps(
        {"namespace": namespace, "parts": parts},
        sort_keys=True,
        default=str,
        separators=(",", ":"),
    )
    return f"{namespace}:{hashlib.sha256(canonical.encode()).hexdigest()}"


#: (peer, key) as each library builds it.
PEER_KEYS = [
    ("justonce", "charge:v1:order_123"),  # operation_key("charge", "order_123")
    ("justonce-run", "charge:v1:run:0"),  # operation_key("charge", "run", 0)
    ("deduplex", _deduplex_key("cus_42", 1999, namespace="stripe.charge")),
    ("dbos", f"{uuid.uuid4()}:3"),  # a workflow id and its step's function id
    ("sf-string", '"charge:v1:order_124"'),  # an RFC 8941 string of such a key
]


@pytest.mark.parametrize(("peer", "key"), PEER_KEYS, ids=[p for p, _ in PEER_KEYS])
def test_a_peer_key_with_colons_is_opaque(redis_proc: RedisServer, peer: str, key: str) -> None:
    """The peer's key runs the tool once, its resend is replayed, and another body under it
    is refused 422 (before: 400 "must be an agentkey key", the tool never ran)."""
    with serve_agentkey(redis_proc) as served, httpx.Client(base_url=served.url) as client:
        url = "/tools/charge"
        first = client.post(url, json={"amount": 5}, headers={"Idempotency-Key": key})
        again = client.post(url, json={"amount": 5}, headers={"Idempotency-Key": key})
        other = client.post(url, json={"amount": 7}, headers={"Idempotency-Key": key})
    assert first.status_code == 201, first.text
    assert again.status_code == 201, again.text
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.json() == first.json()
    assert other.status_code == 422, other.text
    assert other.json()["type"] == "urn:agentkey:problem:payload_mismatch"
    assert served.tool.executions() == 1


_HASH = "a" * 64


@pytest.mark.parametrize(
    "key",
    [
        f"plan-1:step_3:{_HASH}",  # a step label, not canonical
        "plan-1:step_003:not-a-digest",  # a step label, no digest
        f"plan-1:v1:{_HASH.upper()}",  # a 64-hex digest, in capitals
        f"plan 1:run:{_HASH}",  # a 64-hex digest, a plan id agentkey never makes
    ],
)
def test_a_malformed_agentkey_key_is_still_refused(redis_proc: RedisServer, key: str) -> None:
    """A key that claims agentkey's format but breaks it is 400 ``idempotency_key_invalid``,
    and the tool never runs: it is not read as opaque, which would drop its hash check."""
    with serve_agentkey(redis_proc) as served, httpx.Client(base_url=served.url) as client:
        answer = client.post("/tools/charge", json={"amount": 5}, headers={"Idempotency-Key": key})
    assert answer.status_code == 400, answer.text
    assert answer.json()["type"] == "urn:agentkey:problem:idempotency_key_invalid"
    assert key not in answer.text  # a key is a bearer secret: shown redacted if at all
    assert served.tool.executions() == 0


def test_an_agentkey_key_whose_hash_does_not_match_the_body_is_refused(
    redis_proc: RedisServer,
) -> None:
    """A well-formed agentkey key sent with another body stays 422 ``args_hash_mismatch``."""
    step = PlanSession.new().step(0, "charge", {"amount": 5})
    with serve_agentkey(redis_proc) as served, httpx.Client(base_url=served.url) as client:
        answer = client.post(
            "/tools/charge", json={"amount": 7}, headers={"Idempotency-Key": step.idempotency_key}
        )
    assert answer.status_code == 422, answer.text
    assert answer.json()["type"] == "urn:agentkey:problem:args_hash_mismatch"
    assert served.tool.executions() == 0


@pytest.mark.parametrize(
    ("key", "agentkeys"),
    [
        ("charge:v1:run:0", False),
        ("a:b", False),
        ("a:b:c", False),
        (f"ns:{_HASH}", False),
        (f"ns:x:{_HASH}", True),
        ("ns:STEP_x:y", True),
        (f'"ns:step_001:{_HASH}"', True),
    ],
)
def test_which_keys_claim_agentkeys_format(key: str, agentkeys: bool) -> None:
    """Three parts with a ``step_`` middle or a 64-hex last part claim agentkey's format."""
    parsed = parse_key([key])
    claimed = not hasattr(parsed, "text")  # an OpaqueKey has .text; a Reject or StepKey not
    assert claimed is agentkeys, parsed
