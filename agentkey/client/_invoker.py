"""ToolInvoker and AsyncToolInvoker: one step, one side effect, whatever the network does.

The public shells: they check their options and each call at the boundary,
then run the sans-I/O flow of ``_flow`` (every decision across answers, on an
injected clock) with a driver of a few lines that only sends, sleeps and awaits.

Importing this module loads only what the classes' signatures need (plans and
policies): the engine (the flow, the HTTP wire with httpx's transport, anyio and
asyncio, the journal) loads when the first invoker is made (:func:`_load_engine`),
so ``from agentkey import ToolInvoker`` stays cheap and a missing dependency is
an ImportError from that constructor, not from a call deep inside.
"""

from __future__ import annotations

import enum
import functools
import inspect
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, TypedDict
from urllib.parse import quote, urlsplit

from pydantic import BaseModel, ConfigDict, computed_field

from .._clock import Clock, default_clock
from .._exceptions import AgentKeyError, ConfigurationError, InsecureTransport, JournalError
from .._keys import HEADER_STYLES, HeaderStyle, StepKey, header_value, shown_key
from .._plan import Step
from ._policies import DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_REPLAY_HEADERS, PollPolicy, RetryPolicy

if TYPE_CHECKING:  # bound at run time by _load_engine(), with the first invoker
    import types

    from typing_extensions import Unpack  # typing's own from 3.12; for the type checker only

    from ..journal._base import Journal, current_owner, in_flight
    from ..journal._default import resolve_journal
    from ..journal._verify import HttpLookup
    from . import _flow
    from ._clients import make_async_client, make_client, make_max_response_bytes, make_timeout
    from ._drive import Handlers, async_carrier, carrier, run_async, run_sync
    from ._effects import Emit, Journaled, Outgoing, Reconcile, Sleep
    from ._flow import Call, Finished, Flow, Identity, Pick, Reconciler, Settings, check_headers
    from ._honours import honours_option
    from ._hooks import InvokeHook, LoggingHook, listened
    from ._http import Auth, Timeout, send_async, send_sync
    from ._httpx2 import AsyncClient, Client
    from ._net import is_loopback, origin_of, redact_url
    from ._protocol import ProtocolConfig, parse_json, replay_markers

#: What ``journal=`` takes: a journal, None (the default SQLite file) or False (none).
JournalOption: TypeAlias = "Journal | Literal[False] | None"


class InvokerOptions(TypedDict, total=False):
    """The options :class:`ToolInvoker` and :class:`AsyncToolInvoker` share, each a keyword.

    Written once for both twins (``**options: Unpack[InvokerOptions]``); what is
    left out takes its default. A misspelt name is a type error for the checker
    and a TypeError naming it at run time.

    - ``retry`` (``RetryPolicy()``): resends of one step with its one key.
    - ``polling`` (``PollPolicy()``): how a ``202 Accepted`` is polled to its end.
    - ``timeout`` (None: the default): seconds, or an ``httpx.Timeout``, per request.
    - ``clock`` (None: the system clock): every wait, deadline and jitter draw.
    - ``key_header_style`` (``"raw"``): the key as sent, ``"sf-string"`` or ``"uuid"``.
    - ``replay_headers``: the headers by which a server marks a replayed answer.
    - ``allowed_poll_origins`` (none): other origins a status URL may point to.
    - ``routes`` / ``route_template``: a tool's path, by name or by ``'/tools/{tool}'``.
    - ``hooks`` (a ``LoggingHook``): callables given each invoke event.
    - ``max_response_bytes``: the largest answer read.
    - ``journal`` (None: the default SQLite file; False: none): the call journal.
    - ``honours_keys`` (None: learn it): whether the server is known to honour keys.
    - ``reconcile``: the hook that settles a call in doubt (one, or one per tool).
    """

    retry: RetryPolicy
    polling: PollPolicy
    timeout: float | Timeout | None
    clock: Clock | None
    key_header_style: HeaderStyle
    replay_headers: Sequence[str]
    allowed_poll_origins: Iterable[str]
    routes: Mapping[str, str] | None
    route_template: str | None
    hooks: Sequence[InvokeHook] | None
    max_response_bytes: int
    journal: JournalOption
    honours_keys: bool | Mapping[str, bool] | None
    reconcile: Reconciler | Mapping[str, Reconciler] | None


