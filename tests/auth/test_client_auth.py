"""ClientAuth: one validated value for a client's authentication, shared by every provider."""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
from pydantic import SecretBytes, SecretStr

from agentkey import ConfigurationError
from agentkey.auth import (
    ClientAuth,
    ClientCredentials,
    OAuthProvider,
    OnBehalfOf,
    RefreshTokenGrant,
    TokenExchange,
    TokenPolicy,
)
from agentkey.testing import FakeClock
from tests.auth._idp import IdP
from tests.auth.conftest import CLIENT_ID, CLIENT_SECRET, JWT_CLIENT, PRIVATE_PEM, PUBLIC_CLIENT

URL = "https://idp.example/token"
SECRET = "s3cr3t-never-shown-9"
FAST = TokenPolicy(initial_backoff=0.01, max_backoff=0.05, max_attempts=2)
_PEM_BODY = PRIVATE_PEM.splitlines()[1]  # a line of key material, to look for in messages


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"client_id": ""}, "client_id"),
        ({"client_id": 42}, "client_id"),
        ({"client_secret": ""}, "client_secret"),
        ({"client_secret": b"s3cr3t-never-shown-9"}, "client_secret"),
        ({"method": "magic"}, "method"),
        ({"method": "client_secret_post", "client_secret": None}, "needs client_secret"),
        ({"method": "none"}, "method='none'"),
        ({"method": "private_key_jwt"}, "private_key"),
        ({"method": "private_key_jwt", "client_secret": None}, "private_key"),
        ({"method": "private_key_jwt", "client_secret": None, "private_key": "junk"}, "PEM"),
        ({"method": "private_key_jwt", "client_secret": None, "private_key": 7}, "private_key"),
        (
            {
                "method": "private_key_jwt",
                "client_secret": None,
                "private_key": PRIVATE_PEM,
                "private_key_alg": "HS256",
            },
            "private_key_alg",
        ),
        ({"private_key": PRIVATE_PEM}, "only used with"),
        ({"assertion_lifetime": 0}, "assertion_lifetime"),
        ({"assertion_lifetime": 301}, "assertion_lifetime"),
        ({"assertion_lifetime": True}, "assertion_lifetime"),
        ({"assertion_lifetime": float("nan")}, "assertion_lifetime"),
        ({"key_id": ""}, "key_id"),
        ({"private_key_alg": ""}, "private_key_alg"),
    ],
)
def test_client_auth_validation(kwargs: dict[str, Any], field: str) -> None:
    """Each mistake raises ConfigurationError naming its field, never quoting a secret or key."""
    given: dict[str, Any] = {"client_id": "c", "client_secret": SECRET, **kwargs}
    with pytest.raises(ConfigurationError, match=field) as info:
        ClientAuth(**given)
    text = str(info.value)
    assert SECRET not in text
    assert _PEM_BODY not in text
    assert "junk" not in text


def test_client_auth_repr_and_equality_hide_secrets() -> None:
    """Neither the secret nor the key is in a repr; equal inputs make equal, hashable values;
    a copy made with dataclasses.replace is validated like the original."""
    basic = ClientAuth("c", SECRET)
    keyed = ClientAuth("c", method="private_key_jwt", private_key=PRIVATE_PEM, key_id="k1")
    for value in (
        basic,
        keyed,
        ClientCredentials(URL, client=keyed),
        ClientCredentials(URL, "c", SECRET),
    ):
        assert SECRET not in repr(value)
        assert _PEM_BODY not in repr(value)
    assert basic == ClientAuth("c", SecretStr(SECRET))
    assert isinstance(basic.client_secret, SecretStr)
    assert basic.method == "client_secret_basic"
    as_bytes = ClientAuth("c", method="private_key_jwt", private_key=PRIVATE_PEM.encode())
    assert isinstance(as_bytes.private_key, SecretBytes)
    assert keyed == ClientAuth(
        "c", method="private_key_jwt", private_key=SecretStr(PRIVATE_PEM), key_id="k1"
    )
    assert len({basic, ClientAuth("c", SECRET), keyed}) == 2
    posted = dataclasses.replace(basic, method="client_secret_post")
    assert posted == ClientAuth("c", SECRET, method="client_secret_post")
    with pytest.raises(ConfigurationError, match="assertion_lifetime"):
        dataclasses.replace(keyed, assertion_lifetime=3600)


