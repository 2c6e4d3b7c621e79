"""Fixtures for the PostgresStore tests: a throwaway PostgreSQL cluster and a round-trip counter.

The cluster (``tests/_postgres.py``) is started once per session with ``initdb`` and
``pg_ctl`` on a free 127.0.0.1 port in a temporary directory, and deleted afterwards.
PostgreSQL refuses to run as root: when the tests run as root (CI does), the cluster
runs as the unprivileged ``nobody`` user (its data directory is chowned to it and the
server binaries start with ``user="nobody"``); nothing is installed or changed on the
machine. Debian's ``postgresql`` package provides the binaries (``.ci/run`` installs it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from tests._postgres import PostgresServer, postgres_proc, postgres_store_factory

__all__ = ["CutProxy", "postgres_proc", "postgres_store_factory"]


class _Proxy:
    """A loopback TCP proxy in front of PostgreSQL; subclasses relay each connection."""

    def __init__(self, upstream: PostgresServer) -> None:
        self.upstream = upstream
        self.port = 0
        self._server: asyncio.Server | None = None

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()


class TurnCounter(_Proxy):
    """A loopback TCP proxy to PostgreSQL counting round trips.

    A round trip is a client turn: the client sends after the server last spoke
    (or first). Bytes split over several TCP segments still count once.
    """

    def __init__(self, upstream: PostgresServer) -> None:
        super().__init__(upstream)
        self.turns = 0
        self._last = "server"

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, side: str
    ) -> None:
        try:
            while data := await reader.read(65536):
                if side == "client" and self._last == "server":
                    self.turns += 1
                self._last = side
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.upstream.host, self.upstream.port)
        await asyncio.gather(
            self._pipe(reader, up_writer, "client"), self._pipe(up_reader, writer, "server")
        )

    def reset(self) -> None:
        self.turns = 0
        self._last = "server"


@pytest.fixture
async def turn_counter(postgres_proc: PostgresServer) -> AsyncIterator[TurnCounter]:
    """A round-trip counting proxy in front of the session's PostgreSQL."""
    counter = TurnCounter(postgres_proc)
    await counter.start()
    yield counter
    await counter.close()


class CutProxy(_Proxy):
    """A loopback proxy to PostgreSQL that cuts a connection when the client sends ``trigger``.

    ``mode="before"``: the message carrying the trigger never reaches the server (it
    sees the connection drop, and rolls back). ``mode="after"``: the message reaches
    the server, which runs it and answers, but the answer is dropped and the
    connection cut (the client cannot know whether it ran). ``cuts`` connections are
    cut, then the proxy only counts: ``seen`` is how often the trigger was sent.
    :meth:`go_down` cuts every connection and turns new ones away (the database is
    down, as in a restart) until :meth:`come_back`.
    """

    def __init__(self, upstream: PostgresServer) -> None:
        super().__init__(upstream)
        self.trigger = b"\x00never\x00"
        self.mode = "before"
        self.cuts = 0
        self.seen = 0
        self.down = False
        self._transports: set[asyncio.WriteTransport] = set()

    def arm(self, trigger: bytes, mode: str, cuts: int = 1) -> None:
        self.trigger, self.mode, self.cuts, self.seen = trigger, mode, cuts, 0

    def go_down(self) -> None:
        self.down = True
        for transport in list(self._transports):
            transport.abort()

    def come_back(self) -> None:
        self.down = False

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.down:
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection(self.upstream.host, self.upstream.port)
        self._transports.update((writer.transport, up_writer.transport))
        cut = asyncio.Event()

        async def upstream() -> None:
            with contextlib.suppress(ConnectionError):
                await _upstream()

        async def _upstream() -> None:
            while data := await reader.read(65536):
                if self.trigger in data:
                    self.seen += 1
                    if self.cuts > 0:
                        self.cuts -= 1
                        cut.set()
                        if self.mode == "after":
                            up_writer.write(data)
                            await up_writer.drain()
                            await asyncio.sleep(0.3)  # the server runs it; its answer is dropped
                        return
                up_writer.write(data)
                await up_writer.drain()

        async def downstream() -> None:
            with contextlib.suppress(ConnectionError):
                while data := await up_reader.read(65536):
                    if cut.is_set():
                        return
                    writer.write(data)
                    await writer.drain()

        tasks = [asyncio.ensure_future(upstream()), asyncio.ensure_future(downstream())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            writer.transport.abort()
            up_writer.transport.abort()
            self._transports.difference_update((writer.transport, up_writer.transport))


@pytest.fixture
async def cut_proxy(postgres_proc: PostgresServer) -> AsyncIterator[CutProxy]:
    """A proxy in front of the session's PostgreSQL that cuts connections on a trigger."""
    proxy = CutProxy(postgres_proc)
    await proxy.start()
    yield proxy
    await proxy.close()
