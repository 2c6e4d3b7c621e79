"""I/O-free parts of auth: refresh arithmetic, answer parsing, loopback rules, option checks."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import SecretStr

from agentkey import ConfigurationError, InsecureTransport, TokenError
from agentkey.auth import (
    ClientCredentials,
    OnBehalfOf,
    RefreshTokenGrant,
    StaticToken,
    TokenExchange,
    TokenPolicy,
)
from agentkey.auth._endpoint import (
    ClientAuth,
    TokenEndpoint,
    TokenRequest,
    _Retryable,
)
from agentkey.auth._token import jwt_expired, refresh_deadline
from agentkey.client._protocol import Answer

URL = "https://idp.example/oauth2/token"


@given(
    lifetime=st.floats(min_value=0.001, max_value=1e7),
    leeway=st.floats(min_value=0, max_value=1e5),
    fraction=st.floats(min_value=0.01, max_value=0.99),
    jitter=st.floats(min_value=0, max_value=1),
    rand=st.floats(min_value=0, max_value=0.999),
)
def test_refresh_point_lies_inside_the_lifetime(
    lifetime: float, leeway: float, fraction: float, jitter: float, rand: float
) -> None:
    """The refresh point is after issue (no refresh loop) and no later than leeway before expiry."""
    at = refresh_deadline(
        100.0, lifetime, leeway=leeway, lifetime_fraction=fraction, jitter=jitter, rand=rand
    )
    assert at is not None
    assert at > 100.0  # a freshly issued token is never already due
    assert at >= 100.0 + (1 - fraction) * lifetime - 1e-6
    assert at <= 100.0 + lifetime - min(leeway, fraction * lifetime) + 1e-6


def test_short_token_uses_half_its_life_and_long_token_the_leeway() -> None:
    """A 2 s token is due after 1 s; a 1 h token is due 60 s (plus jitter) before expiry."""
    kw: dict[str, Any] = {"leeway": 60.0, "lifetime_fraction": 0.5, "jitter": 0.1, "rand": 0.0}
    assert refresh_deadline(0.0, 2.0, **kw) == 1.0
    assert refresh_deadline(0.0, 60.0, **kw) == 30.0
    assert refresh_deadline(0.0, 3600.0, **kw) == 3540.0
    assert refresh_deadline(0.0, 3600.0, **{**kw, "rand": 0.5}) == pytest.approx(3537.0)
    assert refresh_deadline(0.0, None, **kw) is None


def _jwt(claims: dict[str, Any]) -> str:
    def part(obj: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")

    return f"{part({'alg': 'none'})}.{part(claims)}.sig"


@pytest.mark.parametrize(
    ("token", "expired"),
    [
        (_jwt({"exp": 1000}), True),
        (_jwt({"exp": 3000}), False),
        (_jwt({"sub": "no exp"}), False),
        (_jwt({"exp": "soon"}), False),
        (_jwt({"exp": True}), False),
        ("opaque-token", False),
        ("a.!!!.c", False),
    ],
)
def test_jwt_expired(token: str, expired: bool) -> None:
    """Only a readable JWT with an exp in the past counts as expired; the rest is the IdP's call."""
    assert jwt_expired(token, now=2000.0) is expired


def _endpoint(**policy: Any) -> TokenEndpoint:
    client = ClientAuth("c", method="none")
    return TokenEndpoint(URL, client, policy=TokenPolicy(**policy))


def _answer(status: int, body: object, headers: dict[str, str] | None = None) -> Answer:
    lowered = {name.lower(): value for name, value in (headers or {}).items()}
    return Answer(status, lowered, json.dumps(body).encode(), URL)


def test_interpret_success() -> None:
    """A good answer becomes a Token timed from when the request was sent."""
    endpoint = _endpoint()
    token = endpoint.interpret(
        TokenRequest("client_credentials"),
        _answer(
            200,
            {"access_token": "at", "token_type": "bearer", "expires_in": "120", "scope": "a b"},
        ),
        sent_at=50.0,
    )
    assert token.access_token.get_secret_value() == "at"
    assert token.lifetime == 120.0
    assert token.expires_at == 170.0
    assert token.scope == "a b"
    assert token.refresh_at is not None
    assert 50.0 + 120 - 66 <= token.refresh_at <= 50.0 + 120 - 60