#: Each option's default, in this one place.
_DEFAULTS: InvokerOptions = {
    "retry": RetryPolicy(),
    "polling": PollPolicy(),
    "timeout": None,
    "clock": None,
    "key_header_style": "raw",
    "replay_headers": DEFAULT_REPLAY_HEADERS,
    "allowed_poll_origins": (),
    "routes": None,
    "route_template": None,
    "hooks": None,
    "max_response_bytes": DEFAULT_MAX_RESPONSE_BYTES,
    "journal": None,
    "honours_keys": None,
    "reconcile": None,
}
#: The keywords every invoker takes besides the shared options (their types differ by twin).
_OWN = ("base_url", "auth", "client", "poll_client")


def _options(kind: str, given: Mapping[str, object]) -> InvokerOptions:
    """``given`` over the defaults; a name that is no option raises TypeError, as Python does."""
    unknown = sorted(set(given) - set(_DEFAULTS))
    if unknown:
        import difflib  # only for the error

        hints = [difflib.get_close_matches(name, [*_DEFAULTS, *_OWN], n=1) for name in unknown]
        said = ", ".join(
            f"{name!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
            for name, near in zip(unknown, hints, strict=True)
        )
        raise TypeError(
            f"{kind}() got unexpected keyword argument(s) {said}; its options are "
            f"{', '.join(_OWN)} and {', '.join(sorted(_DEFAULTS))}"
        )
    options = _DEFAULTS.copy()
    options.update(given)  # type: ignore[typeddict-item]
    return options


_engine_loaded = False


def _load_engine() -> None:
    """Import the call engine, once, when the first invoker is made.

    What a call needs (the flow, the drivers, the HTTP wire, the journal) costs
    over 100 ms of CPU to import: it is not paid by ``from agentkey import
    ToolInvoker``, only by a program that makes an invoker, and an ImportError
    (a broken install) is raised here, by the constructor.
    """
    global _engine_loaded, _flow, async_carrier, carrier, run_async, run_sync
    global Emit, Journaled, Outgoing, Sleep, Reconcile, Call, Settings, check_headers
    global LoggingHook, listened, AsyncClient, Auth, Client, make_async_client, make_client
    global make_max_response_bytes, make_timeout, send_async, send_sync, is_loopback
    global origin_of, redact_url, ProtocolConfig, parse_json, replay_markers
    global current_owner, in_flight, resolve_journal, HttpLookup, honours_option
    if _engine_loaded:
        return

    from ..journal._base import current_owner, in_flight
    from ..journal._default import resolve_journal
    from ..journal._verify import HttpLookup
    from . import _flow
    from ._clients import make_async_client, make_client, make_max_response_bytes, make_timeout
    from ._drive import async_carrier, carrier, run_async, run_sync
    from ._effects import Emit, Journaled, Outgoing, Reconcile, Sleep
    from ._flow import Call, Settings, check_headers
    from ._honours import honours_option
    from ._hooks import LoggingHook, listened
    from ._http import Auth, send_async, send_sync
    from ._httpx2 import AsyncClient, Client
    from ._net import is_loopback, origin_of, redact_url
    from ._protocol import ProtocolConfig, parse_json, replay_markers

    _engine_loaded = True


__all__ = ["AsyncToolInvoker", "InvokerOptions", "Outcome", "ToolInvoker", "ToolResult"]

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
_CREDENTIAL_HEADERS = ("authorization", "cookie", "proxy-authorization")
_MAX_TEMPLATE_URLS = 1024
_BAD_PATH = re.compile(r"://|^//|[?#\x00-\x1f\x7f]")


class Outcome(str, enum.Enum):
    """Whether this call ran the step, received the stored outcome of an earlier run, or
    got an answer that does not show which."""

    #: The tool ran the step now: its answer says so (no replay marker from a tool that
    #: marks replays: agentkey's middleware, or a route seen marking one).
    EXECUTED = "executed"
    #: The stored outcome of an earlier run: a replay marker, the journal's copy, or (from
    #: a tool declared to mark no replays) an answer after a 409/423 "in flight".
    REPLAYED = "replayed"
    #: The tool answered and did not show whether it ran the step now or replayed it (it
    #: marks no replays, as pyidempotent and idemgate, or ``replay_headers=()``).
    ANSWERED = "answered"


