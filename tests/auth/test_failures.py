"""Unexpected failures around a refresh: broken stores and callables, interruptions."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from agentkey import AuthError, DelegationExpired
from agentkey.auth import ClientAuth, RefreshTokenGrant, TokenExchange, TokenPolicy
from tests.auth._idp import IdP
from tests.auth.conftest import CLIENT_ID, CLIENT_SECRET, PUBLIC_CLIENT, Driver

POLICY = TokenPolicy(failure_ttl=30.0)


class BrokenStore:
    """A TokenStore whose backend is down."""

    def load(self, key: str) -> SecretStr | None:
        raise ConnectionError("vault unreachable")

    def save(self, key: str, value: SecretStr) -> None:
        raise ConnectionError("vault unreachable")

    def delete(self, key: str) -> None:
        raise ConnectionError("vault unreachable")


async def test_broken_store_is_an_auth_error_with_its_cause(idp: IdP, driver: Driver) -> None:
    """A store that raises surfaces as AuthError naming the failure, with the original as cause."""
    auth = RefreshTokenGrant(
        idp.url + "/token",
        client=ClientAuth(PUBLIC_CLIENT, method="none"),
        store=BrokenStore(),
        policy=POLICY,
    )
    with pytest.raises(AuthError, match="ConnectionError") as info:
        await driver.request("GET", idp.url + "/tool", auth=auth)
    assert isinstance(info.value.__cause__, ConnectionError)
    assert idp.token_requests == 0


async def test_subject_callable_failures(idp: IdP, driver: Driver) -> None:
    """A raising subject_token callable is an AuthError; one returning None means re-authorise."""

    def boom() -> str:
        raise RuntimeError("session store down")

    url = idp.url + "/token"
    auth = TokenExchange(url, CLIENT_ID, CLIENT_SECRET, subject_token=boom, policy=POLICY)
    with pytest.raises(AuthError, match="subject_token callable raised RuntimeError"):
        await driver.request("GET", idp.url + "/tool", auth=auth)
    gone = TokenExchange(
        url,
        CLIENT_ID,
        CLIENT_SECRET,
        subject_token=lambda: None,  # type: ignore[arg-type, return-value]
        policy=POLICY,
    )
    with pytest.raises(DelegationExpired, match="authorise"):
        await driver.request("GET", idp.url + "/tool", auth=gone)
    assert idp.token_requests == 0


def test_interruption_is_not_remembered_as_a_failure(idp: IdP) -> None:
    """Ctrl-C during a refresh propagates, and the next call refreshes instead of failing fast."""
    calls = {"n": 0}
    user = idp.user_token()

    def subject() -> str:
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt
        return user

    auth = TokenExchange(
        idp.url + "/token", CLIENT_ID, CLIENT_SECRET, subject_token=subject, policy=POLICY
    )
    with pytest.raises(KeyboardInterrupt):
        auth.get_token()
    assert auth.get_token()
    assert idp.token_requests == 1
