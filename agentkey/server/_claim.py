"""The claim a handler holds while its step runs, and how the handler reaches it.

The lease is renewed by a background loop while the handler runs (the default),
or by the handler itself (``auto_renew=False``: :meth:`Claim.renew`,
:meth:`Claim.keep_alive`). The loop stops on an event, never by cancellation
alone: on CPython <= 3.11 a cancellation that lands as a store call completes can
be swallowed inside ``asyncio.wait_for`` (redis-py uses it), and a loop stopped
only by ``cancel()`` then renews forever. Waiting for the loop is bounded, and a
cancellation aimed at the handler always propagates.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import itertools
import json
import logging
import re
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio

from .._clock import SYSTEM, Clock, SystemClock
from .._exceptions import (
    ConfigurationError,
    InvalidArguments,
    InvalidKey,
    LeaseLost,
    StoreError,
    StoreUnavailable,
)
from .._keys import StepKey, shown_key
from .._schedule import Backoff
from ._records import (
    Binding,
    InProgress,
    Phase,
    StoredOutcome,
    decode_record,
    encode_in_progress,
    encode_outcome,
)
from ._stores import Store

__all__ = ["Claim", "LeaseLost", "current_claim"]

#: The longest leaving a renewal loop waits for a renewal in flight.
STOP_WAIT_SECONDS = 5.0
#: The waits between renewals after one failed (full jitter; never beyond the interval).
_RENEW_BACKOFF = Backoff(initial=0.05, cap=1.0)

_logger = logging.getLogger("agentkey.server")
_current: contextvars.ContextVar[Claim | None] = contextvars.ContextVar(
    "agentkey_claim", default=None
)


#: A name of Claim.key_for(): the characters of a plan id.
_DOWNSTREAM_NAME = re.compile(r"[A-Za-z0-9._~-]{1,64}")

#: Claim.json() has not parsed the body yet.
_UNPARSED: Any = object()


def wall_ms(clock: Clock) -> int:
    """``clock``'s wall time in Unix milliseconds: what records and ``Retry-After`` count in."""
    return int(clock.time() * 1000)


async def wait_for_event(wait: Callable[[], Awaitable[Any]], seconds: float, clock: Clock) -> bool:
    """Wait until ``wait()`` returns or ``seconds`` pass on ``clock``; True if ``wait()`` did.

    The timeout is a sleep on ``clock``, so an injected clock (a ``FakeClock``) runs it:
    the wait is recorded there and no real time passes.
    """
    if type(clock) is SystemClock:  # the same wait, without a task for the timer
        with anyio.move_on_after(seconds):
            await wait()
            return True
        return False
    woken = False
    async with anyio.create_task_group() as group:

        async def timer() -> None:
            await clock.asleep(seconds)
            group.cancel_scope.cancel()

        group.start_soon(timer)
        await wait()
        woken = True
        group.cancel_scope.cancel()
    return woken


class OutOfTime(Exception):
    """A retry loop of a settle found its budget spent on the clock (caught by the settle)."""


