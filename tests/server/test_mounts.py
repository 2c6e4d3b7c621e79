"""Routes are matched as the router matches them: relative to a Mount or uvicorn's --root-path."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from agentkey.server import IdempotencyMiddleware, MemoryStore, current_claim
from agentkey.server._middleware import route_path
from tests._loopback import serve
from tests.server._util import request_for, with_options


def _tools(runs: Counter[str], **options: Any) -> Starlette:
    async def charge(request: Request) -> JSONResponse:
        current_claim().begin_mutation()  # raises when the middleware did not claim
        runs["charge"] += 1
        return JSONResponse({"run": runs["charge"]}, status_code=201)

    return Starlette(
        routes=[Route("/tools/charge", charge, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=MemoryStore(),
                routes=["/tools/*"],
                shared_key_space=True,
                **with_options(options),
            )
        ],
    )


def _check_protected(url: str, path: str, runs: Counter[str]) -> None:
    headers, body = request_for({"amount": 5})
    with httpx.Client(base_url=url, timeout=30) as client:
        first = client.post(path, headers=headers, content=body)
        again = client.post(path, headers=headers, content=body)
        keyless = client.post(path, content=body)
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()
    assert (keyless.status_code, keyless.json()["error"]) == (400, "idempotency_key_missing")
    assert runs["charge"] == 1


def test_routes_under_a_starlette_mount_are_protected() -> None:
    """Under Mount("/api", app), routes=["/tools/*"] protects /api/tools/charge."""
    runs: Counter[str] = Counter()
    outer = Starlette(routes=[Mount("/api", app=_tools(runs))])
    with serve(outer) as url:
        _check_protected(url, "/api/tools/charge", runs)


def test_routes_under_uvicorn_root_path_are_protected() -> None:
    """Under uvicorn --root-path /api, routes=["/tools/*"] protects /tools/charge."""
    runs: Counter[str] = Counter()
    with serve(_tools(runs), root_path="/api") as url:
        _check_protected(url, "/tools/charge", runs)


def test_a_pattern_that_never_matches_is_reported_once(caplog: pytest.LogCaptureFixture) -> None:
    """Keyed requests reaching unprotected paths while a pattern never matched: one WARNING."""
    runs: Counter[str] = Counter()

    async def charge(request: Request) -> JSONResponse:
        runs["charge"] += 1
        return JSONResponse({"run": runs["charge"]})

    inner = Starlette(routes=[Route("/tools/charge", charge, methods=["POST"])])
    # The middleware wraps the outer app, so it sees /api/...: a misconfiguration.
    outer = IdempotencyMiddleware(
        Starlette(routes=[Mount("/api", app=inner)]),
        store=MemoryStore(),
        routes=["/tools/*"],
        shared_key_space=True,
    )
    headers, body = request_for({"amount": 5})
    with (
        caplog.at_level(logging.WARNING, logger="agentkey.server"),
        serve(outer) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        for _ in range(3):
            assert client.post("/api/tools/charge", headers=headers, content=body).is_success
    warnings = [r for r in caplog.records if "have not matched any request" in r.getMessage()]
    assert len(warnings) == 1
    assert "/tools/*" in warnings[0].getMessage()
    assert headers["idempotency-key"] not in warnings[0].getMessage()


@pytest.mark.parametrize(
    ("path", "root", "expected"),
    [
        ("/api/tools/a", "/api", "/tools/a"),
        ("/tools/a", "/api", "/tools/a"),  # older Starlette: the mount already stripped it
        ("/api", "/api", "/"),
        ("/apix/tools", "/api", "/apix/tools"),  # not a path-segment prefix
        ("/tools/a", "", "/tools/a"),
    ],
)
def test_route_path_is_relative_to_root_path(path: str, root: str, expected: str) -> None:
    """The route path strips root_path only on a segment boundary, as Starlette's router does."""
    assert route_path({"path": path, "root_path": root}) == expected


def test_two_mounted_apps_sharing_a_store_never_answer_with_each_others_records() -> None:
    """/billing/create and /shipping/create are one relative path but two routes: 422, no replay."""
    store = MemoryStore()
    runs: Counter[str] = Counter()

    def sub_app(name: str) -> Starlette:
        async def create(request: Request) -> JSONResponse:
            runs[name] += 1
            return JSONResponse({"created_by": name}, status_code=201)

        return Starlette(
            routes=[Route("/create", create, methods=["POST"])],
            middleware=[Middleware(IdempotencyMiddleware, store=store, shared_key_space=True)],
        )

    app = Starlette(
        routes=[Mount("/billing", sub_app("billing")), Mount("/shipping", sub_app("shipping"))]
    )
    headers = {"Idempotency-Key": "3f0c6a3e-8f1d-4a2b-9c1e-5d7f0a9b2c41"}
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        first = client.post("/billing/create", headers=headers, json={"n": 1})
        other = client.post("/shipping/create", headers=headers, json={"n": 1})
    assert first.status_code == 201
    assert (other.status_code, other.json()["error"]) == (422, "key_reused")
    assert runs == {"billing": 1}
