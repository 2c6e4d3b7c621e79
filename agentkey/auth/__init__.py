"""OAuth token providers that keep every tool call's bearer token valid.

Each provider is an ``httpx.Auth``: pass it as ``auth=`` to an httpx client
or to agentkey's invokers. See docs/auth.md for which provider fits which
situation.
"""

from ._base import TokenProvider
from ._policy import TokenPolicy
from ._providers import (
    ACCESS_TOKEN_TYPE,
    ID_TOKEN_TYPE,
    JWT_TOKEN_TYPE,
    REFRESH_TOKEN_TYPE,
    ClientCredentials,
    OnBehalfOf,
    RefreshTokenGrant,
    StaticToken,
    TokenExchange,
)
from ._stores import EncryptedFileTokenStore, MemoryTokenStore, TokenStore

__all__ = [
    "ACCESS_TOKEN_TYPE",
    "ID_TOKEN_TYPE",
    "JWT_TOKEN_TYPE",
    "REFRESH_TOKEN_TYPE",
    "ClientCredentials",
    "EncryptedFileTokenStore",
    "MemoryTokenStore",
    "OnBehalfOf",
    "RefreshTokenGrant",
    "StaticToken",
    "TokenExchange",
    "TokenPolicy",
    "TokenProvider",
    "TokenStore",
]
