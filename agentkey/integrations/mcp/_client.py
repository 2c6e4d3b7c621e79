"""The client half: ``tools/call`` with a deterministic key, retries and token refresh."""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import (
    AsyncIterator,
    Callable,
    Mapping,
    Sequence,
)
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import TracebackType
from typing import Any, cast
from urllib.parse import quote
from weakref import WeakKeyDictionary

import anyio
import anyio.abc
from mcp import Client, ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import (
    CONNECTION_CLOSED,
    INTERNAL_ERROR,
    REQUEST_TIMEOUT,
    CallToolRequest,
    CallToolRequestParams,
    CallToolResult,
    PaginatedRequestParams,
    RequestParamsMeta,
    TextContent,
)
from pydantic import BaseModel

from ..._canonical import args_hash
from ..._clock import Clock, default_clock
from ..._exceptions import ConfigurationError
from ..._plan import OnRepeat, PlanSession, Step, check_on_repeat
from ...auth import TokenProvider
from ...client import _httpx2
from ...client._drive import Handlers, async_carrier, run_async
from ...client._effects import Answer, Failure, FailureKind, Outgoing, Received, Sleep
from ...client._flow import Call, Finished, Reconciler, Settings
from ...client._flow import invoke as flow_invoke
from ...client._hooks import InvokeHook, LoggingHook
from ...client._invoker import JournalOption, shared_handlers
from ...client._net import Origin
from ...client._policies import PollPolicy, RetryPolicy
from ...client._protocol import DEFAULT_REPLAY_HEADERS, PROTECTED_HEADER, ProtocolConfig
from ...journal._base import current_owner, in_flight
from ...journal._default import resolve_journal
from ...journal._records import route_of
from .._adapter import code
from ._wire import (
    CONVENTIONS,
    CONVENTIONS_FIELD,
    PROTECTED_FIELD,
    REPLAYED_FIELD,
    KeyConvention,
    refusal_of,
    with_key,
)

__all__ = ["IdempotentSession", "MCPToolResult", "SessionFactory", "connect"]

#: Opens a new initialised session: ``lambda: connect(url, auth=provider)``, or
#: ``lambda: mcp.Client(url)`` (whose ``.session`` is used).
SessionFactory = Callable[[], AbstractAsyncContextManager["ClientSession | Client"]]

#: JSON-RPC codes after which the tool may or may not have run: the connection closed
#: (a reset, a stream that ended without an answer), the read timed out, or the server
#: (or a proxy, as an HTTP 5xx) failed while handling the call.
_IN_DOUBT_CODES = frozenset({CONNECTION_CLOSED, REQUEST_TIMEOUT, INTERNAL_ERROR})
#: Exceptions of the transport itself, seen when the session's streams broke.
_TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    anyio.ClosedResourceError,
    anyio.BrokenResourceError,
    anyio.EndOfStream,
    OSError,
)
_METHOD = "CALL"  # the method of a tools/call in the flow (its "url" names server and tool)
#: What an agentkey refusal becomes for the flow: (status, problem code).
_REFUSALS: dict[str, tuple[int, str]] = {
    "in-progress": (409, "in_progress"),
    "unavailable": (503, "not_run"),  # nothing ran: resent, from a tool marked protected
    "in-doubt": (409, "in_doubt"),  # may have run, unsettled: OutcomeUnknown at once
    "payload-mismatch": (422, "payload_mismatch"),
    "key-reused": (422, "key_reused"),
    "invalid-key": (400, "idempotency_key_invalid"),
    "key-required": (400, "idempotency_key_missing"),
    "unauthenticated": (401, "unauthenticated"),
}
#: Request headers the flow sets itself; any other (a hook's ``traceparent``) goes in _meta.
_OWN_HEADERS = frozenset({"content-type", "accept", "idempotency-key"})
#: What a tool that its server lists as protected, without naming conventions, reads:
#: agentkey's own (a server from before the conventions were advertised).
_AGENTKEY_ONLY: tuple[KeyConvention, ...] = ("agentkey",)
#: How many pages of ``tools/list`` the session reads, at most, to find a tool.
_MAX_PAGES = 50


