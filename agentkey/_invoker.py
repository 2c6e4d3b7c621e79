"""ToolInvoker and AsyncToolInvoker: one step, one side effect, whatever the network does.

All logic lives in one generator, :meth:`_InvokerBase._flow`, in the style of
``httpx.Auth.auth_flow``: it yields :class:`~agentkey._http.Outgoing` (send
this) or :class:`_Sleep` (wait this long) and receives the reply. tenacity,
configured from the ``RetryPolicy`` in ``_policy.retry_engine``, decides
attempts and waits; the protocol core (``_protocol``) classifies answers.
The two drivers below only send, sleep and await.
"""

from __future__ import annotations

import asyncio
import enum
import re
import time
import types
from collections.abc import Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias
from urllib.parse import quote, urlsplit, urlunsplit

import tenacity
from pydantic import BaseModel, ConfigDict, computed_field

from ._exceptions import ConfigurationError, InsecureTransport, InvokeError, PollTimeout
from ._hooks import (
    GiveUpEvent,
    InvokeHook,
    LoggingHook,
    PollEvent,
    ReplayEvent,
    RetryEvent,
    _one_line,
)
from ._http import (
    DEFAULT_MAX_RESPONSE_BYTES,
    AsyncClient,
    Auth,
    Client,
    Outgoing,
    Timeout,
    make_async_client,
    make_client,
    make_max_response_bytes,
    make_timeout,
    send_async,
    send_sync,
)
from ._keys import HeaderStyle, StepKey
from ._plan import Step
from ._policy import PollPolicy, RetryPolicy, retry_engine
from ._protocol import (
    DEFAULT_REPLAY_HEADERS,
    Action,
    Answer,
    CallContext,
    Decision,
    ProtocolConfig,
    Reply,
    budget_exhausted,
    classify,
    interpret_poll,
    is_loopback,
    origin_of,
    parse_json,
    poll_target,
)

__all__ = ["AsyncToolInvoker", "Outcome", "ToolInvoker", "ToolResult"]

KEY_HEADER = "Idempotency-Key"
_RESERVED = frozenset(
    {
        "idempotency-key",
        "authorization",
        "proxy-authorization",
        "content-type",
        "content-length",
        "accept-encoding",  # agentkey decodes answers itself, with a size limit
    }
)
_MAX_POLL_REDIRECTS = 10
_CREDENTIAL_HEADERS = ("authorization", "cookie", "proxy-authorization")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 field-name
_FIELD_VALUE = re.compile(r"(?:[\x21-\x7e](?:[\x20-\x7e\t]*[\x21-\x7e])?)?")  # visible ASCII


class Outcome(str, enum.Enum):
    """Whether this call ran the step or received the stored outcome of an earlier run."""

    EXECUTED = "executed"
    REPLAYED = "replayed"


class ToolResult(BaseModel):
    """The final answer of one step: what the tool said, and how agentkey got there."""

    model_config = ConfigDict(frozen=True)

    status_code: int
    body: Any = None
    headers: dict[str, str]
    outcome: Outcome
    idempotency_key: str
    step: str | None = None
    attempts: int
    polls: int = 0
    elapsed: float
    status_url: str | None = None

    @computed_field  # type: ignore[prop-decorator]  # pydantic's documented pattern
    @property
    def replayed(self) -> bool:
        """True when the tool replayed a stored outcome instead of running the step now."""
        return self.outcome is Outcome.REPLAYED


@dataclass(frozen=True, slots=True)
class _Sleep:
    seconds: float


_Flow: TypeAlias = Generator["Outgoing | _Sleep", "Reply | None", ToolResult]


@dataclass(frozen=True, slots=True)
class _Call:
    """Everything one logical call needs, computed once before the first send."""

    url: str
    method: str
    headers: tuple[tuple[str, str], ...] = field(repr=False)  # user headers (checked)
    key: StepKey
    key_value: str  # the header value in the configured style
    body: bytes


def _redact(url: str) -> str:
    parts = urlsplit(url)  # status URLs may be signed: keep query and fragment out of messages
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


