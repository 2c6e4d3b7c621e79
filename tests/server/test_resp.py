"""RedisStore's wire layer: the RESP reply parser, and the pipelined connection on real sockets.

The parser is checked on generated replies cut at every possible place, and on hostile
bytes (never anything but ProtocolError). The pipe is checked against a real Redis (many
commands in flight on one connection, cancelled ones among them, each answer reaching its
own command) and against a loopback server that misbehaves: silent, or answering twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkey import StoreUnavailable
from agentkey.server import RedisStore
from agentkey.server._records import encode_in_progress
from agentkey.server._resp import MAX_DEPTH, PUSH, ProtocolError, Replies, ReplyError, pack
from tests._loopback import RedisServer

# --- the parser ----------------------------------------------------------------------------


def _resp(value: Any) -> bytes:
    """RESP2 bytes of a value (bytes, int, None, list, ReplyError)."""
    if value is None:
        return b"$-1\r\n"
    if isinstance(value, bytes):
        return b"$%d\r\n%s\r\n" % (len(value), value)
    if isinstance(value, int):
        return b":%d\r\n" % value
    if isinstance(value, ReplyError):
        return b"-%s\r\n" % value.message.encode()
    return b"*%d\r\n" % len(value) + b"".join(_resp(v) for v in value)


def _plain(value: Any) -> Any:
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return ("error", value.message) if isinstance(value, ReplyError) else value


_SCALARS = (
    st.binary(max_size=40)
    | st.integers(-(2**63), 2**63 - 1)
    | st.none()
    | st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=20).map(
        lambda m: ReplyError("ERR " + m)
    )
)
_REPLIES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4), max_leaves=12)


@given(replies=st.lists(_REPLIES, min_size=1, max_size=6), data=st.data())
def test_replies_cut_anywhere_parse_to_the_values_sent(replies: list[Any], data: Any) -> None:
    """However the socket splits the stream, each reply comes out once, whole and in order."""
    stream = b"".join(_resp(r) for r in replies)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=5)))
    parser, got = Replies(), []
    for start, stop in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        got += parser.feed(stream[start:stop])
    assert [_plain(v) for v in got] == [_plain(r) for r in replies]


def test_resp3_types_and_pushes() -> None:
    """RESP3 nulls, booleans, doubles, maps and verbatim strings parse; a push answers nothing."""
    stream = (
        b"_\r\n#t\r\n,1.5\r\n%1\r\n$3\r\nkey\r\n:7\r\n=8\r\ntxt:abcd\r\n"
        b">2\r\n$7\r\nmessage\r\n$1\r\nx\r\n(12345678901234567890\r\n+OK\r\n"
        b"|1\r\n+ttl\r\n:3\r\n$2\r\nhi\r\n"
    )
    assert Replies().feed(stream) == [
        None, True, 1.5, {b"key": 7}, b"abcd", PUSH, 12345678901234567890, b"OK", b"hi"
    ]  # fmt: skip


@pytest.mark.parametrize(
    "stream",
    [
        b"?what\r\n",  # an unknown type byte
        b"$abc\r\nxyz\r\n",  # a length that is no number
        b"$-2\r\n",  # a negative length other than null
        b"$99999999999\r\n",  # beyond Redis's own bulk limit
        b"$3\r\nabcdef\r\n",  # longer than its length
        b"*" + b"*1\r\n" * (MAX_DEPTH + 1),  # nested too deeply
        b"+" + b"x" * 70_000,  # a line that never ends
        b"%1\r\n*1\r\n:1\r\n:2\r\n",  # an array as a map key
        b":12x\r\n",  # an integer that is not one
    ],
)
def test_a_peer_breaking_the_protocol_raises_protocol_error(stream: bytes) -> None:
    """Each break of RESP is a ProtocolError (the pipe then drops the connection)."""
    with pytest.raises(ProtocolError):
        Replies().feed(stream)


@given(st.binary(max_size=200))
def test_hostile_bytes_raise_nothing_but_protocol_error(stream: bytes) -> None:
    """Arbitrary bytes parse, wait for more, or raise ProtocolError: never another exception."""
    with contextlib.suppress(ProtocolError):
        Replies().feed(stream)


def test_pack_writes_an_array_of_bulk_strings() -> None:
    """A command is the array of bulk strings Redis reads (and our parser reads back)."""
    packed = pack((b"SET", b"k", b"v\r\n"))
    assert packed == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\nv\r\n\r\n"
    assert Replies().feed(packed) == [[b"SET", b"k", b"v\r\n"]]


# --- the pipe, on a real Redis ----------------------------------------------------------------


def _owner() -> str:
    return secrets.token_hex(16)


async def test_many_commands_in_flight_each_get_their_own_answer(redis_proc: RedisServer) -> None:
    """Hundreds of claims and reads in flight on one connection, some cancelled midway:
    every answer reaches its own command, and later commands are not shifted."""
    store = RedisStore(redis_proc.url, prefix="pipe-" + secrets.token_hex(4))
    try:
        values = {f"k{i}": encode_in_progress(_owner(), i) for i in range(300)}
        assert (
            await asyncio.gather(*(store.claim(k, v, ttl_ms=60_000) for k, v in values.items()))
            == [None] * 300
        )
        reads = [asyncio.ensure_future(store.get(k)) for k in values]
        await asyncio.sleep(0)  # sent, not answered
        for task in reads[::3]:
            task.cancel()
        results = await asyncio.gather(*reads, return_exceptions=True)
        for (key, value), result in zip(values.items(), results, strict=True):
            assert isinstance(result, asyncio.CancelledError) or result == value, key
        again = await asyncio.gather(*(store.get(k) for k in values))
        assert again == list(values.values())
    finally:
        await store.aclose()


def test_the_pipe_runs_on_uvloop(redis_proc: RedisServer) -> None:
    """On uvloop (what uvicorn[standard] runs) the pipe takes over redis-py's socket too, and
    every operation answers as on asyncio's own loop."""
    uvloop = pytest.importorskip("uvloop")

    async def operations() -> None:
        store = RedisStore(redis_proc.url, prefix="uvloop-" + secrets.token_hex(4))
        try:
            values = {f"k{i}": encode_in_progress(_owner(), i) for i in range(200)}
            claims = await asyncio.gather(
                *(store.claim(k, v, ttl_ms=60_000) for k, v in values.items())
            )
            assert claims == [None] * 200
            assert await asyncio.gather(*(store.get(k) for k in values)) == list(values.values())
            owner = _owner()
            assert await store.claim("op", encode_in_progress(owner, 1), ttl_ms=60_000) is None
            assert await store.renew("op", owner, ttl_ms=60_000)
            assert await store.finish("op", owner, b"C:{}\n", ttl_ms=60_000)
            assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
        finally:
            await store.aclose()

    uvloop.run(operations())


