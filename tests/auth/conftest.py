"""Fixtures for the auth tests: one real identity provider on loopback, reset per test."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from joserfc.jwk import RSAKey

from agentkey import _clock
from tests._loopback import serve
from tests.auth._idp import IdP

CLIENT_ID = "agent-orchestrator"
CLIENT_SECRET = "s3cr3t-client-value-42"
PUBLIC_CLIENT = "cli-public"
JWT_CLIENT = "jwt-client"

_KEY = RSAKey.generate_key(2048, private=True)
PRIVATE_PEM = _KEY.as_pem(private=True).decode("ascii")


@pytest.fixture(scope="session")
def _idp_server() -> Iterator[IdP]:
    idp = IdP(
        clients={CLIENT_ID: CLIENT_SECRET, "odd:id/é": "p@ss:w/rd", PUBLIC_CLIENT: None},
        client_keys={JWT_CLIENT: RSAKey.import_key(_KEY.as_pem(private=False))},
    )
    with serve(idp.app()) as url:
        idp.url = url
        yield idp


@pytest.fixture
def idp(_idp_server: IdP) -> IdP:
    """The loopback identity provider and tool, with counters reset."""
    _idp_server.reset()
    return _idp_server


@pytest.fixture(autouse=True)
def _waits_skipped() -> Iterator[None]:
    """Providers built here without clock= never really wait between token requests: the
    default clock is testing mode's skipping one. Tests that look at the waits, or move time
    by hand, pass a ``FakeClock`` as ``clock=``."""
    prior = _clock.default_clock()
    _clock.set_default_clock(_clock.SkippingClock())
    yield
    _clock.set_default_clock(prior)


@dataclass(frozen=True)
class Driver:
    """Sends one request with a sync or an async httpx client; awaitable either way."""

    kind: str

    async def request(
        self, method: str, url: str, *, auth: httpx.Auth, **kwargs: Any
    ) -> httpx.Response:
        if self.kind == "async":
            async with httpx.AsyncClient(auth=auth, timeout=30) as client:
                return await client.request(method, url, **kwargs)

        def run() -> httpx.Response:
            with httpx.Client(auth=auth, timeout=30) as client:
                return client.request(method, url, **kwargs)

        return await asyncio.to_thread(run)


@pytest.fixture(params=["sync", "async"])
def driver(request: pytest.FixtureRequest) -> Driver:
    """The same scenario through httpx.Client (in a thread) and httpx.AsyncClient."""
    return Driver(str(request.param))