def renew_every_ms(lease_ms: int) -> int:
    """How often a lease of ``lease_ms`` is renewed: every third of it (at least every ms)."""
    return max(1, lease_ms // 3)


def kept_ms(phase: str, lease_ms: int, result_ttl_ms: int) -> int:
    """How long the store keeps a record in ``phase``: one lease while ``claimed``, as long
    as a result once the side effect may have started (so a lapsed lease is remembered as
    in doubt, never forgotten)."""
    return result_ttl_ms if phase == "started" else lease_ms


class Claim:
    """The lease on one ``Idempotency-Key`` held by the running handler.

    - By default (the middleware's ``mutation_starts="on_run"``) the side effect may
      have started as soon as the handler runs: the claim's own record says so, so a
      server that dies, or a handler that fails with a 5xx or an exception, leaves
      the key *in doubt*, never free. :meth:`nothing_started` says otherwise (a
      failure then releases the key for a retry).
    - :meth:`begin_mutation` says the side effect has started: from then on a
      failure (an exception, a 5xx, a 401...) is recorded as ``FAILED`` and
      replayed, instead of releasing the key for a blind retry. With
      ``mutation_starts="on_mark"`` it is where "may have started" begins: ``await
      claim.begin_mutation()`` writes it to the store before the side effect.
    - The lease (the middleware's ``lock_ttl``) is renewed every third of it
      while the handler runs, unless the middleware has ``auto_renew=False``;
      then :meth:`renew` extends it once and :meth:`keep_alive` renews it for a
      block of work.
    - :attr:`lost` is true only when another request took the key.
    """

    __slots__ = (
        "_binding",
        "_body",
        "_clock",
        "_downstream",
        "_json",
        "_lease_ms",
        "_lost",
        "_mark_awaited",
        "_maybe_committed",
        "_mutation_started",
        "_nothing_started",
        "_operation",
        "_owner",
        "_phase",
        "_renew_ms",
        "_renewed",
        "_result_ttl_ms",
        "_settled",
        "_started_ms",
        "_stop",
        "_store",
        "_task",
        "_unavailable",
        "_waiting",
        "auto_renew",
        "idempotency_key",
        "key",
        "principal",
        "record_key",
    )

    def __init__(
        self,
        *,
        key: StepKey | None,
        idempotency_key: str,
        principal: str,
        record_key: str,
        owner: str,
        store: Store,
        lock_ttl_ms: int,
        auto_renew: bool = True,
        binding: Binding | None = None,
        started_ms: int | None = None,
        clock: Clock | None = None,
        body: Sequence[bytes] | None = None,
        phase: Phase = "claimed",
        result_ttl_ms: int | None = None,
        operation: str = "",
    ) -> None:
        #: The parsed agentkey key; None for an opaque key (a UUID, ``ik_...``).
        self.key = key
        #: The key as received (raw form; an sf-string is unquoted).
        self.idempotency_key = idempotency_key
        self.principal = principal
        self.record_key = record_key
        self.auto_renew = auto_renew
        self._owner = owner
        self._store = store
        self._lease_ms = lock_ttl_ms
        self._renew_ms = renew_every_ms(lock_ttl_ms)
        self._binding = binding
        self._clock = clock if clock is not None else SYSTEM
        self._started_ms = wall_ms(self._clock) if started_ms is None else started_ms
        self._mutation_started = False
        self._mark_awaited = False  # begin_mutation()'s answer was awaited (on_mark)
        self._downstream = False  # key_for() was called: a foreign call is (about to be) made
        #: A transaction of this claim committed, or its COMMIT failed and may have landed.
        self._maybe_committed = False
        self._nothing_started = False
        self._phase: Phase = phase
        self._result_ttl_ms = lock_ttl_ms if result_ttl_ms is None else result_ttl_ms
        self._operation = operation
        self._lost = False
        self._settled = False
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._waiting: _FirstRenewals | None = None  # waiting there for its first interval
        self._renewed = 0.0  # monotonic time of the last renewal (or of the claim)
        #: The store failure the handler met inside the store's transaction, if any.
        self._unavailable: StoreUnavailable | None = None
        # The HTTP request's body (its chunks) until json() parses it. The middleware
        # hands on no parsed object: one kept here would live (and be walked by the
        # garbage collector) for the whole handler, which may never ask for it.
        self._body = body
        self._json: Any = _UNPARSED

    def __repr__(self) -> str:
        # The key is a bearer secret: a claim that reaches a log shows its redacted form.
        key = shown_key(self.idempotency_key)
        return f"Claim(key={key!r}, mutation_started={self._mutation_started})"

    @property
    def owner(self) -> str:
        """The random fencing token of this claim."""
        return self._owner

    @property
    def binding(self) -> Binding | None:
        """The operation (method, route, opaque body) the key is bound to."""
        return self._binding

    @property
    def mutation_started(self) -> bool:
        """True once :meth:`begin_mutation` was called."""
        return self._mutation_started

    @property
    def _may_have_started(self) -> bool:
        """True when the side effect may have started without the handler saying so: the
        claim's record says "may have started" and :meth:`nothing_started` was not called.
        A 5xx or an exception then puts the key in doubt."""
        return self._phase == "started" and not self._nothing_started

    @property
    def _record_ttl_ms(self) -> int:
        """How long the store keeps this claim's record: one lease while ``claimed``, as
        long as a result once the side effect may have started (so a lapsed lease is
        remembered as in doubt, never forgotten)."""
        return kept_ms(self._phase, self._lease_ms, self._result_ttl_ms)

    def nothing_started(self) -> None:
        """Say that this request's side effect has not started and will not: if the
        handler then fails (an exception, a 5xx), the key is released for a retry
        instead of being left in doubt.

        Call it on a failure path before anything happened (a validation error, a
        downstream refusal that charged nothing). It is a promise about this process
        only: if the server dies afterwards, the key is still in doubt (the store was
        told the side effect may have started). Raises
        :class:`~agentkey.ConfigurationError` after :meth:`begin_mutation`.
        """
        if self._mutation_started:
            raise ConfigurationError(
                f"nothing_started() after begin_mutation() on {shown_key(self.idempotency_key)}: "
                "the side effect has begun, so the key cannot be released"
            )
        self._nothing_started = True

    @property
    def lost(self) -> bool:
        """True once a renewal found that another request took the key.

        A lease that merely expired, with nobody else claiming the key, is taken
        back by the next renewal and is not lost.
        """
        return self._lost

    def json(self) -> Any:
        """The request's JSON body, parsed at most once: what ``await request.json()`` gives.

        The body is parsed on the first call, never before: a handler that does not
        ask holds no parsed copy of it (the middleware keeps none: an opaque key's body
        is fingerprinted by its bytes, and a body it parses to check, such as one that
        is not an agentkey key's exact bytes, is dropped after the check). Every call
        returns the same object.

        Raises :class:`~agentkey.InvalidArguments` when the body is not JSON, and
        :class:`~agentkey.ConfigurationError` for a claim without an HTTP body (an MCP
        call, whose arguments the tool receives as they are).
        """
        value = self._json
        if value is _UNPARSED:
            if self._body is None:
                raise ConfigurationError(
                    "this claim has no HTTP request body to parse: it was made by a front "
                    "end other than IdempotencyMiddleware (an MCP call receives its arguments)"
                )
            try:
                value = json.loads(b"".join(self._body))
            except (ValueError, RecursionError) as exc:
                raise InvalidArguments(
                    f"the request body under {shown_key(self.idempotency_key)} is not JSON "
                    f"({type(exc).__name__}); answer the request with a 400",
                    path="body",
                ) from None
            self._json, self._body = value, None
        return value

    def begin_mutation(self) -> Awaitable[None]:
        """Mark that the side effect has started; later failures are recorded as FAILED.

        With the middleware's default (``mutation_starts="on_run"``) the store already
        knows the side effect may have started, and this marks the point in the
        process. With ``mutation_starts="on_mark"``, ``await claim.begin_mutation()``
        also writes "may have started" to the store (one write, compare-and-set on the
        owner) before returning: do it before the side effect, so a server that dies
        after it leaves the key in doubt rather than free. Not awaited, the mark lives
        in this process only.

        Raises :class:`LeaseLost` when a renewal found that another request took
        the key: it may be running this step, so this one must not.
        """
        if self._lost:
            raise LeaseLost(
                f"another request took the key {shown_key(self.idempotency_key)} after this "
                "request's lease expired, so the side effect must not start here; the client "
                "retries with the same key and gets the other request's answer"
            )
        if self._nothing_started:
            raise ConfigurationError(
                f"begin_mutation() after nothing_started() on "
                f"{shown_key(self.idempotency_key)}: the handler said nothing would start"
            )
        self._mutation_started = True
        return _Mark(self)

    async def _mark_started(self) -> None:
        """Write "may have started" over this claim's record (``mutation_starts="on_mark"``)."""
        if self._phase == "started":
            return
        self._phase = "started"
        if self._settled:
            return
        try:
            owned = await self._store.finish(
                self.record_key, self._owner, self.in_progress_record(), ttl_ms=self._record_ttl_ms
            )
        except StoreError as exc:
            # Nothing started: the handler must not begin its side effect, and the key is
            # released (503, or the handler's own failure) rather than left in doubt.
            self._phase, self._mutation_started = "claimed", False
            if isinstance(exc, StoreUnavailable):
                raise self._note_unavailable(exc) from None
            raise
        if not owned:
            self._phase, self._mutation_started = "claimed", False
            self._lost = True
            raise LeaseLost(
                f"the lease on {shown_key(self.idempotency_key)} lapsed before the side "
                "effect began and another request may hold the key, so it must not start "
                "here; the client retries with the same key"
            )

    async def _mark_claimed(self) -> None:
        """Write "claimed" (nothing started) over this claim's record: a handler whose side
        effects all happen in one database transaction (PostgreSQL's transactional
        completion), so a crash rolls them back and the key must be free after its lease.

        Not when the handler may have started something outside the transaction: it
        called :meth:`begin_mutation` (it said so) or :meth:`key_for` (it calls a third
        party, or is about to). The record then keeps "may have started", so a crash or a
        failure leaves the key in doubt rather than free for a second foreign call."""
        if self._phase == "claimed" or self._mutation_started or self._downstream:
            return
        if self._settled:
            return
        self._phase = "claimed"
        if not await self._store.finish(
            self.record_key, self._owner, self.in_progress_record(), ttl_ms=self._record_ttl_ms
        ):
            self._lost = True

    def key_for(self, name: str) -> str:
        """The ``Idempotency-Key`` for the downstream call ``name`` this handler makes.

        The same request (the same key, caller and route) gets the same key for
        ``name`` on every run, so a run after a crash or a released retry repeats its
        downstream calls under their first keys, and a downstream service that honours
        keys (Stripe, another agentkey server) runs each once. The key is a UUID (version
        8) made from a SHA-256 digest of the incoming key, the principal, the route the
        key is bound to and ``name``: it reveals nothing of the incoming key (a bearer
        secret, never passed on), and differs per caller, per route and per name. Give
        each downstream call of the handler its own name (``"payments"``,
        ``"ledger.entry"``): one name is one operation downstream.

        Raises :class:`~agentkey.InvalidKey` when ``name`` is not 1-64 characters from
        ``[A-Za-z0-9._~-]``.
        """
        if not isinstance(name, str) or not _DOWNSTREAM_NAME.fullmatch(name):
            shown = repr(name) if not isinstance(name, str) or len(name) <= 80 else "a long str"
            raise InvalidKey(
                f"claim.key_for() takes the name of one downstream call, 1-64 characters from "
                f"[A-Za-z0-9._~-] such as 'payments', got {shown}; the key of "
                f"{shown_key(self.idempotency_key)} is not derived for it"
            )
        self._downstream = True  # a foreign call: a transaction no longer frees the key
        # Fixed forever, as KEY_UUID_NAMESPACE is: another derivation would give a step
        # already in flight new downstream keys on its next run.
        digest = hashlib.sha256()
        binding = "" if self._binding is None else self._binding.encode()
        for part in ("agentkey.key_for.v1", self.principal, binding, self.idempotency_key, name):
            data = part.encode("utf-8", "surrogatepass")
            digest.update(len(data).to_bytes(4, "big") + data)  # length-prefixed: unambiguous
        value = int.from_bytes(digest.digest()[:16], "big")
        # RFC 9562 version 8 (custom) and the RFC variant bits: a valid UUID everywhere.
        value = (value & ~(0xF << 76) & ~(0x3 << 62)) | (0x8 << 76) | (0x2 << 62)
        return str(uuid.UUID(int=value))

    def in_progress_record(self, now_ms: int | None = None) -> bytes:
        """This claim's ``IN_PROGRESS`` value, its lease starting now (or at ``now_ms``)."""
        now = wall_ms(self._clock) if now_ms is None else now_ms
        return encode_in_progress(
            self._owner,
            self._started_ms,
            lease_end_ms=now + self._lease_ms,
            renew_ms=self._renew_ms if self.auto_renew or self.renewing else 0,
            binding=self._binding,
            phase=self._phase,
            operation=self._operation,
        )

    async def renew(self) -> bool:
        """Extend the lease by ``lock_ttl`` from now; False (and :attr:`lost`) if another
        request took the key.

        The record is rewritten (compare-and-set on the owner), so it says when
        its lease ends. If the lease had expired and nobody claimed the key, it
        is claimed again.
        """
        if self._settled:
            return not self._lost
        value = self.in_progress_record()
        store, key = self._store, self.record_key
        if await store.finish(key, self._owner, value, ttl_ms=self._record_ttl_ms):
            return True
        # "Not owned": a write the client library re-sent after it landed, or an
        # expired lease. Only a record of someone else means the key was taken.
        current = await store.get(key)
        if current is None and not self._settled:
            current = await store.claim(key, value, ttl_ms=self._record_ttl_ms)
            if current is None:
                _logger.warning(
                    "the lease on %s had expired (nobody claimed the key meanwhile) and was "
                    "taken back; if the event loop or the store stalls for a whole lease, "
                    "another request may run this step",
                    shown_key(self.idempotency_key),
                )
                return True
        if current is None or current == value or self._is_ours(current):
            return True
        if not self._settled:
            self._lost = True
            _logger.warning(
                "another request took the key %s after this request's lease expired; "
                "this request's result will not be stored",
                shown_key(self.idempotency_key),
            )
        return False

    def _is_ours(self, value: bytes) -> bool:
        try:
            record = decode_record(value, key=self.idempotency_key)
        except StoreError:
            return False
        return isinstance(record, InProgress) and record.owner == self._owner

    # --- the renewal loop ------------------------------------------------------

    async def _loop(self, stop: asyncio.Event) -> None:
        """Renew every third of the lease; after a failed renewal (the store is away) retry
        sooner, with backoff, so the lease is extended as soon as the store is back.

        Started once the first interval has passed on the event loop's timer (one timer
        serves every claim, see :class:`_FirstRenewals`: a handler that ends sooner costs
        no task, and on an injected clock a short handler is never renewed); from then on
        the waits are on real time too: the lease is timed by the store (Redis and PostgreSQL
        in real seconds), and on a clock that moves when something sleeps on it (a FakeClock,
        set_testing's) a loop of waits would renew as fast as the CPU allows and push that
        clock on by an interval each time. Stalls are measured, and the jitter drawn, on the
        claim's clock."""
        interval, lease = self._renew_ms / 1000, self._lease_ms / 1000
        clock = self._clock
        failures = 0
        lapse_warned = False
        while not stop.is_set() and not self._settled:  # an interval has passed: renew
            stalled = clock.monotonic() - self._renewed
            if stalled > lease and not lapse_warned:
                lapse_warned = True
                _logger.warning(
                    "the lease on %s lapsed: no renewal for %.1f s, longer than the %g s "
                    "lease (the event loop was blocked, or the store was slow), so another "
                    "request may have run this step; keep blocking calls out of async "
                    "handlers (use a def endpoint or a thread) or raise lock_ttl",
                    shown_key(self.idempotency_key),
                    stalled,
                    lease,
                )
            try:
                if not await self.renew():
                    return
            except Exception as exc:  # a failed renewal must not kill the handler
                failures += 1
                if failures == 1:
                    _logger.warning(
                        "renewing the lease on %s failed (%s); retrying until the store "
                        "answers (the lease ends %.1f s after the last renewal)",
                        shown_key(self.idempotency_key),
                        exc,
                        lease,
                    )
                wait = min(interval, _RENEW_BACKOFF.delay(failures, rng=clock.random))
            else:
                if failures:
                    _logger.warning(
                        "renewed the lease on %s after %d failed attempts",
                        shown_key(self.idempotency_key),
                        failures,
                    )
                self._renewed = clock.monotonic()
                failures, lapse_warned, wait = 0, False, interval
            await wait_for_event(stop.wait, wait, SYSTEM)  # real time: the store's lease

    def _spawn(self) -> None:
        """The first interval passed with the handler still running: start the loop."""
        self._waiting = None
        if not self._settled:
            self._stop = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop(self._stop))

    @property
    def renewing(self) -> bool:
        """True while the lease is renewed in the background."""
        return self._waiting is not None or self._task is not None

    def start_renewing(self) -> bool:
        """Renew in the running asyncio loop from now on; False if none runs.

        Until its first interval has passed the claim waits in a queue that one
        timer serves for every claim of the loop, so a handler that finishes
        within ``lock_ttl / 3`` costs neither a task nor a timer of its own.
        """
        if self.renewing:
            return True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # trio, or no loop: the handler renews by itself
            return False
        self._renewed = self._clock.monotonic()
        self._waiting = _FirstRenewals.of(loop, self._renew_ms)
        self._waiting.add(self, loop)
        return True

    def _stopped_at_once(self) -> bool:
        """Leave the queue of first renewals; True when no renewal loop runs either (the
        usual handler, done within its first interval): nothing is left to wait for."""
        if self._waiting is not None:
            self._waiting.discard(self)
            self._waiting = None
        return self._task is None

    async def stop_renewing(self) -> None:
        """Stop the loop: set its event, wait (bounded) for a renewal in flight.

        A cancellation of the caller propagates; the loop is then told to stop
        and cancelled, and exits at its next check even if that cancellation is
        swallowed below it.
        """
        if self._stopped_at_once():
            return
        task, stop = self._task, self._stop
        if task is None or stop is None:
            return
        self._task = self._stop = None
        stop.set()
        try:
            await asyncio.wait({task}, timeout=min(STOP_WAIT_SECONDS, self._lease_ms / 1000))
        finally:
            if not task.done():
                task.cancel()
                _logger.warning(
                    "a lease renewal of %s was still running when its handler finished; "
                    "it was cancelled",
                    shown_key(self.idempotency_key),
                )

    def _note_unavailable(
        self, exc: StoreUnavailable, *, maybe_committed: bool = False
    ) -> StoreUnavailable:
        """The store failed inside the handler (its transaction): the middleware answers
        503 instead of the 500 the app makes of it; ``not_run`` only when nothing can have
        happened (``maybe_committed``: a COMMIT failed and may have landed)."""
        self._unavailable = exc
        if maybe_committed:
            self._maybe_committed = True
        return exc

    @property
    def _nothing_outside(self) -> bool:
        """Nothing of this request can have happened beyond the transaction that failed: no
        transaction of it committed (or may have), and no foreign call was made."""
        return not (self._maybe_committed or self._downstream or self._mutation_started)

    def mark_settled(self) -> None:
        """The outcome is being recorded: no renewal may write the record again."""
        self._settled = True

    @asynccontextmanager
    async def keep_alive(self) -> AsyncIterator[Claim]:
        """Renew the lease every ``lock_ttl / 3`` while the block runs.

        With automatic renewal (the default) the lease is already renewed and
        this only yields.
        """
        if self.renewing or not self.start_renewing():
            yield self
            return
        try:
            yield self
        finally:
            await self.stop_renewing()


