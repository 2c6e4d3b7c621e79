"""Journals of every kind, from one fixture: the same table of tests runs on each."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentkey.journal import MemoryJournal, SQLiteJournal
from tests._loopback import RedisServer
from tests._postgres import PostgresServer, postgres_proc

__all__ = ["postgres_proc"]

KINDS = ("memory", "sqlite", "redis", "postgres")


@pytest.fixture(params=KINDS)
def journal_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Build journals of one kind (each test runs once per kind); all share one store."""
    kind: str = request.param
    made: list[Any] = []
    prefix = f"t{uuid.uuid4().hex[:10]}"

    shared: list[MemoryJournal] = []

    def factory(**options: Any) -> Any:
        if kind == "memory":  # one store per test, as the others share their server
            if not shared:
                shared.append(MemoryJournal(**options))
            journal: Any = shared[0]
        elif kind == "sqlite":
            journal = SQLiteJournal(tmp_path / "journal.sqlite3", **options)
        elif kind == "redis":
            from agentkey.journal import RedisJournal

            server: RedisServer = request.getfixturevalue("redis_proc")
            journal = RedisJournal(server.url, prefix=f"agentkey:{prefix}", **options)
        else:
            from agentkey.journal import PostgresJournal

            pg: PostgresServer = request.getfixturevalue("postgres_proc")
            journal = PostgresJournal(pg.dsn, table=prefix, **options)
        made.append(journal)
        return journal

    factory.kind = kind  # type: ignore[attr-defined]
    yield factory
    for journal in made:
        journal.close()
