"""Which journal an invoker gets when it is given none (``$AGENTKEY_JOURNAL``, the data dir)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from agentkey import ConfigurationError
from agentkey.journal import MemoryJournal, SQLiteJournal, _default
from agentkey.journal._default import ENV


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
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A default file that cannot be made (the data directory is a file, say) warns that
    restarts lose the record, and uses memory."""
    (tmp_path / "not-a-directory").write_text("")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "not-a-directory"))
    with caplog.at_level(logging.WARNING, logger="agentkey"):
        journal = _default.resolve_journal(None)
    assert isinstance(journal, MemoryJournal)
    assert "a restarted process will not know what this one sent" in caplog.text
    assert ENV in caplog.text


def test_a_symlinked_default_directory_is_refused(tmp_path: Path) -> None:
    """A symlink where the default directory goes (planted by someone else, maybe) is refused,
    not worked around with a memory journal."""
    _symlinked_directory(tmp_path)
    with pytest.raises(ConfigurationError, match="symlink"):
        _default.resolve_journal(None)
    assert not (tmp_path / "elsewhere" / "journal.sqlite3").exists()


def test_an_unusable_file_the_user_named_is_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A path set in ``$AGENTKEY_JOURNAL`` that cannot be used raises: no silent fallback."""
    monkeypatch.setenv(ENV, str(_symlinked_directory(tmp_path)))
    with pytest.raises(ConfigurationError, match="symlink"):
        _default.resolve_journal(None)


def _planted(tmp_path: Path, *, dir_mode: int, file_mode: int | None, owner: int | None) -> Path:
    """The default directory (and file) as another user could have left them."""
    directory = tmp_path / "data" / "agentkey"
    directory.mkdir(parents=True)
    os.chmod(directory, dir_mode)
    path = directory / "journal.sqlite3"
    if file_mode is not None:
        SQLiteJournal(path).close()  # a real journal, with a planted record in it, say
        os.chmod(path, file_mode)
    if owner is not None:
        os.chown(path if file_mode is not None else directory, owner, owner)
    return path


@pytest.mark.parametrize(
    ("dir_mode", "file_mode", "owner", "what"),
    [
        (0o777, None, None, "directory"),
        (0o755, None, None, "directory"),
        (0o700, 0o666, None, "file"),
        (0o700, 0o644, None, "file"),
        (0o700, 0o600, 65534, "file"),
        (0o700, None, 65534, "directory"),
    ],
    ids=["dir-0777", "dir-0755", "file-0666", "file-0644", "file-not-mine", "dir-not-mine"],
)
def test_a_default_journal_that_is_not_private_is_refused_with_the_fix(
    tmp_path: Path, dir_mode: int, file_mode: int | None, owner: int | None, what: str
) -> None:
    """The default directory must be the user's own with mode 0700 and the file 0600 (as the
    docs promise): anything else is refused, naming it and how to fix it, and never used."""
    if owner is not None and os.getuid() != 0:
        pytest.skip("giving a file to another user needs root")
    path = _planted(tmp_path, dir_mode=dir_mode, file_mode=file_mode, owner=owner)
    with pytest.raises(ConfigurationError, match="not private to this user") as caught:
        _default.resolve_journal(None)
    message = str(caught.value)
    assert f"{what} {str(path if what == 'file' else path.parent)!r}" in message
    assert "chmod 700" in message
    assert "chmod 600" in message
    with pytest.raises(ConfigurationError, match="not private"):
        SQLiteJournal()  # the default location, asked for by name too


def test_the_default_journal_is_made_private(tmp_path: Path) -> None:
    """The default journal is created 0600 in a 0700 directory, and opens again."""
    journal = _default.resolve_journal(None)
    assert isinstance(journal, SQLiteJournal)
    path = tmp_path / "data" / "agentkey" / "journal.sqlite3"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    SQLiteJournal().close()
