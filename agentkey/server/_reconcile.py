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
- :meth:`Reconciled.in_doubt`: still in doubt. The request gets the in-doubt answer.

The hook may be a plain function (run in a worker thread) or a coroutine function
(or return an awaitable); either is bounded by ``reconcile_timeout`` seconds. A hook
that raises, times out or returns anything else counts as "still in doubt": it never
fails the request.

A key in doubt only because its lease lapsed (``why == "lease lapsed"``: the store
was down while its handler ran, or its process died) may still have a live handler
about to call the provider. A ``not_run`` answer for it is taken as "still in doubt"
until one more ``lock_ttl`` has passed since the lease ended (on the server's
clock), so the step never runs beside its first handler. A key its own handler put
in doubt (``why == "failed after start"``: a 5xx or an exception; that handler is
done) is run at once on ``not_run``.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import anyio.to_thread

from .._exceptions import ConfigurationError
from .._keys import shown_key
from ._records import InProgress

__all__ = [
    "ReconcileContext",
    "ReconcileHook",
    "Reconciled",
    "ask",
    "check_reconcile",
    "context_for",
]

_logger = logging.getLogger("agentkey.server")


@dataclass(frozen=True, slots=True)
class ReconcileContext:
    """What a ``reconcile`` hook is told about a key in doubt and the request that met it.

    ``method`` and ``route`` name the operation (HTTP: the method and the route path;
    MCP: ``"tools/call"`` and the tool's name). ``body`` is the request's body (MCP:
    the canonical JSON of the arguments). ``started_ms`` is when the earlier request
    claimed the key and ``doubt_since_ms`` when it became in doubt (Unix ms).
    ``why`` says why it is in doubt: ``"failed after start"`` (its handler answered a
    5xx or raised after it may have started: that handler is done) or ``"lease lapsed"``
    (its lease ended without a renewal: its process died, or the store was down while
    it ran, and its handler may still be running). ``doubt_for_ms`` is how long it has
    been in doubt, on the server's clock. Look the downstream call up with
    :meth:`key_for`, never with ``idempotency_key`` (a bearer secret). The ``repr``
    shows the key redacted.
    """

    idempotency_key: str
    principal: str
    method: str
    route: str
    body: bytes = field(repr=False)
    started_ms: int
    doubt_since_ms: int
    why: Literal["failed after start", "lease lapsed"] = "failed after start"
    doubt_for_ms: int = 0
    _key_for: Callable[[str], str] | None = field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        return (
            f"ReconcileContext(idempotency_key={shown_key(self.idempotency_key)!r}, "
            f"method={self.method!r}, route={self.route!r}, started_ms={self.started_ms}, "
            f"why={self.why!r}, doubt_for_ms={self.doubt_for_ms})"
        )

    def key_for(self, name: str) -> str:
        """The downstream key ``claim.key_for(name)`` gives this request's handler: look
        the provider up with it (it is the same for the first handler and this request).

        Raises :class:`~agentkey.InvalidKey` for a bad ``name``, as ``claim.key_for`` does.
        """
        if self._key_for is None:
            raise ConfigurationError("this ReconcileContext was built without a claim")
        return self._key_for(name)

    def json(self) -> Any:
        """The body parsed as JSON (the tool's arguments)."""
        return json.loads(self.body)


