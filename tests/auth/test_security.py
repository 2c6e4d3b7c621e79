"""No secret, token or assertion in logs, reprs or error messages; no warnings on import."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from urllib.parse import parse_qsl, quote, quote_plus

import httpx
import pytest

from agentkey import AgentKeyError, DelegationExpired, TokenError
from agentkey.auth import (
    ClientAuth,
    ClientCredentials,
    EncryptedFileTokenStore,
    OnBehalfOf,
    RefreshTokenGrant,
    StaticToken,
    TokenExchange,
    TokenPolicy,
)
from agentkey.auth._base import TokenProvider
from agentkey.auth._endpoint import TokenRequest
from agentkey.auth._token_stores import MemoryTokenStore
from agentkey.client._protocol import Answer
from tests.auth._idp import IdP, Reply
from tests.auth.conftest import (
    CLIENT_ID,
    CLIENT_SECRET,
    JWT_CLIENT,
    PRIVATE_PEM,
    PUBLIC_CLIENT,
)

FAST = TokenPolicy(initial_backoff=0.01, max_backoff=0.05, max_attempts=2, failure_ttl=0.0)
ACTOR = "actor-token-do-not-leak"
STORE_KEY = EncryptedFileTokenStore.generate_key()


def test_nothing_secret_reaches_logs_reprs_or_errors(
    idp: IdP, caplog: pytest.LogCaptureFixture, tmp_path: object
) -> None:
    """Run every provider through success and failure; grep all output for every secret."""
    caplog.set_level(logging.DEBUG)
    url = idp.url + "/token"
    seen: list[str] = []
    errors: list[BaseException] = []
    idp.lifetime = 30.0

    def use(auth: TokenProvider, target: str = "/tool") -> None:
        seen.extend([repr(auth), str(auth)])
        try:
            with httpx.Client(auth=auth) as client:
                client.get(idp.url + target)
        except AgentKeyError as exc:
            errors.append(exc)

    store = MemoryTokenStore()
    refreshing = RefreshTokenGrant(
        url,
        client=ClientAuth(PUBLIC_CLIENT, method="none"),
        refresh_token=idp.grant_refresh_token(PUBLIC_CLIENT),
        store=store,
        policy=FAST,
    )
    providers: list[TokenProvider] = [
        ClientCredentials(url, CLIENT_ID, CLIENT_SECRET, policy=FAST),
        ClientCredentials(
            url, client=ClientAuth(CLIENT_ID, CLIENT_SECRET, method="client_secret_post")
        ),
        ClientCredentials(
            url,
            client=ClientAuth(JWT_CLIENT, method="private_key_jwt", private_key=PRIVATE_PEM),
            policy=FAST,
        ),
        refreshing,
        TokenExchange(
            url,
            CLIENT_ID,
            CLIENT_SECRET,
            subject_token=idp.user_token(),
            actor_token=ACTOR,
            actor_token_type=TokenExchange.ACCESS_TOKEN_TYPE,
            policy=FAST,
        ),
        OnBehalfOf(
            url, CLIENT_ID, CLIENT_SECRET, user_token=idp.user_token(), scope="s", policy=FAST
        ),
        StaticToken("static-token-do-not-leak"),
    ]
    for auth in providers:
        use(auth)
        idp.revoke_all()
        use(auth)  # the 401 path
    # failures: refused refresh token, refused subject token, broken endpoint, insecure url
    use(
        RefreshTokenGrant(
            url, client=ClientAuth(PUBLIC_CLIENT, method="none"), refresh_token="rt-x-leak"
        )
    )
    use(TokenExchange(url, CLIENT_ID, CLIENT_SECRET, subject_token="user-unknown-leak"))
    use(ClientCredentials(url, CLIENT_ID, "wrong-secret-leak", policy=FAST))
    idp.replies = [Reply(503, {"error": "x"}, {"Retry-After": "0"})] * 2
    use(ClientCredentials(url, CLIENT_ID, CLIENT_SECRET, policy=FAST))
    try:
        with httpx.Client(auth=StaticToken("static-token-do-not-leak")) as client:
            client.get("http://tool.example/x")
    except AgentKeyError as exc:
        errors.append(exc)
    try:
        ClientAuth(JWT_CLIENT, method="private_key_jwt", private_key="junk-key")
    except AgentKeyError as exc:
        errors.append(exc)
    file_store = EncryptedFileTokenStore(f"{tmp_path}/t.bin", key=STORE_KEY)
    rotated = store.load(refreshing.store_key)
    assert rotated is not None
    file_store.save("k", rotated)
    seen += [repr(store), repr(file_store), repr(FAST)]
    seen += [repr(p._token) for p in providers]  # the held Token objects
    assert len(errors) >= 6
    for error in errors:
        chain: BaseException | None = error
        while chain is not None:
            seen += [str(chain), repr(chain)]
            chain = chain.__cause__ or chain.__context__
    seen += [record.getMessage() for record in caplog.records]
    seen.append(caplog.text)
    haystack = "\n".join(seen)

    secrets = idp.secrets_seen() | {
        CLIENT_SECRET,
        ACTOR,
        STORE_KEY,
        "static-token-do-not-leak",
        "rt-x-leak",
        "user-unknown-leak",
        "wrong-secret-leak",
        "junk-key",
        PRIVATE_PEM.splitlines()[5],
    }
    assert len(secrets) > 20  # tokens, refresh tokens, user tokens and assertions were collected
    leaked = sorted(s for s in secrets if s in haystack)
    assert leaked == []
    assert "token obtained" in caplog.text  # the logs were captured, so the check is not vacuous
    assert "retried" in caplog.text


def test_import_pulls_no_httpx_integration_and_no_warning() -> None:
    """Warnings as errors: agentkey.auth imports and signs; authlib's httpx client stays out."""
    code = f"""
import warnings, sys
warnings.simplefilter("error")
import agentkey, agentkey.auth
from agentkey.auth._endpoint import TokenRequest
auth = agentkey.auth.ClientCredentials(
    "https://idp.example/token",
    client=agentkey.auth.ClientAuth("c", method="private_key_jwt", private_key={PRIVATE_PEM!r}),
)
auth._endpoint.build(TokenRequest("client_credentials"))
agentkey.auth.ClientCredentials("https://idp.example/token", "c", "s")._endpoint.build(
    TokenRequest("client_credentials")
)
assert "authlib.oauth2.rfc7523" in sys.modules  # the assertion really went through authlib
print([m for m in sys.modules if m.startswith("authlib.integrations")])
"""
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
    assert out.stderr == ""


