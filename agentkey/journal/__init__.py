"""The client's call journal: every call recorded before it is sent, and how it ended.

An invoker writes a record of each call before its first request leaves and
its outcome when the call ends: answered, failed, accepted (still running on
the tool), not sent, or in doubt (it may have run and nothing says whether it
did). The record outlives the process, so a restarted agent never sends a call
in doubt blindly to a tool that does not honour Idempotency-Key, and never
sends a new key for a step it already sent.

- :class:`SQLiteJournal`: the default, a file in the user's data directory.
- :class:`RedisJournal`, :class:`PostgresJournal`: one journal for a fleet
  of agents (extras ``redis`` and ``postgres``).
- :class:`MemoryJournal`: in-process, for tests.
- :class:`Verdict`, :class:`InDoubt` and :class:`HttpLookup`: reconcile hooks
  (``reconcile=`` on an invoker) that settle a call in doubt.
- :class:`Evidence`: what a route showed about honouring keys (``journal.evidence()``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._base import CallRecord, CallState, Evidence, Journal
from ._memory import MemoryJournal
from ._sqlite import SQLiteJournal
from ._verify import HttpLookup, InDoubt, Verdict

if TYPE_CHECKING:
    from ._postgres import PostgresJournal
    from ._redis import RedisJournal

__all__ = [
    "CallRecord",
    "CallState",
    "Evidence",
    "HttpLookup",
    "InDoubt",
    "Journal",
    "MemoryJournal",
    "PostgresJournal",
    "RedisJournal",
    "SQLiteJournal",
    "Verdict",
]

_LAZY = {"PostgresJournal": "._postgres", "RedisJournal": "._redis"}


if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        """Load the Redis and PostgreSQL journals on first use (their clients are extras)."""
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value
        return value