#: Each outcome's member by its value: a dict look-up per call, not Enum's call machinery.
_OUTCOMES: dict[str, Outcome] = {member.value: member for member in Outcome}


class ToolResult(BaseModel):
    """The final answer of one step: what the tool said, and how agentkey got there.

    ``label`` is the step's label (``step_003``), as on :class:`~agentkey.Step`.
    """

    # Built on first use (the first result), not when the module is imported.
    model_config = ConfigDict(frozen=True, defer_build=True)

    status_code: int
    body: Any = None
    headers: dict[str, str]
    outcome: Outcome
    idempotency_key: str
    label: str | None = None
    attempts: int
    polls: int = 0
    elapsed: float
    status_url: str | None = None
    #: Where the answer came from: ``"tool"`` (an HTTP answer, run now or replayed by the
    #: tool), ``"journal"`` (the answer of an earlier run of this call, kept by the
    #: journal; nothing was sent) or ``"reconcile"`` (the reconcile= hook found it had run).
    source: Literal["tool", "journal", "reconcile"] = "tool"
    #: Set when the call repeats an earlier step of its plan (same tool and arguments) and
    #: was answered with that step's key: the earlier step's label.
    repeat_of: str | None = None

    @computed_field  # type: ignore[prop-decorator]  # pydantic's documented pattern
    @property
    def replayed(self) -> bool:
        """True when the tool replayed a stored outcome instead of running the step now.

        False when it ran the step, or when the answer does not show which (``outcome``
        is then ``Outcome.ANSWERED``).
        """
        return self.outcome is Outcome.REPLAYED


