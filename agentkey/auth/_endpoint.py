"""The token endpoint client: form POST, client authentication, retries, error parsing.

Building a request and interpreting an answer are plain functions; the sync
and async drivers only send and sleep, through tenacity configured in one
place (``_retrying``).
"""

from __future__ import annotations

import logging
import math
import random
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode, urlsplit

import httpx
from pydantic import SecretStr
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
)

from .._exceptions import ConfigurationError, InsecureTransport, TokenError
from .._protocol import is_loopback
from .._retry_after import parse_retry_after
from ._oauth import AuthMethod, apply_client_auth, sign_client_assertion
from ._policy import TokenPolicy
from ._token import Token, header_safe, refresh_deadline

if TYPE_CHECKING:
    from ._oauth import PrivateKey

__all__ = [
    "ClientAuthConfig",
    "TokenEndpoint",
    "TokenRequest",
    "is_loopback",
    "redact_url",
    "require_secure",
    "scope_text",
]

_log = logging.getLogger("agentkey.auth")

_HINTS = {
    "invalid_client": "check the client id and its secret or key with the identity provider",
    "invalid_grant": "the grant (refresh token, subject token or assertion) is invalid, "
    "expired or revoked; obtain a new one",
    "unauthorized_client": "the identity provider does not allow this client to use this "
    "grant type; change the client's registration",
    "invalid_scope": "ask for a scope the client is allowed",
    "invalid_target": "the requested audience or resource is unknown or not allowed",
    "unsupported_grant_type": "the identity provider does not support this grant type",
    "invalid_request": "the request is malformed; check the provider's options",
}


def redact_url(url: str | httpx.URL) -> str:
    """``scheme://host[:port]/path`` of ``url``: no user info, query or fragment."""
    parts = urlsplit(str(url))
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def require_secure(url: str | httpx.URL, *, what: str) -> None:
    """Raise InsecureTransport unless ``url`` is https, or http to a loopback host."""
    parsed = httpx.URL(str(url))
    if parsed.scheme == "https":
        return
    if parsed.scheme == "http" and is_loopback(parsed.host):
        return
    raise InsecureTransport(
        f"refusing to send {what} to {redact_url(url)}: credentials travel only over "
        "https (plain http is allowed to loopback hosts alone); use an https:// URL"
    )


@dataclass(frozen=True, slots=True)
class ClientAuthConfig:
    """How the client authenticates at the token endpoint (secrets stay wrapped)."""

    client_id: str
    method: AuthMethod
    client_secret: SecretStr | None = None
    private_key: PrivateKey | None = field(default=None, repr=False)
    private_key_alg: str = "RS256"
    key_id: str | None = None
    assertion_lifetime: float = 60.0


@dataclass(frozen=True, slots=True)
class TokenRequest:
    """The grant part of one token request; values that are secrets stay SecretStr."""

    grant_type: str
    params: tuple[tuple[str, str | SecretStr], ...] = ()
    # Token exchange answers must say what they issued (RFC 8693 section 2.2.1).
    expect_issued_token_type: frozenset[str] | None = None

    @property
    def grant_name(self) -> str:
        return self.grant_type.rsplit(":", 1)[-1]


class _Retryable(Exception):
    """A token request may succeed if sent again (429, 5xx, timeout, connection error)."""

    def __init__(self, reason: str, *, status_code: int | None, retry_after: float | None):
        super().__init__(reason)
        self.reason = reason
        self.status_code = status_code
        self.retry_after = retry_after


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            return None
    else:
        return None
    return number if math.isfinite(number) and number >= 0 else None


def _clean(text: object, limit: int = 300) -> str | None:
    """An endpoint-provided string, made safe for one line of a message."""
    if not isinstance(text, str):
        return None
    flat = "".join(ch if ch.isprintable() else " " for ch in text).strip()
    return flat[:limit] or None


