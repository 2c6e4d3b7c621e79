"""An agent process for the recovery tests: an OpenAI Agents SDK run calling a tool over HTTP.

    python -m tests.recovery._openai_agent --url URL --trace-id ID [--tickets N]

The model (the SDK's ``ScriptedModel``) asks, in one response, for ``--tickets``
identical charges (two tickets of the same price are two charges), each with a new
random call id as real models draw them, then says it is done. The journal is
``$AGENTKEY_JOURNAL``. The run's tool outputs are printed as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid

from agents import Agent, RunConfig, Runner
from agents.items import ToolCallOutputItem
from agents.testing import ScriptedModel, assistant_message, function_call
from pydantic import BaseModel

from agentkey import RetryPolicy, ToolInvoker
from agentkey.integrations.openai_agents import remote_tool


class Charge(BaseModel):
    """Charge the customer."""

    amount: int
    currency: str = "EUR"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--trace-id", required=True)
    parser.add_argument("--tickets", type=int, default=1)
    ns = parser.parse_args()
    calls = [
        function_call(
            "charge", {"amount": 5, "currency": "EUR"}, call_id=f"call_{uuid.uuid4().hex[:12]}"
        )
        for _ in range(ns.tickets)
    ]
    model = ScriptedModel([calls, [assistant_message("Charged.")]])
    retry = RetryPolicy(initial_backoff=0.01, max_backoff=0.05)
    with ToolInvoker(ns.url, route_template="/tools/{tool}", retry=retry, timeout=30) as invoker:
        tool = remote_tool(name="charge", description="charge", args_schema=Charge, invoker=invoker)
        agent = Agent(name="shop", model=model, tools=[tool])
        config = RunConfig(trace_id=ns.trace_id, tracing_disabled=True)
        result = Runner.run_sync(agent, "Two tickets, please.", run_config=config)
    for item in result.new_items:
        if isinstance(item, ToolCallOutputItem):
            print(json.dumps({"output": str(item.output), "record": item.custom_data}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
