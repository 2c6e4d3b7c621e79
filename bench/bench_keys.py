"""Key derivation cost: agentkey against the bare hash any implementation must compute.

Baseline (measured in the same run, interleaved)::

    sha256(json.dumps(args, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True, allow_nan=False).encode()).hexdigest()

These are the bytes of the project's ``python`` profile (CONTRACT section 2) and the
bytes of issue 14's ``json.dumps(sort_keys=True, separators=(",", ":"))``: for valid
arguments ``ensure_ascii=True`` is json.dumps's default and ``allow_nan`` only
decides whether NaN raises. ``ensure_ascii=False`` would give other bytes for
non-ASCII text, so it is not a baseline. The script asserts the bytes are equal
before timing anything.

agentkey rows:

- ``args_hash(args)``: validation (types, NaN, huge ints, key types, cycles) plus
  the canonical bytes and their hash;
- ``PlanSession.step(...).idempotency_key``: the above plus the plan's bookkeeping,
  the frozen ``Step`` and the validated ``StepKey``.

Method: for each input shape, rounds of A B B A (A = baseline, B = agentkey), each
slot timing a batch of calls; a round's ratio is (B1 + B2) / (A1 + A2). The table gives
the median of the per-round ratios, their spread (min-max and interquartile range) and
N (rounds). Slots are timed in thread CPU time, and interleaving keeps the ratio
meaningful on a shared, loaded machine: load that comes and goes hits both sides of a
round alike. Absolute microseconds are shown too but depend on the load; the ratio is
the figure of merit.

``orjson`` (when installed) is shown for information only: it cannot give the
python-profile bytes (it writes non-ASCII as UTF-8, formats floats differently and
refuses integers beyond 64 bits), so it is not a drop-in accelerator.

    python bench/bench_keys.py                  # full run, writes bench/results/keys.json
    python bench/bench_keys.py --smoke          # a few seconds, for CI (writes nothing)
    python bench/bench_keys.py --rounds 30 --out other.json
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for bench._harness

from agentkey import PlanSession, args_hash
from bench._harness import load_line, machine, write_results

orjson: Any
try:
    orjson = importlib.import_module("orjson")
except ImportError:  # optional, informational only
    orjson = None


def _record(i: int) -> dict[str, Any]:
    return {
        "id": i,
        "sku": f"SKU-{i:05d}",
        "name": f"Widget number {i}",
        "price": round(9.99 + i * 0.37, 2),
        "qty": i % 7,
        "tags": ["blue", "large"] if i % 2 else ["red"],
        "gift": i % 3 == 0,
        "note": None,
    }


def _flat(n: int) -> dict[str, Any]:
    """A flat object of ``n`` scalar fields: strings, ints, floats, bools, nulls."""
    kinds: list[Callable[[int], Any]] = [
        lambda i: f"value number {i}",
        lambda i: i * 37,
        lambda i: i / 8 + 0.1,
        lambda i: i % 2 == 0,
        lambda i: None,
    ]
    return {f"field_{i:04d}": kinds[i % len(kinds)](i) for i in range(n)}


SHAPES: dict[str, dict[str, Any]] = {
    "200 B nested": {
        "region": "us-east-1",
        "instance": {
            "type": "m5.large",
            "storage_gb": 200,
            "tags": {"team": "infra", "env": "prod"},
        },
        "subnets": ["subnet-1", "subnet-2", "subnet-3"],
        "spot": False,
        "max_price": 0.052,
    },
    "1 KB flat": _flat(40),
    "1 KB nested": {"order": "ord-77", "lines": [_record(i) for i in range(6)], "rush": True},
    "100 KB flat": _flat(3600),
    "100 KB nested": {"order": "ord-78", "lines": [_record(i) for i in range(720)]},
}


def baseline_hash(args: dict[str, Any]) -> str:
    body = json.dumps(
        args, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    )
    return hashlib.sha256(body.encode()).hexdigest()


# CPU time of this thread: time spent descheduled while other processes run is not
# counted, which matters on a shared machine (cache and frequency effects remain).
_clock = getattr(time, "thread_time", time.perf_counter)


def _time(fn: Callable[[], object], calls: int) -> float:
    start = _clock()
    for _ in range(calls):
        fn()
    return _clock() - start


def _calls_for(fn: Callable[[], object], target: float) -> int:
    """How many calls of ``fn`` take about ``target`` seconds (at least 1)."""
    calls = 1
    while True:
        spent = _time(fn, calls)
        if spent >= target / 4 or calls >= 1 << 20:
            return max(1, round(calls * target / max(spent, 1e-9)))
        calls *= 4


def abba(
    base: Callable[[], object], mine: Callable[[], object], rounds: int, slot: float
) -> dict[str, Any]:
    """Interleave ``base`` (A) and ``mine`` (B) in ABBA rounds; summarise the paired ratios."""
    calls = _calls_for(base, slot)
    _time(mine, calls)  # warm up both sides
    ratios: list[float] = []
    base_us: list[float] = []
    mine_us: list[float] = []
    for _ in range(rounds):
        a1 = _time(base, calls)
        b1 = _time(mine, calls)
        b2 = _time(mine, calls)
        a2 = _time(base, calls)
        ratios.append((b1 + b2) / (a1 + a2))
        base_us.append((a1 + a2) / (2 * calls) * 1e6)
        mine_us.append((b1 + b2) / (2 * calls) * 1e6)
    quart = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {
        "ratio_median": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "ratio_iqr": [round(quart[0], 3), round(quart[2], 3)],
        "baseline_us_median": round(statistics.median(base_us), 2),
        "agentkey_us_median": round(statistics.median(mine_us), 2),
        "rounds": rounds,
        "calls_per_slot": calls,
    }


# Issue 14's targets: the ratio each row must stay under (rows not named have none).
TARGETS: dict[tuple[str, str], float] = {
    **{("args_hash", shape): 1.1 for shape in ("1 KB flat", "1 KB nested")},
    **{("args_hash", shape): 1.1 for shape in ("100 KB flat", "100 KB nested")},
    **{("PlanSession.step().idempotency_key", s): 1.3 for s in ("1 KB flat", "1 KB nested")},
}


def cases() -> list[tuple[str, str, Callable[[dict[str, Any]], object]]]:
    """(row, shape, measured call): what each row of the table compares to the baseline."""
    plan = PlanSession(id="plan-1")
    out: list[tuple[str, str, Callable[[dict[str, Any]], object]]] = []
    for shape in SHAPES:
        out.append(("args_hash", shape, args_hash))
        out.append(
            (
                "PlanSession.step().idempotency_key",
                shape,
                lambda a: plan.step((3, 1), "provision", a).idempotency_key,
            )
        )
        if orjson is not None:
            out.append(
                (
                    "orjson sha256 (not byte-compatible; info)",
                    shape,
                    lambda a: hashlib.sha256(
                        orjson.dumps(a, option=orjson.OPT_SORT_KEYS)
                    ).hexdigest(),
                )
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a few seconds, for CI; no JSON")
    parser.add_argument("--rounds", type=int, default=None, help="ABBA rounds per row (>= 10)")
    parser.add_argument("--slot", type=float, default=None, help="seconds per timed slot")
    parser.add_argument("--out", type=Path, help="results JSON path")
    opts = parser.parse_args()
    rounds = opts.rounds or (3 if opts.smoke else 15)
    slot = opts.slot or (0.002 if opts.smoke else 0.05)
    if not opts.smoke and rounds < 10:
        parser.error("a full run needs --rounds >= 10")

    at_start = machine()
    for shape, args in SHAPES.items():  # same bytes as the baseline, or the bench is void
        size = len(json.dumps(args, sort_keys=True, separators=(",", ":")))
        assert args_hash(args) == baseline_hash(args), shape
        print(f"shape {shape!r}: {size} bytes of canonical JSON")

    rows = []
    print(
        f"\n{'row':44s} {'shape':14s} {'median':>7s} {'min-max':>13s} {'IQR':>13s}"
        f" {'base us':>9s} {'agentkey us':>11s}  N  target"
    )
    for name, shape, fn in cases():
        args = SHAPES[shape]
        result = abba(
            functools.partial(baseline_hash, args), functools.partial(fn, args), rounds, slot
        )
        target = TARGETS.get((name, shape))
        verdict = (
            ""
            if target is None
            else f"<= {target}: " + ("met" if result["ratio_median"] <= target else "MISSED")
        )
        rows.append({"row": name, "shape": shape, **result, "target": target})
        print(
            f"{name:44s} {shape:14s} {result['ratio_median']:6.2f}x "
            f"{result['ratio_min']:5.2f}-{result['ratio_max']:5.2f}x "
            f"{result['ratio_iqr'][0]:5.2f}-{result['ratio_iqr'][1]:5.2f}x "
            f"{result['baseline_us_median']:9.2f} {result['agentkey_us_median']:11.2f}"
            f"  {result['rounds']}  {verdict}"
        )
    if opts.smoke:
        print(load_line(at_start))
        return
    payload = {
        "method": "ABBA rounds timed in thread CPU time; ratio per round = (B1+B2)/(A1+A2); "
        "A = baseline, B = agentkey",
        "baseline": "sha256(json.dumps(args, sort_keys=True, separators=(',', ':'), "
        "ensure_ascii=True, allow_nan=False).encode()).hexdigest()",
        "shapes": {
            s: len(json.dumps(a, sort_keys=True, separators=(",", ":"))) for s, a in SHAPES.items()
        },
        "rows": rows,
    }
    print(f"\nwrote {write_results('keys', payload, opts.out, at_start)}")


if __name__ == "__main__":
    main()