class _InvokerBase:
    def __init__(self, base_url: str, *, auth: Auth | None, options: InvokerOptions) -> None:
        _load_engine()
        retry, polling, timeout = options["retry"], options["polling"], options["timeout"]
        clock, key_header_style = options["clock"], options["key_header_style"]
        replay_headers = options["replay_headers"]
        allowed_poll_origins = options["allowed_poll_origins"]
        routes, route_template = options["routes"], options["route_template"]
        hooks, max_response_bytes = options["hooks"], options["max_response_bytes"]
        journal, honours_keys = options["journal"], options["honours_keys"]
        reconcile = options["reconcile"]
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
        if clock is not None and not isinstance(clock, Clock):
            raise ConfigurationError(
                "clock must be an agentkey.Clock (monotonic, time, sleep, asleep, random), "
                f"e.g. agentkey.testing.FakeClock(), or None for the system clock; got {clock!r}"
            )
        #: The one clock of every flow (time, jitter, wall time) and every wait of the driver.
        self._clock: Clock = clock if clock is not None else default_clock()
        if key_header_style not in HEADER_STYLES:
            raise ConfigurationError(
                "key_header_style must be 'raw', 'sf-string' or 'uuid' (a UUIDv5 of the key, "
                f"for servers that accept only UUIDs), got {key_header_style!r}"
            )
        try:
            replay_markers(tuple(replay_headers))
            valid = not isinstance(replay_headers, str)
        except (TypeError, AttributeError, ValueError):
            valid = False
        if not valid:
            raise ConfigurationError(
                "replay_headers must be a sequence of header names ('Idempotent-Replayed': "
                "the value true marks a replay) or 'Name: value' entries ('X-Ichido-Status: "
                f"replayed'), or () for a server that marks none; got {replay_headers!r}"
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
        declared, declarations = honours_option(honours_keys)
        checked = _check_reconcile(reconcile)
        #: The reconcile hook of every tool (or none), or None and a hook per tool name.
        self._reconcile = None if isinstance(checked, Mapping) else checked
        self._reconcile_by_tool = checked if isinstance(checked, Mapping) else None
        self._base_url = base_url.rstrip("/")
        self._auth = auth
        self._timeout = make_timeout(timeout)
        self._max_bytes = make_max_response_bytes(max_response_bytes)
        self._style: HeaderStyle = key_header_style
        self._routes = {str(k): self._url(v) for k, v in (routes or {}).items()}
        self._route_template = route_template
        self._template_urls: dict[str, str] = {}
        self._config = ProtocolConfig(
            base_origin=origin,
            retry_statuses=retry.retry_statuses,
            replay_headers=tuple(replay_headers),
            allowed_poll_origins=frozenset(allowed),
            has_auth=auth is not None,
        )
        self._hooks = hooks
        self._journal = resolve_journal(journal)
        self._settings = Settings(
            self._config,
            retry,
            polling,
            bool(hooks),
            self._clock.monotonic,
            self._clock.random,
            self._clock.time,
            journal=self._journal is not None,
            journal_max_body=getattr(self._journal, "max_body_bytes", 0),
            honours_keys=declared,
            declarations=declarations,
        )
        self._by_events: dict[frozenset[type], Settings] = {}
        self._closed = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._base_url!r})"

    def _settings_now(self) -> Settings:
        """The settings of a call starting now: its flow builds only the events the hooks
        listen to at this moment (a LoggingHook's logger may be turned up or down)."""
        if not self._hooks:
            return self._settings
        events = listened(self._hooks)
        settings = self._by_events.get(events)
        if settings is None:  # a few sets at most: one per logging level
            settings = self._by_events[events] = replace(self._settings, events=events)
        return settings

    def _handlers(
        self,
        client: Client | AsyncClient,
        send: Callable[..., Any],
        sleep: Callable[[Clock, Sleep], Any],
        *,
        asynchronous: bool,
        poll_client: Client | AsyncClient | None = None,
    ) -> Handlers:
        """How this invoker's driver carries out each effect: ``send`` (send_sync or send_async)
        through ``client``.

        The request goes out with the deadline read on the flows' own clock, and the waits
        are the clock's. The table holds what the invoker holds, never the invoker, so it
        makes no reference cycle.
        """
        options = {
            "auth": self._auth,
            "timeout": self._timeout,
            "max_bytes": self._max_bytes,
            "poll_client": poll_client,
        }
        return {
            **shared_handlers(self._hooks, self._journal, asynchronous=asynchronous),
            Outgoing: functools.partial(send, client, **options, clock=self._clock),
            Sleep: functools.partial(sleep, self._clock),
        }

    @property
    def journal(self) -> Journal | None:
        """The journal this invoker records its calls in (None with ``journal=False``)."""
        return self._journal

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

    def _check_poll_client(
        self, poll_client: object, client: object, kind: type[Any] | tuple[type[Any], ...]
    ) -> None:
        """``poll_client=``: a client of the invoker's kind, for allowed status origins only."""
        if poll_client is None:
            return
        if not isinstance(poll_client, kind):
            raise ConfigurationError(
                f"poll_client must be a client of the same kind as client= "
                f"({'httpx.AsyncClient' if kind is AsyncClient else 'httpx.Client'}), "
                f"got {type(poll_client).__name__}"
            )
        if poll_client is client:
            raise ConfigurationError(
                "poll_client must be a client of its own, not client=: the status origin's "
                "answers would put its cookies into client='s jar, which sends them to the "
                "tool (a jar ignores ports). Build a second client with the same transport, "
                "mounts, proxy and certificates"
            )
        if not self._config.allowed_poll_origins:
            raise ConfigurationError(
                "poll_client= sends the polls to allowed_poll_origins, and none is given: "
                "add the status origins, e.g. allowed_poll_origins=['https://status.example.com']"
            )

    # --- preparing a call: everything checked at the boundary, the key computed once --------

    def _url(self, path: object) -> str:
        if not isinstance(path, str) or _BAD_PATH.search(path):
            raise ConfigurationError(
                f"a route must be a path such as '/tools/create_db' (no scheme, host, query, "
                f"fragment or control characters), got {path!r}"
            )
        return f"{self._base_url}/{path.lstrip('/')}"

    def _templated(self, tool: str, template: str) -> str:
        """The URL of ``tool`` by the route template, built once per tool name."""
        url = self._template_urls.get(tool)
        if url is None:
            url = self._url(template.format(tool=quote(tool, safe="")))
            if len(self._template_urls) < _MAX_TEMPLATE_URLS:  # bounded: names may be many
                self._template_urls[tool] = url
        return url

    def _prepare(
        self,
        step: Step,
        path: str | None,
        method: str,
        headers: Mapping[str, str] | None,
        idempotency_key: str | None,
        call_id: str | None = None,
        context: str | None = None,
    ) -> Call:
        if self._closed:
            raise ConfigurationError(f"{self!r} is closed; create a new invoker")
        if not isinstance(step, Step):
            raise ConfigurationError(
                f"invoke() takes a Step (from PlanSession.step()), got {type(step).__name__}"
            )
        if not isinstance(method, str) or not method.isalpha():
            raise ConfigurationError(f"method must be an HTTP method name, got {method!r}")
        # The step's own key, ``<plan>:<label>:<args hash>``: what was sent is always its
        # arguments, whichever key is sent with them (the journal refuses others under a key).
        own = step.idempotency_key
        args_hash = own.rpartition(":")[2]
        if idempotency_key is None:  # its parts are known: no StepKey to build
            raw, label, plan = own, own.rsplit(":", 2)[1], step.plan_session_id
            sent = header_value(raw, self._style)
        else:
            key = StepKey.parse(idempotency_key)
            raw, label, plan = key.format(), key.label, key.plan_session_id
            sent = key.header_value(self._style)
        if path is not None:
            url = self._url(path)
        elif step.tool in self._routes:
            url = self._routes[step.tool]
        elif self._route_template is not None:
            url = self._templated(step.tool, self._route_template)
        else:
            raise ConfigurationError(
                f"no route for tool {step.tool!r} at {label}: pass path=, or set "
                "routes={tool: path} or route_template='/tools/{tool}' on the invoker"
            )
        if call_id is not None or context is not None:
            for name, value in (("call_id", call_id), ("context", context)):
                if value is not None and (not isinstance(value, str) or not value):
                    raise ConfigurationError(
                        f"{name} must be a non-empty str or None, got {value!r}"
                    )
        extra = _check_headers(headers)
        by_tool = self._reconcile_by_tool
        reconcile = self._reconcile if by_tool is None else by_tool.get(step.tool)
        return Call(
            url,
            method.upper(),
            extra,
            raw,
            label,
            sent,
            step.body,
            step.tool,
            plan,
            args_hash,
            call_id,
            context,
            current_owner() if self._journal is not None else "",  # the journal's alone
            step.repeat_of,
            reconcile,
            step.on_repeat if idempotency_key is None else "allow",  # your key is yours
            self._style,
        )

    def _resume(self, status_url: str, key: str, headers: Mapping[str, str] | None) -> Flow:
        if self._closed:
            raise ConfigurationError(f"{self!r} is closed; create a new invoker")
        parsed = StepKey.parse(key)
        if not isinstance(status_url, str) or origin_of(status_url) is None:
            shown = redact_url(status_url) if isinstance(status_url, str) else status_url
            raise ConfigurationError(f"status_url must be an absolute URL, got {shown!r}")
        extra = _check_headers(headers)
        label, value = parsed.label, parsed.header_value(self._style)
        call = Call(
            status_url, "GET", extra, parsed.format(), label, value, b"",
            plan=parsed.plan_session_id, args_hash=parsed.args_hash, owner=current_owner(),
        )  # fmt: skip
        return _flow.resume(call, self._settings_now())

    def _result(self, done: Finished) -> ToolResult:
        answer = done.answer
        values: dict[str, Any] = {
            "status_code": answer.status_code,
            "body": parse_json(answer.content),
            "headers": dict(answer.headers),
            "outcome": _OUTCOMES.get(done.outcome) or Outcome(done.outcome),
            "idempotency_key": done.key,
            "label": done.label,
            "attempts": done.attempts,
            "polls": done.polls,
            "elapsed": float(done.elapsed),  # a clock may answer ints; validation made floats
            "status_url": done.status_url,
            "source": done.source,
            "repeat_of": done.repeat_of,
        }
        # An HTTP answer's parts are httpx's (an int status, str headers): valid as they
        # are. The journal's copy and a reconcile hook's Verdict are validated.
        return _built(values) if done.source == "tool" else ToolResult(**values)