class _Mark:
    """What :meth:`Claim.begin_mutation` returns: awaiting it makes the mark durable.

    Not a coroutine, so the many handlers that call ``claim.begin_mutation()`` without
    ``await`` (the default mode needs none) get no "never awaited" warning.
    """

    __slots__ = ("_claim",)

    def __init__(self, claim: Claim) -> None:
        self._claim = claim

    def __await__(self) -> Generator[Any, None, None]:
        self._claim._mark_awaited = True
        return self._claim._mark_started().__await__()


class _FirstRenewals:
    """The claims of one event loop and one renewal interval that wait for their first renewal.

    One timer serves them all: claims are queued in the order they started, and
    as they share the interval, they fall due in that order. When the timer
    fires, the claims due start their renewal loops and the timer is set for
    the next one. A claim that settles first leaves the queue (a dict: O(1)).
    The queue holds no reference to its loop (it is a weak key of ``_QUEUES``):
    only the loop's own timer refers to it.
    """

    __slots__ = ("__weakref__", "_armed", "_claims", "_interval")

    def __init__(self, renew_ms: int) -> None:
        self._interval = renew_ms / 1000
        self._claims: dict[Claim, float] = {}  # claim -> loop time its first renewal is due
        self._armed = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop, renew_ms: int) -> _FirstRenewals:
        global _LAST
        last = _LAST
        if last is not None and last[0]() is loop:  # the usual case: the same loop again
            queues = last[1]
        else:  # a lookup in _QUEUES makes a weak reference each time: once per loop here
            found = _QUEUES.get(loop)
            if found is None:
                found = _QUEUES[loop] = {}
            queues = found
            _LAST = (weakref.ref(loop), queues)
        queue = queues.get(renew_ms)
        if queue is None:
            queue = queues[renew_ms] = cls(renew_ms)
        return queue

    def add(self, claim: Claim, loop: asyncio.AbstractEventLoop) -> None:
        due = loop.time() + self._interval
        self._claims[claim] = due
        if not self._armed:
            self._armed = True
            loop.call_at(due, self._fire, loop)

    def discard(self, claim: Claim) -> None:
        # The timer stays: it fires once for nothing, or for the next claim.
        self._claims.pop(claim, None)

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        claims = self._claims
        now = loop.time() + 0.001  # the loop may fire a timer within its clock's resolution
        while claims:
            claim, due = next(iter(claims.items()))
            if due > now:
                loop.call_at(due, self._fire, loop)
                return
            del claims[claim]
            claim._spawn()
        self._armed = False


