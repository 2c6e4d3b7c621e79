"""`agentkey serve` on the memory store needs no redis-py."""

from __future__ import annotations

import subprocess
import sys

_SCRIPT = """
import sys
sys.modules["redis"] = None  # redis-py is not installed
import uvicorn
served = []
uvicorn.run = lambda app, **kwargs: served.append(app)
from agentkey.cli import main
assert main(["serve"]) == 0, "serve failed"
assert served, "nothing was served"
assert "agentkey.server.redis._store" not in sys.modules
"""


def test_serve_on_memory_runs_without_redis_py() -> None:
    """With redis-py missing, `agentkey serve` (no --redis) still builds and serves the app."""
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "records in memory" in done.stdout
