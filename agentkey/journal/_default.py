"""Which journal an invoker uses when it is given none: one per process and path."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from .._exceptions import ConfigurationError
from ._base import Journal
from ._memory import MemoryJournal
from ._sqlite import SQLiteJournal, UnsafeJournal, default_journal_path

__all__ = ["ENV", "is_testing", "resolve_journal", "set_testing"]

#: Environment variable naming the default journal: a file path, ``memory`` or ``off``.
ENV = "AGENTKEY_JOURNAL"

_logger = logging.getLogger("agentkey")
_shared: dict[str, Journal] = {}
_lock = threading.Lock()
_testing = False


def set_testing(testing: bool) -> None:
    """In testing mode an invoker given no journal gets its own in-memory journal, whatever
    file ``$AGENTKEY_JOURNAL`` names (``off`` still means none): nothing is written to the
    user's data directory or to the agent's journal, and no test's calls are found by
    another test's invoker."""
    global _testing
    _testing = testing


def is_testing() -> bool:
    """Whether testing mode is on (for ``set_testing`` to restore it)."""
    return _testing


def resolve_journal(journal: Any) -> Journal | None:
    """The journal an invoker uses for ``journal=``: a journal as given, None for none.

    ``None`` means the default: ``$AGENTKEY_JOURNAL`` when set (a path, ``memory``
    or ``off``), else the SQLite file in the user's data directory. Invokers of
    one process share it. When the default file cannot be used (a read-only home
    directory), a warning says so and the calls are journalled in memory only; a
    default directory or file that is not private to the user (another owner, a mode
    other users can read or write, a symlink) is refused with ConfigurationError.
    In testing mode (``agentkey.testing.set_testing``) the default is a new
    :class:`MemoryJournal` for each invoker instead, unless the setting is ``off``.
    """
    if journal is False:
        return None
    if journal is not None:
        if not isinstance(journal, Journal):
            raise ConfigurationError(
                "journal must be a journal (SQLiteJournal, RedisJournal, PostgresJournal, "
                f"MemoryJournal), None for the default file, or False for none, got {journal!r}"
            )
        return journal
    setting = os.environ.get(ENV, "").strip()
    if setting.lower() in ("off", "none", "false", "0"):
        return None
    if _testing:  # a file set for the agent's own runs is not a test's to write to
        return MemoryJournal()  # one per invoker: no test sees another test's calls
    with _lock:
        name = setting or str(default_journal_path())
        found = _shared.get(name)
        if found is None:
            found = _open(name, explicit=bool(setting))
            _shared[name] = found
        return found


def _open(name: str, *, explicit: bool) -> Journal:
    if name.lower() == "memory":
        return MemoryJournal()
    try:
        return SQLiteJournal(name)
    except ConfigurationError as exc:
        if explicit or isinstance(exc, UnsafeJournal):
            raise  # a file that may be someone else's is refused, never worked around
        _logger.warning(
            "agentkey: the default journal cannot be used (%s); calls are journalled in "
            "memory only, so a restarted process will not know what this one sent. Set %s "
            "to a writable path, or pass journal= to the invoker",
            exc,
            ENV,
        )
        return MemoryJournal()
