"""Test your agent's tool calls and your tool server: a scripted tool, fast policies, a checker.

Import it explicitly (``import agentkey.testing``); ``import agentkey`` never loads it.

- :class:`ScriptedTool` is an httpx transport (sync and async) that answers each request
  with the next entry of a script and records every request, so a test can assert that a
  retry carried the same ``Idempotency-Key``::

      tool = ScriptedTool([Reply(503), Reply(201, json={"charge_id": "ch_1"})])
      with ToolInvoker("https://tools.test", client=tool.client(),
                       retry=fast_retry_policy()) as invoker:
          result = invoker.invoke(step)
      assert tool.keys == [step.idempotency_key] * 2

- :func:`fast_retry_policy`, :func:`fast_poll_policy` and :func:`fast_token_policy`: the
  production policies with waits in the millisecond range, so a script of retries, 409s
  and polls runs in milliseconds (a ``Retry-After`` in a script is capped the same way).
- :func:`example_app`: the example tool server behind the middleware (``agentkey[server]``),
  for tests that want the real server half in process (``httpx.ASGITransport``).
- :func:`check_server` / :func:`acheck_server`: the protocol checker behind ``agentkey
  check``, which proves over HTTP that a running tool server honours the wire contract
  and returns a :class:`CheckReport` of :class:`CheckResult` rows.
- :func:`set_testing`: for a whole suite, no real waits and an in-memory journal per
  invoker for everything built with no ``clock=`` and no ``journal=``.
- :class:`FakeClock`: the clock to pass as ``clock=`` when a test asserts on a schedule:
  it moves only when told to, and records every wait.
"""

from __future__ import annotations

import json as _json
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

import httpx

from ._clock import Clock, SkippingClock, default_clock, set_default_clock
from ._exceptions import ConfigurationError
from .client._checker import CheckReport, CheckResult, acheck_server, check_server
from .client._policies import PollPolicy, RetryPolicy

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from .auth import TokenPolicy
    from .server import Store

__all__ = [
    "CheckReport",
    "CheckResult",
    "FakeClock",
    "Reply",
    "ScriptedTool",
    "acheck_server",
    "check_server",
    "example_app",
    "fast_poll_policy",
    "fast_retry_policy",
    "fast_token_policy",
    "set_testing",
]

_NO_JSON: Any = object()


@dataclass(frozen=True)
class Reply:
    """One scripted answer: a status, a JSON (or raw) body and headers.

    ``replayed=True`` adds ``Idempotent-Replayed: true``, as a server replaying a
    stored outcome does. A ``Reply`` is reusable: each use builds a fresh response.
    """

    status: int = 200
    json: Any = _NO_JSON
    headers: Mapping[str, str] = field(default_factory=dict)
    content: bytes = b""
    replayed: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.status, bool) or not isinstance(self.status, int):
            raise TypeError(f"Reply.status must be an int, got {self.status!r}")
        if not 100 <= self.status <= 599:
            raise ValueError(f"Reply.status must be an HTTP status (100-599), got {self.status}")
        if self.json is not _NO_JSON and self.content:
            raise ValueError("give a Reply json= or content=, not both")

    def response(self) -> httpx.Response:
        """A fresh ``httpx.Response`` for this answer."""
        headers = dict(self.headers)
        content = self.content
        if self.json is not _NO_JSON:
            content = _json.dumps(self.json).encode()
            headers.setdefault("Content-Type", "application/json")
        if self.replayed:
            headers["Idempotent-Replayed"] = "true"
        return httpx.Response(self.status, headers=headers, content=content)


#: A script entry: an answer, an exception to raise (``httpx.ConnectError(...)``,
#: ``httpx.ReadTimeout(...)``: the request is attached), a ready response (used once),
#: or a function of the request returning one of those.
Answer: TypeAlias = (
    "Reply | httpx.Response | BaseException | Callable[[httpx.Request], Reply | httpx.Response]"
)


