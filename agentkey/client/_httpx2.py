"""A user's httpx2 client: recognised, and handed agentkey's ``httpx.Auth`` through a bridge.

httpx2 is the fork of httpx with the same API. agentkey never imports it: a user's
httpx2 client has already loaded it, and the wire builds requests, timeouts and errors
from the module the client belongs to (:func:`lib_of`).
"""

from __future__ import annotations

import abc
import sys
from functools import cache
from typing import TYPE_CHECKING, Any

import httpx

from .._exceptions import ConfigurationError

__all__ = ["AsyncClient", "Client", "adapt", "adapt_auth", "fork_async_client", "lib_of"]


def _fork() -> Any:
    return sys.modules.get("httpx2")  # loaded by whoever built an httpx2 client; never here


def fork_async_client(headers: dict[str, str], connect: float, read: float) -> Any:
    """An ``httpx2.AsyncClient``, for an SDK whose transports speak httpx2 (MCP's).

    That SDK has loaded httpx2 already; without it this is a configuration error.
    """
    lib = _fork()
    if lib is None:
        raise ConfigurationError("httpx2 is not loaded: the SDK that needs it imports it first")
    return lib.AsyncClient(headers=headers, timeout=lib.Timeout(connect, read=read))


if TYPE_CHECKING:
    Client = httpx.Client
    AsyncClient = httpx.AsyncClient
else:

    class Client(abc.ABC):  # noqa: B024 - a virtual base: isinstance only
        """``isinstance(c, Client)``: c is an ``httpx.Client`` or an ``httpx2.Client``."""

        @classmethod
        def __subclasshook__(cls, other: type) -> bool:
            fork = _fork()
            return issubclass(other, httpx.Client) or (
                fork is not None and issubclass(other, fork.Client)
            )

    class AsyncClient(abc.ABC):  # noqa: B024 - a virtual base: isinstance only
        """``isinstance(c, AsyncClient)``: an ``httpx.AsyncClient`` or an ``httpx2.AsyncClient``."""

        @classmethod
        def __subclasshook__(cls, other: type) -> bool:
            fork = _fork()
            return issubclass(other, httpx.AsyncClient) or (
                fork is not None and issubclass(other, fork.AsyncClient)
            )


def lib_of(client: object) -> Any:
    """The module ``client`` comes from: httpx, or its fork httpx2 (the same API)."""
    if isinstance(client, (httpx.Client, httpx.AsyncClient)):
        return httpx
    fork = _fork()
    if fork is not None and isinstance(client, (fork.Client, fork.AsyncClient)):
        return fork
    raise ConfigurationError(
        f"expected an httpx or httpx2 client, got {type(client).__name__}"
    )  # pragma: no cover - the invoker checks its client= first


@cache
def _bridge_class(lib: Any) -> Any:
    class Bridge(lib.Auth):  # type: ignore[misc]
        """An ``httpx.Auth`` (a token provider) as an Auth of ``lib``.

        Both libraries drive an auth flow the same way, a generator that yields
        requests and receives responses, so the flows are handed through as they are.
        """

        def __init__(self, inner: httpx.Auth) -> None:
            self.inner = inner
            self.requires_request_body = inner.requires_request_body
            self.requires_response_body = inner.requires_response_body

        def sync_auth_flow(self, request: Any) -> Any:
            return self.inner.sync_auth_flow(request)

        def async_auth_flow(self, request: Any) -> Any:
            return self.inner.async_auth_flow(request)

    return Bridge


def adapt_auth(auth: httpx.Auth | None, client: Client | AsyncClient) -> Any:
    """``auth`` as an Auth that ``client``'s library (httpx or httpx2) accepts."""
    return adapt(lib_of(client), auth)


def adapt(lib: Any, auth: httpx.Auth | None) -> Any:
    if auth is None or lib is httpx or isinstance(auth, lib.Auth):
        return auth
    return _bridge_class(lib)(auth)
