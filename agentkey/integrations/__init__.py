"""Adapters that route an agent framework's tool calls through an agentkey invoker.

- :mod:`agentkey.integrations.langchain` (extra ``langchain``): turn a remote
  HTTP tool into a LangChain tool whose calls carry a runtime-built
  ``Idempotency-Key``, with the plan and step given by your code.
- :mod:`agentkey.integrations.langgraph` (extra ``langgraph``): the same tool,
  with the plan taken from the graph's ``thread_id`` and the thread's first
  message (one plan per lifetime of a thread), and the step from the
  checkpointed superstep, the node and tool, and the call's number among the
  identical calls of the model's message.
- :mod:`agentkey.integrations.mcp` (extra ``mcp``): MCP ``tools/call`` with the
  key in the request's ``_meta``, on the client (``IdempotentSession``) and on
  the server (``IdempotentToolsMiddleware``).
- :mod:`agentkey.integrations.pydantic_ai` (extra ``pydantic-ai``): PydanticAI
  tools keyed on the run's ``run_id`` and the call's id, settled against the
  journal and the run's messages.
- :mod:`agentkey.integrations.openai_agents` (extra ``openai-agents``): OpenAI
  Agents SDK function tools keyed on ``RunConfig.trace_id`` and the call's id,
  settled against the journal, the run's input and the run's own calls.
- :mod:`agentkey.integrations.otel` (extra ``otel``): ``OTelHook``, spans and
  ``traceparent`` for the invoker, token providers and the middleware.

The LangChain and LangGraph adapters answer a call the model repeats (same
tool and arguments as an earlier step of the plan) by the tool's
``on_repeat`` policy, and give a tool's own refusal to the model as an error
``ToolMessage`` with the server's reason.

Neither ``import agentkey`` nor this package imports a framework; each
module does when it is imported, and raises :class:`agentkey.MissingExtra`
naming the extra to install when the framework is missing.
"""

from __future__ import annotations

__all__: list[str] = []
