"""CrewAI: tools keyed by the job's plan (a Flow's persisted state id) and the journal.

:func:`remote_tool` turns a tool served over HTTP into a CrewAI ``BaseTool``.
CrewAI hands a tool only its arguments: no call id, no history. And the ids a
crew draws (``Crew.id``, ``Task.id``) are new in every process and cannot be set.
What CrewAI keeps across a restart is a Flow's state: with ``@persist``, a flow
run again with ``flow.kickoff(inputs={"id": state_id})`` gets its state back,
``id`` included. So a call's identity comes from:

- plan session id: the ``plan=`` you pass, a :class:`~agentkey.PlanSession`
  or a callable returning one. Inside a Flow, :func:`flow_plan` gives a UUIDv5
  of the flow's state id; a crew outside a flow needs a plan kept with the job
  (``PlanSession.new()``, saved with ``to_json()``);
- the call's number among the identical calls (same tool, same normalised
  arguments) this tool made for the plan: a restarted job's first identical
  call is the crashed job's first, and so gets its key;
- the invoker's journal and the calls this tool answered in this process
  (``_identity``): the same call run again keeps its key, and the tool server
  replays; it is marked as a repeat when the agent of this process never read
  its answer (a job resumed after a crash), and a warning says to give each job
  its own state id if it was in fact a new one. A call the agent asks for again
  after reading its answer (a guardrail's retry of the task, an agent's
  ``max_retry_limit`` retry, a second task asking the same) follows
  ``on_repeat``: by default the earlier answer, marked, nothing sent. What the agent
  read is kept per plan: one tool object serves many jobs, and a job never reads
  another's answer.

Two copies of one job (the same state id) racing send their first identical
call under one key: the tool server runs it once.

Needs the ``crewai`` extra (``pip install 'agentkey-idempotency[crewai]'``).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias, cast

from pydantic import BaseModel, PrivateAttr, ValidationError

from .._canonical import args_hash, to_jsonable
from .._exceptions import ConfigurationError, ToolError
from .._plan import OnRepeat, PlanSession
from ..client._flow import Pick
from ..client._invoker import AsyncToolInvoker, ToolInvoker, ToolResult
from ._adapter import (
    call_record,
    check_sources,
    check_tool,
    code,
    first_error,
    missing_extra,
    refusal,
    repeat_note,
)
from ._identity import CallSite, Seen
from ._settle import Chooser, Repeat

try:
    from crewai.tools import BaseTool
except ModuleNotFoundError as exc:  # pragma: no cover - exercised in a subprocess test
    raise missing_extra(exc, "crewai", "crewai") from None

__all__ = ["flow_plan", "remote_tool"]

#: A plan session, or a callable returning one at each call.
PlanSource: TypeAlias = "PlanSession | Callable[[], PlanSession]"


def flow_plan(flow: Any) -> PlanSession:
    """The plan session of a CrewAI Flow run: a UUIDv5 of its state id (``flow.flow_id``).

    With ``@persist``, run the flow again with ``flow.kickoff(inputs={"id": state_id})``
    after a crash: its state, and so its plan, come back. Give each job its own state id.
    """
    state_id = getattr(flow, "flow_id", None)
    if not isinstance(state_id, str) or not state_id:
        raise ConfigurationError(
            f"flow_plan needs a CrewAI Flow with a state id, got {flow!r}; pass the flow "
            "(self in a flow method), or plan=PlanSession(...) kept with the job"
        )
    return PlanSession.from_external_id(json.dumps(["crewai-flow", state_id]))


class _RemoteTool(BaseTool):
    """A CrewAI tool whose calls go through an agentkey invoker (see :func:`remote_tool`)."""

    _call: Callable[[dict[str, Any]], str] = PrivateAttr()
    #: The records of the calls this tool answered, oldest first.
    _records: list[dict[str, Any]] = PrivateAttr(default_factory=list)

    @property
    def records(self) -> list[dict[str, Any]]:
        """How agentkey answered each call of this tool (``idempotency_key``, ``step``,
        ``outcome``, ``replayed``, ``repeat_of`` ...), oldest first."""
        return list(self._records)

    def _run(self, **kwargs: Any) -> str:
        return self._call(kwargs)

    async def _arun(self, **kwargs: Any) -> str:
        return await asyncio.to_thread(self._call, kwargs)


def remote_tool(
    *,
    name: str,
    description: str,
    args_schema: type[BaseModel],
    invoker: ToolInvoker,
    plan: PlanSource,
    path: str | None = None,
    method: str = "POST",
    headers: Mapping[str, str] | None = None,
    on_repeat: OnRepeat = "replay",
    errors_to_model: bool = True,
) -> BaseTool:
    """A CrewAI ``BaseTool`` that sends each call through ``invoker`` with a deterministic key.

    ``plan`` is the job's plan: :func:`flow_plan` of the Flow that builds the crew,
    a :class:`~agentkey.PlanSession` kept with the job, or a callable returning one.
    Each call's key is settled against the invoker's journal and the calls this
    tool answered (module docstring). ``on_repeat`` says what a call the agent
    already read the answer of gets when it is asked for again: ``"replay"`` (the
    default: the earlier answer, marked, nothing sent), ``"raise"``
    (:class:`~agentkey.StepRepeated`) or ``"allow"`` (a new call: for a tool whose
    identical calls in one job are separate operations).

    The agent reads the tool's JSON body as text; the tool's ``records`` keep how
    each call was answered. Arguments that do not fit ``args_schema``, and with
    ``errors_to_model`` a tool's own refusal (a 4xx that is not a key problem),
    go back to the agent as text with the reason; every other agentkey error
    propagates and fails the task.

    CrewAI calls tools from its worker threads, so the invoker is a
    :class:`~agentkey.ToolInvoker`.
    """
    check_tool(name, description, args_schema, invoker)
    if isinstance(cast(object, invoker), AsyncToolInvoker):  # typed away, passed all the same
        raise ConfigurationError(
            f"invoker of tool {name!r} is an AsyncToolInvoker; CrewAI calls tools from its "
            "worker threads, so pass a ToolInvoker"
        )
    policy = check_sources(name, plan, 0, on_repeat, "no argument")
    options: dict[str, Any] = {"path": path, "method": method, "headers": headers}
    memory = _Memory()
    # CrewAI's own cache would answer an identical call from memory, unmarked and only within
    # one crew: agentkey answers it instead (marked, and across processes), so nothing is cached.
    tool = _RemoteTool(
        name=name, description=description, args_schema=args_schema, cache_function=_never
    )

    def call(raw: dict[str, Any]) -> str:
        try:
            values = to_jsonable(args_schema.model_validate(raw))
        except ValidationError as exc:
            return (
                f"Tool {name!r} was not called: the arguments do not match "
                f"{args_schema.__name__} ({first_error(exc)}). Correct them and call again."
            )
        session = plan() if callable(plan) else plan
        if not isinstance(session, PlanSession):
            raise ConfigurationError(
                f"the plan callable of tool {name!r} returned {session!r}, not a PlanSession"
            )
        digest = args_hash(values, profile=session.profile)
        call_id = memory.next_id(session.id, name, digest)
        rule = Chooser(
            lambda: memory.site(session, name, values, call_id),
            args_hash=digest,
            on_repeat=policy,
            derive=lambda: (code(name), code(call_id)),
            args_model=args_schema,
            unread="flow state id",
        )
        template = rule.template()
        try:
            result = invoker._invoke_identified(
                template, rule, **options, call_id=call_id, context=None
            )
        except ToolError as exc:
            text = refusal(name, exc, errors_to_model)
            memory.answered(session.id, call_id, None, None)
            return text
        if isinstance(result, Pick):
            repeat: Repeat = result.answer
            memory.answered(
                session.id, call_id, repeat.content, repeat.record.get("idempotency_key")
            )
            tool._records.append(repeat.record)
            return repeat.content
        text = _text(result)
        memory.answered(session.id, call_id, text, result.idempotency_key)
        tool._records.append(call_record(result, template))
        return text

    tool._call = call
    return tool


def _never(_args: Any = None, _result: Any = None) -> bool:
    return False


def _text(result: ToolResult) -> str:
    """What the agent reads: the tool's JSON body, after the repeat note of a marked repeat."""
    text = json.dumps(result.body, ensure_ascii=False)
    if result.repeat_of is None:
        return text
    return repeat_note(result.repeat_of, replayed=result.replayed) + text


