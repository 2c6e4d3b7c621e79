"""``agentkey demo``: the whole contract, end to end, on embedded defaults.

The client half (PlanSession, AsyncToolInvoker) talks to the server half
(``agentkey.testing.example_app`` on a MemoryStore) in-process, through an
ASGI client (``_clients.asgi_client``): no network, no Redis, nothing to set up. A fault
injector between them loses one answer after the server committed, the way a
read timeout does on a real network.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ._plan import PlanSession
from .client import _clients, _http
from .client._hooks import InvokeEvent, ReplayEvent, RetryEvent
from .client._invoker import AsyncToolInvoker, ToolResult
from .client._policies import RetryPolicy

__all__ = ["run_demo"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class _LoseFirstAnswer:
    """ASGI wrapper: let the app run and commit, then drop its answer once (a lost response)."""

    def __init__(self, app: ASGIApp, path: str) -> None:
        self.app = app
        self.path = path
        self.armed = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not (self.armed and scope.get("path") == self.path):
            await self.app(scope, receive, send)
            return
        self.armed = False

        async def swallow(message: Message) -> None:
            return None

        await self.app(scope, receive, swallow)  # the charge happens and is recorded
        raise _http.ReadTimeout("simulated: the tool ran, but its answer never arrived")


def _short(key: str) -> str:
    plan, step, digest = key.split(":")
    return f"{plan[:8]}…:{step}:{digest[:10]}…"


async def _run(out: Callable[[str], None]) -> int:
    try:
        from .server import MemoryStore  # noqa: F401 - the server half is an extra: checked here
        from .server._example import example_app
    except ImportError:  # MissingExtra, or a package of the extra missing
        out("agentkey demo needs the server half: pip install 'agentkey-idempotency[server]'")
        return 2  # a usage error, as for `agentkey serve`: 1 means the contract broke

    app = example_app(work_seconds=0.3, shared_key_space=True)  # one agent, in process
    faulty = _LoseFirstAnswer(app, "/tools/charge")
    events: dict[str, list[str]] = {}  # per asyncio task, so racing workers keep their own

    def hook(event: InvokeEvent) -> None:
        task = asyncio.current_task()
        lines = events.setdefault(task.get_name() if task else "", [])
        if isinstance(event, RetryEvent):
            lines.append(
                f"attempt {event.attempt} failed ({event.reason}); resending the same key "
                f"in {event.wait:.2f} s"
            )
        elif isinstance(event, ReplayEvent):
            lines.append(f"the server replayed its stored answer (status {event.status_code})")

    def invoker() -> AsyncToolInvoker:
        client = _clients.asgi_client(faulty)
        return AsyncToolInvoker(
            "http://tools.internal",
            client=client,
            route_template="/tools/{tool}",
            retry=RetryPolicy(initial_backoff=0.05, max_backoff=0.2, max_retry_after=1.0),
            hooks=[hook],
        )

    explained: list[bool] = []

    def show(title: str, result: ToolResult, task: str = "main") -> None:
        out(f"  {title}")
        out(f"    key       {_short(result.idempotency_key)}")
        if not explained:
            explained.append(True)
            out(
                "              (Idempotency-Key = <plan session id>:<step>:<sha256 of the "
                "canonical JSON args>,"
            )
            out(
                f"               {len(result.idempotency_key)} characters, shortened here; "
                "same plan, step and args always give the same key)"
            )
        for line in events.pop(task, []):
            out(f"    event     {line}")
        verdict = "REPLAYED (no new side effect)" if result.replayed else "EXECUTED"
        out(f"    outcome   {verdict} after {result.attempts} attempt(s)")
        out(f"    body      {json.dumps(result.body, separators=(',', ':'))}")

    plan = PlanSession.new()
    saved = plan.to_json()
    out("agentkey demo: an agent's plan against a tool server that honours Idempotency-Key")
    out(f"plan session {plan.id} (saved as JSON with the plan)\n")

    charge = plan.step(0, "charge", {"amount": 1999, "currency": "EUR"})
    provision = plan.step(1, "provision", {"region": "eu-west-1", "size": "m5.large"})
    async with invoker() as tools:
        out("1. step 0 charges a card; the answer is lost after the server committed")
        first = await tools.invoke(charge)
        show("the invoker retried with the same key", first)

        out("\n2. two workers race step 1 (provision a VM)")
        a, b = await asyncio.gather(
            asyncio.create_task(tools.invoke(provision), name="A"),
            asyncio.create_task(tools.invoke(provision), name="B"),
        )
        show("worker A", a, "A")
        show("worker B", b, "B")

    out("\n3. the orchestrator restarts, restores the plan and runs step 0 again")
    restored = PlanSession.from_json(saved)
    again = restored.step(0, "charge", {"currency": "EUR", "amount": 1999})
    async with invoker() as tools:
        replay = await tools.invoke(again)
        show("same step, same args (in another order): same key", replay)

        out("\n4. the planner revises step 0: the amount changes, so it is a new operation")
        revised = restored.step(0, "charge", {"amount": 2999, "currency": "EUR"})
        changed = await tools.invoke(revised)
        show("changed args: new key", changed)

    executions = dict(app.state.executions)
    out(f"\nside effects on the server: {json.dumps(executions, sort_keys=True)}")
    ok = (
        executions == {"charge": 2, "provision": 1}
        and first.replayed
        and replay.replayed
        and replay.body == first.body
        and a.body == b.body
        and a.replayed != b.replayed
        and not changed.replayed
        and changed.idempotency_key != first.idempotency_key
    )
    out(
        "contract held: 5 invokes, 3 side effects; every repeat was a replay"
        if ok
        else "CONTRACT BROKEN: a repeat ran twice or a changed step was replayed"
    )
    if ok:
        out("")
        out(_READ_NEXT)
    return 0 if ok else 1


_DOCS = "https://github.com/agentkey-idempotency/agentkey/tree/main/docs"
_READ_NEXT = f"""read next ({_DOCS}):
  quickstart.md   your own plan and invoker in ten lines
  protocol.md     the wire contract this demo just exercised
  server.md       protect your own tool server with IdempotencyMiddleware
  cli.md          agentkey key, and agentkey check <url> to test a server you run"""


def run_demo(out: Callable[[str], None] = print) -> int:
    """Run the demo, writing lines through ``out``; return the exit code."""

    async def main() -> int:
        current = asyncio.current_task()
        if current is not None:
            current.set_name("main")
        return await _run(out)

    return asyncio.run(main())