#: Every field of a ToolResult: the invoker sets them all (so validation reports them all
#: as set).
_RESULT_FIELDS = tuple(ToolResult.model_fields)


def _built(values: dict[str, Any]) -> ToolResult:
    """The ToolResult of ``values`` (each field, valid as it is): what validating them
    gives, without validating again. What model_construct does, without its per-field
    loop; validating cost 20k instructions a call, a quarter of what the invoker added
    over httpx. ``tests/invoker/test_invoker_api.py`` holds the two equal."""
    result: ToolResult = object.__new__(ToolResult)
    put = object.__setattr__
    put(result, "__dict__", values)
    put(result, "__pydantic_fields_set__", set(_RESULT_FIELDS))
    put(result, "__pydantic_extra__", None)
    put(result, "__pydantic_private__", None)
    return result


def shared_handlers(
    hooks: Sequence[Callable[[Any], object]], journal: Journal | None, *, asynchronous: bool
) -> dict[type, Callable[[Any], Any]]:
    """How a tool-call front end carries out what is neither a request nor a sleep.

    The hooks get each event; the journal runs each operation (its ``a``-prefixed
    twin on asyncio); the reconcile hook answers for a call in doubt. Shared by both
    invokers and the MCP session; none of it holds the front end itself.
    """
    _load_engine()

    def emit(effect: Emit) -> None:
        for hook in hooks:
            hook(effect.event)

    def journaled(effect: Journaled) -> Any:
        try:
            return getattr(journal, effect.op)(*effect.args, **effect.kwargs)
        except AgentKeyError:
            raise
        except Exception as exc:
            raise _journal_failed(journal, effect, exc) from None

    async def ajournaled(effect: Journaled) -> Any:
        try:
            return await getattr(journal, "a" + effect.op)(*effect.args, **effect.kwargs)
        except AgentKeyError:
            raise
        except Exception as exc:
            raise _journal_failed(journal, effect, exc) from None

    return {
        Emit: emit,
        Journaled: ajournaled if asynchronous else journaled,
        Reconcile: _reconciled if asynchronous else _reconcile_sync,
    }


