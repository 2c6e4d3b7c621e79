"""The tables of docs/performance.md, from the JSON in bench/results/.

    python bench/report.py              # print every table
    python bench/report.py postgres     # print one of them
    python bench/report.py --write      # rewrite the generated regions of docs/performance.md
    python bench/report.py --check      # exit 1 if docs/performance.md differs from --write's

docs/performance.md holds one region per table, between ``<!-- report.py NAME -->`` and
``<!-- /report.py NAME -->``: ``NAME`` is a results file (``postgres`` is
``bench/results/postgres.json``), or ``header NAME`` for a table composed by hand, whose
region is only the line naming its run. Nobody edits inside a region: ``--write`` does, and
``tests/test_bench_report.py`` fails when the page is not what ``--write`` would write.

Each table starts with the line naming its run: machine, Python, date, commit and load
average at start and end. A figure older than the code it describes is marked: when a
commit after the run's (or any commit, when the run's commit is unknown, as in files
written before benches recorded it) touched the code the bench measures (``MEASURES``),
the line is followed by ``(stale: measured at X, code changed since)``. The marker names no
later commit, so a merge or a rebase of code commits does not change the page.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "performance.md"

#: Targets, by (agentkey, baseline, mode, concurrency or None for any). Issue 39's: server CPU
#: per request, the Redis middleware at or below the naive handler's at one connection and
#: ≤ 1.5× the bare endpoint's at 64; PostgreSQL at its floor, the same statements written by
#: hand (the old "CPU ≤ 2.5× / 1.8× the bare endpoint" are retired). Issue 14's throughput
#: target for MemoryStore stands.
SERVER_TARGETS = {
    ("redis", "bare", "fresh", 64): "CPU ≤ 1.5×",
    ("redis", "naive", "fresh", 1): "CPU ≤ 1.0×",
    ("memory", "bare", "fresh", None): "throughput ≥ 0.85×",
    ("postgres", "floor", "fresh", None): "CPU ≤ 1.1×",
    ("postgres", "floor", "replay", None): "CPU ≤ 1.1×",
}

_SERVER = ("agentkey/server", "agentkey/_keys.py", "agentkey/_canonical.py")
_CLIENT = (
    "agentkey/client",
    "agentkey/journal",
    "agentkey/_keys.py",
    "agentkey/_canonical.py",
    "agentkey/_plan.py",
    "agentkey/_schedule.py",
)
#: The code each bench measures, by results file (its name up to the first ``-``): a commit
#: that touches one of these paths after the run makes the run's figures stale.
MEASURES: dict[str, tuple[str, ...]] = {
    "server": _SERVER,
    "postgres": _SERVER,
    "pg_driver": ("agentkey/server/_postgres.py",),
    "body": _SERVER,
    "invoker": _CLIENT,
    "hooks": _CLIENT,
    "journal": _CLIENT,
    "inflight": (*_CLIENT, "agentkey/server"),
    "keys": ("agentkey/_keys.py", "agentkey/_canonical.py", "agentkey/_plan.py"),
    "import": ("agentkey",),
}


# --------------------------------------------------------------------------- staleness


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(  # noqa: S603 - git, with this module's own arguments
            ["git", *args],  # noqa: S607
            cwd=root,
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def measured_at(data: Mapping[str, Any]) -> str:
    """The commit a results file was measured at (``abc1234``, ``abc1234+dirty``, ``unknown``)."""
    found = data.get("commit") or data.get("machine", {}).get("commit")
    return str(found) if found else "unknown"


def stale(data: Mapping[str, Any], paths: Sequence[str], root: Path = ROOT) -> str | None:
    """``stale: measured at X, code changed since`` when a commit the run did not include
    touched ``paths`` (any commit, when the run's commit is unknown); None when fresh.

    A run on a modified tree (``+dirty``) is taken as its commit's: its results are
    committed after it, with the change they measured."""
    at = measured_at(data)
    base = at.removesuffix("+dirty")
    known = at != "unknown" and _git(root, "cat-file", "-e", f"{base}^{{commit}}") is not None
    since = [f"{base}..HEAD"] if known else ["HEAD"]
    changed = _git(root, "log", "-1", "--format=%H", *since, "--", *paths)
    if changed is None:
        return f"stale: measured at {at}, code history unknown"
    if not changed:
        return None
    return f"stale: measured at {at}, code changed since"


# --------------------------------------------------------------------------- tables


def ratio(s: Mapping[str, Any]) -> str:
    return f"{s['median']:.2f}× ({s['iqr'][0]:.2f}–{s['iqr'][1]:.2f})"


def _load(m: Mapping[str, Any], at: str) -> str:
    value = m.get(f"loadavg_at_{at}")
    return f"{value[0]:.1f}" if value else "?"


def header(name: str, data: Mapping[str, Any], root: Path = ROOT) -> str:
    """The line naming a run (and, when its figures are stale, the line that says so)."""
    m = data.get("machine", {})
    packages = m.get("packages") or {}
    cpu, cores = m.get("cpu") or m.get("processor", "?"), m.get("cores") or m.get("cpus", "?")
    parts = [str(cpu), f"{cores} cores"]
    parts.append(f"CPython {m.get('python', '?')}")
    if packages.get("uvicorn"):
        httptools = "yes" if packages.get("httptools") else "no"
        parts.append(f"uvicorn {packages['uvicorn']} (httptools {httptools})")
    date = str(data.get("date", "?"))[:16].replace("T", " ")
    line = (
        f"{', '.join(parts)}; {date} UTC, commit `{measured_at(data)}`, load average "
        f"{_load(m, 'start')} at start, {_load(m, 'end')} at end; "
        f"`{data.get('bench', f'bench/bench_{name}.py')}`"
    )
    note = stale(data, MEASURES.get(name.split("-")[0], ("agentkey",)), root)
    if note:
        line += (
            f"\n\n**({note})**: these figures are older than the code they describe; "
            f"re-run `python {data.get('bench', f'bench/bench_{name}.py')}`, then "
            "`python bench/report.py --write`."
        )
    return line


def _head(*columns: str) -> list[str]:
    """A table's header row and its rule."""
    return ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]


