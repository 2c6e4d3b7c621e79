"""The two drivers: run a flow's effects, synchronously or on asyncio. They never decide.

``run_sync`` and ``run_async`` hold the only next/send/throw loop of the client:
every flow (a tool call, a resumed poll, an MCP tool call, a token request and
the refresh around it) runs through one of them. What an effect means is the
``carry`` function's business; a failure while carrying one out is thrown into
the flow, which reports it and re-raises.

A front end builds its ``carry`` from a table of handlers, one per effect type
(:func:`carrier`, :func:`async_carrier`): the sync and async tables differ only
where the I/O does (sending, sleeping), and share the rest.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Generator, Mapping
from typing import Any, TypeAlias, TypeVar

__all__ = ["Handlers", "async_carrier", "carrier", "run_async", "run_sync"]

T = TypeVar("T")

#: What a front end does with each type of effect: the handler gets the effect, and its
#: result is sent back into the flow (awaited first, by :func:`async_carrier`).
Handlers: TypeAlias = Mapping[type, Callable[[Any], Any]]


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


def carrier(handlers: Handlers) -> Callable[[Any], Any]:
    """The ``carry`` of :func:`run_sync`: each effect goes to the handler of its type."""

    def carry(effect: Any) -> Any:
        return _handler(handlers, effect)(effect)

    return carry


def async_carrier(handlers: Handlers) -> Callable[[Any], Awaitable[Any]]:
    """The ``carry`` of :func:`run_async`: a handler's awaitable result is awaited."""

    async def carry(effect: Any) -> Any:
        result = _handler(handlers, effect)(effect)
        return (await result) if inspect.isawaitable(result) else result

    return carry


def _handler(handlers: Handlers, effect: Any) -> Callable[[Any], Any]:
    for kind in type(effect).__mro__:
        handler = handlers.get(kind)
        if handler is not None:
            return handler
    # A flow yielded an effect its front end does not carry: a bug in agentkey itself.
    raise TypeError(f"no handler for the effect {type(effect).__name__}")
