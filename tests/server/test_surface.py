"""The public surface, the optional extra, and the pure pieces: key parsing, blobs, options."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import agentkey.server as server
from agentkey import ConfigurationError, StepKey, StoreError
from agentkey._canonical import Profile
from agentkey.server import (
    FileBlobStore,
    IdempotencyMiddleware,
    MemoryStore,
    ServerOptions,
    current_claim,
)
from agentkey.server._decide import OpaqueKey, _parse_key
from agentkey.server._decide import record_key as _record_key
from tests.server._util import request_for, with_options

ROOT = Path(__file__).resolve().parents[2]


def test_public_surface() -> None:
    """agentkey.server exports exactly the documented names, sorted."""
    assert server.__all__ == [
        "BlobStore",
        "Claim",
        "DecisionEvent",
        "FileBlobStore",
        "IdempotencyMiddleware",
        "MemoryStore",
        "PostgresStore",
        "PostgresTransaction",
        "ReconcileContext",
        "Reconciled",
        "RedisStore",
        "ServerOptions",
        "Store",
        "current_claim",
        "starlette_user_identity",
    ]
    assert server.__all__ == sorted(server.__all__, key=lambda n: (not n.isupper(), n))
    assert all(getattr(server, name) is not None for name in server.__all__)


def test_the_postgres_store_needs_only_its_extra() -> None:
    """agentkey.server imports without psycopg; PostgresStore then names the extra to install."""
    result = _run(
        "import sys\nsys.modules['psycopg'] = None\n"
        "import agentkey.server as s\nfrom agentkey import MissingExtra\n"
        "try:\n    s.PostgresStore\nexcept MissingExtra as exc:\n    print(exc.extra)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "postgres"


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
    )


def test_import_agentkey_never_imports_the_server_stack() -> None:
    """`import agentkey` (and its CLI) load neither starlette nor redis."""
    result = _run(
        "import sys, agentkey, agentkey.cli\n"
        "bad = [m for m in ('starlette', 'redis', 'agentkey.server') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    assert result.returncode == 0, result.stderr


def test_missing_starlette_names_the_extra() -> None:
    """Without starlette, importing agentkey.server raises MissingExtra naming the extra."""
    result = _run(
        "import sys\nsys.modules['starlette'] = None\n"
        "from agentkey import MissingExtra\n"
        "try:\n    import agentkey.server\n"
        "except MissingExtra as exc:\n    print(exc.extra, exc.module, exc)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("server starlette ")
    assert "pip install 'agentkey-idempotency[server]'" in result.stdout


_NO_REDIS = """
import sys
from importlib.abc import MetaPathFinder

