"""End-to-end: every provider against the real loopback identity provider and tool.

Each scenario runs through both drivers (httpx.Client and httpx.AsyncClient).
Token lifetimes run on a fake clock shared by the identity provider and the
providers' policy, so time passes only where a test advances it: a loaded
machine cannot expire a token between two lines of a test.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from joserfc import jwt
from joserfc.jwk import OctKey
from pydantic import SecretStr

from agentkey import DelegationExpired, InsecureTransport, TokenError
from agentkey.auth import (
    ClientAuth,
    ClientCredentials,
    OnBehalfOf,
    RefreshTokenGrant,
    StaticToken,
    TokenExchange,
    TokenPolicy,
)
from agentkey.auth._token_stores import MemoryTokenStore
from agentkey.testing import FakeClock
from tests.auth._idp import ACCESS_TOKEN_TYPE, IdP, Reply
from tests.auth.conftest import (
    CLIENT_ID,
    CLIENT_SECRET,
    JWT_CLIENT,
    PRIVATE_PEM,
    PUBLIC_CLIENT,
    Driver,
)

CLOCK = FakeClock()
FAST = TokenPolicy(
    initial_backoff=0.01,
    max_backoff=0.05,
    max_retry_after=0.05,
    max_attempts=3,
    failure_ttl=0.5,
)


@pytest.fixture(autouse=True)
def _fake_time(idp: IdP) -> None:
    """The identity provider measures token lifetimes on the same fake clock as the providers."""
    idp.clock = CLOCK.monotonic


def _cc(idp: IdP, **kwargs: Any) -> ClientCredentials:
    kwargs.setdefault("policy", FAST)
    kwargs.setdefault("clock", CLOCK)
    return ClientCredentials(idp.url + "/token", CLIENT_ID, CLIENT_SECRET, **kwargs)


def _form(idp: IdP, index: int = -1) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, value in idp.forms[index]:
        out.setdefault(name, []).append(value)
    return out


async def test_client_credentials_reuses_a_fresh_token(idp: IdP, driver: Driver) -> None:
    """Two calls within the token's life make one token request and reach the tool."""
    auth = _cc(idp, scope=["tools.read", "tools.write"], audience="https://tool", resource="r1")
    for _ in range(2):
        response = await driver.request("GET", idp.url + "/tool", auth=auth)
        assert response.status_code == 200
    assert idp.hits["client_credentials"] == 1
    form = _form(idp)
    assert form["scope"] == ["tools.read tools.write"]
    assert form["audience"] == ["https://tool"]
    assert form["resource"] == ["r1"]
    assert "client_secret" not in form  # client_secret_basic puts it in the header
    assert (idp.auth_headers[-1] or "").startswith("Basic ")


@pytest.mark.parametrize("client", [("odd:id/é", "p@ss:w/rd"), (CLIENT_ID, CLIENT_SECRET)])
async def test_basic_auth_is_form_encoded(
    idp: IdP, driver: Driver, client: tuple[str, str]
) -> None:
    """client_secret_basic url-encodes id and secret (RFC 6749 2.3.1), so ':' and '@' survive."""
    auth = ClientCredentials(idp.url + "/token", client[0], client[1], policy=FAST, clock=CLOCK)
    response = await driver.request("GET", idp.url + "/tool", auth=auth)
    assert response.status_code == 200


async def test_client_secret_post(idp: IdP, driver: Driver) -> None:
    """client_secret_post sends id and secret in the form, no Authorization header."""
    auth = ClientCredentials(
        idp.url + "/token",
        client=ClientAuth(CLIENT_ID, CLIENT_SECRET, method="client_secret_post"),
        policy=FAST,
        clock=CLOCK,
    )
    response = await driver.request("GET", idp.url + "/tool", auth=auth)
    assert response.status_code == 200
    form = _form(idp)
    assert form["client_id"] == [CLIENT_ID]
    assert form["client_secret"] == [CLIENT_SECRET]
    assert idp.auth_headers[-1] is None


