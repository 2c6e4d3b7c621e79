"""Real servers on loopback for the tests: uvicorn in a thread, redis-server in a subprocess."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import uvicorn

__all__ = ["Handler", "RedisServer", "free_port", "raw_server", "redis_server", "serve"]

Handler = Callable[[socket.socket, bytes], None]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def serve(
    app: Any,
    *,
    timeout_keep_alive: int = 5,
    root_path: str = "",
    lifespan: Literal["on", "off"] = "off",
) -> Iterator[str]:
    """Run an ASGI ``app`` under uvicorn on 127.0.0.1 in a thread; yield its base URL.

    ``root_path`` is what ``uvicorn --root-path`` sets (a proxy's path prefix);
    ``lifespan="on"`` runs the app's startup (an MCP streamable HTTP app needs it).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted sockets inherit this on Linux; without it Nagle and delayed ACKs add ~40 ms
    # to every response.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan=lifespan,
        timeout_keep_alive=timeout_keep_alive,
        access_log=False,
        root_path=root_path,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start on loopback within 10 s")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@dataclass(frozen=True)
class RedisServer:
    """A private redis-server started for the test session."""

    host: str
    port: int
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"


@contextmanager
def redis_server(*options: str) -> Iterator[RedisServer]:
    """Start a throwaway redis-server on a free loopback port (no persistence); ``options``
    are added to its command line (``"--replicaof", host, port``, say)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(
            "redis-server is not on PATH; the tests need a real Redis. "
            "On Debian: apt-get install redis-server (.ci/run does this)"
        )
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="agentkey-redis-") as workdir:
        proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                workdir,
                "--protected-mode",
                "yes",
                *options,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                        conn.sendall(b"PING\r\n")
                        if conn.recv(16).startswith(b"+PONG"):
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {port}")
                time.sleep(0.05)
            yield RedisServer("127.0.0.1", port, proc)
        finally:
            proc.terminate()
            proc.wait(timeout=10)


@contextmanager
def raw_server(handler: Handler) -> Iterator[str]:
    """A raw TCP server on 127.0.0.1: ``handler`` writes whatever bytes it likes."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve_one(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            data = b""
            try:
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, rest = data.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                while len(rest) < length:
                    rest += conn.recv(65536)
                handler(conn, head)
            except OSError:
                pass

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            threading.Thread(target=serve_one, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        listener.close()
