"""Request bodies through the middleware: read once, checked once, parsed when asked."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentkey import ConfigurationError, InvalidArguments, StepKey, canonical_json
from agentkey.server import IdempotencyMiddleware, MemoryStore, current_claim
from agentkey.server import _claim as claim_module
from agentkey.server._claim import Claim
from agentkey.server._decide import Checked, Reject, check_body
from tests.server._util import new_plan, serve_closing, with_options

OP = ("POST", "/tools/echo")


def _raw_key(body: bytes) -> str:
    """An agentkey key whose args_hash is the SHA-256 of ``body``'s bytes, as they are."""
    return f"{new_plan()}:step_000:{hashlib.sha256(body).hexdigest()}"


class _Tool:
    """A tool that records the bytes it received and what ``claim.json()`` gave it."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.parsed: list[Any] = []

    async def echo(self, request: Request) -> Response:
        self.bodies.append(await request.body())
        return JSONResponse({"run": len(self.bodies)}, status_code=201)

    async def args(self, request: Request) -> Response:
        claim = current_claim()
        try:
            first = claim.json()
        except InvalidArguments as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        assert claim.json() is first  # parsed once, then the same object
        self.parsed.append(first)
        return JSONResponse({"args": first}, status_code=201)

    def app(self, **options: Any) -> tuple[IdempotencyMiddleware, MemoryStore]:
        routes = [
            Route("/tools/echo", self.echo, methods=["POST"]),
            Route("/tools/args", self.args, methods=["POST"]),
        ]
        store = MemoryStore()
        options.setdefault("shared_key_space", True)
        return IdempotencyMiddleware(
            Starlette(routes=routes), store=store, **with_options(options)
        ), store


@pytest.fixture
def tool() -> Iterator[tuple[_Tool, httpx.Client]]:
    """The recording tool behind the middleware on MemoryStore, under uvicorn on loopback."""
    recorder = _Tool()
    app, store = recorder.app()
    with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield recorder, client


@pytest.mark.parametrize("body", [b"{oops", b"[1,2]", b'{"a":NaN}', b'{"a":1,"a":2}'])
def test_the_keys_own_bytes_reach_the_handler_unparsed(
    tool: tuple[_Tool, httpx.Client], body: bytes
) -> None:
    """A body that is the key's exact bytes runs as sent, replays, and no other body gets in."""
    recorder, client = tool
    headers = {"idempotency-key": _raw_key(body), "content-type": "application/json"}
    first = client.post("/tools/echo", headers=headers, content=body)
    again = client.post("/tools/echo", headers=headers, content=body)
    other = client.post("/tools/echo", headers=headers, content=canonical_json({"a": 2}))
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()
    assert other.status_code == 422
    assert other.json()["error"] == "args_hash_mismatch"
    assert recorder.bodies == [body]  # once, byte for byte


def test_a_body_in_many_chunks_is_read_whole_and_its_size_capped() -> None:
    """A chunked body (no Content-Length) is joined exactly; past max_body_bytes it is a 413."""
    recorder = _Tool()
    app, store = recorder.app(max_body_bytes=4096)
    args = {"lines": [{"sku": f"S{i}", "qty": i} for i in range(100)]}
    body = canonical_json(args)
    big = canonical_json({"pad": "x" * 5000})
    with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
        ok = client.post(
            "/tools/echo",
            headers={"idempotency-key": StepKey.build(new_plan(), 0, args).format()},
            content=iter([body[i : i + 97] for i in range(0, len(body), 97)]),
        )
        over = client.post(
            "/tools/echo",
            headers={"idempotency-key": StepKey.build(new_plan(), 0, {"pad": "x"}).format()},
            content=iter([big[i : i + 1000] for i in range(0, len(big), 1000)]),
        )
    assert ok.status_code == 201
    assert recorder.bodies == [body]
    assert over.status_code == 413
    assert over.json()["error"] == "body_too_large"
    assert len(recorder.bodies) == 1


