"""Where refresh tokens live between refreshes: in memory, in an encrypted file, or your own."""

from __future__ import annotations

import base64
import binascii
import json
import os
import secrets
import tempfile
import threading
from pathlib import Path
from typing import Protocol, runtime_checkable

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


_MAGIC = b"agentkey-token-store-v1\n"
_NONCE = 12


class EncryptedFileTokenStore:
    """Secrets encrypted at rest in one file (AES-256-GCM, file mode 0600).

    ``key`` is 32 random bytes, raw or URL-safe base64 (make one with
    ``EncryptedFileTokenStore.generate_key()`` and keep it in your secret
    manager, not beside the file). Each save rewrites the whole file through a
    temporary file, ``fsync`` and ``os.replace``, so a crash leaves the old or
    the new file, never half of one. Saves within one process are serialised;
    several processes must not share one file.
    """

    def __init__(self, path: str | os.PathLike[str], *, key: str | bytes | SecretStr) -> None:
        self._path = Path(path)
        self._aead = AESGCM(_decode_key(key))
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"EncryptedFileTokenStore({str(self._path)!r})"

    @staticmethod
    def generate_key() -> str:
        """A new random 256-bit key, URL-safe base64; treat it as a secret."""
        return base64.urlsafe_b64encode(secrets.token_bytes(32)).decode("ascii")

    def load(self, key: str) -> SecretStr | None:
        with self._lock:
            return self._read().get(key)

    def save(self, key: str, value: SecretStr) -> None:
        with self._lock:
            data = self._read()
            data[key] = value
            self._write(data)

    def delete(self, key: str) -> None:
        with self._lock:
            data = self._read()
            if data.pop(key, None) is not None:
                self._write(data)

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
            directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self._path.name}.", dir=directory)
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
