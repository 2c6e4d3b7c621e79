"""Access tokens an Authorization header cannot carry are refused before any tool sees them,
and without echoing them (the HTTP layer's own error would quote the whole header)."""

from __future__ import annotations

import traceback

import pytest

from agentkey import ConfigurationError, TokenError
from agentkey.auth import ClientCredentials, StaticToken, TokenPolicy
from tests.auth._idp import IdP, Reply
from tests.auth.conftest import CLIENT_ID, CLIENT_SECRET, Driver

MARK = "TOKEN-7d1e"
BAD_TOKENS = [f"{MARK}\n", f"{MARK}\r\nX-Evil: 1", f"{MARK} x", f"{MARK}é", f"{MARK}\x00"]


def _everything(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc)) + repr(exc) + repr(exc.args)


@pytest.mark.parametrize("token", BAD_TOKENS)
async def test_endpoint_token_with_bad_characters_is_a_token_error(
    idp: IdP, driver: Driver, token: str
) -> None:
    """An IdP answer whose access_token holds a line break, space or non-ASCII is a TokenError."""
    idp.replies = [Reply(200, {"access_token": token, "token_type": "Bearer", "expires_in": 60})]
    auth = ClientCredentials(
        idp.url + "/token", CLIENT_ID, CLIENT_SECRET, policy=TokenPolicy(failure_ttl=0)
    )
    with pytest.raises(TokenError, match="Authorization header cannot carry") as info:
        await driver.request("GET", idp.url + "/tool", auth=auth)
    assert MARK not in _everything(info.value)
    assert idp.tool_requests == []


@pytest.mark.parametrize("token", [*BAD_TOKENS, f"Bearer {MARK}"])
def test_static_token_with_bad_characters_is_refused(token: str) -> None:
    """StaticToken refuses a value a header cannot carry, without quoting it."""
    with pytest.raises(ConfigurationError, match="Authorization") as info:
        StaticToken(token)
    assert MARK not in _everything(info.value)
