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
from collections.abc import AsyncIterator

import pytest

from tests._postgres import PostgresServer, postgres_proc, postgres_store_factory

__all__ = ["postgres_proc", "postgres_store_factory"]


class TurnCounter:
    """A loopback TCP proxy to PostgreSQL counting round trips.

    A round trip is a client turn: the client sends after the server last spoke
    (or first). Bytes split over several TCP segments still count once.
    """

    def __init__(self, upstream: PostgresServer) -> None:
        self.upstream = upstream
        self.turns = 0
        self._last = "server"
        self.port = 0
        self._server: asyncio.Server | None = None

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

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

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

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
