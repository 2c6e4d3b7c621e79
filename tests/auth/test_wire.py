"""Token requests on the wire: the pure exchange, the provider's client, hooks, extension kit."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

import agentkey.auth
from agentkey import ConfigurationError, TokenError
from agentkey.auth import (
    ClientCredentials,
    OAuthProvider,
    Token,
    TokenEvent,
    TokenPolicy,
    TokenRequest,
)
from agentkey.auth._endpoint import ClientAuth, Note, TokenEndpoint
from agentkey.client._drive import run_sync
from agentkey.client._effects import Emit, Outgoing, Sleep
from agentkey.client._protocol import Answer, Failure, FailureKind, Received
from agentkey.testing import FakeClock
from tests._loopback import serve
from tests.auth._idp import IdP
from tests.auth._idp import Reply as IdPReply
from tests.auth.conftest import CLIENT_ID, CLIENT_SECRET, Driver
from tests.wire._drip import dripping_app

URL = "https://idp.example/token"
GOOD = Answer(200, {}, b'{"access_token": "at", "token_type": "Bearer", "expires_in": 60}', URL)
BUSY = Answer(503, {}, b"", URL)


@dataclass(frozen=True)
class Attempt:
    """A token request the exchange yielded, and the seconds it was given (on the clock)."""

    outgoing: Outgoing
    seconds: float


def _run(endpoint: TokenEndpoint, replies: list[Received], clock: FakeClock) -> list[object]:
    """Run ``endpoint.exchange`` on the shared driver: scripted replies, waits pass on ``clock``.

    Returns each request (an Attempt), each Sleep, and the Token at the end; events
    and log notes are left out.
    """
    effects: list[object] = []

    def carry(effect: object) -> object:
        if isinstance(effect, Emit):
            return None
        effects.append(effect)
        if isinstance(effect, Outgoing):
            assert effect.deadline is not None
            effects[-1] = Attempt(effect, effect.deadline - clock.monotonic())
            return replies.pop(0)
        assert isinstance(effect, Sleep)
        clock.advance(effect.seconds)
        return None

    flow = endpoint.exchange(
        TokenRequest("client_credentials"), clock=clock.monotonic, rng=lambda: 0.5, wall=lambda: 0.0
    )
    effects.append(run_sync(flow, carry))
    return effects


def _endpoint(**policy: Any) -> TokenEndpoint:
    client = ClientAuth("c", method="none")
    return TokenEndpoint(URL, client, policy=TokenPolicy(jitter=False, **policy))


def test_exchange_waits_follow_the_policy_schedule() -> None:
    """Waits between token attempts are TokenPolicy.schedule's, on the injected clock."""
    clock = FakeClock()
    endpoint = _endpoint(initial_backoff=0.5, backoff_multiplier=3.0)
    effects = _run(endpoint, [BUSY, Failure(FailureKind.NOT_SENT, "ConnectError"), GOOD], clock)
    waits = [e.seconds for e in effects if isinstance(e, Sleep)]
    assert waits == [endpoint.policy.schedule.delay(1), endpoint.policy.schedule.delay(2)]
    assert waits == [0.5, 1.5]
    assert isinstance(effects[-1], Token)
    assert effects[-1].obtained_at == 1002.0  # sent after both waits had passed on the clock


def test_exchange_honours_retry_after_capped_by_max_retry_after() -> None:
    """A Retry-After of 30 s waits max_retry_after (2 s), not the formula and not 30 s."""
    clock = FakeClock()
    slow = Answer(429, {"retry-after": "30"}, b"", URL)
    effects = _run(_endpoint(max_retry_after=2.0), [slow, GOOD], clock)
    assert [e.seconds for e in effects if isinstance(e, Sleep)] == [2.0]


def test_exchange_gives_up_when_the_next_wait_passes_the_deadline() -> None:
    """With 0.4 s of the deadline left and 1.2 s to wait, it stops after 2 attempts."""
    clock = FakeClock()
    endpoint = _endpoint(deadline=1.0, initial_backoff=0.6, max_attempts=10)
    with pytest.raises(TokenError, match=r"answered 503\) after 2 attempt\(s\)") as info:
        _run(endpoint, [BUSY, BUSY, GOOD], clock)
    assert info.value.status_code == 503


def test_each_attempt_may_take_the_timeout_cut_to_the_deadline() -> None:
    """An attempt gets TokenPolicy.timeout, or less when the deadline is nearer."""
    clock = FakeClock()
    endpoint = _endpoint(deadline=3.0, timeout=2.0, initial_backoff=1.5, max_backoff=1.5)
    effects = _run(endpoint, [BUSY, GOOD], clock)
    assert [e.seconds for e in effects if isinstance(e, Attempt)] == [2.0, 1.5]