# --- the pipe, against a misbehaving server ---------------------------------------------------


class _FakeRedis:
    """A loopback server answering redis-py's handshake with +OK, then ``behave(command)``."""

    def __init__(self, behave: Callable[[list[bytes]], bytes]) -> None:
        self.behave = behave
        self.commands: list[list[bytes]] = []
        self.connections = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        parser = Replies()
        try:
            while data := await reader.read(65536):
                for command in parser.feed(data):
                    self.commands.append(command)
                    name = command[0].upper()
                    answer = b"+OK\r\n" if name in (b"CLIENT", b"HELLO", b"PING") else None
                    writer.write(answer if answer is not None else self.behave(command))
        except ConnectionError:
            pass
        finally:
            writer.close()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            server.close()
            await server.wait_closed()


async def test_a_redis_that_never_answers_fails_the_command_within_its_timeouts() -> None:
    """A connection whose commands get no answer is dropped after `timeout`; the one re-send
    meets the same, and the claim fails closed as StoreUnavailable, not a hang."""
    fake = _FakeRedis(lambda command: b"")
    async with fake.running() as url:
        store = RedisStore(url, prefix="silent", timeout=0.3)
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="claim"):
            await store.claim("k", encode_in_progress(_owner(), 1), ttl_ms=5000)
        elapsed = time.monotonic() - started
        await store.aclose()
    assert 0.5 <= elapsed < 5  # two timeouts of 0.3 s, on a loaded machine with slack
    assert fake.connections == 2  # dropped, reconnected once for the re-send


async def test_an_answer_nobody_asked_for_drops_the_connection() -> None:
    """A server answering one command twice cannot shift answers onto later commands: the
    connection is dropped and the command re-sent on a new one."""
    answers = iter([b"$-1\r\n$5\r\nhello\r\n"])
    fake = _FakeRedis(lambda command: next(answers, b"$-1\r\n"))
    async with fake.running() as url:
        store = RedisStore(url, prefix="twice")
        assert await store.get("a") is None  # "hello" arrives with it, answering nothing
        assert await store.get("b") is None  # never the stray "hello"
        await store.aclose()
    assert fake.connections == 2
