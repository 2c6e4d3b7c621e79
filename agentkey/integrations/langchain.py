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
describing the call (``tool``, ``idempotency_key``, ``step``, ``outcome``,
``replayed``, ``repeat_of``, ``attempts`` ...), so a replay is visible in the
``ToolMessage``; the same fields go into the metadata of the tool's LangChain
run, so tracing shows them.

A tool's final refusal (a :class:`~agentkey.ToolError` other than a key
problem) reaches the model as an error ``ToolMessage`` carrying the server's
short reason, never the key: the tool raises LangChain's ``ToolException``
from the agentkey error and handles it (``handle_tool_error``). An undecided
outcome (:class:`~agentkey.OutcomeUnknown`) and the key problems
(:class:`~agentkey.KeyRejected`, :class:`~agentkey.PayloadMismatch`) stay
fatal: the model cannot fix them, an operator has to look.

With :class:`LangChainHook` among the invoker's ``hooks``, the invoker's
retries, 409 waits, polls, replays and give-ups during a tool's call reach
that tool's LangChain run: as custom events (``agentkey_retry``,
``agentkey_poll``, ``agentkey_replay``, ``agentkey_give_up``) for every
callback handler and ``astream_events``, and as events of the tool's run for
tracers that keep runs (LangSmith's ``LangChainTracer``).

Needs the ``langchain`` extra (``pip install 'agentkey-idempotency[langchain]'``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Annotated, Any, TypeAlias

from pydantic import BaseModel, Field, ValidationError

from .._canonical import args_hash, to_jsonable
from .._exceptions import ConfigurationError, InvalidArguments, ToolError
from .._plan import OnRepeat, PlanSession, Step
from ..client._flow import Pick
from ..client._hooks import GiveUpEvent, PollEvent, ReplayEvent, RetryEvent
from ..client._invoker import AsyncToolInvoker, ToolInvoker, ToolResult
from ..client._net import redact_url
from ._adapter import (
    call_record,
    check_sources,
    check_tool,
    make_step,
    missing_extra,
    refusal,
    repeat_note,
    server_reason,
    unsettled,
)
from ._identity import CallSite, adopted, in_thread, unfinished_elsewhere
from ._settle import NOT_SENT, Chooser, Repeat

try:
    from langchain_core.callbacks import AsyncCallbackManager
    from langchain_core.messages import ToolMessage
    from langchain_core.runnables import RunnableConfig
    from langchain_core.tools import InjectedToolArg, StructuredTool, ToolException
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise missing_extra(exc, "langchain", "langchain_core") from None

_logger = logging.getLogger("agentkey")

__all__ = [
    "LangChainHook",
    "ToolCallContext",
    "remote_tool",
]

#: Names the tool's own function takes from LangChain; an args_schema may not use them.
_RESERVED_FIELDS = frozenset({"config", "runtime", "callbacks", "run_manager"})


@dataclass(frozen=True, slots=True)
class ToolCallContext:
    """What the runtime knows about one tool call, for choosing its plan and step.

    ``args`` are the arguments after ``args_schema`` validation, as plain JSON
    values (exactly what is hashed). ``config`` is the LangChain
    ``RunnableConfig`` of the call (empty when none was given).
    ``tool_call_id`` is set whenever the tool was invoked with a tool call
    (``tool.invoke({"name": ..., "args": ..., "id": ..., "type": "tool_call"})``);
    ``state`` is the graph state when LangGraph's ``ToolNode`` runs the tool
    (it injects a ``ToolRuntime``), else ``None``. ``args_schema`` is the
    tool's schema, to normalise the arguments of other calls alike.
    """

    tool: str
    args: Mapping[str, Any]
    config: Mapping[str, Any]
    tool_call_id: str | None = None
    state: Any = None
    args_schema: type[BaseModel] | None = None


#: A plan session, or a callable choosing one per call.
PlanSource: TypeAlias = "PlanSession | Callable[[ToolCallContext], PlanSession]"
#: A step index (``3``, ``(3, 1)``), or a callable computing one per call.
StepIndexSource: TypeAlias = (
    "int | Sequence[int] | Callable[[ToolCallContext], int | Sequence[int]]"
)


#: A runtime's view of a call (LangGraph: its graph state): the plan, the call's identical
#: siblings, the conversation turn and what the model saw (``_identity.CallSite``).
Identity: TypeAlias = "Callable[[ToolCallContext], CallSite]"


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
    on_repeat: OnRepeat = "replay",
    errors_to_model: bool = True,
) -> StructuredTool:
    """Build a LangChain tool that sends each call through ``invoker`` with a deterministic key.

    ``plan`` and ``step_index`` say which step of which plan a call is. Pass
    values when your loop knows them, or callables of :class:`ToolCallContext`
    (for LangGraph, :mod:`agentkey.integrations.langgraph` supplies both). Two
    different calls of one plan must get different step indexes, or the server
    replays one call's answer for the other; a retried call must get the same.
    A :class:`~agentkey.PlanSession` refuses one index for two tools.

    ``on_repeat`` says what to do when the model asks, at another step, for a
    call this plan already made (same tool, same arguments): ``"replay"`` (the
    default) answers with the earlier step's result, marked as a repeat of that
    step, and runs nothing; ``"raise"`` raises :class:`~agentkey.StepRepeated`;
    ``"allow"`` runs it again as a new step.

    A :class:`~agentkey.ToolInvoker` serves ``tool.invoke`` and also
    ``tool.ainvoke`` (LangChain runs it in a worker thread); an
    :class:`~agentkey.AsyncToolInvoker` serves ``tool.ainvoke`` only, and
    ``tool.invoke`` raises :class:`~agentkey.ConfigurationError` rather than
    start a nested event loop. ``path``, ``method`` and ``headers`` go to
    ``invoker.invoke``; without ``path`` the invoker's ``routes`` or
    ``route_template`` choose it.

    With ``errors_to_model`` (the default) a tool's own refusal (a 4xx
    :class:`~agentkey.ToolError` that is not a key problem) becomes an error
    ``ToolMessage`` with the server's reason, for the model to correct itself;
    the agentkey error is the ``ToolException``'s ``__cause__``. Every other
    agentkey error propagates: :class:`~agentkey.OutcomeUnknown` (re-running
    the call later is safe: it gets the same key), key problems, auth errors.
    """
    return build_tool(
        name=name,
        description=description,
        args_schema=args_schema,
        invoker=invoker,
        plan=plan,
        step_index=step_index,
        options={"path": path, "method": method, "headers": headers},
        return_direct=return_direct,
        on_repeat=on_repeat,
        errors_to_model=errors_to_model,
        identity=None,
    )


def build_tool(
    *,
    name: str,
    description: str,
    args_schema: type[BaseModel],
    invoker: ToolInvoker | AsyncToolInvoker,
    plan: PlanSource,
    step_index: StepIndexSource,
    options: Mapping[str, Any],
    return_direct: bool,
    on_repeat: OnRepeat,
    errors_to_model: bool,
    identity: Identity | None,
) -> StructuredTool:
    """:func:`remote_tool`, plus a runtime's ``identity`` of each call (see ``_identity``)."""
    check_tool(
        name,
        description,
        args_schema,
        invoker,
        "the model reads it to decide when to call the tool",
    )
    clash = sorted(_RESERVED_FIELDS & set(args_schema.model_fields))
    if clash:
        raise ConfigurationError(
            f"args_schema {args_schema.__name__} of tool {name!r} has field(s) {clash} that "
            f"LangChain passes to the tool itself; rename them (the wire name can stay the "
            "same with a pydantic alias in your own schema for the server)"
        )
    policy = check_sources(name, plan, step_index, on_repeat, "a ToolCallContext")
    call = _Call(name, args_schema, plan, step_index, policy, identity, invoker, options)
    call.errors_to_model = errors_to_model
    common: dict[str, Any] = {
        "name": name,
        "description": description,
        "args_schema": args_schema,
        "response_format": "content_and_artifact",
        "return_direct": return_direct,
        "handle_tool_error": errors_to_model,
    }

    if isinstance(invoker, ToolInvoker):
        sync_invoker = invoker

        def run(
            *args: Any,
            config: RunnableConfig,
            callbacks: Any = None,
            runtime: Annotated[Any, InjectedToolArg] = None,
            **kwargs: Any,
        ) -> tuple[str, dict[str, Any]]:
            prepared = call.prepare(args, kwargs, config, runtime)
            step = call.step_of(prepared)
            try:
                with _in_tool_run(callbacks):
                    result: ToolResult | Repeat | None
                    if isinstance(prepared, _Pending):
                        result = call.send_sync(prepared, step)
                    else:
                        result = sync_invoker.invoke(step, **options)
            except ToolError as exc:
                raise _for_model(name, step, exc, callbacks, errors_to_model) from exc
            if isinstance(result, Repeat):
                return _traced(callbacks, result.content, result.record)
            assert result is not None  # (None only for sent_only)
            return _traced(callbacks, *_answer(result, step))

        return _KeyedTool(func=run, agentkey_call=call, **common)

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
        callbacks: Any = None,
        runtime: Annotated[Any, InjectedToolArg] = None,
        **kwargs: Any,
    ) -> tuple[str, dict[str, Any]]:
        prepared = call.prepare(args, kwargs, config, runtime)
        step = call.step_of(prepared)
        try:
            with _in_tool_run(callbacks) as run:
                try:
                    result: ToolResult | Repeat | None
                    if isinstance(prepared, _Pending):
                        result = await call.send_async(prepared, step)
                    else:
                        result = await async_invoker.invoke(step, **options)
                finally:
                    await run.flush()
        except ToolError as exc:
            raise _for_model(name, step, exc, callbacks, errors_to_model) from exc
        if isinstance(result, Repeat):
            return _traced(callbacks, result.content, result.record)
        assert result is not None  # (None only for sent_only)
        return _traced(callbacks, *_answer(result, step))

    return _KeyedTool(func=refuse, coroutine=arun, agentkey_call=call, **common)


