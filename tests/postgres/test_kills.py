"""Exactly once under SIGKILL: the handler's process dies at random points, retries settle it.

Each attempt runs in a forked process (the handler's process) that serves one
request through IdempotencyMiddleware on a PostgresStore. The first attempt of
each step SIGKILLs itself at a random point: before its write, after its write,
after complete() but before the COMMIT, or after the COMMIT. Retries with the same
key run in fresh processes until one answers. The charges table has no unique
constraint, so a repeated side effect would show as a second row.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
import traceback
from typing import Any

import httpx
import psycopg
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentkey import PlanSession
from agentkey.server import IdempotencyMiddleware, ServerOptions, current_claim
from agentkey.server._postgres import PostgresStore
from tests._postgres import PostgresServer

POINTS = ("before_write", "after_write", "before_commit", "after_commit")
TABLE = "kill_records"
LEASE = 0.2  # seconds: a dead handler's claim clears this fast


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _app(store: PostgresStore, kill_at: str) -> Any:
    async def charge(request: Request) -> JSONResponse:
        args = await request.json()
        claim = current_claim()
        if kill_at == "before_write":
            _die()
        async with store.transaction(claim) as tx:
            cur = await tx.connection.execute(
                "INSERT INTO kill_charges (step, amount) VALUES (%s, %s) RETURNING id",
                (claim.idempotency_key, args["amount"]),
            )
            row = await cur.fetchone()
            assert row is not None
            if kill_at == "after_write":
                _die()
            response = await tx.complete(JSONResponse({"charge_id": row[0]}, status_code=201))
            if kill_at == "before_commit":
                _die()
        if kill_at == "after_commit":
            _die()
        return response

    app = Starlette(routes=[Route("/charge", charge, methods=["POST"])])
    # Every side effect of this tool is in the transaction: a crash anywhere before its
    # commit changed nothing, so the key frees with the lease (on_mark: the claim never
    # says "may have started"). tests/recovery/test_server_kills.py kills the default.
    return IdempotencyMiddleware(
        app,
        store=store,
        options=ServerOptions(lock_ttl=LEASE, mutation_starts="on_mark"),
        shared_key_space=True,
    )


async def _attempt(dsn: str, key: str, body: bytes, kill_at: str) -> str:
    store = PostgresStore(dsn, table=TABLE, create=False, min_size=1, max_size=2)
    transport = httpx.ASGITransport(app=_app(store, kill_at))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            response = await client.post("/charge", headers={"idempotency-key": key}, content=body)
    finally:
        await store.aclose()
    if response.status_code in (409, 503):
        # 409: the dead handler's lease has not ended. 503: its transaction still holds
        # the record's row lock (PostgreSQL has not yet seen the client die) past the
        # store's lock_timeout. Either way the client retries with the same key.
        return "conflict"
    assert response.status_code == 201, response.text
    kind = "replayed" if response.headers.get("idempotent-replayed") == "true" else "executed"
    return f"{kind}:{response.json()['charge_id']}"


def _in_child(dsn: str, key: str, body: bytes, kill_at: str) -> tuple[int, str]:
    """Run one attempt in a forked process; (signal that killed it or 0, its answer)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the handler's process
        os.close(read_end)
        code = 0
        try:
            answer = asyncio.run(_attempt(dsn, key, body, kill_at))
            os.write(write_end, answer.encode())
        except BaseException:
            traceback.print_exc()  # the parent only sees the exit status
            code = 1
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        answer = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return os.WTERMSIG(status), answer
    assert os.WEXITSTATUS(status) == 0, f"attempt crashed: exit {os.WEXITSTATUS(status)}"
    return 0, answer


def _run(server: PostgresServer, kills: int, seed: int) -> None:
    rng = random.Random(seed)
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS kill_charges")
        conn.execute(f"DROP TABLE IF EXISTS {TABLE}")
        conn.execute("CREATE TABLE kill_charges (id serial PRIMARY KEY, step text, amount int)")
        conn.execute(PostgresStore(server.dsn, table=TABLE).schema_sql())
    plan = PlanSession.new()
    expected: dict[str, str] = {}
    outcome: dict[str, str] = {}
    for i in range(kills):
        step = plan.step(i, "charge", {"amount": i})
        point = rng.choice(POINTS)
        killed_by, _ = _in_child(server.dsn, step.idempotency_key, step.body, point)
        assert killed_by == signal.SIGKILL, f"step {i} was not killed at {point}"
        deadline = time.monotonic() + 30
        while True:
            killed_by, answer = _in_child(server.dsn, step.idempotency_key, step.body, "none")
            assert killed_by == 0
            if answer != "conflict":
                break
            assert time.monotonic() < deadline, f"step {i} stayed in progress"
            time.sleep(LEASE / 4)  # the dead handler's lease has not expired yet
        outcome[step.idempotency_key] = answer
        expected[step.idempotency_key] = "replayed" if point == "after_commit" else "executed"

    with psycopg.connect(server.dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT step, id FROM kill_charges").fetchall()
        records: dict[str, bytes] = dict(
            conn.execute(f"SELECT key, value FROM {TABLE}").fetchall()  # noqa: S608
        )
    charges: dict[str, list[int]] = {}
    for step_key, charge_id in rows:
        charges.setdefault(step_key, []).append(charge_id)
    duplicates = [k for k, ids in charges.items() if len(ids) > 1]
    assert duplicates == [], f"{len(duplicates)} duplicate side effects"
    completed = {k.split(":", 1)[1] for k, v in records.items() if bytes(v).startswith(b"C:")}
    assert completed == set(expected), "every step ends COMPLETED"
    assert [k for k in completed if k not in charges] == [], "steps complete without side effect"
    for key, answer in outcome.items():
        kind, charge_id = answer.split(":")
        assert kind == expected[key], (key, answer)
        assert charges[key] == [int(charge_id)]  # the answer names the one real charge


def test_thirty_kills_at_random_points(postgres_proc: PostgresServer) -> None:
    """30 SIGKILLs: no duplicate charge, no COMPLETED step without one, every retry settles."""
    _run(postgres_proc, 30, seed=13)


@pytest.mark.long
@pytest.mark.timeout(3600)
def test_four_hundred_kills_at_random_points(postgres_proc: PostgresServer) -> None:
    """400 SIGKILLs at random points: 0 duplicates, 0 completions without effect, all settle."""
    # 400, not 1,000: the longer run cost CI about 5 minutes for the same random points.
    _run(postgres_proc, 400, seed=1000)
