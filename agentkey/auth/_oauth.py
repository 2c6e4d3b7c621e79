"""The one module that touches authlib: client authentication and client assertions.

authlib has no type hints, so its untyped surface stays inside this file.
Only its client-agnostic pieces are used (``authlib.oauth2.auth`` and
``authlib.oauth2.rfc7523``); ``authlib.integrations.httpx_client`` never is.
authlib and joserfc are imported on first use, so ``import agentkey`` stays
fast for code that never fetches a token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, TypeAlias
from urllib.parse import quote

from .._exceptions import ConfigurationError

if TYPE_CHECKING:
    from joserfc.jwk import ECKey, OKPKey, RSAKey

    PrivateKey: TypeAlias = RSAKey | ECKey | OKPKey

__all__ = [
    "ASSERTION_TYPE",
    "AuthMethod",
    "apply_client_auth",
    "load_private_key",
    "sign_client_assertion",
]

AuthMethod = Literal["client_secret_basic", "client_secret_post", "private_key_jwt", "none"]

ASSERTION_TYPE = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"

_KEY_TYPES: dict[str, Literal["RSA", "EC", "OKP"]] = {
    "RS": "RSA",
    "PS": "RSA",
    "ES": "EC",
    "Ed": "OKP",
}


def load_private_key(pem: str | bytes, alg: str) -> PrivateKey:
    """Import a PEM private key for ``alg`` (RS256, PS256, ES256, EdDSA ...).

    A key that cannot be read raises ConfigurationError without echoing it.
    """
    key_type = _KEY_TYPES.get(alg[:2])
    if key_type is None:
        raise ConfigurationError(
            f"private_key_alg {alg!r} is not an asymmetric JWS algorithm; "
            "use RS256, PS256, ES256 or EdDSA"
        )
    from joserfc.jwk import import_key

    try:
        key = import_key(pem, key_type)
    except Exception:  # joserfc raises several types; the key must not leak into a message
        raise ConfigurationError(
            f"private_key could not be read as a PEM {key_type} private key for {alg}; "
            "pass the PEM text of the key registered with the identity provider"
        ) from None  # the cause could quote key material
    if not key.is_private:
        raise ConfigurationError(
            "private_key is a public key; private_key_jwt needs the private half"
        )
    return key


def sign_client_assertion(
    key: PrivateKey,
    *,
    client_id: str,
    audience: str,
    alg: str,
    lifetime: float,
    key_id: str | None,
) -> str:
    """A fresh RFC 7523 client assertion: new ``jti``, ``exp`` ``lifetime`` seconds ahead."""
    header: dict[str, Any] = {"typ": "JWT"}
    if key_id is not None:
        header["kid"] = key_id
    from authlib.oauth2.rfc7523.assertion import private_key_jwt_sign

    # authlib puts iss = sub = client_id, aud = the token endpoint, iat, exp and a
    # fresh random jti (RFC 7523 section 3) into every assertion it signs.
    assertion: Any = private_key_jwt_sign(
        key,
        client_id=client_id,
        token_endpoint=audience,
        alg=alg,
        claims=None,
        header=header,
        expires_in=max(1, int(lifetime)),
    )
    return str(assertion)


def apply_client_auth(
    method: AuthMethod,
    *,
    client_id: str,
    client_secret: str | None,
    assertion: str | None,
    token_url: str,
    headers: dict[str, str],
    body: str,
) -> tuple[dict[str, str], str]:
    """Add client authentication to a token request; returns the new headers and body."""
    from authlib.common.urls import add_params_to_qs
    from authlib.oauth2.auth import ClientAuth

    if method == "private_key_jwt":
        assert assertion is not None
        auth: Any = ClientAuth(client_id, None, "none")
        _, headers, body = auth.prepare("POST", token_url, headers, body)
        body = add_params_to_qs(
            body, [("client_assertion_type", ASSERTION_TYPE), ("client_assertion", assertion)]
        )
        return headers, str(body)
    if method == "client_secret_basic":
        # RFC 6749 section 2.3.1: both parts are form-urlencoded before base64.
        auth = ClientAuth(quote(client_id, safe=""), quote(client_secret or "", safe=""), method)
    else:
        auth = ClientAuth(client_id, client_secret or "", method)
    _, headers, body = auth.prepare("POST", token_url, headers, body)
    return headers, str(body)
