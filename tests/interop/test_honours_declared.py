"""Declaring once that an origin honours keys (issue 37, item 5), against a real peer.

fastapi-idempotency 0.1.1 honours Idempotency-Key (it replays with
``Idempotent-Replayed: true``) but, like every FastAPI/Starlette app, answers the
invoker's ``OPTIONS`` probe with 405: it never shows the protection header. Served by
uvicorn on loopback, the wire in front of it loses the first answer after the tool ran.
Without a declaration the call ends OutcomeUnknown; with one for its origin or route,
the invoker resends the same key and gets the real answer; the tool runs once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from agentkey import Outcome, OutcomeUnknown, PlanSession, ToolResult
from agentkey.cli import main
from agentkey.journal._default import resolve_journal
from tests._loopback import RedisServer

from ._peers import PEERS, serve_peer
from ._support import Called, Served, invoke_all

pytestmark = pytest.mark.redis

PEER = next(p for p in PEERS if p.name == "fastapi-idempotency")
PYIDEMPOTENT = next(p for p in PEERS if p.name == "pyidempotent")
PATH = "/tools/charge"


@pytest.fixture
def served(redis_proc: RedisServer) -> Iterator[Served]:
    with serve_peer(PEER, redis_proc) as served:
        yield served


def lost_answer(served: Served, **options: Any) -> Called:
    """One charge whose first answer is lost after the tool ran, through a fresh invoker."""
    served.wire.lose[PATH] = "drop"
    step = PlanSession.new().step(0, "charge", {"amount": 5})
    options.setdefault("honours_keys", None)
    (called,) = invoke_all("sync", served.url, [step], **options)
    return called


def test_the_peer_answers_options_with_405_and_a_lost_answer_is_in_doubt(served: Served) -> None:
    """Undeclared: the probe gets 405, so the lost answer ends OutcomeUnknown (1 run, no resend)."""
    called = lost_answer(served)
    assert isinstance(called, OutcomeUnknown), called
    assert served.tool.executions() == 1
    assert [a.status for a in served.wire.answers] == [201, 405]
    assert "honours_keys={'http://127.0.0.1:" in str(called)  # the way out, for its origin


@pytest.mark.parametrize(
    "entry", ["{origin}", "{origin}/", "{origin}/tools/*", "{origin}/tools/charge"]
)
def test_a_declared_origin_or_route_gets_the_real_answer(served: Served, entry: str) -> None:
    """Declared by origin or route pattern: the same key is resent and the peer's replay is
    the answer (before: OutcomeUnknown); one execution on the server."""
    pattern = entry.format(origin=served.url.rstrip("/"))
    called = lost_answer(served, honours_keys={pattern: True})
    assert isinstance(called, ToolResult), called
    assert called.outcome is Outcome.REPLAYED
    assert called.body["execution"] == 1
    assert served.tool.executions() == 1
    assert called.attempts == 2


@pytest.mark.parametrize(
    "entry",
    [
        "{other_port}",  # the same host, another port
        "{localhost}",  # the same server by another name
        "{origin}/v2/tools/*",  # another path of the same origin
        "{origin}/tools/charge/*",  # below the path, not the path itself
        "{origin}/tools/char",  # a prefix of the path, not a pattern
    ],
)
def test_a_declaration_never_reaches_another_origin_or_route(served: Served, entry: str) -> None:
    """A declaration for another origin or path does not apply: OutcomeUnknown, one run."""
    origin = served.url.rstrip("/")
    port = int(origin.rsplit(":", 1)[1])
    pattern = entry.format(
        origin=origin,
        other_port=f"http://127.0.0.1:{port + 1}",
        localhost=f"http://localhost:{port}",
    )
    called = lost_answer(served, honours_keys={pattern: True})
    assert isinstance(called, OutcomeUnknown), called
    assert served.tool.executions() == 1


def test_a_route_declared_false_is_never_resent_under_a_true_origin(served: Served) -> None:
    """The most specific entry wins: the route's False over its origin's True."""
    origin = served.url.rstrip("/")
    called = lost_answer(served, honours_keys={origin: True, f"{origin}{PATH}": False})
    assert isinstance(called, OutcomeUnknown), called
    assert "honours_keys=False" in str(called)
    assert served.tool.executions() == 1


def test_a_dot_segment_route_is_declared_as_the_path_it_is_sent_to(served: Served) -> None:
    """A route template with ``x/..`` is sent (by httpx) to the charge route declared False:
    that False applies, not the origin's True (before: the unnormalised path matched only
    the origin, the lost answer was resent as honoured); one execution on the server."""
    origin = served.url.rstrip("/")
    called = lost_answer(
        served,
        honours_keys={origin: True, f"{origin}{PATH}": False},
        route_template="/tools/x/../{tool}",
    )
    assert isinstance(called, OutcomeUnknown), called
    assert "honours_keys=False" in str(called)
    assert served.tool.executions() == 1


def check(served: Served, *extra: str) -> int:
    """`agentkey check` against the served peer's charge route (in this process)."""
    argv = [
        "check", served.url, "--path", PATH, "--args", '{"amount": 1}',
        "--concurrency", "4", "--timeout", "30", *extra,
    ]  # fmt: skip
    return main(argv)


def test_a_remembered_check_is_believed_until_forgotten(
    served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    """`agentkey check --remember` passes and writes the route's evidence (7 days): a lost
    answer is then resent with the same key and replayed (before: OutcomeUnknown), the key
    runs once; forgotten, a lost answer is in doubt again."""
    served.tool.delay = 0.1  # the checker's burst arrives while the first request runs
    route = f"POST {served.url.rstrip('/')}{PATH}"
    assert check(served, "--remember") == 0
    assert f"remembered: {route} honours Idempotency-Key until " in capsys.readouterr().err
    journal = resolve_journal(None)
    assert journal is not None
    (evidence,) = [e for e in journal.evidence() if e.route == route]
    assert evidence.marker == "agentkey check passed"
    assert evidence.expires_at - evidence.last_seen == 7 * 86400.0
    # As `agentkey journal evidence --forget` does (another process sees it within a minute).
    assert journal.forget(route) is True
    served.tool.delay = 0.0
    assert isinstance(lost_answer(served), OutcomeUnknown)  # forgotten: not believed
    served.tool.delay = 0.1
    assert check(served, "--remember") == 0
    served.tool.delay = 0.0
    before = served.tool.executions()
    called = lost_answer(served)
    assert isinstance(called, ToolResult), called
    assert called.outcome is Outcome.REPLAYED
    assert called.attempts == 2
    assert served.tool.executions() == before + 1
    assert served.tool.seen_keys().count(called.idempotency_key) == 1


def test_a_check_that_fails_is_never_remembered(
    redis_proc: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """pyidempotent fails a contract row (it replays another route's answer): --remember
    writes nothing, and a lost answer there stays in doubt."""
    with serve_peer(PYIDEMPOTENT, redis_proc) as served:
        assert check(served, "--remember", "--other-path", "/v2/tools/charge") == 1
        assert "not remembered: the check did not pass" in capsys.readouterr().err
        journal = resolve_journal(None)
        assert journal is not None
        assert journal.evidence() == []
        assert isinstance(lost_answer(served), OutcomeUnknown)


def test_remember_days_are_checked_before_anything_is_sent(
    served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    """--remember-days 0 is a usage error (exit 2) before any request reaches the tool."""
    with pytest.raises(SystemExit) as exited:
        check(served, "--remember", "--remember-days", "0")
    assert exited.value.code == 2
    assert "--remember-days" in capsys.readouterr().err
    assert served.wire.answers == []