class _KeyedParams(CallToolRequestParams):
    """``tools/call`` params with SEP-3182's ``idempotencyKey`` (the SDK's model has none)."""

    idempotency_key: str | None = None


class _KeyedCall(CallToolRequest):
    """A ``tools/call`` whose params carry ``idempotencyKey``."""

    params: _KeyedParams


@dataclass(frozen=True, slots=True)
class MCPToolResult:
    """What :meth:`IdempotentSession.call_tool` returns.

    ``result`` is the SDK's ``CallToolResult`` as the server sent it (a tool's
    own failure is a result with ``is_error`` true, as in MCP); ``replayed`` is
    true when the server answered with the result stored for this key.
    ``source`` says who answered, as on :class:`~agentkey.ToolResult`:
    ``"tool"``, ``"journal"`` (the result an earlier send of this call got; nothing
    was sent) or ``"reconcile"``; ``repeat_of`` names the earlier step a repeated call
    was sent as.
    """

    result: CallToolResult
    replayed: bool
    idempotency_key: str
    step: str
    attempts: int
    source: str = "tool"
    repeat_of: str | None = None


#: Set by IdempotentSession around each attempt: the HTTP statuses of that attempt's
#: requests. The SDK sends in the caller's context, so the client's response hook
#: (see :func:`connect`) sees it; the SDK turns any HTTP error into one JSON-RPC error,
#: and this tells a refused token (401 after the provider's one refresh) from the rest.
_STATUSES: ContextVar[list[int] | None] = ContextVar("agentkey_mcp_statuses", default=None)


#: The URL each session opened by :func:`connect` talks to: the scope of its calls in the
#: journal (what the client chose, never the name a server reports about itself).
_URLS: WeakKeyDictionary[ClientSession, str] = WeakKeyDictionary()
#: A scope of its own for each session known by neither a URL nor a name given by the user.
_SCOPES: WeakKeyDictionary[ClientSession, str] = WeakKeyDictionary()


async def _record_status(response: Any) -> None:
    statuses = _STATUSES.get()
    if statuses is not None:
        statuses.append(int(response.status_code))


@asynccontextmanager
async def connect(
    url: str,
    *,
    auth: TokenProvider | None = None,
    headers: Mapping[str, str] | None = None,
    **session_options: Any,
) -> AsyncIterator[ClientSession]:
    """An initialised ``ClientSession`` over streamable HTTP, its token kept valid by ``auth``.

    ``auth`` is any agentkey token provider (``ClientCredentials``,
    ``RefreshTokenGrant``, ``TokenExchange``...): the token is renewed before it
    is due (one refresh for all concurrent callers), plain http is refused except
    to loopback, and a 401 for the token in use refreshes it once and resends the
    same request (same JSON-RPC body, same key); when the tool refuses the new
    token too, :class:`IdempotentSession` raises
    :class:`~agentkey.TokenRejected`. ``session_options`` go to
    ``ClientSession`` (``read_timeout_seconds``, callbacks). The HTTP client has
    the SDK transports' timeouts (30 s to connect, 300 s to read a held stream).
    """
    if auth is not None and not isinstance(auth, TokenProvider):
        raise ConfigurationError(
            f"auth must be an agentkey token provider (ClientCredentials, ...), got {auth!r}"
        )
    client = _httpx2.fork_async_client(dict(headers or {}), connect=30.0, read=300.0)
    client.auth = _httpx2.adapt_auth(auth, client)
    client.event_hooks["response"].append(_record_status)
    async with (
        client,
        streamable_http_client(url, http_client=client) as (read, write),
        ClientSession(read, write, **session_options) as session,
    ):
        await session.initialize()
        _URLS[session] = route_of("CALL", url).partition(" ")[2]  # no query: tokens go there
        yield session


