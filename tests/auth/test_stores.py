"""Token stores: memory, encrypted file (AES-GCM at rest, atomic replace), the Protocol."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import SecretStr

from agentkey import AuthError, ConfigurationError
from agentkey.auth import EncryptedFileTokenStore, MemoryTokenStore, RefreshTokenGrant, TokenStore
from tests.auth._idp import IdP
from tests.auth.conftest import PUBLIC_CLIENT


@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> TokenStore:
    """Each store implementation."""
    if request.param == "memory":
        return MemoryTokenStore()
    return EncryptedFileTokenStore(
        tmp_path / "tokens.bin", key=EncryptedFileTokenStore.generate_key()
    )


def test_store_round_trip(store: TokenStore) -> None:
    """save/load/delete behave like a dict; delete of a missing key is fine."""
    assert isinstance(store, TokenStore)
    assert store.load("a") is None
    store.save("a", SecretStr("one"))
    store.save("b", SecretStr("two"))
    store.save("a", SecretStr("three"))
    loaded = store.load("a")
    assert loaded is not None
    assert loaded.get_secret_value() == "three"
    store.delete("a")
    store.delete("missing")
    assert store.load("a") is None
    b = store.load("b")
    assert b is not None
    assert b.get_secret_value() == "two"


@given(key=st.text(min_size=1, max_size=40), value=st.text(min_size=1, max_size=200))
def test_encrypted_file_round_trips_any_text(key: str, value: str) -> None:
    """Any key and secret text survives a write and a read by a fresh store object."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        secret_key = EncryptedFileTokenStore.generate_key()
        path = Path(tmp) / "t.bin"
        EncryptedFileTokenStore(path, key=secret_key).save(key, SecretStr(value))
        loaded = EncryptedFileTokenStore(path, key=SecretStr(secret_key)).load(key)
        assert loaded is not None
        assert loaded.get_secret_value() == value


def test_file_is_encrypted_private_and_replaced_atomically(tmp_path: Path) -> None:
    """The file holds no plaintext, is mode 0600, and no temporary file is left behind."""
    path = tmp_path / "sub" / "tokens.bin"
    store = EncryptedFileTokenStore(path, key=os.urandom(32))
    store.save("refresh_token:client", SecretStr("rt-very-secret-value"))
    blob = path.read_bytes()
    assert b"rt-very-secret-value" not in blob
    assert b"refresh_token:client" not in blob
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert os.listdir(path.parent) == ["tokens.bin"]
    assert "rt-very-secret-value" not in repr(store)


def test_wrong_key_or_tampering_is_an_auth_error(tmp_path: Path) -> None:
    """A wrong key or an altered file raises AuthError saying what to do, never garbage."""
    path = tmp_path / "tokens.bin"
    EncryptedFileTokenStore(path, key=os.urandom(32)).save("k", SecretStr("v"))
    with pytest.raises(AuthError, match="wrong key"):
        EncryptedFileTokenStore(path, key=os.urandom(32)).load("k")
    other = tmp_path / "other.bin"
    other.write_bytes(b"not a store")
    with pytest.raises(AuthError, match="not an agentkey token store"):
        EncryptedFileTokenStore(other, key=os.urandom(32)).load("k")


@pytest.mark.parametrize("key", [b"short", "not base64!", "", SecretStr("AAAA")])
def test_bad_store_keys_are_refused(tmp_path: Path, key: str | bytes | SecretStr) -> None:
    """Only a 256-bit key (raw or base64) is accepted."""
    with pytest.raises(ConfigurationError, match="32 random bytes"):
        EncryptedFileTokenStore(tmp_path / "t.bin", key=key)


def test_concurrent_saves_keep_every_entry(tmp_path: Path) -> None:
    """Saves from many threads through one store lose nothing."""
    key = os.urandom(32)
    store = EncryptedFileTokenStore(tmp_path / "t.bin", key=key)
    threads = [
        threading.Thread(target=store.save, args=(f"k{i}", SecretStr(f"v{i}"))) for i in range(16)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    fresh = EncryptedFileTokenStore(tmp_path / "t.bin", key=key)
    assert all(fresh.load(f"k{i}") is not None for i in range(16))


async def test_rotation_survives_a_restart_through_the_file(idp: IdP, tmp_path: Path) -> None:
    """A rotated refresh token written to the file is what a restarted orchestrator uses."""
    key = EncryptedFileTokenStore.generate_key()
    path = tmp_path / "tokens.bin"
    first = idp.grant_refresh_token(PUBLIC_CLIENT)

    def provider() -> RefreshTokenGrant:
        return RefreshTokenGrant(
            idp.url + "/token",
            PUBLIC_CLIENT,
            auth_method="none",
            refresh_token=first,  # the configured, soon spent, bootstrap token
            store=EncryptedFileTokenStore(path, key=key),
        )

    assert await provider().aget_token()
    assert provider().get_token()  # a new process: reads the rotated token from the file
    assert idp.hits["refresh_token"] == 2
    assert first in idp.spent_refresh