async def test_private_key_jwt_fresh_jti_and_short_exp(idp: IdP, driver: Driver) -> None:
    """private_key_jwt signs a new assertion per request: fresh jti, exp 60 s after iat."""
    auth = ClientCredentials(
        idp.url + "/token",
        client=ClientAuth(
            JWT_CLIENT, method="private_key_jwt", private_key=PRIVATE_PEM, key_id="k1"
        ),
        policy=FAST,
        clock=CLOCK,
    )
    idp.lifetime = 0.4
    for _ in range(3):
        response = await driver.request("GET", idp.url + "/tool", auth=auth)
        assert response.status_code == 200
        CLOCK.advance(0.25)  # past the refresh point (half of 0.4 s)
    assert idp.hits["client_credentials"] == 3
    assert len(set(idp.jtis)) == 3
    for assertion in idp.assertions:
        header_b64, payload_b64, _ = assertion.split(".")
        payload = json.loads(base64.urlsafe_b64decode(payload_b64 + "=="))
        header = json.loads(base64.urlsafe_b64decode(header_b64 + "=="))
        assert payload["exp"] - payload["iat"] == 60
        assert header["kid"] == "k1"


async def test_refreshes_before_the_call_when_leeway_is_reached(idp: IdP, driver: Driver) -> None:
    """A token past its refresh point is renewed before sending; the tool never sees it expire."""
    idp.lifetime = 1.0
    auth = _cc(idp)
    for _ in range(4):
        response = await driver.request("GET", idp.url + "/tool", auth=auth)
        assert response.status_code == 200
        CLOCK.advance(0.55)
    assert idp.tool_401 == 0
    assert idp.hits["client_credentials"] == 4


async def test_short_lived_token_is_not_refreshed_on_every_call(idp: IdP, driver: Driver) -> None:
    """A 2 s token under a 60 s leeway is still reused (effective leeway capped to a fraction)."""
    auth = _cc(idp, policy=FAST.replace(leeway=60.0))
    for _ in range(10):
        response = await driver.request("GET", idp.url + "/tool", auth=auth)
        assert response.status_code == 200
    assert idp.hits["client_credentials"] == 1


async def test_401_refreshes_once_and_resends_the_same_request(idp: IdP, driver: Driver) -> None:
    """A 401 on the current token refreshes once and resends the same body and Idempotency-Key."""
    auth = _cc(idp)
    await driver.request("GET", idp.url + "/tool", auth=auth)
    idp.force_401 = 1  # the IdP revoked the token behind our back
    key = "plan-1:step_003:" + "a" * 64
    response = await driver.request(
        "POST",
        idp.url + "/tool",
        auth=auth,
        content=b'{"region":"us-east-1"}',
        headers={"Idempotency-Key": key, "Content-Type": "application/json"},
    )
    assert response.status_code == 200
    assert idp.hits["client_credentials"] == 2
    (k1, h1, b1), (k2, h2, b2) = idp.tool_requests[-2:]
    assert k1 == k2 == key
    assert b1 == b2 == b'{"region":"us-east-1"}'
    assert h1 != h2


async def test_second_401_is_handed_back(idp: IdP, driver: Driver) -> None:
    """After one refresh, a second 401 is returned as is (the invoker raises), no loop."""
    auth = _cc(idp)
    idp.force_401 = 5
    response = await driver.request("GET", idp.url + "/tool", auth=auth)
    assert response.status_code == 401
    assert idp.tool_401 == 2
    assert idp.hits["client_credentials"] == 2


async def test_403_never_refreshes(idp: IdP, driver: Driver) -> None:
    """A 403 is about permissions, not the token: no refresh, no resend."""
    auth = _cc(idp)
    response = await driver.request("GET", idp.url + "/forbidden", auth=auth)
    assert response.status_code == 403
    assert idp.tool_403 == 1
    assert idp.hits["client_credentials"] == 1


async def test_5xx_and_429_are_retried_honouring_retry_after(idp: IdP, driver: Driver) -> None:
    """503 and 429 from the token endpoint are retried (Retry-After 0 honoured), then succeed."""
    idp.replies = [
        Reply(503, {"error": "temporarily_unavailable"}, {"Retry-After": "0"}),
        Reply(429, {"error": "slow_down"}, {"Retry-After": "0"}),
    ]
    response = await driver.request("GET", idp.url + "/tool", auth=_cc(idp))
    assert response.status_code == 200
    assert idp.hits["client_credentials"] == 3


@pytest.mark.parametrize("error", ["invalid_client", "invalid_grant", "unauthorized_client"])
async def test_oauth_errors_raise_at_once(idp: IdP, driver: Driver, error: str) -> None:
    """invalid_client / invalid_grant raise TokenError at once, with the endpoint's own words."""
    idp.replies = [Reply(400, {"error": error, "error_description": "nope, said the IdP"})]
    with pytest.raises(TokenError) as info:
        await driver.request("GET", idp.url + "/tool", auth=_cc(idp))
    assert idp.token_requests == 1
    assert info.value.error == error
    assert info.value.error_description == "nope, said the IdP"
    assert info.value.status_code == 400
    assert error in str(info.value)
    assert "nope, said the IdP" in str(info.value)


