"""The invoker's boundary: options and call arguments are checked before anything is sent."""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkey import (
    AsyncToolInvoker,
    ConfigurationError,
    InsecureTransport,
    InvalidKey,
    Outcome,
    PlanSession,
    ToolInvoker,
    ToolResult,
)
from agentkey.journal import SQLiteJournal

from ._support import BASE, DRIVERS, Bearer, Driver, Script, make_step, run_invoke


def ok() -> httpx.Response:
    return httpx.Response(200, json={"ok": True})


@pytest.mark.parametrize(
    "base_url",
    ["tool.test", "ftp://tool.test", "https://", "https://tool.test/?x=1", "/tools", 42],
)
def test_bad_base_url(base_url: Any) -> None:
    """base_url must be an absolute http(s) URL with a host."""
    with pytest.raises(ConfigurationError, match="base_url"):
        ToolInvoker(base_url)


@pytest.mark.parametrize(
    "options",
    [
        {"auth": "Bearer x"},
        {"retry": {"max_attempts": 3}},
        {"polling": None},
        {"key_header_style": "quoted"},
        {"replay_headers": "Idempotent-Replayed"},
        {"allowed_poll_origins": ["status.test"]},
        {"allowed_poll_origins": ["https://status.test/path"]},
        {"route_template": "/tools"},
        {"hooks": [42]},
        {"timeout": -1},
        {"client": httpx.AsyncClient()},
        {"routes": {"create_db": "https://evil.test/x"}},
        {"routes": [("create_db", "/tools/create_db")]},
        {"routes": {"create_db": "/tools/create_db#frag"}},
        {"hooks": print},
        {"allowed_poll_origins": "https://status.test"},
        {"timeout": float("nan")},
        {"timeout": float("inf")},
    ],
)
def test_bad_options(options: dict[str, Any]) -> None:
    """Each wrong option raises ConfigurationError naming it."""
    try:
        with pytest.raises(ConfigurationError):
            ToolInvoker(BASE, **options)
    finally:
        client = options.get("client")
        if isinstance(client, httpx.AsyncClient):
            asyncio.run(client.aclose())


@pytest.mark.parametrize(
    ("base_url", "insecure"),
    [
        ("http://tools.example.com", True),
        ("http://localhost:8000", False),
        ("http://127.0.0.1:8000", False),
        ("http://[::1]:8000", False),
        ("https://tools.example.com", False),
    ],
)
def test_no_credentials_over_plain_http(base_url: str, insecure: bool) -> None:
    """auth= with a plain-http base_url is refused unless the host is loopback."""
    if insecure:
        with pytest.raises(InsecureTransport, match="https"):
            ToolInvoker(base_url, auth=Bearer())
    else:
        ToolInvoker(base_url, auth=Bearer()).close()
    ToolInvoker(base_url).close()  # without credentials plain http is the user's call


@pytest.mark.parametrize("invoker_cls", [ToolInvoker, AsyncToolInvoker])
@pytest.mark.parametrize(
    "options",
    [
        {"base_url": "https://svc:hunter2@tool.test"},
        {"base_url": BASE, "allowed_poll_origins": ["https://svc:hunter2@status.test"]},
    ],
)
def test_urls_with_credentials_refused_without_echo(
    invoker_cls: type[ToolInvoker] | type[AsyncToolInvoker], options: dict[str, Any]
) -> None:
    """user:password@ in base_url or a poll origin is refused, and the password is not quoted."""
    with pytest.raises(ConfigurationError, match="user:password@") as info:
        invoker_cls(hooks=(), **options)
    assert "hunter2" not in str(info.value)


def test_async_invoker_rejects_sync_client() -> None:
    """AsyncToolInvoker needs an AsyncClient."""
    with httpx.Client() as client, pytest.raises(ConfigurationError, match="AsyncClient"):
        AsyncToolInvoker(BASE, client=client)  # type: ignore[arg-type]


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize(
    "name", ["Idempotency-Key", "authorization", "Content-Type", "PROXY-AUTHORIZATION"]
)
def test_reserved_headers_rejected(driver: Driver, name: str) -> None:
    """headers= cannot override the key, credentials or content type; nothing is sent."""
    script = Script([ok()])
    with pytest.raises(ConfigurationError, match="cannot set"):
        _invoke_with(driver, script, path="/t", headers={name: "x"})
    assert script.requests == []


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize(
    ("call", "match"),
    [
        ({"headers": [("X-Tenant", "a")]}, "headers must be a mapping"),
        ({"headers": "X-Tenant: a"}, "headers must be a mapping"),
        ({"path": "/t#frag"}, "fragment"),
        ({"path": "/t\x00x"}, "control characters"),
        ({"path": "/t\x7f"}, "control characters"),
        ({"path": "https://evil.test/t"}, "no scheme"),
        ({"path": "//evil.test/t"}, "no scheme"),
        ({"path": "/t?x=1"}, "query"),
    ],
)
def test_bad_call_arguments(driver: Driver, call: dict[str, Any], match: str) -> None:
    """Wrongly shaped headers= or a path with a fragment fail at the boundary; nothing is sent."""
    script = Script([ok()])
    call.setdefault("path", "/t")
    with pytest.raises(ConfigurationError, match=match):
        _invoke_with(driver, script, **call)
    assert script.requests == []


