"""The token endpoint without I/O: build a request, interpret an answer, retry on the engine.

:meth:`TokenEndpoint.exchange` is a flow of the core's effects (``_effects``),
run on the client's one retry loop (``_flow.attempts``) with a classifier of its
own (:meth:`TokenEndpoint.interpret`): it yields each token request as an
``Outgoing`` whose deadline is on the provider's clock, a ``Sleep`` between
attempts, and an ``Emit`` for each :class:`~agentkey.auth.TokenEvent` and each
log line (:class:`Note`). The provider runs it with the shared drivers
(``_drive``) and carries the effects out: the request through ``_http`` on the
client it owns, the waits, the hooks and the logger. Time is read from the
injected ``clock`` only, the jitter from the injected ``rng``, and a ``Retry-After``
date is measured from the injected ``wall`` (all three the provider's ``Clock``'s);
waits come from
``TokenPolicy.schedule``, the same backoff formula and deadline rule as step
retries and polls.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, get_args
from urllib.parse import parse_qsl, urlencode, urlsplit

from pydantic import SecretBytes, SecretStr

from .._exceptions import ConfigurationError, TokenError
from .._validate import choice, number, secret, text
from ..client._effects import Effect, Emit, Failure, Outgoing, Received
from ..client._flow import Again, Exchange, attempts
from ..client._net import origin_of, redact_url, require_secure, scrub, secret_forms
from ..client._protocol import parse_json
from ..client._retry_after import parse_retry_after
from ._oauth import AuthMethod, apply_client_auth, load_private_key, sign_client_assertion
from ._token import Token, TokenEvent, header_safe, refresh_deadline
from ._token_policy import TokenPolicy

if TYPE_CHECKING:
    import ssl

    from ._oauth import PrivateKey

__all__ = [
    "MAX_TOKEN_ANSWER_BYTES",
    "ClientAuth",
    "Note",
    "TokenEndpoint",
    "TokenFlow",
    "TokenRequest",
    "redact_url",
    "require_secure",
    "scope_text",
]

#: The largest token endpoint answer read: a token answer is a few kilobytes.
MAX_TOKEN_ANSWER_BYTES = 1024 * 1024

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


_METHODS: tuple[AuthMethod, ...] = get_args(AuthMethod)


@dataclass(frozen=True, slots=True, init=False)
class ClientAuth:
    """How a client authenticates at a token endpoint: one validated value, secrets hidden.

    ``ClientAuth("my-agent", "s3cret")`` is ``client_secret_basic`` (the default
    ``method``); ``method="client_secret_post"`` puts the secret in the form instead;
    ``method="none"`` is a public client (no secret). ``method="private_key_jwt"``
    takes ``private_key`` (the PEM private key, str, bytes or ``SecretStr``, whose
    public half the identity provider knows) instead of a secret, ``private_key_alg``
    (RS256, PS256, ES256, EdDSA...), ``key_id`` (sent as ``kid``) and
    ``assertion_lifetime`` (seconds, at most 300, each assertion lives). Everything is
    checked here, once: a mistake raises ConfigurationError naming the field, and no
    secret or key appears in a message or in ``repr``.
    """

    client_id: str
    client_secret: SecretStr | None
    method: AuthMethod
    private_key: SecretStr | SecretBytes | None = field(repr=False)
    private_key_alg: str
    key_id: str | None
    assertion_lifetime: float
    # The key, read once from ``private_key``; the value is compared by what it was built from.
    _key: PrivateKey | None = field(init=False, repr=False, compare=False)

    def __init__(
        self,
        client_id: str,
        client_secret: str | SecretStr | None = None,
        *,
        method: AuthMethod = "client_secret_basic",
        private_key: str | bytes | SecretStr | SecretBytes | None = None,
        private_key_alg: str = "RS256",
        key_id: str | None = None,
        assertion_lifetime: float = 60.0,
    ) -> None:
        client_id = text("client_id", client_id)
        method = choice("method", method, _METHODS, "how the client authenticates")
        secret_value = secret("client_secret", client_secret)
        private_key_alg = text("private_key_alg", private_key_alg)
        if key_id is not None:
            key_id = text("key_id", key_id)
        lifetime = number("assertion_lifetime", assertion_lifetime, above=True, most=300)
        pem: SecretStr | SecretBytes | None
        if private_key is None or isinstance(private_key, (SecretStr, SecretBytes)):
            pem = private_key
        elif isinstance(private_key, bytes):
            pem = SecretBytes(private_key)
        elif isinstance(private_key, str):
            pem = SecretStr(private_key)
        else:
            raise ConfigurationError(
                "private_key must be the PEM text of a private key (str, bytes, SecretStr or "
                f"SecretBytes), got a {type(private_key).__name__}"
            )
        key = None
        if method == "private_key_jwt":
            if pem is None:
                raise ConfigurationError(
                    "method='private_key_jwt' needs private_key= (the PEM private key whose "
                    "public half is registered with the identity provider)"
                )
            if secret_value is not None:
                raise ConfigurationError(
                    "pass either client_secret or private_key_jwt's private_key, not both"
                )
            key = load_private_key(pem.get_secret_value(), private_key_alg)
        elif pem is not None:
            raise ConfigurationError(
                f"private_key is only used with method='private_key_jwt', not {method!r}"
            )
        elif method == "none" and secret_value is not None:
            raise ConfigurationError(
                "method='none' is a public client, which sends no client_secret; pass "
                "method='client_secret_basic' or 'client_secret_post' to send it"
            )
        elif method != "none" and secret_value is None:
            raise ConfigurationError(
                f"method={method!r} needs client_secret=; a public client uses method='none'"
            )
        for name, value in (
            ("client_id", client_id),
            ("client_secret", secret_value),
            ("method", method),
            ("private_key", pem),
            ("private_key_alg", private_key_alg),
            ("key_id", key_id),
            ("assertion_lifetime", lifetime),
            ("_key", key),
        ):
            object.__setattr__(self, name, value)

    def authenticate(
        self, token_url: str, headers: dict[str, str], body: str
    ) -> tuple[dict[str, str], str]:
        """``headers`` and form ``body`` of a request to ``token_url``, this client's
        authentication added (a ``private_key_jwt`` assertion is signed fresh each time)."""
        assertion = None
        if self._key is not None:
            assertion = sign_client_assertion(
                self._key,
                client_id=self.client_id,
                audience=token_url,
                alg=self.private_key_alg,
                lifetime=self.assertion_lifetime,
                key_id=self.key_id,
            )
        secret_text = self.client_secret.get_secret_value() if self.client_secret else None
        return apply_client_auth(
            self.method,
            client_id=self.client_id,
            client_secret=secret_text,
            assertion=assertion,
            token_url=token_url,
            headers=headers,
            body=body,
        )


@dataclass(frozen=True, slots=True)
class TokenRequest:
    """The grant part of one token request: ``grant_type`` and its form parameters.

    Values that are secrets stay ``SecretStr`` until the form body is built.
    ``expect_issued_token_type``, when set, is the set of RFC 8693
    ``issued_token_type`` values the answer may carry.
    """

    grant_type: str
    params: tuple[tuple[str, str | SecretStr], ...] = ()
    # Token exchange answers must say what they issued (RFC 8693 section 2.2.1).
    expect_issued_token_type: frozenset[str] | None = None

    @property
    def grant_name(self) -> str:
        """The grant type's last part: ``client_credentials``, ``token-exchange``..."""
        return self.grant_type.rsplit(":", 1)[-1]