def server_table(data: Mapping[str, Any]) -> list[str]:
    lines = _head(
        "what",
        "keys",
        "conc.",
        "agentkey req/s",
        "baseline req/s",
        "throughput ratio",
        "server CPU/req agentkey",
        "baseline",
        "CPU ratio",
        "server / load CPU",
        "N",
        "target",
    )
    for r in data["rows"]:
        if r["what"].startswith("loadgen"):
            target = "≈ 1.0×"
        elif r["what"].startswith("gc threshold"):  # the targets are for the defaults
            target = "none (tuned GC)"
        else:
            target = ""
        target = (
            target
            or SERVER_TARGETS.get((r["agentkey"], r["baseline"], r["mode"], r["concurrency"]))
            or SERVER_TARGETS.get((r["agentkey"], r["baseline"], r["mode"], None), "")
        )
        bound = re.fullmatch(r"CPU ≤ ([0-9.]+)×", target)
        floor = re.fullmatch(r"throughput ≥ ([0-9.]+)×", target)
        if bound:  # a CPU target: the median of the per-round ratios against it
            met = r["server_cpu_per_request_ratio"]["median"] <= float(bound[1])
            target += ": met" if met else ": **not met**"
        elif floor:
            met = r["throughput_ratio"]["median"] >= float(floor[1])
            target += ": met" if met else ": **not met**"
        lines.append(
            f"| {r['what']} | {r['mode']} | {r['concurrency']} | {r['agentkey_rps']} "
            f"| {r['baseline_rps']} | {ratio(r['throughput_ratio'])} "
            f"| {r['agentkey_server_cpu_us']:.0f} µs | {r['baseline_server_cpu_us']:.0f} µs "
            f"| {ratio(r['server_cpu_per_request_ratio'])} "
            f"| {r['agentkey_server_cpu_util']:.2f} / {r['load_cpu_util_max']:.2f} "
            f"| {r['N']} | {target} |"
        )
    return lines


