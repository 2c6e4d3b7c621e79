"""No secret, token or assertion in logs, reprs or error messages; no warnings on import."""

from __future__ import annotations

import logging
import subprocess
import sys

import httpx
import pytest

from agentkey import AgentKeyError
from agentkey.auth import (
    ACCESS_TOKEN_TYPE,
    ClientCredentials,
    EncryptedFileTokenStore,
    MemoryTokenStore,
    OnBehalfOf,
    RefreshTokenGrant,
    StaticToken,
    TokenExchange,
    TokenPolicy,
)
from agentkey.auth._base import TokenProvider
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
        PUBLIC_CLIENT,
        auth_method="none",
        refresh_token=idp.grant_refresh_token(PUBLIC_CLIENT),
        store=store,
        policy=FAST,
    )
    providers: list[TokenProvider] = [
        ClientCredentials(url, CLIENT_ID, CLIENT_SECRET, policy=FAST),
        ClientCredentials(url, CLIENT_ID, CLIENT_SECRET, auth_method="client_secret_post"),
        ClientCredentials(
            url, JWT_CLIENT, auth_method="private_key_jwt", private_key=PRIVATE_PEM, policy=FAST
        ),
        refreshing,
        TokenExchange(
            url,
            CLIENT_ID,
            CLIENT_SECRET,
            subject_token=idp.user_token(),
            actor_token=ACTOR,
            actor_token_type=ACCESS_TOKEN_TYPE,
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
    use(RefreshTokenGrant(url, PUBLIC_CLIENT, auth_method="none", refresh_token="rt-x-leak"))
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
        ClientCredentials(url, JWT_CLIENT, auth_method="private_key_jwt", private_key="junk-key")
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
auth = agentkey.ClientCredentials(
    "https://idp.example/token", "c", auth_method="private_key_jwt", private_key={PRIVATE_PEM!r}
)
auth._endpoint.build(TokenRequest("client_credentials"))
agentkey.ClientCredentials("https://idp.example/token", "c", "s")._endpoint.build(
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