_QUEUES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[int, _FirstRenewals]] = (
    weakref.WeakKeyDictionary()
)
# The loop looked up last, weakly, with its queues (which hold no reference to it).
_LAST: tuple[weakref.ref[asyncio.AbstractEventLoop], dict[int, _FirstRenewals]] | None = None


def current_claim() -> Claim:
    """The claim of the request being handled (works in any handler behind the middleware)."""
    claim = _current.get()
    if claim is None:
        raise ConfigurationError(
            "no idempotency claim is active: this code does not run inside a request "
            "that IdempotencyMiddleware claimed (check its routes and methods)"
        )
    return claim


def set_current(claim: Claim | None) -> contextvars.Token[Claim | None]:
    return _current.set(claim)


def reset_current(token: contextvars.Token[Claim | None]) -> None:
    _current.reset(token)


#: Waits between retries of an outcome's write while the store is down (full jitter).
SETTLE_BACKOFF = Backoff(initial=0.05, cap=1.0)


async def record_outcome(
    store: Store, claim: Claim, outcome: StoredOutcome, *, ttl_ms: int
) -> bool:
    """Write ``outcome`` over ``claim``'s record; False when another request owns the key now.

    Idempotent, so it can be retried: a finish whose answer was lost finds its
    own outcome; a record whose lease lapsed and that nobody took is claimed
    with the outcome. Raises :class:`~agentkey.StoreError` when the store fails.
    """
    encoded = encode_outcome(outcome)
    if await store.finish(claim.record_key, claim.owner, encoded, ttl_ms=ttl_ms):
        return True
    # A finish that the client library re-sent after it had succeeded also answers
    # "not owned": the record is then exactly ours.
    current = await store.get(claim.record_key)
    if current is None:
        # The lease lapsed (a stalled loop or store) and nobody took the key: the
        # outcome is still this request's, so record it.
        current = await store.claim(claim.record_key, encoded, ttl_ms=ttl_ms)
    return current is None or current == encoded


