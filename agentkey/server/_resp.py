"""RESP, Redis's wire protocol: the incremental reply parser of RedisStore's pipeline.

Pure code, no I/O: :meth:`Replies.feed` takes the bytes a socket delivered and
returns every reply they complete, keeping an incomplete tail for the next call.
It reads RESP2 and the RESP3 types a server may send on a connection whose
handshake asked for them. A peer that breaks the protocol (an unknown type byte,
a length that is not a number or is beyond Redis's own limits, a line that never
ends, nesting past ``MAX_DEPTH``) raises :class:`ProtocolError`: the caller drops
the connection instead of matching a reply to the wrong command.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_BULK", "MAX_DEPTH", "PUSH", "ProtocolError", "Replies", "ReplyError", "pack"]

#: Redis's ``proto-max-bulk-len`` default: no bulk string is longer.
MAX_BULK = 512 * 1024 * 1024
#: More items than any reply to the store's commands holds.
MAX_ITEMS = 1 << 20
#: Arrays within arrays: the store's replies nest at most twice.
MAX_DEPTH = 8
#: A simple line (type byte, number or short text) longer than this is not Redis.
MAX_LINE = 64 * 1024


class ProtocolError(Exception):
    """The peer does not speak RESP: the connection must be dropped."""


class ReplyError:
    """A ``-ERR ...`` reply: the command failed in Redis (delivered, not raised)."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message

    def __repr__(self) -> str:
        return f"ReplyError({self.message!r})"


class _Push:
    """An out-of-band RESP3 push: it answers no command."""


PUSH: Any = _Push()


class _Incomplete(Exception):
    pass


def pack(args: tuple[bytes, ...]) -> bytes:
    """One command: an array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        parts += (b"$%d\r\n" % len(arg), arg, b"\r\n")
    return b"".join(parts)


class Replies:
    """Incremental parser: ``feed(data)`` returns the replies ``data`` completed, in order."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        buf = self._buf
        buf += data
        out: list[Any] = []
        pos, size = 0, len(buf)
        try:
            while pos < size:
                value, pos_after = _parse(buf, pos, 0)
                out.append(value)
                pos = pos_after
        except _Incomplete:
            pass
        if pos:
            del buf[:pos]
        return out


def _line_end(buf: bytearray, pos: int) -> int:
    end = buf.find(b"\r\n", pos)
    if end < 0:
        if len(buf) - pos > MAX_LINE:
            raise ProtocolError("a RESP line without its end")
        raise _Incomplete
    return end


def _number(raw: bytearray, low: int, high: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ProtocolError(f"a RESP length that is not a number: {bytes(raw[:20])!r}") from None
    if not low <= value <= high:
        raise ProtocolError(f"a RESP length out of range: {value}")
    return value


def _parse(buf: bytearray, pos: int, depth: int) -> tuple[Any, int]:
    end = _line_end(buf, pos)
    kind = buf[pos]
    after = end + 2
    if kind == 36 or kind == 61:  # $ bulk string, = verbatim string
        size = _number(buf[pos + 1 : end], -1, MAX_BULK)
        if size < 0:
            return None, after
        stop = after + size
        if len(buf) < stop + 2:
            raise _Incomplete
        if buf[stop : stop + 2] != b"\r\n":
            raise ProtocolError("a RESP bulk string longer than its length")
        # A verbatim string starts with its 3-letter format and a colon ("txt:").
        return bytes(buf[after + 4 if kind == 61 else after : stop]), stop + 2
    if kind == 58 or kind == 40:  # : integer, ( big number
        try:
            return int(buf[pos + 1 : end]), after
        except ValueError:
            raise ProtocolError("a RESP integer that is not a number") from None
    if kind == 43:  # + simple string
        return bytes(buf[pos + 1 : end]), after
    if kind == 45 or kind == 33:  # - error, ! bulk error
        if kind == 33:
            size = _number(buf[pos + 1 : end], 0, MAX_LINE)
            if len(buf) < after + size + 2:
                raise _Incomplete
            text, after = buf[after : after + size], after + size + 2
        else:
            text = buf[pos + 1 : end]
        return ReplyError(text.decode("utf-8", "replace")), after
    if kind == 95:  # _ null
        return None, after
    if kind == 35:  # # boolean
        return buf[pos + 1 : end] == b"t", after
    if kind == 44:  # , double
        try:
            return float(buf[pos + 1 : end]), after
        except ValueError:
            raise ProtocolError("a RESP double that is not a number") from None
    if kind in _AGGREGATES:
        if depth >= MAX_DEPTH:
            raise ProtocolError("RESP replies nested too deeply")
        count = _number(buf[pos + 1 : end], -1, MAX_ITEMS)
        if count < 0:
            return None, after
        pairs = kind == 37 or kind == 124  # % map, | attribute
        items = []
        for _ in range(count * 2 if pairs else count):
            item, after = _parse(buf, after, depth + 1)
            items.append(item)
        if kind == 124:  # attributes describe the reply that follows: skip them
            return _parse(buf, after, depth)
        if kind == 62:  # > push
            return PUSH, after
        if pairs:
            try:
                return dict(zip(items[::2], items[1::2], strict=True)), after
            except TypeError:  # an array as a map key
                raise ProtocolError("a RESP map with an unhashable key") from None
        return items, after
    raise ProtocolError(f"unknown RESP type byte {bytes([kind])!r}")


_AGGREGATES = frozenset(b"*~%|>")  # array, set, map, attribute, push
