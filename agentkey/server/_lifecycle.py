"""One claim lifecycle for every front end: whose key space, the claim, the settle.

The HTTP middleware and the MCP middleware read requests and send answers each in
their own way. Between those two ends they do the same I/O around the pure
decisions of :mod:`agentkey.server._decide`, and it lives here, once::

    resolve_principal(func, request)      -> str | None (None: refuse, nothing is looked up)
    Lifecycle.open(checked, principal, hold=) -> Claim | Doubted | Replay | Problem
        (a replay or a refusal builds no Claim; a run is its Claim)
    Lifecycle.reconcile(doubted, checked, hook, ...) -> Claim | Replay | Problem
        ... the tool runs, its lease renewed ...
    Lifecycle.settle(claim, on_finished(...), deliver=)  -> "claimed" | "failed" | "released"

:meth:`Lifecycle.settle` records the outcome (or releases the key) and keeps the
rules every front end needs: the first write runs inline; a cancellation makes it
run again, shielded, within the settle budget; a failed write is retried there
after the answer is delivered; a blob is written once per claim, and a blob no
record will name is deleted. A duplicate held by ``hold_in_flight`` waits for a
notification from the settle of its key in this process, while one of the
duplicates of the key (never all of them) asks the store, with backoff, in case
another process holds it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, Literal, TypeVar

import anyio

from .._clock import Clock
from .._exceptions import ConfigurationError, StoreError
from .._keys import StepKey, shown_key
from .._schedule import Backoff
from ._blobs import BlobStore
from ._claim import (
    Claim,
    OutOfTime,
    kept_ms,
    record_outcome,
    record_until_stored,
    release_until_done,
    renew_every_ms,
    until_answered,
    wait_for_event,
    wall_ms,
)
from ._decide import (
    Checked,
    Complete,
    Conflict,
    Doubt,
    Fail,
    InDoubt,
    Problem,
    Reject,
    Release,
    Replay,
    Run,
    Unavailable,
    on_claimed,
    on_finished,
    unavailable,
)
from ._decide import record_key as _record_key
from ._reconcile import ReconcileContext, ReconcileHook, ask
from ._records import StoredOutcome, encode_in_progress, encode_outcome
from ._stores import SETTLE_SECONDS, Store

#: ``mutation_starts``: when a handler's side effect may have started. ``on_run`` (the
#: default): as soon as it runs, carried in the claim's own write. ``on_mark``: when it
#: calls ``await claim.begin_mutation()`` (one more write), so a failure or a crash
#: before that frees the key.
MutationStarts = Literal["on_run", "on_mark"]


def check_mutation_starts(value: object) -> MutationStarts:
    if value not in ("on_run", "on_mark"):
        raise ConfigurationError(
            f"mutation_starts must be 'on_run' (the side effect may have started as soon as "
            f"the handler runs) or 'on_mark' (at await claim.begin_mutation()), got {value!r}"
        )
    return value


__all__ = [
    "MAX_HELD",
    "SHARED_PRINCIPAL",
    "Doubted",
    "Lifecycle",
    "MutationStarts",
    "check_mutation_starts",
    "check_principal_options",
    "resolve_principal",
]

_logger = logging.getLogger("agentkey.server")
_T = TypeVar("_T")

#: The principal of every request when the app declares one shared key space.
SHARED_PRINCIPAL = "shared"
#: The most duplicates one front end holds at once (``hold_in_flight``); beyond it a
#: duplicate gets its 409 at once, so held requests cannot pile up without bound.
MAX_HELD = 1000
# How often the one duplicate that asks the store for a held key does so: 0.1 s, then
# doubling to 1 s. A settle in this process wakes the duplicates at once.
_HOLD_BACKOFF = Backoff(initial=0.1, cap=1.0, jitter=False)


def check_principal_options(principal: object, shared_key_space: object, *, what: str) -> None:
    """Refuse a front end that cannot tell its callers apart, unless it says it need not."""
    if not isinstance(shared_key_space, bool):
        raise ConfigurationError(
            f"shared_key_space must be True or False, got {type(shared_key_space).__name__}"
        )
    if principal is not None and not callable(principal):
        raise ConfigurationError(
            f"principal must be a function ({what}) -> str | None, got {type(principal).__name__}"
        )
    if principal is not None and shared_key_space:
        raise ConfigurationError(
            "pass either principal= (records are scoped by caller) or shared_key_space=True "
            "(every caller shares one key space), not both"
        )


async def resolve_principal(func: Callable[[_T], object], request: _T) -> str | None:
    """The principal ``func`` gives for ``request`` (sync or async); None when it has none.

    None or an empty string means the request is not authenticated: the front end
    refuses it before looking anything up. Any other non-str is a bug in the
    principal function, raised as :class:`~agentkey.ConfigurationError`.
    """
    value = func(request)
    if type(value) is str and value:
        return value
    if inspect.isawaitable(value):
        value = await value
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        # The type only: a principal function gone wrong may return a credential.
        raise ConfigurationError(
            f"the principal function must return a str (or None for an unauthenticated "
            f"request), got a {type(value).__name__}; return the tenant, user or client id "
            "of the request"
        )
    return value


class _Held:
    """The duplicates of one record key that this front end holds (``hold_in_flight``)."""

    __slots__ = ("count", "event", "finished", "poller")

    def __init__(self) -> None:
        self.count = 0
        self.finished = 0  # bumped each time the key may have finished
        self.event = anyio.Event()  # set (and replaced) on a finish or a handover
        self.poller: Claim | None = None  # the one duplicate that asks the store


class _Blob:
    """The blob of one settle: written once, whichever attempt of the settle asks."""

    __slots__ = ("task", "uri")

    def __init__(self) -> None:
        self.task: asyncio.Task[str] | None = None
        self.uri: str | None = None


class Doubted:
    """The key is in doubt (``doubt``, the answer when nothing reconciles it); ``claim``
    is this request's, for :meth:`Lifecycle.reconcile`."""

    __slots__ = ("claim", "doubt")

    def __init__(self, claim: Claim, doubt: InDoubt) -> None:
        self.claim, self.doubt = claim, doubt