def _journal_failed(journal: Any, effect: Journaled, exc: Exception) -> JournalError:
    """A journal's own failure (a locked or full SQLite file, a lost Redis connection) as a
    typed error that says what it means for the call. Only SQLite's reason is shown: other
    drivers' messages may name a server's address or credentials."""
    record = effect.args[0] if effect.args else None  # a CallRecord, for most operations
    key, step = getattr(record, "key", None), getattr(record, "step", None)
    which = f" of {step or 'a step'} ({shown_key(key)})" if isinstance(key, str) else ""
    reason = f": {exc}" if type(exc).__module__ == "sqlite3" else ""  # sqlite3 loads lazily
    meant = {
        "begin": "the call was not sent",
        "finish": (
            "the tool answered, but the answer was not recorded: the call stays pending in "
            "the journal, and a later call of the step will find it in doubt unless you "
            "settle it (agentkey journal settle)"
        ),
    }.get(
        effect.op,
        "the call stopped there: if it had been sent, its record stays pending and a later "
        "call of the step will find it in doubt unless you settle it (agentkey journal settle)",
    )
    return JournalError(
        f"the journal {journal!r} failed during {effect.op}{which} "
        f"({type(exc).__name__}{reason}); {meant}. Check that the journal is reachable and "
        "writable (disk space, permissions, its server), or pass another journal",
        sent=effect.op != "begin",  # after begin, a request of the call may have left
        idempotency_key=key if isinstance(key, str) else None,
        step=step if isinstance(step, str) else None,
    )


def _reconciled(effect: Reconcile) -> Any:
    """The reconcile hook's Verdict (an awaitable one is awaited by the async carrier)."""
    return effect.hook(effect.call)


def _reconcile_sync(effect: Reconcile) -> Any:
    verdict = effect.hook(effect.call)
    if inspect.isawaitable(verdict):
        _close_awaitable(verdict)
        raise ConfigurationError(
            "reconcile= is a coroutine function, which ToolInvoker cannot await; give it a "
            "plain function, or use AsyncToolInvoker"
        )
    return verdict


def _sleep(clock: Clock, effect: Sleep) -> None:
    clock.sleep(effect.seconds)