def test_the_shorthand_builds_the_same_client_auth() -> None:
    """client_id and client_secret build the ClientAuth a provider would get from client=."""
    assert ClientCredentials(URL, "c", SECRET).client == ClientAuth("c", SECRET)
    assert RefreshTokenGrant(URL, "c", SECRET, refresh_token="r").client == ClientAuth("c", SECRET)
    assert TokenExchange(URL, "c", SECRET, subject_token="u").client == ClientAuth("c", SECRET)
    # Entra's on-behalf-of wants the secret in the form: its shorthand says so.
    obo = OnBehalfOf(URL, "c", SECRET, user_token="u", scope="api://t/.default")
    assert obo.client == ClientAuth("c", SECRET, method="client_secret_post")
    with pytest.raises(ConfigurationError, match="not both"):
        ClientCredentials(URL, "c", client=ClientAuth("c", SECRET))
    with pytest.raises(ConfigurationError, match="ClientAuth"):
        ClientCredentials(URL, client="c:" + SECRET)  # type: ignore[arg-type]


_AUTHS: dict[str, ClientAuth] = {
    "basic": ClientAuth(CLIENT_ID, CLIENT_SECRET),
    "post": ClientAuth(CLIENT_ID, CLIENT_SECRET, method="client_secret_post"),
    "private_key_jwt": ClientAuth(JWT_CLIENT, method="private_key_jwt", private_key=PRIVATE_PEM),
    "none": ClientAuth(PUBLIC_CLIENT, method="none"),
}

_Make = Callable[[IdP, ClientAuth], OAuthProvider]
_PROVIDERS: dict[str, _Make] = {
    "client_credentials": lambda idp, auth: ClientCredentials(
        idp.url + "/token", client=auth, policy=FAST, clock=FakeClock()
    ),
    "refresh_token": lambda idp, auth: RefreshTokenGrant(
        idp.url + "/token",
        client=auth,
        refresh_token=idp.grant_refresh_token(auth.client_id),
        policy=FAST,
        clock=FakeClock(),
    ),
    "token_exchange": lambda idp, auth: TokenExchange(
        idp.url + "/token",
        client=auth,
        subject_token=idp.user_token(),
        policy=FAST,
        clock=FakeClock(),
    ),
    "on_behalf_of": lambda idp, auth: OnBehalfOf(
        idp.url + "/token",
        client=auth,
        user_token=idp.user_token(),
        scope="api://tool/.default",
        policy=FAST,
        clock=FakeClock(),
    ),
}


def _how_authenticated(idp: IdP) -> tuple[str, str]:
    """How the last token request authenticated, as the identity provider read it."""
    header = idp.auth_headers[-1]
    form = dict(idp.forms[-1])
    if header is not None:
        user = base64.b64decode(header.split(" ", 1)[1]).decode().partition(":")[0]
        return "basic", unquote(user)
    if "client_assertion" in form:
        payload = form["client_assertion"].split(".")[1]
        return "private_key_jwt", json.loads(base64.urlsafe_b64decode(payload + "=="))["iss"]
    if "client_secret" in form:
        return "post", form["client_id"]
    return "none", form["client_id"]


@pytest.mark.parametrize("provider", sorted(_PROVIDERS))
@pytest.mark.parametrize("method", sorted(_AUTHS))
def test_every_provider_authenticates_alike_from_one_client_auth(
    idp: IdP, provider: str, method: str
) -> None:
    """One ClientAuth authenticates each grant the same way at the real loopback endpoint."""
    auth = _AUTHS[method]
    with httpx.Client(auth=_PROVIDERS[provider](idp, auth), timeout=30) as client:
        assert client.get(idp.url + "/tool").status_code == 200
    assert idp.token_requests == 1
    assert _how_authenticated(idp) == (method, auth.client_id)
