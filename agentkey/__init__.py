"""agentkey: deterministic idempotency keys for the tool calls of AI agents.

The public surface is what ``__all__`` lists; every module behind it is private.
"""

from ._canonical import Profile, args_hash, canonical_json
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
    MissingExtra,
    OutcomeUnknown,
    PayloadMismatch,
    PollTimeout,
    StepFailed,
    StepInProgress,
    StoreError,
    StoreUnavailable,
    TokenError,
    ToolError,
    UnsafeRedirect,
)
from ._keys import HeaderStyle, StepKey, step_key
from ._plan import PlanSession, Step
from ._version import __version__

__all__ = [
    "AgentKeyError",
    "AuthError",
    "AuthenticationError",
    "ConfigurationError",
    "DelegationExpired",
    "HeaderStyle",
    "InsecureTransport",
    "InvalidArguments",
    "InvalidKey",
    "InvokeError",
    "KeyRejected",
    "MissingExtra",
    "OutcomeUnknown",
    "PayloadMismatch",
    "PlanSession",
    "PollTimeout",
    "Profile",
    "Step",
    "StepFailed",
    "StepInProgress",
    "StepKey",
    "StoreError",
    "StoreUnavailable",
    "TokenError",
    "ToolError",
    "UnsafeRedirect",
    "__version__",
    "args_hash",
    "canonical_json",
    "step_key",
]
