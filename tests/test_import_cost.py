"""What importing the client costs: the call engine loads with the first invoker, not before.

Each test runs a fresh interpreter, so what is already imported by the test session
does not count. Times are measured by ``bench/bench_import.py``; these tests check
what is loaded, which does not depend on the machine's load.
"""

from __future__ import annotations

import os
import subprocess
import sys

#: What a call needs and ``from agentkey import ToolInvoker, PlanSession`` does not load.
ENGINE = (
    "agentkey.client._flow",
    "agentkey.client._http",
    "agentkey.client._deadline",
    "agentkey.client._hooks",
    "agentkey.client._protocol",
    "agentkey.journal",
    "httpcore",
    "anyio",
    "asyncio",
    "sqlite3",
    "tenacity",
)


def _run(code: str) -> list[str]:
    # A child measured by coverage (the suite's subprocess patch) imports sqlite3 and more for
    # coverage's own sake; what agentkey loads is measured without it.
    env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    return out.stdout.split("\n")


def test_the_invoker_and_plans_import_without_the_engine() -> None:
    """Importing the invoker, plans and policies loads no engine and builds no model yet."""
    lines = _run(
        "import sys\n"
        "from agentkey import (AsyncToolInvoker, PlanSession, PollPolicy, RetryPolicy, Step,\n"
        "    ToolInvoker, ToolResult)\n"
        f"print([m for m in {ENGINE!r} if m in sys.modules])\n"
        "print([m.__name__ for m in (PlanSession, Step, ToolResult) if m.__pydantic_complete__])\n"
    )
    assert lines[:2] == ["[]", "[]"]


def test_the_engine_loads_with_the_first_invoker_and_every_model_works() -> None:
    """The first invoker loads the engine; plans, steps and results then work as ever."""
    lines = _run(
        "import sys, httpx\n"
        "from agentkey import PlanSession, ToolInvoker\n"
        "plan = PlanSession.new()\n"
        "step = plan.step(0, 'charge', {'amount': 5})\n"
        "assert PlanSession.from_json(plan.to_json()).id == plan.id\n"
        "answer = httpx.MockTransport(lambda r: httpx.Response(201, json={'ok': True}))\n"
        "with ToolInvoker('https://tool.test', client=httpx.Client(transport=answer),\n"
        "                 route_template='/tools/{tool}', journal=False) as tools:\n"
        "    loaded = ('agentkey.client._flow', 'agentkey.client._http', 'httpcore')\n"
        "    print([m in sys.modules for m in loaded])\n"
        "    result = tools.invoke(step)\n"
        "print(result.status_code, result.body, result.model_dump()['replayed'])\n"
    )
    assert lines[:2] == ["[True, True, True]", "201 {'ok': True} False"]


def test_a_broken_install_fails_at_the_constructor_not_in_a_call() -> None:
    """A dependency that cannot be imported raises ImportError when the invoker is made."""
    lines = _run(
        "import sys\n"
        "sys.modules['httpcore'] = None  # as if it were not installed\n"
        "from agentkey import PlanSession, ToolInvoker\n"
        "PlanSession.new().step(0, 'charge', {'amount': 5})\n"
        "try:\n"
        "    ToolInvoker('https://tool.test')\n"
        "except ImportError as exc:\n"
        "    print(isinstance(exc, ImportError), 'httpcore' in str(exc))\n"
    )
    assert lines[0] == "True True"
