"""The journal's record of one call and its states: plain data, no I/O.

```
            begin (recorded before the first send)
                 │
                 ▼
             PENDING ──answer──▶ ANSWERED   the tool answered; the answer is kept
                 │   ──202─────▶ ACCEPTED   running on the tool; poll its status URL
                 │   ──refusal─▶ FAILED     a final error: the tool did not run it
                 │   ──nothing─▶ NOT_SENT   never reached the tool: safe to send
                 └───doubt─────▶ IN_DOUBT   sent, and no answer says whether it ran
```

A ``PENDING`` record whose owner is gone (the process died, or its lease ran
out) counts as ``IN_DOUBT``. A record is written before the request leaves,
so a process killed at any moment leaves the truth behind: either nothing was
sent, or the record says the call may have run.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FIELDS",
    "SETTLED",
    "Begun",
    "CallRecord",
    "CallState",
    "Evidence",
    "ended",
    "pending",
    "record_of",
    "recorded",
    "repeats_among",
    "route_of",
    "values_of",
]


class CallState(str, enum.Enum):
    """Where one call stands, as far as the client knows."""

    PENDING = "pending"  # recorded; being sent (or its sender died: then it is in doubt)
    ANSWERED = "answered"  # the tool answered (2xx); the answer is kept when small enough
    ACCEPTED = "accepted"  # the tool accepted it (202) and polling did not see it end
    FAILED = "failed"  # a final error answer: the tool refused it
    NOT_SENT = "not_sent"  # no attempt reached the tool
    IN_DOUBT = "in_doubt"  # it may have run: no answer says either way


#: States after which the call is settled: nothing about it is in doubt.
SETTLED = frozenset({CallState.ANSWERED, CallState.ACCEPTED, CallState.FAILED, CallState.NOT_SENT})


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One call as the journal keeps it.

    ``key`` is the full Idempotency-Key (the journal is the caller's own file or
    database; everything the journal prints shows a digest of it instead).
    ``route`` is ``"<METHOD> <origin><path>"`` (no query), the scope of what is
    learnt about whether the tool honours keys. ``call_id`` is the agent
    runtime's own id of the call (a model's tool call id), when an integration
    gave one; ``context`` names the turn of the conversation it was made in (the
    id of the user's message it answers). ``body`` is the answer's bytes when at most the journal's
    ``max_body_bytes``; ``body_size`` is its size either way.
    """

    key: str
    plan: str
    step: str | None
    tool: str | None
    args_hash: str | None
    route: str
    state: CallState = CallState.PENDING
    call_id: str | None = None
    context: str | None = None
    created_at: float = 0.0
    updated_at: float = 0.0
    owner: str | None = None
    lease_until: float = 0.0
    attempts: int = 0
    status_code: int | None = None
    outcome: str | None = None
    source: str | None = None
    error: str | None = None
    reason: str | None = None
    honoured: bool | None = None
    body: bytes | None = field(default=None, repr=False)
    body_size: int | None = None
    status_url: str | None = field(default=None, repr=False)

    def with_(self, **changes: Any) -> CallRecord:
        """A copy with ``changes`` applied."""
        values = list(_values(self))
        for name, value in changes.items():
            index = _INDEX.get(name)
            if index is None:
                raise TypeError(f"CallRecord has no field {name!r}")
            values[index] = value
        return record_of(values)

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON values (the body as text when it is UTF-8, else omitted)."""
        out: dict[str, Any] = {
            name: getattr(self, name) for name in self.__dataclass_fields__ if name != "body"
        }
        out["state"] = self.state.value
        if self.body is not None:
            try:
                out["body"] = self.body.decode("utf-8")
            except UnicodeDecodeError:
                out["body"] = None
        return out


#: The record's fields, in order (the SQL journals' column order too).
FIELDS: tuple[str, ...] = tuple(CallRecord.__dataclass_fields__)
#: All of a record's field values at once, in :data:`FIELDS` order.
_values = operator.attrgetter(*FIELDS)
#: Each field's place in :data:`FIELDS` (``with_`` builds its copy positionally).
_INDEX = {name: index for index, name in enumerate(FIELDS)}
# ``pending`` and ``ended`` below build records positionally: they hold this order.
assert FIELDS[6:14] == ("state", "call_id", "context", "created_at", "updated_at", "owner",
                        "lease_until", "attempts")  # fmt: skip
assert FIELDS[14:] == ("status_code", "outcome", "source", "error", "reason", "honoured",
                       "body", "body_size", "status_url")  # fmt: skip


def values_of(record: CallRecord) -> tuple[Any, ...]:
    """The record's field values, in :data:`FIELDS` order."""
    values: tuple[Any, ...] = _values(record)
    return values


#: Each field's slot, set directly by :func:`record_of` (the frozen ``__init__`` goes through
#: ``object.__setattr__`` for each of the 23 fields, twice what setting the slot costs).
_SLOTS = tuple(CallRecord.__dict__[name].__set__ for name in FIELDS)
_new = object.__new__


