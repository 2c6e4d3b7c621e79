"""The framework adapters that install apart (Google ADK, CrewAI) name their extra when missing.

These run in the default suite, where neither framework is installed, and in each
framework's own nox session, where the framework is hidden from the child process.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("module", "hidden", "expected"),
    [("google_adk", "google.adk", "google-adk google.adk"), ("crewai", "crewai", "crewai crewai")],
)
def test_a_missing_framework_names_the_extra(module: str, hidden: str, expected: str) -> None:
    """Importing the adapter without its framework raises MissingExtra naming the extra."""
    code = (
        f"import sys\nsys.modules[{hidden!r}] = None\nimport agentkey\n"
        f"try:\n    import agentkey.integrations.{module}\n"
        "except agentkey.MissingExtra as exc:\n    print(exc.extra, exc.module)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected
