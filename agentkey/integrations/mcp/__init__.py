"""MCP: deterministic idempotency keys for ``tools/call``, on the official ``mcp`` SDK.

Both halves of the contract over the Model Context Protocol:

- client: :class:`IdempotentSession` wraps an SDK ``ClientSession``; each
  ``call_tool`` derives its key from a :class:`~agentkey.PlanSession` (plan,
  step, tool, canonical arguments), sends it in ``params._meta`` under
  ``"io.agentkey/idempotency-key"``, resends the same key
  after a failure in doubt within a :class:`~agentkey.RetryPolicy`, and
  reports a replay read from the result's ``_meta`` (``"io.agentkey/replayed"``).
  :func:`connect` opens a streamable HTTP session whose bearer token an
  agentkey token provider keeps valid.
- server: :class:`IdempotentToolsMiddleware`, a middleware for the SDK's
  ``MCPServer`` or low-level ``Server``, deduplicates ``tools/call`` on that
  key with an agentkey :class:`~agentkey.server.Store`, scoped per principal,
  with the HTTP middleware's decision table. It reads the key in every convention
  in use (agentkey's field, SEP-3182's ``params.idempotencyKey``, UCP's
  ``arguments.meta``, an ``idempotency_key`` argument...; ``key_conventions=``).

See docs/mcp.md for the wire format, so any MCP client can take part.
Needs the ``mcp`` extra (``pip install 'agentkey-idempotency[mcp]'``); the
server half also needs the ``server`` extra (for Redis).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._exceptions import missing_extra

try:
    import mcp  # noqa: F401 - checked here so the error names the extra
    import mcp_types  # noqa: F401 - the SDK's wire types
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    if (exc.name or "").partition(".")[0] not in ("mcp", "mcp_types", "httpx2"):
        raise
    raise missing_extra("mcp", "mcp", exc) from None

from ._client import IdempotentSession, MCPToolResult, connect

if TYPE_CHECKING:
    from ._server import IdempotentToolsMiddleware

__all__ = [
    "IdempotentSession",
    "IdempotentToolsMiddleware",
    "MCPToolResult",
    "connect",
]


def __getattr__(name: str) -> object:
    """The server half loads on first use: it needs the ``server`` extra (redis) too."""
    if name == "IdempotentToolsMiddleware":
        from . import _server

        return getattr(_server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