async def test_wrong_secret_is_invalid_client(idp: IdP, driver: Driver) -> None:
    """A wrong client secret gives the real endpoint's invalid_client, not a generic failure."""
    auth = ClientCredentials(idp.url + "/token", CLIENT_ID, "wrong", policy=FAST, clock=CLOCK)
    with pytest.raises(TokenError) as info:
        await driver.request("GET", idp.url + "/tool", auth=auth)
    assert info.value.error == "invalid_client"
    assert info.value.status_code == 401


async def test_broken_endpoint_gives_up_and_failure_is_remembered(idp: IdP, driver: Driver) -> None:
    """A persistently failing endpoint raises after the attempts; callers right behind fail fast."""
    idp.replies = [Reply(500, None) for _ in range(3)]
    auth = _cc(idp)
    with pytest.raises(TokenError) as info:
        await driver.request("GET", idp.url + "/tool", auth=auth)
    assert info.value.status_code == 500
    assert "3 attempt" in str(info.value)
    assert idp.token_requests == 3
    with pytest.raises(TokenError):
        await driver.request("GET", idp.url + "/tool", auth=auth)
    assert idp.token_requests == 3  # remembered: no new request
    CLOCK.advance(0.6)  # failure_ttl is 0.5 s
    response = await driver.request("GET", idp.url + "/tool", auth=auth)
    assert response.status_code == 200
    assert idp.token_requests == 4


async def test_refresh_token_rotation_is_persisted(idp: IdP, driver: Driver) -> None:
    """A rotated refresh token replaces the old one in the store; the old one is spent."""
    first = idp.grant_refresh_token(PUBLIC_CLIENT)
    store = MemoryTokenStore()
    auth = RefreshTokenGrant(
        idp.url + "/token",
        client=ClientAuth(PUBLIC_CLIENT, method="none"),
        refresh_token=first,
        store=store,
        policy=FAST,
        clock=CLOCK,
    )
    idp.lifetime = 0.4
    seen = []
    for _ in range(3):
        response = await driver.request("GET", idp.url + "/tool", auth=auth)
        assert response.status_code == 200
        stored = store.load(auth.store_key)
        assert stored is not None
        seen.append(stored.get_secret_value())
        CLOCK.advance(0.25)
    assert len(set(seen)) == 3
    assert first not in seen
    assert {first, *seen[:2]} <= idp.spent_refresh
    assert idp.hits["refresh_token"] == 3


async def test_refresh_token_kept_without_rotation(idp: IdP, driver: Driver) -> None:
    """When the endpoint sends no new refresh token, the old one stays in the store."""
    idp.rotate = False
    first = idp.grant_refresh_token(CLIENT_ID)
    store = MemoryTokenStore()
    auth = RefreshTokenGrant(
        idp.url + "/token",
        CLIENT_ID,
        CLIENT_SECRET,
        refresh_token=first,
        store=store,
        policy=FAST,
        clock=CLOCK,
    )
    response = await driver.request("GET", idp.url + "/tool", auth=auth)
    assert response.status_code == 200
    stored = store.load(auth.store_key)
    assert stored is not None
    assert stored.get_secret_value() == first


async def test_stored_refresh_token_wins_over_configured(idp: IdP, driver: Driver) -> None:
    """After a restart, the rotated token in the store is used, not the spent configured one."""
    spent = "rt-already-spent"
    current = idp.grant_refresh_token(PUBLIC_CLIENT)
    store = MemoryTokenStore()
    probe = RefreshTokenGrant(
        idp.url + "/token",
        client=ClientAuth(PUBLIC_CLIENT, method="none"),
        refresh_token=spent,
        store=store,
        policy=FAST,
        clock=CLOCK,
    )
    store.save(probe.store_key, SecretStr(current))
    response = await driver.request("GET", idp.url + "/tool", auth=probe)
    assert response.status_code == 200


