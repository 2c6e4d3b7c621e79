"""What the agent-framework adapters share: argument checks, step making, refusals.

Framework-free on purpose: nothing here imports LangChain, PydanticAI, the
Agents SDK, MCP or OpenTelemetry, so each adapter pays only for its own extra.
"""

from __future__ import annotations

import hashlib
import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from .._exceptions import ConfigurationError, KeyRejected, MissingExtra, PayloadMismatch, ToolError
from .._exceptions import missing_extra as _missing_extra
from .._keys import normalize_step
from .._plan import OnRepeat, PlanSession, Step, check_on_repeat
from ..client._invoker import AsyncToolInvoker, ToolInvoker, ToolResult
from ..client._protocol import short_reason
from ..journal._base import is_live
from ..journal._records import CallRecord, CallState

_Ctx = TypeVar("_Ctx")


def missing_extra(exc: ImportError, extra: str, module: str, *roots: str) -> MissingExtra:
    """The :class:`~agentkey.MissingExtra` for ``exc``; ``exc`` itself when another module broke.

    ``roots`` are the top-level modules of the extra (default: ``module``).
    """
    if (exc.name or "").partition(".")[0] not in (roots or (module,)):
        raise exc
    return _missing_extra(extra, module, exc)


def check_tool(
    name: object,
    description: object,
    args_schema: object,
    invoker: object,
    /,
    why: str = "the model reads it",
) -> None:
    """Refuse a badly built tool with :class:`~agentkey.ConfigurationError`.

    ``why`` says why the description matters.
    """
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"name must be a non-empty str, got {name!r}")
    if not isinstance(description, str) or not description.strip():
        raise ConfigurationError(f"description of tool {name!r} must be a non-empty str: {why}")
    if not (isinstance(args_schema, type) and issubclass(args_schema, BaseModel)):
        raise ConfigurationError(
            f"args_schema of tool {name!r} must be a pydantic BaseModel subclass, "
            f"got {args_schema!r}"
        )
    if not isinstance(invoker, (ToolInvoker, AsyncToolInvoker)):
        raise ConfigurationError(
            f"invoker of tool {name!r} must be a ToolInvoker or AsyncToolInvoker, got {invoker!r}"
        )


def check_sources(
    name: str, plan: object, step_index: object, on_repeat: object, context: str, /
) -> OnRepeat:
    """Refuse a bad plan or fixed step index (:class:`~agentkey.ConfigurationError`,
    :class:`~agentkey.InvalidKey`); the on_repeat policy.

    ``plan`` and ``step_index`` come with the adapter's defaults applied;
    ``context`` names what a plan callable takes (``"the RunContext"``).
    """
    if not (isinstance(plan, PlanSession) or callable(plan)):
        raise ConfigurationError(
            f"plan of tool {name!r} must be a PlanSession or a callable taking {context}, "
            f"got {plan!r}"
        )
    if not callable(step_index):
        normalize_step(step_index)  # a fixed index: check it now (raises InvalidKey)
    return check_on_repeat(on_repeat)


def make_step(
    plan: PlanSession | Callable[[_Ctx], PlanSession],
    ctx: _Ctx,
    index: int | Sequence[int],
    name: str,
    values: Mapping[str, Any],
    args_schema: type[BaseModel],
    on_repeat: OnRepeat,
) -> Step:
    """The step ``index`` of the call's plan (a value, or chosen by a callable of ``ctx``)."""
    session = plan(ctx) if callable(plan) else plan
    if not isinstance(session, PlanSession):
        raise ConfigurationError(
            f"the plan callable of tool {name!r} returned {session!r}, not a PlanSession"
        )
    return session.step(index, name, values, args_model=args_schema, on_repeat=on_repeat)


def repeat_note(label: str, *, replayed: bool) -> str:
    """What the model reads before the result of a call it asked for again.

    ``replayed``: the earlier call's answer (it ran at ``label``); else the earlier
    call had not finished and has now run once.
    """
    if replayed:
        return (
            f"[repeat of {label}: this call, with the same arguments, already succeeded at "
            f"{label} of this plan, so it was not run a second time. Its result follows.] "
        )
    return (
        f"[repeat of {label}: this call was asked for before, at {label}, and had not "
        "finished; it has now run once. Its result follows.] "
    )


