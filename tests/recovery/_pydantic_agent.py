"""An agent process for the recovery tests: a PydanticAI ``Agent`` calling tools over HTTP.

    python -m tests.recovery._pydantic_agent --url URL --run-id ID [--read-first] [--amount N]

The model is scripted the way a real one behaves: it draws a new random id for every
call; with ``--read-first`` it looks at the balance (``get_balance``) before it charges;
it charges once (``charge``) and then says it is done. The journal is ``$AGENTKEY_JOURNAL``.
The tool returns of the run are printed as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid

from pydantic import BaseModel
from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from agentkey import RetryPolicy, ToolInvoker
from agentkey.integrations.pydantic_ai import remote_tool


class Charge(BaseModel):
    """Charge the customer."""

    amount: int
    currency: str = "EUR"


class Account(BaseModel):
    """Whose balance to read."""

    customer: str = "c-1"


def scripted(read_first: bool, amount: int) -> FunctionModel:
    def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        returned = {
            p.tool_name
            for m in messages
            if isinstance(m, ModelRequest)
            for p in m.parts
            if isinstance(p, ToolReturnPart)
        }
        call_id = f"call_{uuid.uuid4().hex[:12]}"
        if read_first and "get_balance" not in returned:
            return ModelResponse(parts=[ToolCallPart("get_balance", {"customer": "c-1"}, call_id)])
        if "charge" not in returned:
            args = {"amount": amount, "currency": "EUR"}
            return ModelResponse(parts=[ToolCallPart("charge", args, call_id)])
        return ModelResponse(parts=[TextPart("Charged.")])

    return FunctionModel(answer)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--read-first", action="store_true")
    parser.add_argument("--amount", type=int, default=5)
    ns = parser.parse_args()
    retry = RetryPolicy(initial_backoff=0.01, max_backoff=0.05)
    with ToolInvoker(ns.url, route_template="/tools/{tool}", retry=retry, timeout=30) as invoker:
        tools = [
            remote_tool(name="charge", description="charge", args_schema=Charge, invoker=invoker),
            remote_tool(
                name="get_balance",
                description="read the balance",
                args_schema=Account,
                invoker=invoker,
                on_repeat="allow",  # a read: asked again, it is read again
            ),
        ]
        agent = Agent(scripted(ns.read_first, ns.amount), tools=tools)
        result = agent.run_sync("Charge my order.", run_id=ns.run_id)
    for message in result.all_messages():
        for part in getattr(message, "parts", ()):
            if isinstance(part, ToolReturnPart):
                content = part.content
                text = content if isinstance(content, str) else json.dumps(content)
                print(json.dumps({"tool": part.tool_name, "content": text,
                                  "metadata": part.metadata}))  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