@given(st.one_of(st.integers(max_value=-1), st.just("soon"), st.just(float("inf")), st.booleans()))
def test_interpret_rejects_unusable_expires_in(value: object) -> None:
    """A negative, infinite or non-numeric expires_in is an error, not an eternal token."""
    answer = _answer(200, {"access_token": "at", "expires_in": value})
    with pytest.raises(TokenError, match="expires_in"):
        _endpoint().interpret(TokenRequest("client_credentials"), answer, 0.0)


@pytest.mark.parametrize(
    ("status", "body", "match"),
    [
        (200, {"token_type": "bearer"}, "without an access_token"),
        (200, ["not", "an", "object"], "no JSON object"),
        (200, {"access_token": "at", "token_type": "mac"}, "Bearer tokens only"),
        (400, {"error": "invalid_scope"}, "invalid_scope"),
        (403, "plain text", "no OAuth error code"),
    ],
)
def test_interpret_errors(status: int, body: object, match: str) -> None:
    """Malformed or refused answers raise TokenError with a message saying what to fix."""
    with pytest.raises(TokenError, match=match):
        _endpoint().interpret(TokenRequest("client_credentials"), _answer(status, body), 0.0)


@pytest.mark.parametrize(("status", "retry_after"), [(429, "3"), (500, None), (503, "soon")])
def test_interpret_marks_retryable(status: int, retry_after: str | None) -> None:
    """429 and 5xx are retryable; a usable Retry-After is carried to the wait."""
    headers = {"Retry-After": retry_after} if retry_after else {}
    with pytest.raises(_Retryable) as info:
        _endpoint().interpret(TokenRequest("x"), _answer(status, {}, headers), 0.0)
    assert info.value.retry_after == (3.0 if retry_after == "3" else None)


def test_error_description_is_flattened_and_capped() -> None:
    """An endpoint's error_description cannot inject lines or flood the message."""
    body = {"error": "invalid_grant", "error_description": "line1\nline2" + "x" * 1000}
    with pytest.raises(TokenError) as info:
        _endpoint().interpret(TokenRequest("x"), _answer(400, body), 0.0)
    assert "\n" not in str(info.value)
    assert info.value.error_description is not None
    assert len(info.value.error_description) == 300


def test_issued_token_type_checked() -> None:
    """A token exchange answer must name one of the expected issued token types."""
    request = TokenRequest(
        "x", expect_issued_token_type=frozenset({TokenExchange.ACCESS_TOKEN_TYPE})
    )
    good = {"access_token": "at", "issued_token_type": TokenExchange.ACCESS_TOKEN_TYPE}
    assert _endpoint().interpret(request, _answer(200, good), 0.0).issued_token_type
    with pytest.raises(TokenError, match="issued_token_type"):
        _endpoint().interpret(request, _answer(200, {"access_token": "at"}), 0.0)


@pytest.mark.parametrize(
    "make",
    [
        lambda: ClientCredentials("http://idp.example/token", "c", "s"),
        lambda: RefreshTokenGrant(
            "http://10.1.1.1/token", client=ClientAuth("c", method="none"), refresh_token="r"
        ),
    ],
)
def test_token_url_must_be_https_unless_loopback(make: Any) -> None:
    """Client secrets are never configured to travel over plain http to another host."""
    with pytest.raises(InsecureTransport):
        make()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"client_id": ""}, "client_id"),
        ({"client_secret": None}, "without client_secret"),
        ({"client_id": None}, "needs the client's authentication"),
        ({"client": ClientAuth("c", "s")}, "not both"),
        ({"scope": ["a b"]}, "scope"),
        ({"resource": [""]}, "resource"),
        ({"token_url": "ftp://idp.example/token"}, "http"),
        ({"token_url": "https://user:pw@idp.example/token"}, "credentials"),
    ],
)
def test_client_credentials_option_errors(kwargs: dict[str, Any], match: str) -> None:
    """Bad options fail at construction with ConfigurationError naming the option."""
    base: dict[str, Any] = {"token_url": URL, "client_id": "c", "client_secret": "s"}
    with pytest.raises(ConfigurationError, match=match) as info:
        ClientCredentials(**{**base, **kwargs})
    assert "junk" not in str(info.value)


