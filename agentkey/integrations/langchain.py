"""LangChain tools whose calls go through an agentkey invoker.

:func:`remote_tool` turns a tool served over HTTP into a LangChain
``StructuredTool``. Each call becomes one :class:`~agentkey.Step` of a
:class:`~agentkey.PlanSession`: the plan and the step index come from your
code (a value, or a callable given the :class:`ToolCallContext`), the
arguments are normalised by the tool's ``args_schema`` and hashed, and the
invoker sends them with the resulting ``Idempotency-Key``. The model only
chooses arguments; it never sees or shapes the key.

The tool answers in LangChain's ``content_and_artifact`` format: the content
is the tool's JSON body (what the model reads), the artifact a plain dict
describing the call (``idempotency_key``, ``step``, ``outcome``, ``replayed``,
``attempts`` ...), so a replay is visible in the ``ToolMessage``.

Needs the ``langchain`` extra (``pip install 'agentkey-idempotency[langchain]'``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeAlias

from pydantic import BaseModel, ValidationError

from .._canonical import to_jsonable
from .._exceptions import ConfigurationError, InvalidArguments, MissingExtra
from .._invoker import AsyncToolInvoker, ToolInvoker, ToolResult
from .._keys import normalize_step
from .._plan import PlanSession, Step

try:
    from langchain_core.runnables import RunnableConfig
    from langchain_core.tools import InjectedToolArg, StructuredTool
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    if (exc.name or "").partition(".")[0] != "langchain_core":
        raise
    raise MissingExtra("langchain", "langchain_core") from None

__all__ = ["PlanSource", "StepIndexSource", "ToolCallContext", "remote_tool"]

#: Names the tool's own function takes from LangChain; an args_schema may not use them.
_RESERVED_FIELDS = frozenset({"config", "runtime", "callbacks", "run_manager"})


@dataclass(frozen=True, slots=True)
class ToolCallContext:
    """What the runtime knows about one tool call, for choosing its plan and step.

    ``args`` are the arguments after ``args_schema`` validation, as plain JSON
    values (exactly what is hashed). ``config`` is the LangChain
    ``RunnableConfig`` of the call. ``tool_call_id`` and ``state`` are set when
    LangGraph's ``ToolNode`` runs the tool (it injects a ``ToolRuntime``), and
    ``None`` otherwise.
    """

    tool: str
    args: Mapping[str, Any]
    config: Mapping[str, Any]
    tool_call_id: str | None = None
    state: Any = None


#: A plan session, or a callable choosing one per call.
PlanSource: TypeAlias = "PlanSession | Callable[[ToolCallContext], PlanSession]"
#: A step index (``3``, ``(3, 1)``), or a callable computing one per call.
StepIndexSource: TypeAlias = (
    "int | Sequence[int] | Callable[[ToolCallContext], int | Sequence[int]]"
)


def remote_tool(
    *,
    name: str,
    description: str,
    args_schema: type[BaseModel],
    invoker: ToolInvoker | AsyncToolInvoker,
    plan: PlanSource,
    step_index: StepIndexSource,
    path: str | None = None,
    method: str = "POST",
    headers: Mapping[str, str] | None = None,
    return_direct: bool = False,
) -> StructuredTool:
    """Build a LangChain tool that sends each call through ``invoker`` with a deterministic key.

    ``plan`` and ``step_index`` say which step of which plan a call is. Pass
    values when your loop knows them, or callables of :class:`ToolCallContext`
    (for LangGraph, :mod:`agentkey.integrations.langgraph` supplies both). Two
    different calls of one plan must get different step indexes, or the server
    replays one call's answer for the other; a retried call must get the same.

    A :class:`~agentkey.ToolInvoker` serves ``tool.invoke`` and also
    ``tool.ainvoke`` (LangChain runs it in a worker thread); an
    :class:`~agentkey.AsyncToolInvoker` serves ``tool.ainvoke`` only, and
    ``tool.invoke`` raises :class:`~agentkey.ConfigurationError` rather than
    start a nested event loop. ``path``, ``method`` and ``headers`` go to
    ``invoker.invoke``; without ``path`` the invoker's ``routes`` or
    ``route_template`` choose it. agentkey's errors propagate unchanged: a
    final answer from the tool is a :class:`~agentkey.ToolError`, an
    undecided one :class:`~agentkey.OutcomeUnknown` (re-running the call later
    is safe: it gets the same key).
    """
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"name must be a non-empty str, got {name!r}")
    if not isinstance(description, str) or not description.strip():
        raise ConfigurationError(
            f"description of tool {name!r} must be a non-empty str: the model reads it to "
            "decide when to call the tool"
        )
    if not (isinstance(args_schema, type) and issubclass(args_schema, BaseModel)):
        raise ConfigurationError(
            f"args_schema of tool {name!r} must be a pydantic BaseModel subclass, "
            f"got {args_schema!r}"
        )
    clash = sorted(_RESERVED_FIELDS & set(args_schema.model_fields))
    if clash:
        raise ConfigurationError(
            f"args_schema {args_schema.__name__} of tool {name!r} has field(s) {clash} that "
            f"LangChain passes to the tool itself; rename them (the wire name can stay the "
            "same with a pydantic alias in your own schema for the server)"
        )
    if not isinstance(invoker, (ToolInvoker, AsyncToolInvoker)):
        raise ConfigurationError(
            f"invoker of tool {name!r} must be a ToolInvoker or AsyncToolInvoker, got {invoker!r}"
        )
    if not (isinstance(plan, PlanSession) or callable(plan)):
        raise ConfigurationError(
            f"plan of tool {name!r} must be a PlanSession or a callable taking a "
            f"ToolCallContext, got {plan!r}"
        )
    if not callable(step_index):
        normalize_step(step_index)  # a fixed index: check it now (raises InvalidKey)
    call = _Call(name, args_schema, plan, step_index)
    options: dict[str, Any] = {"path": path, "method": method, "headers": headers}

    if isinstance(invoker, ToolInvoker):
        sync_invoker = invoker

        def run(
            *args: Any,
            config: RunnableConfig,
            runtime: Annotated[Any, InjectedToolArg] = None,
            **kwargs: Any,
        ) -> tuple[str, dict[str, Any]]:
            step = call.step(args, kwargs, config, runtime)
            return _answer(sync_invoker.invoke(step, **options))

        return StructuredTool(
            name=name,
            description=description,
            args_schema=args_schema,
            func=run,
            response_format="content_and_artifact",
            return_direct=return_direct,
        )

    async_invoker = invoker

    def refuse(
        *args: Any,
        config: RunnableConfig,
        runtime: Annotated[Any, InjectedToolArg] = None,
        **kwargs: Any,
    ) -> tuple[str, dict[str, Any]]:
        raise ConfigurationError(
            f"tool {name!r} was built with an AsyncToolInvoker, which cannot serve a "
            "synchronous call: use `await tool.ainvoke(...)` (or run the graph with "
            "ainvoke/astream), or build the tool with a ToolInvoker for synchronous use"
        )

    async def arun(
        *args: Any,
        config: RunnableConfig,
        runtime: Annotated[Any, InjectedToolArg] = None,
        **kwargs: Any,
    ) -> tuple[str, dict[str, Any]]:
        step = call.step(args, kwargs, config, runtime)
        return _answer(await async_invoker.invoke(step, **options))

    return StructuredTool(
        name=name,
        description=description,
        args_schema=args_schema,
        func=refuse,
        coroutine=arun,
        response_format="content_and_artifact",
        return_direct=return_direct,
    )


class _Call:
    """Turns one LangChain call into a Step: the key is made here, by the runtime."""

    __slots__ = ("_name", "_plan", "_schema", "_step_index")

    def __init__(
        self,
        name: str,
        schema: type[BaseModel],
        plan: PlanSource,
        step_index: StepIndexSource,
    ) -> None:
        self._name = name
        self._schema = schema
        self._plan = plan
        self._step_index = step_index

    def step(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], config: RunnableConfig, runtime: Any
    ) -> Step:
        if args:
            raise ConfigurationError(
                f"tool {self._name!r} takes its arguments as a dict matching "
                f"{self._schema.__name__}, got a positional value"
            )
        # LangChain validated kwargs against the schema already; dumping them through it
        # gives the plain JSON values that are hashed (defaults included, types coerced).
        try:
            values = to_jsonable(self._schema.model_validate(kwargs))
        except ValidationError as exc:  # e.g. an aliased field without populate_by_name
            raise InvalidArguments(
                f"arguments of tool {self._name!r} do not re-validate against "
                f"{self._schema.__name__} ({exc.error_count()} error(s)); if the schema uses "
                "aliases, set model_config = ConfigDict(populate_by_name=True)",
                path="args",
            ) from exc
        ctx = ToolCallContext(
            tool=self._name,
            args=values,
            config=config,
            tool_call_id=getattr(runtime, "tool_call_id", None),
            state=getattr(runtime, "state", None),
        )
        index = self._step_index(ctx) if callable(self._step_index) else self._step_index
        session = self._plan(ctx) if callable(self._plan) else self._plan
        if not isinstance(session, PlanSession):
            raise ConfigurationError(
                f"the plan callable of tool {self._name!r} returned {session!r}, not a PlanSession"
            )
        return session.step(index, self._name, values, args_model=self._schema)


def _answer(result: ToolResult) -> tuple[str, dict[str, Any]]:
    """The model reads the tool's JSON body; the artifact records how agentkey got it."""
    content = json.dumps(result.body, ensure_ascii=False)
    # Headers and the status URL stay out: artifacts land in checkpoints and traces, and
    # either may carry something (a cookie, a signed URL) that does not belong there.
    artifact = result.model_dump(mode="json", exclude={"headers", "status_url"})
    return content, artifact
