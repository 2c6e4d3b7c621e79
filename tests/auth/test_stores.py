"""Token stores: memory, encrypted file (AES-GCM at rest, atomic replace), the Protocol."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import SecretStr

from agentkey import AuthError, ConfigurationError
from agentkey.auth import (
    ClientAuth,
    EncryptedFileTokenStore,
    RefreshTokenGrant,
    TokenStore,
)
from agentkey.auth._token_stores import MemoryTokenStore
from tests.auth._idp import IdP
from tests.auth.conftest import CLIENT_ID, CLIENT_SECRET, PUBLIC_CLIENT


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


# Each example writes a file with two fsyncs: a quarter of the profile's examples (25 by
# default, 500 under `long`); 100 took 17 s of the default suite at load 16.
@settings(max_examples=settings().max_examples // 4)
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
    assert sorted(os.listdir(path.parent)) == ["tokens.bin", "tokens.bin.lock"]  # no temp file
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
            client=ClientAuth(PUBLIC_CLIENT, method="none"),
            refresh_token=first,  # the configured, soon spent, bootstrap token
            store=EncryptedFileTokenStore(path, key=key),
        )

    assert await provider().aget_token()
    assert provider().get_token()  # a new process: reads the rotated token from the file
    assert idp.hits["refresh_token"] == 2
    assert first in idp.spent_refresh


def test_two_store_objects_on_one_file_lose_no_write(tmp_path: Path) -> None:
    """Two store objects on one file (as after a restart), saving from threads, lose nothing."""
    key = os.urandom(32)
    stores = [EncryptedFileTokenStore(tmp_path / "t.bin", key=key) for _ in range(2)]

    def save_many(which: int) -> None:
        for i in range(40):
            stores[which].save(f"s{which}-{i}", SecretStr(f"v{i}"))

    threads = [threading.Thread(target=save_many, args=(w,)) for w in (0, 1, 0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    fresh = EncryptedFileTokenStore(tmp_path / "t.bin", key=key)
    missing = [(w, i) for w in (0, 1) for i in range(40) if fresh.load(f"s{w}-{i}") is None]
    assert missing == []


def test_a_killed_saves_temp_file_is_removed_by_the_next_save(tmp_path: Path) -> None:
    """A killed save's temp file goes at the next save; another store's save in flight stays."""
    path = tmp_path / "tokens.bin"
    store = EncryptedFileTokenStore(path, key=os.urandom(32))
    store.save("a", SecretStr("one"))
    orphan = tmp_path / ".tokens.bin.k1ll3d_x.agentkey-tmp"  # what mkstemp made before SIGKILL
    orphan.write_bytes(b"agentkey-token-store-v1\n half written")
    # The save in flight of another store, whose file name starts with this one's.
    neighbour = tmp_path / ".tokens.bin.prod.a1b2c3d4.agentkey-tmp"
    neighbour.write_bytes(b"agentkey-token-store-v1\n being written")
    store.save("b", SecretStr("two"))
    assert not orphan.exists()
    assert neighbour.exists()
    neighbour.unlink()
    assert sorted(os.listdir(tmp_path)) == ["tokens.bin", "tokens.bin.lock"]


def test_a_held_lock_times_out_with_an_auth_error(tmp_path: Path) -> None:
    """A store whose lock another holder keeps raises AuthError after lock_timeout, not a hang."""
    path = tmp_path / "tokens.bin"
    holder = EncryptedFileTokenStore(path, key=os.urandom(32))
    waiter = EncryptedFileTokenStore(path, key=os.urandom(32), lock_timeout=0.2)
    with (
        holder.rotation_lock("k"),
        pytest.raises(AuthError, match="lock_timeout"),
        waiter.rotation_lock("k"),
    ):
        pass


_ROTATOR = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from agentkey.auth import EncryptedFileTokenStore, RefreshTokenGrant, TokenPolicy

    url, client, secret, path, key, go, rounds = sys.argv[1:]
    provider = RefreshTokenGrant(
        url + "/token", client, secret,
        store=EncryptedFileTokenStore(path, key=key),
        policy=TokenPolicy(max_attempts=1),
    )
    Path(path + ".ready-" + str(id(provider))).touch()
    while not Path(go).exists():
        time.sleep(0.005)
    for _ in range(int(rounds)):
        provider.invalidate()  # every call now renews: a rotation each time
        provider.get_token()
    """
)


