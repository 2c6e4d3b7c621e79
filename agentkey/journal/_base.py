"""What every journal implements, and who owns a pending record (this process or another)."""

from __future__ import annotations

import itertools
import os
import secrets
import socket
import time
from collections.abc import Collection, Sequence
from typing import Protocol, runtime_checkable

from .._exceptions import ConfigurationError
from ._records import SETTLED, Begun, CallRecord, CallState, repeats_among, route_of

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_RETENTION",
    "SETTLED",
    "Begun",
    "CallRecord",
    "CallState",
    "Journal",
    "check_journal_options",
    "current_owner",
    "current_process",
    "in_flight",
    "is_live",
    "repeats_among",
    "route_of",
]

#: Answers larger than this are not kept in the journal (the record says how large they were).
DEFAULT_MAX_BODY_BYTES = 1024 * 1024
#: How long a record is kept after its last change (seconds): a week.
DEFAULT_RETENTION = 7 * 24 * 3600.0
#: Evidence that a route honours keys is trusted this long after it was last seen.
EVIDENCE_TTL = 30 * 24 * 3600.0


@runtime_checkable
class Journal(Protocol):
    """A durable record of the calls a client sends. Every write is atomic per key.

    Synchronous methods serve :class:`~agentkey.ToolInvoker`; the ``a``-prefixed
    ones :class:`~agentkey.AsyncToolInvoker`. A journal that supports only one
    side says so with ``supports_sync`` / ``supports_async``.
    """

    supports_sync: bool
    supports_async: bool

    def begin(
        self, record: CallRecord, *, repeats: bool = False, known: Collection[str] | None = None
    ) -> Begun:
        """Write ``record`` unless a record of its key exists; return what was there.

        ``repeats=True``: first look for the plan's records of the same tool and
        arguments under another key (:func:`repeats_among`); when there are any, write
        nothing and return them as ``Begun.earlier``. With ``known`` (the keys of the
        identical calls an agent runtime's call was decided against), those records
        include calls with a runtime call id, and are returned (nothing written) only
        when one of them is not in ``known``: the look and the write are one step.
        """
        ...

    def take_over(self, record: CallRecord, previous: CallRecord) -> bool:
        """Replace ``previous`` (unchanged since read) by ``record``; False if it changed."""
        ...

    def finish(self, record: CallRecord) -> bool:
        """Write ``record`` over the record its owner holds; False if another owner holds it."""
        ...

    def get(self, key: str) -> CallRecord | None: ...

    def find(self, plan: str, *, tool: str | None = None, args_hash: str | None = None,
             call_id: str | None = None) -> list[CallRecord]:  # fmt: skip
        """The records of ``plan`` (oldest first), filtered by tool, args hash or call id."""
        ...

    def calls(self, *, plan: str | None = None, states: Sequence[CallState] | None = None,
              limit: int = 100) -> list[CallRecord]:  # fmt: skip
        """Records, newest first, of one plan or all, in the given states."""
        ...

    def learn(self, route: str, evidence: str) -> None:
        """Remember that ``route`` showed it honours keys (``evidence`` says how)."""
        ...

    def settle(self, key: str, state: CallState, *, reason: str) -> CallRecord | None:
        """An operator's verdict on a call: overwrite its state whoever holds it."""
        ...

    def prune(self, *, older_than: float) -> int:
        """Delete records untouched for ``older_than`` seconds; how many went."""
        ...

    def close(self) -> None: ...

    async def abegin(
        self, record: CallRecord, *, repeats: bool = False, known: Collection[str] | None = None
    ) -> Begun: ...

    async def atake_over(self, record: CallRecord, previous: CallRecord) -> bool: ...

    async def afinish(self, record: CallRecord) -> bool: ...

    async def aget(self, key: str) -> CallRecord | None: ...

    async def afind(self, plan: str, *, tool: str | None = None, args_hash: str | None = None,
                    call_id: str | None = None) -> list[CallRecord]: ...  # fmt: skip

    async def alearn(self, route: str, evidence: str) -> None: ...

    async def aclose(self) -> None: ...


# --- who owns a pending record ------------------------------------------------------------

_host = socket.gethostname()
_process: tuple[int, str] | None = None
_calls = itertools.count(1)
#: The owners (one per call) this process is sending right now (see :class:`in_flight`).
_IN_FLIGHT: set[str] = set()


def current_process() -> str:
    """``<host>:<pid>:<random>``: this process, told apart from an earlier one with its pid."""
    global _process
    pid = os.getpid()
    if _process is None or _process[0] != pid:  # first use, or a forked child
        _process = (pid, f"{_host}:{pid}:{secrets.token_hex(4)}")
    return _process[1]


def current_owner() -> str:
    """A new owner name for one call of this process: ``<host>:<pid>:<random>:<n>``."""
    return f"{current_process()}:{next(_calls)}"


class in_flight:
    """Marks a call's owner as sending, in this process, for the duration of a ``with``."""

    __slots__ = ("owner",)

    def __init__(self, owner: str | None) -> None:
        self.owner = owner

    def __enter__(self) -> None:
        if self.owner:
            _IN_FLIGHT.add(self.owner)

    def __exit__(self, *exc: object) -> None:
        if self.owner:
            _IN_FLIGHT.discard(self.owner)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists, owned by someone else (or we cannot tell: assume alive)
    return True


def is_live(record: CallRecord, now: float) -> bool:
    """True when a ``PENDING`` record's sender may still be sending it.

    This process: while the key is in flight here. Another process on this host:
    while that pid exists and the lease lasts. Another host: while the lease lasts.
    """
    if record.state is not CallState.PENDING:
        return False
    owner = record.owner or ""
    if owner.startswith(current_process() + ":"):
        return owner in _IN_FLIGHT
    if now >= record.lease_until:
        return False
    host, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if host == _host and pid_text.isdigit():
        pid = int(pid_text)
        return pid != os.getpid() and _pid_alive(pid)
    return True


def check_journal_options(max_body_bytes: object, retention: object) -> tuple[int, float]:
    """Validated ``max_body_bytes`` and ``retention`` of a journal's constructor."""
    if (
        isinstance(max_body_bytes, bool)
        or not isinstance(max_body_bytes, int)
        or max_body_bytes < 0
    ):
        raise ConfigurationError(
            f"max_body_bytes must be a whole number of bytes >= 0, got {max_body_bytes!r}"
        )
    if (
        isinstance(retention, bool)
        or not isinstance(retention, (int, float))
        or not 60 <= retention < float("inf")
    ):
        raise ConfigurationError(
            f"retention must be a number of seconds of at least 60, got {retention!r}"
        )
    return max_body_bytes, float(retention)


def now_wall() -> float:
    """Unix time in seconds: journal records outlive processes, so they use the wall clock."""
    return time.time()
