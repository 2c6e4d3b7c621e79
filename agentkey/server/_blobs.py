"""Blob stores for large responses: the record keeps only the blob's URI."""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import stat
import tempfile
from pathlib import Path
from typing import Protocol, runtime_checkable
from urllib.parse import unquote, urlsplit

from .._clock import Clock
from .._exceptions import ConfigurationError, StoreError
from ._stores import resolve_clock

__all__ = ["BlobStore", "FileBlobStore"]

# <32 hex>.<expiry, whole Unix seconds>.blob; names without the expiry predate it.
_NAME = re.compile(r"[0-9a-f]{32}(?:\.([0-9]{1,15}))?\.blob")


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


def _private_directory(path: Path) -> Path:
    """``path`` as a directory only this user can use, created 0700 if missing.

    The shared temp dir is writable by everyone, so someone else may have put
    something at ``path`` first: a symlink (to a directory of this user's,
    which ``resolve()`` would follow), or a directory they own or can read.
    Each is refused. The check opens the directory without following a link
    (``O_NOFOLLOW``) and inspects what it opened, so nothing can be swapped in
    between the check and the use.
    """

    def refuse(why: str) -> ConfigurationError:
        return ConfigurationError(
            f"the default blob directory {str(path)!r} {why}; pass FileBlobStore(<a directory "
            "you control>) explicitly"
        )

    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise refuse(f"cannot be created ({exc.strerror})") from None
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            raise refuse("is a symlink, which another user may have planted")
        flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(path, flags)
    except OSError as exc:
        raise refuse(f"cannot be opened as a directory ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if hasattr(os, "getuid") and (info.st_uid != os.getuid() or info.st_mode & 0o077):
            raise refuse("is not private to this user")
        if not stat.S_ISDIR(info.st_mode):
            raise refuse("is not a directory")
    finally:
        os.close(fd)
    return path


class FileBlobStore:
    """Blobs as files in one directory, written atomically, expiring after ``ttl``.

    Without ``directory``, a private per-user directory under the system temp
    dir is used. Every replica that can replay a record must see the same
    directory (a shared volume), else use an object store.

    Each blob expires ``ttl`` seconds (set it to the middleware's
    ``result_ttl``; default 24 h) plus ``GRACE`` after it is written: its
    record, finished just after, is gone by then. The expiry is part of the
    file name. A :meth:`put` removes expired blobs (and temp files left by a
    killed write) at most once every ``SWEEP_INTERVAL`` seconds, so the
    directory holds only the blobs of live records. An expired blob is never
    served: :meth:`get` raises :class:`~agentkey.StoreError` as for a missing one.
    Expiries are on ``clock``'s wall time (``clock.time()``, shared by every replica);
    tests pass ``agentkey.testing.FakeClock``.
    """

    #: Seconds a blob outlives ``ttl``: its record's TTL starts a moment later, at
    #: finish, and replicas' clocks differ a little.
    GRACE = 300.0
    #: Least seconds between two sweeps of expired blobs (each lists the directory once).
    SWEEP_INTERVAL = 60.0
    #: Seconds after which a temp file is taken for the leftover of a killed write.
    STALE_TEMP = 3600.0

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        ttl: float = 86_400.0,
        clock: Clock | None = None,
    ) -> None:
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl < 1e10:
            raise ConfigurationError(
                f"FileBlobStore ttl is a positive number of seconds (the middleware's "
                f"result_ttl), got {ttl!r}"
            )
        self.ttl = float(ttl)
        self._clock = resolve_clock(clock, "FileBlobStore")
        self._next_sweep = float("-inf")
        if directory is None:
            suffix = f"-{os.getuid()}" if hasattr(os, "getuid") else ""
            # The temp dir itself may be a symlink (macOS: /tmp): resolve it, never our name.
            self.directory = _private_directory(
                Path(tempfile.gettempdir()).resolve() / f"agentkey-blobs{suffix}"
            )
            return
        self.directory = Path(directory).resolve()
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise ConfigurationError(
                f"FileBlobStore cannot use directory {str(self.directory)!r}: {exc.strerror}"
            ) from None

    def __repr__(self) -> str:
        return f"FileBlobStore({str(self.directory)!r})"

    def _path(self, uri: str) -> tuple[Path, float | None]:
        """The file of ``uri`` and its expiry (None for a blob named before expiries)."""
        parts = urlsplit(uri)
        path = Path(unquote(parts.path))
        name = _NAME.fullmatch(path.name)
        if parts.scheme != "file" or path.parent != self.directory or name is None:
            raise StoreError(f"blob URI {uri!r} does not belong to {self!r}")
        return path, None if name[1] is None else float(name[1])

    def _name(self) -> str:
        """A new blob's file name, its expiry in it."""
        expires = int(self._clock.time() + self.ttl + self.GRACE) + 1
        return f"{secrets.token_hex(16)}.{expires}.blob"

    def _put(self, data: bytes, name: str) -> str:
        now = self._clock.time()
        if now >= self._next_sweep:
            self._next_sweep = now + self.SWEEP_INTERVAL
            self._sweep(now)
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
        path, expires = self._path(uri)
        if expires is not None and expires <= self._clock.time():
            path.unlink(missing_ok=True)
            raise StoreError(
                f"blob {uri!r} expired and was purged; its record outlived the blob "
                "store's ttl, so set FileBlobStore(ttl=...) to at least the middleware's "
                "result_ttl"
            )
        try:
            return path.read_bytes()
        except OSError as exc:
            raise StoreError(
                f"blob {uri!r} could not be read ({exc.strerror}); it was purged or the "
                "directory is not shared with the replica that stored it"
            ) from None

    async def put(self, data: bytes) -> str:
        """Write ``data`` in a worker thread; a cancelled put leaves no file behind.

        The thread cannot be stopped, so a put cancelled while it writes deletes
        the blob once the thread is done: nobody will ever name it.
        """
        name = self._name()
        written = asyncio.get_running_loop().run_in_executor(None, self._put, bytes(data), name)
        try:
            return await asyncio.shield(written)
        except asyncio.CancelledError:
            written.add_done_callback(lambda _: (self.directory / name).unlink(missing_ok=True))
            raise

    async def get(self, uri: str) -> bytes:
        return await asyncio.to_thread(self._get, uri)

    async def delete(self, uri: str) -> None:
        path, _ = self._path(uri)
        await asyncio.to_thread(path.unlink, missing_ok=True)

    def _sweep(self, now: float) -> int:
        """Delete expired blobs and stale temp files; return how many blobs went."""
        removed = 0
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return 0  # the next put raises the real problem
        for entry in entries:
            if entry.name.startswith(".tmp-"):
                self._unlink_if_older(Path(entry.path), now - self.STALE_TEMP)
                continue
            name = _NAME.fullmatch(entry.name)
            if name is None:
                continue
            if name[1] is None:  # written before expiries: by its age
                removed += self._unlink_if_older(Path(entry.path), now - self.ttl - self.GRACE)
            elif float(name[1]) <= now:
                removed += self._unlink_if_older(Path(entry.path), float("inf"))
        return removed

    def purge(self, *, older_than: float | None = None) -> int:
        """Delete expired blobs now; with ``older_than`` (seconds), every blob written
        longer ago than that too. Return how many went."""
        now = self._clock.time()
        removed = self._sweep(now)
        if older_than is not None:
            cutoff = now - older_than
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
