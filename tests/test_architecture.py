"""The import rules of docs/architecture.md, checked on the source.

The tree shows the layers: the shared modules at the top of ``agentkey`` (canonical
JSON, keys, plans, the backoff schedule, the errors) import nothing of the halves;
``agentkey.client`` never imports the server half, nor ``agentkey.server`` the client's.

Every ``import`` is read from the syntax tree, including imports inside
functions, so a lazy import cannot slip past a rule. ``__init__.py`` files are
facades that load their package's modules on demand: they follow the rules
for third-party imports but may name any module of their own package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from agentkey.client import _effects

ROOT = Path(__file__).resolve().parents[1] / "agentkey"

#: Layers, lowest first. A module may import agentkey modules of its own layer or below.
LAYERS: dict[str, int] = {
    # 0: pure core. No I/O, no clock of its own.
    "agentkey._canonical": 0,
    "agentkey._clock": 0,
    "agentkey.client._drive": 0,
    "agentkey.client._effects": 0,
    "agentkey.client._evidence": 0,
    "agentkey._exceptions": 0,
    "agentkey.client._flow": 0,
    "agentkey.client._hooks": 0,
    "agentkey.client._honours": 0,
    "agentkey._keys": 0,
    "agentkey.client._net": 0,
    "agentkey._plan": 0,
    "agentkey.client._policies": 0,
    "agentkey.client._protocol": 0,
    "agentkey.client._retry_after": 0,
    "agentkey._schedule": 0,
    "agentkey._validate": 0,
    "agentkey._version": 0,
    "agentkey.auth._token_policy": 0,
    "agentkey.auth._token": 0,
    "agentkey.journal._records": 0,
    "agentkey.journal._verify": 0,
    "agentkey.server._decide": 0,
    "agentkey.server._records": 0,
}
#: The wire (the client modules that touch httpx), and what drives it.
WIRE = 1
#: The server half: may use the pure core, never the client's wire.
SERVER = 2
#: Applications of the library: CLI, demo, integrations, test support.
APPS = 3

#: Modules that must not do I/O or read the clock: their effects are yielded to a driver.
PURE = {
    "agentkey._canonical",
    "agentkey.client._drive",
    "agentkey.client._effects",
    "agentkey.client._evidence",
    "agentkey.client._flow",
    "agentkey.client._honours",
    "agentkey._keys",
    "agentkey.client._net",
    "agentkey.client._protocol",
    "agentkey.client._retry_after",
    "agentkey._schedule",
    "agentkey._validate",
    "agentkey.journal._records",
    "agentkey.journal._verify",
    "agentkey.server._decide",
}
#: What a pure module never imports: I/O, a clock (``time``, ``datetime.now``), a random
#: source of its own, or a logger. Its clock, random source and wall time are injected, and
#: what it would log or tell a hook is an ``Emit`` effect the driver carries out.
IMPURE_MODULES = {
    "anyio",
    "asyncio",
    "datetime",
    "httpx",
    "httpx2",
    "logging",
    "psycopg",
    "psycopg_pool",
    "random",
    "redis",
    "socket",
    "ssl",
    "starlette",
    "threading",
    "time",
    "uvicorn",
}
#: httpx (and its fork) may be imported here only.
WIRE_MODULES = {"_clients", "_deadline", "_decode", "_http", "_httpx2", "_translate"}
HTTPX_OWNERS = {f"agentkey.client.{name}" for name in WIRE_MODULES} | {"agentkey.testing"}


def _layer(module: str) -> int:
    if module in LAYERS:
        return LAYERS[module]
    if module.startswith("agentkey.server"):
        return SERVER
    if module.startswith(("agentkey.integrations", "agentkey.testing")) or module in {
        "agentkey.cli",
        "agentkey._demo",
        "agentkey.__main__",
    }:
        return APPS
    return WIRE


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """Absolute names of every module ``path`` imports, with line numbers."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = _module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            if name == "__future__":
                continue
            found.append((name, node.lineno))
            # ``from . import x`` names a module when x is one.
            for alias in node.names:
                candidate = f"{name}.{alias.name}"
                if _is_agentkey_module(candidate):
                    found.append((candidate, node.lineno))
    return found


def _is_agentkey_module(name: str) -> bool:
    rel = Path(*name.split("."))
    base = ROOT.parent / rel
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _owner(name: str) -> str:
    """The agentkey module an import resolves to (a name inside it maps to the module)."""
    while name and not _is_agentkey_module(name):
        name = name.rpartition(".")[0]
    return name


