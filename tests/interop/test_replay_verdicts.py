"""Honest replay verdicts against servers that mark no replays (issue 37, item 3).

pyidempotent (on the session's real Redis, served by uvicorn) never says whether an
answer ran the step or replayed it; idemgate neither (its exact answers are scripted
here: it does not install beside redis-py 8). Executions are counted in the tool. An
answer that shows nothing is "answered"; one that follows a 409/423 "in flight" for
the same key in the same invoke is the earlier attempt's outcome, "replayed", when the
tool is declared to mark no replays (``replay_headers=()``); where it may mark them, such an
answer could be a second run (a racing server), so it stays "answered".
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import threading

import pytest

from agentkey import Outcome, PlanSession, Step, ToolInvoker, ToolResult
from agentkey.testing import Reply, ScriptedTool, fast_retry_policy
from tests._loopback import RedisServer

from ._peers import PEERS, Peer, _pyidempotent, serve_peer
from ._support import Called, Wire, invoke_all

PYIDEMPOTENT = next(p for p in PEERS if p.name == "pyidempotent")
#: pyidempotent with its option ``wait_on_processing=False``: a duplicate of a request
#: still running gets its 409 at once (the default holds it up to 10 s).
NO_WAIT = Peer(
    "pyidempotent-no-wait",
    functools.partial(_pyidempotent, wait_on_processing=False),
    replay_marker=None,
)
BURST = 20


def result(outcome: Called) -> ToolResult:
    assert isinstance(outcome, ToolResult), f"the call raised {outcome!r}"
    return outcome


def step_of(tool: str) -> Step:
    return PlanSession.new().step(0, tool, {"amount": 5})


def wait_for_status(wire: Wire, path: str, status: int) -> None:
    """Block until the server has answered ``status`` on ``path`` (at most 10 s)."""
    seen = threading.Event()
    for _ in range(1000):
        if any(a.status == status for a in wire.on(path)):
            return
        seen.wait(0.01)
    raise AssertionError(f"the server never answered {status} on {path}")


@pytest.mark.redis
def test_pyidempotent_answers_with_default_replay_headers_are_never_executed(
    redis_proc: RedisServer,
) -> None:
    """With agentkey's default replay headers, pyidempotent's run and its replay both say
    "answered" (before: both "executed"), for one execution."""
    step = step_of("create_db")
    with serve_peer(PYIDEMPOTENT, redis_proc) as served:
        first, again = (result(invoke_all("sync", served.url, [step])[0]) for _ in "12")
    assert served.tool.executions() == 1
    assert first.body == again.body
    assert (first.outcome, again.outcome) == (Outcome.ANSWERED, Outcome.ANSWERED)
    assert not first.replayed
    assert not again.replayed


@pytest.mark.redis
def test_a_burst_of_duplicates_to_pyidempotent_never_says_executed(
    redis_proc: RedisServer,
) -> None:
    """20 invokes of one step at once against pyidempotent: 1 run on the server, and none
    of the 20 results says "executed" (before: all 20 did)."""
    step = step_of("provision")
    with serve_peer(PYIDEMPOTENT, redis_proc) as served:
        gate = served.tool.gates["provision"] = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(invoke_all, "async", served.url, [step] * BURST)
            try:
                assert served.tool.entered("provision").wait(10)
                threading.Event().wait(0.3)  # the duplicates arrive while the first runs
            finally:
                gate.set()
            results = [result(o) for o in future.result(timeout=60)]
    assert served.tool.executions() == 1
    assert all(r.body == results[0].body for r in results)
    outcomes = [r.outcome for r in results]
    assert outcomes.count(Outcome.EXECUTED) == 0, outcomes
    assert set(outcomes) <= {Outcome.ANSWERED, Outcome.REPLAYED}, outcomes


@pytest.mark.redis
@pytest.mark.parametrize(
    ("markers", "expected"),
    [((), Outcome.REPLAYED), (None, Outcome.ANSWERED)],
    ids=["replay_headers=()", "default replay headers"],
)
def test_an_answer_after_409_in_progress_is_never_executed(
    redis_proc: RedisServer, markers: tuple[str, ...] | None, expected: Outcome
) -> None:
    """A duplicate that got pyidempotent's 409 "in progress" and then its 201: "replayed"
    when the tool is declared to mark no replays, else "answered" (before: "executed");
    the first says "answered"; one execution."""
    step = step_of("charge")
    options = {} if markers is None else {"replay_headers": markers}
    with serve_peer(NO_WAIT, redis_proc) as served:
        gate = served.tool.gates["charge"] = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            first = pool.submit(invoke_all, "sync", served.url, [step], **options)
            try:
                assert served.tool.entered("charge").wait(10)
                second = pool.submit(invoke_all, "sync", served.url, [step], **options)
                wait_for_status(served.wire, "/tools/charge", 409)
            finally:
                gate.set()
            ran, duplicate = result(first.result(60)[0]), result(second.result(60)[0])
    assert served.tool.executions() == 1
    assert duplicate.body == ran.body
    assert duplicate.attempts >= 2  # the 409, then the stored answer
    assert (ran.outcome, duplicate.outcome) == (Outcome.ANSWERED, expected)


# idemgate 0.1.0's exact answers: no replay header, a dialect code on its refusals.
IDEMGATE_IN_FLIGHT = Reply(
    409,
    json={
        "error": {
            "code": "idempotency_in_progress",
            "message": "An identical request is still processing.",
        }
    },
)
IDEMGATE_OK = Reply(201, json={"charge_id": "ch_1"})


def test_idemgate_answer_after_its_in_progress_is_a_replay_and_a_plain_answer_is_not() -> None:
    """idemgate (declared to mark no replays): 201 after its 409 ``idempotency_in_progress``
    is "replayed"; a later 201 on the same route is "answered", not "executed"."""
    tool = ScriptedTool([IDEMGATE_IN_FLIGHT, IDEMGATE_OK, IDEMGATE_OK])
    plan = PlanSession.new()
    with ToolInvoker(
        "https://idemgate.test",
        client=tool.client(),
        retry=fast_retry_policy(),
        route_template="/tools/{tool}",
        hooks=(),
        journal=False,
        replay_headers=(),
    ) as invoker:
        after_409 = invoker.invoke(plan.step(0, "charge", {"amount": 5}))
        later = invoker.invoke(plan.step(1, "charge", {"amount": 7}))
    assert (after_409.outcome, later.outcome) == (Outcome.REPLAYED, Outcome.ANSWERED)
    assert after_409.attempts == 2
    assert json.loads(tool.requests[-1].content) == {"amount": 7}


def test_a_route_that_marked_a_replay_says_executed_after() -> None:
    """Once a route has marked a replay (``Idempotent-Replayed``), its unmarked answers
    ran the step: "executed"; before it marked one, "answered"."""
    ok = Reply(201, json={"ok": True})
    tool = ScriptedTool([ok, Reply(201, json={"ok": True}, replayed=True), ok])
    plan = PlanSession.new()
    with ToolInvoker(
        "https://marks.test",
        client=tool.client(),
        retry=fast_retry_policy(),
        route_template="/tools/{tool}",
        hooks=(),
        journal=False,
    ) as invoker:
        outcomes = [invoker.invoke(plan.step(i, "charge", {"n": i})).outcome for i in range(3)]
    assert outcomes == [Outcome.ANSWERED, Outcome.REPLAYED, Outcome.EXECUTED]
