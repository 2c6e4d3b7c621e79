"""The client half: ``tools/call`` with a deterministic key, retries and token refresh."""

from __future__ import annotations

import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
    Sequence,
)
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import TracebackType
from typing import Any, cast

import anyio
import anyio.abc
from mcp import Client, ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client  # the SDK's own client factory
from mcp.shared.exceptions import MCPError
from mcp_types import (
    CONNECTION_CLOSED,
    INTERNAL_ERROR,
    REQUEST_TIMEOUT,
    CallToolResult,
    RequestParamsMeta,
)
from pydantic import BaseModel

from ... import _http
from ..._exceptions import (
    AuthenticationError,
    ConfigurationError,
    InvokeError,
    KeyRejected,
    KeyReused,
    OutcomeUnknown,
    PayloadMismatch,
    StepInProgress,
    ToolRejected,
)
from ..._hooks import (
    AttemptEvent,
    CallEndEvent,
    CallStartEvent,
    GiveUpEvent,
    InvokeEvent,
    InvokeHook,
    LoggingHook,
    ReplayEvent,
    RetryEvent,
)
from ..._plan import OnRepeat, PlanSession, Step, check_on_repeat
from ..._policy import RetryPolicy
from ...auth import TokenProvider
from ._wire import KEY_FIELD, REPLAYED_FIELD, refusal_of

__all__ = ["IdempotentSession", "MCPToolResult", "SessionFactory", "connect"]

#: Opens a new initialised session: ``lambda: connect(url, auth=provider)``, or
#: ``lambda: mcp.Client(url)`` (whose ``.session`` is used).
SessionFactory = Callable[[], AbstractAsyncContextManager["ClientSession | Client"]]

#: JSON-RPC codes after which the tool may or may not have run: the connection closed
#: (a reset, a stream that ended without an answer), the read timed out, or the server
#: (or a proxy, as an HTTP 5xx) failed while handling the call.
_AMBIGUOUS_CODES = frozenset({CONNECTION_CLOSED, REQUEST_TIMEOUT, INTERNAL_ERROR})
#: Exceptions of the transport itself, seen when the session's streams broke.
_TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    anyio.ClosedResourceError,
    anyio.BrokenResourceError,
    anyio.EndOfStream,
    OSError,
)
_METHOD = "tools/call"  # the "method" of the call events; their "url" is the tool name


@dataclass(frozen=True, slots=True)
class MCPToolResult:
    """What :meth:`IdempotentSession.call_tool` returns.

    ``result`` is the SDK's ``CallToolResult`` as the server sent it (a tool's
    own failure is a result with ``is_error`` true, as in MCP); ``replayed`` is
    true when the server answered with the result stored for this key.
    """

    result: CallToolResult
    replayed: bool
    idempotency_key: str
    step: str
    attempts: int


