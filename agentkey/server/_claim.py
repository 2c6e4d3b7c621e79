"""The claim a handler holds while its step runs, and how the handler reaches it."""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

from starlette.requests import HTTPConnection

from .._exceptions import ConfigurationError, StoreError
from .._keys import StepKey
from ._stores import Store

__all__ = ["SCOPE_STATE_KEY", "Claim", "current_claim", "get_claim"]

#: Where the middleware puts the claim in ``scope["state"]`` (``request.state``).
SCOPE_STATE_KEY = "agentkey_claim"

_logger = logging.getLogger("agentkey.server")
_current: contextvars.ContextVar[Claim | None] = contextvars.ContextVar(
    "agentkey_claim", default=None
)


class Claim:
    """The lease on one ``Idempotency-Key`` held by the running handler.

    - :meth:`begin_mutation` says the side effect has started: from then on a
      failure (an exception, a 5xx, a 401...) is recorded as ``FAILED`` and
      replayed, instead of releasing the key for a blind retry.
    - :meth:`renew` extends the lease by the middleware's ``lock_ttl``;
      :meth:`keep_alive` does it every ``lock_ttl / 3`` for long work.
    """

    __slots__ = (
        "_lock_ttl_ms",
        "_lost",
        "_mutation_started",
        "_owner",
        "_store",
        "key",
        "principal",
        "record_key",
    )

    def __init__(
        self,
        *,
        key: StepKey,
        principal: str,
        record_key: str,
        owner: str,
        store: Store,
        lock_ttl_ms: int,
    ) -> None:
        self.key = key
        self.principal = principal
        self.record_key = record_key
        self._owner = owner
        self._store = store
        self._lock_ttl_ms = lock_ttl_ms
        self._mutation_started = False
        self._lost = False

    def __repr__(self) -> str:
        return f"Claim(key={self.key.format()!r}, mutation_started={self._mutation_started})"

    @property
    def owner(self) -> str:
        """The random fencing token of this claim."""
        return self._owner

    @property
    def mutation_started(self) -> bool:
        """True once :meth:`begin_mutation` was called."""
        return self._mutation_started

    @property
    def lost(self) -> bool:
        """True once a renewal found that the lease expired and another request took it."""
        return self._lost

    def begin_mutation(self) -> None:
        """Mark that the side effect has started; later failures are recorded as FAILED.

        Raises :class:`~agentkey.StoreError` when a renewal already found the lease
        lost: another request may be running this step, so this one must not mutate.
        """
        if self._lost:
            raise StoreError(
                f"the lease on {self.key.format()} was lost (it expired and may be claimed "
                "by another request), so the side effect must not start here; the client "
                "retries with the same key and gets the other request's answer"
            )
        self._mutation_started = True

    async def renew(self) -> bool:
        """Extend the lease by ``lock_ttl``; False (and :attr:`lost`) if it was lost."""
        held = await self._store.renew(self.record_key, self._owner, ttl_ms=self._lock_ttl_ms)
        if not held:
            self._lost = True
            _logger.warning(
                "lease on %s was lost (it expired and may be claimed by another request); "
                "this request's result will not be stored",
                self.key.format(),
            )
        return held

    @asynccontextmanager
    async def keep_alive(self) -> AsyncIterator[Claim]:
        """Renew the lease every ``lock_ttl / 3`` while the block runs."""
        interval = self._lock_ttl_ms / 3000

        async def loop() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    if not await self.renew():
                        return
                except Exception:  # a failed renewal must not kill the handler
                    _logger.exception("renewing the lease on %s failed", self.key.format())

        task = asyncio.get_running_loop().create_task(loop())
        try:
            yield self
        finally:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task


def current_claim() -> Claim:
    """The claim of the request being handled (works in any handler behind the middleware)."""
    claim = _current.get()
    if claim is None:
        raise ConfigurationError(
            "no idempotency claim is active: this code does not run inside a request "
            "that IdempotencyMiddleware claimed (check its routes and methods)"
        )
    return claim


def get_claim(request: HTTPConnection) -> Claim:
    """The claim stored on a Starlette/FastAPI ``request`` (``request.state``).

    Works as a FastAPI dependency too: ``claim: Claim = Depends(get_claim)``.
    """
    state = request.scope.get("state") or {}
    claim = state.get(SCOPE_STATE_KEY)
    if not isinstance(claim, Claim):
        raise ConfigurationError(
            "this request carries no idempotency claim: it did not pass through "
            "IdempotencyMiddleware, or the route is not one the middleware protects"
        )
    return claim


def set_current(claim: Claim | None) -> contextvars.Token[Claim | None]:
    return _current.set(claim)


def reset_current(token: contextvars.Token[Claim | None]) -> None:
    _current.reset(token)
