"""The import rules of docs/architecture.md, checked on the source.

Every ``import`` is read from the syntax tree, including imports inside
functions, so a lazy import cannot slip past a rule. ``__init__.py`` files are
facades that load their package's modules on demand: they follow the rules
for third-party imports but may name any module of their own package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from agentkey import _effects

ROOT = Path(__file__).resolve().parents[1] / "agentkey"

#: Layers, lowest first. A module may import agentkey modules of its own layer or below.
LAYERS: dict[str, int] = {
    # 0: pure core. No I/O, no clock of its own.
    "agentkey._canonical": 0,
    "agentkey._drive": 0,
    "agentkey._effects": 0,
    "agentkey._exceptions": 0,
    "agentkey._flow": 0,
    "agentkey._hooks": 0,
    "agentkey._keys": 0,
    "agentkey._net": 0,
    "agentkey._plan": 0,
    "agentkey._policy": 0,
    "agentkey._protocol": 0,
    "agentkey._retry_after": 0,
    "agentkey._schedule": 0,
    "agentkey._version": 0,
    "agentkey.auth._policy": 0,
    "agentkey.auth._token": 0,
    "agentkey.journal._records": 0,
    "agentkey.journal._verify": 0,
    "agentkey.server._decide": 0,
    "agentkey.server._records": 0,
}
#: The wire: the one module that touches httpx, and what drives it.
WIRE = 1
#: The server half: may use the pure core, never the client's wire.
SERVER = 2
#: Applications of the library: CLI, demo, integrations, test support.
APPS = 3

#: Modules that must not do I/O or read the clock: their effects are yielded to a driver.
PURE = {
    "agentkey._canonical",
    "agentkey._drive",
    "agentkey._effects",
    "agentkey._flow",
    "agentkey._keys",
    "agentkey._net",
    "agentkey._protocol",
    "agentkey._retry_after",
    "agentkey._schedule",
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
HTTPX_OWNERS = {"agentkey._deadline", "agentkey._http", "agentkey.testing"}


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
    """Each module imports only what its layer allows: httpx in _http alone, pure modules no I/O."""
    module = _module_name(path)
    facade = path.name == "__init__.py"
    broken: list[str] = []
    for name, line in _imports(path):
        top = name.split(".")[0]
        if top in {"httpx", "httpx2"} and module not in HTTPX_OWNERS:
            broken.append(f"line {line}: imports {name}; only agentkey/_http.py talks to httpx")
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


#: The core's vocabulary: defined in agentkey/_effects.py, and imported from there alone.
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
            if isinstance(owner, ast.Name) and owner.id in {"_http", "_protocol", "_flow"}:
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
