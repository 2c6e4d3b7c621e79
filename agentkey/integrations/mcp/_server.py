"""The server half: one ``ServerMiddleware`` that deduplicates ``tools/call`` on its key.

It drives the same decision table as the HTTP middleware (``agentkey.server._decide``)
against the same :class:`~agentkey.server.Store`: the operation a key is bound to is
``("tools/call", <tool name>)`` and the body whose hash the key carries is the
canonical JSON of the call's arguments.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import anyio
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.request_state import authenticated_principal
from mcp.shared.exceptions import MCPError
from pydantic import BaseModel

from ..._canonical import canonical_json
from ..._clock import Clock
from ..._exceptions import ConfigurationError, InvalidArguments
from ..._keys import shown_key
from ...server._claim import Claim, reset_current, set_current
from ...server._decide import (
    Checked,
    Conflict,
    DecisionEvent,
    InDoubt,
    Reject,
    Replay,
    Unavailable,
    check_request,
    on_finished,
)
from ...server._lifecycle import (
    SHARED_PRINCIPAL,
    Doubted,
    Lifecycle,
    check_principal_options,
    resolve_principal,
)
from ...server._options import ServerOptions, check_hooks, check_store, options_or_default
from ...server._reconcile import ReconcileHook, check_reconcile, context_for
from ...server._records import StoredOutcome
from ...server._stores import Store, resolve_clock
from ._wire import (
    CONVENTIONS,
    CONVENTIONS_FIELD,
    ERROR_CODES,
    FIELD_NAMES,
    PROTECTED_FIELD,
    REPLAYED_FIELD,
    KeyConvention,
    RefusalKind,
    check_conventions,
    keys_in,
    refusal_data,
    without_keys,
)

__all__ = ["IdempotentToolsMiddleware", "MCPPrincipalFunc"]

#: ``(ctx) -> principal`` (or an awaitable of it): the tenant, user or client id records
#: are scoped by; None (or ``""``) for a call that is not authenticated, which is refused.
#: The default is the OAuth identity the SDK verified.
MCPPrincipalFunc = Callable[[ServerRequestContext[Any, Any]], "str | Awaitable[str | None] | None"]

_logger = logging.getLogger("agentkey.server")
_METHOD = "tools/call"
_LIST = "tools/list"
_REJECT_KINDS: Mapping[str, RefusalKind] = {
    "idempotency_key_missing": "key-required",
    "idempotency_key_invalid": "invalid-key",
    "key_reused": "key-reused",
}
# The decision table speaks HTTP; an MCP client reads the same refusals in MCP's terms.
_NEEDS_KEY = "this endpoint needs an Idempotency-Key header"
_WORDING = (
    ("the body does not hash", "the arguments do not hash"),
    ("another method or route", "another tool"),
    ("another request body; send changed arguments", "other arguments; send changed arguments"),
    ("Idempotency-Key", "idempotency key"),
)
_STATUS = {
    "claimed": 200,
    "replay": 200,
    "failed": 500,
    "released": 500,
    "in_doubt": 500,
    "passthrough": 0,
}


def _principal(
    principal: MCPPrincipalFunc | None, shared_key_space: bool
) -> MCPPrincipalFunc | None:
    """Whose key space a call is in: ``principal``, else the OAuth identity; None: shared."""
    check_principal_options(principal, shared_key_space, what="ctx")
    return None if shared_key_space else principal or _oauth_principal


def _tools(tools: object) -> frozenset[str] | None:
    """The protected tool names (None: every tool)."""
    if tools is None:
        return None
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Iterable):
        raise ConfigurationError("tools must be a collection of tool names, not one str")
    names = frozenset(tools)
    if not all(isinstance(name, str) for name in names):
        raise ConfigurationError("tools must be a collection of tool names (str)")
    return names


def _oauth_principal(ctx: ServerRequestContext[Any, Any]) -> str | None:
    """The OAuth identity the SDK's auth verified (client, issuer, subject), else None."""
    return authenticated_principal(ctx)