def _invoke_with(driver: Driver, script: Script, **call: Any) -> ToolResult:
    step = call.pop("step", make_step())
    options = call.pop("options", {})
    transport = httpx.MockTransport(script)
    if driver == "sync":
        with (
            httpx.Client(transport=transport) as client,
            ToolInvoker(BASE, client=client, hooks=(), **options) as inv,
        ):
            return inv.invoke(step, **call)

    async def main() -> ToolResult:
        async with (
            httpx.AsyncClient(transport=transport) as client,
            AsyncToolInvoker(BASE, client=client, hooks=(), **options) as inv,
        ):
            return await inv.invoke(step, **call)

    return asyncio.run(main())


@pytest.mark.parametrize("driver", DRIVERS)
def test_missing_route(driver: Driver) -> None:
    """Without path=, routes or a template, the call fails before sending."""
    script = Script([ok()])
    with pytest.raises(ConfigurationError, match="no route for tool 'create_db'"):
        _invoke_with(driver, script)
    assert script.requests == []


@pytest.mark.parametrize("driver", DRIVERS)
def test_routes_then_template(driver: Driver) -> None:
    """routes= wins over route_template=, which quotes the tool name."""
    script = Script([ok(), ok()])
    options = {"routes": {"create_db": "/v1/db"}, "route_template": "/tools/{tool}"}
    _invoke_with(driver, script, options=options)
    _invoke_with(driver, script, options=options, step=make_step(tool="send mail"))
    assert [r.url.path for r in script.requests] == ["/v1/db", "/tools/send mail"]
    assert script.requests[1].url.raw_path == b"/tools/send%20mail"


@pytest.mark.parametrize("driver", DRIVERS)
def test_explicit_key_wins_and_style(driver: Driver) -> None:
    """An explicit key is validated, wins over the step's, and goes out in sf-string style."""
    step = make_step()
    other = PlanSession.new().step(9, "create_db", {"x": 1}).idempotency_key
    script = Script([ok()])
    result = _invoke_with(
        driver,
        script,
        step=step,
        path="/t",
        idempotency_key=other,
        options={"key_header_style": "sf-string"},
    )
    assert script.requests[0].headers["Idempotency-Key"] == f'"{other}"'
    assert result.idempotency_key == other
    assert result.label == "step_009"
    with pytest.raises(InvalidKey):
        _invoke_with(driver, Script([]), path="/t", idempotency_key="not-a-key")


@pytest.mark.parametrize("driver", DRIVERS)
def test_user_headers_and_method(driver: Driver) -> None:
    """Extra headers and another method go out; the body stays the canonical bytes."""
    step = make_step()
    script = Script([ok()])
    _invoke_with(driver, script, step=step, path="/t", method="put", headers={"X-Tenant": "a"})
    (request,) = script.requests
    assert request.method == "PUT"
    assert request.headers["X-Tenant"] == "a"
    assert request.content == step.body


def test_invoke_needs_a_step() -> None:
    """Passing a dict instead of a Step is a clear error."""
    with ToolInvoker(BASE) as invoker, pytest.raises(ConfigurationError, match="Step"):
        invoker.invoke({"tool": "x"}, path="/t")  # type: ignore[arg-type]


def test_client_ownership() -> None:
    """A user's client is left open; the invoker's own client is closed; closed invokers refuse."""
    with httpx.Client(transport=httpx.MockTransport(Script([ok()]))) as client:
        invoker = ToolInvoker(BASE, client=client, hooks=())
        invoker.close()
        assert not client.is_closed
        with pytest.raises(ConfigurationError, match="closed"):
            invoker.invoke(make_step(), path="/t")
    own = ToolInvoker(BASE)
    own.close()
    assert own._client.is_closed


def test_user_client_auth_and_redirects_do_not_apply() -> None:
    """A user client's own auth and follow_redirects are overridden per request."""
    script = Script([httpx.Response(307, headers={"Location": "https://evil.test/x"})])
    with httpx.Client(
        transport=httpx.MockTransport(script), auth=("user", "pw"), follow_redirects=True
    ) as client:
        invoker = ToolInvoker(BASE, client=client, hooks=())
        with pytest.raises(Exception, match="another origin"):
            invoker.invoke(make_step(), path="/t")
    (request,) = script.requests
    assert "Authorization" not in request.headers


def test_result_model() -> None:
    """ToolResult is frozen and exposes replayed from the outcome."""
    result = run_invoke("sync", Script([ok()]), make_step())
    assert result.outcome is Outcome.ANSWERED  # the answer shows no sign either way
    assert result.model_dump()["replayed"] is False
    assert result.label == "step_003"
    assert "step" not in result.model_dump()  # one name for the label: .label
    with pytest.raises(Exception, match="frozen"):
        result.status_code = 500  # type: ignore[misc]


