"""An agent process for the recovery tests: an OpenAI Agents SDK run calling a tool over HTTP.

    python -m tests.recovery._openai_agent --url URL --trace-id ID [--tickets N]
        [--session PATH [--session-id ID] [--group]]

The model (the SDK's ``ScriptedModel``) asks, in one response, for ``--tickets``
identical charges (two tickets of the same price are two charges), each with a new
random call id as real models draw them, then says it is done. The journal is
``$AGENTKEY_JOURNAL``. With ``--session`` the conversation is kept in the SDK's
``SQLiteSession`` at PATH (its docs' way to keep a conversation across runs and restarts),
and the user's message is sent again in it; ``--group`` links the run's trace to the
session (``RunConfig(group_id=session.session_id)``). The run's tool outputs are printed
as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid

from agents import Agent, RunConfig, Runner, SQLiteSession
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
    parser.add_argument("--session")
    parser.add_argument("--session-id", default="conversation_123")
    parser.add_argument("--group", action="store_true", help="group_id= the session's id")
    ns = parser.parse_args()
    session = SQLiteSession(ns.session_id, ns.session) if ns.session else None
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
        group = session.session_id if session is not None and ns.group else None
        config = RunConfig(trace_id=ns.trace_id, group_id=group, tracing_disabled=True)
        result = Runner.run_sync(agent, "Two tickets, please.", run_config=config, session=session)
    for item in result.new_items:
        if isinstance(item, ToolCallOutputItem):
            print(json.dumps({"output": str(item.output), "record": item.custom_data}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
