"""agentkey's client and `agentkey check` against six other idempotency servers.

Each peer (see ``_peers.py`` for what each sends) runs the counting tool on loopback
with its records in a real Redis; executions are counted in the tool itself.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import Counter

import pytest

from agentkey import (
    KeyRejected,
    Outcome,
    PayloadMismatch,
    PlanSession,
    Step,
    ToolResult,
)
from agentkey.testing import check_server
from tests._loopback import RedisServer

from ._peers import OTHER_ROUTE, PEERS, Peer, serve_peer
from ._support import DRIVERS, Called, Driver, invoke_all

pytestmark = [pytest.mark.redis, pytest.mark.parametrize("peer", PEERS, ids=lambda p: p.name)]
BURST = 4


def result(outcome: Called) -> ToolResult:
    assert isinstance(outcome, ToolResult), f"the call raised {outcome!r}"
    return outcome


def options(peer: Peer) -> dict[str, object]:
    """How agentkey's invoker is told about ``peer``: its key style and replay marker."""
    extra: dict[str, object] = {"key_header_style": peer.style}
    if peer.replay_headers is not None:
        extra["replay_headers"] = peer.replay_headers
    return extra


def step_of(tool: str, **args: object) -> Step:
    return PlanSession.new().step(0, tool, {"region": "eu-west-1", "gb": 20, **args})


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_resent_step_runs_once_and_says_how_it_was_answered(
    peer: Peer, redis_proc: RedisServer, driver: Driver
) -> None:
    """Fresh then resent: one execution; the resend is "replayed", or "answered" when the
    peer marks nothing; "executed" only once the answer or its route shows a run."""
    step, later = step_of("create_db"), step_of("create_db", gb=40)
    with serve_peer(peer, redis_proc) as served:
        first, again = (invoke_all(driver, served.url, [step], **options(peer))[0] for _ in "12")
        (third,) = invoke_all(driver, served.url, [later], **options(peer))
    # Only ichido marks a first run ("X-Ichido-Status: executed"); the others say nothing.
    runs = Outcome.EXECUTED if peer.name == "ichido" else Outcome.ANSWERED
    assert served.tool.executions() == 2
    if not peer.replays:
        assert result(first).outcome is runs
        assert isinstance(again, PayloadMismatch), f"the call gave {again!r}"
        assert again.attempts == 1  # final at once: never waited out as "in flight"
        return
    first, again, third = result(first), result(again), result(third)
    assert first.body == again.body
    if peer.replay_marker is None:  # it never shows whether it ran: never "executed"
        assert [r.outcome for r in (first, again, third)] == [Outcome.ANSWERED] * 3
    else:
        # The route marked a replay (the journal keeps that): its unmarked answers ran.
        assert [r.outcome for r in (first, again, third)] == [
            runs,
            Outcome.REPLAYED,
            Outcome.EXECUTED,
        ]
        name, value = peer.replay_marker
        replay = served.wire.on("/tools/create_db")[1]
        assert replay.headers.get(name, "").lower() == value
    seen = served.tool.seen_keys()
    assert seen == [step.key.header_value(peer.style), later.key.header_value(peer.style)]


