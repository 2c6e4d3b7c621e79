"""The token model and the refresh-time arithmetic (no I/O, no clock of its own)."""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from pydantic import SecretStr

__all__ = ["Token", "TokenEvent", "TokenHook", "header_safe", "jwt_expired", "refresh_deadline"]


_VISIBLE = re.compile(r"[\x21-\x7e]+")


def header_safe(token: str) -> bool:
    """True when ``token`` can follow ``Bearer `` in a header: visible ASCII, no spaces.

    RFC 6750's b64token is stricter still; anything outside this set would be
    refused by the HTTP layer with an error that quotes the header, token included.
    """
    return _VISIBLE.fullmatch(token) is not None


@dataclass(frozen=True, slots=True)
class Token:
    """An access token as agentkey holds it.

    Times are on the provider's monotonic clock (``Clock.monotonic()``), so a wall-clock
    jump (NTP, a laptop waking up) never makes a token look fresh or stale.
    ``refresh_at`` is ``None`` when the token carries no lifetime: it is then
    only renewed when a tool rejects it with 401.
    """

    access_token: SecretStr
    obtained_at: float
    lifetime: float | None = None
    refresh_at: float | None = None
    refresh_token: SecretStr | None = field(default=None)
    scope: str | None = None
    issued_token_type: str | None = None

    def due(self, now: float) -> bool:
        """True when the token should be renewed before it is sent at ``now``."""
        return self.refresh_at is not None and now >= self.refresh_at

    @property
    def expires_at(self) -> float | None:
        """The monotonic time the token expires, if it said."""
        return None if self.lifetime is None else self.obtained_at + self.lifetime


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """A provider starts (``phase="start"``) or ends (``"end"``) one request to its token endpoint.

    ``grant`` is the grant type's last part (``client_credentials``,
    ``refresh_token``, ``token-exchange``, ``jwt-bearer``); ``endpoint_origin``
    is ``scheme://host:port`` of the token URL; ``attempts`` counts the HTTP
    requests made so far (0 at start); ``error`` is the class name of the
    error the request ended with (``TokenError``, ``DelegationExpired``), or
    None. Events never carry a token, a secret or a form parameter.
    """

    phase: Literal["start", "end"]
    grant: str
    endpoint_origin: str
    attempts: int
    error: str | None = None


#: A hook receives each TokenEvent; an exception it raises fails the token request.
TokenHook: TypeAlias = Callable[[TokenEvent], None]


def refresh_deadline(
    obtained_at: float,
    lifetime: float | None,
    *,
    leeway: float,
    lifetime_fraction: float,
    jitter: float,
    rand: float,
) -> float | None:
    """When a token obtained at ``obtained_at`` and valid for ``lifetime`` seconds is due.

    The leeway is stretched by up to ``jitter`` (a fraction, so refreshes of
    many processes spread out) and then capped to ``lifetime_fraction`` of the
    lifetime, so a token shorter than the leeway (2 s, or 60 s with a 60 s
    leeway) is still used for part of its life instead of being refreshed on
    every call. ``rand`` in [0, 1) is the draw that stretches it (the provider's
    ``Clock.random()``).
    """
    if lifetime is None:
        return None
    effective = min(leeway * (1.0 + jitter * rand), lifetime_fraction * lifetime)
    return obtained_at + lifetime - effective


def jwt_expired(token: str, *, now: float) -> bool:
    """True when ``token`` is a JWT whose ``exp`` claim is before ``now`` (Unix seconds).

    The signature is not checked: this only spares the token endpoint a
    request that is bound to fail. Anything that is not a readable JWT gives
    False, and the endpoint decides.
    """
    parts = token.split(".")
    if len(parts) != 3:
        return False
    payload = parts[1] + "=" * (-len(parts[1]) % 4)
    try:
        claims = json.loads(base64.urlsafe_b64decode(payload.encode("ascii")))
    except (ValueError, binascii.Error, UnicodeError):
        return False
    if not isinstance(claims, dict):
        return False
    exp = claims.get("exp")
    if isinstance(exp, bool) or not isinstance(exp, (int, float)):
        return False
    return float(exp) <= now
