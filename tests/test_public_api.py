"""The public surface: one sorted __all__, nothing heavy imported."""

from __future__ import annotations

import subprocess
import sys

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
