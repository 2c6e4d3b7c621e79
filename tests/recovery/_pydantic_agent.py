"""An agent process for the recovery tests: a PydanticAI ``Agent`` calling tools over HTTP.

    python -m tests.recovery._pydantic_agent --url URL [--run-id ID] [--read-first]
        [--amount N] [--history PATH [--repair]] [--conversation-id ID]

The model is scripted the way a real one behaves: it draws a new random id for every
call; with ``--read-first`` it looks at the balance (``get_balance``) before it charges;
it charges once (``charge``) and then says it is done. The journal is ``$AGENTKEY_JOURNAL``.

``--history PATH`` persists the run's messages the way PydanticAI's docs teach
(``ModelMessagesTypeAdapter``), after every step of ``agent.iter``; when the file exists,
the process continues from it: ``message_history=`` as saved, no new prompt (PydanticAI
runs the calls its last response left unanswered), or with ``--repair``
``repair_messages()`` and the user's prompt sent again. The tool returns of the run are
printed as JSON lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
    repair_messages,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from agentkey import RetryPolicy, ToolInvoker
from agentkey.integrations.pydantic_ai import remote_tool

PROMPT = "Charge my order."


class Charge(BaseModel):
    """Charge the customer."""

    amount: int
    currency: str = "EUR"


class Account(BaseModel):
    """Whose balance to read."""

    customer: str = "c-1"


def _real(part: ToolReturnPart) -> bool:
    """A return the tool gave (not one repair_messages() made up for a dangling call)."""
    metadata = part.metadata if isinstance(part.metadata, dict) else {}
    return not metadata.get("pydantic_ai_synthesized_tool_return")


def scripted(read_first: bool, amount: int) -> FunctionModel:
    def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        returned: set[str] = set()
        for m in messages:  # what came back since the user's last prompt
            if not isinstance(m, ModelRequest):
                continue
            if any(isinstance(p, UserPromptPart) for p in m.parts):
                returned = set()
            returned |= {p.tool_name for p in m.parts if isinstance(p, ToolReturnPart) and _real(p)}
        call_id = f"call_{uuid.uuid4().hex[:12]}"
        if read_first and "get_balance" not in returned:
            return ModelResponse(parts=[ToolCallPart("get_balance", {"customer": "c-1"}, call_id)])
        if "charge" not in returned:
            args = {"amount": amount, "currency": "EUR"}
            return ModelResponse(parts=[ToolCallPart("charge", args, call_id)])
        return ModelResponse(parts=[TextPart("Charged.")])

    return FunctionModel(answer)


def _save(history: Path, messages: list[ModelMessage]) -> None:
    history.write_bytes(ModelMessagesTypeAdapter.dump_json(messages))


def _options(history: Path, ns: argparse.Namespace) -> tuple[str | None, dict[str, Any]]:
    """The prompt and options of the run: continued from the saved history, if any."""
    options: dict[str, Any] = {}
    prompt: str | None = PROMPT
    if history.exists():
        saved = ModelMessagesTypeAdapter.validate_json(history.read_bytes())
        if ns.repair:
            options["message_history"] = repair_messages(saved)
        else:
            options["message_history"], prompt = saved, None
    if ns.conversation_id:
        options["conversation_id"] = ns.conversation_id
    if ns.run_id:
        options["run_id"] = ns.run_id
    return prompt, options


async def _iterate(agent: Agent[None, str], history: Path, ns: argparse.Namespace) -> Any:
    """The run, its messages saved after every step (and continued from the file)."""
    prompt, options = _options(history, ns)
    async with agent.iter(prompt, **options) as run:
        async for _node in run:
            _save(history, run.all_messages())
    assert run.result is not None
    return run.result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--run-id")
    parser.add_argument("--conversation-id")
    parser.add_argument("--history", type=Path)
    parser.add_argument("--repair", action="store_true")
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
        if ns.history is not None:
            result = asyncio.run(_iterate(agent, ns.history, ns))
        else:
            options = {"conversation_id": ns.conversation_id} if ns.conversation_id else {}
            result = agent.run_sync(PROMPT, run_id=ns.run_id, **options)
    for message in result.all_messages():
        for part in getattr(message, "parts", ()):
            if isinstance(part, ToolReturnPart) and _real(part):
                content = part.content
                text = content if isinstance(content, str) else json.dumps(content)
                print(json.dumps({"tool": part.tool_name, "content": text,
                                  "metadata": part.metadata}))  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
