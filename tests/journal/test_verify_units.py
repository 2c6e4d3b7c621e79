"""The reconcile hooks' pure logic: how a lookup's answer becomes a verdict, and bad input.

The hooks run end to end against real servers in ``test_unhonoured.py``; this table pins
every branch of :meth:`HttpLookup.verdict` and of :class:`Verdict`'s constructors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from agentkey import ConfigurationError
from agentkey.client._effects import Answer, Failure, FailureKind
from agentkey.journal import HttpLookup, InDoubt, Verdict


def _answer(status: int, content: bytes = b"", **extra: Any) -> Answer:
    return Answer(status, {}, content, "http://127.0.0.1/lookup", **extra)


def _call(key: str = "plan-1:charge:" + "a" * 64) -> InDoubt:
    return InDoubt(
        idempotency_key=key,
        plan="plan-1",
        step="charge",
        tool="charge",
        args={"amount": 5},
        method="POST",
        url="http://127.0.0.1:8000/tools/charge?x=1",
        sent_at=0.0,
        attempts=1,
    )


def _says(value: bool | None) -> Callable[[Any], bool | None]:
    return lambda body: value


CASES: list[tuple[str, Answer | Failure, Callable[[Any], bool | None] | None, Verdict]] = [
    ("no answer", Failure(FailureKind.IN_DOUBT, "read timeout"), None,
     Verdict.in_doubt("the lookup failed (read timeout)")),
    ("404", _answer(404), None, Verdict.not_run()),
    ("410", _answer(410), None, Verdict.not_run()),
    ("500", _answer(500), None, Verdict.in_doubt("the lookup answered 500")),
    ("302", _answer(302), None, Verdict.in_doubt("the lookup answered 302")),
    ("oversize 200", _answer(200, oversize=True), None,
     Verdict.in_doubt("the lookup answered 200")),
    ("unreadable 200", _answer(200, unreadable="stacked codings"), None,
     Verdict.in_doubt("the lookup answered 200")),
    ("not JSON", _answer(200, b"{nope"), None,
     Verdict.in_doubt("the lookup's answer is not JSON")),
    ("not UTF-8", _answer(200, b"\xff\xfe\x00"), None,
     Verdict.in_doubt("the lookup's answer is not JSON")),
    ("empty 200", _answer(200, b"  "), None, Verdict.ran(None)),
    ("JSON 201", _answer(201, b'{"id": 7}'), None, Verdict.ran({"id": 7})),
    ("ran() True", _answer(200, b"[1]"), _says(True), Verdict.ran([1])),
    ("ran() False", _answer(200, b"[]"), _says(False), Verdict.not_run()),
    ("ran() None", _answer(200, b"[]"), _says(None),
     Verdict.in_doubt("the lookup's answer does not say")),
]  # fmt: skip


@pytest.mark.parametrize(("reply", "ran", "expected"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_a_lookup_answer_becomes_a_verdict(
    reply: Answer | Failure, ran: Callable[[Any], bool | None] | None, expected: Verdict
) -> None:
    """Each kind of lookup answer gives the verdict the docstring promises."""
    assert HttpLookup("/by-key/{key}", ran=ran).verdict(reply) == expected


def test_the_lookup_url_stays_on_the_tools_origin_and_encodes_values() -> None:
    """Placeholders are percent-encoded, and the path replaces the tool's path and query."""
    lookup = HttpLookup("/ops?key={key}&plan={plan}&step={step}&hash={args_hash}")
    url = lookup.url("http://127.0.0.1:8000/tools/charge?x=1", _call())
    assert url == (
        "http://127.0.0.1:8000/ops?key=plan-1%3Acharge%3A" + "a" * 64
        + "&plan=plan-1&step=charge&hash=" + "a" * 64
    )  # fmt: skip
    assert _call("opaque-key").args_hash is None


@pytest.mark.parametrize(
    "path",
    ["charges/{key}", "//evil.example/{key}", "http://evil.example/{key}", 7, "/x/{who}", "/{"],
)
def test_a_lookup_path_off_the_origin_or_with_unknown_placeholders_is_refused(path: Any) -> None:
    """A path that could leave the tool's origin, or names an unknown placeholder, is refused."""
    with pytest.raises(ConfigurationError, match="HttpLookup path"):
        HttpLookup(path)


def test_ran_must_be_a_function() -> None:
    """``ran=`` that is not callable is refused at construction."""
    with pytest.raises(ConfigurationError, match="ran must be a function"):
        HttpLookup("/by-key/{key}", ran=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("status", [True, "200", 302, 404, 199])
def test_a_ran_verdict_takes_a_successful_status(status: Any) -> None:
    """``Verdict.ran`` refuses a status that is not a 2xx int."""
    with pytest.raises(ConfigurationError, match="status"):
        Verdict.ran({}, status_code=status)


@pytest.mark.parametrize(
    ("body", "content"),
    [
        (None, b""),
        (b"raw", b"raw"),
        (bytearray(b"ba"), b"ba"),
        ({"a": "\u00e9"}, '{"a":"\u00e9"}'.encode()),
    ],
)
def test_a_verdict_body_becomes_bytes(body: Any, content: bytes) -> None:
    """The answer's body is kept as bytes, or JSON-encoded in UTF-8."""
    assert Verdict.ran(body).content() == content


def test_an_unknown_verdict_without_a_reason_has_none() -> None:
    """An empty reason is stored as None, so messages never show an empty pair of brackets."""
    assert Verdict.in_doubt().reason is None
    assert Verdict.in_doubt("x").reason == "x"