class _Connection:
    """One session from ``factory``, held open by a background task; reopened once it died.

    The SDK tears a session down when its transport fails (on the 2026-07-28 protocol a
    reset connection ends the whole session). Holding it in a task of our own keeps that
    failure away from the caller: the call in flight gets ``CONNECTION_CLOSED``, and the
    next attempt opens a new session.
    """

    def __init__(self, factory: SessionFactory, group: anyio.abc.TaskGroup) -> None:
        self._factory = factory
        self._group = group
        self._session: ClientSession | None = None
        self._dead = anyio.Event()
        self._stop = anyio.Event()

    async def session(self) -> ClientSession:
        if self._session is None or self._dead.is_set():
            self._session = None
            self._session = await self._open()
        return self._session

    async def _open(self) -> ClientSession:
        ready, dead = anyio.Event(), anyio.Event()
        box: dict[str, Any] = {}

        async def hold() -> None:
            try:
                async with self._factory() as opened:
                    box["session"] = opened.session if isinstance(opened, Client) else opened
                    ready.set()
                    await self._stop.wait()
            except Exception as exc:  # the transport failed: this session is gone
                box.setdefault("error", exc)
            finally:
                dead.set()
                ready.set()

        self._dead = dead
        self._group.start_soon(hold)
        await ready.wait()
        if "session" not in box:
            raise _NotConnected(box.get("error"))
        session: ClientSession = box["session"]
        return session

    def close(self) -> None:
        self._stop.set()


class _NotConnected(Exception):
    """Opening a session failed; nothing was sent."""

    def __init__(self, cause: object) -> None:
        super().__init__(type(cause).__name__ if cause is not None else "no session")


#: What the probe's ``tools/list`` may fail with; each reads as "not sent".
_PROBE_ERRORS: tuple[type[BaseException], ...] = (_NotConnected, MCPError, *_TRANSPORT_ERRORS)


