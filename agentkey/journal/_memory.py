"""An in-process journal: the semantics of the durable ones, for tests and short scripts.

Nothing survives the process, so it protects retries within one run only.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence

from .._clock import Clock
from ._base import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_RETENTION,
    EVIDENCE_TTL,
    Begun,
    CallRecord,
    CallState,
    Evidence,
    check_journal_options,
    is_live,
    journal_clock,
    missed_finish,
    prunable,
    repeats_among,
    settle_by_take_over,
)
from ._records import recorded

__all__ = ["MemoryJournal", "SyncJournal", "unchanged"]


def unchanged(current: CallRecord, previous: CallRecord) -> bool:
    """True when ``current`` is still the record that was read as ``previous``."""
    return (current.state, current.owner, current.updated_at) == (
        previous.state,
        previous.owner,
        previous.updated_at,
    )


class SyncJournal(ABC):
    """A journal whose work never waits on a network: its ``a``-methods call the sync ones."""

    supports_sync = True
    supports_async = True
    _clock: Clock

    @abstractmethod
    def begin(
        self, record: CallRecord, *, repeats: bool = False, known: Collection[str] | None = None
    ) -> Begun: ...

    @abstractmethod
    def take_over(self, record: CallRecord, previous: CallRecord) -> bool: ...

    @abstractmethod
    def finish(self, record: CallRecord) -> bool: ...

    @abstractmethod
    def get(self, key: str) -> CallRecord | None: ...

    @abstractmethod
    def find(
        self,
        plan: str,
        *,
        tool: str | None = None,
        args_hash: str | None = None,
        call_id: str | None = None,
    ) -> list[CallRecord]: ...

    @abstractmethod
    def learn(self, route: str, evidence: str, *, ttl: float | None = None) -> None: ...

    @abstractmethod
    def evidence(self) -> list[Evidence]: ...

    @abstractmethod
    def forget(self, route: str) -> bool: ...

    def settle(
        self, key: str, state: CallState, *, reason: str, force: bool = False
    ) -> CallRecord | None:
        return settle_by_take_over(self, key, state, reason, force=force, now=self._clock.time())

    @abstractmethod
    def close(self) -> None: ...

    async def abegin(
        self, record: CallRecord, *, repeats: bool = False, known: Collection[str] | None = None
    ) -> Begun:
        return self.begin(record, repeats=repeats, known=known)

    async def atake_over(self, record: CallRecord, previous: CallRecord) -> bool:
        return self.take_over(record, previous)

    async def afinish(self, record: CallRecord) -> bool:
        return self.finish(record)

    async def aget(self, key: str) -> CallRecord | None:
        return self.get(key)

    async def afind(
        self,
        plan: str,
        *,
        tool: str | None = None,
        args_hash: str | None = None,
        call_id: str | None = None,
    ) -> list[CallRecord]:
        return self.find(plan, tool=tool, args_hash=args_hash, call_id=call_id)

    async def alearn(self, route: str, evidence: str, *, ttl: float | None = None) -> None:
        self.learn(route, evidence, ttl=ttl)

    async def aclose(self) -> None:
        self.close()


class MemoryJournal(SyncJournal):
    """A journal held in this process's memory (thread-safe).

    ``clock``: the :class:`~agentkey.Clock` its record times and evidence expiry are read
    on (default: the system clock; tests pass ``agentkey.testing.FakeClock``).
    """

    def __init__(
        self,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        retention: float = DEFAULT_RETENTION,
        clock: Clock | None = None,
    ) -> None:
        self.max_body_bytes, self.retention = check_journal_options(max_body_bytes, retention)
        self._clock = journal_clock(clock)
        self._records: dict[str, CallRecord] = {}
        # (plan, args_hash) -> the keys of its records: what a begin that looks for repeats
        # reads, instead of every record of the journal (a long run made each begin slower).
        self._by_args: dict[tuple[str, str | None], dict[str, None]] = {}
        self._evidence: dict[str, Evidence] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"MemoryJournal(records={len(self._records)})"

    def _put(self, record: CallRecord) -> None:
        """Keep ``record`` under its key (in place of the one there), and in the index."""
        previous = self._records.get(record.key)
        if previous is not None and (previous.plan, previous.args_hash) != (
            record.plan,
            record.args_hash,
        ):
            self._unindex(previous)
        self._records[record.key] = record
        self._by_args.setdefault((record.plan, record.args_hash), {})[record.key] = None

    def _same_args(self, record: CallRecord) -> list[CallRecord]:
        """The records of ``record``'s plan and arguments (``repeats_among`` picks its repeats)."""
        keys = self._by_args.get((record.plan, record.args_hash), ())
        return [self._records[key] for key in keys]

    def _unindex(self, record: CallRecord) -> None:
        where = (record.plan, record.args_hash)
        keys = self._by_args.get(where)
        if keys is not None:
            keys.pop(record.key, None)
            if not keys:
                del self._by_args[where]

    def _evidence_of(self, route: str) -> str | None:
        found = self._evidence.get(route)
        if found is None or self._clock.time() > found.expires_at:
            return None
        return found.marker

    def begin(
        self, record: CallRecord, *, repeats: bool = False, known: Collection[str] | None = None
    ) -> Begun:
        with self._lock:
            if repeats and (earlier := repeats_among(record, self._same_args(record), known=known)):
                return Begun(None, self._evidence_of(record.route), False, earlier)
            existing = self._records.get(record.key)
            if existing is None:
                self._put(record)
                return recorded(self._evidence_of(record.route))
            live = is_live(existing, self._clock.time())
            return Begun(existing, self._evidence_of(record.route), live)

    def take_over(self, record: CallRecord, previous: CallRecord) -> bool:
        with self._lock:
            current = self._records.get(record.key)
            if current is None or not unchanged(current, previous):
                return False
            self._put(record)
            return True

    def finish(self, record: CallRecord) -> bool:
        with self._lock:
            current = self._records.get(record.key)
            if current is not None and current.owner == record.owner:
                self._put(record)
                return True
            written, error = missed_finish(record, current)
            if written is not None:
                self._put(written)
        raise error

    def get(self, key: str) -> CallRecord | None:
        with self._lock:
            return self._records.get(key)

    def find(
        self,
        plan: str,
        *,
        tool: str | None = None,
        args_hash: str | None = None,
        call_id: str | None = None,
    ) -> list[CallRecord]:
        with self._lock:
            found = [
                r
                for r in self._records.values()
                if r.plan == plan
                and (tool is None or r.tool == tool)
                and (args_hash is None or r.args_hash == args_hash)
                and (call_id is None or r.call_id == call_id)
            ]
        return sorted(found, key=lambda r: r.created_at)

    def calls(
        self,
        *,
        plan: str | None = None,
        states: Sequence[CallState] | None = None,
        limit: int = 100,
    ) -> list[CallRecord]:
        with self._lock:
            found = [
                r
                for r in self._records.values()
                if (plan is None or r.plan == plan) and (states is None or r.state in states)
            ]
        return sorted(found, key=lambda r: r.updated_at, reverse=True)[:limit]

    def learn(self, route: str, evidence: str, *, ttl: float | None = None) -> None:
        now = self._clock.time()
        expires = now + (EVIDENCE_TTL if ttl is None else ttl)
        with self._lock:
            known = self._evidence.get(route)
            first = known.first_seen if known is not None and now <= known.expires_at else now
            self._evidence[route] = Evidence(route, evidence, first, now, expires)

    def evidence(self) -> list[Evidence]:
        now = self._clock.time()
        with self._lock:
            for route in [r for r, e in self._evidence.items() if now > e.expires_at]:
                del self._evidence[route]
            found = list(self._evidence.values())
        return sorted(found, key=lambda e: (-e.last_seen, e.route))

    def forget(self, route: str) -> bool:
        with self._lock:
            return self._evidence.pop(route, None) is not None

    def prune(self, *, older_than: float, include_unsettled: bool = False) -> int:
        now = self._clock.time()
        cutoff = now - older_than
        with self._lock:
            old = [
                k
                for k, r in self._records.items()
                if prunable(r, cutoff, include_unsettled=include_unsettled, now=now)
            ]
            for key in old:
                self._unindex(self._records.pop(key))
            return len(old)

    def close(self) -> None:
        return None
