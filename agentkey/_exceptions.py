"""Every error agentkey raises, in one tree.

```
AgentKeyError                      root: catch this to catch everything agentkey raises
├── ConfigurationError (ValueError)  an option or call argument is wrong; fix the code
│   └── MissingExtra (ImportError)     an optional extra is not installed, or too old
├── InvalidArguments (ValueError)    tool arguments cannot become canonical JSON
├── InvalidKey (ValueError)          a plan id, step index or Idempotency-Key is malformed
├── InvokeError                      a tool call did not give a usable result
│   ├── ToolError                      the tool answered with a final error
│   │   ├── ToolRejected                 4xx: the tool refused the request for its own reason
│   │   ├── KeyRejected                  400: the server rejected the key itself
│   │   └── PayloadMismatch              422 (or a mismatch 409): body and key disagree
│   │       └── KeyReused                  the key is bound to another tool or route
│   ├── StepInProgress                 409 until the retry budget ran out
│   ├── OutcomeUnknown                 in doubt: the step may have run, nothing says whether
│   ├── ToolUnreachable                no request reached the tool: the step did not run
│   ├── StepFailed                     an asynchronous operation reported failure
│   ├── PollTimeout                    the poll deadline passed; resume later
│   └── UnsafeRedirect                 a redirect or status URL leads to another origin
├── AuthError                        credentials could not be obtained or were refused
│   ├── TokenRejected (InvokeError)    the tool refused a freshly refreshed token
│   ├── TokenError                     the token endpoint answered with an error
│   │   └── DelegationExpired            the user's delegation cannot be renewed
│   └── InsecureTransport (ConfigurationError)  a bearer token would travel over plain http
├── StepRepeated                     the model asked again for a call that already succeeded
├── JournalError                     the client's journal failed or refused a write (``sent``
│                                      says whether the call was sent)
└── StoreError                       server side: the idempotency store failed
    ├── StoreUnavailable               the store cannot be reached
    └── LeaseLost                      another request took the key after this lease lapsed
```

A name in parentheses is a second parent: ``except InvokeError`` also catches
``TokenRejected``, and ``except ConfigurationError`` (or ``ValueError``)
also catches ``InsecureTransport``.

Every message says what happened, which key or step it concerns, and what
to do next. No message, ``str`` or ``repr`` ever contains a secret or token.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable

__all__ = [
    "AgentKeyError",
    "AuthError",
    "ConfigurationError",
    "DelegationExpired",
    "InsecureTransport",
    "InvalidArguments",
    "InvalidKey",
    "InvokeError",
    "JournalError",
    "KeyRejected",
    "KeyReused",
    "LeaseLost",
    "MissingExtra",
    "OutcomeUnknown",
    "PayloadMismatch",
    "PollTimeout",
    "StepFailed",
    "StepInProgress",
    "StepRepeated",
    "StoreError",
    "StoreUnavailable",
    "TokenError",
    "TokenRejected",
    "ToolError",
    "ToolRejected",
    "ToolUnreachable",
    "UnsafeRedirect",
]


class AgentKeyError(Exception):
    """Root of every error agentkey raises."""


class ConfigurationError(AgentKeyError, ValueError):
    """An option or argument given to agentkey is invalid."""


class MissingExtra(ConfigurationError, ImportError):
    """An optional extra is needed but not installed, or installed in a release too old.

    ``module`` names the missing (or old) package; ``installed`` is its installed version
    when it is there but too old, ``needed`` the lowest release agentkey works with.
    """

    def __init__(
        self,
        extra: str,
        module: str,
        *,
        installed: str | None = None,
        needed: str | None = None,
    ) -> None:
        self.extra = extra
        self.module = module
        self.installed = installed
        self.needed = needed
        if installed is None:
            message = (
                f"this feature needs the {module!r} package, which is not installed; "
                f"install it with: pip install 'agentkey-idempotency[{extra}]'"
            )
        elif needed is not None:
            message = (
                f"this feature needs {module} {needed} or newer, but {module} {installed} is "
                f"installed, which is too old; upgrade it with: "
                f"pip install --upgrade 'agentkey-idempotency[{extra}]'"
            )
        else:
            message = (
                f"this feature needs a release of {module} that agentkey supports; "
                f"{module} {installed} is installed but lacks what agentkey uses; "
                f"install a supported one with: pip install --upgrade "
                f"'agentkey-idempotency[{extra}]'"
            )
        super().__init__(message)


_DIST = "agentkey-idempotency"
_REQUIREMENT = re.compile(
    r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?\s*([^;]*)(?:;(.*))?"
)
_RELEASE = re.compile(r"\s*v?(\d+(?:\.\d+)*)")


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of ``version`` (``"1.1.5rc1"`` -> ``(1, 1, 5)``), zeros trimmed."""
    match = _RELEASE.match(version)
    parts = [int(part) for part in match.group(1).split(".")] if match else [0]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def too_old(
    extra: str, requires: Iterable[str], version_of: Callable[[str], str | None]
) -> tuple[str, str, str] | None:
    """The first package of ``extra`` installed below its floor: ``(name, installed, floor)``.

    ``requires`` are agentkey's Requires-Dist lines (``'langgraph>=1.1.5; extra ==
    "langgraph"'``), ``version_of`` gives a distribution's installed version or None. An
    extra that includes another (``agentkey-idempotency[server]``) is followed. Pure: the
    caller reads the installed metadata.
    """
    lines = list(requires)
    todo, seen = [extra], set()
    while todo:
        current = todo.pop(0)
        if current in seen:
            continue
        seen.add(current)
        for line in lines:
            match = _REQUIREMENT.fullmatch(line)
            if match is None:
                continue
            name, extras, spec, marker = match.groups()
            if not re.search(rf"""extra\s*==\s*["']{re.escape(current)}["']""", marker or ""):
                continue
            if name.lower().replace("_", "-") == _DIST:
                todo.extend(e.strip() for e in (extras or "").split(",") if e.strip())
                continue
            floor = re.search(r">=\s*([0-9][^,\s]*)", spec)
            installed = version_of(name)
            if floor and installed is not None and _release(installed) < _release(floor[1]):
                return name, installed, floor[1]
    return None


