"""Adapters that route an agent framework's tool calls through an agentkey invoker.

- :mod:`agentkey.integrations.langchain` (extra ``langchain``): turn a remote
  HTTP tool into a LangChain tool whose calls carry a runtime-built
  ``Idempotency-Key``, with the plan and step given by your code.
- :mod:`agentkey.integrations.langgraph` (extra ``langgraph``): the same tool,
  with the plan taken from the graph's ``thread_id`` and the step from the
  checkpointed superstep and the call's position in the model's message.

Neither ``import agentkey`` nor this package imports a framework; each
module does when it is imported, and raises :class:`agentkey.MissingExtra`
naming the extra to install when the framework is missing.
"""

from __future__ import annotations

__all__: list[str] = []
