"""agentkey: deterministic idempotency keys for the tool calls of AI agents.

The public surface is what ``__all__`` lists; every module behind it is private.

``import agentkey`` loads only what keys need (canonical JSON, keys, the
exceptions). Everything else loads on first use of one of its names (PEP 562):
plans (pydantic), and the invoker, policies and hooks (httpx), so a program pays
for what it uses. Token providers live in :mod:`agentkey.auth`, the server half in
:mod:`agentkey.server`, and the protocol checker in :mod:`agentkey.testing`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._canonical import args_hash, canonical_json
from ._clock import Clock
from ._exceptions import (
    AgentKeyError,
    AuthError,
    ConfigurationError,
    DelegationExpired,
    InsecureTransport,
    InvalidArguments,
    InvalidKey,
    InvokeError,
    JournalError,
    KeyRejected,
    KeyReused,
    LeaseLost,
    MissingExtra,
    OutcomeUnknown,
    PayloadMismatch,
    PollTimeout,
    StepFailed,
    StepInProgress,
    StepRepeated,
    StoreError,
    StoreUnavailable,
    TokenError,
    TokenRejected,
    ToolError,
    ToolRejected,
    ToolUnreachable,
    UnsafeRedirect,
)
from ._keys import StepKey
from ._version import __version__

if TYPE_CHECKING:  # loaded on first use at run time: see _LAZY and __getattr__
    from ._plan import PlanSession, Step
    from .client._hooks import (
        AttemptEvent,
        CallEndEvent,
        CallStartEvent,
        GiveUpEvent,
        InvokeEvent,
        InvokeHook,
        LoggingHook,
        PollEvent,
        RepeatEvent,
        ReplayEvent,
        RetryEvent,
    )
    from .client._invoker import AsyncToolInvoker, Outcome, ToolInvoker, ToolResult
    from .client._policies import PollPolicy, RetryPolicy

# Public name -> the module that defines it, imported on first access.
_LAZY: dict[str, str] = {
    **dict.fromkeys(
        [
            "AttemptEvent",
            "CallEndEvent",
            "CallStartEvent",
            "GiveUpEvent",
            "InvokeEvent",
            "InvokeHook",
            "LoggingHook",
            "PollEvent",
            "RepeatEvent",
            "ReplayEvent",
            "RetryEvent",
        ],
        ".client._hooks",
    ),
    **dict.fromkeys(
        ["AsyncToolInvoker", "Outcome", "ToolInvoker", "ToolResult"], ".client._invoker"
    ),
    **dict.fromkeys(["PlanSession", "Step"], "._plan"),
    **dict.fromkeys(["PollPolicy", "RetryPolicy"], ".client._policies"),
}


if not TYPE_CHECKING:  # type checkers see the names above, and no catch-all for typos

    def __getattr__(name: str) -> Any:
        """Import a lazily loaded public name on first access (PEP 562), then keep it."""
        if name == "auth":  # the subpackage, an attribute since import agentkey once loaded it
            return importlib.import_module(".auth", __name__)
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value  # later accesses skip this function
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "AgentKeyError",
    "AsyncToolInvoker",
    "AttemptEvent",
    "AuthError",
    "CallEndEvent",
    "CallStartEvent",
    "Clock",
    "ConfigurationError",
    "DelegationExpired",
    "GiveUpEvent",
    "InsecureTransport",
    "InvalidArguments",
    "InvalidKey",
    "InvokeError",
    "InvokeEvent",
    "InvokeHook",
    "JournalError",
    "KeyRejected",
    "KeyReused",
    "LeaseLost",
    "LoggingHook",
    "MissingExtra",
    "Outcome",
    "OutcomeUnknown",
    "PayloadMismatch",
    "PlanSession",
    "PollEvent",
    "PollPolicy",
    "PollTimeout",
    "RepeatEvent",
    "ReplayEvent",
    "RetryEvent",
    "RetryPolicy",
    "Step",
    "StepFailed",
    "StepInProgress",
    "StepKey",
    "StepRepeated",
    "StoreError",
    "StoreUnavailable",
    "TokenError",
    "TokenRejected",
    "ToolError",
    "ToolInvoker",
    "ToolRejected",
    "ToolResult",
    "ToolUnreachable",
    "UnsafeRedirect",
    "__version__",
    "args_hash",
    "canonical_json",
]