class _CountingJson:
    """Stands in for the json module inside the claim: counts its parses."""

    def __init__(self) -> None:
        self.parses = 0

    def loads(self, data: bytes) -> Any:
        self.parses += 1
        return json.loads(data)


@pytest.mark.parametrize(
    ("case", "parses_in_claim"),
    [
        # The middleware hands on no parsed body (none is kept while the handler runs):
        ("opaque key", 1),  # fingerprinted by its bytes, never parsed by the middleware
        ("agentkey key, re-serialised body", 1),  # parsed to check it, then dropped
        ("agentkey key, its exact bytes", 1),  # never parsed by the middleware
    ],
)
def test_claim_json_hands_the_handler_the_body_parsed_once(
    tool: tuple[_Tool, httpx.Client], monkeypatch: pytest.MonkeyPatch, case: str,
    parses_in_claim: int,
) -> None:  # fmt: skip
    """claim.json() gives what request.json() would, parsed once however often it is called."""
    recorder, client = tool
    counting = _CountingJson()
    monkeypatch.setattr(claim_module, "json", SimpleNamespace(loads=counting.loads))
    args = {"b": [1, 2.5, "é"], "a": {"nested": None}}
    body = json.dumps(args).encode()  # spaces, member order as built: not canonical
    key = StepKey.build(new_plan(), 0, args).format()
    if case == "opaque key":
        key = str(uuid.uuid4())
    elif case == "agentkey key, its exact bytes":
        body = canonical_json(args)
    headers = {"idempotency-key": key, "content-type": "application/json"}
    answer = client.post("/tools/args", headers=headers, content=body)
    assert answer.status_code == 201, answer.text
    assert recorder.parsed == [json.loads(body)]
    assert answer.json()["args"] == args
    assert counting.parses == parses_in_claim


def test_claim_json_of_a_body_that_is_not_json_raises_a_typed_error(
    tool: tuple[_Tool, httpx.Client],
) -> None:
    """A body the key vouches for but that is not JSON: claim.json() raises InvalidArguments."""
    recorder, client = tool
    body = b"amount=500"
    headers = {"idempotency-key": _raw_key(body)}
    answer = client.post("/tools/args", headers=headers, content=body)
    assert answer.status_code == 400
    assert "body: the request body under" in answer.text
    assert "is not JSON" in answer.text
    assert headers["idempotency-key"] not in answer.text  # the key shows as its digest only
    assert recorder.parsed == []


def test_claim_json_without_an_http_body_says_so() -> None:
    """A claim made by another front end (MCP) has no body to parse: ConfigurationError."""
    claim = Claim(
        key=None, idempotency_key="k", principal="p", record_key="r", owner="o",
        store=MemoryStore(), lock_ttl_ms=1000,
    )  # fmt: skip
    with pytest.raises(ConfigurationError, match="no HTTP request body"):
        claim.json()


_SCALARS = st.none() | st.booleans() | st.integers() | st.text()
_JSON_VALUES = st.recursive(
    _SCALARS | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
_ARGS = st.dictionaries(st.text(max_size=8), _JSON_VALUES, max_size=5)


@given(_ARGS, _ARGS, st.sampled_from(["canonical", "json.dumps", "indented"]))
def test_a_body_is_accepted_exactly_when_its_arguments_are_the_keys(
    keyed: dict[str, Any], sent: dict[str, Any], layout: str
) -> None:
    """Whatever the layout, a body passes iff its arguments are the key's; else a 4xx."""
    key = StepKey.build("plan", 0, keyed)
    body = {
        "canonical": canonical_json(sent),
        "json.dumps": json.dumps(sent).encode(),
        "indented": json.dumps(sent, indent=2, ensure_ascii=False).encode(),
    }[layout]
    checked = check_body(key, OP, body)
    same = canonical_json(sent) == canonical_json(keyed)
    if same:
        assert isinstance(checked, Checked)
    else:
        assert isinstance(checked, Reject)
        assert checked.status in (400, 422)
