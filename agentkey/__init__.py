"""agentkey: deterministic idempotency keys for the tool calls of AI agents.

The public surface is what ``__all__`` lists; every module behind it is private.
"""

from ._canonical import Profile, args_hash, canonical_json
from ._checker import CheckReport, CheckResult, acheck_server, check_server
from ._exceptions import (
    AgentKeyError,
    AuthenticationError,
    AuthError,
    ConfigurationError,
    DelegationExpired,
    InsecureTransport,
    InvalidArguments,
    InvalidKey,
    InvokeError,
    KeyRejected,
    KeyReused,
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
    ToolError,
    ToolRejected,
    UnsafeRedirect,
)
from ._hooks import InvokeEvent, InvokeHook, LoggingHook, PollEvent, ReplayEvent, RetryEvent
from ._invoker import AsyncToolInvoker, Outcome, ToolInvoker, ToolResult
from ._keys import HeaderStyle, StepKey, step_key
from ._plan import PlanSession, Step
from ._policy import PollPolicy, RetryPolicy
from ._version import __version__
from .auth import ClientCredentials, OnBehalfOf, RefreshTokenGrant, StaticToken, TokenExchange

__all__ = [
    "AgentKeyError",
    "AsyncToolInvoker",
    "AuthError",
    "AuthenticationError",
    "CheckReport",
    "CheckResult",
    "ClientCredentials",
    "ConfigurationError",
    "DelegationExpired",
    "HeaderStyle",
    "InsecureTransport",
    "InvalidArguments",
    "InvalidKey",
    "InvokeError",
    "InvokeEvent",
    "InvokeHook",
    "KeyRejected",
    "KeyReused",
    "LoggingHook",
    "MissingExtra",
    "OnBehalfOf",
    "Outcome",
    "OutcomeUnknown",
    "PayloadMismatch",
    "PlanSession",
    "PollEvent",
    "PollPolicy",
    "PollTimeout",
    "Profile",
    "RefreshTokenGrant",
    "ReplayEvent",
    "RetryEvent",
    "RetryPolicy",
    "StaticToken",
    "Step",
    "StepFailed",
    "StepInProgress",
    "StepKey",
    "StepRepeated",
    "StoreError",
    "StoreUnavailable",
    "TokenError",
    "TokenExchange",
    "ToolError",
    "ToolInvoker",
    "ToolRejected",
    "ToolResult",
    "UnsafeRedirect",
    "__version__",
    "acheck_server",
    "args_hash",
    "canonical_json",
    "check_server",
    "step_key",
]
