"""The method every server-side bench shares: servers in their own processes, ABBA rounds.

- **Process split.** Each configuration runs under uvicorn (one worker, loopback) in a
  process of its own (:class:`Server`); the load comes from other processes
  (:class:`Load`), so neither side's CPU or GIL is counted in the other.
- **Interleaving.** All configurations of a block are up at once; each round loads them
  in a palindrome (``A B C C B A``: ABBA for two), so load that comes and goes on a shared
  machine hits every configuration alike. A round's ratio of B to A uses B's two slots
  against A's two slots; the tables give the median of the per-round ratios, their
  spread and N (rounds).
- **CPU per request** is read from the server process (``/proc/<pid>/stat``, utime +
  stime) before and after each slot, divided by the requests served in it.
- **The load generator is checked**: every slot records the load processes' own CPU
  time, and the ``loadgen`` rows run the fastest configuration with one and with two
  load processes: the same throughput means one was not the bottleneck.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import importlib.metadata
import importlib.util
import json
import multiprocessing
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
_TICK = os.sysconf("SC_CLK_TCK")

# --------------------------------------------------------------------------- machine


def commit() -> str:
    """The checkout's commit (``git rev-parse --short HEAD``), ``+dirty`` when a tracked file
    outside ``bench/results`` differs from it; ``unknown`` outside a git checkout.
    ``report.py`` compares it with the last commit of the code a bench measures, to mark
    figures older than that code."""

    def git(*args: str) -> str:
        command = ["git", *args]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)  # noqa: S603
        return done.stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        # Results written by an earlier bench of the same run are not code: not dirty.
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if changed else "")


def machine() -> dict[str, Any]:
    """What a reader needs to weigh the figures: CPU, cores, Python, packages, the commit,
    and the date and load average at the start (:func:`write_results` adds the end's)."""
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    names = ("uvicorn", "h11", "httptools", "uvloop", "starlette", "httpx", "httpcore", "anyio")
    versions = {name: _version(name) for name in (*names, "redis", "hiredis", "psycopg")}

    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "packages": versions,
        "sniffio_installed": importlib.util.find_spec("sniffio") is not None,
        "commit": commit(),
        "date_at_start": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "loadavg_at_start": list(os.getloadavg()),
    }


def load_line(at_start: Mapping[str, Any]) -> str:
    """``commit 1a2b3c4, load average 3.1 at start, now 3.4``: printed with every table."""
    now = os.getloadavg()[0]
    return (
        f"commit {at_start.get('commit', 'unknown')}, load average "
        f"{at_start['loadavg_at_start'][0]:.1f} at start, {now:.1f} now"
    )


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def write_results(
    name: str, payload: dict[str, Any], out: Path | None, at_start: dict[str, Any]
) -> Path:
    """Write ``bench/results/<name>.json`` (or ``out``): ``at_start`` is :func:`machine`'s
    answer when the run began (commit, start date and load); the date is the run's end,
    and the load average at the end is added. The commit is also at the top level."""
    path = out or RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "bench": f"bench/bench_{name.split('-')[0]}.py",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": at_start.get("commit", "unknown"),
        "machine": dict(at_start),
        **payload,
    }
    data["machine"]["loadavg_at_end"] = list(os.getloadavg())
    path.write_text(json.dumps(data, indent=2) + "\n", "utf-8")
    print(load_line(at_start))
    return path