class IdempotentToolsMiddleware:
    """Runs each ``tools/call`` at most once per key; replays its result afterwards.

    Add it to an ``MCPServer`` (``MCPServer(..., middleware=[...])`` or
    ``server.middleware.append(...)``) or to a low-level ``Server``'s
    ``middleware`` list. For a call that carries a key in one of ``key_conventions``
    (all by default: ``params._meta["io.agentkey/idempotency-key"]``, SEP-3182's
    ``params.idempotencyKey``, ``params._meta.idempotencyKey``, UCP's
    ``arguments.meta["idempotency-key"]``, an ``idempotency_key`` argument; see
    :data:`~agentkey.integrations.mcp._wire.KeyConvention`):

    - a key inside the arguments is left out of what it binds (the arguments are hashed
      without it); two conventions carrying different keys are refused (``invalid-key``,
      ``data.fields`` names them), and nothing runs;
    - the key must parse (an agentkey key ``<plan>:<step>:<args_hash>``, or an
      opaque key of 1-255 printable ASCII characters unless
      ``key_format="agentkey"``); an agentkey key's ``args_hash`` must be the
      SHA-256 of the canonical JSON of ``arguments``;
    - the key is claimed atomically in ``store`` under the principal; while
      the tool runs the lease is renewed every ``options.lock_ttl / 3``, and other
      calls with the key are refused as ``in-progress`` with ``retryAfter`` (after
      waiting up to ``options.hold_in_flight`` for the first call's result);
    - a successful result is stored for ``options.result_ttl`` seconds and replayed,
      with ``_meta["io.agentkey/replayed"] = true``, to every later call with
      the key; the same key with another tool is refused (``key-reused``),
      with other arguments (``payload-mismatch``);
    - a result with ``isError`` (MCPServer's answer to a tool that raised) or an
      exception leaves the key *in doubt* by default (``options.mutation_starts="on_run"``:
      the tool may have begun its side effect as soon as it ran): every later call
      with the key is refused as ``in-doubt`` until ``reconcile`` or an operator
      settles it. It releases the key instead when the tool called
      ``current_claim().nothing_started()``, or with ``mutation_starts="on_mark"``
      before ``await current_claim().begin_mutation()``. After
      ``begin_mutation()`` the outcome is stored as FAILED and replayed as an
      ``isError`` result. An ``input_required`` answer releases the key.
    - a server that dies while the tool runs leaves the key in doubt too (by
      default), never free: the claim's record says the tool may have started.
    - ``reconcile``: ``(ReconcileContext) -> Reconciled`` (or async), asked when a
      call meets a key in doubt (see :mod:`agentkey.server`).

    Records are scoped by the caller: by default the OAuth identity the SDK
    verified, else ``principal(ctx)``. A call with a key and no caller (a
    server without OAuth) is refused as ``unauthenticated``, unless the app
    passes ``shared_key_space=True``: then every session shares one key space
    (one client, or callers that trust each other). A result larger than
    ``options.max_recorded_bytes`` (1 MiB) reaches its caller but is not stored: later
    calls with the key get an ``isError`` result saying so, never a second run.

    A call without a key is refused (``key-required``), and nothing runs, unless
    ``options.require_key`` is False: then it runs unprotected, as before. The
    options are a :class:`~agentkey.server.ServerOptions`, the value the HTTP
    middleware takes too (same fields, same defaults). ``tools`` limits protection to those tool
    names (the others pass through); ``tools/list`` marks them protected and names
    the conventions read (``io.agentkey/key-conventions``). Refusals are JSON-RPC
    errors whose ``data.type`` is ``io.agentkey/<kind>``. Leases and records are
    measured on ``clock`` (an :class:`~agentkey.Clock`; default the system clock).
    """

    def __init__(
        self,
        store: Store,
        *,
        options: ServerOptions | None = None,
        principal: MCPPrincipalFunc | None = None,
        shared_key_space: bool = False,
        tools: Collection[str] | None = None,
        key_conventions: Collection[KeyConvention] = CONVENTIONS,
        hooks: Sequence[Callable[[DecisionEvent], object]] = (),
        reconcile: ReconcileHook | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.store = check_store(store)
        self.options = options = options_or_default(options)
        self._principal = _principal(principal, shared_key_space)
        self.shared_key_space = shared_key_space
        self.tools = _tools(tools)
        self.key_conventions = check_conventions(key_conventions)
        self._hooks = check_hooks(hooks)
        check_reconcile(reconcile, options.reconcile_timeout)
        self._reconcile = reconcile
        self._clock = resolve_clock(clock, "IdempotentToolsMiddleware")
        self._needs_key = "this tool needs an idempotency key, in " + " or ".join(
            FIELD_NAMES[name] for name in self.key_conventions
        )
        self._life = Lifecycle(
            store,
            lock_ttl_ms=options.lock_ttl_ms,
            result_ttl_ms=options.result_ttl_ms,
            retry_after=options.retry_after,
            auto_renew=options.auto_renew,
            clock=self._clock,
            mutation_starts=options.mutation_starts,
        )

    def __repr__(self) -> str:
        return f"IdempotentToolsMiddleware(store={self.store!r}, options={self.options!r})"

    async def __call__(
        self, ctx: ServerRequestContext[Any, Any], call_next: CallNext
    ) -> HandlerResult:
        params = ctx.params
        if ctx.method == _LIST:
            return self._advertised(await call_next(ctx))
        if ctx.method != _METHOD or ctx.request_id is None or not isinstance(params, Mapping):
            return await call_next(ctx)
        name = params.get("name")
        if not isinstance(name, str) or (self.tools is not None and name not in self.tools):
            return await call_next(ctx)
        carried = keys_in(params, self.key_conventions)
        value = self._one_key(carried, name)
        if value is None and not self.options.require_key:
            self._emit("passthrough", name, None)
            return self._unkeyed(await call_next(ctx))
        # Whose key space, before anything about the key: a caller nobody authenticated
        # learns nothing (no replay, no in-progress, no key-reused about another's key).
        principal = SHARED_PRINCIPAL
        if self._principal is not None:
            found = await resolve_principal(self._principal, ctx)
            if found is None:
                self._emit("rejected", name, None, 401)
                raise _refusal(
                    "unauthenticated",
                    "this server runs each idempotency key once per authenticated caller, "
                    "and this call is not authenticated (no OAuth identity), so nothing ran; "
                    "call again with the same key over an authenticated session",
                )
            principal = found
        arguments = without_keys(params.get("arguments"), [field for field, _ in carried])
        checked, body = self._check(value, carried, name, arguments)
        decision = await self._life.open(
            checked, principal, None, f"{_METHOD} {name}", hold=self.options.hold_in_flight
        )
        key = checked.idempotency_key
        if isinstance(decision, Doubted):
            if self._reconcile is None:
                decision = decision.doubt
            else:
                claim = decision.claim
                context = context_for(
                    key,
                    principal,
                    _METHOD,
                    name,
                    body,
                    decision.doubt.record,
                    self._life.now_ms(),
                    claim.key_for,
                )
                decision = await self._life.reconcile(
                    decision,
                    checked,
                    self._reconcile,
                    context,
                    self.options.reconcile_timeout,
                    max_recorded_bytes=self.options.max_recorded_bytes,
                )
        if isinstance(decision, Claim):  # it runs, under this claim
            return _protected(await self._run(ctx, call_next, decision, name))
        if isinstance(decision, Replay):
            self._emit("replay", name, key)
            return _replayed(decision.outcome)
        if isinstance(decision, InDoubt):
            self._emit("in_doubt", name, key, 409)
            raise _refusal("in-doubt", self._words(decision.detail))
        if isinstance(decision, Unavailable):
            self._emit("unavailable", name, key, 503)
            raise _refusal("unavailable", decision.detail, retry_after=decision.retry_after)
        if isinstance(decision, Conflict):
            self._emit("conflict", name, key, 409)
            raise _refusal("in-progress", decision.detail, retry_after=decision.retry_after)
        assert isinstance(decision, Reject)  # the last kind of Problem
        raise self._rejected(decision, name, key)

    def _advertised(self, result: HandlerResult) -> HandlerResult:
        """``tools/list`` with each protected tool marked, so a client knows before it calls."""
        doc = _as_dict(result)
        tools = doc.get("tools") if doc is not None else None
        if not isinstance(tools, list):
            return result
        for tool in tools:
            if isinstance(tool, dict) and (self.tools is None or tool.get("name") in self.tools):
                meta = tool.get("_meta")
                marks = {PROTECTED_FIELD: True, CONVENTIONS_FIELD: list(self.key_conventions)}
                tool["_meta"] = {**(meta if isinstance(meta, dict) else {}), **marks}
        return doc

    def _unkeyed(self, result: HandlerResult) -> HandlerResult:
        """A result of a protected tool called without a key it reads, naming where the
        server reads keys (so a client sends its next key there); not marked protected."""
        doc = _as_dict(result)
        if doc is None:
            return result
        meta = doc.get("_meta")
        marks = {CONVENTIONS_FIELD: list(self.key_conventions)}
        doc["_meta"] = {**(meta if isinstance(meta, dict) else {}), **marks}
        return doc

    # -- before the claim ------------------------------------------------------------

    def _one_key(self, found: list[tuple[KeyConvention, object]], name: str) -> object:
        """The call's key: the one value its conventions carry, refused when they differ."""
        if not found:
            return None
        first = found[0][1]
        if any(value != first or type(value) is not type(first) for _, value in found[1:]):
            fields = [FIELD_NAMES[field] for field, _ in found]
            self._emit("rejected", name, None, 400)
            raise MCPError(
                ERROR_CODES["invalid-key"],
                f"this call carries different idempotency keys in {' and '.join(fields)}, so "
                "nothing ran: which one names the operation is unknown; send one key (or the "
                "same key in every field)",
                {**refusal_data("invalid-key"), "fields": fields},
            )
        return first

    def _check(
        self,
        value: object,
        found: list[tuple[KeyConvention, object]],
        name: str,
        arguments: object,
    ) -> tuple[Checked, bytes]:
        if value is not None and not isinstance(value, str):
            self._emit("rejected", name, None, 400)
            raise _refusal("invalid-key", f"{FIELD_NAMES[found[0][0]]} must be a string")
        if arguments is None:
            arguments = {}
        try:
            body = canonical_json(arguments, profile=self.options.hash_profile)
        except InvalidArguments:
            self._emit("rejected", name, None, 400)
            raise _refusal(
                "payload-mismatch",
                "the arguments must be a JSON object to be checked against the key",
            ) from None
        checked = check_request(
            None if value is None else [value],
            (_METHOD, name),
            body,
            key_format=self.options.key_format,
            hash_profile=self.options.hash_profile,
        )
        if isinstance(checked, Reject):
            raise self._rejected(checked, name, value)
        return checked, body

    def _rejected(self, reject: Reject, name: str, key: str | None) -> MCPError:
        kind = _REJECT_KINDS.get(reject.code, "payload-mismatch")
        mismatch = kind in ("key-reused", "payload-mismatch")
        self._emit("mismatch" if mismatch else "rejected", name, key, reject.status)
        return _refusal(kind, self._words(reject.detail))

    # -- the run ------------------------------------------------------------------

    async def _run(
        self, ctx: ServerRequestContext[Any, Any], call_next: CallNext, claim: Claim, name: str
    ) -> HandlerResult:
        token = set_current(claim)
        if claim.auto_renew:
            claim.start_renewing()
        result: HandlerResult = None
        # Shielded: a client that stops waiting (its attempt timed out) cancels the request,
        # and the SDK would cancel the tool half-way through its side effect, so a resend
        # could not tell whether it ran. The tool runs to its end; its outcome is then
        # recorded by the settle, which redoes a write a pending cancellation interrupts
        # (shielded, within its budget). The resend waits (in progress), then replays.
        failure: BaseException | None = None
        with anyio.CancelScope(shield=True):
            try:
                result = await call_next(ctx)
            except BaseException as exc:  # re-raised below, once the outcome is settled
                failure = exc
            finally:
                reset_current(token)
        if failure is not None:
            await self._finish(claim, name, None)
            raise failure
        await self._finish(claim, name, result)
        return result

    async def _finish(self, claim: Claim, name: str, result: HandlerResult) -> None:
        """Record the outcome (or release the key): the settle every front end shares."""
        doc = _as_dict(result)
        final = doc is not None and doc.get("isError") is not True and _complete(doc)
        body = b"" if doc is None else json.dumps(doc, separators=(",", ":")).encode()
        if len(body) > self.options.max_recorded_bytes and (final or claim.mutation_started):
            _logger.warning(
                "the result of %s is over max_recorded_bytes (%d) and was not stored; "
                "later calls with the key get an isError result saying so",
                shown_key(claim.idempotency_key),
                self.options.max_recorded_bytes,
            )
        decision = on_finished(
            200 if final else 500,
            (),
            body,
            error=doc is None,
            mutation_started=claim.mutation_started,
            may_have_started=claim._may_have_started and _complete_or_error(doc),
            binding=claim.binding,
            now_ms=self._life.now_ms(),
            max_inline_bytes=1 << 62,  # MCP results stay inline: no blob store here
            max_recorded_bytes=self.options.max_recorded_bytes,
        )
        self._emit(await self._life.settle(claim, decision), name, claim.idempotency_key)

    def _words(self, detail: str) -> str:
        """A refusal's detail in MCP's terms, naming the fields this server reads a key from."""
        return _mcp_words(detail.replace(_NEEDS_KEY, self._needs_key))

    def _emit(self, decision: str, name: str, key: str | None, status: int | None = None) -> None:
        event = DecisionEvent(
            decision, _METHOD, name, key, _STATUS.get(decision, 0) if status is None else status
        )
        for hook in self._hooks:
            hook(event)


def _mcp_words(detail: str) -> str:
    """A refusal's detail in MCP's terms (the decision table speaks HTTP)."""
    for http, mcp in _WORDING:
        detail = detail.replace(http, mcp)
    return detail


def _complete_or_error(doc: Mapping[str, Any] | None) -> bool:
    """Not an ``input_required`` round trip (the client answers it; the tool resumes)."""
    return doc is None or _complete(doc)


def _as_dict(result: HandlerResult) -> dict[str, Any] | None:
    if isinstance(result, BaseModel):
        dumped: dict[str, Any] = result.model_dump(by_alias=True, mode="json", exclude_none=True)
        return dumped
    return dict(result) if isinstance(result, Mapping) else None


def _complete(doc: Mapping[str, Any]) -> bool:
    """A final result: not an ``input_required`` round trip, which the client answers later."""
    return bool(doc.get("resultType", "complete") == "complete")


def _refusal(kind: RefusalKind, detail: str, *, retry_after: float | None = None) -> MCPError:
    data = refusal_data(kind, retry_after=retry_after)
    if kind in ("unavailable", "in-doubt"):
        # Said by this protected tool itself: a client believes "nothing ran" (or "in
        # doubt") only with the mark, never from a body some other tool passed on.
        data[PROTECTED_FIELD] = True
    return MCPError(ERROR_CODES[kind], detail, data)


def _protected(result: HandlerResult) -> HandlerResult:
    """The tool's result with ``_meta["io.agentkey/protected"] = true``."""
    doc = _as_dict(result)
    if doc is None:
        return result
    meta = doc.get("_meta")
    doc["_meta"] = {**(meta if isinstance(meta, dict) else {}), PROTECTED_FIELD: True}
    return doc


def _replayed(outcome: StoredOutcome) -> dict[str, Any]:
    """The stored result with ``_meta["io.agentkey/replayed"] = true``.

    A FAILED outcome that holds no tool result (the tool raised after
    ``begin_mutation``) becomes an ``isError`` result carrying the stored reason.
    """
    try:
        doc = json.loads(outcome.body)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or "content" not in doc:
        detail = doc.get("detail") if isinstance(doc, dict) else None
        text = detail if isinstance(detail, str) else "the tool failed after its side effect began"
        doc = {
            "resultType": "complete",
            "content": [{"type": "text", "text": text}],
            "isError": True,
        }
    meta = doc.get("_meta")
    marks = {REPLAYED_FIELD: True, PROTECTED_FIELD: True}
    doc["_meta"] = {**(meta if isinstance(meta, dict) else {}), **marks}
    return doc
