"""Import cost: agentkey's imports in fresh interpreters, against the imports they add to.

Each row is one statement run by ``python -c`` in a fresh subprocess (``-E -s``
is not used: the installed environment is what users import from). Rows are
interleaved in rounds (every row once per round, in a rotated order), so load that
comes and goes hits every row alike. Each row is compared with its baseline row
*within each round* (CPU of the row minus CPU of the baseline, both from the same
round), and the table gives the median of those paired differences with their
interquartile range, beside the median wall and CPU time of the row itself. CPU is the
child's user + system time, which a loaded machine inflates less than wall time.

Rows (baseline in brackets):

- ``import agentkey`` [``python -c pass``]: what every user pays (canonical JSON,
  keys, exceptions);
- ``from agentkey import ToolInvoker, PlanSession`` [``import httpx, pydantic``]: a
  client program's imports, over the two libraries it needs anyway; the call engine
  (the flow, httpx's transport, asyncio, the journal) loads when the first invoker is
  made, which the next row shows;
- ``... ; ToolInvoker(...)`` [``import httpx, pydantic``]: the same, plus making one
  invoker (``journal=False``);
- ``from agentkey.testing import check_server`` [``python -c pass``]: the protocol checker;
- ``import pydantic``, ``import httpx`` [``python -c pass``]: for scale.

Bytecode. An installed package has its ``.pyc`` files (pip compiles them), so by
default the children read cached bytecode: ``PYTHONDONTWRITEBYTECODE`` is dropped for
them and ``PYTHONPYCACHEPREFIX`` points at a directory of this run, which the warm-up
round fills. ``--bytecode none`` keeps what the environment says instead (with
``PYTHONDONTWRITEBYTECODE=1`` and no cache, every module of a checkout is compiled
from source on every run: a developer's figure, not a user's).

    python bench/bench_import.py                  # full run, writes bench/results/import.json
    python bench/bench_import.py --smoke          # a few seconds, for CI (writes nothing)
    python bench/bench_import.py --rounds 30 --bytecode none --out other.json
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for bench._harness

from bench._harness import load_line, machine, write_results

PYTHON = "python -c pass"
LIBRARIES = "import httpx, pydantic"
CLIENT = "from agentkey import ToolInvoker, PlanSession"
#: name -> (statement, baseline row)
ROWS: dict[str, tuple[str, str]] = {
    PYTHON: ("pass", PYTHON),
    "import agentkey": ("import agentkey", PYTHON),
    LIBRARIES: (LIBRARIES, PYTHON),
    CLIENT: (f"{LIBRARIES}; {CLIENT}", LIBRARIES),
    f"{CLIENT}; ToolInvoker(...)": (
        f"{LIBRARIES}; {CLIENT}; ToolInvoker('https://tool.test', journal=False)",
        LIBRARIES,
    ),
    "from agentkey.testing import check_server": (
        "from agentkey.testing import check_server",
        PYTHON,
    ),
    "import pydantic": ("import pydantic", PYTHON),
    "import httpx": ("import httpx", PYTHON),
}


def run_once(statement: str, env: Mapping[str, str]) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of ``python -c statement``, fresh interpreter."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], check=True, env=env)  # noqa: S603
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(rounds: int, env: Mapping[str, str]) -> dict[str, dict[str, list[float]]]:
    """Every row once per round, the order rotated each round; wall and CPU ms per row."""
    names = list(ROWS)
    for statement, _ in ROWS.values():  # warm the file-system cache and the bytecode cache
        run_once(statement, env)
    times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            wall, cpu = run_once(ROWS[name][0], env)
            times[name]["wall"].append(wall * 1e3)
            times[name]["cpu"].append(cpu * 1e3)
    return times


def child_env(bytecode: str, cache: str) -> dict[str, str]:
    env = dict(os.environ)
    if bytecode == "cached":
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = cache
    return env


def quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0], values[0]]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return [round(q1, 1), round(q3, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a few seconds, for CI; no JSON")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (>= 10 for a full run)")
    parser.add_argument(
        "--bytecode",
        choices=["cached", "none"],
        default="cached",
        help="cached: .pyc files as an install has them (default); none: as the env says",
    )
    parser.add_argument("--out", type=Path, help="results JSON path")
    opts = parser.parse_args()
    rounds = opts.rounds or (2 if opts.smoke else 20)
    if not opts.smoke and rounds < 10:
        parser.error("a full run needs --rounds >= 10")

    at_start = machine()
    with tempfile.TemporaryDirectory(prefix="bench-import-pyc-") as cache:
        times = measure(rounds, child_env(opts.bytecode, cache))
    rows: list[dict[str, Any]] = []
    print(f"bytecode: {opts.bytecode}; {rounds} rounds; CPU over the baseline = median (IQR)")
    print(
        f"{'statement':52s} {'wall ms':>8s} {'cpu ms':>8s} {'cpu min-max':>13s}"
        f" {'cpu over baseline':>22s}  baseline"
    )
    for name, kinds in times.items():
        baseline = ROWS[name][1]
        over = [a - b for a, b in zip(kinds["cpu"], times[baseline]["cpu"], strict=True)]
        row: dict[str, Any] = {"row": name, "statement": ROWS[name][0], "rounds": rounds}
        for kind, values in kinds.items():
            row[kind] = {
                "median_ms": round(statistics.median(values), 1),
                "min_ms": round(min(values), 1),
                "max_ms": round(max(values), 1),
            }
        row["cpu_over_baseline"] = {
            "baseline": baseline,
            "median_ms": round(statistics.median(over), 1),
            "iqr_ms": quartiles(over),
        }
        rows.append(row)
        cpu, iqr = row["cpu"], row["cpu_over_baseline"]["iqr_ms"]
        line = f"{name:52s} {row['wall']['median_ms']:8.1f} {cpu['median_ms']:8.1f}"
        line += f" {cpu['min_ms']:6.1f}-{cpu['max_ms']:6.1f}"
        line += f" {row['cpu_over_baseline']['median_ms']:8.1f} ({iqr[0]:5.1f}-{iqr[1]:5.1f})"
        print(f"{line}  {baseline if baseline != name else ''}")
    if opts.smoke:
        print(load_line(at_start))
        return
    payload = {
        "bytecode": opts.bytecode,
        "method": "wall time and CPU time (user + system, from getrusage of the child) of "
        "`python -c STATEMENT` in a fresh subprocess; rows interleaved in rounds (order "
        "rotated per round); medians over rounds; cpu_over_baseline = median (and IQR) of "
        "the per-round difference between the row and its baseline row",
        "rows": rows,
    }
    name = "import" if opts.bytecode == "cached" else "import-source"
    print(f"\nwrote {write_results(name, payload, opts.out, at_start)}")


if __name__ == "__main__":
    main()
