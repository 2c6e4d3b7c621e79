"""agentkey's middleware speaks the dialects other clients expect, on a real Redis.

Three peer suites expect another replay header name, the IETF draft's syntax lets a
key carry RFC 8941 parameters, and the draft suggests a ``Link`` to documentation on
its error answers. A plain client sends each request; the tool counts executions.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import uuid

import httpx
import pytest

from agentkey import ConfigurationError, PlanSession, ToolResult
from agentkey.server import ServerOptions
from agentkey.server._decide import PROBLEM_DOCS
from tests._loopback import RedisServer

from ._support import invoke_all, serve_agentkey

pytestmark = pytest.mark.redis

BODY = json.dumps({"amount": 5}).encode()


def post(client: httpx.Client, key: str | None, body: bytes = BODY) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["idempotency-key"] = key
    return client.post("/tools/charge", content=body, headers=headers)


@pytest.mark.parametrize("name", ["Idempotency-Replayed", "X-Idempotent-Replayed"])
def test_replay_header_name_is_configurable(redis_proc: RedisServer, name: str) -> None:
    """replay_header= names the header a replay carries; agentkey's client reads it too."""
    step = PlanSession.new().step(0, "charge", {"amount": 5})
    with serve_agentkey(redis_proc, replay_header=name) as served:
        with httpx.Client(base_url=served.url, timeout=10) as client:
            key = str(uuid.uuid4())
            first, again = post(client, key), post(client, key)
        results = invoke_all("sync", served.url, [step, step], replay_headers=(name,))
    assert first.status_code == again.status_code == 201
    assert name.lower() not in first.headers
    assert again.headers[name] == "true"
    assert "idempotent-replayed" not in again.headers or name == "Idempotent-Replayed"
    assert again.json() == first.json()
    assert sorted(bool(getattr(r, "replayed", None)) for r in results) == [False, True]
    assert all(isinstance(r, ToolResult) for r in results)
    assert served.tool.executions() == 2  # one per key: the UUID's and the step's


@pytest.mark.parametrize("name", ["", "Bad Name", "X:Y", 3])
def test_a_bad_replay_header_name_is_refused(name: object) -> None:
    """A replay_header that is no header name is a ConfigurationError at start."""
    with pytest.raises(ConfigurationError, match="replay_header"):
        ServerOptions(replay_header=name)  # type: ignore[arg-type]


def test_an_sf_item_with_parameters_is_the_same_key(redis_proc: RedisServer) -> None:
    """`"k";x=1` (an RFC 8941 Item with parameters) names the key k: replayed, run once."""
    key = str(uuid.uuid4())
    with (
        serve_agentkey(redis_proc) as served,
        httpx.Client(base_url=served.url, timeout=10) as client,
    ):
        answers = [post(client, form) for form in (key, f'"{key}";x=1', f'"{key}";a;b=?0')]
        broken = post(client, f'"{key}"junk')
    assert [a.status_code for a in answers] == [201, 201, 201]
    assert [a.headers.get("idempotent-replayed") for a in answers] == [None, "true", "true"]
    assert broken.status_code == 400
    assert served.tool.executions() == 1


def test_errors_link_to_the_documentation(redis_proc: RedisServer) -> None:
    """400, 409 and 422 carry `Link: <docs>; rel="describedby"`; a 2xx does not."""
    key = str(uuid.uuid4())
    with serve_agentkey(redis_proc) as served:
        gate = served.tool.gates["charge"] = threading.Event()
        with httpx.Client(base_url=served.url, timeout=10) as client:
            missing = post(client, None)
            with (
                httpx.Client(base_url=served.url, timeout=10) as other,
                concurrent.futures.ThreadPoolExecutor(1) as pool,
            ):
                first = pool.submit(post, other, key)
                assert served.tool.entered("charge").wait(10)
                in_flight = post(client, key)
                gate.set()
                done = first.result(timeout=10)
            mismatch = post(client, key, json.dumps({"amount": 6}).encode())
    link = f'<{PROBLEM_DOCS}>; rel="describedby"; type="text/html"'
    assert (missing.status_code, missing.headers["link"]) == (400, link)
    assert (in_flight.status_code, in_flight.headers["link"]) == (409, link)
    assert (mismatch.status_code, mismatch.headers["link"]) == (422, link)
    assert done.status_code == 201
    assert "link" not in done.headers
    assert served.tool.executions() == 1
