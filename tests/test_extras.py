"""The extras: which versions agentkey states it works with, and what it says when one is old.

``nox -s lowest`` runs this file with each extra installed at its lowest allowed version; the
default suite runs it against whatever is installed. The version check itself is pure logic
(``too_old``), tested here on agentkey's Requires-Dist lines without touching any library.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.version import Version  # pytest's own dependency: an independent oracle
from pydantic import BaseModel

from agentkey import MissingExtra, PlanSession, ToolInvoker
from agentkey._exceptions import too_old
from agentkey.testing import example_app
from tests._loopback import serve

#: agentkey's Requires-Dist lines as a wheel carries them (a slice of them).
REQUIRES = [
    "httpx>=0.27",
    'anyio>=4.0; extra == "server"',
    'starlette>=0.37; extra == "server"',
    'agentkey-idempotency[server]; extra == "postgres"',
    'psycopg[binary]>=3.2.1; extra == "postgres"',
    'langchain-core>=0.3; extra == "langchain"',
    'langgraph>=1.1.5; extra == "langgraph"',
    "pydantic-ai-slim>=2.68; python_version >= \"3.11\" and extra == 'pydantic-ai'",
]


def _versions(**installed: str) -> dict[str, str]:
    return {name.replace("_", "-"): version for name, version in installed.items()}


def test_too_old_names_the_package_its_version_and_the_floor() -> None:
    """langgraph 0.2.76 under a floor of 1.1.5 is reported as (langgraph, 0.2.76, 1.1.5)."""
    installed = _versions(langgraph="0.2.76", langchain_core="0.3.30")
    assert too_old("langgraph", REQUIRES, installed.get) == ("langgraph", "0.2.76", "1.1.5")


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("1.1.5", None),  # the floor itself
        ("1.1.10", None),  # numeric, not string order
        ("1.2.0rc1", None),  # a pre-release above the floor
        ("1.1.4", ("langgraph", "1.1.4", "1.1.5")),
        ("1.1", ("langgraph", "1.1", "1.1.5")),
    ],
)
def test_too_old_compares_release_numbers(
    version: str, expected: tuple[str, str, str] | None
) -> None:
    """Versions compare by release numbers: 1.1.10 is newer than 1.1.5, 1.1 is older."""
    assert too_old("langgraph", REQUIRES, _versions(langgraph=version).get) == expected


def test_too_old_ignores_absent_packages_and_other_extras() -> None:
    """A package not installed is not "too old", nor is one of an extra not asked about."""
    installed = _versions(anyio="3.7.1", pydantic_ai_slim="1.0")
    assert too_old("langgraph", REQUIRES, installed.get) is None


def test_too_old_follows_an_extra_that_includes_another() -> None:
    """[postgres] includes [server]: an anyio below [server]'s floor is found from [postgres]."""
    installed = _versions(anyio="3.7.1", psycopg="3.2.1", starlette="0.37.2")
    assert too_old("postgres", REQUIRES, installed.get) == ("anyio", "3.7.1", "4.0")


def test_too_old_reads_markers_with_either_quote() -> None:
    """An extra's marker written with single quotes (and beside another marker) still counts."""
    installed = _versions(pydantic_ai_slim="2.60.0")
    assert too_old("pydantic-ai", REQUIRES, installed.get) == ("pydantic-ai-slim", "2.60.0", "2.68")


def test_message_says_too_old_with_both_versions_and_the_upgrade_command() -> None:
    """The message names the package, the installed and the needed version, and pip --upgrade."""
    exc = MissingExtra("langgraph", "langgraph", installed="0.2.76", needed="1.1.5")
    assert isinstance(exc, ImportError)
    assert (exc.extra, exc.module, exc.installed, exc.needed) == (
        "langgraph",
        "langgraph",
        "0.2.76",
        "1.1.5",
    )
    message = str(exc)
    assert "langgraph 1.1.5 or newer" in message
    assert "langgraph 0.2.76 is installed, which is too old" in message
    assert "pip install --upgrade 'agentkey-idempotency[langgraph]'" in message
    assert "not installed" not in message


