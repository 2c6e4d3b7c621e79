"""A real (small) identity provider and tool for the auth tests, served on loopback.

``/token`` implements client_credentials, refresh_token (with rotation and
reuse detection), RFC 8693 token exchange and Entra's jwt-bearer
on-behalf-of grant, with client_secret_basic, client_secret_post and
private_key_jwt client authentication. Tokens live ``lifetime`` seconds.
``/tool`` answers 401 to a missing, unknown or expired token; ``/forbidden``
always answers 403; ``/jobs`` starts a 202 operation whose status URL needs a
valid token on every poll. Counters and recorded requests let tests assert exactly
what went over the wire.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote

from joserfc import jwt
from joserfc.errors import JoseError
from joserfc.jwk import Key
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

__all__ = ["IdP", "Reply"]

TOKEN_EXCHANGE = "urn:ietf:params:oauth:grant-type:token-exchange"
JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"
ACCESS_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:access_token"
ASSERTION_TYPE = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"


@dataclass
class Reply:
    """A canned answer the token endpoint gives before its normal behaviour."""

    status: int
    body: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class IdP:
    """The identity provider's state; tests change it between calls."""

    clients: dict[str, str | None] = field(default_factory=dict)  # id -> secret (None: public)
    client_keys: dict[str, Key] = field(default_factory=dict)  # id -> public key (private_key_jwt)
    lifetime: float = 2.0
    rotate: bool = True
    exchange_refresh: bool = False  # token exchange / OBO also return a refresh token
    issued_token_type: str | None = ACCESS_TOKEN_TYPE
    delay: float = 0.0
    replies: list[Reply] = field(default_factory=list)
    url: str = ""
    # Token lifetimes run on this clock; tests that give it a FakeClock's monotonic and the
    # provider the same FakeClock (clock=) advance time by hand, so machine load never
    # expires a token.
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget everything issued and counted (clients, keys and url stay)."""
        with self.lock:
            self.clock = time.monotonic
            self.lifetime = 2.0
            self.rotate = True
            self.exchange_refresh = False
            self.issued_token_type = ACCESS_TOKEN_TYPE
            self.delay = 0.0
            self.replies = []
            self.hits: Counter[str] = Counter()
            self.access: dict[str, float] = {}  # token -> monotonic expiry
            self.refresh: dict[str, str] = {}  # live refresh token -> client id
            self.spent_refresh: set[str] = set()
            self.revoked: set[str] = set()
            self.user_tokens: dict[str, float] = {}  # subject tokens the IdP accepts
            self.forms: list[list[tuple[str, str]]] = []
            self.auth_headers: list[str | None] = []
            self.jtis: list[str] = []
            self.assertions: list[str] = []
            self.tool_calls = 0
            self.tool_401 = 0
            self.tool_403 = 0
            self.force_401 = 0
            self.tool_requests: list[tuple[str | None, str | None, bytes]] = []
            self.job_polls = 0
            self.polls_until_done = 5

    @property
    def token_requests(self) -> int:
        """How many requests reached /token."""
        return sum(self.hits.values())

    def user_token(self, lifetime: float = 3600.0) -> str:
        """A user token (subject / OBO assertion) the IdP will accept for ``lifetime`` s."""
        token = "user-" + secrets.token_urlsafe(16)
        with self.lock:
            self.user_tokens[token] = self.clock() + lifetime
        return token

    def grant_refresh_token(self, client_id: str) -> str:
        """A refresh token for ``client_id``, as if the user had just authorised it."""
        token = "rt-" + secrets.token_urlsafe(16)
        with self.lock:
            self.refresh[token] = client_id
        return token

    def revoke_all(self) -> None:
        """Revoke every access token issued so far (the tool answers 401 to them)."""
        with self.lock:
            self.revoked.update(self.access)
            for token in self.access:
                self.access[token] = 0.0

    def secrets_seen(self) -> set[str]:
        """Every token, refresh token and assertion this IdP issued or received."""
        with self.lock:
            return (
                set(self.access)
                | set(self.refresh)
                | self.spent_refresh
                | set(self.user_tokens)
                | set(self.assertions)
            )

    # -- the ASGI app --------------------------------------------------------------------

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/token", self._token, methods=["POST"]),
                Route("/tool", self._tool, methods=["GET", "POST"]),
                Route("/forbidden", self._forbidden, methods=["GET", "POST"]),
                Route("/jobs", self._start_job, methods=["POST"]),
                Route("/bounce", self._bounce, methods=["GET"]),
                Route("/jobs/{job}", self._poll_job, methods=["GET"]),
            ]
        )

    async def _token(self, request: Request) -> Response:
        body = (await request.body()).decode("ascii")
        form = parse_qsl(body, keep_blank_values=True)
        params: dict[str, list[str]] = {}
        for name, value in form:
            params.setdefault(name, []).append(value)
        grant = params.get("grant_type", ["?"])[0]
        with self.lock:
            self.hits[grant] += 1
            self.forms.append(form)
            self.auth_headers.append(request.headers.get("authorization"))
            delay = self.delay
            reply = self.replies.pop(0) if self.replies else None
        if delay:
            await asyncio.sleep(delay)
        if reply is not None:
            return JSONResponse(reply.body, reply.status, headers=reply.headers)
        client_id = self._authenticate(request, params)
        if client_id is None:
            return _error(401, "invalid_client", "client authentication failed")
        with self.lock:
            return self._grant(grant, client_id, params)

    def _authenticate(self, request: Request, params: dict[str, list[str]]) -> str | None:
        header = request.headers.get("authorization", "")
        if header.lower().startswith("basic "):
            decoded = base64.b64decode(header[6:]).decode("utf-8")
            user, _, password = decoded.partition(":")
            client_id, secret = unquote(user), unquote(password)
            return client_id if self.clients.get(client_id, None) == secret else None
        client_id = params.get("client_id", [""])[0]
        if "client_assertion" in params:
            return self._check_assertion(params)
        if "client_secret" in params:
            secret = params["client_secret"][0]
            return client_id if self.clients.get(client_id, None) == secret else None
        if client_id in self.clients and self.clients[client_id] is None:
            return client_id  # a public client
        return None

    def _check_assertion(self, params: dict[str, list[str]]) -> str | None:
        if params.get("client_assertion_type") != [ASSERTION_TYPE]:
            return None
        assertion = params["client_assertion"][0]
        with self.lock:
            self.assertions.append(assertion)
        for client_id, key in self.client_keys.items():
            try:
                token = jwt.decode(assertion, key, algorithms=["RS256", "ES256", "PS256"])
            except (JoseError, ValueError):
                continue
            claims = token.claims
            ok = (
                claims.get("iss") == client_id
                and claims.get("sub") == client_id
                and claims.get("aud") == self.url + "/token"
                and isinstance(claims.get("exp"), int)
                and claims["exp"] > time.time()
                and isinstance(claims.get("jti"), str)
            )
            with self.lock:
                if not ok or claims["jti"] in self.jtis:
                    return None  # expired, misaddressed or replayed
                self.jtis.append(claims["jti"])
            return client_id
        return None

    def _issue(self, client_id: str, *, refresh: bool, extra: dict[str, Any]) -> Response:
        token = "at-" + secrets.token_urlsafe(16)
        self.access[token] = self.clock() + self.lifetime
        body: dict[str, Any] = {
            "access_token": token,
            "token_type": "Bearer",
            "expires_in": self.lifetime,
            **extra,
        }
        if refresh:
            rt = "rt-" + secrets.token_urlsafe(16)
            self.refresh[rt] = client_id
            body["refresh_token"] = rt
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    def _grant(self, grant: str, client_id: str, params: dict[str, list[str]]) -> Response:
        if grant == "client_credentials":
            return self._issue(client_id, refresh=False, extra={})
        if grant == "refresh_token":
            rt = params.get("refresh_token", [""])[0]
            if self.refresh.get(rt) != client_id:
                return _error(400, "invalid_grant", "refresh token unknown, spent or revoked")
            if self.rotate:
                del self.refresh[rt]
                self.spent_refresh.add(rt)
            return self._issue(client_id, refresh=self.rotate, extra={})
        if grant in (TOKEN_EXCHANGE, JWT_BEARER):
            name = "subject_token" if grant == TOKEN_EXCHANGE else "assertion"
            subject = params.get(name, [""])[0]
            expiry = self.user_tokens.get(subject) or self.access.get(subject)
            if expiry is None or expiry <= self.clock():
                return _error(400, "invalid_grant", f"the {name} is expired or unknown")
            if grant == JWT_BEARER and params.get("requested_token_use") != ["on_behalf_of"]:
                return _error(400, "invalid_request", "requested_token_use must be on_behalf_of")
            extra = {}
            if grant == TOKEN_EXCHANGE and self.issued_token_type is not None:
                extra["issued_token_type"] = self.issued_token_type
            return self._issue(client_id, refresh=self.exchange_refresh, extra=extra)
        return _error(400, "unsupported_grant_type", f"{grant} is not supported")

    async def _tool(self, request: Request) -> Response:
        body = await request.body()
        header = request.headers.get("authorization", "")
        token = header[7:] if header.startswith("Bearer ") else ""
        with self.lock:
            self.tool_requests.append((request.headers.get("idempotency-key"), header, body))
            expiry = self.access.get(token)
            valid = expiry is not None and expiry > self.clock()
            if valid and self.force_401:
                self.force_401 -= 1
                valid = False
            if not valid:
                self.tool_401 += 1
                return JSONResponse(
                    {"error": "invalid_token"},
                    401,
                    headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
                )
            self.tool_calls += 1
            calls = self.tool_calls
        return JSONResponse({"ok": True, "calls": calls, "echo": json.loads(body or b"null")})

    def _authorized(self, request: Request) -> bool:
        header = request.headers.get("authorization", "")
        token = header[7:] if header.startswith("Bearer ") else ""
        with self.lock:
            expiry = self.access.get(token)
            if expiry is not None and expiry > self.clock():
                return True
            self.tool_401 += 1
            return False

    async def _start_job(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse({"error": "invalid_token"}, 401)
        with self.lock:
            self.tool_calls += 1
        return JSONResponse(
            {"status": "running"}, 202, headers={"Operation-Location": "/jobs/job-1"}
        )

    async def _poll_job(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse({"error": "invalid_token"}, 401)
        with self.lock:
            self.job_polls += 1
            done = self.job_polls >= self.polls_until_done
        return JSONResponse({"status": "succeeded" if done else "running"})

    async def _bounce(self, request: Request) -> Response:
        return RedirectResponse(request.query_params["to"], 307)

    async def _forbidden(self, request: Request) -> Response:
        with self.lock:
            self.tool_403 += 1
        return JSONResponse({"error": "forbidden"}, 403)


def _error(status: int, error: str, description: str) -> Response:
    return JSONResponse({"error": error, "error_description": description}, status)