def test_two_processes_sharing_one_store_never_spend_a_refresh_token_twice(
    idp: IdP, tmp_path: Path
) -> None:
    """Two processes rotating one stored refresh token take turns: no reuse, no lost rotation."""
    first = idp.grant_refresh_token(CLIENT_ID)
    key = EncryptedFileTokenStore.generate_key()
    path = tmp_path / "tokens.bin"
    seed = RefreshTokenGrant(
        idp.url + "/token", CLIENT_ID, CLIENT_SECRET, store=EncryptedFileTokenStore(path, key=key)
    )
    seed_store = EncryptedFileTokenStore(path, key=key)
    seed_store.save(seed.store_key, SecretStr(first))
    go = tmp_path / "go"
    rounds = 15
    argv = [idp.url, CLIENT_ID, CLIENT_SECRET, str(path), key, str(go), str(rounds)]
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _ROTATOR, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("tokens.bin.ready-*"))) < 2:
        assert time.monotonic() < deadline, "the child processes did not start"
        time.sleep(0.01)
    go.touch()  # both start rotating at the same moment
    outcomes = [child.communicate(timeout=120) for child in children]
    assert [child.returncode for child in children] == [0, 0], outcomes
    assert idp.hits["refresh_token"] == 2 * rounds
    assert len(idp.spent_refresh) == 2 * rounds  # every rotation spent a live token, once
    stored = seed_store.load(seed.store_key)
    assert stored is not None
    assert stored.get_secret_value() in idp.refresh  # the last rotation was kept, and is live


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_two_providers_on_one_store_take_turns_rotating(
    idp: IdP, tmp_path: Path, kind: str
) -> None:
    """Two providers (own store objects on one file, or one memory store) never reuse a token."""
    first = idp.grant_refresh_token(CLIENT_ID)
    key = EncryptedFileTokenStore.generate_key()
    shared = MemoryTokenStore()

    def store() -> TokenStore:
        if kind == "memory":
            return shared
        return EncryptedFileTokenStore(tmp_path / "tokens.bin", key=key)

    providers = [
        RefreshTokenGrant(idp.url + "/token", CLIENT_ID, CLIENT_SECRET, store=store())
        for _ in range(2)
    ]
    store().save(providers[0].store_key, SecretStr(first))
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def rotate(provider: RefreshTokenGrant) -> None:
        barrier.wait()
        try:
            for _ in range(10):
                provider.invalidate()
                provider.get_token()
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=rotate, args=(p,)) for p in providers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert idp.hits["refresh_token"] == 20
    assert len(idp.spent_refresh) == 20


def test_lock_files_and_new_directories_are_private(tmp_path: Path) -> None:
    """Lock files are 0600 and every directory the store creates is 0700, whatever the umask."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    path = shared / "a" / "b" / "tokens.bin"
    store = EncryptedFileTokenStore(path, key=os.urandom(32))
    old = os.umask(0o022)
    try:
        store.save("k", SecretStr("v"))
        with store.rotation_lock("k"):
            pass
    finally:
        os.umask(old)
    for name in ("tokens.bin.lock", "tokens.bin.rotate.lock"):
        assert stat.S_IMODE((path.parent / name).stat().st_mode) == 0o600, name
    for directory in (shared / "a", shared / "a" / "b"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755  # an existing directory is left alone


def test_a_readable_lock_file_left_by_an_older_version_is_made_private(tmp_path: Path) -> None:
    """A lock file created 0644 before this release is narrowed to 0600 on first use."""
    path = tmp_path / "tokens.bin"
    lock = tmp_path / "tokens.bin.lock"
    lock.touch()
    lock.chmod(0o644)
    EncryptedFileTokenStore(path, key=os.urandom(32)).save("k", SecretStr("v"))
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX symlinks and owners")
def test_a_planted_lock_file_is_refused(tmp_path: Path) -> None:
    """A symlinked lock file, or one another user owns, is an AuthError, never a lock to share."""
    path = tmp_path / "tokens.bin"
    store = EncryptedFileTokenStore(path, key=os.urandom(32))
    target = tmp_path / "elsewhere"
    (tmp_path / "tokens.bin.lock").symlink_to(target)
    with pytest.raises(AuthError, match="lock file"):
        store.save("k", SecretStr("v"))
    assert not target.exists()
    if os.geteuid() != 0:
        return  # only root can give a file to another user
    (tmp_path / "tokens.bin.lock").unlink()
    (tmp_path / "tokens.bin.lock").touch()
    os.chown(tmp_path / "tokens.bin.lock", 65534, 65534)
    with pytest.raises(AuthError, match="belongs to another user"):
        store.save("k", SecretStr("v"))