class _KeyedTool(StructuredTool):
    """A StructuredTool that hands its function the id of the tool call it serves.

    LangChain's own ``InjectedToolCallId`` would make every call without an id
    (``tool.invoke({"amount": 5})``) fail; agentkey needs the id only when the
    step is derived from it. ``run`` and ``arun`` (public, and given the id by
    ``invoke`` whenever the input is a tool call) keep it in a context variable
    that the function reads.
    """

    #: The call maker of this tool (for agentkey's own helpers, such as the LangGraph
    #: pending-calls hook); not part of the tool's schema.
    agentkey_call: Any = Field(default=None, exclude=True)

    def run(self, tool_input: Any, *args: Any, tool_call_id: str | None = None, **kw: Any) -> Any:
        token = _TOOL_CALL_ID.set(tool_call_id)
        try:
            return super().run(tool_input, *args, tool_call_id=tool_call_id, **kw)
        finally:
            _TOOL_CALL_ID.reset(token)

    async def arun(
        self, tool_input: Any, *args: Any, tool_call_id: str | None = None, **kw: Any
    ) -> Any:
        token = _TOOL_CALL_ID.set(tool_call_id)
        try:
            return await super().arun(tool_input, *args, tool_call_id=tool_call_id, **kw)
        finally:
            _TOOL_CALL_ID.reset(token)


