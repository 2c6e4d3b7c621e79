"""MCP key conventions on the wire, from a client that is not the MCP SDK (issue 37).

The client here writes JSON-RPC over streamable HTTP by hand with httpx, each convention as
its spec or binding shows it, against agentkey's middleware in the SDK's server under
uvicorn on loopback; executions are counted on the server. Before, every convention but
agentkey's own ran the tool twice on a resend.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agentkey.server import MemoryStore
from tests.integrations._mcp_app import Lab, running

pytestmark = pytest.mark.timeout(60)


class RawMCP:
    """A bare streamable HTTP MCP client: initialize, then tools/call with params as given."""

    def __init__(self, client: httpx.Client, url: str) -> None:
        self.client, self.url, self.session = client, url, ""
        self.ids = iter(range(1, 1000))
        self.post({"method": "initialize", "params": _INIT}, request=True)
        self.post({"method": "notifications/initialized"}, request=False)

    def post(self, message: dict[str, Any], *, request: bool) -> dict[str, Any]:
        body = {"jsonrpc": "2.0", **message}
        if request:
            body["id"] = next(self.ids)
        headers = {
            "accept": "application/json, text/event-stream",
            "mcp-protocol-version": "2025-11-25",
        }
        if self.session:
            headers["mcp-session-id"] = self.session
        reply = self.client.post(self.url, json=body, headers=headers)
        reply.raise_for_status()
        self.session = reply.headers.get("mcp-session-id", self.session)
        if not request:
            return {}
        data = [line[5:] for line in reply.text.splitlines() if line.startswith("data:")]
        answer: dict[str, Any] = json.loads(data[-1] if data else reply.text)
        return answer

    def call(self, params: dict[str, Any]) -> dict[str, Any]:
        return self.post({"method": "tools/call", "params": params}, request=True)


_INIT = {
    "protocolVersion": "2025-11-25",
    "capabilities": {},
    "clientInfo": {"name": "raw-wire", "version": "0"},
}


@pytest.fixture
def served() -> Iterator[tuple[Lab, RawMCP]]:
    with running(MemoryStore()) as lab, httpx.Client(timeout=20) as client:
        yield lab, RawMCP(client, lab.url + "/mcp")


def _params(convention: str, key: str) -> tuple[str, dict[str, Any]]:
    """The tool and the ``tools/call`` params of each convention, as its writers send them."""
    if convention == "agentkey":
        meta = {"io.agentkey/idempotency-key": key}
        return "create_vm", {"name": "create_vm", "arguments": {"region": "r"}, "_meta": meta}
    if convention == "sep-3182":
        plain: dict[str, Any] = {"region": "r"}
        return "create_vm", {"name": "create_vm", "arguments": plain, "idempotencyKey": key}
    if convention == "sep-3182-meta":
        meta = {"idempotencyKey": key}
        return "create_vm", {"name": "create_vm", "arguments": {"region": "r"}, "_meta": meta}
    if convention == "ucp":
        args: dict[str, Any] = {"cart": "c-1", "meta": {"idempotency-key": key}}
        return "checkout", {"name": "checkout", "arguments": args}
    return "transfer", {"name": "transfer", "arguments": {"amount": 9, "idempotency_key": key}}


@pytest.mark.parametrize("convention", ["agentkey", "sep-3182", "sep-3182-meta", "ucp", "argument"])
def test_each_convention_on_the_raw_wire_runs_once(
    served: tuple[Lab, RawMCP], convention: str
) -> None:
    """The same tools/call with its key in one convention, sent twice on the raw wire: one
    execution, the second answer is the stored result marked replayed (before: 2 executions
    for every convention but agentkey's)."""
    lab, wire = served
    tool, params = _params(convention, str(uuid.uuid4()))
    first = wire.call(params)["result"]
    again = wire.call(params)["result"]
    assert lab.runs[tool] == 1
    assert again["_meta"]["io.agentkey/replayed"] is True
    assert again["content"] == first["content"]


def test_two_keys_on_the_raw_wire_are_refused(served: tuple[Lab, RawMCP]) -> None:
    """params.idempotencyKey and the agentkey _meta field with different keys: a JSON-RPC error
    naming both fields, and the tool never ran."""
    lab, wire = served
    params = {
        "name": "create_vm",
        "arguments": {"region": "r"},
        "idempotencyKey": "one",
        "_meta": {"io.agentkey/idempotency-key": "two"},
    }
    error = wire.call(params)["error"]
    assert lab.runs["create_vm"] == 0
    assert error["code"] == -32602
    assert error["data"] == {
        "type": "io.agentkey/invalid-key",
        "fields": ["params._meta['io.agentkey/idempotency-key']", "params.idempotencyKey"],
    }
