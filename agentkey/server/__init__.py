"""The server half of the contract: idempotency middleware, stores and blob stores.

Needs the ``server`` extra (``pip install 'agentkey-idempotency[server]'``). ``import
agentkey`` never imports this package. ``RedisStore`` (redis-py) and ``PostgresStore``
(psycopg) load on first use, so ``MemoryStore`` works with Starlette alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._exceptions import missing_extra

try:
    import starlette  # noqa: F401 - checked here so the error names the extra
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise missing_extra("server", "starlette", exc) from None

from ._blobs import BlobStore, FileBlobStore
from ._claim import Claim, current_claim
from ._decide import DecisionEvent
from ._middleware import IdempotencyMiddleware, starlette_user_identity
from ._options import ServerOptions
from ._reconcile import ReconcileContext, Reconciled
from ._stores import MemoryStore, Store

if TYPE_CHECKING:
    from ._postgres import PostgresStore, PostgresTransaction
    from .redis._store import RedisStore

_LAZY = {
    "PostgresStore": "_postgres",
    "PostgresTransaction": "_postgres",
    "RedisStore": "redis._store",
}


def __getattr__(name: str) -> object:
    """Stores load on first use: ``RedisStore`` needs redis-py, ``PostgresStore`` psycopg."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{module}", __name__), name)


__all__ = [
    "BlobStore",
    "Claim",
    "DecisionEvent",
    "FileBlobStore",
    "IdempotencyMiddleware",
    "MemoryStore",
    "PostgresStore",
    "PostgresTransaction",
    "ReconcileContext",
    "Reconciled",
    "RedisStore",
    "ServerOptions",
    "Store",
    "current_claim",
    "starlette_user_identity",
]
