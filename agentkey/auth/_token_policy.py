"""``TokenPolicy``: when tokens are renewed and how the token endpoint is retried."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .._exceptions import ConfigurationError
from .._schedule import Backoff
from .._validate import replace
from ..client._policies import check_backoff, schedule_of

__all__ = ["TokenPolicy"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenPolicy:
    """How a token provider renews tokens and talks to the token endpoint.

    Every field has a production default; derive variants with ``replace()``.

    - ``leeway``: renew when less than this many seconds of the token remain.
    - ``leeway_jitter``: stretch the leeway by up to this fraction, at random,
      so many processes do not all refresh at the same instant.
    - ``lifetime_fraction``: never use a leeway larger than this fraction of
      the token's lifetime, so a 2-second token is used for a second instead
      of being refreshed before every call.
    - ``max_attempts``: token requests per refresh, counting the first, when the
      endpoint answers 429 or 5xx or times out.
    - ``initial_backoff`` / ``backoff_multiplier`` / ``max_backoff`` / ``jitter``: the
      wait between those attempts when the endpoint sends no ``Retry-After``
      (the same formula as ``RetryPolicy``: see ``.schedule``).
    - ``max_retry_after``: cap on any wait the endpoint asks for.
    - ``deadline``: cap on the whole refresh, waits included.
    - ``timeout``: HTTP timeout of one token request.
    - ``failure_ttl``: how long a failed refresh is remembered, so callers
      arriving right after it fail fast instead of hammering a broken endpoint.
    - ``rejection_interval``: the least time between two refreshes caused by a
      tool rejecting the token (401). A token the tool rejects again within it
      is not renewed: the 401 goes back to the caller (``TokenRejected``),
      so a tool that refuses every token costs the identity provider one request
      per interval, not one per call.

    A policy is a value: it holds no clock. Times are measured on the clock of the
    provider it is given to (its ``clock=``).
    """

    leeway: float = 60.0
    leeway_jitter: float = 0.1
    lifetime_fraction: float = 0.5
    max_attempts: int = 4
    initial_backoff: float = 0.5
    max_backoff: float = 10.0
    backoff_multiplier: float = 2.0
    max_retry_after: float = 10.0
    jitter: bool = True
    deadline: float = 30.0
    timeout: float = 10.0
    failure_ttl: float = 2.0
    rejection_interval: float = 10.0

    def __post_init__(self) -> None:
        for name in ("leeway", "leeway_jitter", "failure_ttl", "rejection_interval"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or value < 0:
                raise ConfigurationError(
                    f"TokenPolicy.{name} must be a finite number >= 0, got {value!r}"
                )
        for name in ("deadline", "timeout"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or value <= 0:
                raise ConfigurationError(
                    f"TokenPolicy.{name} must be a finite number > 0, got {value!r}"
                )
        if not _is_number(self.lifetime_fraction) or not 0.0 < self.lifetime_fraction < 1.0:
            raise ConfigurationError(
                "TokenPolicy.lifetime_fraction must be strictly between 0 and 1 "
                f"(a token must be used for part of its life), got {self.lifetime_fraction!r}"
            )
        if (
            isinstance(self.max_attempts, bool)
            or not isinstance(self.max_attempts, int)
            or self.max_attempts < 1
        ):
            raise ConfigurationError(
                f"TokenPolicy.max_attempts must be an integer >= 1, got {self.max_attempts!r}"
            )
        check_backoff(self, "TokenPolicy.")

    def replace(self, **changes: Any) -> TokenPolicy:
        """A copy with ``changes`` applied (validated like the original)."""
        return replace(self, changes)

    @property
    def schedule(self) -> Backoff:
        """The wait between token requests, as one :class:`~agentkey._schedule.Backoff`."""
        return schedule_of(self)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
