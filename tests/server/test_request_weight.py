"""What a request in flight costs the server beside its answer: objects held, caches kept.

At 64 connections every request in flight holds its state across the store's round trips,
and the garbage collector, run by the others' allocations, walks it again and again. So
the settle holds no closure cells, and the values the middleware remembers per distinct
operation, route, header name or binding stay bounded however many a server meets.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import itertools
import os
import threading
import time
import types
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentkey import StepKey
from agentkey.server import IdempotencyMiddleware, MemoryStore, _decide, _records
from agentkey.server._claim import Claim
from agentkey.server._decide import check_body, stored_headers
from agentkey.server._lifecycle import Lifecycle
from agentkey.server._records import Binding, digest, encode_in_progress
from agentkey.testing import FakeClock
from tests._loopback import serve

BODY = b'{"amount":100}'


class _HeldFinish(MemoryStore):
    """A MemoryStore whose finish waits, once written, until the test lets it answer."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.gate: asyncio.Event | None = None

    async def finish(self, key: str, owner: str, value: bytes, *, ttl_ms: int) -> bool:
        done = await super().finish(key, owner, value, ttl_ms=ttl_ms)
        if self.gate is None:
            self.loop, self.gate = asyncio.get_running_loop(), asyncio.Event()
        self.waiting += 1
        await self.gate.wait()
        return done

    def open(self) -> None:
        assert self.loop is not None
        assert self.gate is not None
        self.loop.call_soon_threadsafe(self.gate.set)


def _cells_holding_a_claim(plan: str) -> int:
    """Closure cells holding a claim of ``plan`` (another test's leftovers are not counted)."""
    found = 0
    for obj in gc.get_objects():
        if type(obj) is types.CellType:
            try:
                held = obj.cell_contents
                if isinstance(held, Claim) and held.idempotency_key.startswith(plan + ":"):
                    found += 1
            except ValueError:  # an empty cell
                pass
    return found