class NoRedis(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("redis", "psycopg", "psycopg_pool"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoRedis())
import anyio, httpx
import agentkey.server as s
from agentkey import MissingExtra, StepKey
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

async def ok(request):
    return JSONResponse(await request.json(), status_code=201)

app = s.IdempotencyMiddleware(
    Starlette(routes=[Route("/ok", ok, methods=["POST"])]),
    store=s.MemoryStore(),
    shared_key_space=True,
)
key = StepKey.build("plan", 0, {"a": 1}).format()

async def main():
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        for _ in range(2):
            r = await client.post("/ok", headers={"idempotency-key": key}, content=b'{"a":1}')
            print(r.status_code, r.headers.get("idempotent-replayed"))

anyio.run(main)
assert not [m for m in sys.modules if m.partition(".")[0] in ("redis", "psycopg")]
for name in ("RedisStore", "PostgresStore"):
    try:
        getattr(s, name)
    except MissingExtra as exc:
        print(exc.extra, exc.module)
"""


def test_memory_store_needs_no_redis() -> None:
    """Without redis or psycopg, MemoryStore serves; RedisStore, PostgresStore name their extras."""
    result = _run(_NO_REDIS)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines == ["201 None", "201 true", "server redis", "postgres psycopg"]


@given(st.binary(max_size=400))
def test_any_header_bytes_parse_or_give_a_message(raw: bytes) -> None:
    """Any header value parses to a valid key or yields a 400 message; nothing else escapes."""
    result = _parse_key([raw])
    if isinstance(result, StepKey):
        assert raw.decode("ascii").strip(" \t") in (result.format(), f'"{result.format()}"')
    else:
        assert result


@given(st.text(max_size=300))
def test_any_header_text_parse_or_give_a_message(text: str) -> None:
    """Unicode, control characters and quotes in a key give a message, never an exception."""
    result = _parse_key([text.encode("utf-8", "surrogatepass")])
    assert isinstance(result, (StepKey, OpaqueKey, str))


def test_two_key_headers_are_refused() -> None:
    """Two Idempotency-Key headers are ambiguous: 400."""
    key = request_for({})[0]["idempotency-key"].encode()
    assert isinstance(_parse_key([key, key]), str)


@given(st.text(min_size=1, max_size=400))
def test_record_keys_separate_principals(principal: str) -> None:
    """Principal text cannot forge another principal's record key; long ones are hashed."""
    key = StepKey.parse(request_for({})[0]["idempotency-key"])
    record = _record_key(principal, key)
    scoped, _, rest = record.partition(":")
    assert rest == key.format()
    assert "{" not in scoped
    assert "}" not in scoped
    assert len(scoped) <= 128


async def test_file_blob_store_round_trip_and_refuses_foreign_uris(tmp_path: Path) -> None:
    """Blobs round-trip; a URI outside the directory or of another scheme is refused."""
    blobs = FileBlobStore(tmp_path)
    uri = await blobs.put(b"x" * 1000)
    assert uri.startswith("file://")
    assert await blobs.get(uri) == b"x" * 1000
    for foreign in ("file:///etc/passwd", "s3://bucket/a.blob", uri.replace(".blob", ".txt")):
        with pytest.raises(StoreError):
            await blobs.get(foreign)
    await blobs.delete(uri)
    with pytest.raises(StoreError, match="purged"):
        await blobs.get(uri)
    await blobs.put(b"old")
    assert blobs.purge(older_than=-1) == 1


def _plain(app: Any) -> Any:
    return Starlette(routes=[Route("/x", app, methods=["POST"])])


@pytest.mark.parametrize(
    "options",
    [
        {"lock_ttl": 0},
        {"lock_ttl": 10, "result_ttl": 5},
        {"retry_after": -1},
        {"retry_after": 1.5},
        {"max_inline_bytes": -1},
        {"hash_profile": "xml"},
        {"key_format": "uuid"},
        {"hold_in_flight": -1},
        {"hold_in_flight": 3600},
        {"routes": "/x"},
        {"routes": ["/tools*"]},  # would match nothing
        {"routes": ["tools/*"]},
        {"routes": ["/a/*/b"]},
        {"routes": [None]},
        {"methods": "POST"},  # would protect the methods P, O, S and T: nothing
        {"methods": ["POST", ""]},
        {"principal": "tenant"},
        {"blob_store": "/var/blobs"},
        {"max_recorded_bytes": -1},
        {"max_recorded_bytes": 1.5},
        {"shared_key_space": "yes"},
    ],
)
def test_bad_middleware_options_are_refused(options: dict[str, Any]) -> None:
    """Each invalid option is a ConfigurationError at construction."""
    with pytest.raises(ConfigurationError):
        IdempotencyMiddleware(
            _plain(None), store=MemoryStore(), **with_options({"shared_key_space": True, **options})
        )


def test_store_must_implement_the_protocol() -> None:
    """Passing something that is not a Store fails at construction, naming the type."""
    with pytest.raises(ConfigurationError, match="dict"):
        IdempotencyMiddleware(_plain(None), store={}, shared_key_space=True)  # type: ignore[arg-type]


def test_claim_accessors_outside_a_claimed_request_explain() -> None:
    """current_claim() outside a protected request raises ConfigurationError."""
    with pytest.raises(ConfigurationError, match="no idempotency claim"):
        current_claim()


async def _ok(request: Request) -> Response:
    claim = current_claim()
    assert current_claim() is claim
    return JSONResponse({"principal": claim.principal})


@pytest.mark.parametrize(
    ("routes", "path", "protected"),
    [
        (None, "/tools/a", True),
        (["/tools/a"], "/tools/a", True),
        (["/tools/a"], "/tools/b", False),
        (["/tools/*"], "/tools/b", True),
        (["/tools/*"], "/other", False),
    ],
)
async def test_routes_select_what_is_protected(
    routes: list[str] | None, path: str, protected: bool
) -> None:
    """Exact paths and /prefix/* patterns choose the protected routes; others pass untouched."""

    async def plain(request: Request) -> Response:
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route(path, plain, methods=["POST"])])
    wrapped = IdempotencyMiddleware(app, store=MemoryStore(), routes=routes, shared_key_space=True)
    transport = httpx.ASGITransport(app=wrapped)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        response = await client.post(path, content=b"{}")  # no key
    assert response.status_code == (400 if protected else 200)