def repeat_record(tool: str, key: str, label: str) -> dict[str, Any]:
    """The call's record (the runtime keeps it beside the answer) for a repeat answered unsent."""
    return {
        "tool": tool,
        "idempotency_key": key,
        "step": label,
        "outcome": "replayed",
        "replayed": True,
        "repeat_of": label,
        "attempts": 0,
        "polls": 0,
        "elapsed": 0.0,
    }


def call_record(result: ToolResult, step: Step, *, body: bool = False) -> dict[str, Any]:
    """How agentkey got a call's answer, for the framework's record of the call."""
    # Headers and the status URL stay out: records get persisted (checkpoints, traces), and
    # either may carry something (a cookie, a signed URL) that does not belong there.
    exclude = {"headers", "status_url"} if body else {"headers", "status_url", "body"}
    record = result.model_dump(mode="json", exclude=exclude)
    # The record names the label "step", as the invoker's events and repeat_record do.
    record = {("step" if name == "label" else name): value for name, value in record.items()}
    # The result's repeat_of: the flow may have found the call to repeat an earlier one.
    return {"tool": step.tool, **record}


_logger = logging.getLogger("agentkey")
_unreadable: weakref.WeakSet[Any] = weakref.WeakSet()  # journals already warned about


def unsettled(invoker: ToolInvoker | AsyncToolInvoker) -> list[CallRecord]:
    """The calls the invoker's journal shows never settled: in doubt, or pending with their
    sender gone (a process that died while it made them). Empty without a journal, or with
    one that cannot be read synchronously."""
    journal = invoker.journal
    if journal is None:
        return []
    if not journal.supports_sync:
        _warn_unreadable(journal)
        return []
    found = journal.calls(states=[CallState.IN_DOUBT, CallState.PENDING], limit=200)
    now = invoker._clock.time()
    return [r for r in found if not is_live(r, now)]


def _warn_unreadable(journal: Any) -> None:
    """Say once per journal that the recoveries reading its unsettled calls are off."""
    try:
        if journal in _unreadable:
            return
        _unreadable.add(journal)
    except TypeError:  # a journal without weak references: said each time
        pass
    _logger.warning(
        "agentkey: the invoker's journal (%s) cannot be read synchronously (an asyncio "
        "client), so the recovery of a call another run left unsettled (a request re-sent "
        "after a crash under a new message id, run id or trace id) is off: such a call runs "
        "again. To keep it, pass a journal that also reads synchronously (RedisJournal on a "
        "redis.Redis client, PostgresJournal, SQLiteJournal)",
        type(journal).__name__,
    )


def server_reason(exc: ToolError) -> str | None:
    """The server's short reason, cleaned and cut; never the Idempotency-Key."""
    return exc.reason or short_reason(exc.body, exc.idempotency_key)


def refusal(tool: str, exc: ToolError, errors_to_model: bool, reason: str | None = None) -> str:
    """A tool's own refusal (a 4xx, not a key problem) as text for the model; else ``exc`` raised.

    The model cannot fix a key problem or a failure that may have done harm.
    """
    status = exc.status_code or 0
    if (
        not errors_to_model
        or isinstance(exc, (KeyRejected, PayloadMismatch))
        or not 400 <= status < 500
    ):
        raise exc
    reason = reason or server_reason(exc) or f"HTTP {status}"
    return (
        f"Tool {tool!r} refused this call: {reason} (HTTP {status}). Nothing was done; "
        "correct the arguments, or tell the user why it cannot be done."
    )


def first_error(exc: ValidationError) -> str:
    """``where: what`` of the first error (never the input value)."""
    first = exc.errors(include_input=False)[0]
    where = ".".join(str(p) for p in first["loc"]) or "arguments"
    return f"{where}: {first['msg']}"


def code(text: str) -> int:
    """A stable 32-bit number for ``text`` (a step index part)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:4], "big")
