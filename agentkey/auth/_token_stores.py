"""Where refresh tokens live between refreshes: in memory, in an encrypted file, or your own."""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import json
import os
import secrets
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Protocol, runtime_checkable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from pydantic import SecretStr

from .._exceptions import AuthError, ConfigurationError

__all__ = ["EncryptedFileTokenStore", "MemoryTokenStore", "TokenStore"]


@runtime_checkable
class TokenStore(Protocol):
    """Persists secrets (refresh tokens) by name.

    ``save`` must be atomic and durable before it returns: a rotated refresh
    token is saved before the new access token is used, so a crash never loses
    the only valid refresh token. Calls are blocking; the async path runs them
    in a worker thread. Implement it over a database or a vault as needed.

    A store shared by several providers or processes should also offer
    ``rotation_lock(key)``: a context manager that excludes every other holder
    for ``key`` (a row lock, an advisory lock). ``RefreshTokenGrant`` holds it
    from reading the refresh token until the rotated one is saved, so two
    holders never spend the same refresh token. Entering may block; leaving
    must be quick.
    """

    def load(self, key: str) -> SecretStr | None:
        """The secret saved under ``key``, or None."""
        ...

    def save(self, key: str, value: SecretStr) -> None:
        """Save ``value`` under ``key``, replacing any earlier value."""
        ...

    def delete(self, key: str) -> None:
        """Forget ``key`` (no error if it is absent)."""
        ...


class MemoryTokenStore:
    """A thread-safe store in this process's memory (lost when the process ends)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, SecretStr] = {}
        self._rotations: dict[str, threading.Lock] = {}

    def __repr__(self) -> str:
        return f"MemoryTokenStore(<{len(self._data)} entries>)"

    def load(self, key: str) -> SecretStr | None:
        with self._lock:
            return self._data.get(key)

    def save(self, key: str, value: SecretStr) -> None:
        with self._lock:
            self._data[key] = value

    def delete(self, key: str) -> None:
        with self._lock:
            self._data.pop(key, None)

    @contextlib.contextmanager
    def rotation_lock(self, key: str) -> Iterator[None]:
        """Exclude other providers of this process from rotating ``key`` meanwhile."""
        with self._lock:
            lock = self._rotations.setdefault(key, threading.Lock())
        with lock:
            yield


_MAGIC = b"agentkey-token-store-v1\n"
_NONCE = 12


class EncryptedFileTokenStore:
    """Secrets encrypted at rest in one file (AES-256-GCM, file mode 0600).

    ``key`` is 32 random bytes, raw or URL-safe base64 (make one with
    ``EncryptedFileTokenStore.generate_key()`` and keep it in your secret
    manager, not beside the file). Each save rewrites the whole file through a
    temporary file, ``fsync`` and ``os.replace``, so a crash leaves the old or
    the new file, never half of one; temporary files a killed save left
    behind are removed by the next save.

    Every read and write holds an OS lock on ``<path>.lock`` (``flock`` on
    POSIX, ``msvcrt.locking`` on Windows), so any number of store objects,
    threads and processes may share one file without losing a write. A
    refresh-token rotation holds ``<path>.rotate.lock`` from reading the
    token until the rotated one is saved: the rotations of all processes
    sharing the file run one at a time, and each reads the token the previous
    one stored. The lock files must live on a local file system (network file
    systems may not honour the locks). A lock not obtained within
    ``lock_timeout`` seconds raises AuthError.

    No other local user can read the file or hold its locks: lock files are
    created mode 0600 (and refused when another user owns one), and the
    directories the store creates are mode 0700.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        key: str | bytes | SecretStr,
        lock_timeout: float = 60.0,
    ) -> None:
        if (
            isinstance(lock_timeout, bool)
            or not isinstance(lock_timeout, (int, float))
            or not 0 < lock_timeout < float("inf")
        ):
            raise ConfigurationError(
                f"lock_timeout must be a positive number of seconds, got {lock_timeout!r}"
            )
        self._path = Path(path)
        self._aead = AESGCM(_decode_key(key))
        self._lock_timeout = float(lock_timeout)

    def __repr__(self) -> str:
        return f"EncryptedFileTokenStore({str(self._path)!r})"

    @staticmethod
    def generate_key() -> str:
        """A new random 256-bit key, URL-safe base64; treat it as a secret."""
        return base64.urlsafe_b64encode(secrets.token_bytes(32)).decode("ascii")

    def load(self, key: str) -> SecretStr | None:
        with self._locked(".lock"):
            return self._read().get(key)

    def save(self, key: str, value: SecretStr) -> None:
        with self._locked(".lock"):
            data = self._read()
            data[key] = value
            self._write(data)

    def delete(self, key: str) -> None:
        with self._locked(".lock"):
            data = self._read()
            if data.pop(key, None) is not None:
                self._write(data)

    def rotation_lock(self, key: str) -> contextlib.AbstractContextManager[None]:
        """Exclude every other thread and process using this file from rotating meanwhile."""
        return self._locked(".rotate.lock")

    @contextlib.contextmanager
    def _locked(self, suffix: str) -> Iterator[None]:
        lock_path = self._path.with_name(self._path.name + suffix)
        try:
            _make_private_dir(lock_path.parent)
            handle = _open_lock(lock_path)
        except OSError as exc:
            raise AuthError(
                f"cannot open the lock file {str(lock_path)!r} ({exc.strerror}); "
                "check the path and its permissions"
            ) from None
        try:
            _acquire(handle, lock_path, self._lock_timeout)
            yield
        finally:
            handle.close()  # closing the file releases the lock

    def _read(self) -> dict[str, SecretStr]:
        try:
            blob = self._path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise AuthError(
                f"cannot read the token store {str(self._path)!r} ({exc.strerror}); "
                "check the path and its permissions"
            ) from None
        if not blob.startswith(_MAGIC) or len(blob) < len(_MAGIC) + _NONCE + 16:
            raise AuthError(
                f"{str(self._path)!r} is not an agentkey token store; point the store at its "
                "own file, or remove the file to start empty"
            )
        nonce = blob[len(_MAGIC) : len(_MAGIC) + _NONCE]
        try:
            plain = self._aead.decrypt(nonce, blob[len(_MAGIC) + _NONCE :], _MAGIC)
        except InvalidTag:
            raise AuthError(
                f"cannot decrypt the token store {str(self._path)!r}: wrong key, or the file "
                "was altered; use the key it was written with, or remove the file and "
                "authorise again"
            ) from None
        raw = json.loads(plain)
        return {str(k): SecretStr(str(v)) for k, v in raw.items()}

    def _write(self, data: dict[str, SecretStr]) -> None:
        plain = json.dumps({k: v.get_secret_value() for k, v in data.items()}).encode("utf-8")
        nonce = secrets.token_bytes(_NONCE)
        blob = _MAGIC + nonce + self._aead.encrypt(nonce, plain, _MAGIC)
        directory = self._path.parent
        try:
            _make_private_dir(directory)
            self._remove_orphans()
            fd, tmp = tempfile.mkstemp(prefix=f".{self._path.name}.", suffix=_TMP, dir=directory)
            try:
                with os.fdopen(fd, "wb") as handle:  # mkstemp creates it with mode 0600
                    handle.write(blob)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(tmp, self._path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            _fsync_directory(directory)
        except OSError as exc:
            raise AuthError(
                f"cannot write the token store {str(self._path)!r} ({exc.strerror}); "
                "check the path and its permissions"
            ) from None

    def _remove_orphans(self) -> None:
        """Delete temporary files of saves that were killed (the caller holds the lock).

        Exactly mkstemp's eight random characters: the store at ``tokens`` must never
        delete ``.tokens.prod.XXXXXXXX.tmp``, the save in flight of the store at
        ``tokens.prod``, which holds another lock.
        """
        pattern = f".{_glob_escape(self._path.name)}.{'?' * 8}{_TMP}"
        for orphan in self._path.parent.glob(pattern):
            with contextlib.suppress(OSError):
                orphan.unlink()


_TMP = ".agentkey-tmp"


def _make_private_dir(directory: Path) -> None:
    """Create ``directory`` and any missing parent, each mode 0700 (existing ones stay as they are).

    ``Path.mkdir(parents=True)`` gives the parents it creates the umask's mode (often
    0755), which would let other local users list the store's files.
    """
    missing = []
    for part in (directory, *directory.parents):
        if part.exists():
            break
        missing.append(part)
    for part in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            part.mkdir(mode=0o700)


def _open_lock(path: Path) -> IO[bytes]:
    """Open (creating it mode 0600) the lock file at ``path``, which must be the user's own.

    A lock file another local user can open is one they can ``flock`` to block the store's
    owner: it is never followed through a symlink, a lock file owned by someone else is
    refused, and one an older version left group- or world-readable is made 0600.
    """
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o600)
    try:
        if sys.platform != "win32":
            info = os.fstat(fd)
            if info.st_uid != os.getuid():
                owner = "the lock file belongs to another user; remove it or move the store"
                raise OSError(errno.EPERM, owner)
            if stat.S_IMODE(info.st_mode) & 0o077:
                os.fchmod(fd, 0o600)
        return os.fdopen(fd, "r+b")
    except BaseException:
        os.close(fd)
        raise


