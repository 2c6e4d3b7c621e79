"""The token providers: client credentials, refresh token, token exchange, on-behalf-of, static."""

from __future__ import annotations

import dataclasses
import logging
import ssl
from collections.abc import Callable, Sequence
from typing import ClassVar

from pydantic import SecretStr

from .._clock import Clock
from .._exceptions import AuthError, ConfigurationError, DelegationExpired, TokenError
from .._validate import secret
from ..client._net import redact_url
from ._base import Obtain, TokenProvider, call, send
from ._endpoint import ClientAuth, TokenEndpoint, TokenRequest, scope_text
from ._oauth import AuthMethod
from ._token import Token, TokenHook, header_safe, jwt_expired
from ._token_policy import TokenPolicy
from ._token_stores import MemoryTokenStore, TokenStore

__all__ = [
    "ACCESS_TOKEN_TYPE",
    "ID_TOKEN_TYPE",
    "JWT_TOKEN_TYPE",
    "REFRESH_TOKEN_TYPE",
    "ClientCredentials",
    "OAuthProvider",
    "OnBehalfOf",
    "RefreshTokenGrant",
    "StaticToken",
    "TokenExchange",
]

_log = logging.getLogger("agentkey.auth")

ACCESS_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:access_token"  # noqa: S105 - a URI from RFC 8693, not a secret
REFRESH_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:refresh_token"  # noqa: S105 - a URI from RFC 8693, not a secret
ID_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:id_token"  # noqa: S105 - a URI from RFC 8693, not a secret
JWT_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:jwt"  # noqa: S105 - a URI from RFC 8693, not a secret
_TOKEN_EXCHANGE = "urn:ietf:params:oauth:grant-type:token-exchange"  # noqa: S105 - a URI from RFC 8693, not a secret
_JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"

SecretInput = str | SecretStr
SubjectInput = str | SecretStr | Callable[[], str | SecretStr]


def _secret(value: object, name: str, *, required: bool = False) -> SecretStr | None:
    if value is None and required:
        raise ConfigurationError(f"{name} is required")
    return secret(name, value)


def _strings(value: str | Sequence[str] | None, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, str) else tuple(value)
    if any(not isinstance(v, str) or not v for v in items):
        raise ConfigurationError(f"{name} must be a non-empty string or a list of them")
    return items


def _client(
    kind: str,
    client_id: str | None,
    client_secret: SecretInput | None,
    client: ClientAuth | None,
    method: AuthMethod,
) -> ClientAuth:
    """The provider's ClientAuth: ``client``, or the shorthand of an id and a secret."""
    if client is not None:
        if client_id is not None or client_secret is not None:
            raise ConfigurationError(
                f"{kind} takes client=ClientAuth(...) or client_id and client_secret, not "
                "both; put the id and the secret into the ClientAuth"
            )
        if not isinstance(client, ClientAuth):
            raise ConfigurationError(
                f"client must be an agentkey.auth.ClientAuth, got a {type(client).__name__}"
            )
        return client
    if client_id is None:
        raise ConfigurationError(
            f"{kind} needs the client's authentication: client=ClientAuth(client_id, "
            "client_secret) or, as a shorthand, client_id and client_secret"
        )
    if client_secret is None:
        raise ConfigurationError(
            f"{kind} got client_id without client_secret; a public client passes "
            "client=ClientAuth(client_id, method='none'), a client with a key passes "
            "client=ClientAuth(client_id, method='private_key_jwt', private_key=...)"
        )
    return ClientAuth(client_id, client_secret, method=method)


