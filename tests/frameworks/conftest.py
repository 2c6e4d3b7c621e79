"""Fixtures of the framework tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _crewai_storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CrewAI keeps each kickoff's task outputs in a SQLite file under the user's data folder,
    named after the working directory: shared by every run and every CrewAI version on the
    machine. Each test (and the processes it starts) gets a folder of its own."""
    monkeypatch.setenv("CREWAI_STORAGE_DIR", str(tmp_path / "crewai"))