class ScriptedTool(httpx.BaseTransport, httpx.AsyncBaseTransport):
    """An httpx transport answering each request with the next entry of ``script``.

    Pass it as ``transport=`` to an ``httpx.Client`` or ``httpx.AsyncClient`` (or use
    :meth:`client` / :meth:`async_client`) and give that client to the invoker.
    Every request is kept in :attr:`requests`, its body read, so tests can assert on
    keys, bodies and headers. When the script runs out, ``then`` answers every later
    request if given; otherwise the request fails the test with an ``AssertionError``
    naming it.
    """

    def __init__(self, script: Iterable[Answer] = (), *, then: Answer | None = None) -> None:
        self.script: list[Answer] = list(script)
        self.then = then
        #: Every request received, in order, bodies read.
        self.requests: list[httpx.Request] = []

    def __repr__(self) -> str:
        return f"ScriptedTool({len(self.script)} answers left, {len(self.requests)} requests)"

    @property
    def keys(self) -> list[str | None]:
        """The ``Idempotency-Key`` header of each request, in order (``None`` when absent)."""
        return [r.headers.get("Idempotency-Key") for r in self.requests]

    def calls(self, method: str) -> list[httpx.Request]:
        """The requests sent with ``method`` (``"POST"`` for the steps, ``"GET"`` for polls)."""
        return [r for r in self.requests if r.method == method.upper()]

    def client(self, **options: Any) -> httpx.Client:
        """An ``httpx.Client`` over this transport (``options`` go to the client)."""
        return httpx.Client(transport=self, **options)

    def async_client(self, **options: Any) -> httpx.AsyncClient:
        """An ``httpx.AsyncClient`` over this transport (``options`` go to the client)."""
        return httpx.AsyncClient(transport=self, **options)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()
        return self._answer(request)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        return self._answer(request)

    def _answer(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.script:
            entry = self.script.pop(0)
        elif self.then is not None:
            entry = self.then
        else:
            raise AssertionError(
                f"ScriptedTool ran out of answers: request {len(self.requests)} "
                f"({request.method} {request.url.path}) was not expected"
            )
        if callable(entry) and not isinstance(entry, (Reply, httpx.Response, BaseException)):
            entry = entry(request)
        if isinstance(entry, httpx.RequestError):
            raise type(entry)(str(entry), request=request)
        if isinstance(entry, BaseException):
            raise entry
        if isinstance(entry, Reply):
            return entry.response()
        if isinstance(entry, httpx.Response):
            return entry
        raise TypeError(
            f"a ScriptedTool entry must be a Reply, an httpx.Response, an exception or a "
            f"function of the request returning one, got {entry!r}"
        )


def fast_retry_policy(**changes: Any) -> RetryPolicy:
    """``RetryPolicy`` with waits of a millisecond or two (``Retry-After`` capped at 10 ms)."""
    policy = RetryPolicy(
        initial_backoff=0.001, max_backoff=0.002, max_retry_after=0.01, deadline=10.0
    )
    return policy.replace(**changes) if changes else policy


def fast_poll_policy(**changes: Any) -> PollPolicy:
    """``PollPolicy`` polling every millisecond (``Retry-After`` capped at 10 ms)."""
    policy = PollPolicy(
        initial_backoff=0.001,
        backoff_multiplier=1.0,
        max_backoff=0.001,
        max_retry_after=0.01,
        deadline=10.0,
        min_interval=0.001,
    )
    return policy.replace(**changes) if changes else policy


def fast_token_policy(**changes: Any) -> TokenPolicy:
    """``TokenPolicy`` retrying a token endpoint after a millisecond or two."""
    from .auth import TokenPolicy

    policy = TokenPolicy(
        initial_backoff=0.001, max_backoff=0.002, max_retry_after=0.01, deadline=10.0
    )
    return policy.replace(**changes) if changes else policy


def example_app(store: Store | None = None, **options: Any) -> Starlette:
    """The example tool server (``POST /tools/charge``, ``/provision``, ``/report``).

    It runs behind ``IdempotencyMiddleware`` on ``store`` (a fresh ``MemoryStore`` by
    default) and counts executions in ``app.state.executions``. Every caller shares
    one key space (``shared_key_space=True``: the agent under test is the only
    caller); pass ``shared_key_space=False`` to require a bearer token per caller.
    Needs ``agentkey[server]``; see :func:`agentkey.server._example.example_app` for
    ``options``.
    """
    from .server._example import example_app as make

    options.setdefault("shared_key_space", True)
    return make(store, **options)


class FakeClock:
    """A clock that moves only when told to, or when something sleeps on it.

    Pass it as ``clock=`` to an invoker, a middleware, a store, a journal or a token
    provider. ``sleep``/``asleep`` record the wait in :attr:`sleeps` and move the clock
    on by it at once; :meth:`advance` moves it by hand. ``time()`` (the wall clock)
    moves with ``monotonic()``. ``random()`` returns the entries of ``draws`` in turn
    (then the last one again); the default ``0.5`` makes every jittered wait half its
    ceiling.
    """

    def __init__(
        self,
        *,
        start: float = 1000.0,
        wall: float = 1_700_000_000.0,
        draws: Iterable[float] = (0.5,),
    ) -> None:
        self._now = float(start)
        self._offset = float(wall) - float(start)
        self._draws = [float(d) for d in draws]
        if not self._draws or not all(0.0 <= d < 1.0 for d in self._draws):
            raise ValueError("FakeClock draws= must hold at least one number in [0, 1)")
        #: Every wait asked of this clock, in seconds, in order.
        self.sleeps: list[float] = []

    def __repr__(self) -> str:
        return f"FakeClock(now={self._now:.3f}, {len(self.sleeps)} sleeps)"

    def monotonic(self) -> float:
        return self._now

    def time(self) -> float:
        return self._now + self._offset

    def advance(self, seconds: float) -> None:
        """Move the clock on by ``seconds`` (a finite number >= 0)."""
        if not 0 <= seconds < float("inf"):  # NaN too
            raise ValueError(f"a clock moves on by a finite number >= 0; got {seconds!r}")
        self._now += seconds

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self._now += max(0.0, seconds)

    async def asleep(self, seconds: float) -> None:
        import anyio.lowlevel

        self.sleeps.append(seconds)
        self._now += max(0.0, seconds)
        await anyio.lowlevel.checkpoint()  # let the other tasks run, as a real wait would

    def random(self) -> float:
        return self._draws.pop(0) if len(self._draws) > 1 else self._draws[0]


class _TestingMode:
    """What :func:`set_testing` returns: leaving its ``with`` block restores what was before."""

    __slots__ = ("_before",)

    def __init__(self, before: tuple[Clock, bool]) -> None:
        self._before = before

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        from .journal import _default

        clock, journal = self._before
        set_default_clock(clock)
        _default.set_testing(journal)

    def __repr__(self) -> str:
        return f"<agentkey testing mode; leaving it restores {self._before[0]!r}>"


def set_testing(testing: bool = True) -> AbstractContextManager[None]:
    """Turn testing mode on (or off): no real waits, and an in-memory journal per invoker.

    For a user's own test suite, in a fixture or ``conftest.py``. Objects built afterwards
    with no ``clock=`` (invokers, token providers, MCP sessions, journals; not the server
    half, whose leases the store times in real seconds) use a clock whose waits return at
    once while the time they would have taken still counts,
    so a production retry schedule, 409 waits and polls run in microseconds and deadlines
    still expire. Invokers built afterwards with no ``journal=`` get a journal in memory
    of their own, whatever file ``$AGENTKEY_JOURNAL`` names (``off`` still means none):
    nothing is written to the user's data directory or the agent's journal, and no test's
    invoker answers a call from another test's record.

    ``set_testing(False)`` restores the system clock and the default journal for objects
    built after it. Used as a context manager, it restores whatever was in force before
    it, on or off::

        @pytest.fixture(autouse=True)
        def agentkey_testing():
            with agentkey.testing.set_testing():
                yield

    Objects already built keep the clock and journal they were built with.
    """
    if not isinstance(testing, bool):
        raise ConfigurationError(f"set_testing takes True or False, got {testing!r}")
    from .journal import _default

    before = (default_clock(), _default.is_testing())
    set_default_clock(SkippingClock() if testing else None)
    _default.set_testing(testing)
    return _TestingMode(before)