def _new_owner() -> str:
    """A claim's owner token: what ``secrets.token_hex(16)`` does, in one call. A
    uniqueness token, not the clock's chance: two claims never share one."""
    return os.urandom(16).hex()


class Lifecycle:
    """The I/O of one front end's claims: claiming, holding, settling.

    ``blob_store`` is a function returning the blob store (it may be built on
    first use); None keeps every answer inline. ``clock`` is the front end's: the
    claims' wall times (Unix ms in the records), the hold of a duplicate, the settle's
    budget and its retries all run on it.
    """

    __slots__ = (
        "_blob_store",
        "_held",
        "_holding",
        "_warned",
        "auto_renew",
        "clock",
        "lock_ttl_ms",
        "mutation_starts",
        "result_ttl_ms",
        "retry_after",
        "store",
    )

    def __init__(
        self,
        store: Store,
        *,
        lock_ttl_ms: int,
        result_ttl_ms: int,
        retry_after: int,
        auto_renew: bool,
        clock: Clock,
        blob_store: Callable[[], BlobStore] | None = None,
        mutation_starts: MutationStarts = "on_run",
    ) -> None:
        self.store = store
        self.mutation_starts = mutation_starts
        self.lock_ttl_ms = lock_ttl_ms
        self.result_ttl_ms = result_ttl_ms
        self.retry_after = retry_after
        self.auto_renew = auto_renew
        self.clock = clock
        self._blob_store = blob_store
        # Per thread: an event loop's events are woken from that loop only. A loop in
        # another thread that shares this front end has its own poller per key.
        self._held: dict[tuple[int, str], _Held] = {}
        self._holding = 0
        self._warned: set[str] = set()  # operations warned about an unawaited mark

    # --- claiming --------------------------------------------------------------------

    def new_claim(
        self,
        checked: Checked,
        principal: str,
        body: Sequence[bytes] | None = None,
        operation: str = "",
        *,
        owner: str | None = None,
        record_key: str | None = None,
        started_ms: int | None = None,
    ) -> Claim:
        """The claim of ``checked`` for ``principal``; ``body``: the HTTP request's chunks,
        which :meth:`Claim.json` parses for the handler if it asks.
        ``operation`` (``"POST /charges"``, ``"tools/call charge"``) is kept in the record
        for operators who list the keys in doubt. ``owner``, ``record_key`` and
        ``started_ms``: those of a claim already sent to the store (:meth:`open`)."""
        key = checked.key
        return Claim(
            key=key if isinstance(key, StepKey) else None,
            idempotency_key=key.format(),
            principal=principal,
            record_key=_record_key(principal, key) if record_key is None else record_key,
            owner=_new_owner() if owner is None else owner,
            started_ms=started_ms,
            store=self.store,
            lock_ttl_ms=self.lock_ttl_ms,
            auto_renew=self.auto_renew,
            binding=checked.binding,
            clock=self.clock,
            body=body,
            phase=self.first_phase(),
            result_ttl_ms=self.result_ttl_ms,
            operation=operation,
        )

    def first_phase(self) -> Literal["started", "claimed"]:
        """A new claim's phase: ``started`` when the side effect starts with the run."""
        return "started" if self.mutation_starts == "on_run" else "claimed"

    def now_ms(self) -> int:
        """The clock's wall time in Unix milliseconds."""
        return wall_ms(self.clock)

    def claim(
        self, claim: Claim, checked: Checked, *, hold: float = 0.0
    ) -> Coroutine[Any, Any, Problem | Run | Replay]:
        # (An InDoubt problem carries the record met, for reconcile().)
        """Claim the key; with ``hold`` (seconds), a duplicate waits for the key to finish.

        Without ``hold`` it is one coroutine, not two: every request pays for the
        frames it holds across the store's round trip.
        """
        if hold:
            return self._claim_or_hold(claim, checked, hold)
        return self._claim_once(claim, checked)

    async def _claim_or_hold(
        self, claim: Claim, checked: Checked, hold: float
    ) -> Problem | Run | Replay:
        until = self.clock.monotonic() + hold
        decision = await self._claim_once(claim, checked)
        if isinstance(decision, Conflict):
            return await self._hold(claim, checked, decision, until)
        return decision

    async def open(
        self,
        checked: Checked,
        principal: str,
        body: Sequence[bytes] | None = None,
        operation: str = "",
        *,
        hold: float = 0.0,
    ) -> Claim | Doubted | Replay | Problem:
        """:meth:`new_claim` then :meth:`claim`, the :class:`Claim` built only when the
        request goes on with one: it runs (the answer is the claim it runs under: a run
        never comes without one), it is held (``hold``), or its key is in doubt
        (:class:`Doubted`, for a reconcile hook). A replay, a
        refusal, a 409 or a 503 is answered from the key and the record met alone: the
        same store write and the same decision (:func:`on_claimed`), without the object.
        """
        key = checked.key
        store_key = _record_key(principal, key)
        owner = _new_owner()
        until = self.clock.monotonic() + hold if hold else 0.0
        now = wall_ms(self.clock)  # the lease's start; a 409's Retry-After counts from it
        phase = self.first_phase()
        # What Claim.in_progress_record(now) of the claim new_claim() would build writes
        # (tests/server/test_request_weight.py compares the two writes).
        value = encode_in_progress(
            owner,
            now,
            lease_end_ms=now + self.lock_ttl_ms,
            renew_ms=renew_every_ms(self.lock_ttl_ms) if self.auto_renew else 0,
            binding=checked.binding,
            phase=phase,
            operation=operation,
        )
        ttl = kept_ms(phase, self.lock_ttl_ms, self.result_ttl_ms)
        decision = await self._ask(store_key, value, ttl, owner, checked, now)
        if isinstance(decision, Unavailable):
            self._log_unavailable(key.format(), decision)
            return decision
        if isinstance(decision, (Replay, Reject)) or (isinstance(decision, Conflict) and not hold):
            return decision
        claim = self.new_claim(
            checked, principal, body, operation, owner=owner, record_key=store_key, started_ms=now
        )
        if isinstance(decision, Run):
            if decision.renew:
                decision = await self._renewed(claim, decision, checked)
        elif isinstance(decision, Conflict):
            decision = await self._hold(claim, checked, decision, until)
        if isinstance(decision, Run):
            return claim
        if isinstance(decision, InDoubt):
            return Doubted(claim, decision)
        return decision

    async def _ask(
        self, store_key: str, value: bytes, ttl_ms: int, owner: str, checked: Checked, now: int
    ) -> Problem | Run | Replay:
        """Write the claim ``value`` under ``store_key`` if free; decide on what is there."""
        existing: bytes | StoreError | None
        try:
            existing = await self.store.claim(store_key, value, ttl_ms=ttl_ms)
        except StoreError as exc:
            existing = exc
        return on_claimed(existing, checked, owner=owner, now_ms=now, retry_after=self.retry_after)

    async def _renewed(
        self, claim: Claim, decision: Run, checked: Checked
    ) -> Problem | Run | Replay:
        """``decision`` once our own claim, read back (``Run(renew=True)``), is renewed.

        A renewal that finds the key taken by another request (our lease lapsed between
        the write and its read-back) runs nothing: the answer is decided again on the
        record there now (409 in progress, a replay, in doubt...), or 503 if it is gone
        again, so the handler never runs beside the request that holds the key."""
        if not decision.renew:
            return decision
        try:
            if await claim.renew():
                return decision
            existing = await self.store.get(claim.record_key)
        except StoreError as exc:
            failed = unavailable(self.retry_after, str(exc))
            self._log_unavailable(claim.idempotency_key, failed)
            return failed
        now = wall_ms(self.clock)
        again = on_claimed(
            existing, checked, owner=claim.owner, now_ms=now, retry_after=self.retry_after
        )
        if isinstance(again, Run):  # gone again, or (never) ours: nothing ran, try again
            return unavailable(
                self.retry_after, "the key changed hands while this request claimed it"
            )
        return again

    def _log_unavailable(self, key: str, decision: Unavailable) -> None:
        _logger.error(
            "idempotency store failed while claiming %s: %s", shown_key(key), decision.cause
        )

    async def _claim_once(self, claim: Claim, checked: Checked) -> Problem | Run | Replay:
        now = wall_ms(self.clock)  # the lease's start; a 409's Retry-After counts from it
        decision = await self._ask(
            claim.record_key,
            claim.in_progress_record(now),
            claim._record_ttl_ms,
            claim.owner,
            checked,
            now,
        )
        if isinstance(decision, Run):
            return await self._renewed(claim, decision, checked)
        if isinstance(decision, Unavailable):
            self._log_unavailable(claim.idempotency_key, decision)
        return decision

    async def _hold(
        self, claim: Claim, checked: Checked, decision: Conflict, until: float
    ) -> Problem | Run | Replay:
        """Wait for the key in flight to finish, then claim it again (replay or run).

        The settle of the key in this process wakes every held duplicate at once.
        For a key held elsewhere, one duplicate (the poller) asks the store, with
        backoff, and wakes the others when the key has finished; each of them then
        asks once. So N held duplicates cost N round trips plus a few, not N per poll.
        """
        if self._holding >= MAX_HELD:
            return decision
        key = (threading.get_ident(), claim.record_key)
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = _Held()
        held.count += 1
        self._holding += 1
        polls = 0
        try:
            while True:
                left = until - self.clock.monotonic()
                if left <= 0:
                    return decision
                if held.poller is None:
                    held.poller = claim
                polling = held.poller is claim
                seen, event = held.finished, held.event
                if polling:
                    polls += 1
                    left = min(left, _HOLD_BACKOFF.delay(polls))
                await wait_for_event(event.wait, left, self.clock)
                if held.finished == seen and not polling:
                    continue  # a handover, or out of time: look again
                result = await self._claim_once(claim, checked)
                if isinstance(result, Conflict):
                    decision = result
                    continue
                if (
                    polling
                    and held.finished == seen
                    and isinstance(result, (Replay, Reject, InDoubt))
                ):
                    self._wake(claim.record_key)  # it finished elsewhere: the others ask now
                return result
        finally:
            held.count -= 1
            self._holding -= 1
            if held.count == 0:
                if self._held.get(key) is held:
                    del self._held[key]
            elif held.poller is claim:
                held.poller = None
                held.event.set()  # another duplicate takes over the polling
                held.event = anyio.Event()

    def _wake(self, record_key: str) -> None:
        """The key may have finished: every duplicate this thread holds for it asks again."""
        held = self._held.get((threading.get_ident(), record_key))
        if held is not None:
            held.finished += 1
            held.event.set()
            held.event = anyio.Event()

    # --- settling a key in doubt ---------------------------------------------------------

    async def reconcile(
        self,
        doubted: Doubted,
        checked: Checked,
        hook: ReconcileHook,
        context: ReconcileContext,
        seconds: float,
        *,
        max_inline_bytes: int = 1 << 62,
        max_recorded_bytes: int | None = None,
    ) -> Claim | Replay | Problem:
        """Ask ``hook`` about the key in doubt, and act on its answer: a run under
        ``doubted.claim`` (the claim), a replay, or a problem (the doubt itself,
        when it stays in doubt)."""
        claim = doubted.claim
        decision = await self._reconciled(
            claim,
            checked,
            doubted.doubt,
            hook,
            context,
            seconds,
            max_inline_bytes=max_inline_bytes,
            max_recorded_bytes=max_recorded_bytes,
        )
        return claim if isinstance(decision, Run) else decision

    async def _reconciled(
        self,
        claim: Claim,
        checked: Checked,
        doubt: InDoubt,
        hook: ReconcileHook,
        context: ReconcileContext,
        seconds: float,
        *,
        max_inline_bytes: int,
        max_recorded_bytes: int | None,
    ) -> Problem | Run | Replay:
        """Ask ``hook`` about the key in doubt, and act on its answer.

        "Ran": its answer becomes the key's outcome (compare-and-set on the record met;
        the same size limit and blob offload as a handler's answer) and is replayed.
        "Not run": this request's claim replaces the record met (the same
        compare-and-set) and the handler runs; but for a record in doubt only because
        its lease lapsed, not before one more ``lock_ttl`` has passed since the lease
        ended: its handler may still be running (the store was down while it ran),
        and the hook cannot see a call that handler is about to make. "Still in doubt",
        a hook that fails, or a record that changed meanwhile and is still in doubt:
        ``doubt``.
        """
        record = doubt.record
        if record is None:
            return doubt
        answer = await ask(hook, context, seconds)
        if answer.outcome == "in_doubt":
            return doubt
        now = wall_ms(self.clock)
        if answer.outcome == "not_run" and record.phase != "in_doubt":
            alive_until = record.lease_end_ms + self.lock_ttl_ms
            if now < alive_until:
                _logger.warning(
                    "the reconcile hook said %s did not run, but its lease lapsed only %d ms "
                    "ago and its handler may still be running; the key stays in doubt for "
                    "%d ms more before a 'not run' is believed",
                    shown_key(claim.idempotency_key),
                    max(0, now - record.lease_end_ms),
                    alive_until - now,
                )
                return doubt
        blob: _Blob | None = None
        outcome: StoredOutcome | None = None
        if answer.outcome == "ran":
            settled = on_finished(
                answer.status,
                answer.headers,
                answer.body,
                error=False,
                mutation_started=True,
                binding=checked.binding,
                now_ms=now,
                max_inline_bytes=max_inline_bytes,
                max_recorded_bytes=max_recorded_bytes,
            )
            assert isinstance(settled, (Complete, Fail))  # a final status: never released
            outcome = settled.outcome
            if settled.offload and self._blob_store is not None:
                blob = _Blob()
                outcome = await self._offload(claim, outcome, blob)
            value, ttl = encode_outcome(outcome), self.result_ttl_ms
        else:
            value, ttl = claim.in_progress_record(now), claim._record_ttl_ms
        try:
            done = await self.store.finish(claim.record_key, record.owner, value, ttl_ms=ttl)
        except StoreError as exc:
            _logger.error(
                "could not record the reconcile hook's answer for %s: %s",
                shown_key(claim.idempotency_key),
                exc,
            )
            done = False
            if outcome is not None and outcome.blob_uri is not None:
                await self._delete_blob(outcome.blob_uri, "unrecorded reconcile answer")
            return unavailable(self.retry_after, str(exc))
        if not done:  # the record changed meanwhile (its handler finished, another settled it)
            if outcome is not None and outcome.blob_uri is not None:
                await self._delete_blob(outcome.blob_uri, "unrecorded reconcile answer")
            return await self._claim_once(claim, checked)
        _logger.warning(
            "the key %s was in doubt; the reconcile hook said it %s",
            shown_key(claim.idempotency_key),
            "ran (its answer is recorded and replayed)"
            if answer.outcome == "ran"
            else "did not run (it runs now)",
        )
        if outcome is not None:
            if self._held:
                self._wake(claim.record_key)
            return Replay(outcome)
        return Run()

    # --- settling ----------------------------------------------------------------------

    def _unawaited_mark(self, claim: Claim) -> None:
        """Warn, once per operation, that a handler under ``mutation_starts="on_mark"``
        called ``begin_mutation()`` without awaiting it: its mark lived in the process
        only, so a crash after its side effect would have freed the key for a second run."""
        if claim._operation in self._warned:
            return
        if len(self._warned) < 1024:
            self._warned.add(claim._operation)
        _logger.warning(
            "the handler of %s (%s) called claim.begin_mutation() without awaiting it, under "
            'mutation_starts="on_mark": the mark was never written to the store, so a crash '
            "after its side effect frees the key and a retry runs it again; write "
            "'await claim.begin_mutation()' before the side effect (logged once per route)",
            shown_key(claim.idempotency_key),
            claim._operation or "this route",
        )

    async def settle(
        self,
        claim: Claim,
        decision: Complete | Fail | Release | Doubt,
        deliver: Callable[[], Awaitable[None]] | None = None,
    ) -> str:
        """Stop renewing, then record the outcome or release the key; say which.

        ``deliver`` sends the answer: after the first write of the outcome (so a
        client normally never holds an unrecorded result), or at once when that
        write failed; the write is then retried, shielded, until it lands or the
        settle budget (``SETTLE_SECONDS`` in all) runs out.

        The first attempt runs inline: it is one store call, bounded by the
        store's own timeout, and costs no cancel scope. A settle cancelled from
        outside (a client gone under an anyio cancel scope, a server shutting
        down) has that attempt interrupted; it is then done again, shielded and
        within the budget (recording and releasing are idempotent for this
        claim's owner), before the cancellation propagates. So the claim still
        records FAILED or frees its key, instead of staying locked until its
        lease ends and letting a retry repeat a side effect that already began.
        Returns the decision for the hooks: ``claimed``, ``failed``, ``released`` or
        ``in_doubt``.
        """
        started = self.clock.monotonic()
        if claim._mutation_started and not claim._mark_awaited and claim._phase == "claimed":
            self._unawaited_mark(claim)
        blob = None if isinstance(decision, (Release, Doubt)) or not decision.offload else _Blob()
        try:
            if not claim._stopped_at_once():  # a renewal loop runs: wait for it to stop
                await claim.stop_renewing()
            claim.mark_settled()
            pending = await self._write(claim, decision, blob)
        except BaseException as exc:
            if not isinstance(exc, anyio.get_cancelled_exc_class()):
                raise
            # (Functions bound with partial, never closures: a closure here would give
            # every settle its variables as cells, for the garbage collector to walk.)
            again = partial(self._again, claim, decision, blob, started)
            await self._shielded(claim, started, again, blob)
            raise
        try:
            if deliver is not None:
                await deliver()  # after a failed write too: it is retried meanwhile
        finally:
            if pending is not None:
                retry = partial(self._until_written, claim, pending, started + SETTLE_SECONDS)
                await self._shielded(claim, started, retry, blob)
        if isinstance(decision, Release):
            return "released"
        if isinstance(decision, Doubt):
            return "in_doubt"
        return "claimed" if isinstance(decision, Complete) else "failed"

    async def _again(
        self,
        claim: Claim,
        decision: Complete | Fail | Release | Doubt,
        blob: _Blob | None,
        started: float,
    ) -> None:
        """A settle's write once more, after a cancellation interrupted the first."""
        await _stop_lease(claim)
        left = await self._write(claim, decision, blob)
        if left is not None:
            await self._until_written(claim, left, started + SETTLE_SECONDS)

    async def _shielded(
        self,
        claim: Claim,
        started: float,
        work: Callable[[], Awaitable[None]],
        blob: _Blob | None,
    ) -> None:
        """Run ``work`` shielded from cancellation, until the settle budget that began at
        ``started`` (on the clock) runs out; log when it cut the work short.

        The retries in ``work`` wait on the clock and stop when the budget is spent on it
        (:class:`OutOfTime`); the cancel scope, on the event loop's real clock, also cuts
        a store call that hangs (a socket cannot be faked)."""
        left = SETTLE_SECONDS - (self.clock.monotonic() - started)
        with anyio.CancelScope(deadline=anyio.current_time() + left, shield=True):
            try:
                await work()
                return
            except OutOfTime:
                pass
        if blob is not None and blob.uri is None and blob.task is not None:
            # Still being written, and no record will name it now.
            blob.task.add_done_callback(self._drop_late_blob)
        _logger.error(
            "settling %s did not finish within %s s (the store is unreachable or slow) "
            "and was abandoned; the key stays locked until its lease (lock_ttl) ends, "
            "and after that %s",
            shown_key(claim.idempotency_key),
            SETTLE_SECONDS,
            "it is in doubt (409 in_doubt until settled)"
            if claim._phase == "started"
            else "a retry runs the step again",
        )

    async def _write(
        self, claim: Claim, decision: Complete | Fail | Release | Doubt, blob: _Blob | None
    ) -> StoredOutcome | Release | Doubt | None:
        """Record the outcome (compare-and-set on the owner), or release the claim.

        Returns what the store failed to write: the outcome (the handler has run),
        or the release (until it lands, every retry of the step gets 409 for the
        rest of the lease); the caller retries it (:meth:`_until_written`).
        """
        if isinstance(decision, (Release, Doubt)):
            try:
                if isinstance(decision, Release):
                    await self.store.release(claim.record_key, claim.owner)
                else:
                    await self._doubt(claim)
            except StoreError as exc:
                _logger.warning(
                    "could not %s %s (%s); %sthe write is retried for up to %s s",
                    "release" if isinstance(decision, Release) else "mark in doubt",
                    shown_key(claim.idempotency_key),
                    exc,
                    ""
                    if isinstance(decision, Release)
                    else "the record already says its side effect may have started, and ",
                    SETTLE_SECONDS,
                )
                return decision
            if self._held:
                self._wake(claim.record_key)
            return None
        outcome = decision.outcome
        if blob is not None:
            outcome = await self._offload(claim, outcome, blob)
        try:
            # Awaited here rather than in a helper: the fewer coroutines a request holds
            # across the store's round trip, the less the garbage collector walks.
            stored = await record_outcome(self.store, claim, outcome, ttl_ms=self.result_ttl_ms)
        except StoreError as exc:
            _logger.warning(
                "could not record the outcome of %s (%s); the handler has run, so the "
                "write is retried for up to %s s",
                shown_key(claim.idempotency_key),
                exc,
                SETTLE_SECONDS,
            )
            return outcome
        if not stored:
            await self._lost(claim, outcome)
        elif self._held:
            self._wake(claim.record_key)
        return None

    async def _doubt(self, claim: Claim) -> bool:
        """Write the claim's record as in doubt (compare-and-set on the owner), kept as long
        as a result; False when another request owns the key now."""
        now = wall_ms(self.clock)
        record = encode_in_progress(
            claim.owner,
            claim._started_ms,
            lease_end_ms=now,
            renew_ms=0,
            binding=claim.binding,
            phase="in_doubt",
            operation=claim._operation,
        )
        done = await self.store.finish(
            claim.record_key, claim.owner, record, ttl_ms=self.result_ttl_ms
        )
        if done:
            _logger.warning(
                "the handler of %s failed after its side effect may have started; the key "
                "is in doubt until the reconcile hook or an operator settles it "
                "(agentkey server doubt / settle)",
                shown_key(claim.idempotency_key),
            )
        else:
            _logger.debug(
                "the handler of %s failed after its side effect may have started, but its "
                "record changed meanwhile (another request owns the key): not marked in doubt",
                shown_key(claim.idempotency_key),
            )
        return bool(done)

    async def _offload(self, claim: Claim, outcome: StoredOutcome, blob: _Blob) -> StoredOutcome:
        """The outcome with its body in the blob store, written once for this claim.

        On asyncio the write runs in a task of its own: a cancellation of the
        settle leaves it running, and the settle's shielded second attempt waits
        for the same write instead of starting another (which left two copies).
        """
        if blob.uri is None:
            try:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:  # trio: its cancellations respect the shield
                    with anyio.CancelScope(shield=True):
                        blob.uri = await self._blobs().put(outcome.body)
                else:
                    if blob.task is None:
                        blob.task = loop.create_task(self._blobs().put(outcome.body))
                    blob.uri = await asyncio.shield(blob.task)
            except StoreError as exc:
                # The handler has run: an unrecorded outcome would free the key after
                # its lease and let a retry run the side effect again. Keep it inline.
                blob.task = None
                _logger.warning(
                    "blob store failed (%s); keeping the %d-byte response of %s inline "
                    "in the record",
                    exc,
                    len(outcome.body),
                    shown_key(claim.idempotency_key),
                )
                return outcome
        return replace(outcome, body=b"", blob_uri=blob.uri)

    def _blobs(self) -> BlobStore:
        if self._blob_store is None:  # pragma: no cover - on_finished never offloads then
            raise ConfigurationError("this front end keeps answers inline: it has no blob store")
        return self._blob_store()

    def _drop_late_blob(self, task: asyncio.Task[str]) -> None:
        """A blob write that finished after its settle was abandoned: delete the blob."""
        if task.cancelled() or task.exception() is not None:
            return
        uri = task.result()
        task.get_loop().create_task(self._delete_blob(uri, "abandoned settle"))

    async def _delete_blob(self, uri: str, why: str) -> None:
        try:
            await self._blobs().delete(uri)
        except StoreError as exc:
            _logger.warning("could not delete the unused blob of an %s: %s", why, exc)

    async def _until_written(
        self, claim: Claim, pending: StoredOutcome | Release | Doubt, deadline: float
    ) -> None:
        """Retry a write the store failed until it answers, or ``deadline`` (on the clock)
        passes (:class:`OutOfTime`); the caller's cancel scope cuts a call that hangs."""
        if isinstance(pending, Release):
            await release_until_done(self.store, claim, deadline=deadline)
        elif isinstance(pending, Doubt):
            await until_answered(claim, "marked in doubt", lambda: self._doubt(claim), deadline)
        elif not await record_until_stored(
            self.store, claim, pending, ttl_ms=self.result_ttl_ms, deadline=deadline
        ):
            await self._lost(claim, pending)
            return
        if self._held:
            self._wake(claim.record_key)

    async def _lost(self, claim: Claim, outcome: StoredOutcome) -> None:
        _logger.warning(
            "the lease on %s lapsed before the handler finished and another request "
            "owns the key now; this result was not stored (the lease is renewed "
            "automatically unless auto_renew=False; it lapses when the store or the "
            "event loop stalls for a whole lock_ttl)",
            shown_key(claim.idempotency_key),
        )
        if outcome.blob_uri is not None:
            try:
                await self._blobs().delete(outcome.blob_uri)
            except StoreError as exc:
                _logger.warning(
                    "could not delete the unused blob of %s: %s",
                    shown_key(claim.idempotency_key),
                    exc,
                )


async def _stop_lease(claim: Claim) -> None:
    """Before settling: stop the renewals, and keep any from writing the record again."""
    await claim.stop_renewing()
    claim.mark_settled()