async def test_async_principal_and_validation() -> None:
    """An async principal function works; one returning a non-str is a ConfigurationError."""

    async def tenant(scope: Any) -> str:
        return "acme"

    app = Starlette(routes=[Route("/x", _ok, methods=["POST"])])
    headers, body = request_for({"a": 1})
    good = IdempotencyMiddleware(app, store=MemoryStore(), principal=tenant)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=good), base_url="http://t"
    ) as client:
        assert (await client.post("/x", headers=headers, content=body)).json() == {
            "principal": "acme"
        }
    bad = IdempotencyMiddleware(app, store=MemoryStore(), principal=lambda scope: 7)  # type: ignore[arg-type,return-value]
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=bad), base_url="http://t"
    ) as client:
        with pytest.raises(ConfigurationError, match="principal"):
            await client.post("/x", headers=headers, content=body)


async def _asgi_call(app: Any, headers: list[tuple[bytes, bytes]], body: bytes) -> int:
    """Drive the ASGI app directly: hostile header bytes no HTTP client would send."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/x",
        "headers": headers,
        "query_string": b"",
    }
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status: int = sent[0]["status"]
    return status


@given(st.binary(max_size=300))
async def test_hostile_key_bytes_never_run_or_store(raw: bytes) -> None:
    """Control characters, NULs, unicode and quotes in the key: a 400, nothing stored or run."""
    store = MemoryStore()
    runs: list[int] = []

    async def handler(request: Request) -> Response:
        runs.append(1)
        return JSONResponse({})

    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/x", handler, methods=["POST"])]),
        store=store,
        shared_key_space=True,
    )
    status = await _asgi_call(app, [(b"idempotency-key", raw)], b"{}")
    if isinstance(_parse_key([raw]), str):
        assert status == 400
        assert runs == []
        assert repr(store) == "MemoryStore(records=0)"
    else:
        assert status in (201, 200, 422)


@pytest.mark.parametrize("profile", ["python", "jcs"])
async def test_hash_profile_decides_how_a_reformatted_body_is_checked(profile: Profile) -> None:
    """A body with other spacing passes when re-serialised under the configured profile only."""
    import json as _json

    from agentkey import canonical_json

    async def handler(request: Request) -> Response:
        return JSONResponse(await request.json())

    args = {"city": "Zürich", "n": 1}
    step_key = StepKey.build("p", 0, args, profile=profile)
    loose = _json.dumps(args, indent=2, ensure_ascii=False).encode()
    assert loose != canonical_json(args, profile=profile)
    results = {}
    configs: tuple[Profile, ...] = ("python", "jcs")
    for configured in configs:
        app = IdempotencyMiddleware(
            Starlette(routes=[Route("/x", handler, methods=["POST"])]),
            store=MemoryStore(),
            options=ServerOptions(hash_profile=configured),
            shared_key_space=True,
        )
        status = await _asgi_call(app, [(b"idempotency-key", str(step_key).encode())], loose)
        results[configured] = status
    assert results == {profile: 200, ("jcs" if profile == "python" else "python"): 422}


def test_fastapi_dependency_reaches_the_claim() -> None:
    """FastAPI's `Depends(current_claim)` hands the handler its claim; a replay skips it."""
    from fastapi import Depends, FastAPI

    from agentkey.server import Claim
    from tests._loopback import serve

    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), shared_key_space=True)
    seen: list[str] = []

    @app.post("/tools/provision")
    async def provision(
        args: dict[str, str],
        claim: Claim = Depends(current_claim),  # noqa: B008 - FastAPI's idiom
    ) -> dict[str, str]:
        claim.begin_mutation()
        assert claim.key is not None
        seen.append(claim.key.label)
        return {"vm": "vm-1", "region": args["region"]}

    headers, body = request_for({"region": "eu-west-1"})
    with serve(app) as url, httpx.Client(base_url=url) as client:
        first = client.post("/tools/provision", headers=headers, content=body)
        again = client.post("/tools/provision", headers=headers, content=body)
    assert first.json() == again.json() == {"vm": "vm-1", "region": "eu-west-1"}
    assert again.headers["idempotent-replayed"] == "true"
    assert seen == ["step_000"]


def test_default_blob_directory_must_be_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default directory lives in the temp dir; one others can read is refused."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    blobs = FileBlobStore()
    assert blobs.directory.parent == tmp_path
    assert blobs.directory.stat().st_mode & 0o077 == 0
    blobs.directory.chmod(0o755)
    with pytest.raises(ConfigurationError, match="not private"):
        FileBlobStore()
    assert FileBlobStore(blobs.directory).directory == blobs.directory  # explicit: your call