class IdempotentSession:
    """Calls the tools of one MCP session, each call under a deterministic key.

    The key is ``plan.step(step, name, arguments)``'s: the same plan, step, tool
    and arguments give the same key in every process, so a server that honours
    it runs the call at most once and replays its stored result afterwards. It
    goes in ``params._meta["io.agentkey/idempotency-key"]``, or where the server's
    ``tools/list`` says it reads keys for the tool (``io.agentkey/key-conventions``,
    read after a ``key-required`` refusal or a failure in doubt, or on the result
    of a call that ran without a key the server reads).

    The call runs on the same engine as :class:`~agentkey.AsyncToolInvoker`
    (``agentkey.client._flow``): it is recorded in the ``journal`` before it is sent;
    a call that may have run (connection closed or reset, read timeout, server
    error) is sent again with the same key only to a tool known to honour keys:
    ``honours_keys=True``, or the server marked the tool protected (its results
    and its ``tools/list`` entry carry ``_meta["io.agentkey/protected"]``, which
    agentkey's server middleware sets). Otherwise the call ends in
    :class:`~agentkey.OutcomeUnknown` (or the ``reconcile=`` hook settles it). Whether
    the server marks the tool protected is asked again, with ``policy``'s backoff,
    until the call's deadline (on ``clock``): a server that restarts meanwhile gets
    the resend. A refusal as in progress or unavailable is waited out within
    ``policy``. Each attempt waits at most ``attempt_timeout`` seconds for its answer.

    ``session`` is an initialised ``ClientSession``, or a function that opens one
    (no arguments, returning an async context manager of a session, e.g.
    ``lambda: connect(url, auth=provider)``); then use
    the object as ``async with IdempotentSession(factory, plan) as tools:``, and a
    session that its transport ended is replaced by a new one before the resend.
    ``server`` names the server (its URL, say): the journal keeps each call, and
    what agentkey learns about which tools honour keys, under it. By default it is
    the URL :func:`connect` opened, else this session alone; never the name the
    server reports (every unnamed ``MCPServer()`` reports ``mcp-server``, and a
    hostile server can claim any name). Name it to let a restarted process find
    its calls again. A key the journal holds for another server is refused
    (:class:`~agentkey.KeyReused`), never answered with the other server's result.

    ``step`` defaults to ``(tool, n)``: the n-th call of this session with the same
    tool and arguments. A restarted process whose session makes other calls first
    still gives the same call the same key, and two identical calls in one session
    are two operations. Give ``step=`` to number calls yourself (``on_repeat`` then
    decides what a repeat of an earlier step's call at another step gets).
    """

    def __init__(
        self,
        session: ClientSession | SessionFactory,
        plan: PlanSession,
        *,
        policy: RetryPolicy | None = None,
        attempt_timeout: float | None = 30.0,
        on_repeat: OnRepeat = "replay",
        hooks: Sequence[InvokeHook] | None = None,
        clock: Clock | None = None,
        journal: JournalOption = None,
        honours_keys: bool | None = None,
        reconcile: Reconciler | None = None,
        server: str | None = None,
    ) -> None:
        if not isinstance(plan, PlanSession):
            raise ConfigurationError(f"plan must be an agentkey.PlanSession, got {plan!r}")
        if policy is not None and not isinstance(policy, RetryPolicy):
            raise ConfigurationError(f"policy must be an agentkey.RetryPolicy, got {policy!r}")
        if attempt_timeout is not None and not attempt_timeout > 0:
            raise ConfigurationError(
                f"attempt_timeout must be > 0 or None, got {attempt_timeout!r}"
            )
        if not isinstance(session, ClientSession) and not callable(session):
            raise ConfigurationError(
                "session must be an initialised mcp.ClientSession, or a function opening "
                f"one (e.g. lambda: connect(url)), got {session!r}"
            )
        if honours_keys not in (True, False, None):
            raise ConfigurationError(f"honours_keys must be True, False or None: {honours_keys!r}")
        if reconcile is not None and not callable(reconcile):
            raise ConfigurationError(
                f"reconcile must be a function of the call in doubt: {reconcile!r}"
            )
        if clock is not None and not isinstance(clock, Clock):
            raise ConfigurationError(
                "clock must be an agentkey.Clock (e.g. agentkey.testing.FakeClock()), or None "
                f"for the system clock; got {clock!r}"
            )
        if server is not None and (not isinstance(server, str) or not server):
            raise ConfigurationError(
                f"server must be a non-empty str naming the server: {server!r}"
            )
        self._fixed = session if isinstance(session, ClientSession) else None
        self._factory = None if isinstance(session, ClientSession) else session
        self._connection: _Connection | None = None
        self._group: anyio.abc.TaskGroup | None = None
        self._plan = plan
        self._policy = policy or RetryPolicy()
        self._attempt_timeout = attempt_timeout
        self._on_repeat = check_on_repeat(on_repeat)
        self._hooks: tuple[InvokeHook, ...] = (LoggingHook(),) if hooks is None else tuple(hooks)
        clock = clock if clock is not None else default_clock()
        #: The deadlines, the waits and their jitter of every call (tests: a FakeClock).
        self._clock: Clock = clock
        self._reconcile = reconcile
        self._journal = resolve_journal(journal)
        if self._journal is not None and not self._journal.supports_async:
            raise ConfigurationError(
                f"{self._journal!r} serves ToolInvoker only; an MCP session needs a journal "
                "with an asyncio client"
            )
        # How each call's flow sleeps, tells the hooks, writes the journal and asks reconcile=
        # (its requests go through the call's _Carrier).
        self._handlers: Handlers = {
            **shared_handlers(self._hooks, self._journal, asynchronous=True),
            Sleep: lambda effect: clock.asleep(effect.seconds),
        }
        self._server = server  # else connect()'s URL, or a scope of this session alone
        self._own_scope = f"session-{secrets.token_hex(8)}"  # a factory's sessions share it
        self._seen: dict[tuple[str, str], int] = {}  # (tool, args hash) -> calls so far
        #: What the server's tools/list said, per tool: the key conventions it reads
        #: (empty: not protected). Read when first needed; a tool not in it sends agentkey's.
        self._advertised: dict[str, tuple[KeyConvention, ...]] = {}
        config = ProtocolConfig(
            base_origin=Origin("mcp", "the MCP server", 0),
            retry_statuses=self._policy.retry_statuses,
            replay_headers=DEFAULT_REPLAY_HEADERS,
            has_auth=True,
        )
        self._settings = Settings(
            config,
            self._policy,
            PollPolicy(),
            bool(self._hooks),
            self._clock.monotonic,
            self._clock.random,
            self._clock.time,
            journal=self._journal is not None,
            journal_max_body=getattr(self._journal, "max_body_bytes", 0),
            honours_keys=honours_keys,
        )
        # A call given journal=False: not looked up, not recorded (what is learnt is shared).
        self._unjournaled = dataclasses.replace(self._settings, journal=False)

    async def __aenter__(self) -> IdempotentSession:
        if self._factory is not None:
            group = anyio.create_task_group()
            await group.__aenter__()
            self._group, self._connection = group, _Connection(self._factory, group)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        group, connection = self._group, self._connection
        self._group = self._connection = None
        if group is not None and connection is not None:
            connection.close()
            await group.__aexit__(exc_type, exc, tb)

    async def session(self) -> ClientSession:
        """The SDK session in use (opened, or reopened after it died, when given a factory)."""
        if self._fixed is not None:
            return self._fixed
        if self._connection is None:
            raise ConfigurationError(
                "an IdempotentSession built from a session factory opens its sessions itself: "
                "use it as `async with IdempotentSession(factory, plan) as tools:`"
            )
        return await self._connection.session()

    @property
    def plan(self) -> PlanSession:
        """The plan session the keys are derived from."""
        return self._plan

    def _convention(self, tool: str) -> KeyConvention:
        """The convention a call of ``tool`` carries its key in: agentkey's own, unless the
        server's ``tools/list`` said the tool reads only others (then the first of those)."""
        advertised = self._advertised.get(tool)
        if not advertised or "agentkey" in advertised:
            return "agentkey"
        return advertised[0]

    async def _learn(self, session: ClientSession) -> None:
        """List the server's tools (every page) and keep what each says about its keys."""
        cursor: str | None = None
        for _ in range(_MAX_PAGES):
            params = None if cursor is None else PaginatedRequestParams(cursor=cursor)
            listed = await session.list_tools(params=params)
            for tool in listed.tools:
                self._advertised[tool.name] = _conventions_of(tool.meta or {})
            cursor = listed.next_cursor
            if not cursor:
                return

    async def _where(self) -> str:
        """``mcp://<server>``: the scope of this session's calls in the journal.

        What the client controls: the name given as ``server=``, the URL ``connect()``
        opened, else a scope of this session alone (a session given as is: that session
        object's; a factory: this object's). Never the name the server reports.
        """
        if self._server is None:
            try:
                session = await self.session()
            except _NotConnected:  # not sent anyway; the scope is decided on a later call
                return f"mcp://{self._own_scope}"
            url = _URLS.get(session)
            if url is not None:
                self._server = url
            elif self._fixed is not None:
                self._server = _SCOPES.setdefault(session, f"session-{secrets.token_hex(8)}")
            else:
                self._server = self._own_scope
        return f"mcp://{quote(self._server, safe='')}"

    def step_for(
        self,
        name: str,
        arguments: Mapping[str, Any] | BaseModel | None = None,
        *,
        step: int | Sequence[int] | None = None,
        args_model: type[BaseModel] | None = None,
    ) -> Step:
        """The plan step (and so the key) of a call.

        Without ``step``: ``(tool, n)``, the n-th call of this session with this tool
        and these arguments (so a call's key never depends on unrelated calls).
        """
        if step is not None:
            return self._plan.step(
                step, name, arguments or {}, args_model=args_model, on_repeat=self._on_repeat
            )
        values: Any = arguments or {}
        if args_model is not None:
            values = args_model.model_validate(
                values.model_dump(mode="json") if isinstance(values, BaseModel) else values
            )
        digest = args_hash(values, profile=self._plan.profile)
        ordinal = self._seen.get((name, digest), 0)
        self._seen[(name, digest)] = ordinal + 1
        return self._plan.step((code(name), ordinal), name, values, on_repeat="allow")

    async def call_tool(
        self,
        name: str,
        arguments: Mapping[str, Any] | BaseModel | None = None,
        *,
        step: int | Sequence[int] | None = None,
        args_model: type[BaseModel] | None = None,
        meta: Mapping[str, Any] | None = None,
        journal: bool = True,
    ) -> MCPToolResult:
        """Call tool ``name`` under the key of ``step``; resend the same key where safe.

        ``journal=False`` lets this call through the journal: it is sent to the server
        even when the journal holds an answer for its key (an earlier run's), and is not
        recorded. For reads (a ``lookup`` after a restart must see today's value, not
        the answer the journal kept); a tool that the server protects still replays
        what it stored for the key.

        Raises :class:`~agentkey.KeyReused` (the key belongs to another tool),
        :class:`~agentkey.PayloadMismatch`, :class:`~agentkey.KeyRejected`,
        :class:`~agentkey.TokenRejected` (a 401 again after a token refresh, or
        a server that wants an authenticated session), :class:`~agentkey.ToolRejected`
        (any other JSON-RPC error: final), :class:`~agentkey.StepInProgress` (still
        running at the deadline), :class:`~agentkey.ToolUnreachable` (no request
        reached the server) or :class:`~agentkey.OutcomeUnknown` (it may have run:
        resending the same step is safe only where the tool honours keys).
        """
        planned = self.step_for(name, arguments, step=step, args_model=args_model)
        return await self.call_step(planned, meta=meta, journal=journal)

    async def call_step(
        self, planned: Step, *, meta: Mapping[str, Any] | None = None, journal: bool = True
    ) -> MCPToolResult:
        """Send a step built beforehand (``plan.step(...)``); see :meth:`call_tool`."""
        if not isinstance(planned, Step):
            raise ConfigurationError(f"call_step takes a Step, got {type(planned).__name__}")
        if journal not in (True, False):
            raise ConfigurationError(f"journal must be True or False for one call: {journal!r}")
        key = planned.key
        # The caller's own value in the field the key would go in: refused before anything
        # is journaled or sent (the same check guards a convention learnt while sending).
        with_key(
            self._convention(planned.tool),
            planned.idempotency_key,
            planned.args,
            dict(meta or {}),
            tool=planned.tool,
        )
        where = await self._where()
        call = Call(
            f"{where}/tools/{planned.tool}",
            _METHOD,
            (),
            key.format(),
            key.label,
            key.format(),
            planned.body,
            planned.tool,
            key.plan_session_id,
            key.args_hash,
            None,
            None,
            current_owner(),
            planned.repeat_of,
            self._reconcile,
            planned.on_repeat,
        )
        carrier = _Carrier(self, planned, dict(meta or {}))
        carry = async_carrier({**self._handlers, Outgoing: carrier.outgoing})
        with in_flight(call.owner):
            settings = self._settings if journal else self._unjournaled
            done: Finished = await run_async(flow_invoke(call, settings), carry)
        result = _result_of(done.answer)
        return MCPToolResult(
            result,
            done.replayed,
            done.key,
            done.label or "",
            done.attempts,
            done.source,
            done.repeat_of,
        )


