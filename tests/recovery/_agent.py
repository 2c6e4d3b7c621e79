"""An agent process for the recovery tests: LangGraph's prebuilt agent on a SQLite checkpointer.

    python -m tests.recovery._agent --db PATH --url URL --thread T --text TEXT
        [--message-id ID] [--durability sync|async|exit] [--hook] [--amount N]

The model is scripted the way a real one behaves: asked by the user, it calls
``charge`` (a new random call id each time, as real models draw them) unless the
history already holds an answer to a charge after the user's last message; then it
says it is done. The journal is ``$AGENTKEY_JOURNAL``. The final messages are printed
as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
import warnings
from collections.abc import Sequence
from typing import Any, Literal, cast

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.sqlite import SqliteSaver
from pydantic import BaseModel

from agentkey import RetryPolicy, ToolInvoker
from agentkey.integrations.langgraph import pending_calls_hook, remote_tool


class Charge(BaseModel):
    """Charge the customer."""

    amount: int
    currency: str = "EUR"


class ScriptedModel(BaseChatModel):
    """Calls ``charge`` once per user request, like a model that reads its history."""

    amount: int = 5

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> ScriptedModel:
        return self

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
        after_user: list[BaseMessage] = []
        for message in messages:
            after_user = [] if isinstance(message, HumanMessage) else [*after_user, message]
        if any(isinstance(m, ToolMessage) and m.name == "charge" for m in after_user):
            reply = AIMessage("Charged.")
        else:
            call = {
                "name": "charge",
                "args": {"amount": self.amount, "currency": "EUR"},
                "id": f"call_{uuid.uuid4().hex[:12]}",
                "type": "tool_call",
            }
            reply = AIMessage("", tool_calls=[call])
        return ChatResult(generations=[ChatGeneration(message=reply)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--thread", required=True)
    parser.add_argument("--text", required=True)
    parser.add_argument("--message-id")
    parser.add_argument("--durability", default="sync")
    parser.add_argument("--hook", action="store_true")
    parser.add_argument("--amount", type=int, default=5)
    ns = parser.parse_args()
    warnings.simplefilter("ignore")  # create_react_agent's move to langchain.agents
    from langgraph.prebuilt import create_react_agent

    retry = RetryPolicy(initial_backoff=0.01, max_backoff=0.05)
    invoker = ToolInvoker(ns.url, route_template="/tools/{tool}", retry=retry, timeout=30)
    tools = [remote_tool(name="charge", description="charge", args_schema=Charge, invoker=invoker)]
    with SqliteSaver.from_conn_string(ns.db) as saver:
        agent = create_react_agent(
            ScriptedModel(amount=ns.amount),
            tools,
            checkpointer=saver,
            pre_model_hook=pending_calls_hook(tools) if ns.hook else None,
        )
        message = (
            HumanMessage(ns.text, id=ns.message_id) if ns.message_id else HumanMessage(ns.text)
        )
        config: RunnableConfig = {"configurable": {"thread_id": ns.thread}}
        durability = cast(Literal["sync", "async", "exit"], ns.durability)
        final: Any = agent.invoke({"messages": [message]}, config, durability=durability)
    for item in final["messages"]:
        print(json.dumps({"type": item.type, "id": item.id, "content": str(item.content),
                          "artifact": getattr(item, "artifact", None),
                          "tool_call_id": getattr(item, "tool_call_id", None)}))  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
