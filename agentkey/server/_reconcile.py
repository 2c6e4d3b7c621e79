"""Settling a key in doubt: the ``reconcile=`` hook of both middlewares.

A key is in doubt when a request may have started its side effect and did not
finish (its server died, its lease lapsed while the store was down, or it failed
with a 5xx or an exception). The store never forgets it, and no request runs under
it by itself. When a request meets such a key, the front end asks its ``reconcile``
hook, if it has one, with a :class:`ReconcileContext`; the hook looks at the target
system (the payment provider, the database) and answers a :class:`Reconciled`:

- :meth:`Reconciled.ran`: it happened; this is the answer. It is recorded as the
  key's outcome and replayed, to this request and every later one;
- :meth:`Reconciled.not_run`: it did not happen. This request claims the key afresh
  (compare-and-set on the record it met) and runs the handler;
- :meth:`Reconciled.unknown`: still unknown. The request gets the in-doubt answer.

The hook may be a plain function or a coroutine function (or return an awaitable);
an awaitable is bounded by ``reconcile_timeout`` seconds. A hook that raises, times
out or returns anything else counts as "still unknown": it never fails the request.
A plain function runs on the event loop: keep it quick, or make it async.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio

from .._exceptions import ConfigurationError
from .._keys import shown_key

__all__ = ["ReconcileContext", "ReconcileHook", "Reconciled", "ask", "check_reconcile"]

_logger = logging.getLogger("agentkey.server")


@dataclass(frozen=True, slots=True)
class ReconcileContext:
    """What a ``reconcile`` hook is told about a key in doubt and the request that met it.

    ``method`` and ``route`` name the operation (HTTP: the method and the route path;
    MCP: ``"tools/call"`` and the tool's name). ``body`` is the request's body (MCP:
    the canonical JSON of the arguments). ``started_ms`` is when the earlier request
    claimed the key and ``doubt_since_ms`` when it became in doubt (Unix ms). The
    ``repr`` shows the key redacted: it is a bearer secret.
    """

    idempotency_key: str
    principal: str
    method: str
    route: str
    body: bytes = field(repr=False)
    started_ms: int
    doubt_since_ms: int

    def __repr__(self) -> str:
        return (
            f"ReconcileContext(idempotency_key={shown_key(self.idempotency_key)!r}, "
            f"method={self.method!r}, route={self.route!r}, started_ms={self.started_ms})"
        )

    def json(self) -> Any:
        """The body parsed as JSON (the tool's arguments)."""
        return json.loads(self.body)


@dataclass(frozen=True, slots=True)
class Reconciled:
    """A ``reconcile`` hook's answer; build it with :meth:`ran`, :meth:`not_run` or
    :meth:`unknown`."""

    outcome: Literal["ran", "not_run", "unknown"]
    status: int = 200
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""

    @classmethod
    def ran(
        cls,
        body: bytes | Mapping[str, Any] = b"",
        *,
        status: int = 200,
        headers: Iterable[tuple[str, str]] = (),
    ) -> Reconciled:
        """It happened, and this is its answer (recorded for the key and replayed).

        ``body`` as bytes, or a mapping sent as JSON (MCP: the tool's result, such as
        ``{"content": [{"type": "text", "text": "..."}]}``). ``status`` must be a final
        answer (2xx, or a 4xx about the request).
        """
        hdrs = tuple((str(k).lower(), str(v)) for k, v in headers)
        if isinstance(body, Mapping):
            body = json.dumps(dict(body), separators=(",", ":")).encode()
            if not any(k == "content-type" for k, _ in hdrs):
                hdrs += (("content-type", "application/json"),)
        if not isinstance(body, bytes):
            raise ConfigurationError(
                f"Reconciled.ran() takes bytes or a mapping, got {type(body).__name__}"
            )
        from ._decide import is_storable

        if isinstance(status, bool) or not isinstance(status, int) or not is_storable(status):
            raise ConfigurationError(
                f"Reconciled.ran() needs a final status (2xx, or a 4xx about the request), "
                f"got {status!r}; answer Reconciled.unknown() when the outcome is not known"
            )
        return cls("ran", status, hdrs, body)

    @classmethod
    def not_run(cls) -> Reconciled:
        """It did not happen: the request that asked runs it now, under a fresh claim."""
        return cls("not_run")

    @classmethod
    def unknown(cls) -> Reconciled:
        """Still unknown: the key stays in doubt."""
        return cls("unknown")


ReconcileHook = Callable[[ReconcileContext], "Reconciled | Awaitable[Reconciled]"]

_UNKNOWN = Reconciled("unknown")


def check_reconcile(hook: object, timeout: object) -> None:
    if hook is not None and not callable(hook):
        raise ConfigurationError(
            f"reconcile must be a function (ReconcileContext) -> Reconciled, got "
            f"{type(hook).__name__}"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 300:
        raise ConfigurationError(f"reconcile_timeout must be 0 to 300 seconds, got {timeout!r}")


async def ask(hook: ReconcileHook, context: ReconcileContext, seconds: float) -> Reconciled:
    """The hook's answer; "still unknown" when it fails, times out or answers anything else."""
    key = shown_key(context.idempotency_key)
    try:
        value: object = hook(context)
        if inspect.isawaitable(value):
            with anyio.move_on_after(seconds) as scope:
                value = await value
            if scope.cancelled_caught:
                _logger.warning(
                    "the reconcile hook did not answer for %s within %g s; the key stays in doubt",
                    key,
                    seconds,
                )
                return _UNKNOWN
    except Exception as exc:
        _logger.warning(
            "the reconcile hook failed for %s (%s); the key stays in doubt",
            key,
            type(exc).__name__,
        )
        return _UNKNOWN
    if not isinstance(value, Reconciled):
        _logger.warning(
            "the reconcile hook answered %s for %s, not a Reconciled; the key stays in doubt",
            type(value).__name__,
            key,
        )
        return _UNKNOWN
    return value
