"""Time, sleep and chance come only from the injected clock (issue 36, docs/architecture.md).

The package is read as source: a call to ``time.monotonic``/``time.time``/``time.sleep``/
``time.perf_counter``, ``asyncio.sleep``/``anyio.sleep``, or any use of the ``random``
module outside ``agentkey/_clock.py`` fails this test, unless its line says why it must
use real time (a ``# real time:`` comment: socket and driver timeouts, a lock another
process holds, which no clock can fake).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "agentkey"
#: The clock itself, and the test double that is one.
CLOCKS = {ROOT / "_clock.py", ROOT / "testing.py"}
FORBIDDEN = {
    ("time", "monotonic"),
    ("time", "monotonic_ns"),
    ("time", "time"),
    ("time", "time_ns"),
    ("time", "sleep"),
    ("time", "perf_counter"),
    ("asyncio", "sleep"),
    ("anyio", "sleep"),
}


def _offences(source: str) -> list[tuple[int, str]]:
    """(line, what) for each read of the clock, sleep or random draw not marked real time."""
    lines = source.splitlines()
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        what = None
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in FORBIDDEN:
                what = f"{node.value.id}.{node.attr}"
        elif isinstance(node, ast.Import):
            if any(alias.name == "random" for alias in node.names):
                what = "import random"
        elif isinstance(node, ast.ImportFrom) and node.module in (
            "time",
            "random",
            "asyncio",
            "anyio",
        ):
            names = [alias.name for alias in node.names]
            if node.module == "random" or any((node.module, n) in FORBIDDEN for n in names):
                what = f"from {node.module} import {', '.join(names)}"
        if what is not None and "real time:" not in lines[node.lineno - 1]:  # type: ignore[attr-defined]
            found.append((node.lineno, what))  # type: ignore[attr-defined]
    return found


def test_time_sleep_and_chance_come_only_from_the_clock() -> None:
    """No module but the clock's reads the clock, sleeps or draws a random number."""
    offences = [
        f"{path.relative_to(ROOT.parent)}:{line}: {what}"
        for path in sorted(ROOT.rglob("*.py"))
        if path not in CLOCKS
        for line, what in _offences(path.read_text(encoding="utf-8"))
    ]
    assert offences == []


def test_the_check_sees_what_it_forbids() -> None:
    """Each forbidden form is flagged; a line that says why it needs real time passes."""
    sample = (
        "import random\n"
        "import time, asyncio\n"
        "from time import monotonic\n"
        "a = time.monotonic()\n"
        "b = asyncio.sleep(1)\n"
        "c = time.monotonic()  # real time: the socket's deadline\n"
        "d = time.strftime('%Y')\n"
    )
    assert [line for line, _ in _offences(sample)] == [1, 3, 4, 5]
