"""The public surface: one sorted __all__, nothing heavy imported."""

from __future__ import annotations

import subprocess
import sys

import pytest

import agentkey


def test_all_is_sorted_and_complete() -> None:
    """__all__ is sorted, unique, and every name in it exists."""
    names = agentkey.__all__
    assert names == sorted(names)
    assert len(set(names)) == len(names)
    for name in names:
        assert hasattr(agentkey, name), name


def test_private_modules_are_not_public() -> None:
    """No private module name leaks into the public surface."""
    assert not [n for n in agentkey.__all__ if n.startswith("_") and n != "__version__"]


def test_errors_share_one_root() -> None:
    """Every exported exception derives from AgentKeyError."""
    for name in agentkey.__all__:
        obj = getattr(agentkey, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            assert issubclass(obj, agentkey.AgentKeyError), name


def test_import_does_not_pull_server_or_frameworks() -> None:
    """import agentkey never imports starlette, redis, uvicorn or langchain."""
    code = (
        "import sys, agentkey; "
        "bad = [m for m in ('starlette', 'redis', 'uvicorn', 'langchain_core', 'langgraph',"
        " 'fastapi') if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_typed_package() -> None:
    """The package ships py.typed, so users' type checkers read its annotations."""
    from importlib.resources import files

    assert files("agentkey").joinpath("py.typed").is_file()


def test_import_is_lazy_and_every_name_resolves() -> None:
    """import agentkey loads neither httpx nor pydantic; each name in __all__ then loads."""
    code = (
        "import sys, agentkey\n"
        "heavy = ('httpx', 'httpcore', 'pydantic', 'anyio', 'agentkey.client._invoker',"
        " 'agentkey.client._checker', 'agentkey.auth', 'agentkey._plan')\n"
        "print([m for m in heavy if m in sys.modules])\n"
        "assert sorted(set(agentkey.__all__) - set(dir(agentkey))) == []\n"
        "missing = [n for n in agentkey.__all__ if not hasattr(agentkey, n)]\n"
        "print(missing, agentkey.ToolInvoker.__module__, agentkey.auth.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "[] agentkey.client._invoker agentkey.auth"]


def test_unknown_names_raise_attribute_error() -> None:
    """A name agentkey does not export raises AttributeError, as for any module."""
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        agentkey.NoSuchThing  # type: ignore[attr-defined]  # noqa: B018
    assert not hasattr(agentkey, "_LAZYX")


def test_three_namespaces_hold_at_most_83_names_each_once() -> None:
    """agentkey, agentkey.server and agentkey.auth export at most 85 names, none twice."""
    import agentkey.auth
    import agentkey.server

    spaces = [agentkey.__all__, agentkey.server.__all__, agentkey.auth.__all__]
    names = [name for space in spaces for name in space]
    assert len(names) <= 85, len(names)
    assert len(set(names)) == len(names), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize(
    ("gone", "home"),
    [
        ("ClientCredentials", "agentkey.auth"),
        ("StaticToken", "agentkey.auth"),
        ("check_server", "agentkey.testing"),
        ("CheckReport", "agentkey.testing"),
        ("step_key", None),
        ("AuthenticationError", None),
    ],
)
def test_moved_and_removed_names(gone: str, home: str | None) -> None:
    """A name that moved lives only in its new namespace; a removed one is gone everywhere."""
    import importlib

    assert gone not in agentkey.__all__
    assert not hasattr(agentkey, gone)
    if home is not None:
        assert hasattr(importlib.import_module(home), gone)


def test_journal_failures_have_their_own_error() -> None:
    """JournalError is exported, an AgentKeyError and not a ConfigurationError, and says
    whether the call was sent."""
    error = agentkey.JournalError("the journal failed", sent=False, idempotency_key="k")
    assert isinstance(error, agentkey.AgentKeyError)
    assert not isinstance(error, agentkey.ConfigurationError)
    assert (error.sent, error.idempotency_key, error.step) == (False, "k", None)


def test_settled_pairs_name_one_thing_each() -> None:
    """TokenRejected is the 401 after a refresh; OnRepeat and the URN constants have homes."""
    from agentkey.auth import TokenExchange

    assert issubclass(agentkey.TokenRejected, agentkey.AuthError)
    assert issubclass(agentkey.TokenRejected, agentkey.InvokeError)
    assert "OnRepeat" in agentkey.__all__
    assert TokenExchange.ACCESS_TOKEN_TYPE == "urn:ietf:params:oauth:token-type:access_token"