def record_of(values: Iterable[Any]) -> CallRecord:
    """The record of ``values`` (every field, in :data:`FIELDS` order): what
    ``CallRecord(*values)`` builds, made without the frozen ``__init__``. The client
    builds two records a journaled call; their values come from a record or from the
    flow's own call, never from outside."""
    record: CallRecord = _new(CallRecord)
    for put, value in zip(_SLOTS, values, strict=True):
        put(record, value)
    return record


def pending(
    key: str, plan: str, step: str | None, tool: str | None, args_hash: str | None, route: str,
    call_id: str | None, context: str | None, now: float, owner: str | None, lease_until: float,
) -> CallRecord:  # fmt: skip
    """A new call's ``PENDING`` record, made at ``now`` (nothing sent, no answer yet)."""
    return record_of(
        (key, plan, step, tool, args_hash, route, CallState.PENDING, call_id, context, now, now,
         owner, lease_until, 0, None, None, None, None, None, None, None, None, None)
    )  # fmt: skip


def ended(
    record: CallRecord, state: CallState, updated_at: float, attempts: int,
    status_code: int | None, outcome: str | None, source: str | None, error: str | None,
    reason: str | None, honoured: bool | None, body: bytes | None, body_size: int | None,
    status_url: str | None,
) -> CallRecord:  # fmt: skip
    """``record`` as its call ended: ``state`` and how (every field from ``attempts`` on is
    the call's end's); the call's identity, owner and lease are ``record``'s."""
    values = _values(record)
    return record_of(
        (*values[:6], state, *values[7:10], updated_at, values[11], values[12], attempts,
         status_code, outcome, source, error, reason, honoured, body, body_size, status_url)
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Begun:
    """What :meth:`Journal.begin` found: the existing record (None: this call's was written),
    whether that record's sender may still be sending it (``live``), and what is known
    about whether the record's route honours keys (``evidence``).

    ``earlier``: when ``begin`` was asked to look for repeats, the plan's records of
    the same tool and arguments under other keys (oldest first); when there are any,
    nothing was written. With ``known``, every such record, whatever its call id, once
    one of them is not among the ``known`` keys."""

    existing: CallRecord | None
    evidence: str | None
    live: bool = False
    earlier: tuple[CallRecord, ...] = ()


#: The Begun of a call whose record ``begin`` wrote, one per evidence (a Begun is frozen).
_RECORDED: dict[str | None, Begun] = {}


def recorded(evidence: str | None) -> Begun:
    """What ``begin`` found when it wrote the call's record: no other record, ``evidence``
    for the route. The usual begin of every fresh call: one shared value per evidence."""
    found = _RECORDED.get(evidence)
    if found is None:
        found = Begun(None, evidence)
        if len(_RECORDED) < 64:  # evidence names a marker; a journal's rows could hold more
            _RECORDED[evidence] = found
    return found


@dataclass(frozen=True, slots=True)
class Evidence:
    """What one route showed about honouring Idempotency-Key, as the journal keeps it.

    ``route`` is ``"<METHOD> <origin><path>"`` (:func:`route_of`): the method that
    showed it and nothing else. ``marker`` says how it was shown (``"protection
    header"``, ``"replay marker"``, a key problem answer). It counts from
    ``first_seen`` until ``expires_at``; seeing it again (``last_seen``) moves the
    expiry on. Times are Unix seconds.
    """

    route: str
    marker: str
    first_seen: float
    last_seen: float
    expires_at: float

    def to_dict(self) -> dict[str, Any]:
        """The evidence as JSON values."""
        return {
            "route": self.route,
            "marker": self.marker,
            "first_seen": self.first_seen,
            "last_seen": self.last_seen,
            "expires_at": self.expires_at,
        }


def repeats_among(
    record: CallRecord, found: Iterable[CallRecord], *, known: Collection[str] | None = None
) -> tuple[CallRecord, ...]:
    """The records of ``found`` that repeat ``record``: its plan, tool and arguments under
    another key, made without a runtime's call id; oldest first.

    With ``known`` (the keys of the identical calls the caller decided on, for an agent
    runtime's call): every identical record under another key, whatever its call id, when
    one of them is not in ``known`` (the caller then decides again); else none."""
    same = [
        r
        for r in found
        if r.key != record.key
        and (known is not None or r.call_id is None)
        and r.plan == record.plan
        and r.tool == record.tool
        and r.args_hash == record.args_hash
    ]
    if known is not None and all(r.key in known for r in same):
        return ()
    return tuple(sorted(same, key=lambda r: (r.created_at, r.key)))


def route_of(method: str, url: str) -> str:
    """``"<METHOD> <scheme>://<host>[:port]<path>"``: the URL without query or fragment."""
    base = url.split("#", 1)[0].split("?", 1)[0]
    return f"{method.upper()} {base}"
