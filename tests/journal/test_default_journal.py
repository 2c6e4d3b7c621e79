"""Which journal an invoker gets when it is given none (``$AGENTKEY_JOURNAL``, the data dir)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from agentkey import ConfigurationError
from agentkey.journal import ENV, MemoryJournal, SQLiteJournal, _default


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each test starts with no shared journal and its own data directory."""
    monkeypatch.setattr(_default, "_shared", {})
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.delenv(ENV, raising=False)


@pytest.mark.parametrize("setting", ["off", "OFF", " none ", "false", "0"])
def test_the_environment_turns_the_journal_off(
    monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    """``$AGENTKEY_JOURNAL=off`` (and its spellings) gives invokers no journal."""
    monkeypatch.setenv(ENV, setting)
    assert _default.resolve_journal(None) is None


def test_false_means_no_journal_and_a_journal_is_used_as_given() -> None:
    """``journal=False`` is none; a journal object is used as it is."""
    given = MemoryJournal()
    assert _default.resolve_journal(False) is None
    assert _default.resolve_journal(given) is given


@pytest.mark.parametrize("bad", ["journal.sqlite3", True, 0, object()])
def test_anything_else_is_refused(bad: Any) -> None:
    """A path string or any other object is refused with what to pass instead."""
    with pytest.raises(ConfigurationError, match="journal must be a journal"):
        _default.resolve_journal(bad)


def test_memory_is_one_journal_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """``$AGENTKEY_JOURNAL=memory``: every invoker of the process shares one MemoryJournal."""
    monkeypatch.setenv(ENV, "memory")
    first = _default.resolve_journal(None)
    assert isinstance(first, MemoryJournal)
    assert _default.resolve_journal(None) is first


def test_the_default_is_a_file_in_the_data_directory(tmp_path: Path) -> None:
    """With nothing set, the journal is ``<data dir>/agentkey/journal.sqlite3``, shared."""
    journal = _default.resolve_journal(None)
    assert isinstance(journal, SQLiteJournal)
    assert (tmp_path / "data" / "agentkey" / "journal.sqlite3").exists()
    assert _default.resolve_journal(None) is journal


def _symlinked_directory(tmp_path: Path) -> Path:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "agentkey").symlink_to(tmp_path / "elsewhere")
    return tmp_path / "data" / "agentkey" / "journal.sqlite3"


def test_an_unusable_default_file_falls_back_to_memory_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A default file that cannot be used warns that restarts lose the record, and uses memory."""
    _symlinked_directory(tmp_path)
    with caplog.at_level(logging.WARNING, logger="agentkey"):
        journal = _default.resolve_journal(None)
    assert isinstance(journal, MemoryJournal)
    assert "a restarted process will not know what this one sent" in caplog.text
    assert ENV in caplog.text


def test_an_unusable_file_the_user_named_is_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A path set in ``$AGENTKEY_JOURNAL`` that cannot be used raises: no silent fallback."""
    monkeypatch.setenv(ENV, str(_symlinked_directory(tmp_path)))
    with pytest.raises(ConfigurationError, match="symlink"):
        _default.resolve_journal(None)
