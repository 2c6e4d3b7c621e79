"""redis-server processes a test can kill, stop and resume: replicas, and a Redis Cluster
with a replica per master that fails over for real. Loopback only."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis

from tests._loopback import free_port

__all__ = ["Cluster", "Node", "cluster", "until"]

#: Fast failure detection: a master silent for 1 s is failed over within a few seconds.
CLUSTER_OPTIONS = (
    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
    "--cluster-node-timeout", "1000",
    # A replica whose link was cut may still be promoted (the lost-acknowledgement case).
    "--cluster-replica-validity-factor", "0",
)  # fmt: skip


def until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Wait for ``check()``, polling; fail the test with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


class Node:
    """One redis-server on a fixed loopback port, with its own directory."""

    def __init__(self, workdir: Path, *options: str) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not on PATH; the tests need a real Redis")
        self.binary = binary
        self.port = free_port()
        self.workdir = workdir / str(self.port)
        self.workdir.mkdir(parents=True)
        self.options = options
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
             "--cluster-port", str(free_port()) if "--cluster-enabled" in self.options else "0",
             "--save", "", "--dir", str(self.workdir), "--repl-diskless-sync-delay", "0",
             *self.options, *extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        until(self.answers, f"redis-server on port {self.port} to start", 10)

    def answers(self) -> bool:
        with self.admin(timeout=0.5) as probe:
            return bool(probe.ping())

    def admin(self, timeout: float = 5.0) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=timeout, socket_connect_timeout=timeout)

    def role(self) -> str:
        with self.admin() as probe:
            return str(probe.info("replication")["role"])

    def kill(self) -> None:
        """SIGKILL: the process dies at once, with whatever it has not replicated."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def pause(self) -> None:
        """SIGSTOP: alive but silent (a stalled host), until :meth:`resume`."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """At the end of a test: SIGKILL (a primary's SIGTERM waits up to 10 s for replicas)."""
        self.kill()


def replica_online(master: Node, count: int = 1) -> bool:
    with master.admin() as probe:
        info: dict[str, Any] = probe.info("replication")
    online = [k for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
    return sum(info[k].get("state") == "online" for k in online) >= count  # type: ignore[no-any-return]


@contextmanager
def master_and_replica(tmp_path: Path, *options: str) -> Iterator[tuple[Node, Node]]:
    """A Redis with one replica attached and in sync."""
    master, replica = Node(tmp_path, *options), Node(tmp_path, *options)
    try:
        master.start()
        replica.start("--replicaof", "127.0.0.1", str(master.port))
        until(lambda: replica_online(master), "the replica to come online", 20)
        yield master, replica
    finally:
        replica.stop()
        master.stop()


class Cluster:
    """Three masters, each with one replica, created with ``redis-cli --cluster create``."""

    def __init__(self, nodes: list[Node]) -> None:
        self.nodes = nodes

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", n.port) for n in self.nodes]

    def alive(self) -> list[Node]:
        return [n for n in self.nodes if n.proc is not None]

    def by_port(self, port: int) -> Node:
        return next(n for n in self.nodes if n.port == port)

    def master_of(self, key: str) -> Node:
        """The node that serves ``key``'s slot now, as a live node sees it."""
        with self.alive()[0].admin() as probe:
            slot = int(probe.execute_command("CLUSTER", "KEYSLOT", key))
            for start, end, master, *_ in probe.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return self.by_port(int(master[1]))
        raise AssertionError(f"no node serves slot {slot}")

    def replicas_of(self, master: Node) -> list[Node]:
        with master.admin() as probe:
            info = probe.info("replication")
        ports = {int(v["port"]) for k, v in info.items() if k.startswith("slave")}
        return [self.by_port(p) for p in ports]

    def healthy(self) -> bool:
        """Every live node says ok, and every master has a replica in sync."""
        masters = 0
        for node in self.alive():
            with node.admin(timeout=1) as probe:
                if probe.cluster("info").get("cluster_state") != "ok":
                    return False
                if probe.info("replication")["role"] == "master":
                    masters += 1
                    if not replica_online(node):
                        return False
        return masters == 3

    def wait_healthy(self, timeout: float = 60.0) -> None:
        until(self.healthy, "the cluster to be ok with a replica per master", timeout)


@contextmanager
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A private 3-master, 3-replica Redis Cluster (AOF, ``appendfsync always``)."""
    if shutil.which("redis-cli") is None:
        pytest.fail("redis-cli is needed for the Cluster tests")
    options = (*CLUSTER_OPTIONS, "--appendonly", "yes", "--appendfsync", "always")
    nodes = [Node(tmp_path, *options) for _ in range(6)]
    with ExitStack() as stack:
        for node in nodes:
            node.start()
            stack.callback(node.stop)
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
             "--cluster-replicas", "1", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        built = Cluster(nodes)
        built.wait_healthy()
        yield built
