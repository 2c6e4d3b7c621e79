"""The chaos suite's tool server (``uvicorn --factory tests.chaos._app:app --workers N``).

Configured by environment:

- ``AGENTKEY_CHAOS_REDIS``: the idempotency store (a RedisStore URL);
- ``AGENTKEY_CHAOS_PREFIX``: its key prefix;
- ``AGENTKEY_CHAOS_LEASE``: ``lock_ttl`` in seconds;
- ``AGENTKEY_CHAOS_AUTO_RENEW``: ``0`` turns automatic lease renewal off (the old default,
  to show that the suite catches the duplicates it caused);
- ``AGENTKEY_CHAOS_LEDGER``: the side-effect ledger, a file each execution appends one
  line to (``<key> <exec id> <pid> <start> <end>``) with a single ``O_APPEND`` write, so
  executions are counted across worker processes and survive a Redis restart;
- ``AGENTKEY_CHAOS_IDP``: the loopback identity provider; a bearer token is valid when
  the provider's ``/tool`` accepts it (checked once a second per token and worker);
- ``AGENTKEY_CHAOS_DOUBTS``: a file each in-doubt decision appends one line to
  (``<decision status> <key> <time>``): a handler that failed after it may have started
  (status 500), or a request answered 409 ``in_doubt`` (a lease that lapsed while Redis
  was down). The harness counts them as correct outcomes, never as duplicates.

Authentication runs in front of the idempotency middleware, as in a real deployment: a 401
is never stored as the step's answer.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from agentkey.server import (
    DecisionEvent,
    IdempotencyMiddleware,
    RedisStore,
    ServerOptions,
    current_claim,
)

# A token seen valid is trusted this long before the provider is asked again; tokens live
# a few seconds and agents use them for half of that, so expiry is still enforced.
_TRUST_SECONDS = 1.5


class BearerAuth:
    """Refuse a request whose bearer token the identity provider does not accept."""

    def __init__(self, app: ASGIApp, *, idp_url: str) -> None:
        self.app = app
        self.idp_url = idp_url
        self.trusted: dict[str, float] = {}
        self.client: httpx.AsyncClient | None = None

    async def _valid(self, token: str) -> bool | None:
        """Whether the provider accepts ``token`` (None: it could not be asked)."""
        now = time.monotonic()
        if self.trusted.get(token, 0.0) > now:
            return True
        if self.client is None:
            self.client = httpx.AsyncClient(timeout=5.0)
        try:
            answer = await self.client.get(
                self.idp_url + "/tool", headers={"Authorization": f"Bearer {token}"}
            )
        except httpx.HTTPError:
            return None
        if answer.status_code != 200:
            return False
        if len(self.trusted) > 1000:
            self.trusted = {t: end for t, end in self.trusted.items() if end > now}
        self.trusted[token] = now + _TRUST_SECONDS
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            token = header[7:] if header.startswith("Bearer ") else ""
            valid = await self._valid(token) if token else False
            if valid is None:  # the provider is unreachable: not run, retry later
                busy = JSONResponse(
                    {"error": "auth_unavailable"}, 503, headers={"Retry-After": "1"}
                )
                await busy(scope, receive, send)
                return
            if not valid:
                refused = JSONResponse(
                    {"error": "invalid_token"},
                    401,
                    headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
                )
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


def app() -> Starlette:
    ledger = os.open(os.environ["AGENTKEY_CHAOS_LEDGER"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    doubts = os.open(os.environ["AGENTKEY_CHAOS_DOUBTS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    pid = os.getpid()

    def note_doubt(event: DecisionEvent) -> None:
        if event.decision == "in_doubt":
            line = f"{event.status_code} {event.idempotency_key} {time.time():.3f}\n"
            os.write(doubts, line.encode("ascii"))

    async def tool(request: Request) -> Response:
        started = time.time()
        args = await request.json()
        if args.get("reject"):  # the tool's own refusal, before any side effect
            return JSONResponse({"error": "amount over limit"}, 402)
        await asyncio.sleep(args["work_ms"] / 1000)  # may outlast the lease: renewal keeps it
        current_claim().begin_mutation()
        exec_id = uuid.uuid4().hex[:16]
        key = request.headers["idempotency-key"]
        line = f"{key} {exec_id} {pid} {started:.3f} {time.time():.3f}\n"
        os.write(ledger, line.encode("ascii"))  # one write, O_APPEND: atomic across workers
        return JSONResponse({"exec": exec_id, "n": args["n"]}, 201)

    async def health(request: Request) -> Response:
        return Response("ok")

    return Starlette(
        routes=[
            Route("/tools/{tool}", tool, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ],
        middleware=[
            Middleware(BearerAuth, idp_url=os.environ["AGENTKEY_CHAOS_IDP"]),
            Middleware(
                IdempotencyMiddleware,
                store=RedisStore(
                    os.environ["AGENTKEY_CHAOS_REDIS"], prefix=os.environ["AGENTKEY_CHAOS_PREFIX"]
                ),
                routes=["/tools/*"],
                options=ServerOptions(
                    lock_ttl=float(os.environ["AGENTKEY_CHAOS_LEASE"]),
                    auto_renew=os.environ.get("AGENTKEY_CHAOS_AUTO_RENEW", "1") == "1",
                ),
                principal=lambda scope: "chaos-agent",
                hooks=[note_doubt],
            ),
        ],
    )
