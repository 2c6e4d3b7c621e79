"""CrewAI pieces for the tests: a scripted model, and a shop crew inside a persisted Flow.

The model (CrewAI's public ``BaseLLM``) answers in CrewAI's own text protocol: at the start
of a task's execution it asks for the charge (``Action: charge``), and once it has read the
tool's answer it gives the final answer. A task whose guardrail refuses the first answer is
executed again, and its model asks for the charge again, as a real model does.
"""

from __future__ import annotations

import os

# CrewAI sends telemetry and traces unless told not to; these tests reach only loopback.
os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")
os.environ.setdefault("CREWAI_TRACING_ENABLED", "false")
os.environ.setdefault("OTEL_SDK_DISABLED", "true")

import json
from typing import Any, cast

from crewai import Agent, Crew, Task
from crewai.flow.flow import Flow, start
from crewai.flow.persistence import persist
from crewai.llms.base_llm import BaseLLM
from crewai.tasks.task_output import TaskOutput
from pydantic import BaseModel

from agentkey import RetryPolicy, ToolInvoker
from agentkey.integrations.crewai import flow_plan, remote_tool

__all__ = ["ARGS", "FAST", "Charge", "ScriptedLLM", "crew", "shop_flow"]

FAST = RetryPolicy(initial_backoff=0.01, max_backoff=0.05, deadline=30.0)
ARGS = {"amount": 5, "currency": "EUR"}


class Charge(BaseModel):
    """Charge the customer."""

    amount: int
    currency: str = "EUR"


class ScriptedLLM(BaseLLM):
    """Asks for the charge until it has read the tool's answer in this execution; with
    ``failures``, its service fails that many times once it has read the answer."""

    failures: int = 0

    def call(self, messages: Any, *args: Any, **kwargs: Any) -> str:
        if isinstance(messages, list) and any(m.get("role") == "assistant" for m in messages):
            if self.failures > 0:
                self.failures -= 1
                raise RuntimeError("the model's service is unavailable")
            return "Thought: The card is charged.\nFinal Answer: Charged."
        return f"Thought: I must charge the card.\nAction: charge\nAction Input: {json.dumps(ARGS)}"


def crew(tool: Any, *, guardrail_retries: int = 0, model_failures: int = 0) -> Crew:
    """A one-agent, one-task crew; with ``guardrail_retries``, the task's guardrail refuses
    the first answer once, and CrewAI executes the task again; with ``model_failures``, the
    model fails after the charge, and the agent executes the task again (``max_retry_limit``)."""
    agent = Agent(
        role="cashier",
        goal="charge the customer",
        backstory="a careful cashier",
        llm=ScriptedLLM(model="scripted", failures=model_failures),
        tools=[tool],
        max_retry_limit=max(model_failures, 1),
        verbose=False,
    )
    refused: list[str] = []

    def once(output: TaskOutput) -> tuple[bool, Any]:
        if len(refused) < guardrail_retries:
            refused.append(output.raw)
            return False, "Say which card was charged."
        return True, output.raw

    task = Task(
        description="Charge the customer 5 EUR.",
        expected_output="what was charged",
        agent=agent,
        # A lambda: CrewAI reads a guardrail's return annotation, which is a string here.
        guardrail=(lambda output: once(output)) if guardrail_retries else None,
        guardrail_max_retries=max(guardrail_retries, 1),
    )
    return Crew(agents=[agent], tasks=[task], verbose=False)


class ShopState(BaseModel):
    id: str = ""
    records: list[dict[str, Any]] = []


def shop_flow(invoker: ToolInvoker, persistence: Any = None) -> Flow[ShopState]:
    """One job: a flow whose first step runs the shop crew, its tool keyed by the flow's state
    id (``flow_plan(self)``); with ``persistence``, the flow is ``@persist``-ed there."""

    class ShopFlow(Flow[ShopState]):
        @start()
        def charge(self) -> None:
            tool = remote_tool(
                name="charge",
                description="Charge the customer's card.",
                args_schema=Charge,
                invoker=invoker,
                plan=flow_plan(self),
            )
            crew(tool).kickoff()
            self.state.records = cast(Any, tool).records

    made: Any = ShopFlow if persistence is None else persist(persistence)(ShopFlow)
    flow: Flow[ShopState] = made()
    return flow
