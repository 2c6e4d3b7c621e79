"""The two drivers: run a flow's effects, synchronously or on asyncio. They never decide.

``run_sync`` and ``run_async`` hold the only next/send/throw loop of the client:
every flow (a tool call, a resumed poll) runs through one of them. What an
effect means is the ``carry`` function's business; a failure while carrying one
out is thrown into the flow, which reports it and re-raises.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar

__all__ = ["run_async", "run_sync"]

T = TypeVar("T")


def run_sync(flow: Generator[Any, Any, T], carry: Callable[[Any], Any]) -> T:
    """Run ``flow`` to its end, carrying out each effect with ``carry``."""
    try:
        effect = next(flow)
        while True:
            try:
                reply = carry(effect)
            except BaseException as exc:  # the flow reports how the call ended, and re-raises
                effect = flow.throw(exc)
                continue
            effect = flow.send(reply)
    except StopIteration as stop:
        result: T = stop.value
        return result
    finally:
        flow.close()


async def run_async(flow: Generator[Any, Any, T], carry: Callable[[Any], Awaitable[Any]]) -> T:
    """The asyncio twin of :func:`run_sync`: ``carry`` is awaited."""
    try:
        effect = next(flow)
        while True:
            try:
                reply = await carry(effect)
            except BaseException as exc:  # the flow reports how the call ended, and re-raises
                effect = flow.throw(exc)
                continue
            effect = flow.send(reply)
    except StopIteration as stop:
        result: T = stop.value
        return result
    finally:
        flow.close()