class _Carrier:
    """Carries one call's requests to an MCP session: the tool call, and the probe."""

    def __init__(self, tools: IdempotentSession, planned: Step, meta: dict[str, Any]) -> None:
        self.tools, self.planned, self.meta = tools, planned, meta
        #: The convention the last send carried the key in: a resend is safe only when the
        #: server reads that one for the tool.
        self.sent_as: KeyConvention = tools._convention(planned.tool)

    async def outgoing(self, effect: Outgoing) -> Received:
        if effect.method == "OPTIONS":
            return await self.probe(effect)
        if effect.method != _METHOD:
            return Failure(FailureKind.UNSENDABLE, "not a tool call")
        return await self.send(effect)

    async def send(self, out: Outgoing) -> Received:
        tools, planned = self.tools, self.planned
        key = dict(out.headers).get("Idempotency-Key", planned.idempotency_key)
        extra = {k: v for k, v in out.headers if k.lower() not in _OWN_HEADERS}
        timeout = self.timeout(out)
        statuses: list[int] = []
        reset = _STATUSES.set(statuses)
        try:
            session = await tools.session()
            convention = tools._convention(planned.tool)
            try:
                result = await self.call(session, convention, key, extra, timeout)
            except MCPError as exc:
                # Refused for want of a key: this server reads it elsewhere. Nothing ran, so
                # the call goes again at once in the convention its tools/list names.
                if not _wants_a_key(exc) or planned.tool in tools._advertised:
                    raise
                try:
                    await tools._learn(session)
                except _PROBE_ERRORS:
                    raise exc from None  # the refusal stands: nothing ran
                if tools._convention(planned.tool) == convention:
                    raise
                convention = tools._convention(planned.tool)
                result = await self.call(session, convention, key, extra, timeout)
        except _NotConnected as exc:
            return Failure(FailureKind.NOT_SENT, f"connect failed ({exc})")
        except MCPError as exc:
            return _reply_of(exc, statuses, out.url)
        except _TRANSPORT_ERRORS as exc:
            return Failure(FailureKind.IN_DOUBT, type(exc).__name__)
        finally:
            _STATUSES.reset(reset)
        if (result.meta or {}).get(PROTECTED_FIELD) is not True:
            named = (result.meta or {}).get(CONVENTIONS_FIELD)
            if isinstance(named, list):  # run without a key the server reads: where it does
                marked = {PROTECTED_FIELD: True, CONVENTIONS_FIELD: named}
                tools._advertised[planned.tool] = _conventions_of(marked)
        return _answer_of(result, out.url)

    async def call(
        self,
        session: ClientSession,
        convention: KeyConvention,
        key: str,
        extra: Mapping[str, str],
        wait: float | None,
    ) -> CallToolResult:
        """One ``tools/call`` of the step, its key in ``convention``."""
        planned = self.planned
        self.sent_as = convention
        args, meta, params = with_key(
            convention, key, planned.args, {**extra, **self.meta}, tool=planned.tool
        )
        wire_meta = cast(RequestParamsMeta, meta)
        if not params:
            return await session.call_tool(
                planned.tool, args, read_timeout_seconds=wait, meta=wire_meta
            )
        request = _KeyedCall(
            params=_KeyedParams(
                name=planned.tool, arguments=args, _meta=wire_meta, idempotency_key=key
            )
        )
        result = await session.send_request(
            request, CallToolResult, request_read_timeout_seconds=wait
        )
        if not result.is_error:
            await session.validate_tool_result(planned.tool, result)
        return result

    def timeout(self, out: Outgoing) -> float | None:
        """How long one request may wait: the time left before the deadline, at most
        ``attempt_timeout``."""
        tools = self.tools
        left = None if out.deadline is None else max(0.0, out.deadline - tools._clock.monotonic())
        if tools._attempt_timeout is None:
            return left
        return tools._attempt_timeout if left is None else min(left, tools._attempt_timeout)

    async def probe(self, out: Outgoing) -> Received:
        """Does the server mark this tool protected in ``tools/list``? (a harmless question)

        Asked again, with the call's backoff, until it is answered or the call's deadline
        passes (on the session's clock): after a dropped connection the server may take a
        while to come back, and the question is put to a new session once the call's
        failure ended the old one. A tool counts as protected only when the server reads
        the key where this call carried it."""
        tools = self.tools
        listed = False
        tries = 0
        while True:
            timeout = self.timeout(out)
            with anyio.move_on_after(float("inf") if timeout is None else timeout):
                try:
                    session = await tools.session()
                    await tools._learn(session)
                    listed = True
                    break
                except MCPError as exc:
                    if exc.code not in _IN_DOUBT_CODES:  # answered: it lists no tools
                        return Answer(200, {}, b"", out.url)
                except _PROBE_ERRORS:
                    pass
            tries += 1
            left = None if out.deadline is None else out.deadline - tools._clock.monotonic()
            if (left is not None and left <= 0) or (
                left is None and tries >= tools._policy.max_attempts
            ):
                break
            wait = tools._policy.schedule.delay(tries, rng=tools._clock.random)
            await tools._clock.asleep(wait if left is None else min(wait, left))
        if not listed:
            return Failure(FailureKind.NOT_SENT, f"tools/list failed ({tries} tries)")
        if self.sent_as in tools._advertised.get(self.planned.tool, ()):
            return Answer(200, {PROTECTED_HEADER.lower(): "true"}, b"", out.url)
        return Answer(200, {}, b"", out.url)


