"""Both halves together: ToolInvoker and AsyncToolInvoker against the example server.

One scenario table, run on both drivers and on every store kind.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any

import pytest

from agentkey import (
    AsyncToolInvoker,
    PayloadMismatch,
    PlanSession,
    RetryPolicy,
    ToolInvoker,
    ToolResult,
)
from agentkey.auth import StaticToken
from agentkey.server import Store
from agentkey.testing import example_app
from tests.server._util import serve_closing

StoreFactory = Callable[[], Store]
RETRY = RetryPolicy(initial_backoff=0.05, max_backoff=0.2, deadline=30)


def _invoke_all(driver: str, url: str, calls: list[dict[str, Any]]) -> list[ToolResult]:
    """Run ``calls`` concurrently with the chosen driver; each is invoke(**call)."""
    if driver == "sync":
        with ToolInvoker(url, retry=RETRY, auth=StaticToken("agent-7")) as invoker:
            pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(calls))
            with pool:
                return list(pool.map(lambda call: invoker.invoke(**call), calls))

    async def run() -> list[ToolResult]:
        async with AsyncToolInvoker(url, retry=RETRY, auth=StaticToken("agent-7")) as invoker:
            return list(await asyncio.gather(*(invoker.invoke(**c) for c in calls)))

    return asyncio.run(run())


# (name, tool, how many identical invokes at once, expected executions)
SCENARIOS = [
    ("one call", "provision", 1, 1),
    ("three concurrent duplicates", "provision", 3, 1),
]


@pytest.mark.parametrize("driver", ["sync", "async"])
@pytest.mark.parametrize(
    ("tool", "copies", "executions"), [s[1:] for s in SCENARIOS], ids=[s[0] for s in SCENARIOS]
)
def test_invoker_and_middleware_run_each_step_once(
    make_store: StoreFactory, driver: str, tool: str, copies: int, executions: int
) -> None:
    """Concurrent invokes of one step run it once; the others wait out 409 and get the replay."""
    store = make_store()
    app = example_app(store, work_seconds=0.2, shared_key_space=False)
    step = PlanSession.new().step(0, tool, {"region": "eu-west-1"})
    with serve_closing(app, store) as url:
        results = _invoke_all(driver, url, [{"step": step, "path": f"/tools/{tool}"}] * copies)
        # A later resend of the same step, e.g. after an orchestrator restart: a replay.
        (later,) = _invoke_all(driver, url, [{"step": step, "path": f"/tools/{tool}"}])
    assert app.state.executions[tool] == executions
    assert sum(not r.replayed for r in results) == 1
    assert all(r.body == results[0].body for r in results)
    assert later.replayed
    assert later.body == results[0].body


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_key_for_other_args_is_a_payload_mismatch(make_store: StoreFactory, driver: str) -> None:
    """A key whose hash does not cover the body gets 422, which the invoker raises as final."""
    store = make_store()
    app = example_app(store, shared_key_space=False)
    plan = PlanSession.new()
    step = plan.step(0, "charge", {"amount": 5})
    wrong_key = plan.step(0, "charge", {"amount": 500}).idempotency_key
    call = {"step": step, "path": "/tools/charge", "idempotency_key": wrong_key}
    with serve_closing(app, store) as url, pytest.raises(PayloadMismatch):
        _invoke_all(driver, url, [call])
    assert app.state.executions["charge"] == 0