#: Set by IdempotentSession around each attempt: the HTTP statuses of that attempt's
#: requests. The SDK sends in the caller's context, so the client's response hook
#: (see :func:`connect`) sees it; the SDK turns any HTTP error into one JSON-RPC error,
#: and this tells a refused token (401 after the provider's one refresh) from the rest.
_STATUSES: ContextVar[list[int] | None] = ContextVar("agentkey_mcp_statuses", default=None)


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
    :class:`~agentkey.AuthenticationError`. ``session_options`` go to
    ``ClientSession`` (``read_timeout_seconds``, callbacks). The HTTP client has
    the SDK's own timeouts.
    """
    if auth is not None and not isinstance(auth, TokenProvider):
        raise ConfigurationError(
            f"auth must be an agentkey token provider (ClientCredentials, ...), got {auth!r}"
        )
    client = create_mcp_http_client(headers=dict(headers or {}))
    client.auth = _http.adapt_auth(auth, client)  # type: ignore[arg-type]  # httpx2: the fork
    client.event_hooks["response"].append(_record_status)
    async with (
        client,
        streamable_http_client(url, http_client=client) as (read, write),
        ClientSession(read, write, **session_options) as session,
    ):
        await session.initialize()
        yield session


@dataclass(frozen=True, slots=True)
class _Retry:
    reason: str
    retry_after: float | None
    in_flight: bool = False
    ambiguous: bool = False


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


class IdempotentSession:
    """Calls the tools of one MCP session, each call under a deterministic key.

    The key is ``plan.step(step, name, arguments)``'s: the same plan, step,
    tool and arguments give the same key in every process, so the server runs
    the call at most once and replays its stored result afterwards. It goes in
    ``params._meta["io.agentkey/idempotency-key"]``.

    A call that fails ambiguously (connection closed or reset, read timeout,
    server error) is sent again with the same key, and so is one the server
    refuses as in progress or unavailable, within ``policy`` (attempts,
    backoff, ``Retry-After``-style hints, the overall deadline). Each attempt
    waits at most ``attempt_timeout`` seconds for its answer.

    ``session`` is an initialised ``ClientSession``, or a function that opens one
    (:data:`SessionFactory`, e.g. ``lambda: connect(url, auth=provider)``); then use
    the object as ``async with IdempotentSession(factory, plan) as tools:``, and a
    session that its transport ended is replaced by a new one before the resend.

    ``step`` defaults to a counter (0, 1, 2...) of this object's calls, which
    is deterministic only when the calls are made in the same order every run;
    give ``step=`` explicitly for concurrent calls or for a plan resumed in
    another process.
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
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        clock: Callable[[], float] = time.monotonic,
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
        self._fixed = session if isinstance(session, ClientSession) else None
        self._factory = None if isinstance(session, ClientSession) else session
        self._connection: _Connection | None = None
        self._group: anyio.abc.TaskGroup | None = None
        self._plan = plan
        self._policy = policy or RetryPolicy()
        self._attempt_timeout = attempt_timeout
        self._on_repeat = check_on_repeat(on_repeat)
        self._hooks: tuple[InvokeHook, ...] = (LoggingHook(),) if hooks is None else tuple(hooks)
        self._sleep = sleep
        self._clock = clock
        self._next = 0

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

    def step_for(
        self,
        name: str,
        arguments: Mapping[str, Any] | BaseModel | None = None,
        *,
        step: int | Sequence[int] | None = None,
        args_model: type[BaseModel] | None = None,
    ) -> Step:
        """The plan step (and so the key) of a call; advances the counter when ``step`` is None."""
        if step is None:
            step, self._next = self._next, self._next + 1
        return self._plan.step(
            step, name, arguments or {}, args_model=args_model, on_repeat=self._on_repeat
        )

    async def call_tool(
        self,
        name: str,
        arguments: Mapping[str, Any] | BaseModel | None = None,
        *,
        step: int | Sequence[int] | None = None,
        args_model: type[BaseModel] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> MCPToolResult:
        """Call tool ``name`` under the key of ``step``; resend the same key until answered.

        Raises :class:`~agentkey.KeyReused` (the key belongs to another tool),
        :class:`~agentkey.PayloadMismatch`, :class:`~agentkey.KeyRejected`,
        :class:`~agentkey.AuthenticationError` (a 401 again after a token refresh),
        :class:`~agentkey.ToolRejected` (any other JSON-RPC error: final),
        :class:`~agentkey.StepInProgress` (still running when the budget ran
        out) or :class:`~agentkey.OutcomeUnknown` (the budget ran out after an
        ambiguous failure: resending later with the same ``step`` is safe).
        """
        planned = self.step_for(name, arguments, step=step, args_model=args_model)
        return await self.call_step(planned, meta=meta)

    async def call_step(
        self, planned: Step, *, meta: Mapping[str, Any] | None = None
    ) -> MCPToolResult:
        """Send a step built beforehand (``plan.step(...)``); see :meth:`call_tool`."""
        key, label = planned.idempotency_key, planned.label
        self._emit(CallStartEvent(key, label, _METHOD, planned.tool, planned.tool))
        sent = [0]
        try:
            got = await self._send(planned, meta, sent)
        except BaseException as exc:
            attempts = exc.attempts if isinstance(exc, InvokeError) else sent[0]
            self._emit(CallEndEvent(key, label, None, attempts, 0, None, type(exc).__name__))
            raise
        outcome = "replayed" if got.replayed else "executed"
        self._emit(CallEndEvent(key, label, outcome, got.attempts, 0, None, None))
        return got

    async def _send(
        self, planned: Step, meta: Mapping[str, Any] | None, sent: list[int]
    ) -> MCPToolResult:
        key, label, policy = planned.idempotency_key, planned.label, self._policy
        deadline = self._clock() + policy.deadline
        attempts, saw_ambiguous, last = 0, False, _Retry("not sent", None)
        while True:
            remaining = deadline - self._clock()
            if remaining <= 0:
                break
            attempts = sent[0] = attempts + 1
            timeout = remaining
            if self._attempt_timeout is not None:
                timeout = min(remaining, self._attempt_timeout)
            added: dict[str, str] = {}  # a hook's additions, e.g. traceparent
            self._emit(AttemptEvent(key, label, attempts, _METHOD, planned.tool, added))
            wire_meta = cast(RequestParamsMeta, {**added, **(meta or {}), KEY_FIELD: key})
            statuses: list[int] = []
            reset = _STATUSES.set(statuses)
            try:
                session = await self.session()
                result = await session.call_tool(
                    planned.tool, planned.args, read_timeout_seconds=timeout, meta=wire_meta
                )
            except _NotConnected as exc:
                last = _Retry(f"connect failed ({exc})", None)
            except MCPError as exc:
                if statuses and statuses[-1] == 401:
                    raise self._unauthorized(planned, attempts) from None
                last = self._classify(exc, planned, attempts)
            except _TRANSPORT_ERRORS as exc:
                last = _Retry(type(exc).__name__, None, ambiguous=True)
            else:
                return self._done(result, planned, attempts)
            finally:
                _STATUSES.reset(reset)
            saw_ambiguous = saw_ambiguous or last.ambiguous
            if attempts >= policy.max_attempts:
                break
            wait = policy.schedule.delay(attempts, last.retry_after)
            wait = min(wait, max(0.0, deadline - self._clock()))
            self._emit(RetryEvent(key, label, attempts, last.reason, wait, None))
            await self._sleep(wait)
        raise self._give_up(planned, attempts, last, saw_ambiguous)

    # -- one answer ------------------------------------------------------------------

    def _done(self, result: CallToolResult, planned: Step, attempts: int) -> MCPToolResult:
        replayed = bool(result.meta) and (result.meta or {}).get(REPLAYED_FIELD) is True
        if replayed:
            self._emit(ReplayEvent(planned.idempotency_key, planned.label, 200))
        return MCPToolResult(result, replayed, planned.idempotency_key, planned.label, attempts)

    @staticmethod
    def _unauthorized(planned: Step, attempts: int) -> AuthenticationError:
        return AuthenticationError(
            f"the MCP server refused the bearer token for {planned.label} of tool "
            f"{planned.tool!r} (key {planned.idempotency_key}) again after a refresh (401), so "
            "the call was not run. Check the token's audience and scopes for this server",
            idempotency_key=planned.idempotency_key,
            step=planned.label,
            attempts=attempts,
            status_code=401,
        )

    def _classify(self, exc: MCPError, planned: Step, attempts: int) -> _Retry:
        """A retry decision for a JSON-RPC error, or raise the final error it means."""
        refusal = refusal_of(exc.data)
        if refusal is not None:
            kind, retry_after = refusal
            if kind == "in-progress":
                return _Retry("in flight", retry_after, in_flight=True)
            if kind == "unavailable":
                return _Retry("idempotency store unavailable", retry_after)
            raise self._refused(kind, exc, planned, attempts)
        if exc.code in _AMBIGUOUS_CODES:
            return _Retry(f"JSON-RPC error {exc.code}", None, ambiguous=True)
        raise ToolRejected(
            f"tool {planned.tool!r} refused {planned.label} (key {planned.idempotency_key}) with "
            f"JSON-RPC error {exc.code}: {_cut(exc.message)}. Resending the same step will not "
            "help; fix the call or its arguments (a new argument makes a new key)",
            **self._context(planned, attempts, exc),
        )

    def _refused(self, kind: str, exc: MCPError, planned: Step, attempts: int) -> InvokeError:
        where = f"{planned.label} of tool {planned.tool!r} (key {planned.idempotency_key})"
        context = self._context(planned, attempts, exc)
        if kind == "key-reused":
            return KeyReused(
                f"the server bound the key of {where} to another tool, so it refused the call "
                "rather than answer with another tool's result. Give each tool call its own step "
                "index (a PlanSession never gives one index to two tools)",
                **context,
            )
        if kind == "payload-mismatch":
            return PayloadMismatch(
                f"the server says the arguments of {where} do not match the key's args_hash. "
                "Send the arguments exactly as the plan step holds them (Step.args)",
                **context,
            )
        if kind == "unauthenticated":
            return AuthenticationError(
                f"the server refused {where} because the session is not authenticated, so "
                "nothing ran; connect with credentials (connect(url, auth=...)) and call again "
                "with the same step",
                **context,
            )
        return KeyRejected(
            f"the server refused the idempotency key of {where} ({kind}): it expects the "
            f"key in params._meta[{KEY_FIELD!r}] as <plan_session_id>:<step>:<args_hash>",
            **context,
        )

    @staticmethod
    def _context(planned: Step, attempts: int, exc: MCPError) -> dict[str, Any]:
        return {
            "idempotency_key": planned.idempotency_key,
            "step": planned.label,
            "attempts": attempts,
            "body": exc.data,
            "reason": _cut(exc.message),
        }

    def _give_up(self, planned: Step, attempts: int, last: _Retry, ambiguous: bool) -> InvokeError:
        key, label = planned.idempotency_key, planned.label
        context: dict[str, Any] = {"idempotency_key": key, "step": label, "attempts": attempts}
        error: InvokeError
        if last.in_flight:
            error = StepInProgress(
                f"{label} of tool {planned.tool!r} (key {key}) was still running on the server "
                f"after {attempts} attempt(s); call again later with the same step to get its "
                "result",
                **context,
            )
        elif ambiguous:
            error = OutcomeUnknown(
                f"{label} of tool {planned.tool!r} (key {key}) may or may not have run: the last "
                f"of {attempts} attempt(s) failed with {last.reason}. Resending later with the "
                "same step (the same key) is safe: the server replays the stored result",
                **context,
            )
        else:
            error = InvokeError(
                f"{label} of tool {planned.tool!r} (key {key}) was not run: the server answered "
                f"{last.reason} to all {attempts} attempt(s); retry later with the same step",
                **context,
            )
        self._emit(GiveUpEvent(key, label, attempts, 0, last.reason, type(error).__name__))
        return error

    def _emit(self, event: InvokeEvent) -> None:
        for hook in self._hooks:
            hook(event)


def _cut(text: str, limit: int = 200) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit] + "..."
