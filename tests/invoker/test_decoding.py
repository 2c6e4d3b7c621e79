"""agentkey decodes answers itself: one gzip or deflate coding, within max_response_bytes."""

from __future__ import annotations

import gzip
import zlib

import httpx
import pytest

from agentkey.client._effects import Outgoing
from agentkey.client._http import send_sync
from agentkey.client._protocol import Answer, Failure, FailureKind

BODY = b'{"ok": true, "pad": "' + b"x" * 5000 + b'"}'


def _raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


def _send(raw: bytes, encoding: str | None, limit: int = 1 << 20) -> Answer | Failure:
    headers = {"Content-Encoding": encoding} if encoding else {}
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        # A streamed body, as a network answer is: not read before agentkey reads it.
        return httpx.Response(200, headers=headers, stream=httpx.ByteStream(raw))

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        out = Outgoing("GET", "https://tool.test/x", (), None, True)
        reply = send_sync(client, out, auth=None, timeout=None, max_bytes=limit)
    assert seen[0].headers["Accept-Encoding"] == "gzip, deflate"
    return reply


@pytest.mark.parametrize(
    ("raw", "encoding"),
    [
        (BODY, None),
        (BODY, "identity"),
        (gzip.compress(BODY), "gzip"),
        (gzip.compress(BODY), "x-gzip"),
        (gzip.compress(BODY), "GZIP"),
        (zlib.compress(BODY), "deflate"),
        (_raw_deflate(BODY), "deflate"),
    ],
    ids=["none", "identity", "gzip", "x-gzip", "GZIP", "deflate-zlib", "deflate-raw"],
)
def test_one_coding_is_decoded(raw: bytes, encoding: str | None) -> None:
    """identity, gzip, x-gzip and deflate (zlib-wrapped or raw) decode to the body."""
    reply = _send(raw, encoding)
    assert isinstance(reply, Answer)
    assert reply.content == BODY
    assert not reply.oversize
    assert reply.unreadable is None


@pytest.mark.parametrize("encoding", ["gzip, gzip", "gzip, identity, deflate", "br", "zstd"])
def test_stacked_or_unknown_codings_are_refused(encoding: str) -> None:
    """Stacked or unknown codings are refused unread, named in the answer."""
    reply = _send(gzip.compress(gzip.compress(BODY)), encoding)
    assert isinstance(reply, Answer)
    assert reply.unreadable is not None
    assert reply.content == b""


def test_decoded_size_is_limited() -> None:
    """A body whose decoded size passes the limit is oversize, however small on the wire."""
    reply = _send(gzip.compress(b"\0" * 100_000), "gzip", limit=10_000)
    assert isinstance(reply, Answer)
    assert reply.oversize


def test_corrupt_gzip_is_ambiguous() -> None:
    """A body that does not decode is an ambiguous failure (the answer may be cut short)."""
    reply = _send(b"\x1f\x8b\x08\x00garbage-garbage", "gzip")
    assert reply == Failure(FailureKind.IN_DOUBT, "DecodingError")
