"""A key sent again with other arguments is never answered from the journal (issue 34).

``invoke(step_with_amount_2, idempotency_key=earlier_step.idempotency_key)``: the
journal holds the earlier call's answer under that key. Before, it returned that
answer (amount 1) as REPLAYED, never sent and never compared; the peers that
fingerprint bodies would have said "mismatch". Now the journal compares the
arguments' hash and refuses locally with PayloadMismatch, sending nothing. Against
real peers (each library's middleware in front of the counting tool, on Redis) and
agentkey's own middleware; executions counted on the server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentkey import PayloadMismatch, PlanSession, ToolResult
from agentkey.journal import CallState, SQLiteJournal
from tests._loopback import RedisServer

from ._peers import PEERS, Peer, serve_peer
from ._support import DRIVERS, Driver, Served, invoke_all, serve_agentkey

#: Peers with different handling of another body: one that fingerprints (422), one that
#: does not (it would replay the first answer), one with its own replay header.
CHOSEN = [
    p for p in PEERS if p.name in ("fastapi-idempotency", "asgi-idempotency-header", "ichido")
]


def _check(served: Served, driver: Driver, tmp_path: Path, **options: Any) -> None:
    journal = SQLiteJournal(tmp_path / "journal.sqlite3")
    plan = PlanSession.new()
    first = plan.step(0, "charge", {"amount": 1})
    second = plan.step(1, "charge", {"amount": 2})
    options.update(journal=journal, honours_keys=None)
    [done] = invoke_all(driver, served.url, [first], **options)
    assert isinstance(done, ToolResult), done
    sent = len(served.wire.answers)
    [again] = invoke_all(
        driver, served.url, [second], idempotency_key=first.idempotency_key, **options
    )
    assert isinstance(again, PayloadMismatch), again
    message = str(again)
    assert "other arguments" in message
    assert "not sent" in message
    assert first.idempotency_key not in message  # the key shows as a digest
    assert len(served.wire.answers) == sent  # nothing was sent
    assert served.tool.executions() == 1
    record = journal.get(first.idempotency_key)
    assert record is not None
    assert record.state is CallState.ANSWERED
    # The same key with its own arguments still gets its answer.
    [same] = invoke_all(driver, served.url, [first], **options)
    assert isinstance(same, ToolResult)
    assert same.body["args"] == {"amount": 1}
    assert served.tool.executions() == 1


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("peer", CHOSEN, ids=lambda p: p.name)
def test_a_peer_key_with_other_arguments_is_refused_not_answered_from_the_journal(
    peer: Peer, driver: Driver, redis_proc: RedisServer, tmp_path: Path
) -> None:
    """A peer's key sent with other args: PayloadMismatch, nothing sent, 1 execution
    (before: the first call's answer, REPLAYED from the journal)."""
    options: dict[str, Any] = {"key_header_style": peer.style}
    if peer.replay_headers is not None:
        options["replay_headers"] = peer.replay_headers
    with serve_peer(peer, redis_proc) as served:
        _check(served, driver, tmp_path, **options)


@pytest.mark.parametrize("driver", DRIVERS)
def test_agentkey_key_with_other_arguments_is_refused_before_sending(
    driver: Driver, redis_proc: RedisServer, tmp_path: Path
) -> None:
    """Behind agentkey's middleware too: refused locally, never sent (before: sent, 422)."""
    with serve_agentkey(redis_proc) as served:
        _check(served, driver, tmp_path)
