"""The rows of docs/server.md's table of Redis topologies that no other test backs: one Redis
with AOF across a restart, and min-replicas-to-write on a primary cut off from its replica."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from agentkey.server import RedisStore
from tests.server._apps import tool_app
from tests.server._nodes import Node, master_and_replica, until
from tests.server._util import request_for, serve_closing

pytestmark = pytest.mark.realtime


def test_aof_keeps_records_across_a_restart(tmp_path: Path) -> None:
    """appendonly yes, appendfsync always: a finished step is replayed after Redis restarts
    (SIGKILL, so nothing but the AOF survives), and the tool does not run again."""
    node = Node(tmp_path, "--appendonly", "yes", "--appendfsync", "always")
    node.start()
    try:
        headers, body = request_for({"aof": 1})
        store = RedisStore(node.url, prefix="aof")
        app = tool_app(store)
        with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
            assert client.post("/ok", headers=headers, content=body).status_code == 201
            node.kill()
            node.start()
            again = client.post("/ok", headers=headers, content=body)
        assert again.headers.get("idempotent-replayed") == "true"
        assert app.state.runs["ok"] == 1
    finally:
        node.stop()


def test_min_replicas_to_write_refuses_when_cut_off(tmp_path: Path) -> None:
    """With min-replicas-to-write 1, a primary whose replica stalled past the lag refuses the
    claim (NOREPLICAS): 503, the handler does not run; with the replica back it runs once."""
    options = ("--appendonly", "no", "--min-replicas-to-write", "1", "--min-replicas-max-lag", "1")
    with master_and_replica(tmp_path, *options) as (master, replica):
        store = RedisStore(master.url, prefix="minrep", replicas=0)  # Redis's guard alone
        app = tool_app(store)
        headers, body = request_for({"minrep": 1})
        with serve_closing(app, store) as url, httpx.Client(base_url=url, timeout=30) as client:
            replica.pause()
            try:
                with master.admin() as probe:
                    until(lambda: probe.info("replication")["min_slaves_good_slaves"] == 0,
                          "the primary to count its replica out", 15)  # fmt: skip
                refused = client.post("/ok", headers=headers, content=body)
            finally:
                replica.resume()
            with master.admin() as probe:
                until(lambda: probe.info("replication")["min_slaves_good_slaves"] == 1,
                      "the replica to count again", 15)  # fmt: skip
            ran = client.post("/ok", headers=headers, content=body)
        assert refused.status_code == 503
        assert ran.status_code == 201
        assert app.state.runs["ok"] == 1