async def record_until_stored(
    store: Store, claim: Claim, outcome: StoredOutcome, *, ttl_ms: int, deadline: float
) -> bool:
    """Retry :func:`record_outcome` with backoff until the store answers.

    For a handler that has run: an unrecorded outcome would free the key after its
    lease and let a retry run the side effect again. The retries wait on the claim's
    clock and stop at ``deadline`` on it (:class:`OutOfTime`); the caller's cancel
    scope bounds a store call that hangs.
    """
    return await until_answered(
        claim,
        "recorded the outcome of",
        lambda: record_outcome(store, claim, outcome, ttl_ms=ttl_ms),
        deadline,
    )


async def release_until_done(store: Store, claim: Claim, *, deadline: float) -> bool:
    """Retry the release of ``claim`` with backoff until the store answers.

    For a request that ended without running its side effect: until the release
    lands, every retry of the step gets 409 for the rest of the lease. The retries
    wait on the claim's clock and stop at ``deadline`` on it (:class:`OutOfTime`).
    """
    return await until_answered(
        claim, "released", lambda: store.release(claim.record_key, claim.owner), deadline
    )


async def until_answered(
    claim: Claim, done: str, write: Callable[[], Awaitable[bool]], deadline: float
) -> bool:
    clock = claim._clock
    for attempt in itertools.count(1):
        left = deadline - clock.monotonic()
        if left <= 0:
            raise OutOfTime
        await clock.asleep(min(left, SETTLE_BACKOFF.delay(attempt, rng=clock.random)))
        try:
            answer = await write()
        except StoreError as exc:
            _logger.debug("%s %s failed again: %s", done, shown_key(claim.idempotency_key), exc)
            continue
        _logger.warning(
            "%s %s after %d retries (the store was unavailable)",
            done,
            shown_key(claim.idempotency_key),
            attempt,
        )
        return answer
    raise AssertionError("unreachable")  # pragma: no cover