# --------------------------------------------------------------------------- statistics


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and interquartile range of per-round values."""
    ordered = sorted(values)
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return {
        "median": round(statistics.median(ordered), 3),
        "min": round(ordered[0], 3),
        "max": round(ordered[-1], 3),
        "iqr": [round(q1, 3), round(q3, 3)],
    }


def fmt(s: Mapping[str, Any]) -> str:
    """``0.62x (0.58-0.66)``: the median and the interquartile range."""
    return f"{s['median']:.2f}x ({s['iqr'][0]:.2f}-{s['iqr'][1]:.2f})"


def palindrome(names: Sequence[str]) -> list[str]:
    """``A B C`` -> ``A B C C B A``: each configuration sits as early as it sits late."""
    return [*names, *reversed(names)]


# --------------------------------------------------------------------------- processes


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) the process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Server:
    """One uvicorn process (one worker, loopback) serving ``app`` as ``config``,
    from the project's tree at ``root`` (this checkout unless told otherwise)."""

    config: str
    env: Mapping[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    app: str = "bench._apps:app"  # the app factory uvicorn imports
    root: Path = ROOT

    def start(self) -> None:
        env = {**os.environ, **self.env, "BENCH_APP": self.config, "PYTHONPATH": str(self.root)}
        command = [sys.executable, "-m", "uvicorn", self.app, "--factory"]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        command += ["--lifespan", "off", "--log-level", "warning", "--no-access-log"]
        command += ["--loop", "asyncio", "--http", "h11"]  # the figures of record: no uvloop
        command += ["--timeout-keep-alive", "3600"]  # the load keeps its connections
        self.process = subprocess.Popen(command, env=env, cwd=self.root)  # noqa: S603

    def wait_ready(self, timeout: float = 30.0) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while not self._accepts():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {self.config!r} server did not start")
            time.sleep(0.05)

    def _accepts(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
        except OSError:
            return False
        return True

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextmanager
def servers(
    configs: Sequence[str], env: Mapping[str, str], app: str = "bench._apps:app"
) -> Iterator[dict[str, Server]]:
    """Start one server process per configuration (in parallel); stop them all at the end."""
    started = {name: Server(name, env, app=app) for name in configs}
    try:
        for server in started.values():
            server.start()
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.stop()


# --------------------------------------------------------------------------- load

BODY = b'{"amount":100}'
_HASH = hashlib.sha256(BODY).hexdigest()
_HEAD = (
    b"POST /tools/charge HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\nidempotency-key: " % len(BODY)
)
_TAIL = b"\r\n\r\n" + BODY


#: Replay markers the load counts: agentkey's (and Stripe's), and idemkit's default mode.
_REPLAYED = (b"\r\nidempotent-replayed: true", b"\r\nidempotency-replayed: true")


class _Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection: write a request, wait for its whole answer."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.waiter: asyncio.Future[tuple[int, bool]] | None = None
        self.transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0 or self.waiter is None:
            return
        head = bytes(self.buffer[:end]).lower()
        at = head.find(b"\r\ncontent-length:")
        if at >= 0:
            stop = head.find(b"\r\n", at + 2)
            length = int(head[at + 17 : stop if stop > 0 else len(head)])
        elif b"\r\ntransfer-encoding: chunked" in head:  # idemkit's replays
            last = self.buffer.find(b"0\r\n\r\n", end + 4)
            if last < 0:
                return
            length = last + 5 - (end + 4)
        else:
            self.waiter.set_exception(RuntimeError(f"no content-length in {head[:200]!r}"))
            return
        if len(self.buffer) < end + 4 + length:
            return
        del self.buffer[: end + 4 + length]
        waiter, self.waiter = self.waiter, None
        replayed = any(marker in head for marker in _REPLAYED)
        waiter.set_result((int(head[9:12]), replayed))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("the server closed the connection"))

    async def send(self, key: bytes) -> tuple[int, bool]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(_HEAD + key + _TAIL)
        return await self.waiter


class _Pools:
    """A load process's keep-alive connections per server port, reused from slot to slot.

    Connections are opened (and a replay key run once) by ``prepare``, before the parent
    reads the server's CPU, so a slot's CPU holds requests only.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.conns: dict[int, list[_Conn]] = {}
        self.replay_keys: dict[int, bytes] = {}

    def handle(self, op: str, **args: Any) -> dict[str, Any]:
        if op == "prepare":
            return self.loop.run_until_complete(self.prepare(**args))
        return self.loop.run_until_complete(self.slot(**args))

    async def prepare(self, port: int, mode: str, connections: int) -> dict[str, Any]:
        pool = [c for c in self.conns.get(port, []) if not c.closed]
        while len(pool) < connections:
            _, conn = await self.loop.create_connection(_Conn, "127.0.0.1", port)
            pool.append(conn)
        self.conns[port] = pool
        if mode == "replay":  # a new key, run once now: every request of the slot replays it
            key = f"{uuid.uuid4().hex[:20]}:step_000:{_HASH}".encode()
            status, _ = await pool[0].send(key)
            if status != 201:
                raise RuntimeError(f"the first run of the replay key answered {status}")
            self.replay_keys[port] = key
        return {}

    async def slot(self, port: int, mode: str, connections: int, seconds: float) -> dict[str, Any]:
        loop = self.loop
        conns = self.conns[port][:connections]
        plan = uuid.uuid4().hex[:20]
        replay_key = self.replay_keys.get(port, b"")
        counts = {"requests": 0, "errors": 0, "replayed": 0}
        statuses: dict[int, int] = {}

        async def drive(index: int, conn: _Conn, end: float) -> None:
            step = 0
            prefix = f"{plan}-{index}:step_".encode()
            suffix = f":{_HASH}".encode()
            while loop.time() < end:
                key = replay_key if mode == "replay" else prefix + b"%03d" % step + suffix
                step += 1
                status, replayed = await conn.send(key)
                counts["requests"] += 1
                counts["replayed"] += replayed
                if status != 201:
                    counts["errors"] += 1
                    statuses[status] = statuses.get(status, 0) + 1

        cpu = time.process_time()
        started = time.perf_counter()
        end = loop.time() + seconds
        await asyncio.gather(*(drive(i, c, end) for i, c in enumerate(conns)))
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu
        return {**counts, "elapsed": elapsed, "cpu": cpu, "statuses": statuses}


def _worker(pipe: Connection) -> None:
    pools = _Pools()
    while True:
        command = pipe.recv()
        if command is None:
            return
        try:
            pipe.send(pools.handle(**command))
        except Exception as exc:  # reported to the parent, which raises
            pipe.send({"failed": f"{type(exc).__name__}: {exc}"})


class Load:
    """Load-generator processes (an asyncio HTTP/1.1 client each, pre-built requests)."""

    def __init__(self, processes: int = 1) -> None:
        context = multiprocessing.get_context("spawn")
        self.pipes: list[Connection] = []
        self.procs: list[Any] = []
        for _ in range(processes):
            ours, theirs = context.Pipe()
            proc = context.Process(target=_worker, args=(theirs,), daemon=True)
            proc.start()
            self.pipes.append(ours)
            self.procs.append(proc)

    def _ask(self, commands: list[dict[str, Any]]) -> list[dict[str, Any]]:
        pipes = self.pipes[: len(commands)]
        for pipe, command in zip(pipes, commands, strict=True):
            pipe.send(command)
        parts = [pipe.recv() for pipe in pipes]
        failed = [p["failed"] for p in parts if "failed" in p]
        if failed:
            raise RuntimeError(f"the load generator failed: {failed[0]}")
        return parts

    def _shares(self, connections: int, processes: int) -> list[int]:
        return [connections // processes + (i < connections % processes) for i in range(processes)]

    def prepare(self, port: int, mode: str, connections: int, processes: int = 1) -> None:
        """Open the connections (and run the replay key once) before anything is measured."""
        self._ask(
            [
                {"op": "prepare", "port": port, "mode": mode, "connections": n}
                for n in self._shares(connections, processes)
            ]
        )

    def run(
        self, port: int, mode: str, connections: int, seconds: float, processes: int = 1
    ) -> dict[str, Any]:
        """Load ``port`` for ``seconds`` over ``connections`` split across ``processes``."""
        parts = self._ask(
            [
                {"op": "slot", "port": port, "mode": mode, "connections": n, "seconds": seconds}
                for n in self._shares(connections, processes)
            ]
        )
        return {
            "requests": sum(p["requests"] for p in parts),
            "errors": sum(p["errors"] for p in parts),
            "replayed": sum(p["replayed"] for p in parts),
            "elapsed": max(p["elapsed"] for p in parts),
            "load_cpu": max(p["cpu"] for p in parts),  # the busiest load process
            "statuses": [p["statuses"] for p in parts if p["statuses"]],
        }

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for proc in self.procs:
            proc.join(timeout=10)


@dataclass
class Slot:
    """One configuration loaded once: what the load saw and what the server spent."""

    requests: int
    elapsed: float
    server_cpu: float
    load_cpu: float
    other_cpu: float  # a service the server uses (redis-server), when one is watched

    @property
    def rps(self) -> float:
        return self.requests / self.elapsed


def measure(
    load: Load,
    server: Server,
    mode: str,
    connections: int,
    seconds: float,
    *,
    processes: int = 1,
    watch: int | None = None,
) -> Slot:
    """Run one slot against ``server``; fail loudly on any unexpected answer."""
    load.prepare(server.port, mode, connections, processes)
    before = proc_cpu(server.pid)
    other = proc_cpu(watch) if watch else 0.0
    got = load.run(server.port, mode, connections, seconds, processes)
    server_cpu = proc_cpu(server.pid) - before
    other = (proc_cpu(watch) - other) if watch else 0.0
    if got["errors"]:
        raise RuntimeError(f"{server.config} answered non-201s: {got['statuses']}")
    idempotent = server.config != "bare" and not server.config.endswith("_insert")
    if mode == "replay" and idempotent and got["replayed"] != got["requests"]:
        raise RuntimeError(f"{server.config}: {got['replayed']}/{got['requests']} replayed")
    if mode == "fresh" and got["replayed"]:
        raise RuntimeError(f"{server.config}: a fresh key was replayed")
    return Slot(got["requests"], got["elapsed"], server_cpu, got["load_cpu"], other)


@dataclass
class Block:
    """Every round's slots for each configuration of one (mode, concurrency) block."""

    mode: str
    connections: int
    rounds: list[dict[str, list[Slot]]] = field(default_factory=list)

    def total(self, round_: dict[str, list[Slot]], name: str) -> Slot:
        slots = round_[name]
        return Slot(
            sum(s.requests for s in slots),
            sum(s.elapsed for s in slots),
            sum(s.server_cpu for s in slots),
            sum(s.load_cpu for s in slots),
            sum(s.other_cpu for s in slots),
        )

    def row(self, what: str, agentkey: str, baseline: str) -> dict[str, Any]:
        """A result row: agentkey against its baseline, paired round by round."""
        ours = [self.total(r, agentkey) for r in self.rounds]
        base = [self.total(r, baseline) for r in self.rounds]

        def per_req_us(s: Slot, other: bool = False) -> float:
            return (s.server_cpu + (s.other_cpu if other else 0.0)) / s.requests * 1e6

        row: dict[str, Any] = {
            "what": what,
            "mode": self.mode,
            "concurrency": self.connections,
            "agentkey": agentkey,
            "baseline": baseline,
            "N": len(self.rounds),
            "throughput_ratio": spread([o.rps / b.rps for o, b in zip(ours, base, strict=True)]),
            "server_cpu_per_request_ratio": spread(
                [per_req_us(o) / per_req_us(b) for o, b in zip(ours, base, strict=True)]
            ),
            "agentkey_rps": round(statistics.median(o.rps for o in ours)),
            "baseline_rps": round(statistics.median(b.rps for b in base)),
            "agentkey_server_cpu_us": round(statistics.median(map(per_req_us, ours)), 1),
            "baseline_server_cpu_us": round(statistics.median(map(per_req_us, base)), 1),
            "agentkey_server_cpu_util": round(
                statistics.median(o.server_cpu / o.elapsed for o in ours), 2
            ),
            "baseline_server_cpu_util": round(
                statistics.median(b.server_cpu / b.elapsed for b in base), 2
            ),
            "load_cpu_util_max": round(max(s.load_cpu / s.elapsed for s in [*ours, *base]), 2),
            "requests": sum(s.requests for s in [*ours, *base]),
        }
        if any(s.other_cpu for s in ours):
            row["agentkey_server_plus_redis_cpu_us"] = round(
                statistics.median(per_req_us(o, True) for o in ours), 1
            )
            row["baseline_server_plus_redis_cpu_us"] = round(
                statistics.median(per_req_us(b, True) for b in base), 1
            )
        return row


def run_block(
    block: Block,
    rounds: int,
    slot: Callable[[str], Slot],
    configs: Sequence[str],
    *,
    warmup: bool = True,
) -> Block:
    """``rounds`` palindromic rounds over ``configs``; ``slot(config)`` measures one slot."""
    if warmup:
        for name in configs:
            slot(name)
    for _ in range(rounds):
        got: dict[str, list[Slot]] = {name: [] for name in configs}
        for name in palindrome(configs):
            got[name].append(slot(name))
        block.rounds.append(got)
    return block


def loadgen_row(load: Load, server: Server, rounds: int, seconds: float) -> dict[str, Any]:
    """The ``loadgen`` row: ``server`` (the fastest configuration) at 64 connections, fresh
    keys, from one and from two load processes, interleaved. 1.0x: one was enough."""

    def slot(name: str) -> Slot:
        processes = 2 if name == "2 load processes" else 1
        return measure(load, server, "fresh", 64, seconds, processes=processes)

    names = ["1 load process", "2 load processes"]
    block = run_block(Block("fresh", 64), rounds, slot, names)
    what = f"loadgen: {server.config} endpoint, 2 load processes / 1"
    return block.row(what, "2 load processes", "1 load process")


def print_row(row: Mapping[str, Any]) -> None:
    """One printed row: what, then ``agentkey vs baseline`` (the configurations by name)."""
    print(
        f"  {row['what']:<56} [{row['agentkey']} vs {row['baseline']}] "
        f"c={row['concurrency']:<3} {row['mode']:<6} "
        f"thr {fmt(row['throughput_ratio']):<18} "
        f"cpu/req {fmt(row['server_cpu_per_request_ratio']):<18} "
        f"{row['agentkey_rps']:>6}/{row['baseline_rps']:<6} req/s  "
        f"{row['agentkey_server_cpu_us']:>6.0f}/{row['baseline_server_cpu_us']:<5.0f} us  "
        f"srv {row['agentkey_server_cpu_util']:.2f}/{row['baseline_server_cpu_util']:.2f} "
        f"load {row['load_cpu_util_max']:.2f}  N={row['N']}"
    )


# --------------------------------------------------------------------------- instructions


@dataclass
class Instructions:
    """What :func:`instructions` measured, per iteration of the target's loop.

    ``total`` is instructions executed (cachegrind's ``Ir``); ``by_function`` splits it by
    the interpreter's C functions (``file:function``), biggest first; ``gc_collections`` is
    the garbage collector's collections (all generations); ``containers`` the objects
    allocated that the collector tracks and counts towards its next collection (those
    not taken from a free list): what makes it run, the more often the more requests
    are in flight. All are differences of two runs (``2n`` and ``n`` iterations, after
    the same set-up and warm-up), so start-up, imports and set-up cancel out.
    """

    total: float
    by_function: dict[str, float]
    gc_collections: float
    containers: float = 0.0


def instructions(
    target: str,
    iterations: int = 200,
    *,
    arg: str = "",
    warmup: int = 20,
    env: Mapping[str, str] | None = None,
) -> Instructions:
    """Instructions per iteration of ``target`` (``"module:function"``), under cachegrind.

    ``function(arg)`` is called once in a child process (``valgrind --tool=cachegrind
    --cache-sim=no``, this interpreter, this checkout first on the path) and returns
    ``run(n)``, which must do ``n`` iterations of the work measured (an async target runs
    its own event loop inside ``run``). The child calls ``run(warmup)`` then
    ``run(iterations)`` or ``run(2 * iterations)``; the figures are the difference of the
    two runs divided by ``iterations``. Instruction counts do not move with the machine's
    load, unlike CPU time: compare two trees or two configurations by them.
    """
    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (cachegrind) on PATH")
    runs = [_cachegrind(target, arg, warmup, n, env or {}) for n in (iterations, 2 * iterations)]
    (small, small_gc), (big, big_gc) = runs
    by_function = {
        name: (big.get(name, 0) - small.get(name, 0)) / iterations
        for name in big.keys() | small.keys()
    }
    total = sum(by_function.values())
    ordered = dict(sorted(by_function.items(), key=lambda kv: -kv[1]))
    linked = sum(by_function.get(name, 0.0) for name in _GC_LINK)
    per_link = _instructions_per_link() if target != _CALIBRATION else 1.0
    return Instructions(total, ordered, (big_gc - small_gc) / iterations, linked / per_link)


#: Where CPython (3.11-3.13) counts a new tracked container towards the next collection:
#: its instructions per call are fixed, so they count the allocations.
_GC_LINK = ("gcmodule.c:_PyObject_GC_Link", "pycore_pystate.h:_PyObject_GC_Link")
_CALIBRATION = "bench._harness:_ten_containers"
_PER_LINK: list[float] = []


def _ten_containers(arg: str) -> Callable[[int], None]:
    """The calibration target: ten tracked objects (no free list) per iteration."""

    class Node:
        __slots__ = ("next",)
        next: object

    def run(n: int) -> None:
        for _ in range(n):
            for _ in range(10):
                Node().next = None

    return run


def _instructions_per_link() -> float:
    """Instructions of one container's count towards a collection, measured once."""
    if not _PER_LINK:
        got = instructions(_CALIBRATION, 200)
        _PER_LINK.append(sum(got.by_function.get(name, 0.0) for name in _GC_LINK) / 10 or 1.0)
    return _PER_LINK[0]


def _cachegrind(
    target: str, arg: str, warmup: int, n: int, env: Mapping[str, str]
) -> tuple[dict[str, int], int]:
    """One child run: ``Ir`` per ``file:function`` and the GC's collections in ``run(n)``."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-cachegrind-") as tmp:
        out, gc_file = Path(tmp) / "cachegrind.out", Path(tmp) / "gc"
        command = [
            "valgrind",
            "--tool=cachegrind",
            "--cache-sim=no",
            f"--cachegrind-out-file={out}",
            sys.executable,
            "-m",
            "bench._harness",
            "--instructions-child",
            target,
            arg,
            str(warmup),
            str(n),
            str(gc_file),
        ]
        child_env = {**os.environ, **env, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "0"}
        done = subprocess.run(  # noqa: S603
            command, env=child_env, cwd=ROOT, capture_output=True, text=True, check=False
        )
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"{target} failed under cachegrind:\n{done.stderr[-3000:]}")
        return _read_cachegrind(out), int(gc_file.read_text())


def _read_cachegrind(path: Path) -> dict[str, int]:
    """``Ir`` per ``file:function`` from a cachegrind out file (one event: ``Ir``)."""
    counts: dict[str, int] = {}
    file = function = "?"
    for line in path.read_text().splitlines():
        if line.startswith("fl="):
            file = line[3:].rsplit("/", 1)[-1]
        elif line.startswith("fn="):
            function = f"{file}:{line[3:]}"
        elif line[:1].isdigit():
            parts = line.split()
            if len(parts) >= 2:
                counts[function] = counts.get(function, 0) + int(parts[1])
    return counts


def _instructions_child(target: str, arg: str, warmup: int, n: int, gc_file: str) -> None:
    import gc
    import importlib

    module, _, name = target.partition(":")
    run = getattr(importlib.import_module(module), name)(arg)
    run(warmup)
    collections = [0]

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections[0] += 1

    gc.callbacks.append(count)
    run(n)
    gc.callbacks.remove(count)
    Path(gc_file).write_text(str(collections[0]))


if __name__ == "__main__" and sys.argv[1:2] == ["--instructions-child"]:
    _target, _arg, _warmup, _n, _gc_file = sys.argv[2:7]
    _instructions_child(_target, _arg, int(_warmup), int(_n), _gc_file)
