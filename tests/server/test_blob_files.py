"""FileBlobStore's files (issue 24 §2, §4): a cancelled write leaves none, and the default
directory in the shared temp dir is refused when someone else could have placed it."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from agentkey import ConfigurationError
from agentkey.server import FileBlobStore


class GatedBlobs(FileBlobStore):
    """A FileBlobStore whose writes wait in their worker thread until the test opens a gate."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.gate = threading.Event()
        self.writing = threading.Event()
        self.written = threading.Event()
        self.writes = 0

    def _put(self, data: bytes, *args: Any) -> str:
        self.writes += 1
        self.writing.set()
        assert self.gate.wait(30)
        try:
            return super()._put(data, *args)
        finally:
            self.written.set()


def blobs_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".blob"))


async def test_a_cancelled_put_deletes_the_file_its_thread_wrote(tmp_path: Path) -> None:
    """FileBlobStore.put cancelled mid-write: once the thread is done, no blob remains."""
    blobs = GatedBlobs(tmp_path)
    task = asyncio.ensure_future(blobs.put(b"w" * 1000))
    await asyncio.to_thread(blobs.writing.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    blobs.gate.set()
    assert await asyncio.to_thread(blobs.written.wait, 10)  # the thread wrote its file
    for _ in range(500):  # the deletion follows the thread's end
        if not await asyncio.to_thread(blobs_in, tmp_path):
            break
        await asyncio.sleep(0.01)
    assert blobs_in(tmp_path) == []


def test_the_default_blob_directory_refuses_a_symlink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A symlink planted at the default path is refused, even to a private dir of this user."""
    import tempfile

    shared_tmp = tmp_path / "tmp"
    shared_tmp.mkdir()
    target = tmp_path / "victim"
    target.mkdir(mode=0o700)
    suffix = f"-{os.getuid()}" if hasattr(os, "getuid") else ""
    (shared_tmp / f"agentkey-blobs{suffix}").symlink_to(target)
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))
    with pytest.raises(ConfigurationError, match="symlink"):
        FileBlobStore()
    assert list(target.iterdir()) == []


def test_the_default_blob_directory_is_created_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Created fresh, the default directory is 0700 and owned by this user."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    old = os.umask(0o022)
    try:
        blobs = FileBlobStore()
    finally:
        os.umask(old)
    info = blobs.directory.lstat()
    assert info.st_mode & 0o777 == 0o700
    assert info.st_uid == os.getuid()