def _floor(package: str) -> str:
    """The lower bound agentkey's installed metadata states for ``package``."""
    for line in metadata.requires("agentkey-idempotency") or []:
        found = re.match(rf"{re.escape(package)}\s*>=\s*([^,;\s]+)", line)
        if found:
            return found[1]
    raise AssertionError(f"agentkey's metadata states no floor for {package}")


_IMPORT = (
    "import agentkey\n"
    "try:\n"
    "    import agentkey.integrations.langgraph\n"
    "except agentkey.MissingExtra as exc:\n"
    "    print(exc.module, exc.installed, exc.needed)\n"
    "    print(exc)\n"
    "else:\n"
    "    print('imported')\n"
)


def _import_langgraph_adapter(*path: Path) -> list[str]:
    """Import agentkey's LangGraph adapter in a fresh interpreter with ``path`` first."""
    code = f"import sys; sys.path[:0] = {[str(p) for p in path]!r}\n" + _IMPORT
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def _fake_distribution(root: Path, name: str, version: str) -> Path:
    """An installed-looking ``name`` (package and dist-info) without any of its modules."""
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text("")
    info = root / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return root


def test_an_old_langgraph_first_on_the_path_is_reported_too_old(tmp_path: Path) -> None:
    """A langgraph older than the floor makes the adapter's import say "too old", not "missing"."""
    floor = _floor("langgraph")
    lines = _import_langgraph_adapter(_fake_distribution(tmp_path, "langgraph", "0.1.0"))
    assert lines[0] == f"langgraph 0.1.0 {floor}"
    assert "langgraph 0.1.0 is installed, which is too old" in lines[1]
    assert "pip install --upgrade 'agentkey-idempotency[langgraph]'" in lines[1]


def test_a_langgraph_above_the_floor_without_what_agentkey_uses_is_not_called_missing(
    tmp_path: Path,
) -> None:
    """A new langgraph without langgraph.prebuilt is said to lack it, not to be missing."""
    lines = _import_langgraph_adapter(_fake_distribution(tmp_path, "langgraph", "99.0"))
    assert lines[0] == "langgraph 99.0 None"
    assert "langgraph 99.0 is installed but lacks what agentkey uses" in lines[1]


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def test_an_installed_langgraph_below_the_floor_is_reported_too_old() -> None:
    """With a real old langgraph installed (`nox -s lowest`: 0.2.40), the import says too old."""
    version, floor = _installed("langgraph"), _floor("langgraph")
    if version is None or Version(version) >= Version(floor):
        pytest.skip(f"needs a langgraph older than {floor} (`nox -s lowest` installs 0.2.40)")
    lines = _import_langgraph_adapter()
    assert lines[0] == f"langgraph {version} {floor}"
    assert "which is too old" in lines[1]


class _Charge(BaseModel):
    amount: int


def test_the_langchain_adapter_alone_sends_a_resent_call_once() -> None:
    """[langchain] without LangGraph (at its floor in `nox -s lowest`): a resend is replayed."""
    pytest.importorskip("langchain_core")
    from agentkey.integrations.langchain import remote_tool

    app = example_app(work_seconds=0.0)
    plan = PlanSession.new()
    with serve(app) as url, ToolInvoker(url, route_template="/tools/{tool}") as invoker:
        charge = remote_tool(
            name="charge",
            description="Charge the card.",
            args_schema=_Charge,
            invoker=invoker,
            plan=plan,
            step_index=0,
        )
        call = {"name": "charge", "args": {"amount": 700}, "id": "c1", "type": "tool_call"}
        first, again = charge.invoke(call), charge.invoke(call)
    assert first.artifact["outcome"] == "executed"
    assert again.artifact["outcome"] == "replayed"
    assert again.artifact["idempotency_key"] == first.artifact["idempotency_key"]
    assert app.state.executions["charge"] == 1
