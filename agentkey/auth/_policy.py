"""``TokenPolicy``: when tokens are renewed and how the token endpoint is retried."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .._exceptions import ConfigurationError

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
    - ``attempts``: token requests per refresh, counting the first, when the
      endpoint answers 429 or 5xx or times out.
    - ``backoff``: first wait between those attempts (doubled each time, with
      jitter) when the endpoint sends no ``Retry-After``.
    - ``max_wait``: cap on any single wait, ``Retry-After`` included.
    - ``deadline``: cap on the whole refresh, waits included.
    - ``timeout``: HTTP timeout of one token request.
    - ``failure_ttl``: how long a failed refresh is remembered, so callers
      arriving right after it fail fast instead of hammering a broken endpoint.
    - ``clock``: the monotonic clock token lifetimes, refresh points and
      remembered failures are measured on (default ``time.monotonic``). Tests
      pass a fake clock they advance by hand, so a loaded machine cannot make
      a short-lived token expire between two lines of the test.
    """

    leeway: float = 60.0
    leeway_jitter: float = 0.1
    lifetime_fraction: float = 0.5
    attempts: int = 4
    backoff: float = 0.5
    max_wait: float = 10.0
    deadline: float = 30.0
    timeout: float = 10.0
    failure_ttl: float = 2.0
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("leeway", "leeway_jitter", "backoff", "max_wait", "failure_ttl"):
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
            isinstance(self.attempts, bool)
            or not isinstance(self.attempts, int)
            or self.attempts < 1
        ):
            raise ConfigurationError(
                f"TokenPolicy.attempts must be an integer >= 1, got {self.attempts!r}"
            )
        if not callable(self.clock):
            raise ConfigurationError(
                "TokenPolicy.clock must be a function returning monotonic seconds, "
                f"such as time.monotonic; got {type(self.clock).__name__}"
            )

    def replace(self, **changes: float | Callable[[], float]) -> TokenPolicy:
        """A copy with ``changes`` applied (validated like the original)."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ConfigurationError(
                f"TokenPolicy has no option(s) {', '.join(unknown)}; "
                f"valid options: {', '.join(sorted(names))}"
            )
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
