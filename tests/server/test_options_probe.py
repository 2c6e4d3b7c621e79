"""OPTIONS says a route honours keys only for the method asked about, and only if protected.

A client probes with ``OPTIONS`` and ``Access-Control-Request-Method: <METHOD>`` (as a
CORS preflight does) before it resends a call that may have run; a wrong "protected"
answer would make it resend a PATCH that a POST-only middleware never guarded.
"""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agentkey.server import IdempotencyMiddleware, MemoryStore


def _app() -> Starlette:
    async def tool(request: Request) -> Response:
        return Response(status_code=204 if request.method == "OPTIONS" else 200)

    return Starlette(
        routes=[Route("/tools/charge", tool, methods=["POST", "PATCH", "OPTIONS"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=MemoryStore(),
                routes=["/tools/*"],
                methods=["POST"],
                shared_key_space=True,
            )
        ],
    )


@pytest.mark.parametrize(
    ("asked", "path", "protected"),
    [
        ("POST", "/tools/charge", True),
        ("post", "/tools/charge", True),
        ("PATCH", "/tools/charge", False),  # the route matches, the method is not protected
        (None, "/tools/charge", False),  # no question asked: no claim made
        ("POST", "/other", False),  # the method is protected, the route is not
    ],
)
def test_options_advertises_protection_only_for_the_protected_method(
    asked: str | None, path: str, protected: bool
) -> None:
    """OPTIONS with Access-Control-Request-Method: PATCH on a POST-only path is not
    advertised (the old code said "protected" for any method, or none)."""
    from tests._loopback import serve

    headers = {} if asked is None else {"Access-Control-Request-Method": asked}
    with serve(_app()) as url:
        answer = httpx.options(url + path, headers=headers, timeout=30)
    assert ("idempotency-protected" in answer.headers) is protected
    if protected:
        assert answer.headers["idempotency-protected"] == "true"