class TokenEndpoint:
    """Sends token requests for one client to one token URL."""

    def __init__(
        self,
        token_url: str,
        client: ClientAuthConfig,
        *,
        policy: TokenPolicy,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        if not isinstance(token_url, str) or not token_url:
            raise ConfigurationError("token_url must be the URL of the token endpoint")
        parsed = httpx.URL(token_url)
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ConfigurationError(
                f"token_url {redact_url(token_url)!r} is not an absolute http(s) URL"
            )
        if parsed.userinfo:
            raise ConfigurationError(
                "token_url must not carry credentials; pass client_id and client_secret"
            )
        require_secure(token_url, what="client credentials")
        self.url = token_url
        self.client = client
        self.policy = policy
        self._verify = verify
        self._ssl: ssl.SSLContext | None = None  # built once: it costs ~50 ms per client

    def __repr__(self) -> str:
        return f"TokenEndpoint({redact_url(self.url)!r}, client_id={self.client.client_id!r})"

    # -- building and interpreting (no I/O) -----------------------------------------

    def build(self, request: TokenRequest) -> tuple[dict[str, str], bytes]:
        """Headers and form body of ``request``, with client authentication applied."""
        pairs = [("grant_type", request.grant_type)]
        for name, value in request.params:
            pairs.append(
                (name, value.get_secret_value() if isinstance(value, SecretStr) else value)
            )
        headers = {
            "Accept": "application/json",
            "Content-Type": "application/x-www-form-urlencoded",
        }
        body = urlencode(pairs)
        auth = self.client
        assertion = None
        if auth.method == "private_key_jwt":
            assert auth.private_key is not None
            assertion = sign_client_assertion(
                auth.private_key,
                client_id=auth.client_id,
                audience=self.url,
                alg=auth.private_key_alg,
                lifetime=auth.assertion_lifetime,
                key_id=auth.key_id,
            )
        secret = auth.client_secret.get_secret_value() if auth.client_secret else None
        headers, body = apply_client_auth(
            auth.method,
            client_id=auth.client_id,
            client_secret=secret,
            assertion=assertion,
            token_url=self.url,
            headers=headers,
            body=body,
        )
        return headers, body.encode("ascii")

    def interpret(self, request: TokenRequest, response: httpx.Response, sent_at: float) -> Token:
        """The Token in a successful answer; raises TokenError or _Retryable otherwise."""
        status = response.status_code
        where = f"token endpoint {redact_url(self.url)}"
        who = f"the {request.grant_name} request of client {self.client.client_id!r}"
        if status == 429 or status >= 500:
            raise _Retryable(
                f"{where} answered {status}",
                status_code=status,
                retry_after=parse_retry_after(response.headers.get("Retry-After")),
            )
        try:
            payload: Any = response.json()
        except ValueError:
            payload = None
        if status != 200:
            error = _clean(payload.get("error"), 80) if isinstance(payload, dict) else None
            description = (
                _clean(payload.get("error_description")) if isinstance(payload, dict) else None
            )
            what = error or "no OAuth error code"
            detail = f" ({description})" if description else ""
            hint = _HINTS.get(error or "", "check the provider's configuration")
            raise TokenError(
                f"{where} refused {who} with HTTP {status}: {what}{detail}; {hint}",
                error=error,
                error_description=description,
                status_code=status,
            )
        if not isinstance(payload, dict):
            raise TokenError(
                f"{where} answered {who} with HTTP 200 but no JSON object; "
                "check that token_url is the token endpoint",
                status_code=status,
            )
        access = payload.get("access_token")
        if not isinstance(access, str) or not access:
            raise TokenError(
                f"{where} answered {who} without an access_token; "
                "check that token_url is the token endpoint",
                status_code=status,
            )
        if not header_safe(access):
            raise TokenError(
                f"{where} answered {who} with an access_token holding spaces, control or "
                "non-ASCII characters, which an Authorization header cannot carry; check the "
                "identity provider's token format",
                status_code=status,
            )
        token_type = payload.get("token_type", "Bearer")
        if not isinstance(token_type, str) or token_type.lower() != "bearer":
            raise TokenError(
                f"{where} issued a {_clean(token_type, 40)!r} token to {who}; agentkey sends "
                "Bearer tokens only (RFC 6750)",
                status_code=status,
            )
        issued_type = payload.get("issued_token_type")
        expected = request.expect_issued_token_type
        if expected is not None and issued_type is None:
            # RFC 8693 section 2.2.1 requires the field, but some endpoints omit it. A token
            # the answer calls Bearer is an access token for a tool, so it is usable as is.
            if "token_type" not in payload:
                raise TokenError(
                    f"{where} answered {who} with neither issued_token_type nor token_type, "
                    "so what it issued is unknown; configure the identity provider to send "
                    "token_type Bearer (RFC 6749) or issued_token_type (RFC 8693)",
                    status_code=status,
                )
            _log.debug(
                "%s answered %s without issued_token_type; accepted as a Bearer access token",
                where,
                who,
            )
        elif expected is not None and issued_type not in expected:
            raise TokenError(
                f"{where} answered {who} with issued_token_type {_clean(str(issued_type), 80)!r}, "
                f"but agentkey sends only {' or '.join(sorted(expected))} to a tool; make the "
                "identity provider issue one of those (or pass requested_token_type= naming "
                "the type the tool accepts, if the provider honours it)",
                status_code=status,
            )
        lifetime = None
        if payload.get("expires_in") is not None:
            lifetime = _number(payload["expires_in"])
            if lifetime is None:
                raise TokenError(
                    f"{where} answered {who} with an unusable expires_in "
                    f"{_clean(str(payload['expires_in']), 40)!r}; it must be seconds >= 0",
                    status_code=status,
                )
        refresh = payload.get("refresh_token")
        scope = payload.get("scope")
        policy = self.policy
        return Token(
            access_token=SecretStr(access),
            obtained_at=sent_at,
            lifetime=lifetime,
            refresh_at=refresh_deadline(
                sent_at,
                lifetime,
                leeway=policy.leeway,
                lifetime_fraction=policy.lifetime_fraction,
                jitter=policy.leeway_jitter,
            ),
            refresh_token=SecretStr(refresh) if isinstance(refresh, str) and refresh else None,
            scope=scope if isinstance(scope, str) else None,
            issued_token_type=issued_type if isinstance(issued_type, str) else None,
        )

    # -- retry policy, in one place -------------------------------------------------

    def _wait(self, state: RetryCallState) -> float:
        policy = self.policy
        outcome = state.outcome
        exc = outcome.exception() if outcome is not None else None
        retry_after = exc.retry_after if isinstance(exc, _Retryable) else None
        if retry_after is not None:
            wait = min(retry_after, policy.max_wait)
        else:
            ceiling = min(policy.max_wait, policy.backoff * 2 ** (state.attempt_number - 1))
            wait = random.uniform(ceiling / 2, ceiling)  # noqa: S311 - jitter, not security
        elapsed = state.seconds_since_start or 0.0
        wait = max(0.0, min(wait, policy.deadline - elapsed))
        reason = exc.reason if isinstance(exc, _Retryable) else "failed"
        _log.warning("%s; token request retried in %.2f s", reason, wait)
        return wait

    def _retrying(self) -> dict[str, Any]:
        policy = self.policy
        return {
            "stop": stop_after_attempt(policy.attempts) | stop_after_delay(policy.deadline),
            "wait": self._wait,
            "retry": retry_if_exception_type(_Retryable),
            "reraise": True,
        }

    def _exhausted(self, request: TokenRequest, exc: _Retryable, attempts: int) -> TokenError:
        return TokenError(
            f"token endpoint {redact_url(self.url)} was unavailable for the "
            f"{request.grant_name} request of client {self.client.client_id!r} "
            f"({exc.reason}) after {attempts} attempt(s); the next call tries again",
            status_code=exc.status_code,
        )

    def _transport_error(self, exc: httpx.TransportError) -> _Retryable:
        kind = "timed out" if isinstance(exc, httpx.TimeoutException) else "could not be reached"
        return _Retryable(
            f"token endpoint {redact_url(self.url)} {kind} ({type(exc).__name__})",
            status_code=None,
            retry_after=None,
        )

    def _client_options(self) -> dict[str, Any]:
        if self._ssl is None:
            verify = self._verify
            self._ssl = (
                verify
                if isinstance(verify, ssl.SSLContext)
                else httpx.create_ssl_context(verify=verify)
            )
        return {
            "timeout": self.policy.timeout,
            "follow_redirects": False,  # a redirect must not carry client credentials
            "verify": self._ssl,
        }

    def _log_success(self, request: TokenRequest, token: Token) -> None:
        _log.debug(
            "token obtained with the %s grant for client %r from %s (lifetime %s s)",
            request.grant_name,
            self.client.client_id,
            redact_url(self.url),
            "unknown" if token.lifetime is None else f"{token.lifetime:g}",
        )

    # -- drivers --------------------------------------------------------------------

    def send_sync(self, request: TokenRequest) -> Token:
        """Obtain a token, retrying as the policy allows (blocking)."""
        attempts = 0
        try:
            with httpx.Client(**self._client_options()) as http:
                for attempt in Retrying(**self._retrying()):
                    with attempt:
                        attempts += 1
                        headers, body = self.build(request)
                        sent_at = self.policy.clock()
                        try:
                            response = http.post(self.url, headers=headers, content=body)
                        except httpx.TransportError as exc:
                            raise self._transport_error(exc) from None
                        token = self.interpret(request, response, sent_at)
        except _Retryable as exc:
            raise self._exhausted(request, exc, attempts) from None
        self._log_success(request, token)
        return token

    async def send_async(self, request: TokenRequest) -> Token:
        """Obtain a token, retrying as the policy allows (awaitable)."""
        attempts = 0
        try:
            async with httpx.AsyncClient(**self._client_options()) as http:
                async for attempt in AsyncRetrying(**self._retrying()):
                    with attempt:
                        attempts += 1
                        headers, body = self.build(request)
                        sent_at = self.policy.clock()
                        try:
                            response = await http.post(self.url, headers=headers, content=body)
                        except httpx.TransportError as exc:
                            raise self._transport_error(exc) from None
                        token = self.interpret(request, response, sent_at)
        except _Retryable as exc:
            raise self._exhausted(request, exc, attempts) from None
        self._log_success(request, token)
        return token


def scope_text(scope: str | Sequence[str] | None) -> str | None:
    """A space-separated scope string (RFC 6749 section 3.3) from a string or a list."""
    if scope is None:
        return None
    if isinstance(scope, str):
        return scope.strip() or None
    items = [s.strip() for s in scope]
    if any(not s or " " in s for s in items):
        raise ConfigurationError("each scope must be a non-empty string without spaces")
    return " ".join(items) or None