def _asleep(clock: Clock, effect: Sleep) -> Awaitable[None]:
    return clock.asleep(effect.seconds)


def _close_awaitable(value: object) -> None:
    close = getattr(value, "close", None)
    if callable(close):
        close()  # a coroutine never awaited would warn


def _check_reconcile(
    reconcile: object,
) -> Reconciler | Mapping[str, Reconciler] | None:
    """``reconcile=`` checked: a hook, a mapping of tool names to hooks, or None."""
    if reconcile is None or isinstance(reconcile, HttpLookup) or callable(reconcile):
        return reconcile
    if isinstance(reconcile, Mapping) and all(
        isinstance(k, str) and (isinstance(v, HttpLookup) or callable(v))
        for k, v in reconcile.items()
    ):
        return dict(reconcile)
    raise ConfigurationError(
        "reconcile must be a function of the call in doubt returning a Verdict, an HttpLookup, "
        f"or a mapping of tool names to either, got {reconcile!r}"
    )


def _check_headers(headers: Mapping[str, str] | None) -> tuple[tuple[str, str], ...]:
    if headers is None:
        return ()
    if not isinstance(headers, Mapping):
        raise ConfigurationError(
            f"headers must be a mapping of names to values, e.g. {{'X-Tenant': 'acme'}}, "
            f"got {type(headers).__name__}"
        )
    return check_headers(headers, _RESERVED, "headers=")


