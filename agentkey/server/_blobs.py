"""Blob stores for large responses: the record keeps only the blob's URI."""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import tempfile
import time
from pathlib import Path
from typing import Protocol, runtime_checkable
from urllib.parse import unquote, urlsplit

from .._exceptions import ConfigurationError, StoreError

__all__ = ["BlobStore", "FileBlobStore"]

_NAME = re.compile(r"[0-9a-f]{32}\.blob")


@runtime_checkable
class BlobStore(Protocol):
    """Where response bodies above ``max_inline_bytes`` are kept.

    An S3-compatible store fits the same three methods; the URIs it returns
    are opaque to the middleware.
    """

    async def put(self, data: bytes) -> str:
        """Store ``data``; return a URI that :meth:`get` accepts."""
        ...

    async def get(self, uri: str) -> bytes:
        """The bytes stored under ``uri``; raise StoreError when they are gone."""
        ...

    async def delete(self, uri: str) -> None:
        """Remove ``uri`` if it exists."""
        ...


class FileBlobStore:
    """Blobs as files in one directory, written atomically.

    Without ``directory``, a private per-user directory under the system temp
    dir is used. Every replica that can replay a record must see the same
    directory (a shared volume), else use an object store. Files do not expire by
    themselves: call :meth:`purge` from a periodic job with the result TTL.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        default = directory is None
        if directory is None:
            suffix = f"-{os.getuid()}" if hasattr(os, "getuid") else ""
            directory = Path(tempfile.gettempdir()) / f"agentkey-blobs{suffix}"
        self.directory = Path(directory).resolve()
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            info = self.directory.stat()
        except OSError as exc:
            raise ConfigurationError(
                f"FileBlobStore cannot use directory {str(self.directory)!r}: {exc.strerror}"
            ) from None
        # The shared temp dir is writable by everyone: refuse a default directory
        # that someone else created or that others can read.
        if (
            default
            and hasattr(os, "getuid")
            and (info.st_uid != os.getuid() or info.st_mode & 0o077)
        ):
            raise ConfigurationError(
                f"the default blob directory {str(self.directory)!r} is not private to this "
                "user; pass FileBlobStore(<a directory you control>) explicitly"
            )

    def __repr__(self) -> str:
        return f"FileBlobStore({str(self.directory)!r})"

    def _path(self, uri: str) -> Path:
        parts = urlsplit(uri)
        path = Path(unquote(parts.path))
        if (
            parts.scheme != "file"
            or path.parent != self.directory
            or not _NAME.fullmatch(path.name)
        ):
            raise StoreError(f"blob URI {uri!r} does not belong to {self!r}")
        return path

    def _put(self, data: bytes) -> str:
        name = f"{secrets.token_hex(16)}.blob"
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, self.directory / name)
        except OSError as exc:
            Path(tmp).unlink(missing_ok=True)
            raise StoreError(f"could not write a blob to {self!r}: {exc.strerror}") from None
        return (self.directory / name).as_uri()

    def _get(self, uri: str) -> bytes:
        try:
            return self._path(uri).read_bytes()
        except OSError as exc:
            raise StoreError(
                f"blob {uri!r} could not be read ({exc.strerror}); it was purged or the "
                "directory is not shared with the replica that stored it"
            ) from None

    async def put(self, data: bytes) -> str:
        return await asyncio.to_thread(self._put, bytes(data))

    async def get(self, uri: str) -> bytes:
        return await asyncio.to_thread(self._get, uri)

    async def delete(self, uri: str) -> None:
        path = self._path(uri)
        await asyncio.to_thread(path.unlink, missing_ok=True)

    def purge(self, *, older_than: float) -> int:
        """Delete blobs older than ``older_than`` seconds; return how many went."""
        cutoff = time.time() - older_than
        removed = 0
        for path in self.directory.glob("*.blob"):
            removed += self._unlink_if_older(path, cutoff)
        return removed

    @staticmethod
    def _unlink_if_older(path: Path, cutoff: float) -> int:
        try:
            if path.stat().st_mtime < cutoff:
                path.unlink()
                return 1
        except FileNotFoundError:  # purged concurrently
            pass
        return 0
