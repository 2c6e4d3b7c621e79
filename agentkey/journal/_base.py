"""What every journal implements, and who owns a pending record (this process or another)."""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import socket
from collections.abc import Collection, Sequence
from typing import Protocol, runtime_checkable

from .._clock import Clock, default_clock
from .._exceptions import ConfigurationError, JournalError
from .._keys import shown_key
from ._records import SETTLED, Begun, CallRecord, CallState, Evidence, repeats_among, route_of

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_RETENTION",
    "EVIDENCE_TTL",
    "SETTLED",
    "Begun",
    "CallRecord",
    "CallState",
    "Evidence",
    "Journal",
    "check_journal_options",
    "check_settle",
    "current_owner",
    "current_process",
    "in_flight",
    "is_live",
    "journal_clock",
    "malformed",
    "missed_finish",
    "prunable",
    "repeats_among",
    "route_of",
    "settle_by_take_over",
]

_logger = logging.getLogger("agentkey")

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
        """Write ``record`` over the record its owner holds (True).

        When its owner no longer holds it (an operator settled it, another sender took
        it over, it was deleted), raise :class:`~agentkey.JournalError` (``sent=True``)
        saying so; the sender's outcome is still written over an operator's verdict or
        a deleted record, as it is what really happened (:func:`missed_finish`).
        """
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

    def learn(self, route: str, evidence: str, *, ttl: float | None = None) -> None:
        """Remember that ``route`` showed it honours keys (``evidence`` says how): an
        :class:`Evidence` record, first seen now or earlier, expiring ``ttl`` seconds
        (default ``EVIDENCE_TTL``, 30 days) after it was last seen."""
        ...

    def evidence(self) -> list[Evidence]:
        """The evidence in force (not expired), most recently seen first."""
        ...

    def forget(self, route: str) -> bool:
        """Forget what ``route`` showed (True if there was evidence for it)."""
        ...

    def settle(
        self, key: str, state: CallState, *, reason: str, force: bool = False
    ) -> CallRecord | None:
        """An operator's verdict on a call in doubt (None: no such call).

        Refused with :class:`~agentkey.JournalError` while the call's sender is alive
        (:func:`is_live`), and for a call that already ended (answered, failed, ...)
        unless ``force=True``. The verdict lands only on the record that was checked.
        """
        ...

    def prune(self, *, older_than: float, include_unsettled: bool = False) -> int:
        """Delete the records of ended calls untouched for ``older_than`` seconds; how
        many went. A call in doubt (or pending, its sender gone) is kept unless
        ``include_unsettled=True``; one whose sender is alive is always kept."""
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

    async def alearn(self, route: str, evidence: str, *, ttl: float | None = None) -> None: ...

    async def aclose(self) -> None: ...


# --- who owns a pending record ------------------------------------------------------------

_host = socket.gethostname()
_process: tuple[int, str] | None = None
_calls = itertools.count(1)
#: The owners (one per call) this process is sending right now (see :class:`in_flight`).
_IN_FLIGHT: set[str] = set()


def current_process() -> str:
    """``<host>:<pid>:<nonce>``: this process, told apart from an earlier one with its pid."""
    global _process
    pid = os.getpid()
    if _process is None or _process[0] != pid:  # first use, or a forked child
        _process = (pid, f"{_host}:{pid}:{secrets.token_hex(4)}")
    return _process[1]


def current_owner() -> str:
    """A new owner name for one call of this process: ``<host>:<pid>:<nonce>:<n>``."""
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


#: States of a call that may have run without the journal knowing how it ended.
UNSETTLED = frozenset({CallState.PENDING, CallState.IN_DOUBT})


def _describe(record: CallRecord) -> str:
    """How a record ended, in words, for messages."""
    said = record.state.value
    if record.status_code is not None:
        said += f", status {record.status_code}"
    if record.source == "operator":
        said += ", settled by an operator"
    return said


def check_settle(current: CallRecord, state: CallState, *, force: bool, now: float) -> None:
    """Refuse an operator's verdict that could be wrong: a live sender, or an ended call."""
    shown = shown_key(current.key)
    if is_live(current, now):
        raise JournalError(
            f"{shown} is still being sent (its sender {_owner_of(current)} is alive); a "
            "verdict now would be overturned by its answer, or let the step be sent twice. "
            "Wait until it ends (agentkey journal show), then settle it if it is in doubt",
            sent=True,
            idempotency_key=current.key,
            step=current.step,
        )
    if current.state not in UNSETTLED and not force:
        raise JournalError(
            f"{shown} already ended ({_describe(current)}); settle changes only calls in "
            f"doubt. To overwrite that record as {CallState(state).value} anyway, pass "
            "--force (force=True)",
            sent=current.state is not CallState.NOT_SENT,
            idempotency_key=current.key,
            step=current.step,
        )


def settled_as(current: CallRecord, state: CallState, reason: str, now: float) -> CallRecord:
    """``current`` with an operator's verdict."""
    return current.with_(
        state=CallState(state), owner=None, reason=reason, updated_at=now, source="operator"
    )


class _Swaps(Protocol):
    """What settling needs of a journal: read a record, and swap it if unchanged."""

    def get(self, key: str) -> CallRecord | None: ...

    def take_over(self, record: CallRecord, previous: CallRecord) -> bool: ...


def settle_by_take_over(
    journal: _Swaps, key: str, state: CallState, reason: str, *, force: bool, now: float
) -> CallRecord | None:
    """Settle ``key`` with a compare-and-set on the record that was checked (a sender
    that ends meanwhile wins, and the verdict is checked again against its outcome)."""
    for _ in range(5):
        current = journal.get(key)
        if current is None:
            return None
        check_settle(current, state, force=force, now=now)
        settled = settled_as(current, state, reason, now)
        if journal.take_over(settled, current):
            return settled
    raise JournalError(
        f"{shown_key(key)} kept changing while it was being settled; nothing was changed. "
        "Try again",
        sent=True,
        idempotency_key=key,
    )


