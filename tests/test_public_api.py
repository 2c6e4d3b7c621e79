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
        "heavy = ('httpx', 'httpcore', 'pydantic', 'anyio', 'agentkey._invoker',"
        " 'agentkey._checker', 'agentkey.auth', 'agentkey._plan')\n"
        "print([m for m in heavy if m in sys.modules])\n"
        "assert sorted(set(agentkey.__all__) - set(dir(agentkey))) == []\n"
        "missing = [n for n in agentkey.__all__ if not hasattr(agentkey, n)]\n"
        "print(missing, agentkey.ToolInvoker.__module__, agentkey.auth.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "[] agentkey._invoker agentkey.auth"]


def test_unknown_names_raise_attribute_error() -> None:
    """A name agentkey does not export raises AttributeError, as for any module."""
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        agentkey.NoSuchThing  # type: ignore[attr-defined]  # noqa: B018
    assert not hasattr(agentkey, "_LAZYX")