def test_the_token_request_is_sent_bare() -> None:
    """The attempt bypasses client defaults and cookies and carries the form and client auth."""
    clock = FakeClock()
    (attempt, *_) = _run(_endpoint(), [GOOD], clock)
    assert isinstance(attempt, Attempt)
    out = attempt.outgoing
    assert (out.method, out.url, out.same_origin) == ("POST", URL, False)
    assert out.content == b"grant_type=client_credentials&client_id=c"


def test_an_oversized_token_answer_is_refused() -> None:
    """A token answer over 1 MiB (read and cut by _http) is a TokenError, not a token."""
    clock = FakeClock()
    huge = Answer(200, {}, b"", URL, oversize=True)
    with pytest.raises(TokenError, match="body over 1048576 bytes"):
        _run(_endpoint(), [huge], clock)


def _emitted(
    endpoint: TokenEndpoint,
    replies: list[Received | BaseException],
    *,
    rng: float = 0.5,
    wall: float = 0.0,
) -> tuple[list[object], list[float], Token | BaseException]:
    """Run the exchange on the shared driver: what it emitted, what it slept, how it ended.

    A reply that is an exception is raised by the driver when it sends that request.
    """
    emitted: list[object] = []
    slept: list[float] = []

    def carry(effect: object) -> object:
        if isinstance(effect, Emit):
            emitted.append(effect.event)
            return None
        if isinstance(effect, Sleep):
            slept.append(effect.seconds)
            return None
        assert isinstance(effect, Outgoing)
        reply = replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    request = TokenRequest("client_credentials")
    flow = endpoint.exchange(request, clock=lambda: 0.0, rng=lambda: rng, wall=lambda: wall)
    try:
        return emitted, slept, run_sync(flow, carry)
    except (TokenError, RuntimeError) as exc:
        return emitted, slept, exc


def test_the_exchange_emits_its_events_and_log_lines_and_runs_no_hook() -> None:
    """Start and end events and the retry's log line are Emit effects the driver carries out."""
    emitted, slept, token = _emitted(_endpoint(initial_backoff=0.5), [BUSY, GOOD])
    assert isinstance(token, Token)
    origin = "https://idp.example:443"
    assert emitted[0] == TokenEvent("start", "client_credentials", origin, 0)
    assert emitted[1] == Note("warning", f"token endpoint {URL} answered 503; token request "
                              "retried in 0.50 s")  # fmt: skip
    assert isinstance(emitted[2], Note)
    assert emitted[2].text.startswith("token obtained with the client_credentials grant")
    assert emitted[3] == TokenEvent("end", "client_credentials", origin, 2)
    assert slept == [0.5]


def test_a_failure_the_driver_throws_in_ends_the_request_with_an_end_event() -> None:
    """A send that raises (thrown into the flow) is reported in the end event, then re-raised."""
    emitted, _, ended = _emitted(_endpoint(), [BUSY, RuntimeError("boom")])
    assert isinstance(ended, RuntimeError)
    assert emitted[-1] == TokenEvent(
        "end", "client_credentials", "https://idp.example:443", 2, "RuntimeError"
    )


def test_jitter_and_retry_after_dates_come_from_the_injected_sources() -> None:
    """The jitter draw is the injected rng's; a Retry-After date counts from the injected wall."""
    jittered = TokenPolicy(jitter=True, initial_backoff=1.0)
    endpoint = TokenEndpoint(URL, ClientAuth("c", method="none"), policy=jittered)
    _, slept, _ = _emitted(endpoint, [BUSY, GOOD], rng=0.25)
    assert slept == [0.25]
    dated = Answer(503, {"retry-after": "Thu, 01 Jan 1970 00:00:03 GMT"}, b"", URL)
    _, slept, _ = _emitted(_endpoint(), [dated, GOOD], wall=1.0)
    assert slept == [2.0]


def _cc(idp: IdP, **kwargs: Any) -> ClientCredentials:
    kwargs.setdefault("policy", TokenPolicy(max_attempts=3))
    return ClientCredentials(idp.url + "/token", CLIENT_ID, CLIENT_SECRET, **kwargs)


