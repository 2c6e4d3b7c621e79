"""Key derivation cost: agentkey's step key vs the bare hash any implementation must compute.

Baseline: ``sha256(json.dumps(args, sort_keys=True, separators=(",", ":")))``, with no
validation, no type conversion and no key formatting. The ratio is agentkey's price for
checking every value (NaN, sets, paths) and building a validated ``StepKey``.

    python bench/bench_keys.py            # full run
    python bench/bench_keys.py --smoke    # a quick run for CI
"""

from __future__ import annotations

import argparse
import hashlib
import json
import timeit
from typing import Any

from agentkey import PlanSession, step_key

ARGS: dict[str, Any] = {
    "region": "us-east-1",
    "instance": {"type": "m5.large", "storage_gb": 200, "tags": {"team": "infra", "env": "prod"}},
    "subnets": ["subnet-1", "subnet-2", "subnet-3"],
    "spot": False,
    "max_price": 0.052,
}


def baseline() -> str:
    body = json.dumps(ARGS, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def agentkey_key() -> str:
    return step_key("plan-1", (3, 1), ARGS)


def agentkey_step(plan: PlanSession) -> str:
    return plan.step((3, 1), "provision", ARGS).idempotency_key


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="few iterations, for CI")
    number = 200 if parser.parse_args().smoke else 20_000
    plan = PlanSession(id="plan-1")
    assert agentkey_key().endswith(baseline())

    def best(fn: Any) -> float:
        return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6

    base = best(baseline)
    key = best(agentkey_key)
    step = best(lambda: agentkey_step(plan))
    print(f"bench_keys ({number} calls x 5, best run, microseconds per call)")
    print(f"  baseline sha256(json.dumps)   {base:8.2f} us")
    print(f"  agentkey step_key()           {key:8.2f} us   ratio {key / base:5.2f}x")
    print(f"  agentkey PlanSession.step()   {step:8.2f} us   ratio {step / base:5.2f}x")


if __name__ == "__main__":
    main()
