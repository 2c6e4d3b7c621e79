"""Development sessions: ``nox -s tests``, ``lint``, ``typecheck``, ``docs``, ``bench``."""

from __future__ import annotations

from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = False
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests", "lint", "typecheck"]

PYPROJECT = nox.project.load_toml("pyproject.toml")
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
EXTRAS = ".[server,langchain,langgraph]"


def _install(session: nox.Session, *groups: str) -> None:
    deps = [dep for group in groups for dep in nox.project.dependency_groups(PYPROJECT, group)]
    session.install("-e", EXTRAS, *deps)


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
    """Run the test suite (needs redis-server on PATH; the tests start it)."""
    _install(session, "test")
    session.run("pytest", *session.posargs)


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
def bench(session: nox.Session) -> None:
    """Run the benchmarks; each prints agentkey against its baseline."""
    _install(session, "test")
    args = session.posargs or []
    for script in sorted(Path("bench").glob("bench_*.py")):
        session.run("python", str(script), *args)
