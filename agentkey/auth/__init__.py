"""OAuth token providers that keep every tool call's bearer token valid.

Each provider is an ``httpx.Auth``: pass it as ``auth=`` to an httpx client
or to agentkey's invokers. See docs/auth.md for which provider fits which
situation. A grant agentkey lacks is a subclass of :class:`OAuthProvider`
that returns a :class:`TokenRequest` from ``token_request``.
"""

from ._base import TokenProvider
from ._endpoint import ClientAuth, TokenRequest
from ._providers import (
    ClientCredentials,
    OAuthProvider,
    OnBehalfOf,
    RefreshTokenGrant,
    StaticToken,
    TokenExchange,
)
from ._token import Token, TokenEvent
from ._token_policy import TokenPolicy
from ._token_stores import EncryptedFileTokenStore, TokenStore

__all__ = [
    "ClientAuth",
    "ClientCredentials",
    "EncryptedFileTokenStore",
    "OAuthProvider",
    "OnBehalfOf",
    "RefreshTokenGrant",
    "StaticToken",
    "Token",
    "TokenEvent",
    "TokenExchange",
    "TokenPolicy",
    "TokenProvider",
    "TokenRequest",
    "TokenStore",
]