def _conventions_of(meta: Mapping[str, Any]) -> tuple[KeyConvention, ...]:
    """The key conventions a tool's ``tools/list`` entry says its server reads (none: the
    tool is not protected; protected without a list: agentkey's own, as servers said before
    they named conventions)."""
    if meta.get(PROTECTED_FIELD) is not True:
        return ()
    named = meta.get(CONVENTIONS_FIELD)
    if not isinstance(named, list):
        return _AGENTKEY_ONLY
    return tuple(name for name in CONVENTIONS if name in named)


def _wants_a_key(exc: MCPError) -> bool:
    """A refusal as ``key-required``: the server read no key where this call put it."""
    refusal = refusal_of(exc.data)
    return refusal is not None and refusal[0] == "key-required"


def _answer_of(result: CallToolResult, url: str) -> Answer:
    """A tool's result as the flow reads an answer: 200, its marks as headers."""
    meta = result.meta or {}
    headers = {}
    if meta.get(REPLAYED_FIELD) is True:
        headers["idempotent-replayed"] = "true"
    if meta.get(PROTECTED_FIELD) is True:
        headers[PROTECTED_HEADER.lower()] = "true"
    content = result.model_dump_json(by_alias=True, exclude_none=True).encode()
    return Answer(200, headers, content, url)


