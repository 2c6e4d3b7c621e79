"""One set of invoker options: both twins take the same names, with defaults in one place."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from agentkey import AsyncToolInvoker, RetryPolicy, ToolInvoker
from agentkey.client._invoker import _DEFAULTS, InvokerOptions
from agentkey.testing import FakeClock

from ._support import BASE

TWINS = (ToolInvoker, AsyncToolInvoker)


def test_both_twins_take_exactly_the_same_options() -> None:
    """The twins' signatures differ in nothing but their clients' types: same names, same
    shared options (one TypedDict), and every shared option has its one default."""
    sync, asyn = (inspect.signature(twin).parameters for twin in TWINS)
    assert list(sync) == list(asyn) == ["base_url", "auth", "client", "poll_client", "options"]
    for params in (sync, asyn):
        assert params["options"].kind is inspect.Parameter.VAR_KEYWORD
        assert params["options"].annotation == "Unpack[InvokerOptions]"
    assert InvokerOptions.__optional_keys__ == set(_DEFAULTS)
    assert not InvokerOptions.__required_keys__
    assert set(_DEFAULTS) == {
        "retry", "polling", "timeout", "clock", "key_header_style", "replay_headers",
        "allowed_poll_origins", "routes", "route_template", "hooks", "max_response_bytes",
        "journal", "honours_keys", "reconcile",
    }  # fmt: skip


@pytest.mark.parametrize("twin", TWINS)
def test_every_option_is_accepted_by_both_twins(twin: type[Any]) -> None:
    """Each shared option, given explicitly with its default value, is taken by either twin."""
    given: dict[str, Any] = {**_DEFAULTS, "journal": False, "clock": FakeClock()}
    invoker = twin(BASE, **given)
    assert repr(invoker) == f"{twin.__name__}({BASE!r})"


@pytest.mark.parametrize("twin", TWINS)
def test_a_misspelt_option_is_a_type_error_naming_it(twin: type[Any]) -> None:
    """An unknown keyword raises TypeError naming it, the likely option, and the valid names;
    the type checker rejects it too (the ignore below is needed, or mypy --strict fails)."""
    with pytest.raises(TypeError, match=r"'retyr' \(did you mean 'retry'\?\).*route_template"):
        ToolInvoker(BASE, retyr=RetryPolicy())  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=f"{twin.__name__}\\(\\).*'verify'"):
        twin(BASE, verify=True, journal=False)
