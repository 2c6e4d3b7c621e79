"""Print the Markdown tables of docs/performance.md from the JSON in bench/results/.

    python bench/report.py            # server, postgres, invoker and inflight tables
    python bench/report.py server     # one of them

Each table starts with the line naming the machine, Python and date of its run.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

#: Targets from issue 14, by (agentkey, baseline, mode, concurrency or None for any).
SERVER_TARGETS = {
    ("redis", "bare", "fresh", 64): "≥ 0.7×",
    ("redis", "naive", "fresh", None): "≥ 1.0×",
    ("memory", "bare", "fresh", None): "≥ 0.85×",
    ("postgres", "bare", "fresh", None): "CPU ≤ 2.5×",
    ("postgres", "bare", "replay", None): "CPU ≤ 1.8×",
}


def ratio(s: Mapping[str, Any]) -> str:
    return f"{s['median']:.2f}× ({s['iqr'][0]:.2f}–{s['iqr'][1]:.2f})"


def header(data: Mapping[str, Any]) -> str:
    m = data["machine"]
    load = "–".join(f"{x:.1f}" for x in (m["loadavg_at_start"][0], m["loadavg_at_end"][0]))
    return (
        f"{m['cpu']}, {m['cores']} cores, CPython {m['python']}, uvicorn {m['packages']['uvicorn']}"
        f" (httptools {'yes' if m['packages'].get('httptools') else 'no'}), "
        f"{data['date'][:10]}, load average {load}; `{data['bench']}`"
    )


def server_table(data: Mapping[str, Any]) -> str:
    lines = [
        header(data),
        "",
        "| what | keys | conc. | agentkey req/s | baseline req/s | throughput ratio "
        "| server CPU/req agentkey | baseline | CPU ratio | server / load CPU | N | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
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
        lines.append(
            f"| {r['what']} | {r['mode']} | {r['concurrency']} | {r['agentkey_rps']} "
            f"| {r['baseline_rps']} | {ratio(r['throughput_ratio'])} "
            f"| {r['agentkey_server_cpu_us']:.0f} µs | {r['baseline_server_cpu_us']:.0f} µs "
            f"| {ratio(r['server_cpu_per_request_ratio'])} "
            f"| {r['agentkey_server_cpu_util']:.2f} / {r['load_cpu_util_max']:.2f} "
            f"| {r['N']} | {target} |"
        )
    return "\n".join(lines)


def invoker_table(data: Mapping[str, Any]) -> str:
    lines = [
        header(data),
        "",
        "| what | agentkey | baseline | client CPU/call agentkey | baseline | added "
        "| CPU ratio | throughput ratio | N | target |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        added = r["added_client_cpu_us"]
        target = "≤ 30 µs added" if r["what"].startswith("sync, in-process") else ""
        lines.append(
            f"| {r['what']} | `{r['agentkey']}` | `{r['baseline']}` "
            f"| {r['agentkey_client_cpu_us']:.0f} µs | {r['baseline_client_cpu_us']:.0f} µs "
            f"| {added['median']:+.0f} µs ({added['iqr'][0]:+.0f}–{added['iqr'][1]:+.0f}) "
            f"| {ratio(r['client_cpu_per_call_ratio'])} | {ratio(r['throughput_ratio'])} "
            f"| {r['N']} | {target} |"
        )
    lines += [
        "",
        f"sniffio installed in this run: {data['sniffio_installed']}; one failed "
        f"`import sniffio` costs {data['failed_sniffio_import_us']:.0f} µs.",
    ]
    return "\n".join(lines)


#: What each server of bench_inflight.py answers a duplicate while the first call runs.
IN_FLIGHT = {
    "agentkey": "agentkey middleware: 409, `Retry-After: 1`",
    "agentkey_hold": "agentkey middleware, `hold_in_flight=10`",
    "idemkit": "idemkit, no hold: 423, `Retry-After: 30`",
    "idemkit_hold": "idemkit, default: holds the duplicate ≤ 10 s",
}


def inflight_table(data: Mapping[str, Any]) -> str:
    lines = [
        header(data),
        "",
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
    return "\n".join(lines)


TABLES = {
    "server": server_table,
    "postgres": server_table,
    "invoker": invoker_table,
    "inflight": inflight_table,
}


def main() -> None:
    names = sys.argv[1:] or list(TABLES)
    for name in names:
        path = RESULTS / f"{name}.json"
        if not path.exists():
            print(f"<!-- {path.name}: not run yet (python bench/bench_{name}.py) -->\n")
            continue
        print(f"<!-- {name}: generated by python bench/report.py {name} -->")
        print(TABLES[name](json.loads(path.read_text("utf-8"))))
        print()


if __name__ == "__main__":
    main()