class _InvokerBase:
    def __init__(
        self,
        base_url: str,
        *,
        auth: Auth | None,
        retry: RetryPolicy,
        polling: PollPolicy,
        timeout: float | Timeout | None,
        key_header_style: HeaderStyle,
        replay_headers: Sequence[str],
        allowed_poll_origins: Iterable[str],
        routes: Mapping[str, str] | None,
        route_template: str | None,
        hooks: Sequence[InvokeHook] | None,
        max_response_bytes: int,
    ) -> None:
        origin = origin_of(base_url) if isinstance(base_url, str) else None
        if origin is None or urlsplit(base_url).query or urlsplit(base_url).fragment:
            raise ConfigurationError(
                f"base_url must be an absolute http:// or https:// URL with a host and no "
                f"query, e.g. 'https://tools.example.com', got {base_url!r}"
            )
        if "@" in urlsplit(base_url).netloc:
            # httpx would send them as Basic auth, and the invoker's repr would show them.
            raise ConfigurationError(
                "base_url must not carry credentials (user:password@); pass them through auth="
            )
        if auth is not None and not isinstance(auth, Auth):
            raise ConfigurationError(f"auth must be an httpx.Auth or None, got {auth!r}")
        if auth is not None and origin.scheme == "http" and not is_loopback(origin.host):
            raise InsecureTransport(
                f"auth= would send credentials over plain http to {origin.host!r}; use an "
                "https:// base_url (plain http is allowed to loopback hosts alone)"
            )
        if not isinstance(retry, RetryPolicy):
            raise ConfigurationError(f"retry must be a RetryPolicy, got {retry!r}")
        if not isinstance(polling, PollPolicy):
            raise ConfigurationError(f"polling must be a PollPolicy, got {polling!r}")
        if key_header_style not in ("raw", "sf-string"):
            raise ConfigurationError(
                f"key_header_style must be 'raw' or 'sf-string', got {key_header_style!r}"
            )
        if isinstance(replay_headers, str) or not all(
            isinstance(h, str) and h.strip() for h in replay_headers
        ):
            raise ConfigurationError(
                f"replay_headers must be a sequence of header names, got {replay_headers!r}"
            )
        if isinstance(allowed_poll_origins, str) or not isinstance(allowed_poll_origins, Iterable):
            raise ConfigurationError(
                "allowed_poll_origins must be a list of origins like "
                f"['https://status.example.com'], got {allowed_poll_origins!r}"
            )
        if routes is not None and not isinstance(routes, Mapping):
            raise ConfigurationError(
                f"routes must map tool names to paths, e.g. {{'create_db': '/tools/create_db'}}"
                f", got {type(routes).__name__}"
            )
        if hooks is not None and (callable(hooks) or not isinstance(hooks, Iterable)):
            raise ConfigurationError(
                f"hooks must be a sequence of callables, e.g. hooks=[my_hook], got {hooks!r}"
            )
        allowed = set()
        for entry in allowed_poll_origins:
            allowed_origin = origin_of(entry) if isinstance(entry, str) else None
            if allowed_origin is not None and "@" in urlsplit(entry).netloc:
                raise ConfigurationError(
                    "allowed_poll_origins entries are bare origins: no user:password@ "
                    "(polls to them never carry credentials)"
                )
            if allowed_origin is None or urlsplit(entry).path not in ("", "/"):
                raise ConfigurationError(
                    f"allowed_poll_origins entries are origins like 'https://status.example.com'"
                    f", got {entry!r}"
                )
            allowed.add(allowed_origin)
        if route_template is not None and (
            not isinstance(route_template, str) or "{tool}" not in route_template
        ):
            raise ConfigurationError(
                f"route_template must contain '{{tool}}', e.g. '/tools/{{tool}}', "
                f"got {route_template!r}"
            )
        hooks = (LoggingHook(),) if hooks is None else tuple(hooks)
        if not all(callable(h) for h in hooks):
            raise ConfigurationError(f"hooks must be callables taking one event, got {hooks!r}")
        self._base_url = base_url.rstrip("/")
        self._auth = auth
        self._retry = retry
        self._polling = polling
        self._timeout = make_timeout(timeout)
        self._max_bytes = make_max_response_bytes(max_response_bytes)
        self._style: HeaderStyle = key_header_style
        self._routes = {str(k): _check_path(v) for k, v in (routes or {}).items()}
        self._route_template = route_template
        self._hooks: tuple[InvokeHook, ...] = hooks
        self._config = ProtocolConfig(
            base_origin=origin,
            retry_statuses=retry.retry_statuses,
            replay_headers=tuple(replay_headers),
            allowed_poll_origins=frozenset(allowed),
            has_auth=auth is not None,
        )
        self._closed = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._base_url!r})"

    def _check_client_headers(self, client: Client | AsyncClient | None) -> None:
        """A user client's default credential headers obey the same plain-http rule as auth=."""
        origin = self._config.base_origin
        if client is None or origin.scheme != "http" or is_loopback(origin.host):
            return
        carried = sorted(name for name in _CREDENTIAL_HEADERS if name in client.headers)
        if carried:
            raise InsecureTransport(
                f"client= sends {', '.join(carried)} by default, and base_url is plain http to "
                f"{origin.host!r}; use an https:// base_url (plain http is allowed to loopback "
                "hosts alone)"
            )

    # --- preparing a call: everything checked at the boundary, the key computed once --------

    def _prepare(
        self,
        step: Step,
        path: str | None,
        method: str,
        headers: Mapping[str, str] | None,
        idempotency_key: str | None,
    ) -> _Call:
        if self._closed:
            raise ConfigurationError(f"{self!r} is closed; create a new invoker")
        if not isinstance(step, Step):
            raise ConfigurationError(
                f"invoke() takes a Step (from PlanSession.step()), got {type(step).__name__}"
            )
        if not isinstance(method, str) or not method.isalpha():
            raise ConfigurationError(f"method must be an HTTP method name, got {method!r}")
        key = step.key if idempotency_key is None else StepKey.parse(idempotency_key)
        if path is None:
            if step.tool in self._routes:
                path = self._routes[step.tool]
            elif self._route_template is not None:
                path = self._route_template.format(tool=quote(step.tool, safe=""))
            else:
                raise ConfigurationError(
                    f"no route for tool {step.tool!r} at {key.step_label}: pass path=, or set "
                    "routes={tool: path} or route_template='/tools/{tool}' on the invoker"
                )
        return _Call(
            url=f"{self._base_url}/{_check_path(path).lstrip('/')}",
            method=method.upper(),
            headers=_check_headers(headers),
            key=key,
            key_value=key.header_value(self._style),
            body=step.body,
        )

    def _ctx(self, call: _Call, attempts: int, polls: int = 0) -> CallContext:
        return CallContext(call.key.format(), call.key.step_label, attempts, polls)

    def _emit(self, event: RetryEvent | PollEvent | ReplayEvent | GiveUpEvent) -> None:
        for hook in self._hooks:
            hook(event)

    # --- the one flow both drivers run ----------------------------------------------------

    def _flow(self, call: _Call) -> _Flow:
        start = time.monotonic()
        deadline = start + self._retry.deadline  # the caller's: bounds every send and poll
        engine, state = retry_engine(self._retry)
        url, attempts, saw_ambiguous, saw_in_flight = call.url, 0, False, False
        headers = (
            *call.headers,
            ("Content-Type", "application/json"),
            ("Accept", "application/json"),
            (KEY_HEADER, call.key_value),
        )
        decision: Decision | None = None
        reply: Reply | None = None
        while True:
            action = engine.iter(state)
            if isinstance(action, tenacity.DoAttempt):
                if decision is not None and time.monotonic() >= deadline:
                    action = decision  # the deadline passed during the wait: the last answer stands
                    break
                reply = yield Outgoing(call.method, url, headers, call.body, True, deadline)
                assert reply is not None
                attempts += 1
                decision = classify(reply, self._ctx(call, attempts), self._config)
                saw_ambiguous = saw_ambiguous or decision.ambiguous
                saw_in_flight = saw_in_flight or decision.in_flight
                url = decision.url if decision.action is Action.FOLLOW and decision.url else url
                state.set_result(decision)
            elif isinstance(action, tenacity.DoSleep):
                assert decision is not None
                state.prepare_for_next_attempt()
                wait = float(action)
                self._emit(
                    RetryEvent(
                        call.key.format(),
                        call.key.step_label,
                        attempts,
                        decision.reason,
                        wait,
                        decision.status_code,
                    )
                )
                if wait > 0:
                    yield _Sleep(wait)
            else:
                break
        final: Decision = action
        ctx = self._ctx(call, attempts)
        if final.retry:
            error = budget_exhausted(
                final, ctx, saw_ambiguous=saw_ambiguous, saw_in_flight=saw_in_flight
            )
            self._give_up(ctx, final.reason, error)
            raise error
        if final.replayed:
            assert isinstance(reply, Answer)
            self._emit(ReplayEvent(ctx.idempotency_key, ctx.step, reply.status_code))
        if final.action is Action.RAISE:
            assert final.error is not None
            raise final.error
        assert isinstance(reply, Answer)
        if final.action is Action.DONE:
            return self._result(reply, call, final.replayed, attempts, 0, start, None)
        assert final.url is not None
        first_wait = None
        if final.action is Action.POLL:
            hint = interpret_poll(reply, ctx, self._config).retry_after
            first_wait = self._polling.interval if hint is None else hint
        return (
            yield from self._poll(
                call,
                final.url,
                ctx,
                final.replayed,
                start,
                first_wait,
                result_only=final.action is Action.FETCH,
            )
        )

    def _give_up(self, ctx: CallContext, reason: str, error: InvokeError) -> None:
        self._emit(
            GiveUpEvent(
                ctx.idempotency_key, ctx.step, ctx.attempts, ctx.polls, reason, type(error).__name__
            )
        )

    def _poll(
        self,
        call: _Call,
        status_url: str,
        ctx: CallContext,
        replayed: bool,
        start: float,
        wait: float | None,
        *,
        result_only: bool = False,
    ) -> _Flow:
        # Polls end at the poll deadline or the caller's deadline, whichever comes first.
        call_deadline = start + self._retry.deadline
        deadline = min(time.monotonic() + self._polling.deadline, call_deadline)
        url, polls, hops = status_url, 0, 0
        while True:
            same_origin = poll_target(url, ctx, self._config)  # raises UnsafeRedirect
            if wait:
                wait = max(0.0, min(wait, self._polling.max_interval, deadline - time.monotonic()))
                if polls == 0:  # the wait between the 202 and the first poll
                    self._emit(PollEvent(ctx.idempotency_key, ctx.step, 0, url, "accepted", wait))
                yield _Sleep(wait)
            # Same origin: the step's key goes along so the tool can correlate the poll; any
            # other (explicitly allowed) origin gets neither key, credentials nor user headers.
            headers = (
                (*call.headers, ("Accept", "application/json"), (KEY_HEADER, call.key_value))
                if same_origin
                else (("Accept", "application/json"),)
            )
            # The caller's deadline cuts a poll short; the poll deadline only stops new polls.
            reply = yield Outgoing("GET", url, headers, None, same_origin, call_deadline)
            assert reply is not None
            polls += 1
            ctx = CallContext(ctx.idempotency_key, ctx.step, ctx.attempts, polls)
            decision = interpret_poll(reply, ctx, self._config, result_only=result_only)
            if decision.action is Action.DONE:
                assert isinstance(reply, Answer)
                return self._result(reply, call, replayed, ctx.attempts, polls, start, status_url)
            if decision.action is Action.RAISE:
                assert decision.error is not None
                raise decision.error
            if decision.action in (Action.FOLLOW, Action.FETCH):
                assert decision.url is not None
                hops += 1
                if hops > _MAX_POLL_REDIRECTS:
                    raise ctx.error(InvokeError, f"polling {ctx.where()} redirected too often")
                url, wait = decision.url, None
                result_only = result_only or decision.action is Action.FETCH
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                which = (
                    f"the call's deadline (RetryPolicy.deadline={self._retry.deadline:g} s)"
                    if deadline >= call_deadline
                    else f"the poll deadline (PollPolicy.deadline={self._polling.deadline:g} s)"
                )
                error = PollTimeout(
                    f"{ctx.where()} was still {_one_line(decision.reason)!r} at "
                    f"{_redact(status_url)} after {polls} poll(s) and {which}; it has not "
                    "failed. Call invoker.resume_poll(error.status_url, error.idempotency_key) "
                    "later to finish it without sending the step again",
                    status_url=status_url,
                    idempotency_key=ctx.idempotency_key,
                    step=ctx.step,
                    attempts=ctx.attempts,
                    status_code=decision.status_code,
                )
                self._give_up(ctx, decision.reason, error)
                raise error
            hint = decision.retry_after
            wait = self._polling.wait(polls) if hint is None else hint
            wait = min(wait, self._polling.max_interval, remaining)
            self._emit(PollEvent(ctx.idempotency_key, ctx.step, polls, url, decision.reason, wait))

    def _resume(self, status_url: str, key: str, headers: Mapping[str, str] | None) -> _Flow:
        if self._closed:
            raise ConfigurationError(f"{self!r} is closed; create a new invoker")
        parsed = StepKey.parse(key)
        if not isinstance(status_url, str) or origin_of(status_url) is None:
            raise ConfigurationError(
                f"status_url must be an absolute URL, got {_redact_any(status_url)!r}"
            )
        extra = _check_headers(headers)
        call = _Call(status_url, "GET", extra, parsed, parsed.header_value(self._style), b"")
        ctx = self._ctx(call, 0)
        return self._poll(call, status_url, ctx, False, time.monotonic(), None)

    def _result(
        self,
        answer: Answer,
        call: _Call,
        replayed: bool,
        attempts: int,
        polls: int,
        start: float,
        status_url: str | None,
    ) -> ToolResult:
        return ToolResult(
            status_code=answer.status_code,
            body=parse_json(answer.content),
            headers=dict(answer.headers),
            outcome=Outcome.REPLAYED if replayed else Outcome.EXECUTED,
            idempotency_key=call.key.format(),
            step=call.key.step_label,
            attempts=attempts,
            polls=polls,
            elapsed=time.monotonic() - start,
            status_url=status_url,
        )


