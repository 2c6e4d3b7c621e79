"""Google ADK pieces for the tests: a scripted model, and one turn of an agent on a session.

The model (ADK's public ``BaseLlm``) asks, in one response, for ``tickets`` identical
charges (two tickets of the same price are two charges), each with a new random
function call id as real models draw them; once it has read a function response in
this turn, it says it is done.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from typing import Any

from google.adk.agents import LlmAgent
from google.adk.apps import App
from google.adk.models import BaseLlm
from google.adk.models.llm_request import LlmRequest
from google.adk.models.llm_response import LlmResponse
from google.adk.runners import Runner
from google.adk.sessions import BaseSessionService
from google.genai import types
from pydantic import BaseModel

from agentkey import AsyncToolInvoker, RetryPolicy, ToolInvoker
from agentkey.integrations.google_adk import STATE_PREFIX, remote_tool

__all__ = ["ARGS", "FAST", "Charge", "ScriptedModel", "records", "turn"]

FAST = RetryPolicy(initial_backoff=0.01, max_backoff=0.05, deadline=30.0)
ARGS = {"amount": 5, "currency": "EUR"}


class Charge(BaseModel):
    """Charge the customer."""

    amount: int
    currency: str = "EUR"


class ScriptedModel(BaseLlm):
    """Asks for ``tickets`` identical charges until the last user turn has an answer."""

    model: str = "scripted"
    tickets: int = 1

    async def generate_content_async(
        self, llm_request: LlmRequest, stream: bool = False
    ) -> AsyncGenerator[LlmResponse, None]:
        answered = False
        for content in llm_request.contents:
            parts = content.parts or []
            if content.role == "user" and any(p.text for p in parts):
                answered = False  # a new user turn: it asks again
            if any(p.function_response is not None for p in parts):
                answered = True
        if answered:
            text = types.Part(text="Charged.")
            yield LlmResponse(content=types.Content(role="model", parts=[text]))
            return
        calls = [
            types.Part(
                function_call=types.FunctionCall(
                    name="charge", args=dict(ARGS), id=f"call_{uuid.uuid4().hex[:12]}"
                )
            )
            for _ in range(self.tickets)
        ]
        yield LlmResponse(content=types.Content(role="model", parts=calls))


def app(invoker: ToolInvoker | AsyncToolInvoker, tickets: int = 1, **options: Any) -> App:
    """The shop: one agent with the charge tool; ``options`` go to the App (resumability)."""
    tool = remote_tool(name="charge", description="charge", args_schema=Charge, invoker=invoker)
    agent = LlmAgent(name="shop", model=ScriptedModel(tickets=tickets), tools=[tool])
    return App(name="shop", root_agent=agent, **options)


async def turn(
    runner: Runner,
    session_id: str,
    text: str | None = "Charge my order.",
    *,
    invocation_id: str | None = None,
) -> list[dict[str, Any]]:
    """One run of the agent on the session (a user message, or a resumed invocation); the
    function responses the model read, in order."""
    message = None if text is None else types.Content(role="user", parts=[types.Part(text=text)])
    responses: list[dict[str, Any]] = []
    async for event in runner.run_async(
        user_id="user-1", session_id=session_id, new_message=message, invocation_id=invocation_id
    ):
        for part in (event.content.parts if event.content else None) or ():
            if part.function_response is not None:
                response = part.function_response
                responses.append({"id": response.id, "response": response.response})
    return responses


async def records(service: BaseSessionService, session_id: str) -> dict[str, dict[str, Any]]:
    """The agentkey records the session's state holds, by function call id."""
    session = await service.get_session(app_name="shop", user_id="user-1", session_id=session_id)
    assert session is not None
    return {
        key[len(STATE_PREFIX) :]: value
        for key, value in session.state.items()
        if key.startswith(STATE_PREFIX)
    }
