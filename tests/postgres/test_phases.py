"""The atomic-phases worked example of docs/postgres.md, run as written on a real PostgreSQL."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from agentkey import PlanSession
from tests._postgres import PostgresServer

DOC = Path(__file__).resolve().parents[2] / "docs" / "postgres.md"
MARK = "# not run: needs a PostgreSQL server; tests/postgres/test_phases.py runs it"


def _example(dsn: str) -> dict[str, Any]:
    """Execute the page's worked example with DSN pointing at the test server."""
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text("utf-8"), re.DOTALL | re.MULTILINE)
    (code,) = [b for b in blocks if b.startswith(MARK)]
    namespace: dict[str, Any] = {"DSN": dsn, "__name__": "docs_postgres"}
    exec(compile(code, "docs/postgres.md[phases]", "exec"), namespace)  # noqa: S102
    return namespace


@pytest.fixture
def rides(postgres_proc: PostgresServer) -> str:
    """An empty rides table in the test server."""
    with psycopg.connect(postgres_proc.dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS rides")
        conn.execute(
            "CREATE TABLE rides (id serial PRIMARY KEY, origin text, status text, charge_id text)"
        )
    return postgres_proc.dsn


@pytest.mark.parametrize("crash", ["during the charge", "after the charged phase"])
async def test_a_retry_resumes_after_the_last_finished_phase(rides: str, crash: str) -> None:
    """A crash between phases: the retry resumes, so one ride and one charge exist, then replays."""
    ns = _example(rides)
    payments, store = ns["payments"], ns["store"]
    real_charge = payments.charge
    calls: list[str] = []

    async def charge(amount: int, *, idempotency_key: str) -> str:
        calls.append(idempotency_key)
        result: str = await real_charge(amount, idempotency_key=idempotency_key)
        if crash == "during the charge" and len(calls) == 1:
            raise httpx.ReadTimeout("the provider charged, but its answer was lost")
        return result

    payments.charge = charge
    if crash == "after the charged phase":
        # The process fails after the "charged" phase committed, before the final one.
        real_transaction = store.transaction
        opened: list[int] = []

        def transaction(claim: Any) -> Any:
            opened.append(1)
            if len(opened) == 3:
                raise RuntimeError("crash before the final phase")
            return real_transaction(claim)

        store.transaction = transaction
    step = PlanSession.new().step(0, "book_ride", {"origin": "SFO", "amount": 4200})
    transport = httpx.ASGITransport(app=ns["app"], raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            headers = {"idempotency-key": step.idempotency_key}
            first = await client.post("/rides", headers=headers, content=step.body)
            assert first.status_code == 500
            second = await client.post("/rides", headers=headers, content=step.body)
            assert second.status_code == 201, second.text
            third = await client.post("/rides", headers=headers, content=step.body)
        assert third.headers["idempotent-replayed"] == "true"
        assert third.json() == second.json()
    finally:
        await store.aclose()
    with psycopg.connect(rides, autocommit=True) as conn:
        rows = conn.execute("SELECT id, status, charge_id FROM rides").fetchall()
    assert rows == [(second.json()["ride_id"], "booked", second.json()["charge_id"])]
    assert len(payments.charges) == 1
    # Phase 1 never ran twice; the charge was repeated only when its phase had not committed.
    assert len(calls) == (2 if crash == "during the charge" else 1)


async def test_a_store_failure_after_a_phase_committed_is_not_answered_not_run(
    rides: str,
) -> None:
    """Phase 1 committed and the card was charged, then the store failed opening the next
    phase: the answer is 503 not_finished, never "not run" (the old code said not_run), and
    the retry with the same key resumes: one ride, one charge."""
    from agentkey import StoreUnavailable

    ns = _example(rides)
    payments, store = ns["payments"], ns["store"]
    real_transaction = store.transaction
    opened: list[int] = []

    def transaction(claim: Any) -> Any:
        opened.append(1)
        if len(opened) == 2:  # the charge's local phase: the database went away
            raise claim._note_unavailable(StoreUnavailable("PostgreSQL is down (test)"))
        return real_transaction(claim)

    store.transaction = transaction
    step = PlanSession.new().step(0, "book_ride", {"origin": "SFO", "amount": 4200})
    transport = httpx.ASGITransport(app=ns["app"], raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            headers = {"idempotency-key": step.idempotency_key}
            first = await client.post("/rides", headers=headers, content=step.body)
            second = await client.post("/rides", headers=headers, content=step.body)
    finally:
        await store.aclose()
    assert first.status_code == 503, first.text
    assert first.json()["error"] == "not_finished"
    assert second.status_code == 201, second.text
    assert len(payments.charges) == 1
    with psycopg.connect(rides, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM rides").fetchone() == (1,)
