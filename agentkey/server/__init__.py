"""The server half of the contract: idempotency middleware, stores and blob stores.

Needs the ``server`` extra (``pip install 'agentkey-idempotency[server]'``). ``import
agentkey`` never imports this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._exceptions import MissingExtra

try:
    import starlette  # noqa: F401 - checked here so the error names the extra
except ImportError:  # pragma: no cover - exercised in a subprocess test
    raise MissingExtra("server", "starlette") from None
try:
    import redis  # noqa: F401 - checked here so the error names the extra
except ImportError:  # pragma: no cover - exercised in a subprocess test
    raise MissingExtra("server", "redis") from None

from ._blobs import BlobStore, FileBlobStore
from ._claim import Claim, current_claim, get_claim
from ._example import example_app
from ._middleware import REPLAY_HEADER, IdempotencyMiddleware, PrincipalFunc, is_storable
from ._stores import MemoryStore, RedisStore, Store

if TYPE_CHECKING:
    from ._postgres import PostgresStore, PostgresTransaction, RecoveryPoint

_POSTGRES = frozenset({"PostgresStore", "PostgresTransaction", "RecoveryPoint"})


def __getattr__(name: str) -> object:
    """The PostgreSQL store loads on first use: it needs the ``postgres`` extra (psycopg)."""
    if name in _POSTGRES:
        from . import _postgres

        return getattr(_postgres, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "REPLAY_HEADER",
    "BlobStore",
    "Claim",
    "FileBlobStore",
    "IdempotencyMiddleware",
    "MemoryStore",
    "PostgresStore",
    "PostgresTransaction",
    "PrincipalFunc",
    "RecoveryPoint",
    "RedisStore",
    "Store",
    "current_claim",
    "example_app",
    "get_claim",
    "is_storable",
]
