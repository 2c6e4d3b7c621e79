"""What one finished record costs in Redis, measured with MEMORY USAGE, against docs/server.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from agentkey.server import FileBlobStore, RedisStore
from tests._loopback import RedisServer
from tests.server._apps import tool_app
from tests.server._util import request_for

KIB = 1024


@pytest.mark.parametrize(
    ("path", "args", "documented"),
    [
        ("/ok", {"amount": 5}, 512),  # a small JSON answer: ~400 B
        ("/big", {"size": 100 * KIB - 2}, 120_000),  # 100 KiB inline, as its bytes: ~115 KB
        ("/big", {"size": 100 * KIB}, 512),  # just over: the record keeps the blob's URI
    ],
    ids=["small", "100 KiB inline", "over 100 KiB in a blob"],
)
async def test_a_finished_record_stays_within_its_documented_size(
    redis_proc: RedisServer, tmp_path: Path, path: str, args: dict[str, Any], documented: int
) -> None:
    """MEMORY USAGE of a real record stays under the figure docs/server.md gives for its kind."""
    store = RedisStore(redis_proc.url, prefix="memory")
    app = tool_app(store, blob_store=FileBlobStore(tmp_path))
    headers, body = request_for(args)
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.post(path, headers=headers, content=body)).status_code < 300
    finally:
        await store.aclose()
    with redis.Redis.from_url(redis_proc.url) as sync:
        used = sync.memory_usage(
            store.redis_key(f"anonymous:{headers['idempotency-key']}"), samples=0
        )
    assert used is not None
    assert used <= documented
    if path == "/big":  # the answer's size in it shows which side of the threshold it fell
        assert (used > 100 * KIB) == (args["size"] < 100 * KIB)