class _Writes(_Swaps, Protocol):
    """What writing back a missed finish needs of a journal (sync)."""

    def begin(self, record: CallRecord) -> Begun: ...


class _AWrites(Protocol):
    """What writing back a missed finish needs of a journal (asyncio)."""

    async def aget(self, key: str) -> CallRecord | None: ...

    async def abegin(self, record: CallRecord) -> Begun: ...

    async def atake_over(self, record: CallRecord, previous: CallRecord) -> bool: ...


def finish_missed(journal: _Writes, record: CallRecord) -> JournalError:
    """A finish of ``record`` matched no record of its owner: write its outcome back where
    :func:`missed_finish` says to, and return the error to raise (one that says the outcome
    was not recorded when the write-back lost to another change)."""
    current = journal.get(record.key)
    written, error = missed_finish(record, current)
    if written is None:
        return error
    if current is None:
        done = journal.begin(written).existing is None
    else:
        done = journal.take_over(written, current)
    return error if done else _unwritten(record)


async def afinish_missed(journal: _AWrites, record: CallRecord) -> JournalError:
    """:func:`finish_missed` for the asyncio methods."""
    current = await journal.aget(record.key)
    written, error = missed_finish(record, current)
    if written is None:
        return error
    if current is None:
        done = (await journal.abegin(written)).existing is None
    else:
        done = await journal.atake_over(written, current)
    return error if done else _unwritten(record)


def _unwritten(record: CallRecord) -> JournalError:
    return JournalError(
        f"the journal's record of {shown_key(record.key)} changed while this sender's "
        f"finish was written, and changed again while its outcome ({_describe(record)}) was "
        "written back: that outcome was not recorded. See agentkey journal show, and find "
        "what else writes this call's record",
        sent=True,
        idempotency_key=record.key,
        step=record.step,
    )


def missed_finish(
    record: CallRecord, current: CallRecord | None
) -> tuple[CallRecord | None, JournalError]:
    """A finish that matched no record of its owner: what to write, and the error to raise.

    The sender's outcome is what happened, so it is written over an operator's verdict
    (given while the call was still being sent) and over a record that was deleted;
    returned is that record (None: write nothing), to insert when ``current`` is None,
    else to put in place of ``current``. A call another sender took over keeps that
    sender's record: the error says the tool may run it twice.
    """
    shown, outcome = shown_key(record.key), _describe(record)
    if current is None:
        return record, JournalError(
            f"the journal's record of {shown} was deleted while the call was being sent "
            f"(pruned, or it expired); its outcome ({outcome}) was written again. Find what "
            "deletes records of calls in flight (a prune with --include-unsettled, a "
            "retention shorter than a call)",
            sent=True,
            idempotency_key=record.key,
            step=record.step,
        )
    if current.source == "operator" and current.owner is None:
        written = record.with_(
            reason=f"the sender's outcome, over an operator's verdict ({current.reason})"
        )
        return written, JournalError(
            f"{shown} was settled by an operator as {current.state.value} while it was "
            f"still being sent; the sender's outcome ({outcome}) was recorded over that "
            "verdict, so the step is not sent again on its word. Call the step again to "
            "get the recorded outcome, and check how the verdict was reached",
            sent=True,
            idempotency_key=record.key,
            step=record.step,
        )
    return None, JournalError(
        f"{shown} was taken over by another sender ({_owner_of(current)}) while this one "
        f"was still sending it (its lease ran out): the tool may have run it twice. This "
        f"sender's outcome ({outcome}) was not recorded; see agentkey journal show",
        sent=True,
        idempotency_key=record.key,
        step=record.step,
    )


def prunable(record: CallRecord, cutoff: float, *, include_unsettled: bool, now: float) -> bool:
    """Whether ``prune`` deletes ``record``: untouched since before ``cutoff``, and ended
    (or unsettled with ``include_unsettled``, its sender gone)."""
    if record.updated_at >= cutoff:
        return False
    if record.state in UNSETTLED:
        return include_unsettled and not is_live(record, now)
    return True


def malformed(where: str, error: Exception, *, key: str | None = None) -> JournalError:
    """A record the journal cannot read; logged (listing skips it), and raised for one call."""
    name = shown_key(key) if key else "a record"
    message = (
        f"{where}: {name} cannot be read ({type(error).__name__}: {str(error)[:120]}); it "
        "was skipped. Look at it with the journal's own tools, then fix or delete it"
    )
    _logger.warning("agentkey: %s", message)
    return JournalError(message, sent=True, idempotency_key=key)


def _owner_of(record: CallRecord) -> str:
    host, _, rest = (record.owner or "?").partition(":")
    return f"process {rest.partition(':')[0]} on {host}" if rest else host


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


def journal_clock(clock: object) -> Clock:
    """The clock a journal runs on: ``clock``, or the default one (read now, when it is built).

    Record times, evidence expiry and lease ages are on its wall clock (``time()``): records
    outlive processes. What a journal measures within this process (how long ago it pruned,
    read evidence) is on its ``monotonic()``.
    """
    if clock is None:
        return default_clock()
    if not isinstance(clock, Clock):
        raise ConfigurationError(
            f"clock must be an agentkey Clock (agentkey.testing.FakeClock in tests), got "
            f"{clock!r}; a journal no longer takes a function of Unix seconds: pass "
            "FakeClock(wall=...) and move it with advance()"
        )
    return clock