@dataclass(frozen=True, slots=True)
class Reconciled:
    """A ``reconcile`` hook's answer; build it with :meth:`ran`, :meth:`not_run` or
    :meth:`in_doubt`."""

    outcome: Literal["ran", "not_run", "in_doubt"]
    status: int = 200
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""

    def __post_init__(self) -> None:
        # Built directly (not through ran()), it is checked all the same: a "ran" answer
        # is recorded as the key's outcome and replayed forever.
        if self.outcome not in ("ran", "not_run", "in_doubt"):
            raise ConfigurationError(
                f"Reconciled.outcome must be 'ran', 'not_run' or 'in_doubt', got {self.outcome!r}"
            )
        if not isinstance(self.body, bytes):
            raise ConfigurationError(
                f"Reconciled.body must be bytes, got {type(self.body).__name__}"
            )
        if not isinstance(self.headers, tuple) or not all(
            isinstance(h, tuple) and len(h) == 2 and all(isinstance(x, str) for x in h)
            for h in self.headers
        ):
            raise ConfigurationError(
                "Reconciled.headers must be a tuple of (name, value) str pairs"
            )
        from ._decide import is_storable

        status = self.status
        if (
            isinstance(status, bool)
            or not isinstance(status, int)
            or (self.outcome == "ran" and not is_storable(status))
        ):
            raise ConfigurationError(
                f"Reconciled.ran() needs a final status (2xx, or a 4xx about the request), "
                f"got {status!r}; answer Reconciled.in_doubt() when the outcome is not known"
            )

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
        return cls("ran", status, hdrs, body)

    @classmethod
    def not_run(cls) -> Reconciled:
        """It did not happen: the request that asked runs it now, under a fresh claim."""
        return cls("not_run")

    @classmethod
    def in_doubt(cls) -> Reconciled:
        """Still in doubt: nothing says whether it happened; the key stays in doubt."""
        return cls("in_doubt")


def context_for(
    idempotency_key: str,
    principal: str,
    method: str,
    route: str,
    body: bytes,
    record: InProgress | None,
    now_ms: int,
    key_for: Callable[[str], str],
) -> ReconcileContext:
    """The context of the key in doubt ``record``, met by a request at ``now_ms``."""
    started = record.started_ms if record else 0
    since = record.lease_end_ms if record else 0
    lapsed = record is not None and record.phase != "in_doubt"
    return ReconcileContext(
        idempotency_key,
        principal,
        method,
        route,
        body,
        started,
        since,
        "lease lapsed" if lapsed else "failed after start",
        max(0, now_ms - since) if since else 0,
        key_for,
    )


ReconcileHook = Callable[[ReconcileContext], "Reconciled | Awaitable[Reconciled]"]

_IN_DOUBT = Reconciled("in_doubt")

# anyio >= 4.1 names it abandon_on_cancel; 3.x (still allowed by the server extra) cancellable.
_ABANDON: dict[str, bool] = (
    {"abandon_on_cancel": True}
    if "abandon_on_cancel" in inspect.signature(anyio.to_thread.run_sync).parameters
    else {"cancellable": True}
)


def check_reconcile(hook: object, timeout: object) -> None:
    if hook is not None and not callable(hook):
        raise ConfigurationError(
            f"reconcile must be a function (ReconcileContext) -> Reconciled, got "
            f"{type(hook).__name__}"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 300:
        raise ConfigurationError(f"reconcile_timeout must be 0 to 300 seconds, got {timeout!r}")


async def ask(hook: ReconcileHook, context: ReconcileContext, seconds: float) -> Reconciled:
    """The hook's answer; "still in doubt" when it fails, times out or answers anything else."""
    key = shown_key(context.idempotency_key)
    value: object = _IN_DOUBT
    try:
        with anyio.move_on_after(seconds) as scope:
            if inspect.iscoroutinefunction(hook):
                value = await hook(context)
            else:
                # A plain function (a blocking HTTP call to the provider) runs in a worker
                # thread: on the event loop it would stall every request and every lease
                # renewal of this worker. Past the timeout the thread is abandoned.
                value = await anyio.to_thread.run_sync(hook, context, **_ABANDON)  # type: ignore[arg-type]
                if inspect.isawaitable(value):
                    value = await value
        if scope.cancelled_caught:
            _logger.warning(
                "the reconcile hook did not answer for %s within %g s; the key stays in doubt",
                key,
                seconds,
            )
            return _IN_DOUBT
    except Exception as exc:
        _logger.warning(
            "the reconcile hook failed for %s (%s); the key stays in doubt",
            key,
            type(exc).__name__,
        )
        return _IN_DOUBT
    if not isinstance(value, Reconciled):
        _logger.warning(
            "the reconcile hook answered %s for %s, not a Reconciled; the key stays in doubt",
            type(value).__name__,
            key,
        )
        return _IN_DOUBT
    return value