class ToolInvoker(_InvokerBase):
    """Call tools over HTTP so that each step runs at most once (synchronous driver).

    Use it as a context manager, or call :meth:`close`. A ``client`` you pass
    (proxies, mTLS, event hooks) is used as is and not closed; auth and
    redirects are still set per request by agentkey. Polls of a status URL on an
    origin of ``allowed_poll_origins`` go out bare (no credentials, cookies or
    default headers) through ``poll_client`` when given (a second client with your
    transport, mounts, proxy or certificates; not closed either), else through a
    cookieless client agentkey builds. Every wait, deadline and jitter draw runs on
    ``clock`` (an :class:`agentkey.Clock`; tests pass ``agentkey.testing.FakeClock()``).
    The options besides ``base_url``, ``auth``, ``client`` and ``poll_client`` are
    :class:`InvokerOptions`, shared with :class:`AsyncToolInvoker`.
    """

    def __init__(
        self,
        base_url: str,
        *,
        auth: Auth | None = None,
        client: Client | None = None,
        poll_client: Client | None = None,
        **options: Unpack[InvokerOptions],
    ) -> None:
        resolved = _options(type(self).__name__, options)
        _load_engine()
        if client is not None and not isinstance(client, Client):
            raise ConfigurationError(f"client must be an httpx.Client, got {client!r}")
        super().__init__(base_url, auth=auth, options=resolved)
        self._owns_client = client is None
        self._check_client_headers(client)
        self._check_poll_client(poll_client, client, Client)
        self._client = client if client is not None else make_client(self._timeout)
        self._carry = carrier(
            self._handlers(
                self._client, send_sync, _sleep, asynchronous=False, poll_client=poll_client
            )
        )
        if self._journal is not None and not self._journal.supports_sync:
            raise ConfigurationError(
                f"{self._journal!r} serves AsyncToolInvoker only (its client is asyncio); give "
                "ToolInvoker a journal with a synchronous client, or use AsyncToolInvoker"
            )

    def invoke(
        self,
        step: Step,
        *,
        path: str | None = None,
        method: str = "POST",
        headers: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
        call_id: str | None = None,
        context: str | None = None,
    ) -> ToolResult:
        """Run ``step`` once: same key on every resend, polls a 202 to its end.

        ``call_id`` (the agent runtime's own id of this call, a model's tool call id)
        and ``context`` (the conversation turn it answers) are kept in the journal
        beside the call, so an integration can recognise it again after a restart.
        """
        call = self._prepare(step, path, method, headers, idempotency_key, call_id, context)
        return self._drive(_flow.invoke(call, self._settings_now()), call.owner)

    def _invoke_identified(
        self, step: Step, identity: Identity, *, path: str | None = None,
        method: str = "POST", headers: Mapping[str, str] | None = None,
        call_id: str | None = None, context: str | None = None,
    ) -> ToolResult | Pick:  # fmt: skip
        """An agent runtime's call: ``identity`` decides its key (``step`` gives the rest)
        in the flow, in one journal step with the record; its :class:`Pick` when it
        answers without sending (the integrations' entry, ``_flow.identified``)."""
        call = self._prepare(step, path, method, headers, None, call_id, context)
        call = replace(call, identity=identity)
        with in_flight(call.owner):
            done = run_sync(_flow.identified(call, self._settings_now()), self._carry)
        return done if isinstance(done, _flow.Pick) else self._result(done)

    def resume_poll(
        self, status_url: str, key: str, *, headers: Mapping[str, str] | None = None
    ) -> ToolResult:
        """Finish polling a step after :class:`PollTimeout`, without sending the step again.

        ``headers`` are the extra headers the original ``invoke`` sent (a tenant id, say);
        like there, they go to the tool's own origin only.
        """
        return self._drive(self._resume(status_url, key, headers))

    def _drive(self, flow: Flow, owner: str | None = None) -> ToolResult:
        if not owner:  # no journal: no record of this call for in_flight to vouch for
            return self._result(run_sync(flow, self._carry))
        with in_flight(owner):
            return self._result(run_sync(flow, self._carry))

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
        client: AsyncClient | None = None,
        poll_client: AsyncClient | None = None,
        **options: Unpack[InvokerOptions],
    ) -> None:
        resolved = _options(type(self).__name__, options)
        _load_engine()
        if client is not None and not isinstance(client, AsyncClient):
            raise ConfigurationError(f"client must be an httpx.AsyncClient, got {client!r}")
        super().__init__(base_url, auth=auth, options=resolved)
        self._owns_client = client is None
        self._check_client_headers(client)
        self._check_poll_client(poll_client, client, AsyncClient)
        self._client = client if client is not None else make_async_client(self._timeout)
        self._carry = async_carrier(
            self._handlers(
                self._client, send_async, _asleep, asynchronous=True, poll_client=poll_client
            )
        )
        if self._journal is not None and not self._journal.supports_async:
            raise ConfigurationError(
                f"{self._journal!r} serves ToolInvoker only (its client is synchronous); give "
                "AsyncToolInvoker a journal with an asyncio client, or use ToolInvoker"
            )

    async def invoke(
        self,
        step: Step,
        *,
        path: str | None = None,
        method: str = "POST",
        headers: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
        call_id: str | None = None,
        context: str | None = None,
    ) -> ToolResult:
        """Run ``step`` once: same key on every resend, polls a 202 to its end.

        ``call_id`` (the agent runtime's own id of this call, a model's tool call id)
        and ``context`` (the conversation turn it answers) are kept in the journal
        beside the call, so an integration can recognise it again after a restart.
        """
        call = self._prepare(step, path, method, headers, idempotency_key, call_id, context)
        return await self._drive(_flow.invoke(call, self._settings_now()), call.owner)

    async def _invoke_identified(
        self, step: Step, identity: Identity, *, path: str | None = None,
        method: str = "POST", headers: Mapping[str, str] | None = None,
        call_id: str | None = None, context: str | None = None,
    ) -> ToolResult | Pick:  # fmt: skip
        """:meth:`ToolInvoker._invoke_identified`, awaited."""
        call = self._prepare(step, path, method, headers, None, call_id, context)
        call = replace(call, identity=identity)
        with in_flight(call.owner):
            done = await run_async(_flow.identified(call, self._settings_now()), self._carry)
        return done if isinstance(done, _flow.Pick) else self._result(done)

    async def resume_poll(
        self, status_url: str, key: str, *, headers: Mapping[str, str] | None = None
    ) -> ToolResult:
        """Finish polling a step after :class:`PollTimeout`, without sending the step again.

        ``headers`` are the extra headers the original ``invoke`` sent (a tenant id, say);
        like there, they go to the tool's own origin only.
        """
        return await self._drive(self._resume(status_url, key, headers))

    async def _drive(self, flow: Flow, owner: str | None = None) -> ToolResult:
        if not owner:  # no journal: no record of this call for in_flight to vouch for
            return self._result(await run_async(flow, self._carry))
        with in_flight(owner):
            return self._result(await run_async(flow, self._carry))

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
