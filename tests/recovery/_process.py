"""Agent processes against a counting tool server: killed once the tool ran, then run again.

The tool is :class:`~tests.journal._tools.PlainTool` behind agentkey's middleware on
loopback, counting what it executed. :meth:`Recovery.killed` starts an agent process
and SIGKILLs it once the tool has run its side effect ``count`` times (the tool holds
its answers, so none reaches the agent); :meth:`Recovery.again` runs the agent to the
end, as the application does when it recovers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentkey.server import IdempotencyMiddleware, MemoryStore
from tests._loopback import serve
from tests.journal._tools import PlainTool

__all__ = ["Recovery", "recovery"]


@dataclass
class Recovery:
    module: str  # the agent process: python -m <module> --url <url> ...
    tool: PlainTool
    url: str
    journal: Path

    def env(self) -> dict[str, str]:
        return {**os.environ, "AGENTKEY_JOURNAL": str(self.journal), "PYTHONPATH": os.getcwd()}

    def args(self, *extra: str) -> list[str]:
        return [sys.executable, "-m", self.module, "--url", self.url, *extra]

    def killed(self, *extra: str, tool: str = "charge", count: int = 1) -> None:
        """An agent process that dies (SIGKILL) once ``tool`` has run ``count`` times."""
        self.tool.modes[tool] = "hold"
        child = subprocess.Popen(self.args(*extra), env=self.env())
        try:
            deadline = time.monotonic() + 60
            while self.tool.executions[tool] < count:
                assert child.poll() is None, "the agent process ended before the tool ran"
                assert time.monotonic() < deadline, "the agent's calls never reached the tool"
                time.sleep(0.02)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(30)
        self.tool.release.set()  # the tool finishes; its answers go to a dead connection
        self.tool.modes[tool] = "ok"

    def again(self, *extra: str) -> tuple[list[dict[str, Any]], str]:
        """The application recovers: the agent runs again, in a new process, to the end.
        Its printed JSON lines, and its standard error."""
        out = subprocess.run(
            self.args(*extra), env=self.env(), capture_output=True, text=True, timeout=90
        )
        assert out.returncode == 0, out.stderr[-3000:]
        lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        return lines, out.stderr


@contextmanager
def recovery(module: str, tmp_path: Path) -> Iterator[Recovery]:
    """A counting tool server behind the middleware, and agent processes of ``module``."""
    tool = PlainTool()
    app = IdempotencyMiddleware(
        tool, store=MemoryStore(), routes=["/tools/*"], shared_key_space=True
    )
    with serve(app) as url:
        yield Recovery(module, tool, url, tmp_path / "journal.sqlite3")