def _echo(idp: IdP, text: str) -> None:
    """The token endpoint's next answer: 400 invalid_grant whose description is ``text``."""
    idp.replies = [Reply(400, {"error": "invalid_grant", "error_description": text})]


def _no_trace(error: BaseException, secret: str) -> None:
    """Neither the secret nor any 8 characters of it, raw or form-encoded, in the error."""
    texts = [str(error), repr(error), str(getattr(error, "error_description", ""))]
    texts.append(str(getattr(error, "error", "")))
    pieces = {secret[i : i + 8] for i in range(len(secret) - 7)}
    for text in texts:
        assert not any(piece in text for piece in pieces), text
        assert quote(secret, safe="") not in text, text


@pytest.mark.parametrize("where", ["plain", "encoded", "straddling-the-cut", "in-control-chars"])
def test_secrets_the_token_endpoint_echoes_never_reach_errors(idp: IdP, where: str) -> None:
    """A client secret, refresh token or subject token echoed in error_description is cut out.

    Cut first, before control characters are folded and the text is shortened to 300
    characters: an echo that straddles the cut leaves no piece of the secret either.
    """
    url = idp.url + "/token"
    secret, refresh, subject = "p@ss:w/rd-odd-secret", "rt-echoed-refresh-0123", "user-echoed-0123"

    def said(value: str) -> str:
        if where == "encoded":
            return f"refused {quote_plus(value)} for this client"
        if where == "straddling-the-cut":  # the 300-character cut falls 10 characters in
            return "x" * 290 + value
        if where == "in-control-chars":
            return f"refused\x00{value}\x1b[0m"
        return f"the value {value} is not valid"

    cases: list[tuple[TokenProvider, str, type[TokenError]]] = [
        (ClientCredentials(url, CLIENT_ID, secret, policy=FAST), secret, TokenError),
        (
            ClientCredentials(
                url, client=ClientAuth(CLIENT_ID, secret, method="client_secret_post")
            ),
            secret,
            TokenError,
        ),
        (
            RefreshTokenGrant(url, CLIENT_ID, secret, refresh_token=refresh, policy=FAST),
            refresh,
            DelegationExpired,
        ),
        (
            TokenExchange(url, CLIENT_ID, secret, subject_token=subject, policy=FAST),
            subject,
            DelegationExpired,
        ),
    ]
    for auth, echoed, expected in cases:
        _echo(idp, said(echoed) + " / " + said(secret))
        with pytest.raises(expected) as caught:
            auth.get_token()
        for value in (echoed, secret):
            _no_trace(caught.value, value)
        assert "<redacted>" in (caught.value.error_description or "")


def test_a_private_key_jwt_assertion_echoed_is_cut_out() -> None:
    """The client assertion signed for one token request never comes back in its TokenError."""
    auth = ClientCredentials(
        "https://idp.example/token",
        client=ClientAuth(JWT_CLIENT, method="private_key_jwt", private_key=PRIVATE_PEM),
    )
    endpoint = auth._endpoint
    request = TokenRequest("client_credentials")
    out = endpoint.outgoing(request)
    assertion = dict(parse_qsl((out.content or b"").decode()))["client_assertion"]
    echoed = {"error": "invalid_client", "error_description": f"bad assertion {assertion}"}
    answer = Answer(400, {}, json.dumps(echoed).encode(), endpoint.url)
    secrets = endpoint.sent_secrets(request, out)
    with pytest.raises(TokenError) as caught:
        endpoint.interpret(request, answer, 0.0, secrets=secrets)
    _no_trace(caught.value, assertion)
    assert caught.value.error_description == "bad assertion <redacted>"