def _redact_any(value: object) -> object:
    return _redact(value) if isinstance(value, str) else value


def _check_path(path: object) -> str:
    if (
        not isinstance(path, str)
        or "://" in path
        or path.startswith("//")
        or "?" in path
        or "#" in path
        or any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in path)
    ):
        raise ConfigurationError(
            f"a route must be a path such as '/tools/create_db' (no scheme, host, query, "
            "fragment or control characters), "
            f"got {path!r}"
        )
    return path


def _check_headers(headers: Mapping[str, str] | None) -> tuple[tuple[str, str], ...]:
    if headers is None:
        return ()
    if not isinstance(headers, Mapping):
        raise ConfigurationError(
            f"headers must be a mapping of names to values, e.g. {{'X-Tenant': 'acme'}}, "
            f"got {type(headers).__name__}"
        )
    out = []
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise ConfigurationError("headers must map str names to str values")
        if not _TOKEN.fullmatch(name):
            raise ConfigurationError(
                f"headers= holds {name!r}, which is not a valid HTTP header name "
                "(letters, digits and !#$%&'*+-.^_`|~ only)"
            )
        if not _FIELD_VALUE.fullmatch(value):
            # The value is never echoed: headers= is where API keys travel.
            raise ConfigurationError(
                f"the value of header {name!r} holds a character HTTP cannot carry (a line "
                "break, a control character or non-ASCII text); encode it (e.g. base64 or "
                "percent-encoding) before passing it"
            )
        if name.lower() in _RESERVED:
            raise ConfigurationError(
                f"headers= cannot set {name!r}: agentkey sets it (the key comes from the step "
                "or idempotency_key=, credentials from auth=, the body is canonical JSON, and "
                "answers are decoded by agentkey with a size limit)"
            )
        out.append((name, value))
    return tuple(out)


