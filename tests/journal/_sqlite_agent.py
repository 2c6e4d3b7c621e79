"""An agent process writing to one SQLite journal file, for the multi-process tests.

``python _sqlite_agent.py PATH NAME OBJECTS THREADS COUNT``: opens ``OBJECTS`` journal
objects on PATH (one more after the first write, as a second invoker would), prints
``ready``, waits for a line on stdin, then has ``THREADS`` threads per object each record
``COUNT`` calls, prints ``written`` and sleeps until it is killed.
"""

from __future__ import annotations

import sys
import threading
import time

from agentkey.journal import CallRecord, SQLiteJournal


def record(name: str, n: int) -> CallRecord:
    now = time.time()
    return CallRecord(
        key=f"{name}:step_{n:03d}:" + "a" * 64,
        plan=name,
        step=f"step_{n:03d}",
        tool="charge",
        args_hash=f"{n:064x}",
        route="POST http://127.0.0.1:9/tools/charge",
        created_at=now,
        updated_at=now,
        owner="gone-host:1:x:1",
        lease_until=now + 600,
    )


def main() -> None:
    path, name, objects, threads, count = sys.argv[1:6]
    first = SQLiteJournal(path)
    first.begin(record(name, 0))
    journals = [first] + [SQLiteJournal(path) for _ in range(int(objects) - 1)]
    print("ready", flush=True)
    sys.stdin.readline()
    numbers = iter(range(1, 1 + int(objects) * int(threads) * int(count)))
    lock = threading.Lock()

    def write(journal: SQLiteJournal) -> None:
        for _ in range(int(count)):
            with lock:
                n = next(numbers)
            journal.begin(record(name, n))
            if n % 7 == 0:  # another invoker comes and goes meanwhile
                SQLiteJournal(path).close()

    workers = [
        threading.Thread(target=write, args=(journal,))
        for journal in journals
        for _ in range(int(threads))
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    print("written", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