async def test_refused_refresh_token_is_delegation_expired(idp: IdP, driver: Driver) -> None:
    """invalid_grant on a refresh token raises DelegationExpired: the user must re-authorise."""
    auth = RefreshTokenGrant(
        idp.url + "/token",
        client=ClientAuth(PUBLIC_CLIENT, method="none"),
        refresh_token="rt-revoked",
        policy=FAST,
        clock=CLOCK,
    )
    with pytest.raises(DelegationExpired) as info:
        await driver.request("GET", idp.url + "/tool", auth=auth)
    assert info.value.error == "invalid_grant"
    assert "authorise" in str(info.value)


def _exchange(idp: IdP, subject: Any, **kwargs: Any) -> TokenExchange:
    kwargs.setdefault("policy", FAST)
    kwargs.setdefault("clock", CLOCK)
    return TokenExchange(
        idp.url + "/token", CLIENT_ID, CLIENT_SECRET, subject_token=subject, **kwargs
    )


async def test_token_exchange_sends_rfc8693_parameters(idp: IdP, driver: Driver) -> None:
    """Token exchange repeats audience and resource and sends actor_token_type with actor_token."""
    auth = _exchange(
        idp,
        idp.user_token(),
        audience=["tool-a", "tool-b"],
        resource=["https://a/", "https://b/"],
        actor_token="agent-actor-token",
        actor_token_type=ACCESS_TOKEN_TYPE,
        scope="read",
    )
    response = await driver.request("GET", idp.url + "/tool", auth=auth)
    assert response.status_code == 200
    form = _form(idp)
    assert form["grant_type"] == ["urn:ietf:params:oauth:grant-type:token-exchange"]
    assert form["audience"] == ["tool-a", "tool-b"]
    assert form["resource"] == ["https://a/", "https://b/"]
    assert form["actor_token"] == ["agent-actor-token"]
    assert form["actor_token_type"] == [ACCESS_TOKEN_TYPE]
    assert form["subject_token_type"] == [ACCESS_TOKEN_TYPE]
    assert "requested_token_type" not in form


async def test_token_exchange_without_actor_sends_no_actor_type(idp: IdP, driver: Driver) -> None:
    """No actor_token means no actor_token_type either."""
    auth = _exchange(idp, idp.user_token, requested_token_type=ACCESS_TOKEN_TYPE)
    response = await driver.request("GET", idp.url + "/tool", auth=auth)
    assert response.status_code == 200
    form = _form(idp)
    assert "actor_token" not in form
    assert "actor_token_type" not in form
    assert form["requested_token_type"] == [ACCESS_TOKEN_TYPE]


async def test_token_exchange_refuses_another_issued_token_type(idp: IdP, driver: Driver) -> None:
    """A present but unexpected issued_token_type is refused instead of being sent to the tool."""
    idp.issued_token_type = "urn:ietf:params:oauth:token-type:id_token"
    with pytest.raises(TokenError, match="issued_token_type") as info:
        await driver.request("GET", idp.url + "/tool", auth=_exchange(idp, idp.user_token()))
    assert "id_token" in str(info.value)
    assert "make the identity provider issue" in str(info.value)
    assert idp.tool_calls == 0
    assert idp.tool_401 == 0


async def test_token_exchange_accepts_a_missing_issued_token_type_for_bearer(
    idp: IdP, driver: Driver, caplog: pytest.LogCaptureFixture
) -> None:
    """An exchange answer without issued_token_type but with token_type Bearer is used (DEBUG)."""
    idp.issued_token_type = None
    with caplog.at_level("DEBUG", logger="agentkey.auth"):
        response = await driver.request(
            "GET", idp.url + "/tool", auth=_exchange(idp, idp.user_token())
        )
    assert response.status_code == 200
    assert idp.tool_calls == 1
    assert "without issued_token_type" in caplog.text


async def test_token_exchange_without_any_token_type_is_refused(idp: IdP, driver: Driver) -> None:
    """Without issued_token_type and without token_type nothing says what was issued: refused."""
    idp.replies = [Reply(200, {"access_token": "at-mystery", "expires_in": 60})]
    with pytest.raises(TokenError, match="neither issued_token_type nor token_type"):
        await driver.request("GET", idp.url + "/tool", auth=_exchange(idp, idp.user_token()))
    assert idp.tool_requests == []


async def test_token_exchange_renews_with_its_refresh_token(idp: IdP, driver: Driver) -> None:
    """A refresh token from the exchange renews the delegation after the user token died."""
    idp.exchange_refresh = True
    idp.lifetime = 0.4
    auth = _exchange(idp, idp.user_token(lifetime=0.3))
    assert (await driver.request("GET", idp.url + "/tool", auth=auth)).status_code == 200
    CLOCK.advance(0.45)  # the user token and the first access token are both gone
    assert (await driver.request("GET", idp.url + "/tool", auth=auth)).status_code == 200
    assert idp.hits["refresh_token"] == 1
    assert idp.hits["urn:ietf:params:oauth:grant-type:token-exchange"] == 1