class ToolInvoker(_InvokerBase):
    """Call tools over HTTP so that each step runs at most once (synchronous driver).

    Use it as a context manager, or call :meth:`close`. A ``client`` you pass
    (proxies, mTLS, event hooks) is used as is and not closed; auth and
    redirects are still set per request by agentkey.
    """

    def __init__(
        self,
        base_url: str,
        *,
        auth: Auth | None = None,
        retry: RetryPolicy = RetryPolicy(),  # noqa: B008 - frozen, so sharing is safe
        polling: PollPolicy = PollPolicy(),  # noqa: B008 - frozen, so sharing is safe
        client: Client | None = None,
        timeout: float | Timeout | None = None,
        key_header_style: HeaderStyle = "raw",
        replay_headers: Sequence[str] = DEFAULT_REPLAY_HEADERS,
        allowed_poll_origins: Iterable[str] = (),
        routes: Mapping[str, str] | None = None,
        route_template: str | None = None,
        hooks: Sequence[InvokeHook] | None = None,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    ) -> None:
        if client is not None and not isinstance(client, Client):
            raise ConfigurationError(f"client must be an httpx.Client, got {client!r}")
        super().__init__(
            base_url, auth=auth, retry=retry, polling=polling, timeout=timeout,
            key_header_style=key_header_style, replay_headers=replay_headers,
            allowed_poll_origins=allowed_poll_origins, routes=routes,
            route_template=route_template, hooks=hooks, max_response_bytes=max_response_bytes,
        )  # fmt: skip
        self._owns_client = client is None
        self._check_client_headers(client)
        self._client = client if client is not None else make_client(self._timeout)

    def invoke(
        self,
        step: Step,
        *,
        path: str | None = None,
        method: str = "POST",
        headers: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
    ) -> ToolResult:
        """Run ``step`` once: same key on every resend, polls a 202 to its end."""
        return self._drive(self._flow(self._prepare(step, path, method, headers, idempotency_key)))

    def resume_poll(
        self, status_url: str, key: str, *, headers: Mapping[str, str] | None = None
    ) -> ToolResult:
        """Finish polling a step after :class:`PollTimeout`, without sending the step again.

        ``headers`` are the extra headers the original ``invoke`` sent (a tenant id, say);
        like there, they go to the tool's own origin only.
        """
        return self._drive(self._resume(status_url, key, headers))

    def _drive(self, flow: _Flow) -> ToolResult:
        try:
            command = next(flow)
            while True:
                if isinstance(command, _Sleep):
                    time.sleep(command.seconds)
                    command = flow.send(None)
                else:
                    reply = send_sync(
                        self._client,
                        command,
                        auth=self._auth,
                        timeout=self._timeout,
                        max_bytes=self._max_bytes,
                    )
                    command = flow.send(reply)
        except StopIteration as stop:
            result: ToolResult = stop.value
            return result
        finally:
            flow.close()

    def close(self) -> None:
        """Close the HTTP client if agentkey created it."""
        self._closed = True
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> ToolInvoker:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        self.close()


