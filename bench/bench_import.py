"""Import cost: ``import agentkey`` in a fresh interpreter, against the interpreter alone.

Each row is one statement run by ``python -c`` in a fresh subprocess (``-E -s``
is not used: the installed environment is what users import from). Rows are
interleaved in rounds (every row once per round, in a rotated order), so load that
comes and goes hits every row alike; the table gives the median over the rounds
of the wall time and of the child's CPU time (user + system, which a loaded machine
inflates less), their spread (min-max) and the cost over the bare interpreter
(``python -c pass``, median minus median).

Rows:

- ``import agentkey``: what every user pays (canonical JSON, keys, exceptions);
- ``import agentkey; agentkey.PlanSession``: plans, with pydantic, loaded on first use;
- ``import agentkey; agentkey.ToolInvoker``: the invoker and its HTTP stack,
  loaded on first use;
- ``import agentkey; agentkey.check_server``: the protocol checker;
- ``import pydantic`` and ``import httpx``: the two heavy dependencies, for scale.

    python bench/bench_import.py                  # full run, writes bench/results/import.json
    python bench/bench_import.py --smoke          # a few seconds, for CI (writes nothing)
    python bench/bench_import.py --rounds 30 --out other.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "import.json"

BASELINE_ROW = "python -c pass"
ROWS: dict[str, str] = {
    BASELINE_ROW: "pass",
    "import agentkey": "import agentkey",
    "import agentkey; agentkey.PlanSession": "import agentkey; agentkey.PlanSession",
    "import agentkey; agentkey.ToolInvoker": "import agentkey; agentkey.ToolInvoker",
    "import agentkey; agentkey.check_server": "import agentkey; agentkey.check_server",
    "import pydantic": "import pydantic",
    "import httpx": "import httpx",
}


def run_once(statement: str) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of ``python -c statement``, fresh interpreter."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], check=True)  # noqa: S603  # our own argv
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(rounds: int) -> dict[str, dict[str, list[float]]]:
    """Every row once per round, the order rotated each round; wall and CPU ms per row."""
    names = list(ROWS)
    for statement in ROWS.values():  # warm the file-system cache and .pyc files
        run_once(statement)
    times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            wall, cpu = run_once(ROWS[name])
            times[name]["wall"].append(wall * 1e3)
            times[name]["cpu"].append(cpu * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a few seconds, for CI; no JSON")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (>= 10 for a full run)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results JSON path")
    opts = parser.parse_args()
    rounds = opts.rounds or (2 if opts.smoke else 15)
    if not opts.smoke and rounds < 10:
        parser.error("a full run needs --rounds >= 10")

    times = measure(rounds)
    base = {kind: statistics.median(times[BASELINE_ROW][kind]) for kind in ("wall", "cpu")}
    rows: list[dict[str, Any]] = []
    print(
        f"{'statement':40s} {'wall ms':>8s} {'min-max':>13s} {'over py':>8s}"
        f" {'cpu ms':>8s} {'min-max':>13s} {'over py':>8s}  N"
    )
    for name, kinds in times.items():
        row: dict[str, Any] = {"row": name, "rounds": rounds}
        line = f"{name:40s}"
        for kind, values in kinds.items():
            median = statistics.median(values)
            row[kind] = {
                "median_ms": round(median, 1),
                "min_ms": round(min(values), 1),
                "max_ms": round(max(values), 1),
                "over_python_ms": round(median - base[kind], 1),
            }
            line += (
                f" {median:8.1f} {min(values):6.1f}-{max(values):6.1f} {median - base[kind]:8.1f}"
            )
        rows.append(row)
        print(f"{line}  {rounds}")
    if opts.smoke:
        return
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    doc = {
        "bench": "bench/bench_import.py",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "loadavg_at_end": load,
        },
        "method": "wall time and CPU time (user + system, from getrusage of the child) of "
        "`python -c STATEMENT` in a fresh subprocess; rows interleaved in rounds (order "
        "rotated per round); median over rounds; over_python = median - median of "
        "`python -c pass`",
        "baseline": "python -c pass",
        "rows": rows,
    }
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\nwrote {opts.out}")


if __name__ == "__main__":
    main()
