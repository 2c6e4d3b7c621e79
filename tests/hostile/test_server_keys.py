"""Hostile clients against the server: crafted opaque keys and key reuse across operations."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
from hypothesis import assume, given
from hypothesis import strategies as st

from agentkey.server import MemoryStore
from agentkey.server._decide import OpaqueKey, _parse_key
from agentkey.server._decide import record_key as _record_key
from tests.server._apps import tool_app
from tests.server._util import request_for, serve_closing

_PRINTABLE = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=255
)


@given(_PRINTABLE, _PRINTABLE)
def test_distinct_opaque_keys_never_share_a_record(one: str, two: str) -> None:
    """Two different opaque keys get two record keys, with no brace to bend a Cluster hash tag."""
    # HTTP drops the spaces and tabs around a field value (RFC 9110 5.5): "0" and "0 " are
    # one key on the wire, and the middleware reads them so.
    assume(one.strip(" \t") != two.strip(" \t"))
    parsed = [_parse_key([k.encode()]) for k in (one, two)]
    assume(all(isinstance(p, OpaqueKey) for p in parsed))
    first, second = (_record_key("alice", p) for p in parsed)  # type: ignore[arg-type]
    assert first != second
    assert "{" not in first
    assert "}" not in first


def test_crafted_keys_run_as_separate_operations() -> None:
    """ "a{b}", its percent-encoding and a case variant are three keys: none replays another."""
    store = MemoryStore()
    app = tool_app(store)
    body = b'{"amount":5}'
    keys = ["a{b}", "a%7Bb%7D", "A{B}"]
    with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
        answers = [client.post("/ok", headers={"idempotency-key": k}, content=body) for k in keys]
    assert [a.status_code for a in answers] == [201, 201, 201]
    assert not any("idempotent-replayed" in a.headers for a in answers)
    assert app.state.runs["ok"] == 3


def test_a_key_cannot_fetch_another_routes_stored_answer() -> None:
    """A client reusing a finished step's key on another route gets 422, never that answer."""
    store = MemoryStore()
    app = tool_app(store)
    headers, body = request_for({"status": 201, "size": 10, "amount": 5})
    with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
        secret = client.post("/big", headers=headers, content=body)
        probes: list[Any] = [
            client.post(path, headers=headers, content=body) for path in ("/ok", "/status", "/big/")
        ]
        opaque = {"idempotency-key": str(uuid.uuid4())}
        client.post("/big", headers=opaque, content=body)
        probes.append(client.post("/ok", headers=opaque, content=body))
    assert secret.status_code == 200
    for probe in probes:
        assert (probe.status_code, probe.json()["error"]) == (422, "key_reused")
        assert secret.content not in probe.content