def test_one_client_serves_every_token_request(idp: IdP, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three refreshes open one HTTP client, owned by the provider and closed by close()."""
    opened: list[httpx.Client] = []
    real_init = httpx.Client.__init__

    def counting_init(self: httpx.Client, *args: Any, **kwargs: Any) -> None:
        opened.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(httpx.Client, "__init__", counting_init)
    with _cc(idp) as auth:
        for _ in range(3):
            auth.invalidate()
            assert auth.get_token()
    assert idp.hits["client_credentials"] == 3
    assert len(opened) == 1
    assert opened[0].is_closed


def test_async_token_client_serves_any_event_loop(idp: IdP) -> None:
    """One provider obtains tokens from two event loops in turn (asyncio.run twice)."""
    auth = _cc(idp)
    for _ in range(2):
        auth.invalidate()
        assert asyncio.run(auth.aget_token())
    asyncio.run(auth.aclose())
    assert idp.hits["client_credentials"] == 2


async def test_aclose_releases_and_a_later_request_reopens(idp: IdP) -> None:
    """After aclose() the provider still works: a later token request opens a new client."""
    async with _cc(idp) as auth:
        assert await auth.aget_token()
    auth.invalidate()
    assert await auth.aget_token()
    await auth.aclose()
    assert idp.hits["client_credentials"] == 2


def test_token_requests_are_reported_to_hooks(idp: IdP) -> None:
    """Hooks see start and end of each token request, with attempts and error, never a secret."""
    events: list[TokenEvent] = []
    clock = FakeClock()
    idp.clock = clock.monotonic
    policy = TokenPolicy(max_attempts=2, jitter=False, initial_backoff=0.25)
    auth = _cc(idp, hooks=[events.append], policy=policy, clock=clock)
    origin = idp.url  # scheme://host:port, as the event gives it
    idp.replies = [IdPReply(503, {"error": "busy"})]
    token = auth.get_token()
    assert clock.sleeps == [0.25]  # the schedule's wait, on the provider's clock
    assert events == [
        TokenEvent("start", "client_credentials", origin, 0),
        TokenEvent("end", "client_credentials", origin, 2),
    ]
    idp.replies = [IdPReply(400, {"error": "invalid_client"})]
    auth.invalidate()
    with pytest.raises(TokenError):
        auth.get_token()
    assert events[-1] == TokenEvent("end", "client_credentials", origin, 1, "TokenError")
    shown = repr(events)
    assert token not in shown
    assert CLIENT_SECRET not in shown
    auth.close()


@pytest.mark.parametrize("hooks", [print, [1], "hook"])
def test_hooks_must_be_a_sequence_of_callables(idp: IdP, hooks: Any) -> None:
    """hooks= takes a list of callables; anything else is a ConfigurationError at construction."""
    with pytest.raises(ConfigurationError, match="hooks"):
        _cc(idp, hooks=hooks)


def test_a_dripping_token_endpoint_is_cut_at_the_timeout() -> None:
    """A token answer dripping one byte per 100 ms ends at TokenPolicy.timeout, as timed out
    (read to its end, 10 s later, it would be a token answer without token_type)."""
    policy = TokenPolicy(timeout=0.5, max_attempts=1)
    with serve(dripping_app()) as url:
        auth = ClientCredentials(url + "/token", CLIENT_ID, CLIENT_SECRET, policy=policy)
        with pytest.raises(TokenError, match="timed out"):
            auth.get_token()
        auth.close()


class PerAudience(OAuthProvider):
    """A user's provider built from public names only: one token per audience it is told."""

    def __init__(self, token_url: str, client_id: str, client_secret: str, **kwargs: Any):
        super().__init__(token_url, client_id, client_secret, **kwargs)
        self.audience = "https://tool-a"

    def token_request(self, current: Token | None) -> TokenRequest:
        return TokenRequest("client_credentials", (("audience", SecretStr(self.audience)),))


async def test_a_user_subclass_with_public_names_works(idp: IdP, driver: Driver) -> None:
    """Subclassing OAuthProvider with token_request() gets the whole flow: auth, refresh, 401."""
    assert {"OAuthProvider", "Token", "TokenRequest", "TokenEvent"} <= set(agentkey.auth.__all__)
    auth = PerAudience(idp.url + "/token", CLIENT_ID, CLIENT_SECRET)
    assert (await driver.request("GET", idp.url + "/tool", auth=auth)).status_code == 200
    idp.force_401 = 1  # the tool refuses the token: the subclass's request renews it
    auth.audience = "https://tool-b"
    assert (await driver.request("GET", idp.url + "/tool", auth=auth)).status_code == 200
    assert [dict(form)["audience"] for form in idp.forms] == ["https://tool-a", "https://tool-b"]
    await auth.aclose()
