"""Reading an answer's body: raw bytes, decoded here within a size limit and the deadline.

Bodies are read raw and decoded by agentkey, never by httpx, so a compressed answer can
never inflate past ``max_response_bytes`` in memory. One ``gzip`` or ``deflate`` coding is
decoded; stacked (``gzip, gzip``) or unknown codings are refused unread. The credentials
the request carried travel with the answer (``Answer.sent_secrets``), so they can be cut
out of whatever the server says.
"""

from __future__ import annotations

import functools
import zlib

import httpx

from ._clients import PARKED
from ._deadline import DEADLINE_PASSED, seconds_left
from ._effects import Answer, Failure, FailureKind, Received
from ._net import secret_forms

__all__ = ["ACCEPT_ENCODING", "Body"]

#: The content codings agentkey decodes itself (with a size limit); it asks for no other.
ACCEPT_ENCODING = "gzip, deflate"


class _Inflate:
    """zlib decoding that never yields more than it is allowed (``max_length``)."""

    def __init__(self, coding: str) -> None:
        self._raw_fallback = coding == "deflate"  # servers send zlib-wrapped or raw deflate
        wbits = zlib.MAX_WBITS | 16 if coding in ("gzip", "x-gzip") else zlib.MAX_WBITS
        self._z = zlib.decompressobj(wbits)
        self._started = False

    def decode(self, data: bytes, budget: int) -> list[bytes] | None:
        """The decoded pieces of ``data``; None once more than ``budget`` bytes came out."""
        try:
            return self._decode(data, budget)
        except zlib.error:
            if self._started or not self._raw_fallback:
                raise
            self._raw_fallback, self._z = False, zlib.decompressobj(-zlib.MAX_WBITS)
            return self._decode(data, budget)

    def _decode(self, data: bytes, budget: int) -> list[bytes] | None:
        pieces = []
        while data and not self._z.eof:
            piece = self._z.decompress(data, budget + 1)
            self._started = True
            budget -= len(piece)
            if budget < 0:
                return None
            pieces.append(piece)
            data = self._z.unconsumed_tail
        return pieces

    def flush(self, budget: int) -> list[bytes] | None:
        piece = self._z.flush(budget + 1)
        return None if len(piece) > budget else [piece]


class _Identity:
    def decode(self, data: bytes, budget: int) -> list[bytes] | None:
        return None if len(data) > budget else [data]

    def flush(self, budget: int) -> list[bytes] | None:
        return []


_IDENTITY = _Identity()  # stateless: shared


class Body:
    """One answer's body, fed raw chunks: bounded in size, in codings and in time."""

    def __init__(self, response: httpx.Response, limit: int, deadline: float | None) -> None:
        self._response, self._limit, self._deadline = response, limit, deadline
        # Read once: both the checks below and the Answer use them (keys in lowercase).
        self._headers = {k.lower(): v for k, v in response.headers.items()}
        parked = response.extensions.get(PARKED)
        if isinstance(parked, str):
            self._headers["location"] = parked
        self._chunks: list[bytes] = []
        self._size = 0
        self.result: Received | None = None
        self._decoder: _Inflate | _Identity = _IDENTITY
        #: True while raw chunks must still be read from the network (and fed).
        self.pending = not response.is_stream_consumed
        if not self.pending:  # built in memory (a MockTransport answer): decoded already
            self.feed(response.content)
            return
        codings = [
            c.strip().lower()
            for c in self._headers.get("content-encoding", "").split(",")
            if c.strip() and c.strip().lower() != "identity"
        ]
        if len(codings) > 1:
            self.result = self._answer(b"", unreadable=f"stacked content codings {codings!r}")
        elif codings and codings[0] not in ("gzip", "x-gzip", "deflate"):
            self.result = self._answer(b"", unreadable=f"the content coding {codings[0][:40]!r}")
        elif codings:
            self._decoder = _Inflate(codings[0])
        else:
            declared = self._headers.get("content-length", "")
            if declared.isdigit() and len(declared) < 20 and int(declared) > limit:
                self.result = self._answer(b"", oversize=True)

    def _answer(self, content: bytes, *, oversize: bool = False, unreadable: str = "") -> Answer:
        url = str(self._response.request.url)
        return Answer(
            self._response.status_code,
            self._headers,
            content,
            url,
            oversize=oversize,
            unreadable=unreadable or None,
            secrets=functools.partial(_sent_secrets, self._response),  # found if quoted
        )

    def _take(self, pieces: list[bytes] | None) -> bool:
        if pieces is None:
            self.result = self._answer(b"", oversize=True)
            return True
        self._chunks += pieces
        self._size += sum(map(len, pieces))
        return False

    def feed(self, raw: bytes) -> bool:
        """Take one raw chunk; True when reading must stop (``result`` is then set)."""
        left = seconds_left(self._deadline)
        if left is not None and left <= 0:
            self.result = Failure(FailureKind.IN_DOUBT, DEADLINE_PASSED)
            return True
        try:
            return self._take(self._decoder.decode(raw, self._limit - self._size))
        except zlib.error:
            self.result = Failure(FailureKind.IN_DOUBT, "DecodingError")
            return True

    def finish(self) -> Received:
        if self.result is None:
            try:
                self._take(self._decoder.flush(self._limit - self._size))
            except zlib.error:
                self.result = Failure(FailureKind.IN_DOUBT, "DecodingError")
        if self.result is None:
            self.result = self._answer(b"".join(self._chunks))
        return self.result


#: Request headers whose values are never credentials.
_PLAIN_HEADERS = frozenset(
    {
        b"accept",
        b"accept-encoding",
        b"connection",
        b"content-length",
        b"content-type",
        b"host",
        b"idempotency-key",  # the key: messages show it as shown_key, the reason as <key>
        b"transfer-encoding",
        b"user-agent",
    }
)
_CREDENTIAL_HEADERS = frozenset({b"authorization", b"proxy-authorization", b"cookie"})
_SHORTEST_HEADER_SECRET = 8  # a shorter value of another header (X-Tenant: t1) is kept


def _sent_secrets(response: httpx.Response) -> tuple[str, ...]:
    """The credentials the requests behind ``response`` carried, longest first.

    The requests: the one answered, and any an auth flow sent before it (a 401's).
    ``Authorization``, ``Proxy-Authorization`` and ``Cookie`` count whole and in parts
    (the token after the scheme, each cookie's value); any other header a user or a
    client default set counts from 8 characters (API keys travel there).
    """
    found: set[str] = set()
    for sent in (*response.history, response):
        for raw_name, raw_value in sent.request.headers.raw:
            name = raw_name.lower()
            if name in _PLAIN_HEADERS:
                continue
            value = raw_value.decode("latin-1").strip()
            if name in _CREDENTIAL_HEADERS:
                found.add(value)
                if name == b"cookie":
                    found.update(c.partition("=")[2].strip() for c in value.split(";"))
                else:
                    found.add(value.partition(" ")[2].strip())
            elif len(value) >= _SHORTEST_HEADER_SECRET:
                found.add(value)
    return secret_forms(found)
