"""FileBlobStore expiry: blobs follow the result TTL, are swept as the server writes, and an
expired blob is refused, never served."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentkey import ConfigurationError, StoreError
from agentkey.server import FileBlobStore, IdempotencyMiddleware, MemoryStore, ServerOptions
from agentkey.testing import FakeClock
from tests.server._apps import tool_app
from tests.server._util import request_for

HOUR = 3600.0


def _blobs(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.blob"))


async def test_a_blob_expires_after_its_ttl_and_is_then_refused(tmp_path: Path) -> None:
    """A blob is readable for ttl (plus a grace that covers its record); after that get() raises
    StoreError naming the fix, and the file is gone."""
    clock = FakeClock(wall=1_800_000_000.0)
    blobs = FileBlobStore(tmp_path, ttl=2 * HOUR, clock=clock)
    uri = await blobs.put(b"answer")
    clock.advance(2 * HOUR + FileBlobStore.GRACE - 1)
    assert await blobs.get(uri) == b"answer"
    clock.advance(2)
    with pytest.raises(StoreError, match=r"expired .*result_ttl"):
        await blobs.get(uri)
    assert _blobs(tmp_path) == []


async def test_writing_sweeps_expired_blobs_at_most_once_per_interval(tmp_path: Path) -> None:
    """Blobs nobody reads again are deleted by later puts (and a killed write's temp file, and a
    blob named before expiries by its age), so the directory follows the live records."""
    clock = FakeClock(wall=1_800_000_000.0)
    blobs = FileBlobStore(tmp_path, ttl=HOUR, clock=clock)
    old = [await blobs.put(b"old %d" % i) for i in range(20)]
    stale_temp = tmp_path / ".tmp-killed"
    legacy_old, legacy_new = tmp_path / ("a" * 32 + ".blob"), tmp_path / ("b" * 32 + ".blob")
    for path in (stale_temp, legacy_old, legacy_new):
        path.write_bytes(b"x")
    clock.advance(HOUR + FileBlobStore.GRACE + 1)  # every "old" blob has expired
    for path, age in (
        (stale_temp, FileBlobStore.STALE_TEMP + 1),
        (legacy_old, HOUR + FileBlobStore.GRACE + 1),  # named before expiries: mtime + ttl
        (legacy_new, HOUR),
    ):
        os.utime(path, (clock.time() - age, clock.time() - age))
    fresh = await blobs.put(b"fresh")
    assert _blobs(tmp_path) == sorted([blobs._path(fresh)[0], legacy_new])
    assert not stale_temp.exists()
    for uri in old:
        with pytest.raises(StoreError):
            await blobs.get(uri)

    # Within SWEEP_INTERVAL of that sweep a put does not list the directory again; later one does.
    expired = tmp_path / f"{'c' * 32}.{int(clock.time()) - 1}.blob"
    expired.write_bytes(b"x")
    await blobs.put(b"newer")
    assert expired.exists()
    clock.advance(FileBlobStore.SWEEP_INTERVAL)
    await blobs.put(b"newest")
    assert not expired.exists()
    assert blobs.purge() == 0  # nothing else has expired
    assert blobs.purge(older_than=-1) == 4  # fresh, newer, newest and legacy_new: every blob


@pytest.mark.parametrize("ttl", [0, -1, True, "1h", float("inf")])
def test_blob_ttl_must_be_positive_seconds(tmp_path: Path, ttl: Any) -> None:
    """A blob TTL that is not a positive number of seconds is refused at construction."""
    with pytest.raises(ConfigurationError, match="ttl"):
        FileBlobStore(tmp_path, ttl=ttl)


async def test_replay_of_a_record_whose_blob_expired_is_refused_not_rerun(tmp_path: Path) -> None:
    """A record that outlives its blob (a blob host's clock ran ahead) answers 503 with the key
    kept: the stored answer is never replaced by a new run nor by a wrong body."""
    clock = FakeClock(wall=1_800_000_000.0)
    store = MemoryStore()
    blobs = FileBlobStore(tmp_path, ttl=48 * HOUR, clock=clock)
    app = tool_app(store, blob_store=blobs, max_inline_bytes=100, result_ttl=48 * HOUR)
    headers, body = request_for({"size": 500})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        first = await c.post("/big", headers=headers, content=body)
        assert first.status_code == 200
        assert (await c.post("/big", headers=headers, content=body)).content == first.content
        clock.advance(48 * HOUR + FileBlobStore.GRACE + 1)
        late = await c.post("/big", headers=headers, content=body)
    assert late.status_code == 503
    assert app.state.runs["big"] == 1


def test_a_blob_store_that_would_expire_before_its_records_is_refused(tmp_path: Path) -> None:
    """A FileBlobStore ttl below result_ttl is a ConfigurationError; the default follows it."""
    inner = tool_app(MemoryStore())
    short = FileBlobStore(tmp_path, ttl=HOUR)
    with pytest.raises(ConfigurationError, match="result_ttl"):
        IdempotencyMiddleware(
            inner,
            store=MemoryStore(),
            blob_store=short,
            options=ServerOptions(result_ttl=48 * HOUR),
            shared_key_space=True,
        )
    default = IdempotencyMiddleware(
        inner,
        store=MemoryStore(),
        options=ServerOptions(result_ttl=48 * HOUR),
        shared_key_space=True,
    ).blob_store
    assert isinstance(default, FileBlobStore)
    assert default.ttl == 48 * HOUR
