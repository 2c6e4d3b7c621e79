"""CPU per computed wait: tenacity as the formula source, tenacity as the engine, no tenacity.

Issue 36 item 5 asks whether tenacity can be the retry and wait engine. The rows:

- ``formula``: the capped exponential written inline (the baseline: what a wait costs
  with no library at all);
- ``backoff``: ``Backoff.delay`` as shipped: tenacity's ``wait_exponential`` (overflow-safe
  for any attempt count) called with a ``RetryCallState`` built for the wait;
- ``tenacity-engine``: tenacity as the engine, ``for attempt in Retrying(...)`` with
  ``sleep`` a no-op and the attempt failing, per wait (what using it as the engine
  would cost, before any of agentkey's own rules: the deadline, in-flight answers that
  spend no attempt, the last question before the deadline).

Why the engine is not used (the figures are the smaller reason): tenacity's engine reads
the real ``time.monotonic()`` in every ``RetryCallState`` and its statistics, and its
jittered waits draw from the global ``random`` module, so it cannot run on the injected
``Clock`` (``FakeClock`` in tests); and it owns the loop and the sleep, while agentkey's
protocol core yields its waits to a driver and never sleeps.

Method: palindrome rounds (``bench._harness.palindrome``), each slot a batch of waits
timed in thread CPU time; a row's ratio is its two slots over the ``formula`` row's two
slots in the same round. The median of the per-round ratios is the figure of merit;
the load average is printed with it.

    python bench/bench_schedule.py            # 15 rounds
    python bench/bench_schedule.py --smoke    # a few rounds
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tenacity

from agentkey._schedule import Backoff
from bench._harness import palindrome, spread

INITIAL, CAP, BASE = 0.5, 10.0, 2.0
WAITS = 8  # one step's waits: RetryPolicy().max_attempts


_BACKOFF = Backoff(INITIAL, CAP, BASE, jitter=False)
_WAIT = tenacity.wait_exponential(multiplier=INITIAL, max=CAP, exp_base=BASE)


def formula(attempt: int) -> float:
    try:
        return min(CAP, INITIAL * BASE ** (attempt - 1))
    except OverflowError:
        return CAP


def backoff(attempt: int) -> float:
    return _BACKOFF.delay(attempt)


def _no_sleep(seconds: float) -> None:
    return None


def tenacity_engine() -> float:
    """WAITS waits computed by tenacity's own engine (the attempt fails each time)."""
    total = 0.0
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(WAITS + 1),
        wait=_WAIT,
        sleep=_no_sleep,
        reraise=True,
    )
    try:
        for attempt in retrying:
            with attempt:
                total += attempt.retry_state.upcoming_sleep
                raise ValueError
    except ValueError:
        pass
    return total


def _batch_per_wait(name: str, batches: int) -> float:
    start = time.thread_time()
    if name == "tenacity-engine":
        for _ in range(batches):
            tenacity_engine()
    else:
        one: Callable[[int], float] = formula if name == "formula" else backoff
        for _ in range(batches):
            for attempt in range(1, WAITS + 1):
                one(attempt)
    return (time.thread_time() - start) / (batches * WAITS)


def main() -> None:
    smoke = "--smoke" in sys.argv
    rounds, batches = (3, 200) if smoke else (15, 3000)
    names = ["formula", "backoff", "tenacity-engine"]
    assert [formula(n) for n in range(1, 9)] == [backoff(n) for n in range(1, 9)]
    assert formula(10**6) == backoff(10**6) == CAP
    print(f"loadavg at start: {os.getloadavg()}")
    ratios: dict[str, list[float]] = {name: [] for name in names[1:]}
    micros: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        slots: dict[str, float] = dict.fromkeys(names, 0.0)
        for name in palindrome(names):
            per_wait = _batch_per_wait(name, batches)
            slots[name] += per_wait
            micros[name].append(per_wait * 1e6)
        for name in names[1:]:
            ratios[name].append(slots[name] / slots["formula"])
    for name in names:
        line = f"{name:16} {statistics.median(micros[name]):7.2f} us CPU per wait"
        if name in ratios:
            s = spread(ratios[name])
            line += f"   {s['median']:.1f}x formula (IQR {s['iqr'][0]:.1f}-{s['iqr'][1]:.1f})"
        print(line)
    print(f"rounds: {rounds}; loadavg at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