async def test_expired_subject_token_is_delegation_expired(idp: IdP, driver: Driver) -> None:
    """An expired user token with nothing to renew raises DelegationExpired: re-authorise."""
    idp.lifetime = 0.3
    auth = _exchange(idp, idp.user_token(lifetime=0.3))
    assert (await driver.request("GET", idp.url + "/tool", auth=auth)).status_code == 200
    CLOCK.advance(0.35)
    with pytest.raises(DelegationExpired) as info:
        await driver.request("GET", idp.url + "/tool", auth=auth)
    assert "authorise the agent again" in str(info.value)
    assert info.value.error == "invalid_grant"


async def test_expired_jwt_subject_is_caught_before_the_request(idp: IdP, driver: Driver) -> None:
    """A user JWT whose exp has passed raises DelegationExpired without asking the endpoint."""
    key = OctKey.generate_key(256)
    expired = jwt.encode({"alg": "HS256"}, {"sub": "u1", "exp": int(CLOCK.time()) - 5}, key)
    with pytest.raises(DelegationExpired, match="authorise"):
        await driver.request("GET", idp.url + "/tool", auth=_exchange(idp, expired))
    assert idp.token_requests == 0


async def test_on_behalf_of_uses_entra_parameters(idp: IdP, driver: Driver) -> None:
    """OnBehalfOf sends the jwt-bearer grant with requested_token_use=on_behalf_of and the scope."""
    user = idp.user_token()
    auth = OnBehalfOf(
        idp.url + "/token",
        CLIENT_ID,
        CLIENT_SECRET,
        user_token=lambda: user,
        scope="api://tool/.default",
        policy=FAST,
        clock=CLOCK,
    )
    response = await driver.request("GET", idp.url + "/tool", auth=auth)
    assert response.status_code == 200
    form = _form(idp)
    assert form["grant_type"] == ["urn:ietf:params:oauth:grant-type:jwt-bearer"]
    assert form["requested_token_use"] == ["on_behalf_of"]
    assert form["assertion"] == [user]
    assert form["scope"] == ["api://tool/.default"]
    assert form["client_secret"] == [CLIENT_SECRET]


@pytest.mark.parametrize("error", ["invalid_grant", "interaction_required"])
async def test_on_behalf_of_user_must_sign_in_again(idp: IdP, driver: Driver, error: str) -> None:
    """Entra's invalid_grant / interaction_required become DelegationExpired."""
    idp.replies = [Reply(400, {"error": error, "error_description": "AADSTS50013"})]
    auth = OnBehalfOf(
        idp.url + "/token",
        CLIENT_ID,
        CLIENT_SECRET,
        user_token=idp.user_token(),
        scope="api://tool/.default",
        policy=FAST,
        clock=CLOCK,
    )
    with pytest.raises(DelegationExpired) as info:
        await driver.request("GET", idp.url + "/tool", auth=auth)
    assert info.value.error == error


async def test_static_token_hands_back_401(idp: IdP, driver: Driver) -> None:
    """StaticToken sends its token and returns a 401 untouched: nothing can renew it."""
    response = await driver.request("GET", idp.url + "/tool", auth=StaticToken("at-unknown"))
    assert response.status_code == 401
    assert idp.tool_401 == 1
    assert idp.tool_requests[-1][1] == "Bearer at-unknown"


@pytest.mark.parametrize(
    "url", ["http://tool.example.com/run", "http://10.0.0.8/run", "http://[2001:db8::1]/x"]
)
async def test_no_bearer_over_plain_http(idp: IdP, driver: Driver, url: str) -> None:
    """A bearer token is never attached over http:// to a non-loopback host; nothing is fetched."""
    with pytest.raises(InsecureTransport):
        await driver.request("GET", url, auth=_cc(idp))
    with pytest.raises(InsecureTransport):
        await driver.request("GET", url, auth=StaticToken("tok"))
    assert idp.token_requests == 0