class OAuthProvider(TokenProvider):
    """A provider that talks to a token endpoint as one OAuth client: the base for a new grant.

    The constructor takes the token endpoint and the client's authentication,
    as :class:`ClientCredentials` does. A subclass overrides
    :meth:`token_request` to say what to ask for; everything else (client
    authentication, retries, the single flight, refresh before expiry and
    after a 401, hooks) is inherited::

        class JwtBearer(OAuthProvider):
            def __init__(self, token_url, client: ClientAuth, *, assertion):
                super().__init__(token_url, client=client)
                self._assertion = SecretStr(assertion)

            def token_request(self, current: Token | None) -> TokenRequest:
                grant = "urn:ietf:params:oauth:grant-type:jwt-bearer"
                return TokenRequest(grant, (("assertion", self._assertion),))
    """

    _endpoint: TokenEndpoint
    #: The method of the shorthand ``(token_url, client_id, client_secret)``.
    _shorthand: ClassVar[AuthMethod] = "client_secret_basic"

    def __init__(
        self,
        token_url: str,
        client_id: str | None = None,
        client_secret: SecretInput | None = None,
        *,
        client: ClientAuth | None = None,
        policy: TokenPolicy = TokenPolicy(),  # noqa: B008 - frozen, so one shared default is safe
        verify: ssl.SSLContext | bool = True,
        hooks: Sequence[TokenHook] | None = None,
        clock: Clock | None = None,
    ) -> None:
        auth = _client(type(self).__name__, client_id, client_secret, client, self._shorthand)
        super().__init__(
            TokenEndpoint(token_url, auth, policy=policy, verify=verify),
            policy=policy,
            hooks=hooks,
            clock=clock,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(token_url={redact_url(self._endpoint.url)!r}, "
            f"client_id={self._endpoint.client.client_id!r}, "
            f"method={self._endpoint.client.method!r})"
        )

    @property
    def client_id(self) -> str:
        return self._endpoint.client.client_id

    @property
    def client(self) -> ClientAuth:
        """How this provider authenticates at its token endpoint."""
        return self._endpoint.client

    def _who(self) -> str:
        return f"{type(self).__name__} for client {self.client_id!r}"

    def token_request(self, current: Token | None) -> TokenRequest:
        """The request that obtains a new token; ``current`` is the token being replaced.

        ``current`` is None on the first request (and after ``invalidate()``);
        its ``refresh_token``, when the endpoint sent one, can renew it.
        """
        raise NotImplementedError(f"{type(self).__name__} must define token_request()")

    def _obtain(self, current: Token | None) -> Obtain:
        return (yield from send(self.token_request(current)))


class ClientCredentials(OAuthProvider):
    """Machine-to-machine tokens: the OAuth 2.0 client credentials grant (RFC 6749 section 4.4).

    ``scope`` may be a string or a list; ``audience`` (Auth0 and others) and
    ``resource`` (RFC 8707, may repeat) name the API the token is for.
    ``ClientCredentials(token_url, client_id, client_secret)`` authenticates with
    ``client_secret_basic``; any other way (``client_secret_post``,
    ``private_key_jwt``, a public client) is ``client=ClientAuth(...)``.
    """

    def __init__(
        self,
        token_url: str,
        client_id: str | None = None,
        client_secret: SecretInput | None = None,
        *,
        scope: str | Sequence[str] | None = None,
        audience: str | Sequence[str] | None = None,
        resource: str | Sequence[str] | None = None,
        client: ClientAuth | None = None,
        policy: TokenPolicy = TokenPolicy(),  # noqa: B008 - frozen, so one shared default is safe
        verify: ssl.SSLContext | bool = True,
        hooks: Sequence[TokenHook] | None = None,
        clock: Clock | None = None,
    ) -> None:
        super().__init__(
            token_url,
            client_id,
            client_secret,
            client=client,
            policy=policy,
            verify=verify,
            hooks=hooks,
            clock=clock,
        )
        params: list[tuple[str, str | SecretStr]] = []
        text = scope_text(scope)
        if text:
            params.append(("scope", text))
        params += [("audience", a) for a in _strings(audience, "audience")]
        params += [("resource", r) for r in _strings(resource, "resource")]
        self._request = TokenRequest("client_credentials", tuple(params))

    def token_request(self, current: Token | None) -> TokenRequest:
        return self._request


class RefreshTokenGrant(OAuthProvider):
    """Tokens renewed from a refresh token (RFC 6749 section 6), e.g. a user's offline grant.

    The refresh token lives in ``store`` under ``store_key``. ``refresh_token``
    seeds an empty store; a token already in the store wins, because after a
    rotation the configured one is spent. When the store offers
    ``rotation_lock`` (both agentkey stores do), the rotation holds it, so
    providers and processes sharing the store take turns and each spends the
    token the previous one stored. When the endpoint rotates the
    refresh token, the new one is saved (atomically, by the store) before the
    access token that came with it is used; when it sends none, the old one is
    kept. ``invalid_grant`` raises DelegationExpired: the user must authorise
    again.
    """

    def __init__(
        self,
        token_url: str,
        client_id: str | None = None,
        client_secret: SecretInput | None = None,
        *,
        refresh_token: SecretInput | None = None,
        store: TokenStore | None = None,
        store_key: str | None = None,
        scope: str | Sequence[str] | None = None,
        client: ClientAuth | None = None,
        policy: TokenPolicy = TokenPolicy(),  # noqa: B008 - frozen, so one shared default is safe
        verify: ssl.SSLContext | bool = True,
        hooks: Sequence[TokenHook] | None = None,
        clock: Clock | None = None,
    ) -> None:
        super().__init__(
            token_url,
            client_id,
            client_secret,
            client=client,
            policy=policy,
            verify=verify,
            hooks=hooks,
            clock=clock,
        )
        if store is not None and not isinstance(store, TokenStore):
            raise ConfigurationError("store must implement load, save and delete (TokenStore)")
        self._initial = _secret(refresh_token, "refresh_token")
        self._store: TokenStore = store if store is not None else MemoryTokenStore()
        if store is None and self._initial is None:
            raise ConfigurationError("RefreshTokenGrant needs refresh_token=, store=, or both")
        self._store_key = store_key or f"refresh_token:{self.client_id}@{redact_url(token_url)}"
        self._scope = scope_text(scope)

    @property
    def store_key(self) -> str:
        """The name the refresh token is stored under."""
        return self._store_key

    def _obtain(self, current: Token | None) -> Obtain:
        # Held from reading the refresh token until the rotated one is saved, so providers
        # and processes sharing the store never spend one refresh token twice: whoever
        # waited reads the token the previous holder stored.
        opener = getattr(self._store, "rotation_lock", None)
        if opener is None:
            return (yield from self._rotate())
        lock = opener(self._store_key)
        yield from call(lock.__enter__)  # may wait for another process: a worker thread
        try:
            return (yield from self._rotate())
        finally:
            lock.__exit__(None, None, None)  # quick; never a yield, so closing works too

    def _rotate(self) -> Obtain:
        stored = yield from call(lambda: self._store.load(self._store_key))
        refresh = stored or self._initial
        if refresh is None:
            raise DelegationExpired(
                f"{self._who()} has no refresh token in its store under {self._store_key!r}; "
                "the user must authorise the agent again, then store the new refresh token",
                error="invalid_grant",
            )
        params: list[tuple[str, str | SecretStr]] = [("refresh_token", refresh)]
        if self._scope:
            params.append(("scope", self._scope))
        try:
            token = yield from send(TokenRequest("refresh_token", tuple(params)))
        except TokenError as exc:
            if exc.error != "invalid_grant":
                raise
            raise DelegationExpired(
                f"{self._who()}: the refresh token was refused "
                f"({exc.error_description or exc.error}); it expired or was revoked, "
                "so the user must authorise the agent again",
                error=exc.error,
                error_description=exc.error_description,
                status_code=exc.status_code,
            ) from None
        rotated = token.refresh_token
        if rotated is not None and rotated.get_secret_value() != refresh.get_secret_value():
            yield from call(lambda: self._store.save(self._store_key, rotated))
            _log.debug("%s: rotated refresh token saved under %r", self._who(), self._store_key)
        elif stored is None:
            yield from call(lambda: self._store.save(self._store_key, refresh))
        return dataclasses.replace(token, refresh_token=None)  # the store holds it


class _Delegated(OAuthProvider):
    """A delegated token obtained from a user's token, renewed by refresh token when one came."""

    _delegation_errors = frozenset({"invalid_grant"})
    _subject_name = "subject_token"

    def _set_subject(self, subject: SubjectInput) -> None:
        if callable(subject):
            self._subject_source: Callable[[], str | SecretStr] | SecretStr = subject
        else:
            secret = _secret(subject, self._subject_name, required=True)
            assert secret is not None
            self._subject_source = secret

    def _subject(self) -> SecretStr:
        source = self._subject_source
        if isinstance(source, SecretStr):
            return source
        try:
            value = source()
        except Exception as exc:
            raise AuthError(
                f"{self._who()}: the {self._subject_name} callable raised {type(exc).__name__}; "
                "fix the callable, or pass the user's token itself"
            ) from exc
        try:
            secret = _secret(value, f"the value returned by the {self._subject_name} callable")
        except ConfigurationError as exc:
            raise AuthError(f"{self._who()}: {exc}") from None
        if secret is None:
            raise DelegationExpired(
                f"{self._who()}: the {self._subject_name} callable returned None (no user "
                "token); the user must authorise the agent again",
            )
        return secret

    def _exchange(self, subject: SecretStr) -> TokenRequest:
        raise NotImplementedError

    def _obtain(self, current: Token | None) -> Obtain:
        if current is not None and current.refresh_token is not None:
            params: tuple[tuple[str, str | SecretStr], ...] = (
                ("refresh_token", current.refresh_token),
            )
            try:
                token = yield from send(TokenRequest("refresh_token", params))
            except TokenError as exc:
                if exc.error != "invalid_grant":
                    raise
                _log.debug("%s: refresh token refused; exchanging the user's token", self._who())
            else:
                if token.refresh_token is None:
                    token = dataclasses.replace(token, refresh_token=current.refresh_token)
                return token
        subject = self._subject()
        if jwt_expired(subject.get_secret_value(), now=self._clock.time()):
            raise DelegationExpired(
                f"{self._who()}: the user's token ({self._subject_name}) has expired and no "
                "refresh token can renew the delegation; the user must authorise the agent "
                "again (sign in), then pass the new token",
                error="invalid_grant",
            )
        try:
            return (yield from send(self._exchange(subject)))
        except TokenError as exc:
            if exc.error not in self._delegation_errors:
                raise
            raise DelegationExpired(
                f"{self._who()}: the identity provider refused the user's token "
                f"({exc.error}: {exc.error_description or 'no description'}); the delegation "
                "cannot be renewed, so the user must authorise the agent again (sign in)",
                error=exc.error,
                error_description=exc.error_description,
                status_code=exc.status_code,
            ) from None


class TokenExchange(_Delegated):
    """A delegated token by RFC 8693 token exchange: the user's token in, the tool's token out.

    ``subject_token`` is the user's token, or a callable returning the current
    one. ``audience`` and ``resource`` may repeat. ``actor_token_type`` must be
    given exactly when ``actor_token`` is. The answer's ``issued_token_type``
    must be ``requested_token_type`` (default: an access token or a JWT).
    When the exchange returns a refresh token, renewals use it; when the
    user's token has expired and nothing can renew, DelegationExpired says the
    user must authorise again.

    The RFC 8693 token-type URIs these options take are class attributes:
    ``TokenExchange.ACCESS_TOKEN_TYPE``, ``REFRESH_TOKEN_TYPE``, ``ID_TOKEN_TYPE``
    and ``JWT_TOKEN_TYPE``.
    """

    ACCESS_TOKEN_TYPE: ClassVar[str] = ACCESS_TOKEN_TYPE
    REFRESH_TOKEN_TYPE: ClassVar[str] = REFRESH_TOKEN_TYPE
    ID_TOKEN_TYPE: ClassVar[str] = ID_TOKEN_TYPE
    JWT_TOKEN_TYPE: ClassVar[str] = JWT_TOKEN_TYPE

    def __init__(
        self,
        token_url: str,
        client_id: str | None = None,
        client_secret: SecretInput | None = None,
        *,
        subject_token: SubjectInput,
        subject_token_type: str = ACCESS_TOKEN_TYPE,
        actor_token: SecretInput | None = None,
        actor_token_type: str | None = None,
        audience: str | Sequence[str] | None = None,
        resource: str | Sequence[str] | None = None,
        scope: str | Sequence[str] | None = None,
        requested_token_type: str | None = None,
        client: ClientAuth | None = None,
        policy: TokenPolicy = TokenPolicy(),  # noqa: B008 - frozen, so one shared default is safe
        verify: ssl.SSLContext | bool = True,
        hooks: Sequence[TokenHook] | None = None,
        clock: Clock | None = None,
    ) -> None:
        super().__init__(
            token_url,
            client_id,
            client_secret,
            client=client,
            policy=policy,
            verify=verify,
            hooks=hooks,
            clock=clock,
        )
        self._set_subject(subject_token)
        if not isinstance(subject_token_type, str) or not subject_token_type:
            raise ConfigurationError("subject_token_type must be a token type URI")
        self._actor = _secret(actor_token, "actor_token")
        if (self._actor is None) != (actor_token_type is None):
            raise ConfigurationError(
                "actor_token and actor_token_type go together (RFC 8693 section 2.1): "
                "pass both or neither"
            )
        params: list[tuple[str, str | SecretStr]] = [("subject_token_type", subject_token_type)]
        if self._actor is not None and actor_token_type is not None:
            params += [("actor_token", self._actor), ("actor_token_type", actor_token_type)]
        params += [("audience", a) for a in _strings(audience, "audience")]
        params += [("resource", r) for r in _strings(resource, "resource")]
        text = scope_text(scope)
        if text:
            params.append(("scope", text))
        if requested_token_type is not None:
            params.append(("requested_token_type", requested_token_type))
            self._expect = frozenset({requested_token_type})
        else:
            self._expect = frozenset({ACCESS_TOKEN_TYPE, JWT_TOKEN_TYPE})
        self._params = tuple(params)

    def _exchange(self, subject: SecretStr) -> TokenRequest:
        return TokenRequest(
            _TOKEN_EXCHANGE,
            (("subject_token", subject), *self._params),
            expect_issued_token_type=self._expect,
        )


class OnBehalfOf(_Delegated):
    """Microsoft Entra ID's on-behalf-of flow: the jwt-bearer grant with ``on_behalf_of`` use.

    ``user_token`` is the access token the user sent to your service (or a
    callable returning it); ``scope`` names the downstream API, for example
    ``"api://tool/.default"``. Entra wants ``client_secret_post`` (what the
    shorthand ``client_id, client_secret`` sends) or ``private_key_jwt`` (pass
    ``client=ClientAuth(..., method="private_key_jwt", private_key=...)``).
    ``invalid_grant`` and ``interaction_required`` (the user must sign in, consent or
    pass MFA again) raise DelegationExpired.
    """

    _delegation_errors = frozenset({"invalid_grant", "interaction_required", "consent_required"})
    _subject_name = "user_token"
    _shorthand: ClassVar[AuthMethod] = "client_secret_post"  # what Entra wants

    def __init__(
        self,
        token_url: str,
        client_id: str | None = None,
        client_secret: SecretInput | None = None,
        *,
        user_token: SubjectInput,
        scope: str | Sequence[str],
        client: ClientAuth | None = None,
        policy: TokenPolicy = TokenPolicy(),  # noqa: B008 - frozen, so one shared default is safe
        verify: ssl.SSLContext | bool = True,
        hooks: Sequence[TokenHook] | None = None,
        clock: Clock | None = None,
    ) -> None:
        super().__init__(
            token_url,
            client_id,
            client_secret,
            client=client,
            policy=policy,
            verify=verify,
            hooks=hooks,
            clock=clock,
        )
        self._set_subject(user_token)
        text = scope_text(scope)
        if not text:
            raise ConfigurationError(
                "OnBehalfOf needs scope= naming the downstream API, e.g. 'api://tool/.default'"
            )
        self._scope = text

    def _exchange(self, subject: SecretStr) -> TokenRequest:
        return TokenRequest(
            _JWT_BEARER,
            (
                ("assertion", subject),
                ("requested_token_use", "on_behalf_of"),
                ("scope", self._scope),
            ),
        )


class StaticToken(TokenProvider):
    """A token you already hold (tests, pre-issued tokens). It is never renewed.

    A 401 answer is handed back as it is, so the caller raises
    TokenRejected; refusing plain http to non-loopback hosts still applies.
    """

    _can_refresh = False

    def __init__(self, token: SecretInput, *, clock: Clock | None = None) -> None:
        super().__init__(None, policy=TokenPolicy(), clock=clock)
        secret = _secret(token, "token", required=True)
        assert secret is not None
        if not header_safe(secret.get_secret_value()):
            raise ConfigurationError(
                "token holds spaces, control or non-ASCII characters, which an Authorization "
                "header cannot carry; pass the bare access token (without 'Bearer ')"
            )
        self._token = Token(access_token=secret, obtained_at=self._clock.monotonic())

    def __repr__(self) -> str:
        return "StaticToken(<token hidden>)"

    def invalidate(self) -> None:
        """A StaticToken keeps its token: there is nothing to fetch."""

    def _obtain(self, current: Token | None) -> Obtain:
        raise AuthError("a StaticToken cannot be renewed; pass a new token in a new StaticToken")