def _glob_escape(name: str) -> str:
    return "".join(f"[{ch}]" if ch in "*?[" else ch for ch in name)


if sys.platform == "win32":  # pragma: no cover - exercised on Windows only
    import msvcrt

    def _try_lock(handle: IO[bytes]) -> bool:
        handle.seek(0)
        try:
            msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True

else:
    import fcntl

    def _try_lock(handle: IO[bytes]) -> bool:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True


def _acquire(handle: IO[bytes], path: Path, timeout: float) -> None:
    """Take the OS lock on ``handle``, polling until ``timeout`` seconds have passed.

    On the real clock, whatever clock the provider runs on: the lock is held by another
    thread or process, which frees it in real time. A fake or skipping clock would spin
    through ``timeout`` while the holder is still working, and blame it wrongly.
    """
    deadline = time.monotonic() + timeout  # real time: another process holds the OS lock
    delay = 0.001
    while not _try_lock(handle):
        if time.monotonic() >= deadline:  # real time: see above
            raise AuthError(
                f"the token store lock {str(path)!r} was held by another process or thread "
                f"for more than {timeout:g} s; check for a hung process using the store, "
                "or raise lock_timeout"
            )
        time.sleep(delay)  # real time: the holder needs real time to finish
        delay = min(delay * 2, 0.05)


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable (best effort: not every platform can open a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _decode_key(key: str | bytes | SecretStr) -> bytes:
    raw: str | bytes = key.get_secret_value() if isinstance(key, SecretStr) else key
    if isinstance(raw, bytes) and len(raw) == 32:
        return raw
    try:
        text = raw.decode("ascii") if isinstance(raw, bytes) else raw
        decoded = base64.urlsafe_b64decode(text.strip().encode("ascii"))
    except (UnicodeError, ValueError, binascii.Error):
        decoded = b""
    if len(decoded) != 32:
        raise ConfigurationError(
            "the token store key must be 32 random bytes, raw or URL-safe base64; "
            "make one with EncryptedFileTokenStore.generate_key()"
        )
    return decoded