#: The id of the tool call the current ``_KeyedTool.run``/``arun`` serves.
_TOOL_CALL_ID: ContextVar[str | None] = ContextVar("agentkey_tool_call_id", default=None)


@dataclass(frozen=True, slots=True)
class _Pending:
    """A call whose key depends on the plan's earlier calls in the journal."""

    ctx: ToolCallContext
    site: CallSite
    args_hash: str


class _Call:
    """Turns one LangChain call into a Step: the key is made here, by the runtime."""

    __slots__ = (
        "_identity",
        "_invoker",
        "_name",
        "_on_repeat",
        "_options",
        "_plan",
        "_schema",
        "_step_index",
        "errors_to_model",
    )

    def __init__(
        self,
        name: str,
        schema: type[BaseModel],
        plan: PlanSource,
        step_index: StepIndexSource,
        on_repeat: OnRepeat,
        identity: Identity | None,
        invoker: ToolInvoker | AsyncToolInvoker,
        options: Mapping[str, Any],
    ) -> None:
        self._options = dict(options)
        self.errors_to_model = True
        self._name = name
        self._schema = schema
        self._plan = plan
        self._step_index = step_index
        self._on_repeat = on_repeat
        self._identity = identity
        self._invoker = invoker

    def prepare(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        config: RunnableConfig | None,
        runtime: Any,
    ) -> ToolCallContext | _Pending:
        """The call's context; with a runtime identity, what its key depends on."""
        call_id = _TOOL_CALL_ID.get()
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
            config=config or {},  # tool.run() without a config passes None
            tool_call_id=getattr(runtime, "tool_call_id", None) or call_id,
            state=getattr(runtime, "state", None),
            args_schema=self._schema,
        )
        if self._identity is None:
            return ctx
        site = self._identity(ctx)
        digest = args_hash(values, profile=site.plan.profile)
        return _Pending(ctx, self._lost_turn(site, digest), digest)

    def context_of(
        self, values: Mapping[str, Any], config: Any, call_id: str, state: Any
    ) -> _Pending:
        """What a call's key depends on, for a call made outside LangChain's run (a hook)."""
        ctx = ToolCallContext(
            tool=self._name,
            args=to_jsonable(self._schema.model_validate(values)),
            config=config or {},
            tool_call_id=call_id,
            state=state,
            args_schema=self._schema,
        )
        if self._identity is None:
            raise ConfigurationError(f"tool {self._name!r} is not keyed by a runtime")
        site = self._identity(ctx)
        return _Pending(ctx, site, args_hash(ctx.args, profile=site.plan.profile))

    def rule(self, pending: _Pending, *, sent_only: bool = False) -> Chooser:
        """The call's identity rule, for the flow to decide its key against the journal."""
        ctx, site = pending.ctx, pending.site

        def derive() -> Any:
            return self._step_index(ctx) if callable(self._step_index) else self._step_index

        return Chooser(
            site,
            args_hash=pending.args_hash,
            on_repeat=self._on_repeat,
            derive=derive,
            args_model=self._schema,
            sent_only=sent_only,
        )

    def identity(self, pending: _Pending) -> dict[str, Any]:
        """What the journal keeps beside the call (``call_id``, ``context``), and the options."""
        site = pending.site
        found = {"call_id": site.call_id, "context": site.context}
        return {**self._options, **{k: v for k, v in found.items() if v is not None}}

    def send_sync(self, pending: _Pending, step: Step, **rule: Any) -> ToolResult | Repeat | None:
        """Send a runtime's call on a ToolInvoker, its key decided in the flow (``_settle``);
        the answer to a repeat sent nowhere; None: ``sent_only`` and never sent before."""
        invoker = self._invoker
        if not isinstance(invoker, ToolInvoker):
            raise ConfigurationError(
                f"tool {self._name!r} has an AsyncToolInvoker: run the graph with ainvoke"
            )
        chooser = self.rule(pending, **rule)
        done = invoker._invoke_identified(step, chooser, **self.identity(pending))
        return _picked(done)

    async def send_async(
        self, pending: _Pending, step: Step, **rule: Any
    ) -> ToolResult | Repeat | None:
        """:meth:`send_sync` on either invoker, awaited."""
        invoker, options = self._invoker, self.identity(pending)
        chooser = self.rule(pending, **rule)
        if isinstance(invoker, AsyncToolInvoker):
            done = await invoker._invoke_identified(step, chooser, **options)
        else:
            done = await asyncio.to_thread(invoker._invoke_identified, step, chooser, **options)
        return _picked(done)

    def message(self, pending: _Pending) -> ToolMessage | None:
        """Send a call made outside LangChain's run (the pending-calls hook), synchronously,
        if the journal shows it was sent before (None: it never was)."""
        step = self.step_of(pending)
        try:
            result = self.send_sync(pending, step, sent_only=True)
        except ToolError as exc:
            return self._refused(pending, exc)
        return self._message_of(pending, step, result)

    async def amessage(self, pending: _Pending) -> ToolMessage | None:
        """:meth:`message` on either invoker, awaited."""
        step = self.step_of(pending)
        try:
            result = await self.send_async(pending, step, sent_only=True)
        except ToolError as exc:
            return self._refused(pending, exc)
        return self._message_of(pending, step, result)

    def _message_of(
        self, pending: _Pending, step: Step, result: ToolResult | Repeat | None
    ) -> ToolMessage | None:
        if result is None:
            return None
        if isinstance(result, Repeat):
            return self._tool_message(pending, result.content, result.record)
        return self._tool_message(pending, *_answer(result, step))

    def _tool_message(
        self, pending: _Pending, content: str, artifact: dict[str, Any]
    ) -> ToolMessage:
        call_id = pending.site.call_id or ""
        return ToolMessage(content, artifact=artifact, tool_call_id=call_id, name=self._name)

    def _refused(self, pending: _Pending, exc: ToolError) -> ToolMessage:
        text = refusal(self._name, exc, self.errors_to_model, _reason(exc))
        call_id = pending.site.call_id or ""
        return ToolMessage(text, tool_call_id=call_id, name=self._name, status="error")

    def _lost_turn(self, site: CallSite, digest: str) -> CallSite:
        """``site`` in the plan of an identical call that another conversation on its thread
        sent and never settled, when ``site`` is its conversation's first model response:
        the same request re-sent after a crash that lost its checkpoint (``durability=
        "exit"`` saves nothing until the run ends), as a new message. The journal shows the
        earlier run never finished; the call takes its key, marked as a repeat."""
        thread = site.fresh_thread
        if thread is None:
            return site
        lost = unfinished_elsewhere(site, digest, unsettled(self._invoker), in_thread(thread))
        if lost is None:
            return site
        _logger.info(
            "agentkey: tool %r, in the first turn of a conversation on thread %r, repeats a "
            "call an earlier run on that thread sent and never settled (%s): it takes that "
            "call's key, so it does not run twice",
            self._name,
            thread[:80],
            lost.step or lost.key,
        )
        return adopted(site, lost)

    def step_of(self, prepared: ToolCallContext | _Pending) -> Step:
        """The step to send a plain call as; for a runtime's call, a step of its plan, tool
        and arguments, whose key the flow decides (``_settle.Chooser``)."""
        if isinstance(prepared, _Pending):
            return self.rule(prepared).template()
        ctx = prepared
        index = self._step_index(ctx) if callable(self._step_index) else self._step_index
        args, schema = ctx.args, self._schema
        return make_step(self._plan, ctx, index, self._name, args, schema, self._on_repeat)


