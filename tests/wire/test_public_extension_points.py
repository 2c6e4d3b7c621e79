"""agentkey reaches httpx and httpcore through their public interfaces only.

The sync deadline rides on httpcore's network-backend interface and its ``trace``
extension, the cookie rule on a cookieless client, and a redirect's ``Location``
on a response event hook: none of them reads a frame, a private attribute or an
error message. This file fails loudly if one of those reaches comes back.
"""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import httpx
import pytest

from agentkey.client._clients import make_client
from agentkey.client._effects import Outgoing
from agentkey.client._http import send_sync
from agentkey.client._protocol import Answer, Failure, FailureKind
from tests._loopback import raw_server

ROOT = Path(__file__).resolve().parents[2] / "agentkey"

#: What the client side used to reach for, and must not again.
FORBIDDEN = {
    r"_getframe": "a frame of httpcore's",
    r"\bf_locals\b": "a frame's locals",
    r"\._transport_for_url\b": "httpx.Client's private transport lookup",
    r"\._network_stream\b": "an httpcore connection's private stream",
    r"\bclient\._transport\b": "httpx.Client's private transport",
    r"\._mounts\b": "httpx.Client's private mounts",
    r"str\(exc\)\.startswith": "a match on an error message",
}


@pytest.mark.parametrize(
    "path",
    sorted([*ROOT.glob("_*.py"), *(ROOT / "auth").glob("_*.py")]),
    ids=lambda p: p.name,
)
def test_no_private_reach_into_httpx_or_httpcore(path: Path) -> None:
    """No client module reads a frame, a private httpx/httpcore attribute or an error message."""
    text = path.read_text(encoding="utf-8")
    found = [why for pattern, why in FORBIDDEN.items() if re.search(pattern, text)]
    assert not found, f"{path.name} reaches into {', '.join(found)}"


@pytest.mark.realtime  # real time: a socket deadline against a dripping peer
def test_a_reused_connections_drip_ends_at_the_deadline_without_any_alarm() -> None:
    """agentkey's own sync client: a header drip on a pooled connection ends by the deadline.

    The network backend cuts each read to the time left, so no alarm thread and no
    frame inspection is needed to find the reused connection's socket.
    """

    def handler(conn: socket.socket, head: bytes) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        conn.recv(65536)  # the second request, on the same kept-alive connection
        for _ in range(2400):  # its status line, one byte per 50 ms, for 2 minutes at most
            conn.sendall(b"H")
            time.sleep(0.05)

    with raw_server(handler) as base, make_client(None) as client:
        first = send_sync(
            client, Outgoing("GET", base + "/a", (), None, True), auth=None, timeout=None
        )
        assert isinstance(first, Answer)
        assert first.status_code == 200
        deadline = time.monotonic() + 0.5  # real time: the socket's deadline
        out = Outgoing("GET", base + "/b", (), None, True, deadline=deadline)
        reply = send_sync(client, out, auth=None, timeout=None)
    # Only the deadline can end the drip before the test's timeout.
    assert isinstance(reply, Failure)
    assert reply.kind is FailureKind.IN_DOUBT
    assert "deadline" in reply.description


def test_agentkeys_client_keeps_httpx_away_from_a_redirects_location() -> None:
    """A 307 with ``data:,x`` through agentkey's client: an Answer holding the Location."""

    def handler(conn: socket.socket, head: bytes) -> None:
        conn.sendall(
            b"HTTP/1.1 307 Temporary Redirect\r\nLocation: data:,x\r\n"
            b"Content-Length: 0\r\nConnection: close\r\n\r\n"
        )

    with raw_server(handler) as base, make_client(None) as client:
        reply = send_sync(
            client, Outgoing("POST", base + "/t", (), b"{}", True), auth=None, timeout=None
        )
    assert isinstance(reply, Answer)
    assert (reply.status_code, reply.header("location")) == (307, "data:,x")


def test_a_user_clients_own_redirect_handling_is_left_alone() -> None:
    """agentkey adds no hook to a client it was given: the user's own calls see Location."""

    def handler(conn: socket.socket, head: bytes) -> None:
        conn.sendall(
            b"HTTP/1.1 307 Temporary Redirect\r\nLocation: /elsewhere\r\n"
            b"Content-Length: 0\r\nConnection: close\r\n\r\n"
        )

    with raw_server(handler) as base, httpx.Client() as client:
        send_sync(client, Outgoing("POST", base + "/t", (), b"{}", True), auth=None, timeout=None)
        response = client.post(base + "/t")
    assert response.headers["location"] == "/elsewhere"
    assert client.event_hooks == {"request": [], "response": []}
