"""claim.key_for(): keys for the handler's own downstream calls (issue 35, item 4).

A tool server whose handler calls a second agentkey-protected service is SIGKILLed right
after that call, restarted, and the agent retries with the same key: the downstream side
effect runs once, counted on the downstream server (real uvicorn on loopback, its records
on the session's Redis). The derived key is checked for what it must and must not carry.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from mcp.server.mcpserver import MCPServer
from mcp_types import RequestParamsMeta
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentkey import InvalidKey
from agentkey.integrations.mcp import IdempotentToolsMiddleware, connect
from agentkey.integrations.mcp._wire import KEY_FIELD
from agentkey.server import Claim, IdempotencyMiddleware, MemoryStore, RedisStore, current_claim
from agentkey.server._records import Binding, digest
from tests._loopback import RedisServer, free_port, serve
from tests.server._util import request_for, serve_closing

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def _payments(redis_url: str) -> Iterator[tuple[str, Counter[str]]]:
    """The downstream service: charges behind IdempotencyMiddleware on Redis, counted here."""
    charges: Counter[str] = Counter()

    async def charge(request: Request) -> JSONResponse:
        args = await request.json()
        current_claim().begin_mutation()
        charges[request.headers["idempotency-key"]] += 1
        return JSONResponse({"charged": args["amount"]}, 201)

    store = RedisStore(redis_url, prefix="pay-" + uuid.uuid4().hex[:8])
    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/charge", charge, methods=["POST"])]),
        store=store,
        shared_key_space=True,
    )
    with serve_closing(app, store) as url:
        yield url, charges


@contextmanager
def _shop(env: dict[str, str]) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The tool server under test, in its own process (``tests/server/_downstream_app.py``)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", "tests.server._downstream_app:app",
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        cwd=ROOT, env={**os.environ, **env},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):  # up to ~30 s under load; bounded by attempts
            if proc.poll() is not None:
                raise RuntimeError("the tool server exited at start")
            try:
                httpx.get(url + "/", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.realtime  # processes killed and started again
@pytest.mark.parametrize(("keying", "charges_expected"), [("key_for", 1), ("fresh", 2)])
def test_a_handler_killed_after_its_downstream_call_charges_once_with_key_for(
    redis_proc: RedisServer, tmp_path: Path, keying: str, charges_expected: int
) -> None:
    """Killed after its downstream charge and run again: key_for charges once; a fresh key twice."""
    keys, crash = tmp_path / "keys", tmp_path / "crash"
    with _payments(redis_proc.url) as (payments, charges):
        env = {
            "AGENTKEY_TEST_DOWNSTREAM": payments,
            "AGENTKEY_TEST_KEYS": str(keys),
            "AGENTKEY_TEST_CRASH": str(crash),
            "AGENTKEY_TEST_KEYING": keying,
        }
        headers, body = request_for({"amount": 42})
        headers["x-tenant"] = "acme"
        crash.touch()
        with _shop(env) as (shop, proc):
            with pytest.raises(httpx.TransportError):  # the server died mid-request
                httpx.post(shop + "/tools/order", headers=headers, content=body, timeout=30)
            assert proc.wait(timeout=10) < 0  # killed by its own SIGKILL
        assert sum(charges.values()) == 1  # the first run did charge
        with _shop(env) as (shop, _):  # restarted; the agent retries with the same key
            again = httpx.post(shop + "/tools/order", headers=headers, content=body, timeout=30)
    assert again.status_code == 201, again.text
    sent = keys.read_text().split()
    assert len(sent) == 2
    assert sum(charges.values()) == charges_expected  # counted on the downstream server
    if keying == "key_for":
        assert sent[0] == sent[1]
        assert charges == Counter({sent[0]: 1})
        assert again.json() == {"charge": {"charged": 42}, "status": 201, "replayed": "true"}
        incoming = headers["idempotency-key"]
        assert incoming not in sent[0]
        assert incoming.rsplit(":", 1)[-1] not in sent[0]  # nor its args_hash
        assert uuid.UUID(sent[0]).version == 8


def _claim(key: str = "plan-1:step_000:" + "a" * 64, **options: Any) -> Claim:
    fields: dict[str, Any] = {
        "key": None,
        "idempotency_key": key,
        "principal": "acme",
        "record_key": "acme:" + key,
        "owner": "o" * 32,
        "store": MemoryStore(),
        "lock_ttl_ms": 15_000,
        "binding": Binding(digest(b"POST /tools/order")),
        **options,
    }
    return Claim(**fields)


def test_the_key_for_a_name_is_the_same_on_every_run_of_the_request() -> None:
    """Two claims of one request (a run and its re-run, other owners) derive the same key."""
    first, second = _claim(owner="1" * 32), _claim(owner="2" * 32)
    assert first.key_for("payments") == second.key_for("payments")
    assert str(uuid.UUID(first.key_for("payments"))) == first.key_for("payments")


def test_the_derivation_is_fixed() -> None:
    """A pinned vector: a changed derivation would give retries already in flight new keys."""
    assert _claim().key_for("payments") == "842a1a7e-d04b-83f5-a16b-8198e9ee91f9"


@pytest.mark.parametrize(
    "other",
    [
        {"idempotency_key": "plan-1:step_001:" + "a" * 64},
        {"principal": "globex"},
        {"binding": Binding(digest(b"POST /tools/refund"))},
        {"binding": None},
    ],
    ids=["another key", "another principal", "another route", "no binding"],
)
def test_another_key_caller_or_route_gets_another_downstream_key(other: dict[str, Any]) -> None:
    """The key, the principal and the route each change the derived key."""
    assert _claim().key_for("payments") != _claim(**other).key_for("payments")


def test_each_name_gets_its_own_key() -> None:
    """Two downstream calls of one handler, two names: two keys."""
    claim = _claim()
    assert claim.key_for("payments") != claim.key_for("ledger.entry")


@pytest.mark.parametrize("name", ["", "a" * 65, "pay ments", "pay:ments", "é", None, 3, b"x"])
def test_a_bad_name_is_refused_with_a_typed_error(name: object) -> None:
    """key_for() refuses a name outside 1-64 of [A-Za-z0-9._~-] with InvalidKey, no key shown."""
    claim = _claim("plan-1:step_000:" + "f" * 64)
    with pytest.raises(InvalidKey, match=r"key_for\(\) takes the name") as raised:
        claim.key_for(name)  # type: ignore[arg-type]
    assert "f" * 64 not in str(raised.value)


def _mcp_server(store: MemoryStore) -> Any:
    middleware = IdempotentToolsMiddleware(store, shared_key_space=True)
    server: MCPServer[Any] = MCPServer("downstream-keys", middleware=[middleware])

    @server.tool()
    def order(amount: int) -> str:
        """Answers the key its downstream charge would carry."""
        return current_claim().key_for("payments")

    return server.streamable_http_app()


async def _mcp_key(url: str, key: str) -> str:
    async with connect(url + "/mcp") as session:
        meta = cast(RequestParamsMeta, {KEY_FIELD: key})
        got = await session.call_tool("order", {"amount": 42}, meta=meta)
    block = got.content[0]
    return str(getattr(block, "text", ""))


async def test_an_mcp_tool_gets_the_same_downstream_key_after_a_restart() -> None:
    """An MCP tool's key_for() is the same after a restart that lost its records."""
    key = "order-" + uuid.uuid4().hex
    seen = []
    for _ in range(2):
        with serve(_mcp_server(MemoryStore()), lifespan="on") as url:
            seen.append(await _mcp_key(url, key))
    with serve(_mcp_server(MemoryStore()), lifespan="on") as url:
        other = await _mcp_key(url, "order-" + uuid.uuid4().hex)
    assert seen[0] == seen[1]
    assert uuid.UUID(seen[0]).version == 8
    assert other != seen[0]