class AsyncToolInvoker(_InvokerBase):
    """The asyncio twin of :class:`ToolInvoker`: same options, ``invoke`` is awaited."""

    def __init__(
        self,
        base_url: str,
        *,
        auth: Auth | None = None,
        retry: RetryPolicy = RetryPolicy(),  # noqa: B008 - frozen, so sharing is safe
        polling: PollPolicy = PollPolicy(),  # noqa: B008 - frozen, so sharing is safe
        client: AsyncClient | None = None,
        timeout: float | Timeout | None = None,
        key_header_style: HeaderStyle = "raw",
        replay_headers: Sequence[str] = DEFAULT_REPLAY_HEADERS,
        allowed_poll_origins: Iterable[str] = (),
        routes: Mapping[str, str] | None = None,
        route_template: str | None = None,
        hooks: Sequence[InvokeHook] | None = None,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    ) -> None:
        if client is not None and not isinstance(client, AsyncClient):
            raise ConfigurationError(f"client must be an httpx.AsyncClient, got {client!r}")
        super().__init__(
            base_url, auth=auth, retry=retry, polling=polling, timeout=timeout,
            key_header_style=key_header_style, replay_headers=replay_headers,
            allowed_poll_origins=allowed_poll_origins, routes=routes,
            route_template=route_template, hooks=hooks, max_response_bytes=max_response_bytes,
        )  # fmt: skip
        self._owns_client = client is None
        self._check_client_headers(client)
        self._client = client if client is not None else make_async_client(self._timeout)

    async def invoke(
        self,
        step: Step,
        *,
        path: str | None = None,
        method: str = "POST",
        headers: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
    ) -> ToolResult:
        """Run ``step`` once: same key on every resend, polls a 202 to its end."""
        call = self._prepare(step, path, method, headers, idempotency_key)
        return await self._drive(self._flow(call))

    async def resume_poll(
        self, status_url: str, key: str, *, headers: Mapping[str, str] | None = None
    ) -> ToolResult:
        """Finish polling a step after :class:`PollTimeout`, without sending the step again.

        ``headers`` are the extra headers the original ``invoke`` sent (a tenant id, say);
        like there, they go to the tool's own origin only.
        """
        return await self._drive(self._resume(status_url, key, headers))

    async def _drive(self, flow: _Flow) -> ToolResult:
        try:
            command = next(flow)
            while True:
                if isinstance(command, _Sleep):
                    await asyncio.sleep(command.seconds)
                    command = flow.send(None)
                else:
                    reply = await send_async(
                        self._client,
                        command,
                        auth=self._auth,
                        timeout=self._timeout,
                        max_bytes=self._max_bytes,
                    )
                    command = flow.send(reply)
        except StopIteration as stop:
            result: ToolResult = stop.value
            return result
        finally:
            flow.close()

    async def aclose(self) -> None:
        """Close the HTTP client if agentkey created it."""
        self._closed = True
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> AsyncToolInvoker:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        await self.aclose()