def missing_extra(extra: str, module: str, exc: ImportError | None = None) -> MissingExtra:
    """The :class:`MissingExtra` for an import of ``extra`` that failed with ``exc``.

    "Too old" when one of the extra's packages is installed below the floor agentkey's own
    metadata states; "lacks what agentkey uses" when ``module`` is installed but a name
    could not be imported from it; else "not installed".
    """
    from importlib import metadata  # here: ``import agentkey`` does not pay for it

    def version_of(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    try:
        requires = metadata.requires(_DIST) or []
    except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        requires = []
    old = too_old(extra, requires, version_of)
    if old is not None:
        return MissingExtra(extra, old[0], installed=old[1], needed=old[2])
    root = (exc.name or "").partition(".")[0] if exc is not None else ""
    if not root or sys.modules.get(root) is None:
        return MissingExtra(extra, module)  # the package itself could not be imported
    # A part of an installed package could not be imported: never say "not installed".
    dists = metadata.packages_distributions().get(root) or [root]
    same = [d for d in dists if re.sub(r"[-_.]+", "_", d).lower() == root.lower()]
    dist = (same or dists)[0]  # langgraph, not langgraph-prebuilt, for ``langgraph``
    installed = version_of(dist)
    if installed is None:
        return MissingExtra(extra, module)
    return MissingExtra(extra, dist, installed=installed)


class InvalidArguments(AgentKeyError, ValueError):
    """Tool arguments cannot be turned into canonical JSON.

    ``path`` names the offending value, for example ``args.items[2].price``.
    """

    def __init__(self, message: str, *, path: str) -> None:
        self.path = path
        super().__init__(f"{path}: {message}")


class InvalidKey(AgentKeyError, ValueError):
    """A plan session id, step index or Idempotency-Key is malformed."""


class InvokeError(AgentKeyError):
    """A tool call did not produce a usable result.

    Carries what a caller needs to decide what to do next: the
    ``idempotency_key`` and ``step`` it concerns, how many ``attempts`` were
    made, the last HTTP ``status_code`` seen (if any), the parsed ``body``
    of the last answer (if any) and the server's short ``reason`` (a problem
    ``detail``/``title`` or a JSON ``error``/``message``, cut and cleaned; never
    the key), which is what an agent's model should be shown.
    """

    def __init__(
        self,
        message: str,
        *,
        idempotency_key: str | None = None,
        step: str | None = None,
        attempts: int = 0,
        status_code: int | None = None,
        body: object = None,
        reason: str | None = None,
    ) -> None:
        self.idempotency_key = idempotency_key
        self.step = step
        self.attempts = attempts
        self.status_code = status_code
        self.body = body
        self.reason = reason
        super().__init__(message)


class ToolError(InvokeError):
    """The tool answered with a final error (a 4xx, or a replayed error)."""


class ToolRejected(ToolError):
    """The tool refused the request for a reason of its own (a 4xx about the request).

    A validation error or a business rule (``amount over limit``): ``reason``
    holds the server's words. Retrying the same step will not help; the agent
    has to change the arguments, which makes a new key.
    """


class KeyRejected(ToolError):
    """The server refused the Idempotency-Key itself (missing, malformed, wrong style).

    Raised only when the answer says the key is the problem: agentkey's own
    problem types, or a 400 that gives no other reason.
    """


class PayloadMismatch(ToolError):
    """The server says the body does not belong to the key.

    A 422 (the body does not hash to the key's args_hash), or a 409 whose
    problem type or error code says "mismatch" rather than "in flight".
    """


class KeyReused(PayloadMismatch):
    """The server bound this key to another operation (method and route, or tool).

    The stored answer belongs to a different tool, so it is never replayed. A
    plan that gives one step index to two tools causes this: give each tool
    call its own step.
    """


class StepInProgress(InvokeError):
    """The server kept answering 409 (same key in flight) until the budget ran out."""


class OutcomeUnknown(InvokeError):
    """The call is in doubt: it may have run, and no answer says whether it did.

    The error of a call in doubt (``CallState.IN_DOUBT`` in the journal, the server's
    ``in_doubt`` answer, ``Verdict.in_doubt()`` from a reconcile hook). Raised when the
    budget ran out after a failure in doubt (a read timeout, a reset, a 5xx), and when a
    request that may have run is not sent again because the tool is not known
    to honour Idempotency-Key. Against a tool that honours keys, resending later
    with the same ``idempotency_key`` is safe (the tool replays the stored
    outcome); against any other, find out whether it ran first. The journal keeps
    the call in doubt until it is settled.
    """


class ToolUnreachable(InvokeError):
    """No request of the call reached the tool (connection refused, DNS, connect timeout).

    The step did not run; calling again later, with the same step, is safe.
    """


class StepFailed(InvokeError):
    """An asynchronous (202) operation reported that it failed."""


class PollTimeout(InvokeError):
    """The poll deadline passed before the operation finished.

    ``status_url`` lets a caller resume polling later without re-sending
    the step.
    """

    def __init__(self, message: str, *, status_url: str, **kwargs: object) -> None:
        self.status_url = status_url
        super().__init__(message, **kwargs)  # type: ignore[arg-type]


class UnsafeRedirect(InvokeError):
    """A redirect or status URL points at an origin that is not allowed."""

    def __init__(self, message: str, *, url: str, **kwargs: object) -> None:
        self.url = url
        super().__init__(message, **kwargs)  # type: ignore[arg-type]


class AuthError(AgentKeyError):
    """Credentials could not be obtained, or the tool refused them."""


class TokenRejected(AuthError, InvokeError):
    """The tool answered 401 again after a token refresh."""


class TokenError(AuthError):
    """The token endpoint answered with an OAuth error.

    ``error`` and ``error_description`` are the endpoint's own words (RFC 6749
    section 5.2); they never contain a secret.
    """

    def __init__(
        self,
        message: str,
        *,
        error: str | None = None,
        error_description: str | None = None,
        status_code: int | None = None,
    ) -> None:
        self.error = error
        self.error_description = error_description
        self.status_code = status_code
        super().__init__(message)


class DelegationExpired(TokenError):
    """The user's delegated token expired and nothing can renew it.

    The user has to authorise the agent again.
    """


class InsecureTransport(AuthError, ConfigurationError):
    """A bearer token would be sent over plain http to a non-loopback host."""


class StepRepeated(AgentKeyError):
    """The model asked again for a call that already succeeded in this plan.

    Raised under the ``on_repeat="raise"`` policy. ``previous_step`` names the
    step that already ran, ``idempotency_key`` its key.
    """

    def __init__(
        self,
        message: str,
        *,
        tool: str,
        previous_step: str,
        idempotency_key: str,
    ) -> None:
        self.tool = tool
        self.previous_step = previous_step
        self.idempotency_key = idempotency_key
        super().__init__(message)


class JournalError(AgentKeyError):
    """The client's call journal failed, or refused to record something it cannot hold true.

    ``sent`` says whether the call it concerns may have reached the tool: False means
    nothing was sent (the call can be made again once the journal works); True means the
    tool may have run it, so its record is in doubt until someone settles it. The message
    says which call (its key as a digest, never whole), what happened and what to do.
    ``idempotency_key`` and ``step`` name the call when there is one.
    """

    def __init__(
        self,
        message: str,
        *,
        sent: bool,
        idempotency_key: str | None = None,
        step: str | None = None,
    ) -> None:
        self.sent = sent
        self.idempotency_key = idempotency_key
        self.step = step
        super().__init__(message)


class StoreError(AgentKeyError):
    """The server-side idempotency store failed."""


class StoreUnavailable(StoreError):
    """The idempotency store cannot be reached.

    During a claim the request is refused and not run; during a renewal or the
    write of an outcome the handler runs or ran, and its outcome may not be
    recorded yet (the middleware retries that write within its settle budget).
    """


class LeaseLost(StoreError):
    """Another request took the key after this request's lease lapsed.

    Not a store failure: the store works, and the step now belongs to the other
    request, so this one must not start its side effect. A ``StoreError`` for
    compatibility with code that catches ``StoreError`` around ``begin_mutation()``.
    """