def test_concurrent_duplicates_run_once(peer: Peer, redis_proc: RedisServer) -> None:
    """BURST invokes of one step at once, the tool held mid-run: one execution, one body."""
    step = step_of("provision")
    with serve_peer(peer, redis_proc) as served:
        gate = served.tool.gates["provision"] = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(invoke_all, "async", served.url, [step] * BURST, **options(peer))
            try:
                assert served.tool.entered("provision").wait(10)
                threading.Event().wait(0.3)  # the duplicates arrive while the first runs
            finally:
                gate.set()
            outcomes = future.result(timeout=60)
    if peer.races:
        # On a loaded machine a duplicate may lose the peer's race and run again: agentkey
        # must then say so, never call a second execution a replay.
        results = [result(o) for o in outcomes]
        assert sum(not r.replayed for r in results) == served.tool.executions() >= 1
        executed = [r.body for r in results if not r.replayed]
        assert all(r.body in executed for r in results)
        return
    assert served.tool.executions() == 1
    if not peer.replays:  # the duplicates wait out its 409s, then get its 422
        assert sum(isinstance(o, ToolResult) for o in outcomes) == 1
        assert sum(isinstance(o, PayloadMismatch) for o in outcomes) == BURST - 1
        return
    results = [result(o) for o in outcomes]
    assert all(r.body == results[0].body for r in results)
    if peer.replay_marker is not None:
        assert sorted(r.replayed for r in results) == [False] + [True] * (BURST - 1)
    statuses = {a.status for a in served.wire.on("/tools/provision")}
    assert statuses <= {201, 409} | ({500} if peer.torn_reads else set()), statuses


def test_another_body_under_a_used_key_is_refused_at_once(
    peer: Peer, redis_proc: RedisServer
) -> None:
    """The same key with changed args is PayloadMismatch after one attempt, where the peer
    fingerprints bodies; the tool does not run again."""
    if not peer.fingerprints:
        pytest.skip(f"{peer.name} keeps no fingerprint: it replays (see docs/protocol.md)")
    plan = PlanSession.new()
    step, changed = plan.step(0, "charge", {"amount": 5}), plan.step(0, "charge", {"amount": 7})
    with serve_peer(peer, redis_proc) as served:
        (first,) = invoke_all("sync", served.url, [step], **options(peer))
        (error,) = invoke_all(  # no journal: the peer decides (the journal would refuse it)
            "sync",
            served.url,
            [changed],
            idempotency_key=step.idempotency_key,
            journal=False,
            **options(peer),
        )
    assert not result(first).replayed
    assert isinstance(error, PayloadMismatch), f"the call gave {error!r}"
    assert (error.status_code, error.attempts) == (peer.mismatch_status, 1)
    assert served.tool.executions() == 1


def test_check_gives_a_fair_verdict(peer: Peer, redis_proc: RedisServer) -> None:
    """`agentkey check` in the peer's key style: no contract row fails but where the peer
    really breaks the draft (a replay for another body), and the burst ran once."""
    with serve_peer(peer, redis_proc) as served:
        served.tool.delay = 0.1
        report = check_server(
            served.url,
            path="/tools/check",
            other_path="/v2/tools/check",
            args={"region": "eu-west-1", "gb": 20},
            style=peer.style,
            concurrency=BURST,
            timeout=30,
        )
    table = report.table()
    assert report.no_verdict is None, table
    keyed = Counter((r.path, r.key) for r in served.tool.runs if r.key is not None)
    # One run per key and route, except where the peer itself replays another route's
    # answer (then that route never ran) or reads "k" and k as two keys (the styles row).
    assert max(keyed.values()) == 1, table
    failed = {r.name for r in report.results if r.scope == "contract" and r.verdict == "FAIL"}
    assert failed == peer.contract_fails, table
    assert report.ok is not bool(peer.contract_fails), table
    if OTHER_ROUTE in peer.contract_fails:  # it really answered /v2 with /tools' answer
        assert served.tool.executions("/v2/tools/check") == 0, table


def test_a_raw_key_to_a_uuid_only_server_is_key_rejected(
    peer: Peer, redis_proc: RedisServer
) -> None:
    """A server that refuses agentkey's raw key says why: KeyRejected at once, no execution."""
    if peer.style != "uuid":
        pytest.skip(f"{peer.name} accepts agentkey's raw keys")
    with serve_peer(peer, redis_proc) as served:
        (error,) = invoke_all("sync", served.url, [step_of("charge")])
    assert isinstance(error, KeyRejected), f"the call gave {error!r}"
    assert error.attempts == 1
    assert error.reason is not None
    assert "UUID" in error.reason
    assert served.tool.executions() == 0
