"""Header values never leak: bad headers fail at the boundary, and the HTTP layer's own
refusal (which quotes the offending header) never reaches a message or a traceback."""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Generator
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentkey import AsyncToolInvoker, ConfigurationError, ToolInvoker
from agentkey.client._effects import Outgoing
from tests._loopback import serve

from ._support import BASE, DRIVERS, Driver, Script, make_step

SECRET = "SECRET-9f2c"


def _run(driver: Driver, base: str, **options: Any) -> None:
    """Invoke one step through ``driver`` against ``base`` (a real server or a MockTransport)."""
    call = options.pop("call", {})
    transport = options.pop("transport", None)
    step = make_step()
    if driver == "sync":
        client = httpx.Client(transport=transport) if transport else None
        with ToolInvoker(base, client=client, hooks=(), **options) as inv:
            try:
                inv.invoke(step, path="/t", **call)
            finally:
                if client is not None:
                    client.close()
        return

    async def main() -> None:
        client = httpx.AsyncClient(transport=transport) if transport else None
        async with AsyncToolInvoker(base, client=client, hooks=(), **options) as inv:
            try:
                await inv.invoke(step, path="/t", **call)
            finally:
                if client is not None:
                    await client.aclose()

    asyncio.run(main())


def _everything(exc: BaseException) -> str:
    """The message, repr and full traceback (cause and context chains included)."""
    return "".join(traceback.format_exception(exc)) + repr(exc) + repr(exc.args)


BAD_VALUES = [f"{SECRET}\r\nX-Injected: 1", f"{SECRET}\n", f"{SECRET}\x00", f"{SECRET}é", " x"]


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("value", BAD_VALUES)
def test_bad_header_value_rejected_without_echo(driver: Driver, value: str) -> None:
    """A header value HTTP cannot carry is a ConfigurationError naming the header, not the value."""
    script = Script([httpx.Response(200, json={})])
    transport = httpx.MockTransport(script)
    with pytest.raises(ConfigurationError, match="X-Api-Key") as info:
        _run(driver, BASE, transport=transport, call={"headers": {"X-Api-Key": value}})
    assert SECRET not in _everything(info.value)
    assert script.requests == []


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("name", ["X Api", "X-Api:", "X-Api\n", "", "Ä"])
def test_bad_header_name_rejected(driver: Driver, name: str) -> None:
    """A header name that is not an HTTP token is refused before anything is sent."""
    script = Script([httpx.Response(200, json={})])
    transport = httpx.MockTransport(script)
    with pytest.raises(ConfigurationError, match="not a valid HTTP header name"):
        _run(driver, BASE, transport=transport, call={"headers": {name: "v"}})
    assert script.requests == []


@given(st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=40))
def test_visible_ascii_values_pass(value: str) -> None:
    """Every visible-ASCII value (what tokens and API keys are made of) is sent unchanged."""
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["X-Api-Key"])
        return httpx.Response(200, json={})

    _run(
        "sync", BASE, transport=httpx.MockTransport(handler), call={"headers": {"X-Api-Key": value}}
    )
    assert seen == [value]


class LeakyAuth(httpx.Auth):
    """A user's own auth whose token picked up a line break (e.g. read from a file)."""

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = f"Bearer {SECRET}\n"
        yield request


def _app() -> Starlette:
    async def tool(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    return Starlette(routes=[Route("/t", tool, methods=["POST"])])


@pytest.mark.parametrize("driver", DRIVERS)
def test_refused_header_never_reaches_message_or_traceback(driver: Driver) -> None:
    """h11 quotes an illegal Authorization value; agentkey's error drops it and its cause."""
    with (
        serve(_app()) as base,
        pytest.raises(ConfigurationError, match="LocalProtocolError") as info,
    ):
        _run(driver, base, auth=LeakyAuth())
    assert SECRET not in _everything(info.value)
    assert info.value.__cause__ is None


def test_request_records_keep_header_values_out_of_repr() -> None:
    """A request record reprs without header values (error trackers log frame locals)."""
    out = Outgoing("POST", BASE + "/t", (("X-Api-Key", SECRET),), b"{}", same_origin=True)
    assert SECRET not in repr(out)
    assert "POST" in repr(out)