def _fields(result: ToolResult) -> dict[str, Any]:
    return {name: getattr(result, name) for name in ToolResult.model_fields}


@pytest.mark.parametrize("driver", DRIVERS)
def test_result_is_the_validated_model(driver: Driver) -> None:
    """A tool's answer, built without validating it again, is the ToolResult validation gives:
    equal, same repr, dump, JSON and set fields, frozen, copyable and picklable."""
    answer = httpx.Response(201, json={"id": 7}, headers={"X-Trace": "t1", "Retry-After": "3"})
    result = run_invoke(driver, Script([answer]), make_step())
    validated = ToolResult(**_fields(result))
    assert result == validated
    assert validated == result
    assert repr(result) == repr(validated)
    assert result.model_dump() == validated.model_dump()
    assert result.model_dump_json() == validated.model_dump_json()
    assert result.model_fields_set == validated.model_fields_set == set(ToolResult.model_fields)
    assert ToolResult.model_validate(result.model_dump(exclude={"replayed"})) == result
    assert result.headers == {
        "x-trace": "t1",
        "retry-after": "3",
        "content-length": str(len(answer.content)),  # httpx < 0.28 puts spaces in its JSON
        "content-type": "application/json",
    }
    assert result.body == {"id": 7}
    assert result.outcome is Outcome.ANSWERED
    copied = result.model_copy(update={"status_code": 200})
    assert copied.status_code == 200
    assert result.status_code == 201
    assert pickle.loads(pickle.dumps(result)) == result  # noqa: S301 - bytes made just here
    with pytest.raises(Exception, match="frozen"):
        result.body = None  # type: ignore[misc]


@pytest.mark.parametrize("driver", DRIVERS)
def test_only_answers_from_storage_are_validated(
    driver: Driver, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A tool's answer becomes its ToolResult without a second validation (the flow built its
    parts from httpx's); the journal's copy of an earlier answer is validated: 1 and 1 on
    main, 0 and 1 now."""
    validated: list[dict[str, Any]] = []
    real_init = ToolResult.__init__

    def counting(self: ToolResult, **data: Any) -> None:
        validated.append(data)
        real_init(self, **data)

    monkeypatch.setattr(ToolResult, "__init__", counting)
    step = make_step()
    journal = SQLiteJournal(tmp_path / "journal.sqlite3")
    # The tool marks no replays: a second call of the step is the journal's to answer.
    options: dict[str, Any] = {"journal": journal, "honours_keys": False, "replay_headers": ()}
    first = run_invoke(driver, Script([ok()]), step, **options)
    assert first.source == "tool"
    assert validated == []
    again = run_invoke(driver, Script([]), step, **options)
    assert again.source == "journal"
    assert len(validated) == 1
    assert again.body == first.body == {"ok": True}


@given(
    args=st.dictionaries(
        st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=8)), max_size=5
    )
)
def test_key_and_body_are_the_steps(args: dict[str, object]) -> None:
    """For any arguments, the request carries exactly the step's key and canonical body."""
    step = PlanSession.new().step(1, "tool", args)
    script = Script([ok()])
    result = run_invoke("sync", script, step)
    (request,) = script.requests
    assert request.headers["Idempotency-Key"] == step.idempotency_key == result.idempotency_key
    assert request.content == step.body


@pytest.mark.parametrize("invoker_cls", [ToolInvoker, AsyncToolInvoker])
@pytest.mark.parametrize(
    ("base_url", "header", "refused"),
    [
        ("http://tools.example.com", "Authorization", True),
        ("http://tools.example.com", "Cookie", True),
        ("http://tools.example.com", "X-Trace", False),
        ("http://127.0.0.1:8000", "Authorization", False),
        ("https://tools.example.com", "Authorization", False),
    ],
)
def test_client_default_credentials_over_plain_http(
    invoker_cls: type[ToolInvoker] | type[AsyncToolInvoker],
    base_url: str,
    header: str,
    refused: bool,
) -> None:
    """A client= with a default Authorization or Cookie header obeys the plain-http rule too."""
    headers = {header: "Bearer s3cret-default"}
    client: httpx.Client | httpx.AsyncClient = (
        httpx.Client(headers=headers)
        if invoker_cls is ToolInvoker
        else httpx.AsyncClient(headers=headers)
    )
    try:
        if refused:
            with pytest.raises(InsecureTransport, match=header.lower()) as info:
                invoker_cls(base_url, client=client, hooks=())  # type: ignore[arg-type]
            assert "s3cret-default" not in str(info.value)
        else:
            invoker_cls(base_url, client=client, hooks=())  # type: ignore[arg-type]
    finally:
        if isinstance(client, httpx.AsyncClient):
            asyncio.run(client.aclose())
        else:
            client.close()