class _Memory:
    """The calls one tool made in this process, per plan: their ids, and what the agent read.

    A tool object is shared by every job (plan) of the process, and a call id
    (``crewai:{tool}:{digest}:{n}``) names no plan, so everything is kept per plan: one
    job's answers are never another's, read or unread. The plans kept are bounded
    (least recently used first out); a job whose plan was dropped numbers its calls from
    0 again, and so meets its own earlier calls in the journal, answered as repeats.
    """

    #: How many plans (jobs) one tool remembers.
    PLANS = 1024

    def __init__(self, plans: int = PLANS) -> None:
        self._lock = threading.Lock()
        self._limit = plans
        self._plans: OrderedDict[str, _PlanCalls] = OrderedDict()

    def _of(self, plan: str) -> _PlanCalls:
        """The plan's calls (the caller holds the lock), now the most recently used."""
        calls = self._plans.get(plan)
        if calls is None:
            calls = self._plans[plan] = _PlanCalls()
            while len(self._plans) > self._limit:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(plan)
        return calls

    def next_id(self, plan: str, tool: str, digest: str) -> str:
        """The id of the next identical call (same tool and arguments) of ``plan``: the same
        in every process that makes its calls in the same order."""
        with self._lock:
            counts = self._of(plan).counts
            number = counts[(tool, digest)]
            counts[(tool, digest)] += 1
        return f"crewai:{tool}:{digest[:16]}:{number}"

    def answered(self, plan: str, call_id: str, text: str | None, key: Any) -> None:
        with self._lock:
            self._of(plan).answered[call_id] = (text, key if isinstance(key, str) else None)

    def site(
        self, plan: PlanSession, tool: str, values: Mapping[str, Any], call_id: str
    ) -> CallSite:
        with self._lock:
            answered = dict(self._of(plan.id).answered)
        known = {c: k for c, (text, k) in answered.items() if text is not None and k is not None}
        return CallSite(
            plan=plan,
            tool=tool,
            values=values,
            call_id=call_id,
            siblings=(call_id,),
            seen=Seen({c: text for c, (text, _) in answered.items()}),
            known=known,
        )


class _PlanCalls:
    """One plan's calls of one tool: how many of each, and what the agent read of each."""

    __slots__ = ("answered", "counts")

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self.answered: dict[str, tuple[str | None, str | None]] = {}  # id -> (text, key)