@dataclass(frozen=True, slots=True)
class Note:
    """A line for the ``agentkey.auth`` logger, emitted by the flow (which never logs itself)."""

    level: Literal["debug", "warning"]
    text: str


#: One token request as a flow: effects out, replies in, the Token at the end.
TokenFlow: TypeAlias = Generator[Effect, Any, Token]


class _Retryable(Exception):
    """The classifier's verdict that a token request may succeed if sent again.

    429, 5xx, a timeout or a connection error; the exchange waits and resends.
    """

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


#: Form fields of a token request that hold a credential (RFC 6749, 7521, 7523, 8693).
_SECRET_FIELDS = frozenset(
    {
        "actor_token",
        "assertion",
        "client_assertion",
        "client_secret",
        "code",
        "code_verifier",
        "password",
        "refresh_token",
        "subject_token",
    }
)


def _clean(text: object, secrets: tuple[str, ...], limit: int = 300) -> str | None:
    """An endpoint-provided string, made safe for one line of a message.

    Every credential the request carried is cut out first, before control characters
    are folded and the text is cut, so no trace of one survives in any form.
    """
    if not isinstance(text, str):
        return None
    flat = "".join(ch if ch.isprintable() else " " for ch in scrub(text, secrets)).strip()
    return flat[:limit] or None


