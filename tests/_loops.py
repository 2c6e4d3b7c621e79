"""Close the event loop a framework's sync entry point leaves behind.

``Agent.run_sync`` (PydanticAI) and ``Runner.run_sync`` (OpenAI Agents SDK) drive
their coroutine on the thread's current event loop, creating one when there is
none, and never close it. Garbage-collected later, inside whichever test runs
then, it raises "unclosed event loop" there (warnings are errors here).
"""

from __future__ import annotations

import asyncio
import warnings


def close_leftover_loop() -> None:
    """Close and unset the thread's current event loop, unless one is running."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return  # inside a loop (an async test): pytest-asyncio owns it
    policy = asyncio.get_event_loop_policy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: "no current event loop"
        try:
            loop = policy.get_event_loop()
        except RuntimeError:
            return
    if not loop.is_closed():
        loop.close()
    policy.set_event_loop(None)