SOURCES = sorted(ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: _module_name(p))
def test_import_rules(path: Path) -> None:
    """Each module imports only what its layer allows: httpx in the wire alone, pure ones no I/O."""
    module = _module_name(path)
    facade = path.name == "__init__.py"
    broken: list[str] = []
    for name, line in _imports(path):
        top = name.split(".")[0]
        if top in {"httpx", "httpx2"} and module not in HTTPX_OWNERS:
            broken.append(
                f"line {line}: imports {name}; only agentkey/client/_http.py talks to httpx"
            )
        if module in PURE and top in IMPURE_MODULES:
            broken.append(
                f"line {line}: imports {name}; {module} must stay free of I/O, clocks, random "
                "sources and logging (inject them, or yield an effect)"
            )
        if top != "agentkey" or facade:
            continue
        target = _owner(name)
        if target and _layer(target) > _layer(module) and not _same_package(module, target):
            layers = f"layer {_layer(target)} from layer {_layer(module)}"
            broken.append(f"line {line}: imports {target} ({layers})")
        if _layer(module) == SERVER and _layer(target) == WIRE:
            broken.append(f"line {line}: the server half imports the client's wire ({target})")
    assert not broken, f"{module}:\n" + "\n".join(broken)


#: The core's vocabulary: defined in agentkey/client/_effects.py, and imported from there alone.
EFFECT_TYPES = frozenset(_effects.__all__)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: _module_name(p))
def test_effect_types_come_from_one_module(path: Path) -> None:
    """Flows, drivers and the wire take the effect types from _effects, never a re-export."""
    module = _module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    broken = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            source = node.module.rpartition(".")[2]
            names = {alias.name for alias in node.names} & EFFECT_TYPES
            ours = node.level > 0 or node.module.startswith("agentkey")
            if names and ours and source != "_effects":
                broken.append(f"line {node.lineno}: {sorted(names)} from {node.module}")
        elif isinstance(node, ast.Attribute) and node.attr in EFFECT_TYPES:
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in {*WIRE_MODULES, "_protocol", "_flow"}:
                broken.append(f"line {node.lineno}: {owner.id}.{node.attr}")
    assert not broken, f"{module} takes effect types from elsewhere than _effects:\n" + "\n".join(
        broken
    )


def _same_package(module: str, target: str) -> bool:
    return target.startswith("agentkey.server") and module.startswith("agentkey.server")


def test_rules_see_every_layer() -> None:
    """The table names only modules that exist, so a rename cannot silently drop a rule."""
    missing = sorted(m for m in [*LAYERS, *PURE] if not _is_agentkey_module(m))
    assert not missing, f"architecture table names missing modules: {missing}"


#: The shared modules: what both halves build on. They stay at the top of the package.
SHARED = {
    "agentkey._canonical",
    "agentkey._clock",
    "agentkey._exceptions",
    "agentkey._keys",
    "agentkey._plan",
    "agentkey._schedule",
    "agentkey._validate",
    "agentkey._version",
}
#: What else may sit at the top: the package's front door and its applications.
TOP_LEVEL_APPS = {"agentkey", "agentkey.__main__", "agentkey._demo", "agentkey._journal_cli"}
TOP_LEVEL_APPS |= {"agentkey.cli", "agentkey.testing"}


def test_the_top_level_holds_shared_modules_and_applications_only() -> None:
    """A module of one half lives in its folder: the top holds shared modules and apps only."""
    top = {_module_name(p) for p in ROOT.glob("*.py")}
    assert top - SHARED - TOP_LEVEL_APPS == set()


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: _module_name(p))
def test_the_tree_is_the_layering(path: Path) -> None:
    """Shared modules import only shared ones; the client and server halves never meet."""
    module = _module_name(path)
    broken = []
    for name, line in _imports(path):
        if name.split(".")[0] != "agentkey":
            continue
        target = _owner(name)
        if module in SHARED and target not in SHARED and target != "agentkey":
            broken.append(f"line {line}: the shared module imports {target}")
        if module.startswith("agentkey.client") and target.startswith(
            ("agentkey.server", "agentkey.integrations")
        ):
            broken.append(f"line {line}: the client imports {target}")
        if module.startswith("agentkey.server") and target.startswith(
            ("agentkey.client", "agentkey.auth", "agentkey.integrations")
        ):
            broken.append(f"line {line}: the server half imports {target}")
    assert not broken, f"{module}:\n" + "\n".join(broken)
