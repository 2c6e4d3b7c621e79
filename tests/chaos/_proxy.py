"""A fault-injecting HTTP/1.1 proxy on loopback (``python -m tests.chaos._proxy``).

Arguments: ``<listen port> <upstream port> <seed> <fault rate> <read timeout> <log file>``.
Prints ``ready`` once it listens. Every request is logged, once it is over, as one line
``<received> <over> <kind> <status sent to the client, 0 for none> <X-Chaos-Caller>
<Idempotency-Key>`` (wall-clock times; kind ``pass`` when not faulted).

The fault of a request is drawn from ``Random(f"{seed}:{key}:{n}")``, ``n`` counting the
requests seen for that key, so one seed gives each key the same fault sequence in every
run (the interleaving of racing replicas is up to the scheduler). Kinds:

- ``reset_before``: the client's connection is reset; the request never reaches the tool;
- ``drop_after``: forwarded and answered by the tool (committed), then the client's
  connection is closed or reset instead of the answer;
- ``delay_before``: held past the client's read timeout, then forwarded (the tool runs
  it after the client gave up, possibly beside the client's retry);
- ``delay_after``: forwarded, and the answer held past the client's read timeout;
- ``s502``, ``s502_ra``, ``s503``, ``s503_ra``: answered by the proxy without forwarding,
  with or without ``Retry-After``;
- ``double``: sent twice to the tool at once; the client gets one of the two answers.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import struct
import sys
import time
from collections import Counter

FAULTS: dict[str, float] = {
    "reset_before": 5,
    "drop_after": 6,
    "delay_before": 1.5,
    "delay_after": 1.5,
    "s502": 2.5,
    "s502_ra": 2.5,
    "s503": 2.5,
    "s503_ra": 2.5,
    "double": 6,
}
# The kinds after which a client cannot know whether the step ran.
AMBIGUOUS = frozenset(
    {"reset_before", "drop_after", "delay_before", "delay_after", "s502", "s502_ra", "s503"}
    | {"s503_ra"}
)


class Proxy:
    def __init__(
        self, upstream: int, seed: str, rate: float, read_timeout: float, log: int
    ) -> None:
        self.upstream = upstream
        self.seed = seed
        self.rate = rate
        self.hold = read_timeout + 0.5
        self.log = log
        self.seen: Counter[str] = Counter()
        # asyncio keeps only weak references to the connections' tasks: hold them, so a
        # request in flight is neither dropped nor left out of the log.
        self.tasks: set[asyncio.Task[None] | None] = set()
        total = sum(FAULTS.values())
        self.kinds = list(FAULTS)
        self.weights = [w / total for w in FAULTS.values()]

    def fault(self, key: str) -> tuple[str, random.Random]:
        n = self.seen[key]
        self.seen[key] = n + 1
        rng = random.Random(f"{self.seed}:{key}:{n}")
        if rng.random() >= self.rate:
            return "pass", rng
        return rng.choices(self.kinds, self.weights)[0], rng

    async def forward(self, request: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        try:
            writer.write(request)
            await writer.drain()
            head, body = await read_message(reader)
            return head + body
        finally:
            writer.close()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.tasks.add(task)
        try:
            while True:
                try:
                    head, body = await read_message(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                key = header(head, b"idempotency-key") or "-"
                caller = header(head, b"x-chaos-caller") or "-"
                kind, rng = self.fault(key)
                received, answered = time.time(), [0]
                try:
                    if not await self.serve(kind, rng, head + body, writer, answered):
                        return
                finally:
                    line = f"{received:.3f} {time.time():.3f} {kind} {answered[0]} {caller} {key}\n"
                    os.write(self.log, line.encode("latin-1"))
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            return
        finally:
            writer.close()
            self.tasks.discard(task)

    async def serve(
        self,
        kind: str,
        rng: random.Random,
        request: bytes,
        writer: asyncio.StreamWriter,
        answered: list[int],
    ) -> bool:
        """Answer one request as ``kind`` says; False when the connection is gone.

        ``answered[0]`` becomes the status the client was sent (0: none reached it).
        """
        if kind == "reset_before":
            reset(writer)
            return False
        if kind.startswith("s50"):
            status = b"502 Bad Gateway" if kind.startswith("s502") else b"503 Service Unavailable"
            extra = b"Retry-After: 1\r\n" if kind.endswith("_ra") else b""
            writer.write(
                b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain\r\n" + extra
                + b"Content-Length: 5\r\n\r\nfault"
            )  # fmt: skip
            await writer.drain()
            answered[0] = int(status[:3])
            return True
        if kind == "delay_before":
            await asyncio.sleep(self.hold)
        if kind == "double":
            answers = await asyncio.gather(
                self.forward(request), self.forward(request), return_exceptions=True
            )
            good = [a for a in answers if isinstance(a, bytes)]
            if not good:
                reset(writer)
                return False
            answer = rng.choice(good)
        else:
            answer = await self.forward(request)
        if kind == "drop_after":
            if rng.random() < 0.5:
                reset(writer)
            return False
        if kind == "delay_after":
            await asyncio.sleep(self.hold)
        writer.write(answer)
        await writer.drain()
        answered[0] = int(answer[9:12])
        return True


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST instead of a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def header(head: bytes, name: bytes) -> str | None:
    for line in head.split(b"\r\n")[1:]:
        field, _, value = line.partition(b":")
        if field.strip().lower() == name:
            return value.strip().decode("latin-1")
    return None


async def read_message(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One HTTP/1.1 message: its head and its body (Content-Length or chunked)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = header(head, b"content-length")
    if length is not None:
        return head, await reader.readexactly(int(length))
    if (header(head, b"transfer-encoding") or "").lower() == "chunked":
        body = bytearray()
        while True:
            size_line = await reader.readuntil(b"\r\n")
            body += size_line
            size = int(size_line.split(b";")[0], 16)
            body += await reader.readexactly(size + 2)
            if size == 0:
                return head, bytes(body)
    return head, b""


async def main(argv: list[str]) -> None:
    port, upstream, seed, rate, read_timeout, log_path = argv
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    proxy = Proxy(int(upstream), seed, float(rate), float(read_timeout), log)
    await asyncio.start_server(proxy.handle, "127.0.0.1", int(port), backlog=1024)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    os._exit(0)  # every log line is already written; connections in flight just end


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