def test_delegation_option_errors() -> None:
    """actor_token and actor_token_type go together; OBO needs a scope; subjects are required."""
    with pytest.raises(ConfigurationError, match="actor_token"):
        TokenExchange(URL, "c", "s", subject_token="u", actor_token="a")
    with pytest.raises(ConfigurationError, match="actor_token"):
        TokenExchange(
            URL, "c", "s", subject_token="u", actor_token_type=TokenExchange.ACCESS_TOKEN_TYPE
        )
    with pytest.raises(ConfigurationError, match="subject_token"):
        TokenExchange(URL, "c", "s", subject_token="")
    with pytest.raises(ConfigurationError, match="scope"):
        OnBehalfOf(URL, "c", "s", user_token="u", scope=[])
    with pytest.raises(ConfigurationError, match="refresh_token"):
        RefreshTokenGrant(URL, "c", "s")
    with pytest.raises(ConfigurationError, match="token"):
        StaticToken("")


@pytest.mark.parametrize(
    "changes",
    [
        {"leeway": -1.0},
        {"lifetime_fraction": 1.0},
        {"lifetime_fraction": 0.0},
        {"max_attempts": 0},
        {"timeout": 0.0},
        {"deadline": float("inf")},
        {"failure_ttl": float("nan")},
        {"leeway": "60"},
        {"leeway": True},
        {"lifetime_fraction": "0.5"},
        {"timeout": None},
        {"initial_backoff": [1]},
    ],
)
def test_policy_validation(changes: dict[str, Any]) -> None:
    """TokenPolicy refuses values that would loop, never stop or never retry."""
    with pytest.raises(ConfigurationError):
        TokenPolicy(**changes)
    with pytest.raises(ConfigurationError):
        TokenPolicy().replace(**changes)


def test_policy_is_frozen() -> None:
    """A policy cannot be changed in place; replace() makes a variant."""
    policy = TokenPolicy()
    with pytest.raises(AttributeError):
        policy.leeway = 1.0  # type: ignore[misc]
    assert policy.replace(leeway=5.0).leeway == 5.0
    assert policy.leeway == 60.0


def test_policy_replace_unknown_option() -> None:
    """replace() with a misspelt option is a ConfigurationError listing the valid ones."""
    with pytest.raises(ConfigurationError, match=r"no option.*leway.*valid options: backoff_mul"):
        TokenPolicy().replace(leway=5.0)


def test_provider_needs_a_token_policy() -> None:
    """A provider given something other than a TokenPolicy says so with a ConfigurationError."""
    with pytest.raises(ConfigurationError, match="TokenPolicy"):
        ClientCredentials(URL, "c", "s", policy={"leeway": 5})  # type: ignore[arg-type]


def test_build_post_and_basic_bodies() -> None:
    """The form body carries the grant; client_secret_basic moves the secret to the header."""
    basic = TokenEndpoint(
        URL,
        ClientAuth("c", SecretStr("s")),
        policy=TokenPolicy(),
    )
    headers, body = basic.build(TokenRequest("refresh_token", (("refresh_token", SecretStr("r")),)))
    assert body == b"grant_type=refresh_token&refresh_token=r"
    assert headers["Authorization"] == "Basic " + base64.b64encode(b"c:s").decode()
    assert headers["Content-Type"] == "application/x-www-form-urlencoded"


def test_static_token_never_expires_locally() -> None:
    """A StaticToken gives its token back without any endpoint."""
    auth = StaticToken(SecretStr("pre-issued"))
    assert auth.get_token() == "pre-issued"
    auth.invalidate()
    assert auth.get_token() == "pre-issued"
