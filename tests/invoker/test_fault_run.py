"""The fault run of issue 34, as a marked long test: a plain tool never runs a key twice.

A plain tool (it honours no key) behind a faulty way in and out, on loopback: an answer
replaced by a gateway's 503 or 502 after the tool ran, an answer lost after it ran, a
request held past the client's read timeout before it reaches the tool (so a lookup in
the meantime says 404 while the request is still on its way), and a 503 before it ran.
Four agents (threads, one invoker each) send the same steps of one plan through one
shared SQLite journal, with ``reconcile=HttpLookup`` on and off. Counted on the server:
at most one execution per key. (Before: the 503s were resent, and a lookup's early 404
counted as "not run": 39 + 137 duplicates in a ten-minute run.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from agentkey import InvokeError, PlanSession, RetryPolicy, Step, ToolInvoker
from agentkey.journal import HttpLookup, SQLiteJournal
from tests._loopback import serve

pytestmark = pytest.mark.long

READ_TIMEOUT = 0.3
HOLD = 0.6  # past the read timeout
FAULTS = ("pass", "s503_after", "s502_after", "drop_after", "hold_before", "s503_before")
WEIGHTS = (50, 10, 10, 10, 10, 10)


class FaultyPlainTool:
    """``POST /tools/{name}`` runs (counted per key) unless a fault says otherwise;
    ``GET /lookup/{key}`` says whether it ran. Faults are drawn from a seeded Random."""

    def __init__(self, seed: int) -> None:
        self.runs: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.answers: dict[str, Any] = {}
        self.random = random.Random(seed)
        self.lock = threading.Lock()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        key = headers.get("idempotency-key", "")
        path, method = scope["path"], scope["method"]
        while (await receive()).get("more_body"):
            pass
        if method == "GET" and path.startswith("/lookup/"):
            found = self.answers.get(path.removeprefix("/lookup/"))
            await _send(send, 200 if found else 404, found or {"error": "no such call"})
            return
        if method != "POST":
            await _send(send, 204, None)  # OPTIONS: nothing says the route honours keys
            return
        with self.lock:
            fault = self.random.choices(FAULTS, WEIGHTS)[0]
            self.faults[fault] += 1
        if fault == "s503_before":
            await _send(send, 503, {"error": "upstream unavailable"})
            return
        if fault == "hold_before":
            await asyncio.sleep(HOLD)  # the client gave up; the request still arrives
        with self.lock:
            self.runs[key] += 1
            self.answers[key] = {"run": self.runs[key]}
        if fault == "s503_after":
            await _send(send, 503, {"error": "upstream reset"})
        elif fault == "s502_after":
            await _send(send, 502, {"error": "bad gateway"})
        elif fault == "drop_after":
            return  # the connection closes without an answer
        else:
            await _send(send, 201, self.answers[key])


async def _send(send: Any, status: int, body: Any) -> None:
    content = b"" if body is None else json.dumps(body).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": content})


def _agent(url: str, journal: Path, steps: list[Step], reconcile: bool, seed: int) -> list[str]:
    """One agent: its own invoker on the shared journal; each step once, in its own order."""
    order = list(steps)
    random.Random(seed).shuffle(order)
    ended: list[str] = []
    options: dict[str, Any] = {
        "route_template": "/tools/{tool}",
        "journal": SQLiteJournal(journal),
        "timeout": READ_TIMEOUT,
        "hooks": (),
        "retry": RetryPolicy(max_attempts=4, deadline=5.0, initial_backoff=0.01, max_backoff=0.1),
    }
    if reconcile:
        options["reconcile"] = HttpLookup("/lookup/{key}")
    with ToolInvoker(url, **options) as invoker:
        for step in order:
            try:
                invoker.invoke(step)
                ended.append("ok")
            except InvokeError as exc:  # noqa: PERF203 - one per step
                ended.append(type(exc).__name__)
    return ended


@pytest.mark.parametrize("reconcile", [False, True], ids=["plain", "reconcile"])
def test_four_agents_on_one_journal_never_run_a_key_twice(reconcile: bool, tmp_path: Path) -> None:
    """Faults after the effect, held requests, lost answers: executions per key <= 1."""
    tool = FaultyPlainTool(seed=34)
    plan = PlanSession.new()
    steps = [plan.step(n, "charge", {"amount": 100 + n}) for n in range(40)]
    journal = tmp_path / "journal.sqlite3"
    with serve(tool) as url, concurrent.futures.ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(_agent, url, journal, steps, reconcile, seed) for seed in range(4)]
        ended = Counter(e for run in runs for e in run.result(timeout=300))
    assert tool.runs, "the tool never ran"
    worst = max(tool.runs.values())
    assert worst <= 1, f"a key ran {worst} times; faults {dict(tool.faults)}, ended {ended}"
    assert sum(tool.faults[f] for f in FAULTS[1:]) > 0