class TokenEndpoint:
    """Token requests of one client to one token URL: built, read and retried (no I/O)."""

    def __init__(
        self,
        token_url: str,
        client: ClientAuth,
        *,
        policy: TokenPolicy,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        if not isinstance(client, ClientAuth):
            raise ConfigurationError(
                f"client must be an agentkey.auth.ClientAuth, got a {type(client).__name__}"
            )
        if not isinstance(token_url, str) or not token_url:
            raise ConfigurationError("token_url must be the URL of the token endpoint")
        origin = origin_of(token_url)
        if origin is None:
            raise ConfigurationError(
                f"token_url {redact_url(token_url)!r} is not an absolute http(s) URL"
            )
        if "@" in urlsplit(token_url).netloc:
            raise ConfigurationError(
                "token_url must not carry credentials; pass client_id and client_secret"
            )
        require_secure(token_url, what="client credentials")
        self.url = token_url
        self.origin = origin
        self.client = client
        self.policy = policy
        self.verify = verify  # for the HTTP client the provider opens

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
        headers, body = self.client.authenticate(self.url, headers, urlencode(pairs))
        return headers, body.encode("ascii")

    def outgoing(self, request: TokenRequest, *, deadline: float | None = None) -> Outgoing:
        """``request`` as the POST to send: form body, client authentication applied.

        ``deadline`` is on the provider's clock.
        """
        headers, body = self.build(request)
        # Sent bare (same_origin=False): no cookie jar, no client defaults, no auth flow.
        return Outgoing("POST", self.url, tuple(headers.items()), body, False, deadline)

    def sent_secrets(self, request: TokenRequest, out: Outgoing | None = None) -> tuple[str, ...]:
        """Every credential ``request`` carries, sent as ``out``, in the forms a server echoes.

        The client secret and the grant's secret parameters always; from ``out``, the
        ``Authorization`` header (Basic client authentication) and the secret fields of
        the form, such as a ``private_key_jwt`` assertion signed for this one request.
        """
        values = [v.get_secret_value() for _, v in request.params if isinstance(v, SecretStr)]
        if self.client.client_secret is not None:
            values.append(self.client.client_secret.get_secret_value())
        if out is not None:
            for name, value in out.headers:
                if name.lower() == "authorization":
                    values += [value, value.partition(" ")[2]]
            form = (out.content or b"").decode("ascii", "replace")
            values += [v for k, v in parse_qsl(form) if k in _SECRET_FIELDS]
        return secret_forms(values)

    def interpret(
        self,
        request: TokenRequest,
        reply: Received,
        sent_at: float,
        *,
        secrets: tuple[str, ...] | None = None,
        now: float | None = None,
        rand: float = 0.0,
    ) -> Token:
        """The Token in a successful answer; raises TokenError or _Retryable otherwise.

        The token endpoint's classifier. ``secrets`` (default: :meth:`sent_secrets` of
        ``request``) never reach an error; ``now`` is the wall time (Unix seconds) a
        ``Retry-After`` date is measured from (None: a date says nothing); ``rand`` in
        [0, 1) is the draw that stretches the refresh leeway (0: not stretched).
        """
        sent = self.sent_secrets(request) if secrets is None else secrets
        where = f"token endpoint {redact_url(self.url)}"
        who = f"the {request.grant_name} request of client {self.client.client_id!r}"
        if isinstance(reply, Failure):
            said = reply.description
            kind = (
                "timed out" if "Timeout" in said or "deadline" in said else "could not be reached"
            )
            raise _Retryable(f"{where} {kind} ({said})", status_code=None, retry_after=None)
        status = reply.status_code
        if status == 429 or status >= 500:
            raise _Retryable(
                f"{where} answered {status}",
                status_code=status,
                retry_after=parse_retry_after(reply.header("Retry-After"), now=now),
            )
        if reply.oversize or reply.unreadable:
            why = reply.unreadable or f"a body over {MAX_TOKEN_ANSWER_BYTES} bytes"
            raise TokenError(
                f"{where} answered {who} with HTTP {status} and {why}, which agentkey does "
                "not read; check that token_url is the token endpoint",
                status_code=status,
            )
        payload: Any = parse_json(reply.content)
        if status != 200:
            error = _clean(payload.get("error"), sent, 80) if isinstance(payload, dict) else None
            description = (
                _clean(payload.get("error_description"), sent)
                if isinstance(payload, dict)
                else None
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
                f"{where} issued a {_clean(token_type, sent, 40)!r} token to {who}; agentkey sends "
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
        elif expected is not None and issued_type not in expected:
            raise TokenError(
                f"{where} answered {who} with issued_token_type "
                f"{_clean(str(issued_type), sent, 80)!r}, "
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
                    f"{_clean(str(payload['expires_in']), sent, 40)!r}; it must be seconds >= 0",
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
                rand=rand,
            ),
            refresh_token=SecretStr(refresh) if isinstance(refresh, str) and refresh else None,
            scope=scope if isinstance(scope, str) else None,
            issued_token_type=issued_type if isinstance(issued_type, str) else None,
        )

    # -- the token request as a flow on the engine --------------------------------------

    def exchange(
        self,
        request: TokenRequest,
        *,
        clock: Callable[[], float],
        rng: Callable[[], float],
        wall: Callable[[], float],
    ) -> TokenFlow:
        """Obtain a token for ``request``, retrying as the policy allows: a flow of effects.

        ``clock`` (monotonic seconds) measures the deadline, the token's lifetime and its
        refresh point; ``rng`` (uniform in [0, 1)) draws the jitter of waits and refresh points;
        ``wall`` gives the Unix time a ``Retry-After`` date is measured from. A
        TokenEvent is emitted when the request starts and when it ends, also when a
        failure the driver throws in ends it.
        """
        grant, origin = request.grant_name, str(self.origin)
        run = _Attempts(self, request, clock, rng, wall)
        yield Emit(TokenEvent("start", grant, origin, 0))
        try:
            token = yield from attempts(run)
        except GeneratorExit:
            raise
        except BaseException as exc:
            yield Emit(TokenEvent("end", grant, origin, run.attempts, type(exc).__name__))
            raise
        yield Emit(TokenEvent("end", grant, origin, run.attempts))
        return token

    def _exhausted(self, request: TokenRequest, exc: _Retryable, attempts: int) -> TokenError:
        return TokenError(
            f"token endpoint {redact_url(self.url)} was unavailable for the "
            f"{request.grant_name} request of client {self.client.client_id!r} "
            f"({exc.reason}) after {attempts} attempt(s); the next call tries again",
            status_code=exc.status_code,
        )


class _Attempts(Exchange[Token]):
    """One token request's exchange: a fresh request per attempt, judged by ``interpret``."""

    def __init__(
        self,
        endpoint: TokenEndpoint,
        grant: TokenRequest,
        clock: Callable[[], float],
        rng: Callable[[], float],
        wall: Callable[[], float],
    ) -> None:
        self.endpoint, self.grant, self.rng, self.wall = endpoint, grant, rng, wall
        self.clock = clock
        self.deadline = self.clock() + endpoint.policy.deadline  # the whole refresh, waits included
        self.attempts = 0  # token requests made so far
        self.sent_at = 0.0  # when the last one was sent, on the provider's clock
        self.secrets: tuple[str, ...] = ()  # the credentials it carried

    def request(self) -> Generator[Effect, Any, Outgoing]:
        endpoint = self.endpoint
        self.attempts += 1
        self.sent_at = now = self.clock()
        # Each attempt may take the policy's timeout, cut to the time left.
        seconds = max(0.001, min(endpoint.policy.timeout, self.deadline - now))
        out = endpoint.outgoing(self.grant, deadline=now + seconds)
        self.secrets = endpoint.sent_secrets(self.grant, out)
        yield from ()  # nothing to tell before a token request
        return out

    def judge(self, reply: Received) -> Generator[Effect, Any, Token | Again]:
        endpoint, grant, policy = self.endpoint, self.grant, self.endpoint.policy
        try:
            token = endpoint.interpret(
                grant, reply, self.sent_at, secrets=self.secrets, now=self.wall(), rand=self.rng()
            )
        except _Retryable as exc:
            left = self.deadline - self.clock()
            # A wait that would not end before the deadline is not begun: the refresh fails now.
            wait = policy.schedule.within(
                self.attempts, exc.retry_after, left=left, rng=self.rng, whole=True
            )
            if wait is None or self.attempts >= policy.max_attempts:
                raise endpoint._exhausted(grant, exc, self.attempts) from None
            return Again(
                wait, Note("warning", f"{exc.reason}; token request retried in {wait:.2f} s")
            )
        where = f"token endpoint {redact_url(endpoint.url)}"
        if grant.expect_issued_token_type is not None and token.issued_token_type is None:
            who = f"the {grant.grant_name} request of client {endpoint.client.client_id!r}"
            text = f"{where} answered {who} without issued_token_type"
            yield Emit(Note("debug", f"{text}; accepted as a Bearer access token"))
        lifetime = "unknown" if token.lifetime is None else f"{token.lifetime:g}"
        yield Emit(
            Note(
                "debug",
                f"token obtained with the {grant.grant_name} grant for client "
                f"{endpoint.client.client_id!r} from {redact_url(endpoint.url)} "
                f"(lifetime {lifetime} s)",
            )
        )
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