def test_requests_waiting_on_the_finish_hold_no_closure_cells() -> None:
    """16 requests held at the store's finish keep no cell holding their claim (on main: a
    settle's closures gave each request its variables as cells, 16+ found), and each ran once."""
    runs = 0

    async def charge(request: Request) -> Response:
        nonlocal runs
        runs += 1
        args = await request.json()
        return JSONResponse({"amount": args["amount"]}, status_code=201)

    store = _HeldFinish()
    tool = Starlette(routes=[Route("/tools/charge", charge, methods=["POST"])])
    app = IdempotencyMiddleware(tool, store=store, shared_key_space=True)
    digest_hex = hashlib.sha256(BODY).hexdigest()
    plan = os.urandom(6).hex()
    keys = [f"{plan}:step_{i:03d}:{digest_hex}" for i in range(16)]
    answers: list[Any] = []

    async def send_all(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(
                *(
                    client.post(url + "/tools/charge", content=BODY, headers={"Idempotency-Key": k})
                    for k in keys
                )
            )

    with serve(app) as url:
        sender = threading.Thread(target=lambda: answers.append(asyncio.run(send_all(url))))
        sender.start()
        deadline = time.monotonic() + 60
        while store.waiting < len(keys):
            assert time.monotonic() < deadline, f"only {store.waiting} requests reached finish"
            time.sleep(0.01)
        held = _cells_holding_a_claim(plan)
        store.open()
        sender.join(timeout=60)
    assert held == 0
    assert [a.status_code for a in answers[0]] == [201] * len(keys)
    assert runs == len(keys)


def test_the_per_value_caches_stay_bounded() -> None:
    """3,000 distinct operations, routes, route bindings and answer header names leave each
    of the middleware's caches of them at 1,024 entries or fewer."""
    owner = "0" * 32
    digest_hex = hashlib.sha256(BODY).hexdigest()
    key = StepKey("plan", (0,), digest_hex)
    for i in range(3000):
        encode_in_progress(
            owner, 1, binding=Binding("r" * 22), phase="started", operation=f"POST /t/{i}"
        )
        Binding.decode(digest(b"%d" % i))
        stored_headers([(b"x-header-%d" % i, b"v")])
        check_body(key, ("POST", f"/t/{i}"), BODY)
    assert 0 < len(_records._QUOTED) <= 1024
    assert 0 < len(_records._ROUTE_BINDINGS) <= 1024
    assert 0 < len(_decide._HEADER_NAMES) <= 1024
    assert 0 < len(_decide._ROUTES) <= 1024


def test_a_clients_long_operation_is_not_kept() -> None:
    """Operations come from clients: a long path (20,000 CJK characters, 180 KB once
    quoted) is neither quoted into the record cache nor kept as a route binding, so 1,024
    of them cannot make the caches hold hundreds of megabytes; its record and binding are
    what they would have been."""
    owner, long = "0" * 32, "POST /" + "漢" * 20_000
    record = encode_in_progress(
        owner, 1, binding=Binding("r" * 22), phase="started", operation=long
    )
    key = StepKey("plan", (0,), hashlib.sha256(BODY).hexdigest())
    checked = check_body(key, ("POST", long[5:]), BODY)
    assert long not in _records._QUOTED
    assert ("POST", long[5:]) not in _decide._ROUTES
    assert record == encode_in_progress(
        owner, 1, binding=Binding("r" * 22), phase="started", operation=long
    )
    assert checked == check_body(key, ("POST", long[5:]), BODY)


def _claims_built(monkeypatch: Any) -> list[str]:
    """The keys of the claims built from now on, in order (Claim.__init__ watched)."""
    built: list[str] = []
    init = Claim.__init__

    def counting(self: Claim, **kwargs: Any) -> None:
        built.append(kwargs["idempotency_key"])
        init(self, **kwargs)

    monkeypatch.setattr(Claim, "__init__", counting)
    return built


def test_a_replay_or_a_refusal_builds_no_claim(monkeypatch: Any) -> None:
    """Over uvicorn, 2 runs, 6 replays, a 422 and a 409 build 2 claims (one per request before)."""
    built = _claims_built(monkeypatch)
    runs = 0
    release = threading.Event()

    async def charge(request: Request) -> Response:
        nonlocal runs
        runs += 1
        args = await request.json()
        if args.get("slow"):
            await asyncio.get_running_loop().run_in_executor(None, release.wait, 30)
        return JSONResponse({"amount": args["amount"]}, status_code=201)

    tool = Starlette(routes=[Route("/tools/charge", charge, methods=["POST"])])
    app = IdempotencyMiddleware(tool, store=MemoryStore(), shared_key_space=True)
    key = f"{os.urandom(6).hex()}:step_000:{hashlib.sha256(BODY).hexdigest()}"
    opaque = f"ik_{os.urandom(8).hex()}"
    slow = b'{"amount":1,"slow":true}'
    with serve(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        first = client.post("/tools/charge", content=BODY, headers={"Idempotency-Key": key})
        replays = [
            client.post("/tools/charge", content=BODY, headers={"Idempotency-Key": key})
            for _ in range(6)
        ]
        with httpx.Client(base_url=url, timeout=60) as other:
            sender = threading.Thread(
                target=lambda: other.post(
                    "/tools/charge", content=slow, headers={"Idempotency-Key": opaque}
                )
            )
            sender.start()
            deadline = time.monotonic() + 60
            while runs < 2:
                assert time.monotonic() < deadline, "the slow request never ran"
                time.sleep(0.01)
            busy = client.post("/tools/charge", content=slow, headers={"Idempotency-Key": opaque})
            mismatch = client.post(
                "/tools/charge", content=BODY, headers={"Idempotency-Key": opaque}
            )
            release.set()
            sender.join(timeout=60)
    assert first.status_code == 201
    assert [(r.status_code, r.headers.get("idempotent-replayed")) for r in replays] == [
        (201, "true")
    ] * 6
    assert {r.content for r in replays} == {first.content}
    assert (busy.status_code, busy.json()["error"]) == (409, "in_progress")
    assert (mismatch.status_code, mismatch.json()["error"]) == (422, "payload_mismatch")
    assert runs == 2
    assert built == [key, opaque]


def test_the_first_write_of_open_is_the_first_write_of_a_claim(monkeypatch: Any) -> None:
    """Lifecycle.open writes what new_claim() then claim() write: the same record, the same TTL."""

    class Recording(MemoryStore):
        def __init__(self, **options: Any) -> None:
            super().__init__(**options)
            self.writes: list[tuple[str, bytes, int]] = []

        async def claim(self, key: str, value: bytes, *, ttl_ms: int) -> Any:
            self.writes.append((key, value, ttl_ms))
            return await super().claim(key, value, ttl_ms=ttl_ms)

    monkeypatch.setattr(os, "urandom", lambda n: b"\x01" * n)  # one owner for both ways
    key = _decide.parse_key([b"ik_same"], key_format="any")
    assert not isinstance(key, _decide.Reject)
    checked = check_body(key, ("POST", "/a"), [b"{}"], body_fingerprint="bytes")
    assert isinstance(checked, _decide.Checked)
    combinations = itertools.product(
        ("on_run", "on_mark"), (True, False), (1, 2, 3, 15_000, 10**9), ("", "POST /a", "x" * 5000)
    )
    for starts, renew, lease, operation in combinations:
        writes = []
        for way in ("open", "claim"):
            clock = FakeClock()
            store = Recording(clock=clock)
            life = Lifecycle(
                store,
                lock_ttl_ms=lease,
                result_ttl_ms=86_400_000,
                retry_after=1,
                auto_renew=renew,
                clock=clock,
                mutation_starts=starts,  # type: ignore[arg-type]
            )
            if way == "open":
                asyncio.run(life.open(checked, "p", [b"{}"], operation))
            else:
                claim = life.new_claim(checked, "p", [b"{}"], operation)
                asyncio.run(life.claim(claim, checked))
            writes.append(store.writes)
        assert writes[0] == writes[1], (starts, renew, lease, operation)


async def test_an_mcp_replay_or_refusal_builds_no_claim(monkeypatch: Any) -> None:
    """Over MCP streamable HTTP, 1 run, 3 replays and a payload mismatch build 1 claim (5 on
    main, where the MCP middleware built one per call before asking the store)."""
    from mcp.shared.exceptions import MCPError

    from tests.integrations._mcp_app import running
    from tests.integrations.test_mcp import raw_call, session

    built = _claims_built(monkeypatch)
    opaque = f"ik_{os.urandom(8).hex()}"
    args = {"region": "eu-central-1", "size": 4}
    with running(MemoryStore()) as lab:
        async with session(lab) as s:
            first = await raw_call(s, "create_vm", args, opaque)
            replays = [await raw_call(s, "create_vm", args, opaque) for _ in range(3)]
            with pytest.raises(MCPError) as refused:
                await raw_call(s, "create_vm", {**args, "size": 8}, opaque)
        assert lab.runs["create_vm"] == 1
    assert {r.structured_content == first.structured_content for r in replays} == {True}
    assert refused.value.data == {"type": "io.agentkey/payload-mismatch"}
    assert built == [opaque]
