"""PostgresStore's checkout: at most max_size statements in flight; waiters are bounded and
cancellable, and no slot is lost."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from psycopg_pool import PoolTimeout

from agentkey import StoreUnavailable
from agentkey.server._postgres import PostgresStore, _Slots
from agentkey.server._records import encode_in_progress

Factory = Callable[..., PostgresStore]


async def _waiting(slots: _Slots, timeout: float = 30.0) -> asyncio.Task[None]:
    """A task that has queued for a slot."""
    task = asyncio.ensure_future(slots.acquire(timeout))
    for _ in range(3):
        await asyncio.sleep(0)
    assert not task.done()
    return task


async def test_a_freed_slot_goes_to_the_longest_waiter() -> None:
    """Waiters get their turns in the order they came; a slot nobody waits for is free."""
    slots = _Slots(1)
    await slots.acquire(1)
    first, second = await _waiting(slots), await _waiting(slots)
    slots.release()
    await first
    assert not second.done()
    slots.release()
    await second
    slots.release()
    await asyncio.wait_for(slots.acquire(0), 1)  # free again: taken without waiting


async def test_a_waiter_cancelled_as_its_turn_came_passes_the_slot_on() -> None:
    """A waiter handed a slot and cancelled before it resumed gives the slot to the next one."""
    slots = _Slots(1)
    await slots.acquire(1)
    cancelled, next_one = await _waiting(slots), await _waiting(slots)
    slots.release()  # the turn goes to the first waiter ...
    cancelled.cancel()  # ... which is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await asyncio.wait_for(next_one, 1)


async def test_a_waiter_past_its_timeout_raises_pool_timeout_and_keeps_no_slot() -> None:
    """The wait is bounded by the timeout; the waiter that gave up holds nothing."""
    slots = _Slots(1)
    await slots.acquire(1)
    with pytest.raises(PoolTimeout, match="no connection was free"):
        await slots.acquire(0)
    behind = await _waiting(slots)
    slots.release()
    await asyncio.wait_for(behind, 1)  # the slot went to the live waiter, not the expired one


async def test_more_statements_than_connections_run_on_max_size_connections(
    postgres_store_factory: Factory,
) -> None:
    """Sixty reads and claims at once on a pool of three: all answer, three connections at
    most, and every slot comes back, also from the ones cancelled while they waited."""
    store = postgres_store_factory(max_size=3)
    try:
        owner = "a" * 32
        await store.claim("k", encode_in_progress(owner, 1), ttl_ms=60_000)
        reads = [store.get("k") for _ in range(40)]
        claims = [
            store.claim(f"k{i}", encode_in_progress(owner, 1), ttl_ms=60_000) for i in range(20)
        ]
        results = await asyncio.gather(*reads, *claims)
        assert results[:40] == [encode_in_progress(owner, 1)] * 40
        assert results[40:] == [None] * 20
        assert store._pool.get_stats()["pool_size"] <= 3
        tasks = [asyncio.ensure_future(store.get("k")) for _ in range(30)]
        await asyncio.sleep(0)
        for task in tasks[::2]:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert store._slots._free == 3
        assert not store._slots._waiters
    finally:
        await store.aclose()


async def test_a_statement_that_finds_every_slot_taken_answers_unavailable_in_time(
    postgres_store_factory: Factory,
) -> None:
    """The pool's timeout bounds the wait for a slot: StoreUnavailable, then normal service."""
    store = postgres_store_factory(max_size=1, timeout=0.2)
    try:
        await store.get("warm")
        held = await store._checkout()
        try:
            with pytest.raises(StoreUnavailable, match="could not be reached during get"):
                await asyncio.wait_for(store.get("k"), 10)
        finally:
            await store._checkin(held)
        assert await store.get("k") is None
    finally:
        await store.aclose()
