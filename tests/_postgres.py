"""A throwaway PostgreSQL cluster on loopback for the tests (``initdb`` + ``pg_ctl``).

The binaries come from Debian's ``postgresql`` package (``/usr/lib/postgresql/<v>/bin``;
``.ci/run`` installs it when missing). The cluster lives in a temporary directory,
listens on a free 127.0.0.1 port only (no Unix socket), trusts local connections and
runs with ``fsync=off``: the tests kill clients, never the server, so durability
across a power cut is not what they measure.

PostgreSQL refuses to run as root. When the tests run as root (as CI does), the
cluster runs as the unprivileged ``nobody`` user: the data directory is created
and chowned to it, and ``initdb``/``pg_ctl`` are started with ``user=`` (a setuid
in the child, nothing installed or changed on the machine). As any other user the
cluster simply runs as that user.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from tests._loopback import free_port

__all__ = [
    "PostgresCluster",
    "PostgresServer",
    "find_pg_bin",
    "postgres_cluster",
    "postgres_proc",
    "postgres_server",
    "postgres_store_factory",
]


@dataclass(frozen=True)
class PostgresServer:
    """A private PostgreSQL cluster started for the test session."""

    host: str
    port: int

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@{self.host}:{self.port}/postgres"


def find_pg_bin() -> str | None:
    """The directory holding ``initdb`` and ``pg_ctl`` (newest Debian version first)."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for directory in candidates:
        if os.access(os.path.join(directory, "pg_ctl"), os.X_OK):
            return directory
    initdb = shutil.which("initdb")
    pg_ctl = shutil.which("pg_ctl")
    if initdb and pg_ctl:
        return os.path.dirname(pg_ctl)
    return None


@dataclass(frozen=True)
class PostgresCluster:
    """A running throwaway cluster the fault tests can restart and stop (``pg_ctl``)."""

    server: PostgresServer
    datadir: str
    logfile: str
    pg_ctl: str
    run_as: str | None
    env: dict[str, str]

    def restart(self, mode: str) -> None:
        """``pg_ctl restart -m <mode>`` (``fast`` or ``immediate``), waiting until it is up."""
        subprocess.run(
            [self.pg_ctl, "-D", self.datadir, "-l", self.logfile, "-m", mode, "-w", "-t", "60",
             "restart"],
            check=True, capture_output=True, timeout=90, user=self.run_as, env=self.env,
            cwd=os.path.dirname(self.datadir),
        )  # fmt: skip

    def postmaster_pid(self) -> int:
        """The postmaster's process id (the first line of ``postmaster.pid``)."""
        with open(os.path.join(self.datadir, "postmaster.pid")) as f:
            return int(f.readline())


@contextmanager
def postgres_server(*, durable: bool = False) -> Iterator[PostgresServer]:
    """Start a throwaway cluster on a free loopback port; stop and delete it afterwards.

    ``durable=True`` keeps ``fsync`` on (for benchmarks that should pay for commits).
    """
    with postgres_cluster(durable=durable) as cluster:
        yield cluster.server


@contextmanager
def postgres_cluster(*, durable: bool = False) -> Iterator[PostgresCluster]:
    """:func:`postgres_server`, with the handles to restart the cluster and find its pid."""
    bindir = find_pg_bin()
    if bindir is None:
        raise RuntimeError(
            "PostgreSQL server binaries (initdb, pg_ctl) were not found; the tests need a real "
            "PostgreSQL. On Debian: apt-get install postgresql (.ci/run does this)"
        )
    run_as: str | None = None
    if os.geteuid() == 0:
        run_as = "nobody"  # postgres refuses root; nobody exists on every Debian system
        entry = pwd.getpwnam(run_as)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="agentkey-pg-") as workdir:
        datadir = os.path.join(workdir, "data")
        logfile = os.path.join(workdir, "server.log")
        if run_as is not None:
            os.chmod(workdir, 0o755)  # noqa: S103 - nobody must reach its own data dir
            os.chown(workdir, entry.pw_uid, entry.pw_gid)
        env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
        subprocess.run(
            [os.path.join(bindir, "initdb"), "-D", datadir, "-U", "postgres",
             "--auth=trust", "--encoding=UTF8", "--no-sync"],
            check=True, capture_output=True, timeout=120, user=run_as, env=env, cwd=workdir,
        )  # fmt: skip
        options = (
            f"-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' "
            "-c max_connections=200 -c shared_buffers=32MB"
        )
        if not durable:
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        pg_ctl = os.path.join(bindir, "pg_ctl")
        started = subprocess.run(
            [pg_ctl, "-D", datadir, "-l", logfile, "-o", options, "-w", "-t", "60", "start"],
            capture_output=True, timeout=90, user=run_as, env=env, cwd=workdir,
        )  # fmt: skip
        try:
            if started.returncode != 0:
                log = open(logfile).read()[-2000:] if os.path.exists(logfile) else ""  # noqa: SIM115
                raise RuntimeError(f"PostgreSQL did not start on port {port}: {log}")
            deadline = time.monotonic() + 10
            while subprocess.run(
                [os.path.join(bindir, "pg_isready"), "-h", "127.0.0.1", "-p", str(port)],
                capture_output=True,
                check=False,
            ).returncode:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"PostgreSQL on port {port} is not accepting connections")
                time.sleep(0.05)
            server = PostgresServer("127.0.0.1", port)
            yield PostgresCluster(server, datadir, logfile, pg_ctl, run_as, env)
        finally:
            subprocess.run(
                [pg_ctl, "-D", datadir, "-m", "immediate", "-w", "stop"],
                capture_output=True, timeout=60, user=run_as, env=env, cwd=workdir, check=False,
            )  # fmt: skip


@pytest.fixture(scope="session")
def postgres_proc() -> Iterator[PostgresServer]:
    """A real PostgreSQL cluster for the whole session; missing binaries fail, never skip."""
    try:
        with postgres_server() as server:
            yield server
    except RuntimeError as exc:
        pytest.fail(str(exc))


@pytest.fixture
def postgres_store_factory(postgres_proc: PostgresServer) -> Callable[..., Any]:
    """Build PostgresStores, each on its own fresh table (the tests reuse record keys)."""
    from agentkey.server._postgres import PostgresStore

    def factory(**options: Any) -> PostgresStore:
        options.setdefault("table", f"t{uuid.uuid4().hex[:12]}")
        return PostgresStore(postgres_proc.dsn, **options)

    return factory