def _picked(done: ToolResult | Pick) -> ToolResult | Repeat | None:
    """What the flow gave: the tool's result, the answer to a repeat, or None (never sent)."""
    if not isinstance(done, Pick):
        return done
    answer: Repeat | None = None if done.answer == NOT_SENT else done.answer
    return answer


def _answer(result: ToolResult, step: Step) -> tuple[str, dict[str, Any]]:
    """The model reads the tool's JSON body; the artifact records how agentkey got it."""
    content = json.dumps(result.body, ensure_ascii=False)
    if result.repeat_of is not None:
        content = repeat_note(result.repeat_of, replayed=result.replayed) + content
    return content, call_record(result, step, body=True)


def _for_model(
    tool: str, step: Step, exc: ToolError, callbacks: Any, errors_to_model: bool
) -> ToolException:
    """A tool's own refusal as a ToolException for the model; anything else re-raised."""
    reason = _reason(exc)
    _trace(
        callbacks,
        {
            "tool": tool,
            # The error's own key and step: a runtime's call got them in the flow.
            "idempotency_key": exc.idempotency_key or step.idempotency_key,
            "step": exc.step or step.label,
            "outcome": "error",
            "status_code": exc.status_code,
            "reason": reason,
        },
    )
    return ToolException(refusal(tool, exc, errors_to_model, reason))