#: Client CPU added per call, by bench and row: issue 39's plain path of the invoker (hooks
#: off, no journal) and issue 28's default hook.
ADDED_US_TARGETS = {
    ("bench/bench_invoker.py", "sync, in-process"): 15.0,
    ("bench/bench_hooks.py", "sync, in-process"): 5.0,
    ("bench/bench_hooks.py", "async, in-process"): 5.0,
}


def invoker_table(data: Mapping[str, Any]) -> list[str]:
    """bench_invoker.py and bench_hooks.py: client CPU per call, agentkey against its baseline."""
    lines = [
        "| what | agentkey | baseline | client CPU/call agentkey | baseline | added "
        "| CPU ratio | throughput ratio | N | target |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        added = r["added_client_cpu_us"]
        bound = next(
            (
                us
                for (bench, what), us in ADDED_US_TARGETS.items()
                if bench == data.get("bench") and r["what"].startswith(what)
            ),
            None,
        )
        target = _verdict(added["median"], bound, " µs added")
        lines.append(
            f"| {r['what']} | `{r['agentkey']}` | `{r['baseline']}` "
            f"| {r['agentkey_client_cpu_us']:.0f} µs | {r['baseline_client_cpu_us']:.0f} µs "
            f"| {added['median']:+.0f} µs ({added['iqr'][0]:+.0f}–{added['iqr'][1]:+.0f}) "
            f"| {ratio(r['client_cpu_per_call_ratio'])} | {ratio(r['throughput_ratio'])} "
            f"| {r['N']} | {target} |"
        )
    if "sniffio_installed" in data:
        lines += [
            "",
            f"sniffio installed in this run: {data['sniffio_installed']}; one failed "
            f"`import sniffio` costs {data['failed_sniffio_import_us']:.0f} µs.",
        ]
    return lines


#: What each server of bench_inflight.py answers a duplicate while the first call runs.
IN_FLIGHT = {
    "agentkey": "agentkey middleware: 409, `Retry-After: 1`",
    "agentkey_hold": "agentkey middleware, `hold_in_flight=10`",
    "idemkit": "idemkit, no hold: 423, `Retry-After: 30`",
    "idemkit_hold": "idemkit, default: holds the duplicate ≤ 10 s",
}


def inflight_table(data: Mapping[str, Any]) -> list[str]:
    lines = [
        "| server | step | delay: median | IQR | min–max | bound | over | questions: median "
        "(max) | N |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def s(x: float) -> str:  # a held replay can return a few ms before the first call's
        return f"{x:.2f}".replace("-0.00", "0.00")

    for r in data["rows"]:
        d, q = r["delay_seconds"], r["questions"]
        lines.append(
            f"| {IN_FLIGHT.get(r['server'], r['server'])} | {r['step_seconds']:g} s "
            f"| {s(d['median'])} s | {s(d['iqr'][0])}–{s(d['iqr'][1])} s "
            f"| {s(d['min'])}–{s(d['max'])} s | {r['bound_seconds']:g} s | {r['over_bound']} "
            f"| {q['median']:g} ({q['max']:g}) | {r['N']} |"
        )
    return lines


#: The statements of bench_pg_driver.py.
STATEMENTS = {"read": "replay's read", "claim": "claim of a new key (commits)"}


def driver_table(data: Mapping[str, Any]) -> list[str]:
    """bench_pg_driver.py: CPU per statement of each driver path (ratio to psycopg's)."""
    names = list(dict.fromkeys(r["agentkey"] for r in data["rows"]))
    lines = ["| statement | c | " + " | ".join(names) + " | N |", "|---" * (len(names) + 3) + "|"]
    groups: dict[tuple[str, int], dict[str, Mapping[str, Any]]] = {}
    for r in data["rows"]:
        groups.setdefault((r["what"], r["concurrency"]), {})[r["agentkey"]] = r
    for (what, concurrency), got in groups.items():
        cells = []
        for name in names:
            r = got.get(name)
            if r is None:
                cells.append("")
            elif name == r["baseline"]:
                cells.append(f"{r['cpu_us']:.0f} µs")
            else:
                cells.append(f"{r['cpu_us']:.0f} µs ({r['cpu_ratio']['median']:.2f}×)")
        n = max(r["N"] for r in got.values())
        lines.append(
            f"| {STATEMENTS.get(what, what)} | {concurrency} | {' | '.join(cells)} | {n} |"
        )
    return lines


#: Issue 39's targets for the journal: client CPU per call with it / without it.
JOURNAL_TARGETS = {"SQLite": 1.25, "Redis": 1.5}


def journal_table(data: Mapping[str, Any]) -> list[str]:
    """bench_journal.py: client CPU and wall time per call, with the journal / without."""
    lines = _head(
        "journal",
        "with / without: client CPU",
        "added CPU",
        "with / without: wall",
        "added wall",
        "N",
        "target",
    )
    for r in data["rows"]:
        cpu, cpu_iqr = (
            r["client_cpu_per_call_ratio"]["median"],
            r["client_cpu_per_call_ratio"]["iqr"],
        )
        target = _verdict(cpu, JOURNAL_TARGETS.get(r["what"].split(",")[0]))
        lines.append(
            f"| {r['what']} | {cpu:.3f}× ({cpu_iqr[0]:.2f}–{cpu_iqr[1]:.2f}) "
            f"| {r['added_cpu_us']['median']:+.0f} µs | {ratio(r['wall_per_call_ratio'])} "
            f"| {r['added_wall_us']['median']:+.0f} µs | {r['N']} | {target} |"
        )
    return lines


def _verdict(value: float, bound: float | None, unit: str = "×") -> str:
    if bound is None:
        return ""
    return f"≤ {bound:g}{unit}: " + ("met" if value <= bound else "**not met**")


def keys_table(data: Mapping[str, Any]) -> list[str]:
    """bench_keys.py: each key function against the bare hash, by shape of arguments."""
    lines = _head("what", "shape", "ratio", "baseline µs", "agentkey µs", "N", "target")
    lines.extend(
        f"| `{r['row']}` | {r['shape']} | {r['ratio_median']:.2f}× "
        f"({r['ratio_iqr'][0]:.2f}–{r['ratio_iqr'][1]:.2f}) "
        f"| {r['baseline_us_median']:.1f} | {r['agentkey_us_median']:.1f} | {r['rounds']} "
        f"| {_verdict(r['ratio_median'], r.get('target'))} |"
        for r in data["rows"]
    )
    return lines


#: bench_import.py's targets: CPU over the row's baseline, in ms.
IMPORT_TARGETS = {"from agentkey import ToolInvoker, PlanSession": 60.0, "import agentkey": 50.0}


def import_table(data: Mapping[str, Any]) -> list[str]:
    """bench_import.py: CPU of each import in a fresh interpreter, over its baseline row."""
    lines = [
        f"Bytecode: {data.get('bytecode', '?')}.",
        "",
        *_head("statement", "baseline", "CPU over baseline", "IQR", "CPU", "wall", "N", "target"),
    ]
    for r in data["rows"]:
        over, iqr = r["cpu_over_baseline"], r["cpu_over_baseline"]["iqr_ms"]
        if over["baseline"] == r["row"]:
            continue  # a baseline of its own (python -c pass)
        lines.append(
            f"| `{r['row']}` | `{over['baseline']}` | {over['median_ms']:.1f} ms "
            f"| {iqr[0]:.1f}–{iqr[1]:.1f} ms | {r['cpu']['median_ms']:.1f} ms "
            f"| {r['wall']['median_ms']:.1f} ms | {r['rounds']} "
            f"| {_verdict(over['median_ms'], IMPORT_TARGETS.get(r['row']), ' ms')} |"
        )
    return lines


#: bench_body.py's target: middleware / bare CPU for an agentkey key's canonical 1 MB body.
BODY_TARGETS = {("agentkey key, canonical body", "1MB"): 1.6}


def body_table(data: Mapping[str, Any]) -> list[str]:
    """bench_body.py: server CPU per request, middleware / bare, by body size and kind."""
    lines = _head(
        "body",
        "row",
        "middleware / bare CPU",
        "middleware / bare per request",
        "added",
        "N",
        "target",
    )

    def per(us: float) -> str:
        return f"{us / 1000:.1f} ms" if abs(us) >= 1000 else f"{us:.0f} µs"

    for r in data["rows"]:
        added = r["added_cpu_us"]["median"]
        target = _verdict(r["cpu_ratio"]["median"], BODY_TARGETS.get((r["what"], r["size"])))
        lines.append(
            f"| {r['size']} | {r['what']} | {ratio(r['cpu_ratio'])} "
            f"| {per(r['middleware_cpu_us'])} / {per(r['bare_cpu_us'])} | {per(added)} "
            f"| {r['N']} | {target} |"
        )
    return lines


def generic_table(data: Mapping[str, Any]) -> list[str]:
    """Any results file with rows: each row's name and its medians (IQR), and N."""
    rows = [r for r in data.get("rows", []) if isinstance(r, Mapping)]
    spreads = sorted({k for r in rows for k, v in r.items() if isinstance(v, Mapping)})
    lines = ["| what | " + " | ".join(spreads) + " | N |", "|---" * (len(spreads) + 2) + "|"]
    for r in rows:
        cells = []
        for k in spreads:
            v = r.get(k)
            cells.append(ratio(v) if isinstance(v, Mapping) and "iqr" in v else "")
        name = r.get("what", r.get("row", r.get("server", "?")))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {r.get('N', r.get('rounds', ''))} |")
    return lines


TABLES: dict[str, Callable[[Mapping[str, Any]], list[str]]] = {
    "server": server_table,
    "postgres": server_table,
    "pg_driver": driver_table,
    "invoker": invoker_table,
    "hooks": invoker_table,
    "journal": journal_table,
    "inflight": inflight_table,
    "keys": keys_table,
    "import": import_table,
    "import-source": import_table,
    "body": body_table,
}


def table(name: str, root: Path = ROOT) -> str:
    """The table of ``bench/results/<name>.json``, headed by the line naming its run.

    ``header NAME`` gives the heading line alone (for a table composed by hand)."""
    only_header = name.startswith("header ")
    name = name.removeprefix("header ")
    path = root / "bench" / "results" / f"{name}.json"
    if not path.exists():
        return f"Not run yet: `python bench/bench_{name.split('-')[0]}.py` writes `{path.name}`."
    data = json.loads(path.read_text("utf-8"))
    head = header(name, data, root)
    if only_header:
        return head
    try:
        rows = TABLES.get(name, TABLES.get(name.split("-")[0], generic_table))(data)
    except (KeyError, TypeError, ValueError):  # a results file of a newer shape
        rows = generic_table(data)
    return "\n".join([head, "", *rows])


# --------------------------------------------------------------------------- the page

REGION = re.compile(
    r"(?P<open><!-- report\.py (?P<name>[\w -]+?) -->\n)(?P<body>.*?)"
    r"(?P<close><!-- /report\.py (?P=name) -->)",
    re.S,
)


def regions(text: str) -> list[str]:
    """The names of the generated regions of a page, in order."""
    return [m["name"] for m in REGION.finditer(text)]


def rewrite(text: str, root: Path = ROOT) -> str:
    """``text`` with every generated region's content made again from the results."""
    return REGION.sub(lambda m: m["open"] + table(m["name"], root) + "\n" + m["close"], text)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--write" in args or "--check" in args:
        text = DOC.read_text("utf-8")
        new = rewrite(text)
        if "--check" in args:
            if new != text:
                print(f"{DOC} is not what `python bench/report.py --write` writes")
                return 1
            return 0
        DOC.write_text(new, "utf-8")
        print(f"rewrote {len(regions(new))} regions of {DOC}")
        return 0
    names = args or sorted(TABLES)
    for name in names:
        print(f"<!-- report.py {name} -->")
        print(table(name))
        print(f"<!-- /report.py {name} -->\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
