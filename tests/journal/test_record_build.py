"""The journal's positional record builders against the dataclass's own constructor."""

from __future__ import annotations

import pickle
from dataclasses import FrozenInstanceError, fields
from typing import Any

import pytest

from agentkey.journal import CallRecord, CallState
from agentkey.journal._records import FIELDS, ended, pending, record_of, recorded, values_of


def _distinct() -> tuple[Any, ...]:
    """A value for each field, no two alike (a field copied into another's place shows)."""
    out: list[Any] = []
    for i, f in enumerate(fields(CallRecord)):
        if f.name == "state":
            out.append(CallState.IN_DOUBT)
        elif f.name == "honoured":
            out.append(True)
        elif f.name == "body":
            out.append(b"body-%d" % i)
        elif f.name in ("created_at", "updated_at", "lease_until"):
            out.append(1000.0 + i)
        elif f.name in ("attempts", "status_code", "body_size"):
            out.append(i)
        else:
            out.append(f"{f.name}-{i}")
    return tuple(out)


def test_record_of_builds_what_the_constructor_builds_and_stays_frozen() -> None:
    """record_of(values) equals CallRecord(*values) field by field, and is as immutable."""
    values = _distinct()
    built, made = record_of(values), CallRecord(*values)
    assert built == made
    assert values_of(built) == values
    assert hash(built) == hash(made)
    assert repr(built) == repr(made)
    assert pickle.loads(pickle.dumps(built)) == made  # noqa: S301 - our own bytes
    with pytest.raises(FrozenInstanceError):
        built.state = CallState.ANSWERED  # type: ignore[misc]
    with pytest.raises(ValueError, match="shorter"):
        record_of(values[:-1])  # a value short is never a record


def test_pending_and_ended_equal_the_keyword_records_they_replace() -> None:
    """pending() is the keyword-built PENDING record; ended() is with_() of the end's fields."""
    made = CallRecord(
        key="k", plan="p", step="step_001", tool="t", args_hash="h", route="POST http://x/t",
        state=CallState.PENDING, call_id="c", context="ctx", created_at=5.0, updated_at=5.0,
        owner="o", lease_until=65.0,
    )  # fmt: skip
    built = pending("k", "p", "step_001", "t", "h", "POST http://x/t", "c", "ctx", 5.0, "o", 65.0)
    assert built == made
    base = record_of(_distinct())
    args = (CallState.ANSWERED, 9.5, 3, 201, "executed", "tool", "E", "r", False, b"{}", 2, "u")
    assert ended(base, *args) == base.with_(
        state=CallState.ANSWERED, updated_at=9.5, attempts=3, status_code=201, outcome="executed",
        source="tool", error="E", reason="r", honoured=False, body=b"{}", body_size=2,
        status_url="u",
    )  # fmt: skip
    assert FIELDS.index("attempts") == 13  # ended() sets every field from attempts on


def test_a_fresh_begin_shares_one_answer_per_evidence() -> None:
    """recorded() gives the same frozen Begun for the same evidence: nothing found, nothing live."""
    first = recorded("replay marker")
    assert first is recorded("replay marker")
    assert first.existing is None
    assert (first.evidence, first.live, first.earlier) == ("replay marker", False, ())
    assert recorded(None).evidence is None
