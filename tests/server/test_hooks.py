"""The middleware reports one DecisionEvent per request to its hooks, after the answer is sent."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest

from agentkey import ConfigurationError, StoreUnavailable
from agentkey.server import DecisionEvent, IdempotencyMiddleware, MemoryStore
from agentkey.server._decide import Checked, check_request
from agentkey.server._records import encode_in_progress
from tests.server._apps import tool_app
from tests.server._util import request_for, serve_closing


def test_every_decision_reaches_the_hooks() -> None:
    """Claimed, replay, mismatch, rejected, in doubt, in_doubt answered, failed and
    passthrough: each reported once."""
    events: list[DecisionEvent] = []
    store = MemoryStore()
    app = tool_app(store, hooks=[events.append], require_key=True, routes=["/ok", "/fail"])
    headers, body = request_for({"n": 1})
    with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
        expected: list[tuple[str, str, int]] = []

        def post(path: str, hdrs: dict[str, str], content: bytes, want: tuple[str, int]) -> None:
            response = client.post(path, headers=hdrs, content=content)
            assert response.status_code == want[1]
            expected.append((want[0], path, want[1]))

        post("/ok", headers, body, ("claimed", 201))
        post("/ok", headers, body, ("replay", 201))
        post("/fail", headers, body, ("mismatch", 422))  # the key belongs to /ok
        post("/ok", {}, body, ("rejected", 400))
        fail_headers, fail_body = request_for({"mutate": False})
        fail_headers["connection"] = "close"  # uvicorn drops a connection whose app raised
        post("/fail", fail_headers, fail_body, ("in_doubt", 500))  # it may have started
        post("/fail", fail_headers, fail_body, ("in_doubt", 409))  # the retry is told so
        fail_headers, fail_body = request_for({"mutate": True})
        fail_headers["connection"] = "close"
        post("/fail", fail_headers, fail_body, ("failed", 500))
        post("/status", headers, b'{"status": 200}', ("passthrough", 200))  # not protected
    got = [(e.decision, e.route, e.status_code) for e in events]
    assert got == expected
    assert all(e.method == "POST" for e in events)
    assert events[0].idempotency_key == headers["idempotency-key"]
    assert events[3].idempotency_key is None
    assert events[-1].idempotency_key is None


def test_conflict_and_unavailable_reach_the_hooks() -> None:
    """A 409 for a key in flight and a 503 for a failing store are reported as such."""
    events: list[DecisionEvent] = []

    class Down(MemoryStore):
        async def claim(self, key: str, value: bytes, *, ttl_ms: int) -> bytes | None:
            raise StoreUnavailable("down")

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the handler must not run")

    store = MemoryStore()
    headers, body = request_for({"n": 2})
    checked = check_request([headers["idempotency-key"]], ("POST", "/x"), body)
    assert isinstance(checked, Checked)

    async def post(middleware: IdempotencyMiddleware) -> int:
        transport = httpx.ASGITransport(app=middleware)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return (await client.post("/x", headers=headers, content=body)).status_code

    async def run() -> None:
        assert (
            await post(
                IdempotencyMiddleware(
                    app, store=Down(), hooks=[events.append], shared_key_space=True
                )
            )
            == 503
        )
        held = encode_in_progress("c" * 32, 0)  # another request holds the key
        await store.claim(checked.record_key("shared"), held, ttl_ms=10_000)
        assert (
            await post(
                IdempotencyMiddleware(
                    app, store=store, hooks=[events.append], shared_key_space=True
                )
            )
            == 409
        )

    anyio.run(run)
    assert [(e.decision, e.status_code) for e in events] == [
        ("unavailable", 503),
        ("conflict", 409),
    ]


@pytest.mark.parametrize("hooks", [print, ["not callable"]])
def test_hooks_must_be_a_sequence_of_callables(hooks: Any) -> None:
    """A bare callable or a non-callable hook is a ConfigurationError, not a silent no-op."""
    with pytest.raises(ConfigurationError, match="hooks"):
        IdempotencyMiddleware(
            lambda *a: None,  # type: ignore[arg-type]
            store=MemoryStore(),
            hooks=hooks,
            shared_key_space=True,
        )
