"""Development sessions.

- ``nox -s tests``: the default suite on the Python running nox (a few minutes).
- ``nox -s tests_all``: the default suite on every supported Python that can be found.
- ``nox -s long``: the long suites (Redis Cluster, kill runs, long property profiles).
- ``nox -s lint typecheck docs docs_examples bench``: the rest of CI.

Interpreters installed by pyenv are found without activating them; a run of
``tests_all`` that could not find one says so in its last line.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = False
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests", "lint", "typecheck"]

PYPROJECT = nox.project.load_toml("pyproject.toml")
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
EXTRAS = ".[server,langchain,langgraph,postgres]"


def _find_pyenv_interpreters() -> None:
    """Put pyenv's interpreters on PATH, so ``python3.X`` resolves without a shim setting."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found: dict[str, Path] = {}
    for bin_dir in sorted(root.glob("3.*/bin"), reverse=True):
        minor = ".".join(bin_dir.parent.name.split(".")[:2])
        if minor in PYTHONS and (bin_dir / f"python{minor}").exists():
            found.setdefault(minor, bin_dir)  # the newest patch release of each minor
    extra = [str(path) for path in found.values()]
    if extra:
        os.environ["PATH"] = os.pathsep.join([*extra, os.environ.get("PATH", "")])


def _report_missing_interpreters() -> None:
    missing = [v for v in PYTHONS if shutil.which(f"python{v}") is None]
    if missing:
        print(
            f"nox: NOT tested on Python {', '.join(missing)} (interpreter not found); "
            f"install them (for example with pyenv) to test every supported Python",
            file=sys.stderr,
        )


_find_pyenv_interpreters()
if any(arg.startswith("tests_all") for arg in sys.argv):
    atexit.register(_report_missing_interpreters)


def _install(session: nox.Session, *groups: str) -> None:
    deps = [dep for group in groups for dep in nox.project.dependency_groups(PYPROJECT, group)]
    session.install("-e", EXTRAS, *deps)


def _pytest(session: nox.Session, *args: str) -> None:
    _install(session, "test")
    # Two workers fit a 2-core machine; each starts its own redis-server and PostgreSQL.
    session.run("pytest", "-n", "2", *args, *session.posargs)


@nox.session
def tests(session: nox.Session) -> None:
    """The default suite on this Python (needs redis-server and PostgreSQL binaries)."""
    _pytest(session)


@nox.session(python=PYTHONS)
def tests_all(session: nox.Session) -> None:
    """The default suite on every supported Python that is installed."""
    _pytest(session)


@nox.session
def long(session: nox.Session) -> None:
    """Long suites: Redis Cluster, SIGKILL runs, Hypothesis's long profile."""
    _pytest(session, "-m", "long or not long", "--hypothesis-profile", "long")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint and formatting check."""
    session.install(*nox.project.dependency_groups(PYPROJECT, "lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on the package, the tests and the benchmarks."""
    _install(session, "typecheck")
    session.run("mypy", "--strict")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation with warnings as errors."""
    _install(session, "docs")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site")


@nox.session
def docs_examples(session: nox.Session) -> None:
    """Run each docs page's examples in a fresh venv built only from that page's install line."""
    session.install(*nox.project.dependency_groups(PYPROJECT, "test"))
    session.run("pytest", "-m", "docs_install", "-p", "no:cacheprovider", "tests/test_docs.py")


@nox.session
def bench(session: nox.Session) -> None:
    """Run the benchmarks; each prints agentkey against its baseline."""
    _install(session, "test")
    args = session.posargs or []
    for script in sorted(Path("bench").glob("bench_*.py")):
        session.run("python", str(script), *args)
