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


#: Every public name across every public namespace (each ``__all__``), counted once.
#: A new public name raises this number in the commit that adds it, with a reason in its message.
#: 128: agentkey.auth.ClientAuth came (issue 36 item 3) and agentkey.auth.MemoryTokenStore
#: left (the providers' default store, which no user needs to build).
SURFACE = 128
#: STYLE.md's cap on the three core namespaces.
CORE_CAP = 80
#: The namespaces STYLE.md holds to at most 80 names together.
_CORE = frozenset({"agentkey", "agentkey.server", "agentkey.auth"})
#: Names several integrations export on purpose: each framework's own function.
_FRAMEWORK_VERBS = frozenset({"call_step", "remote_tool"})


def _public_surface() -> dict[str, list[str]]:
    """Each public module (no segment starting with ``_``) and its ``__all__``, read from the
    source (the CrewAI and ADK adapters cannot be imported without their extras)."""
    import ast
    from pathlib import Path

    root = Path(agentkey.__file__).parent
    surface: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if any(part.startswith("_") for part in parts[1:]):
            continue
        names: list[str] = []
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                    assert isinstance(node.value, ast.List), path
                    names = [ast.literal_eval(element) for element in node.value.elts]
        surface[".".join(parts)] = names
    return surface


def test_the_public_surface_holds_its_total_and_each_name_once() -> None:
    """Across every public namespace (17) the surface is SURFACE names, none exported twice
    (a framework's own remote_tool and call_step aside) and no compatibility alias."""
    surface = _public_surface()
    assert {"agentkey", "agentkey.server", "agentkey.testing", "agentkey.journal"} <= set(surface)
    qualified = {f"{space}.{name}" for space, names in surface.items() for name in names}
    counts = {space: len(names) for space, names in surface.items()}
    assert len(qualified) == SURFACE, counts
    core = [name for name in qualified if name.rpartition(".")[0] in _CORE]
    assert len(core) <= CORE_CAP, len(core)  # STYLE.md: at most 80 in the three core namespaces
    for space, names in surface.items():
        assert len(set(names)) == len(names), space
    spaces: dict[str, list[str]] = {}
    for space, names in surface.items():
        for name in names:
            spaces.setdefault(name, []).append(space)
    twice = {name: where for name, where in spaces.items() if len(where) > 1}
    assert set(twice) <= _FRAMEWORK_VERBS, twice
    assert all(where.startswith("agentkey.integrations.") for w in twice.values() for where in w)
    assert not [name for name in qualified if name.endswith(("_v1", "_v2", "_compat"))]
    assert len(surface["agentkey"]) == len(agentkey.__all__)  # the parse reads what runs


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
    """TokenRejected is the 401 after a refresh; the URN constants have a home; the option
    strings (on_repeat=, profile=, style=) are plain strings, with no public alias to import."""
    from agentkey.auth import TokenExchange

    assert issubclass(agentkey.TokenRejected, agentkey.AuthError)
    assert issubclass(agentkey.TokenRejected, agentkey.InvokeError)
    assert not {"OnRepeat", "Profile", "HeaderStyle"} & {*agentkey.__all__, *dir(agentkey)}
    assert TokenExchange.ACCESS_TOKEN_TYPE == "urn:ietf:params:oauth:token-type:access_token"


def test_one_word_for_may_have_run() -> None:
    """'In doubt' is the one word for "may have run": journal state, both hooks' answers,
    the failure kind; Outcome has no UNKNOWN alias of ANSWERED."""
    from agentkey.client._effects import FailureKind
    from agentkey.journal import CallState, Verdict
    from agentkey.server import Reconciled

    assert [m.name for m in agentkey.Outcome] == ["EXECUTED", "REPLAYED", "ANSWERED"]
    assert not hasattr(agentkey.Outcome, "UNKNOWN")
    with pytest.raises(ValueError, match="unknown"):
        agentkey.Outcome("unknown")
    assert CallState.IN_DOUBT.value == "in_doubt"
    assert Verdict.in_doubt("no record").happened is None
    assert Reconciled.in_doubt().outcome == "in_doubt"
    assert not hasattr(Verdict, "unknown")
    assert not hasattr(Reconciled, "unknown")
    assert "IN_DOUBT" in FailureKind.__members__
    assert "AMBIGUOUS" not in FailureKind.__members__


def test_reconcile_is_the_hook_and_verify_is_tls() -> None:
    """The invokers and the MCP session take the reconcile hook as reconcile= (the server's
    word); verify= is TLS verification only, on the token providers, as httpx spells it."""
    import inspect

    from agentkey.auth import ClientCredentials, OAuthProvider
    from agentkey.client._invoker import InvokerOptions
    from agentkey.integrations.mcp import IdempotentSession

    params = set(inspect.signature(IdempotentSession).parameters)
    for hooked in (params, InvokerOptions.__optional_keys__):  # the invokers' shared options
        assert "reconcile" in hooked
        assert "verify" not in hooked
    for provider in (ClientCredentials, OAuthProvider):
        assert "verify" in inspect.signature(provider).parameters, provider
    with pytest.raises(TypeError, match="verify"):
        agentkey.ToolInvoker("https://tool.example", verify=lambda call: None)  # type: ignore[call-arg]
