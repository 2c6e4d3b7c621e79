"""A cold worker during a PostgreSQL outage (issue 35): served within a second of the return.

A ``PostgresStore`` server whose first requests arrive while the database is stopped must
create its table first. That creation used a plain pool checkout, which waited out the
pool's whole ``timeout`` (psycopg_pool gives up reconnecting after 0.5 s), so the request
in flight when the database came back still answered 503 seconds later, and every request
waited for it. Each test stops and starts a real PostgreSQL of its own (``pg_ctl``).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import psycopg
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentkey.server import IdempotencyMiddleware, current_claim
from agentkey.server._postgres import PostgresStore
from tests._postgres import PostgresCluster, postgres_cluster
from tests.server._util import request_for, serve_closing

pytestmark = [pytest.mark.realtime, pytest.mark.timeout(180)]


class _Switch:
    """Stops and starts a cluster with ``pg_ctl``, with the options it was started with."""

    def __init__(self, cluster: PostgresCluster) -> None:
        self.cluster = cluster
        with open(os.path.join(cluster.datadir, "postmaster.opts")) as f:
            words = shlex.split(f.read())[1:]  # the postgres binary's own arguments
        keep = [w for i, w in enumerate(words) if w != "-D" and (i == 0 or words[i - 1] != "-D")]
        self.options = " ".join(shlex.quote(w) for w in keep)

    def _pg_ctl(self, *args: str, check: bool = True) -> int:
        c = self.cluster
        done = subprocess.run(
            [c.pg_ctl, "-D", c.datadir, "-l", c.logfile, *args],
            check=check, capture_output=True, timeout=90, user=c.run_as, env=c.env,
            cwd=os.path.dirname(c.datadir),
        )  # fmt: skip
        return done.returncode

    def stop(self) -> None:
        self._pg_ctl("-m", "fast", "-w", "-t", "60", "stop")

    def start(self) -> None:
        """Start the cluster; return once it accepts connections (``pg_ctl -w``)."""
        self._pg_ctl("-o", self.options, "-w", "-t", "60", "start")

    def ensure_up(self) -> None:
        if self._pg_ctl("status", check=False) != 0:  # 3: not running
            self.start()


@pytest.fixture(scope="module")
def cluster() -> Iterator[PostgresCluster]:
    with postgres_cluster() as found:
        yield found


@pytest.fixture
def switch(cluster: PostgresCluster) -> Iterator[_Switch]:
    """The module's cluster, up again after each test whatever happened in it."""
    switch = _Switch(cluster)
    yield switch
    switch.ensure_up()


@contextmanager
def _tool(dsn: str, **options: Any) -> Iterator[tuple[str, list[int]]]:
    """A tool server on a cold PostgresStore (its table not created yet), on loopback."""
    runs: list[int] = []

    async def charge(request: Request) -> JSONResponse:
        await request.json()
        current_claim().begin_mutation()
        runs.append(1)
        return JSONResponse({"charged": len(runs)}, status_code=201)

    store = PostgresStore(dsn, table="cold_" + uuid.uuid4().hex[:10], **options)
    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/charge", charge, methods=["POST"])]),
        store=store,
        shared_key_space=True,
    )
    with serve_closing(app, store) as url:
        yield url, runs


def _post(url: str, n: int) -> httpx.Response:
    headers, body = request_for({"n": n})
    return httpx.post(url + "/charge", headers=headers, content=body, timeout=60)


def _wait_until_up(dsn: str) -> float:
    """The monotonic time the database first accepts a connection (probed every 20 ms)."""
    for _ in range(3000):
        if _answers(dsn):
            return time.monotonic()
        time.sleep(0.02)
    raise AssertionError("the database did not come back")


def _answers(dsn: str) -> bool:
    try:
        psycopg.connect(dsn, connect_timeout=1).close()
    except psycopg.OperationalError:
        return False
    return True


def test_the_first_request_waiting_through_an_outage_is_served_when_the_database_is_back(
    switch: _Switch,
) -> None:
    """The request waiting in a cold worker's table creation at the return gets 201, not 503."""
    switch.stop()
    with _tool(switch.cluster.server.dsn, timeout=30) as (url, runs):
        answers: list[httpx.Response] = []
        first = threading.Thread(target=lambda: answers.append(_post(url, 0)))
        first.start()
        first.join(1.5)  # past psycopg_pool's 0.5 s of reconnection attempts
        assert first.is_alive()  # still waiting for the database
        starting = threading.Thread(target=switch.start)
        starting.start()
        back = _wait_until_up(switch.cluster.server.dsn)
        starting.join(90)
        first.join(60)
        served = time.monotonic() - back
    assert [a.status_code for a in answers] == [201], [a.text for a in answers]
    assert runs == [1]
    print(f"\ncold worker: the waiting request answered {served:.2f} s after the database was back")


def test_a_cold_worker_serves_after_the_database_return_and_prints_how_soon(
    switch: _Switch,
) -> None:
    """A cold worker serves a 2xx after the database's return; how soon (the issue's target
    is within 1 s; it was 3.4-3.8 s) is printed as a figure, never asserted: real elapsed
    time on a loaded machine is no test (the status-only test above is the discriminator)."""
    switch.stop()
    answered: list[tuple[float, float, int]] = []  # (sent, answered, status), monotonic
    stop = threading.Event()
    dsn = switch.cluster.server.dsn
    with _tool(dsn) as (url, _):

        def agent() -> None:
            n = 0
            while not stop.is_set():
                n += 1
                sent = time.monotonic()
                status = _post(url, n).status_code
                answered.append((sent, time.monotonic(), status))

        client = threading.Thread(target=agent)
        client.start()
        time.sleep(1.5)  # the first request waits in the table's creation
        starting = threading.Thread(target=switch.start)
        starting.start()
        back = _wait_until_up(dsn)
        starting.join(90)
        while not any(s < 300 for _, _, s in answered) and time.monotonic() - back < 30:
            time.sleep(0.01)
        stop.set()
        client.join(60)
    timeline = [(round(a - back, 2), round(b - back, 2), s) for a, b, s in answered]
    assert any(s < 300 for _, _, s in answered), timeline
    first_2xx = min(t for _, t, s in answered if s < 300) - back
    print(f"\ncold worker: first 2xx {first_2xx:.2f} s after the database was back", timeline)
