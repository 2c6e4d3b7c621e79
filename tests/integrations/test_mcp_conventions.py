"""MCP: the middleware reads every idempotency-key convention in use (issue 37, item 1).

Each convention is sent by a plain SDK client, written out by hand on the wire, to the
SDK's streamable HTTP app under uvicorn on loopback; executions are counted on the
server. Before, only ``_meta["io.agentkey/idempotency-key"]`` was read: a resend in any
other convention ran the tool a second time.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import pytest
from mcp import ClientSession
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolRequest, CallToolRequestParams, CallToolResult, RequestParamsMeta

from agentkey import ConfigurationError, PlanSession, RetryPolicy
from agentkey.integrations.mcp import IdempotentSession, IdempotentToolsMiddleware, connect
from agentkey.integrations.mcp._wire import KEY_FIELD, PROTECTED_FIELD, REPLAYED_FIELD, with_key
from agentkey.server import MemoryStore
from tests.integrations._mcp_app import running

pytestmark = pytest.mark.timeout(60)

FAST = RetryPolicy(max_attempts=4, deadline=20.0, initial_backoff=0.01, max_backoff=0.05)


class _SepParams(CallToolRequestParams):
    idempotency_key: str | None = None  # on the wire: params.idempotencyKey


class _SepCall(CallToolRequest):
    params: _SepParams


@dataclass(frozen=True)
class Convention:
    """One convention as a plain client writes it: the tool it fits, and how to send."""

    name: str
    tool: str
    args: dict[str, Any]  # the arguments without the key
    send: Callable[[ClientSession, str, dict[str, Any], str], Awaitable[CallToolResult]]


async def _agentkey(s: ClientSession, tool: str, args: dict[str, Any], key: str) -> CallToolResult:
    return await s.call_tool(tool, args, meta=cast(RequestParamsMeta, {KEY_FIELD: key}))


async def _sep(s: ClientSession, tool: str, args: dict[str, Any], key: str) -> CallToolResult:
    request = _SepCall(params=_SepParams(name=tool, arguments=args, idempotency_key=key))
    return await s.send_request(request, CallToolResult)


async def _sep_meta(s: ClientSession, tool: str, args: dict[str, Any], key: str) -> CallToolResult:
    return await s.call_tool(tool, args, meta=cast(RequestParamsMeta, {"idempotencyKey": key}))


async def _ucp(s: ClientSession, tool: str, args: dict[str, Any], key: str) -> CallToolResult:
    return await s.call_tool(tool, {**args, "meta": {"idempotency-key": key}})


async def _argument(s: ClientSession, tool: str, args: dict[str, Any], key: str) -> CallToolResult:
    return await s.call_tool(tool, {**args, "idempotency_key": key})


CONVENTIONS = [
    Convention("agentkey", "create_vm", {"region": "eu-west-1"}, _agentkey),
    Convention("sep-3182", "create_vm", {"region": "eu-west-1"}, _sep),
    Convention("sep-3182-meta", "create_vm", {"region": "eu-west-1"}, _sep_meta),
    Convention("ucp", "checkout", {"cart": "c-1"}, _ucp),
    Convention("argument", "transfer", {"amount": 5}, _argument),
]
BY_NAME = {c.name: c for c in CONVENTIONS}


def agentkey_key(args: dict[str, Any]) -> str:
    """An agentkey key built with the stdlib: its args_hash covers the arguments sent."""
    body = json.dumps(args, sort_keys=True, separators=(",", ":")).encode()
    return f"{uuid.uuid4()}:step_001:{hashlib.sha256(body).hexdigest()}"


@pytest.mark.parametrize("convention", CONVENTIONS, ids=lambda c: c.name)
async def test_a_resend_in_each_convention_runs_once(convention: Convention) -> None:
    """The same key sent twice in one convention runs the tool once; the second call gets the
    stored result, marked replayed (before: 2 executions for every convention but agentkey's)."""
    key = str(uuid.uuid4())
    with running(MemoryStore()) as lab:
        async with connect(lab.url + "/mcp") as s:
            first = await convention.send(s, convention.tool, convention.args, key)
            again = await convention.send(s, convention.tool, convention.args, key)
        assert lab.runs[convention.tool] == 1
    assert (first.meta or {}).get(PROTECTED_FIELD) is True
    assert (again.meta or {}).get(REPLAYED_FIELD) is True
    assert again.content == first.content


@pytest.mark.parametrize("name", ["ucp", "argument"])
async def test_a_key_inside_the_arguments_binds_the_other_arguments(name: str) -> None:
    """A key carried in the arguments is left out of what it binds: an agentkey key whose
    args_hash covers the other arguments is accepted and replayed; the same key with other
    arguments is refused as payload-mismatch, and nothing runs a second time."""
    convention = BY_NAME[name]
    key = agentkey_key(convention.args)
    changed = {k: (f"{v}x" if isinstance(v, str) else v + 1) for k, v in convention.args.items()}
    with running(MemoryStore()) as lab:
        async with connect(lab.url + "/mcp") as s:
            await convention.send(s, convention.tool, convention.args, key)
            again = await convention.send(s, convention.tool, convention.args, key)
            with pytest.raises(MCPError) as mismatch:
                await convention.send(s, convention.tool, changed, key)
        assert lab.runs[convention.tool] == 1
    assert (again.meta or {}).get(REPLAYED_FIELD) is True
    assert mismatch.value.data == {"type": "io.agentkey/payload-mismatch"}


async def test_a_ucp_meta_with_more_than_the_key_binds_the_rest() -> None:
    """UCP's meta object also holds other fields: they stay in what the key binds, so the
    same key with another meta field is a payload mismatch."""
    key = str(uuid.uuid4())
    with running(MemoryStore()) as lab:
        async with connect(lab.url + "/mcp") as s:
            meta = {"idempotency-key": key, "ucp-agent": "a1"}
            await s.call_tool("checkout", {"cart": "c-9", "meta": meta})
            again = await s.call_tool("checkout", {"cart": "c-9", "meta": meta})
            with pytest.raises(MCPError) as mismatch:
                await s.call_tool("checkout", {"cart": "c-9", "meta": {**meta, "ucp-agent": "a2"}})
        assert lab.runs["checkout"] == 1
    assert (again.meta or {}).get(REPLAYED_FIELD) is True
    assert mismatch.value.data == {"type": "io.agentkey/payload-mismatch"}


async def test_disagreeing_conventions_are_refused_and_nothing_runs() -> None:
    """Two different keys in two conventions: refused as invalid-key naming both fields,
    nothing runs; the same key in both is one key (runs once, then replays)."""
    with running(MemoryStore()) as lab:
        async with connect(lab.url + "/mcp") as s:
            meta = cast(RequestParamsMeta, {KEY_FIELD: "key-a"})
            with pytest.raises(MCPError) as caught:
                await s.call_tool("transfer", {"amount": 3, "idempotency_key": "key-b"}, meta=meta)
            assert lab.runs["transfer"] == 0
            both = cast(RequestParamsMeta, {KEY_FIELD: "key-c", "idempotencyKey": "key-c"})
            await s.call_tool("transfer", {"amount": 3, "idempotency_key": "key-c"}, meta=both)
            again = await s.call_tool("transfer", {"amount": 3, "idempotency_key": "key-c"})
        assert lab.runs["transfer"] == 1
    assert caught.value.code == -32602
    assert caught.value.data == {
        "type": "io.agentkey/invalid-key",
        "fields": [f"params._meta[{KEY_FIELD!r}]", "arguments.idempotency_key"],
    }
    assert "different idempotency keys" in caught.value.message
    assert "key-a" not in caught.value.message  # keys are never echoed
    assert (again.meta or {}).get(REPLAYED_FIELD) is True


@pytest.mark.parametrize("convention", CONVENTIONS, ids=lambda c: c.name)
async def test_require_key_is_satisfied_by_each_convention(convention: Convention) -> None:
    """With require_key=True a key in any accepted convention lets the call run (before:
    refused as key-required for every convention but agentkey's); no key is refused."""
    with running(MemoryStore(), require_key=True) as lab:
        async with connect(lab.url + "/mcp") as s:
            got = await convention.send(s, convention.tool, convention.args, str(uuid.uuid4()))
            with pytest.raises(MCPError) as missing:
                await s.call_tool(convention.tool, convention.args)
        assert lab.runs[convention.tool] == 1
    assert (got.meta or {}).get(PROTECTED_FIELD) is True
    assert missing.value.data == {"type": "io.agentkey/key-required"}
    assert "params.idempotencyKey" in missing.value.message  # says where a key may go


async def test_key_conventions_restricts_what_is_read_and_is_advertised() -> None:
    """key_conventions=("sep-3182",): a key in another convention is not read (the tool runs
    each time, as without a key), params.idempotencyKey is; tools/list names the set."""
    with running(MemoryStore(), key_conventions=["sep-3182"], require_key=False) as lab:
        async with connect(lab.url + "/mcp") as s:
            for _ in range(2):
                await _argument(s, "transfer", {"amount": 1}, "k-arg")
            for _ in range(2):
                await _sep(s, "transfer", {"amount": 1}, "k-sep")
            listed = await s.list_tools()
        assert lab.runs["transfer"] == 3
    marks = {tool.name: tool.meta for tool in listed.tools}
    assert marks["transfer"] == {PROTECTED_FIELD: True, "io.agentkey/key-conventions": ["sep-3182"]}


def test_key_conventions_must_name_known_conventions() -> None:
    """An unknown, empty or one-string key_conventions is a ConfigurationError at once."""
    for bad in (["agentkey", "stripe"], [], "agentkey"):
        with pytest.raises(ConfigurationError, match="key_conventions"):
            IdempotentToolsMiddleware(
                MemoryStore(), shared_key_space=True, key_conventions=cast(Any, bad)
            )


@pytest.mark.parametrize(
    ("name", "tool", "args"),
    [
        ("sep-3182", "create_vm", {"region": "eu-south-1"}),
        ("sep-3182-meta", "create_vm", {"region": "eu-south-2"}),
        ("ucp", "checkout", {"cart": "c-7"}),
        ("argument", "transfer", {"amount": 7}),
    ],
)
async def test_the_client_sends_the_convention_the_server_advertises(
    name: str, tool: str, args: dict[str, Any]
) -> None:
    """A server that reads only another convention (and requires a key): the session learns
    it from tools/list after the key-required refusal and sends the key there; the next
    call goes there at once, and its lost answer is resent and replayed: 1 execution per call
    (before: KeyRejected, nothing ran)."""
    with running(MemoryStore(), require_key=True, key_conventions=[name]) as lab:
        async with connect(lab.url + "/mcp") as s:
            tools = IdempotentSession(s, PlanSession.new(), policy=FAST)
            first = await tools.call_tool(tool, args)
            lab.drop[tool] = 1
            second = await tools.call_tool(tool, args)  # a second operation, its answer lost
        assert lab.runs[tool] == 2
    assert (first.attempts, first.replayed) == (1, False)
    assert (second.attempts, second.replayed) == (2, True)


async def test_the_client_sends_agentkeys_convention_by_default() -> None:
    """Against a server that reads every convention, the session's key goes in agentkey's own
    field (a server that reads only that one runs it once and replays it)."""
    with running(MemoryStore(), key_conventions=["agentkey"], require_key=True) as lab:
        lab.drop["create_vm"] = 1
        async with connect(lab.url + "/mcp") as s:
            got = await IdempotentSession(s, PlanSession.new(), policy=FAST).call_tool(
                "create_vm", {"region": "eu-west-9"}
            )
        assert lab.runs["create_vm"] == 1
    assert got.replayed


async def test_a_call_run_without_a_key_the_server_reads_tells_the_client_where() -> None:
    """A server that reads only the argument convention and does not require a key: the
    first call runs unkeyed, its result names the convention, and the next call sends its
    key there, so its lost answer is resent and replayed: 1 execution each."""
    with running(MemoryStore(), key_conventions=["argument"], require_key=False) as lab:
        async with connect(lab.url + "/mcp") as s:
            tools = IdempotentSession(s, PlanSession.new(), policy=FAST)
            first = await tools.call_tool("transfer", {"amount": 4})
            lab.drop["transfer"] = 1
            second = await tools.call_tool("transfer", {"amount": 4})
        assert lab.runs["transfer"] == 2
    assert PROTECTED_FIELD not in (first.result.meta or {})
    assert (first.result.meta or {}).get("io.agentkey/key-conventions") == ["argument"]
    assert (second.attempts, second.replayed) == (2, True)


async def test_an_argument_key_without_a_caller_scope_is_refused_unless_left_out() -> None:
    """On a server with no OAuth, principal= or shared key space, a tool's plain
    idempotency_key argument is now a key: refused as unauthenticated (nothing runs), and
    key_conventions without "argument" keeps the old pass-through."""
    with running(MemoryStore(), principal=None) as strict:
        async with connect(strict.url + "/mcp") as s:
            with pytest.raises(MCPError) as caught:
                await _argument(s, "transfer", {"amount": 2}, "k-1")
        assert strict.runs["transfer"] == 0
    assert caught.value.data == {"type": "io.agentkey/unauthenticated"}
    others = ["agentkey", "sep-3182", "sep-3182-meta", "ucp"]
    with running(MemoryStore(), principal=None, key_conventions=others, require_key=False) as old:
        async with connect(old.url + "/mcp") as s:
            await _argument(s, "transfer", {"amount": 2}, "k-1")
            await _argument(s, "transfer", {"amount": 2}, "k-1")
        assert old.runs["transfer"] == 2


@pytest.mark.parametrize(
    ("name", "tool", "plain", "own"),
    [
        ("argument", "transfer", {"amount": 5}, {"idempotency_key": "order-42"}),
        ("ucp", "checkout", {"cart": "c-9"}, {"meta": {"idempotency-key": "order-43"}}),
    ],
)
async def test_the_client_never_overwrites_the_callers_own_key_field(
    name: str, tool: str, plain: dict[str, Any], own: dict[str, Any]
) -> None:
    """A server that reads the key only where the call already holds the caller's own value:
    the client refuses with ConfigurationError and sends nothing (1 execution: the first,
    plain call); before, the caller's value was replaced by agentkey's key and the tool ran
    a second time."""
    with running(MemoryStore(), require_key=True, key_conventions=[name]) as lab:
        async with connect(lab.url + "/mcp") as s:
            tools = IdempotentSession(s, PlanSession.new(), policy=FAST)
            await tools.call_tool(tool, plain)  # learns where this server reads the key
            with pytest.raises(ConfigurationError, match="will not overwrite") as caught:
                await tools.call_tool(tool, {**plain, **own})
        assert lab.runs[tool] == 1
    assert "order-4" not in str(caught.value)
    assert repr(name) in str(caught.value)


def test_with_key_refuses_another_value_in_each_field_it_writes() -> None:
    """Pure rule: each convention's field holding another value is refused (the tool named);
    the same value, or an empty field, is filled as before."""
    cases: list[tuple[Any, dict[str, Any], dict[str, Any]]] = [
        ("agentkey", {}, {KEY_FIELD: "other"}),
        ("sep-3182-meta", {}, {"idempotencyKey": "other"}),
        ("ucp", {"meta": {"idempotency-key": "other"}}, {}),
        ("ucp", {"meta": "not an object"}, {}),
        ("argument", {"idempotency_key": "other"}, {}),
    ]
    for convention, arguments, meta in cases:
        with pytest.raises(ConfigurationError, match="'pay'"):
            with_key(convention, "K", arguments, meta, tool="pay")
    args, _, _ = with_key("argument", "K", {"idempotency_key": "K", "a": 1}, {})
    assert args == {"idempotency_key": "K", "a": 1}
    args, _, _ = with_key("ucp", "K", {"meta": {"x": 1}}, {})
    assert args == {"meta": {"x": 1, "idempotency-key": "K"}}
    args, meta, _ = with_key("agentkey", "K", {"idempotency_key": "theirs"}, {})
    assert (args, meta) == ({"idempotency_key": "theirs"}, {KEY_FIELD: "K"})