async def test_token_endpoint_timeouts_are_retried_then_reported(idp: IdP, driver: Driver) -> None:
    """A token endpoint slower than the timeout is retried, then reported as timed out."""
    idp.delay = 0.5
    auth = _cc(idp, policy=FAST.replace(timeout=0.1, max_attempts=2))
    with pytest.raises(TokenError, match="timed out") as info:
        await driver.request("GET", idp.url + "/tool", auth=auth)
    assert "2 attempt" in str(info.value)
    assert idp.token_requests == 2


async def test_unreachable_token_endpoint(driver: Driver) -> None:
    """A token endpoint nobody listens on is retried, then reported as unreachable."""
    from tests._loopback import free_port

    url = f"http://127.0.0.1:{free_port()}/token"
    auth = ClientCredentials(
        url, CLIENT_ID, CLIENT_SECRET, policy=FAST.replace(max_attempts=2), clock=CLOCK
    )
    with pytest.raises(TokenError, match="could not be reached"):
        await driver.request("GET", "http://127.0.0.1:9/tool", auth=auth)


@pytest.mark.parametrize(
    ("retry_after", "expected"),
    [("0", "0.00"), ("5", "0.05"), ("Wed, 21 Oct 2015 07:28:00 GMT", "0.00")],
)
async def test_retry_after_is_honoured_and_capped(
    idp: IdP, driver: Driver, caplog: pytest.LogCaptureFixture, retry_after: str, expected: str
) -> None:
    """The wait is the endpoint's Retry-After (a date in the past means now), capped by max_wait."""
    idp.replies = [Reply(503, {"error": "busy"}, {"Retry-After": retry_after})]
    with caplog.at_level("WARNING", logger="agentkey.auth"):
        response = await driver.request("GET", idp.url + "/tool", auth=_cc(idp))
    assert response.status_code == 200
    assert f"retried in {expected} s" in caplog.text


async def test_failed_early_renewal_keeps_the_still_valid_token(
    idp: IdP, driver: Driver, caplog: pytest.LogCaptureFixture
) -> None:
    """A failed early renewal leaves calls on the unexpired token, until it nears expiry."""
    auth = _cc(idp, policy=FAST.replace(max_attempts=1, failure_ttl=30.0))
    assert (await driver.request("GET", idp.url + "/tool", auth=auth)).status_code == 200
    CLOCK.advance(1.1)  # the 2 s token is due (half its life) but valid for 0.9 s more
    idp.replies = [Reply(503, {"error": "down"})]
    with caplog.at_level("WARNING", logger="agentkey.auth"):
        response = await driver.request("GET", idp.url + "/tool", auth=auth)
        assert response.status_code == 200
        assert (await driver.request("GET", idp.url + "/tool", auth=auth)).status_code == 200
    assert "stays in use" in caplog.text
    assert idp.token_requests == 2  # the failure is remembered: the second call did not retry
    CLOCK.advance(0.8)  # now less than the safety margin remains
    with pytest.raises(TokenError):
        await driver.request("GET", idp.url + "/tool", auth=auth)


async def test_token_never_follows_a_redirect_to_another_origin(idp: IdP, driver: Driver) -> None:
    """A redirect to another origin arrives there without the bearer token."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from tests._loopback import serve

    seen: list[str | None] = []

    async def record(request: Request) -> Response:
        seen.append(request.headers.get("authorization"))
        return JSONResponse({"ok": True})

    other = Starlette(routes=[Route("/landing", record)])
    with serve(other) as other_url:
        response = await driver.request(
            "GET",
            idp.url + "/bounce",
            auth=_cc(idp),
            params={"to": other_url + "/landing"},
            follow_redirects=True,
        )
    assert response.status_code == 200
    assert seen == [None]
    assert idp.token_requests == 1  # the token was fetched, and sent to the first origin only


async def test_a_tool_that_rejects_every_token_does_not_hammer_the_idp(
    idp: IdP, driver: Driver
) -> None:
    """50 calls to a tool answering 401 cost 2 token requests, then 1 per rejection_interval."""
    idp.lifetime = 3600.0
    idp.force_401 = 10_000
    auth = _cc(idp)  # TokenPolicy.rejection_interval: 10 s by default
    for _ in range(50):
        response = await driver.request("GET", idp.url + "/tool", auth=auth)
        assert response.status_code == 401
    assert idp.hits["client_credentials"] == 2  # the first token, one refresh after a 401
    assert idp.tool_401 == 51  # each call sent once; the first also resent with the new token
    CLOCK.advance(10.0)
    await driver.request("GET", idp.url + "/tool", auth=auth)
    assert idp.hits["client_credentials"] == 3  # the interval passed: one refresh more
