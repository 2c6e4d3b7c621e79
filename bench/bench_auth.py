"""Refresh storms: 1,000 concurrent calls over an expired token, agentkey vs a naive refresh.

Baseline: an ``httpx.Auth`` that checks the shared token before each request
and, when it has expired, fetches a new one itself, with no lock, as many
hand-written auth hooks do. Under concurrency every caller sees the expired
token, so every caller asks the token endpoint. agentkey's providers run one
refresh per credential and let every other caller wait for it.

Both variants talk to the same identity provider on loopback (a real HTTP
token endpoint); the tool is the same app served in-process, so the figures
are about the token traffic. One run prints the token request counts and the
time ratio.

    python bench/bench_auth.py            # full run (1,000 calls)
    python bench/bench_auth.py --smoke    # a quick run for CI
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncGenerator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.auth._idp

from agentkey.auth import ClientCredentials
from bench._harness import load_line, machine
from tests._loopback import serve
from tests.auth._idp import IdP

CLIENT_ID = "bench-client"
CLIENT_SECRET = "bench-secret"  # noqa: S105 - a throwaway credential for the loopback IdP


class NaiveRefresh(httpx.Auth):
    """Refreshes whenever the token it last saw has expired; no lock, no single flight."""

    def __init__(self, token_url: str, http: httpx.AsyncClient) -> None:
        self.token_url = token_url
        self.http = http
        self.token: str | None = None
        self.expires_at = 0.0

    async def fetch(self) -> None:
        response = await self.http.post(
            self.token_url,
            data={"grant_type": "client_credentials"},
            auth=(CLIENT_ID, CLIENT_SECRET),
        )
        body = response.json()
        self.token = body["access_token"]
        self.expires_at = time.monotonic() + float(body["expires_in"]) - 0.5

    async def async_auth_flow(
        self, request: httpx.Request
    ) -> AsyncGenerator[httpx.Request, httpx.Response]:
        if self.token is None or time.monotonic() >= self.expires_at:
            await self.fetch()
        request.headers["Authorization"] = f"Bearer {self.token}"
        yield request


async def storm(idp: IdP, auth: httpx.Auth, n: int) -> tuple[int, float]:
    """Prime a 1 s token, let it expire, fire ``n`` concurrent calls: (token requests, seconds)."""
    tool = httpx.ASGITransport(app=idp.app())
    async with httpx.AsyncClient(auth=auth, transport=tool, timeout=300) as client:
        idp.lifetime = 1.0
        assert (await client.get(idp.url + "/tool")).status_code == 200
        await asyncio.sleep(1.1)
        idp.lifetime = 300.0
        before = idp.token_requests
        started = time.perf_counter()
        responses = await asyncio.gather(*(client.get(idp.url + "/tool") for _ in range(n)))
        elapsed = time.perf_counter() - started
    assert {r.status_code for r in responses} == {200}
    return idp.token_requests - before, elapsed


async def run(idp: IdP, n: int) -> None:
    token_url = idp.url + "/token"
    ours = ClientCredentials(token_url, CLIENT_ID, CLIENT_SECRET)
    agentkey_requests, agentkey_time = await storm(idp, ours, n)
    limits = httpx.Limits(max_connections=100)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        naive_requests, naive_time = await storm(idp, NaiveRefresh(token_url, http), n)
    print(f"bench_auth ({n} concurrent calls over an expired token, one run)")
    print(f"  naive per-call refresh   {naive_requests:5d} token requests   {naive_time:7.3f} s")
    print(
        f"  agentkey single flight   {agentkey_requests:5d} token requests   {agentkey_time:7.3f} s"
        f"   time ratio {agentkey_time / naive_time:5.2f}x"
        f" ({naive_time / agentkey_time:.1f}x faster)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a quick run for CI")
    n = 50 if parser.parse_args().smoke else 1000
    at_start = machine()
    idp = IdP(clients={CLIENT_ID: CLIENT_SECRET})
    with serve(idp.app()) as url:
        idp.url = url
        asyncio.run(run(idp, n))
    print(load_line(at_start))


if __name__ == "__main__":
    main()
