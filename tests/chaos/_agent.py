"""One chaos agent process (``python -m tests.chaos._agent <config.json> <agent index>``).

It runs the (plan, replica) pairs the config assigns to it, many at once: each replica
restores its plan with ``PlanSession.from_json`` and calls the plan's steps in order
through one ``AsyncToolInvoker`` (short-lived client-credentials tokens, the fault proxy
as ``base_url``). Each finished step appends one JSON line to ``results-<index>.jsonl``
with a single ``O_APPEND`` write; a restarted agent (after a SIGKILL) skips the steps
already there and resends the one it was killed in, with the same key.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from agentkey import AgentKeyError, AsyncToolInvoker, PlanSession, RetryPolicy
from agentkey.auth import ClientCredentials


def _done(path: Path) -> set[tuple[int, int, int]]:
    done: set[tuple[int, int, int]] = set()
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # cannot happen with one write per line; tolerate it anyway
                continue
            done.add((row["p"], row["r"], row["s"]))
    return done


async def run(config: dict[str, Any], index: int) -> None:
    results = Path(config["results_dir"]) / f"results-{index}.jsonl"
    done = _done(results)
    out = os.open(results, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    started = os.open(results.with_suffix(".started"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    auth = ClientCredentials(
        config["idp_url"] + "/token", config["client_id"], config["client_secret"]
    )
    retry = RetryPolicy(
        max_attempts=config["max_attempts"],
        deadline=config["deadline"],
        initial_backoff=0.05,
        max_backoff=0.5,
        max_retry_after=2.0,
    )
    plans = config["plans"]
    async with AsyncToolInvoker(
        config["proxy_url"],
        auth=auth,
        retry=retry,
        timeout=config["read_timeout"],
        route_template="/tools/{tool}",
        hooks=[],
    ) as invoker:

        async def replica(p: int, r: int) -> None:
            session = PlanSession.from_json(plans[p]["plan"])
            caller = {"X-Chaos-Caller": f"{p}.{r}"}  # names the replica in the proxy log
            for s, (tool, args) in enumerate(plans[p]["steps"]):
                if (p, r, s) in done:
                    continue
                step = session.step(s, tool, args)
                row: dict[str, Any] = {"a": index, "p": p, "r": r, "s": s}
                row["k"] = step.idempotency_key
                row["t0"] = time.time()
                os.write(started, f"{p} {r} {s} {row['t0']:.3f}\n".encode("ascii"))
                try:
                    result = await invoker.invoke(step, headers=caller)
                except AgentKeyError as exc:
                    row["res"] = type(exc).__name__
                    row["typed"] = True
                    row["status"] = getattr(exc, "status_code", None)
                    row["msg"] = str(exc)[:300]
                except Exception as exc:  # the suite counts untyped errors
                    row["res"] = type(exc).__name__
                    row["typed"] = False
                    row["msg"] = "".join(traceback.format_exception(exc))[-2000:]
                else:
                    row["res"] = "replayed" if result.replayed else "executed"
                    row["typed"] = True
                    row["status"] = result.status_code
                    row["exec"] = result.body.get("exec") if isinstance(result.body, dict) else None
                    row["attempts"] = result.attempts
                row["t1"] = time.time()
                os.write(out, (json.dumps(row) + "\n").encode("utf-8"))

        pending = iter(config["assign"][str(index)])

        async def worker() -> None:
            for p, r in pending:  # one iterator shared by the workers: each pair runs once
                await replica(p, r)

        await asyncio.gather(*(worker() for _ in range(config["concurrency"])))


if __name__ == "__main__":
    cfg = json.loads(Path(sys.argv[1]).read_text())
    asyncio.run(run(cfg, int(sys.argv[2])))
