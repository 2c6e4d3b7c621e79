"""The effects a flow yields and the replies it receives: the one vocabulary of the core.

A flow (``_flow``) is a generator. It yields an effect and receives what
carrying it out gave; the drivers (``_drive``) carry effects out and never
decide anything:

```
Outgoing   send this request            ─▶ Answer | Failure
Sleep      wait this long (0 included)  ─▶ None
Emit       give this event to the hooks ─▶ None
Journaled  one journal operation        ─▶ what the journal returned
Reconcile  ask the user's reconcile hook about a call in doubt ─▶ Verdict
```

Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from ..journal._verify import InDoubt

__all__ = [
    "Answer",
    "Effect",
    "Emit",
    "Failure",
    "FailureKind",
    "Journaled",
    "Outgoing",
    "Received",
    "Reconcile",
    "Sleep",
]


# Outgoing and Answer (and the flow's Call, Finished and CallContext) are made on every
# call, so they are not frozen: a frozen dataclass's __init__ sets each field through
# object.__setattr__, about 1.6k instructions a field (10k for six, 2.5k unfrozen), a
# third of what the invoker added over httpx. Nothing changes one once it is built.
@dataclass(slots=True)
class Outgoing:
    """One request the flow wants sent.

    ``same_origin`` requests go through the invoker's auth and the client's
    defaults; any other request is built bare: no auth, no client headers or
    cookies, no Idempotency-Key, and sent past the client's cookie jar (so
    another origin's cookies never land there, and never reach the tool).
    ``deadline`` bounds the whole exchange. It is on the clock of the flow that
    yields it (its injected clock): the driver hands that clock to ``_http``
    with the request, so the time left is read on one clock.
    """

    method: str
    url: str
    # Kept out of repr: user headers carry API keys, and error trackers record frame locals.
    headers: tuple[tuple[str, str], ...] = field(repr=False)
    content: bytes | None
    same_origin: bool
    deadline: float | None = None


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait ``seconds`` before the next effect (then send None back). Zero still yields
    to the event loop, so a caller's timeout can cancel a flow that never waits."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Emit:
    """Give ``event`` to every hook, in order (then send None back).

    A tool call's flow emits its ``InvokeEvent``s; a token request's flow its
    ``TokenEvent``s and the lines its driver writes to the logger. A flow never
    calls a hook or a logger itself.
    """

    event: Any


@dataclass(slots=True)  # not frozen: two or more on every journaled call (see Outgoing)
class Journaled:
    """Call ``op`` on the journal with ``args`` and ``kwargs`` (``a`` + ``op`` when async)."""

    op: str
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Reconcile:
    """Ask the user's reconcile hook whether the call in doubt ran (send back its Verdict)."""

    call: InDoubt
    hook: Any  # the user's callable


Effect: TypeAlias = Outgoing | Sleep | Emit | Journaled | Reconcile


class FailureKind(enum.Enum):
    """What a transport error says about whether the request reached the tool."""

    NOT_SENT = "not sent"  # connect error, connect or pool timeout: the tool never saw it
    IN_DOUBT = "in doubt"  # read/write timeout, reset, protocol error: it may have run
    UNSENDABLE = "unsendable"  # a URL from the tool that the HTTP client cannot parse


@dataclass(frozen=True, slots=True)
class Failure:
    """A request that produced no HTTP answer."""

    kind: FailureKind
    description: str  # "read timeout", "connection reset", ... (never a header or token)


@dataclass(slots=True)  # not frozen: built on every call (see Outgoing)
class Answer:
    """An HTTP answer, fully read. ``headers`` keys are lowercase."""

    status_code: int
    headers: Mapping[str, str]
    content: bytes
    url: str
    oversize: bool = False  # the body was over the invoker's max_response_bytes (not kept)
    unreadable: str | None = None  # why the body was refused unread (stacked codings, ...)
    #: The credentials the request carried (tokens, cookies, API keys in headers), longest
    #: first, or the function that finds them: only a message made from the answer needs
    #: them (read them through :attr:`sent_secrets`).
    secrets: tuple[str, ...] | Callable[[], tuple[str, ...]] = field(
        default=(), repr=False, compare=False
    )

    @property
    def sent_secrets(self) -> tuple[str, ...]:
        """The credentials the request carried: cut out of whatever the server says before
        any of it reaches an error. Found on first use (most answers are never quoted)."""
        found = self.secrets
        if callable(found):
            found = self.secrets = found()
        return found

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())


Received: TypeAlias = Answer | Failure
