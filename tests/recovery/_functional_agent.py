"""An agent process for the recovery tests: LangGraph's Functional API on a SQLite checkpointer.

    python -m tests.recovery._functional_agent --db PATH --url URL --thread T --text TEXT
        [--durability sync|async|exit] [--amount N] [--on-repeat replay|raise|allow]
        [--explicit]

The agent is the one LangGraph's docs build with ``@entrypoint`` and ``@task``: a task
asks the model, a task per tool call runs the tool (``tool.invoke(tool_call)``), and the
conversation is saved with ``entrypoint.final``. The model is scripted the way a real one
behaves: asked by the user, it calls ``charge`` (a new random call id each time) unless
the history holds an answer to a charge after the user's last message. The journal is
``$AGENTKEY_JOURNAL``. The final messages are printed as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Literal, cast

from langchain_core.messages import BaseMessage, HumanMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.func import entrypoint, task
from langgraph.graph.message import add_messages

from agentkey import PlanSession, RetryPolicy, ToolInvoker
from agentkey.integrations.langgraph import call_step, remote_tool
from tests.recovery._agent import Charge, ScriptedModel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--thread", required=True)
    parser.add_argument("--text", required=True)
    parser.add_argument("--durability", default="async")
    parser.add_argument("--amount", type=int, default=5)
    parser.add_argument("--on-repeat", default="replay")
    parser.add_argument("--explicit", action="store_true", help="plan= and step_index= given")
    ns = parser.parse_args()
    explicit: dict[str, Any] = {}
    if ns.explicit:  # the recipe of agentkey's docs before issue 38: the thread as the plan
        plan = PlanSession.from_external_id(f"functional-{ns.thread}")
        explicit = {"plan": plan, "step_index": call_step}
    retry = RetryPolicy(initial_backoff=0.01, max_backoff=0.05)
    invoker = ToolInvoker(ns.url, route_template="/tools/{tool}", retry=retry, timeout=30)
    charge = remote_tool(
        name="charge", description="charge", args_schema=Charge, invoker=invoker,
        on_repeat=ns.on_repeat, **explicit,
    )  # fmt: skip
    tools_by_name = {charge.name: charge}
    model = ScriptedModel(amount=ns.amount)

    @task
    def call_model(messages: list[BaseMessage]) -> Any:
        return model.invoke(messages)

    @task
    def call_tool(tool_call: dict[str, Any]) -> ToolMessage:
        return cast(ToolMessage, tools_by_name[tool_call["name"]].invoke(tool_call))

    with SqliteSaver.from_conn_string(ns.db) as saver:

        @entrypoint(checkpointer=saver)
        def agent(messages: Any, *, previous: Any = None) -> Any:
            if previous is not None:
                messages = add_messages(previous, messages)
            response = call_model(messages).result()
            while response.tool_calls:
                results = [call_tool(call).result() for call in response.tool_calls]
                messages = add_messages(messages, [response, *results])
                response = call_model(messages).result()
            messages = add_messages(messages, response)
            return entrypoint.final(value=messages, save=messages)

        config: RunnableConfig = {"configurable": {"thread_id": ns.thread}}
        durability = cast(Literal["sync", "async", "exit"], ns.durability)
        final: Any = agent.invoke([HumanMessage(ns.text)], config, durability=durability)
    for item in final:
        print(json.dumps({"type": item.type, "id": item.id, "content": str(item.content),
                          "artifact": getattr(item, "artifact", None),
                          "tool_call_id": getattr(item, "tool_call_id", None)}))  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
