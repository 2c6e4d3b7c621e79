"""The one place httpx (or httpx2) errors become the core's failure categories."""

from __future__ import annotations

from typing import Any

import httpx

from .._exceptions import ConfigurationError
from ._deadline import DEADLINE_PASSED, seconds_left
from ._effects import Failure, FailureKind
from ._protocol import BAD_LOCATION

__all__ = ["failed", "translate"]


def translate(exc: httpx.RequestError, lib: Any = httpx) -> Failure:
    """The one place httpx (or httpx2, ``lib``) errors become the core's categories."""
    if isinstance(exc, (lib.ConnectError, lib.ConnectTimeout, lib.PoolTimeout)):
        return Failure(FailureKind.NOT_SENT, type(exc).__name__)
    if isinstance(exc, (lib.UnsupportedProtocol, lib.LocalProtocolError, lib.InvalidURL)):
        # Not ``{exc}`` nor ``from exc``: h11 quotes the offending header value, which can be
        # a bearer token or an API key, and a traceback prints the whole cause chain.
        raise ConfigurationError(
            f"the request could not be built or sent ({type(exc).__name__}); check base_url, "
            "the route, and that headers and tokens hold only visible ASCII characters"
        ) from None
    # ReadTimeout, WriteTimeout, ReadError, WriteError, RemoteProtocolError, ProxyError,
    # DecodingError: the request may have reached the tool and run.
    return Failure(FailureKind.IN_DOUBT, type(exc).__name__)


def failed(exc: httpx.RequestError, lib: Any, deadline: float | None, redirected: bool) -> Failure:
    if isinstance(exc, lib.RemoteProtocolError) and (
        redirected or isinstance(exc.__context__, lib.InvalidURL)
    ):
        # A user's client: httpx parsed the Location of a redirect it does not follow, and
        # failed. The trace saw the redirect's head read whole; without a trace (a mock or
        # ASGI transport), httpx raised it while handling the Location's InvalidURL.
        return Failure(FailureKind.UNSENDABLE, BAD_LOCATION)
    failure = translate(exc, lib)
    left = seconds_left(deadline)
    if left is not None and left <= 0.001:  # the deadline, not the server, ended it
        return Failure(failure.kind, f"{DEADLINE_PASSED} ({failure.description})")
    return failure