def _reason(exc: ToolError) -> str:
    """The server's short reason, cleaned and cut; never the Idempotency-Key."""
    return server_reason(exc) or f"the tool answered HTTP {exc.status_code}"


def _traced(callbacks: Any, content: str, artifact: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    _trace(callbacks, {k: artifact.get(k) for k in _TRACED})
    return content, artifact


_TRACED = ("tool", "idempotency_key", "step", "outcome", "replayed", "repeat_of")


def _trace(callbacks: Any, info: Mapping[str, Any]) -> None:
    """Put ``info`` into the metadata of the tool's own run, where tracers show it.

    ``callbacks`` is the tool run's child manager (LangChain passes it to a tool
    function that takes ``callbacks``); its parent is the tool run, which each
    tracer keeps in its ``run_map`` until the run ends.
    """
    run_id = getattr(callbacks, "parent_run_id", None)
    if run_id is None:
        return
    for handler in getattr(callbacks, "handlers", ()):
        run = getattr(handler, "run_map", {}).get(str(run_id))
        extra = getattr(run, "extra", None)
        if isinstance(extra, dict):
            extra.setdefault("metadata", {}).update({f"agentkey_{k}": v for k, v in info.items()})


# --- the invoker's events in the tool's LangChain run ---------------------------------------


@dataclass
class _ToolRun:
    """The LangChain run of the tool whose call the invoker is making in this context."""

    callbacks: Any  # the tool run's child callback manager; its parent is the tool run
    pending: list[tuple[str, dict[str, Any]]] = dataclasses.field(default_factory=list)

    def send(self, name: str, data: dict[str, Any]) -> None:
        _run_event(self.callbacks, name, data)
        if isinstance(self.callbacks, AsyncCallbackManager):
            self.pending.append((name, data))  # a sync hook cannot await: sent after the call
        else:
            self.callbacks.on_custom_event(name, data, run_id=self.callbacks.parent_run_id)

    async def flush(self) -> None:
        pending, self.pending = self.pending, []
        for name, data in pending:
            await self.callbacks.on_custom_event(name, data, run_id=self.callbacks.parent_run_id)


_TOOL_RUN: ContextVar[_ToolRun | None] = ContextVar("agentkey_langchain_tool_run", default=None)
_EVENT_NAMES: dict[type, str] = {
    RetryEvent: "agentkey_retry",
    PollEvent: "agentkey_poll",
    ReplayEvent: "agentkey_replay",
    GiveUpEvent: "agentkey_give_up",
}


@contextmanager
def _in_tool_run(callbacks: Any) -> Iterator[_ToolRun]:
    """Route the invoker's events of this call to the tool's run (see :class:`LangChainHook`)."""
    run = _ToolRun(callbacks)
    token = _TOOL_RUN.set(run if getattr(callbacks, "parent_run_id", None) else None)
    try:
        yield run
    finally:
        _TOOL_RUN.reset(token)


class LangChainHook:
    """An invoker hook that passes retries, polls, replays and give-ups to LangChain.

    Add it to the invoker that a :func:`remote_tool` uses
    (``ToolInvoker(url, hooks=[LoggingHook(), LangChainHook()])``). While such
    a tool runs inside a LangChain run, each event of its call becomes a custom
    event (``agentkey_retry``, ``agentkey_poll``, ``agentkey_replay``,
    ``agentkey_give_up``; the data is the event's fields: key, step, attempt,
    reason, wait, status, with a status URL cut to its path) on the tool's run,
    and an entry of that run's ``events`` for tracers that keep runs. Outside
    a tool run it does nothing. An :class:`~agentkey.AsyncToolInvoker`'s events
    reach async callback handlers when the call ends (a hook cannot await).
    """

    def __call__(self, event: object) -> None:
        run = _TOOL_RUN.get()
        name = _EVENT_NAMES.get(type(event))
        if run is None or name is None or not dataclasses.is_dataclass(event):
            return
        data = dataclasses.asdict(event)  # type: ignore[arg-type]  # an event instance
        if "status_url" in data:  # may be signed: keep its query out of traces
            data["status_url"] = redact_url(str(data["status_url"]))
        run.send(name, data)

    def __repr__(self) -> str:
        return "LangChainHook()"


def _run_event(callbacks: Any, name: str, data: Mapping[str, Any]) -> None:
    """Add an event to the tool's run in each tracer's ``run_map`` (LangSmith shows run events)."""
    run_id = getattr(callbacks, "parent_run_id", None)
    for handler in getattr(callbacks, "handlers", ()):
        run = getattr(handler, "run_map", {}).get(str(run_id))
        events = getattr(run, "events", None)
        if isinstance(events, list):
            events.append({"name": name, "time": datetime.now(timezone.utc), "kwargs": dict(data)})