def _reply_of(exc: MCPError, statuses: list[int], url: str) -> Received:
    """A JSON-RPC error as the flow reads an answer (or a failure that may have run)."""
    if statuses and statuses[-1] == 401:  # the token, refused again after the refresh
        return Answer(401, {}, b"", url)
    refusal = refusal_of(exc.data)
    if refusal is not None:
        kind, retry_after = refusal
        status, problem = _REFUSALS.get(kind, (400, "idempotency_key_invalid"))
        headers: dict[str, str] = {}
        if isinstance(exc.data, Mapping) and exc.data.get(PROTECTED_FIELD) is True:
            headers[PROTECTED_HEADER.lower()] = "true"  # agentkey's server marked the tool
        if retry_after is not None:
            headers["retry-after"] = str(max(0, round(retry_after)))
        body = {"type": f"urn:agentkey:problem:{problem}", "detail": _cut(exc.message)}
        return Answer(status, headers, json.dumps(body).encode(), url)
    if exc.code in _IN_DOUBT_CODES:
        return Failure(FailureKind.IN_DOUBT, f"JSON-RPC error {exc.code}")
    body = {"error": f"JSON-RPC error {exc.code}: {_cut(exc.message)}"}
    return Answer(400, {}, json.dumps(body).encode(), url)


def _result_of(answer: Answer) -> CallToolResult:
    """The tool's result an answer carries (live, or kept by the journal)."""
    try:
        return CallToolResult.model_validate_json(answer.content)
    except ValueError:
        text = answer.content.decode("utf-8", "replace")
        return CallToolResult(content=[TextContent(type="text", text=text)], is_error=False)


def _cut(text: str, limit: int = 200) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit] + "..."
