"""``agentkey server``: the keys in doubt in a server's idempotency store, and settling them.

```
agentkey server doubt --store URL [--prefix P | --table T] [--json]
agentkey server settle --store URL KEY --ran [--status N --body JSON] [--result-ttl S]
                       | --not-run [--force]   [--principal P]
```

A key is in doubt when a request may have started its side effect and did not
finish: its server died (or its lease lapsed while the store was down), or the
handler failed with a 5xx or an exception. Nothing runs under it until it is
settled: by the middleware's ``reconcile`` hook, or here, once you have looked at
the target system. ``--ran`` records the answer (``--body``, else a 500 that says an
operator settled it as ran and its answer is lost) and every later request gets
it as a replay; ``--not-run`` frees the key, and the next request with it runs.

"In doubt" is decided on the store's clock (Redis ``TIME``, PostgreSQL
``clock_timestamp()``), never this machine's. A key in doubt only because its lease
lapsed may still have a live handler (the store was down while it ran): ``--not-run``
refuses it until one more ``lock_ttl`` has passed since the lease ended, unless
``--force``. ``--ran`` keeps the record's remaining lifetime in the store (or
``--result-ttl``). A Redis Cluster is refused: the keys live on every primary, and
one node's list would be incomplete.

Keys are printed as digests (``plan:step_003:#1a2b3c4d``, never whole: a key is a
bearer secret); ``settle`` takes that form. The store URL is ``redis://...``
(``--prefix``, as given to ``RedisStore``) or ``postgresql://...`` (``--table``).
``--store``, ``--prefix``, ``--table`` and ``--json`` go before or after the subcommand.
Times print as ISO 8601 UTC (``--json``: Unix seconds).
Exit codes: 0 done (``doubt`` exits 0 whatever it lists, nothing included), 1 no such
key in doubt (``settle``), 2 bad usage or no store.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from .._exceptions import AgentKeyError, ConfigurationError
from .._keys import shown_key
from ._decide import PROBLEM_TYPE, is_storable, problem_body
from ._records import InProgress, StoredOutcome, decode_record, encode_outcome

__all__ = ["add_parser", "main"]

EXIT_OK, EXIT_FOUND_NOTHING, EXIT_USAGE = 0, 1, 2


def main(argv: Sequence[str]) -> int:
    """``agentkey server ...``: parse ``argv`` (what follows ``server``) and run it."""
    parser = argparse.ArgumentParser(prog="agentkey")
    add_parser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(["server", *argv])
    code: int = ns.func(ns)
    return code


def add_parser(sub: Any) -> None:
    """Add ``server`` and its sub-commands to the ``agentkey`` parser's sub-parsers."""
    # The store options and --json are accepted before or after the subcommand; no level
    # sets a default (a subcommand's would overwrite what came before it): _run does.
    common = argparse.ArgumentParser(add_help=False)
    _store_options(common)
    server = sub.add_parser(
        "server",
        parents=[common],
        help="list and settle the keys in doubt in a server's idempotency store",
        description="A key is in doubt when a request may have started its side effect and "
        "did not finish (its server died, or it failed after the effect began). Nothing runs "
        "under it until the middleware's reconcile hook or an operator settles it. Keys are "
        "printed as digests, never whole.",
    )
    commands = server.add_subparsers(dest="server_command", required=True)
    doubt = commands.add_parser(
        "doubt", parents=[common], help="every key in doubt (exit 0, also when there is none)"
    )
    doubt.add_argument("--limit", type=_count, default=500, help="at most this many (500)")
    doubt.set_defaults(func=_run, func_command=_doubt)

    settle = commands.add_parser(
        "settle",
        parents=[common],
        help="record whether the step of a key in doubt ran",
        description="--ran: it did; later requests with the key get --body (with --status, "
        "200 by default) as a replay, or without --body a 500 saying an operator settled it "
        "as ran and its answer is not known. --not-run: it did not; the key is freed and the "
        "next request with it runs the step.",
    )
    settle.add_argument("key", help="the key as printed (plan:step_003:#1a2b3c4d or #1a2b3c4d)")
    verdict = settle.add_mutually_exclusive_group(required=True)
    verdict.add_argument("--ran", action="store_true", help="the step ran")
    verdict.add_argument("--not-run", action="store_true", help="the step did not run")
    settle.add_argument("--principal", help="the caller the key belongs to, when keys collide")
    settle.add_argument("--status", type=int, default=200, help="with --ran --body (200)")
    settle.add_argument("--body", help="with --ran: the answer to replay (JSON)")
    settle.add_argument(
        "--result-ttl",
        type=_seconds,
        metavar="S",
        help="with --ran: keep the answer S seconds (default: the record's remaining lifetime)",
    )
    settle.add_argument(
        "--force",
        action="store_true",
        help="with --not-run: free a key whose lease lapsed less than one lock_ttl ago "
        "(its handler may still be running)",
    )
    settle.set_defaults(func=_run, func_command=_settle)


_DEFAULTS = {"store": None, "prefix": "agentkey", "table": "agentkey_records", "json": False}


def _store_options(parser: argparse.ArgumentParser) -> None:
    hidden = argparse.SUPPRESS
    parser.add_argument(
        "--store", metavar="URL", default=hidden, help="redis://... or postgresql://... (required)"
    )
    parser.add_argument("--prefix", default=hidden, help="RedisStore prefix (agentkey)")
    parser.add_argument("--table", default=hidden, help="PostgresStore table (agentkey_records)")
    parser.add_argument(
        "--json",
        action="store_true",
        default=hidden,
        help="print JSON lines for scripts (times as Unix seconds)",
    )


def _count(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 100_000:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to 100000, got {text!r}")
    return int(text)


def _seconds(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 1 <= value <= 10 * 365 * 86_400:
        raise argparse.ArgumentTypeError(f"must be 1 to 315360000 seconds, got {text!r}")
    return round(value * 1000)


@dataclass(frozen=True)
class _Doubt:
    record_key: str  # as the store names it (principal:key), never printed
    principal: str
    key: str
    record: InProgress

    def row(self) -> dict[str, Any]:
        method, _, route = self.record.operation.partition(" ")
        return {
            "key": shown_key(self.key),
            "principal": self.principal,
            "method": method or None,
            "route": route or None,
            "started": self.record.started_ms / 1000,
            "since": self.record.lease_end_ms / 1000,
            "why": "failed" if self.record.phase == "in_doubt" else "lease lapsed",
        }


def _split(record_key: str) -> tuple[str, str]:
    """``(principal, idempotency key)`` of a record key ``<quoted principal>:<key>``."""
    scoped, _, rest = record_key.partition(":")
    key = rest if ":" in rest else unquote(rest)  # an opaque key is stored quoted
    return unquote(scoped), key


def _in_doubt(record_key: str, value: bytes, now_ms: int) -> _Doubt | None:
    principal, key = _split(record_key)
    try:
        record = decode_record(value, key=key)
    except AgentKeyError:
        return None
    if isinstance(record, InProgress) and record.in_doubt(now_ms):
        return _Doubt(record_key, principal, key, record)
    return None


class _Redis:
    def __init__(self, url: str, prefix: str) -> None:
        from .redis._store import RedisStore

        self.store = RedisStore(url, prefix=prefix)
        self.url, self.prefix = url, prefix

    def _name(self, record_key: str) -> str:
        return f"{self.prefix}:{{{record_key}}}"

    async def now_ms(self) -> int:
        """The store's clock (``TIME``), in Unix milliseconds."""
        from redis import asyncio as aioredis

        client = aioredis.from_url(self.url)
        try:
            seconds, micros = await client.time()
        finally:
            await client.aclose()
        return int(seconds) * 1000 + int(micros) // 1000

    async def ttl_ms(self, record_key: str) -> int:
        """The record's remaining lifetime (``PTTL``); 0 when it has none or is gone."""
        from redis import asyncio as aioredis

        client = aioredis.from_url(self.url)
        try:
            left = int(await client.pttl(self._name(record_key)))
        finally:
            await client.aclose()
        return max(0, left)

    async def scan(self) -> list[tuple[str, bytes]]:
        from redis import asyncio as aioredis

        client = aioredis.from_url(self.url)
        head = f"{self.prefix}:{{"
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in head) + "*"
        found = []
        try:
            info: Any = await client.info("cluster")
            if isinstance(info, dict) and str(info.get("cluster_enabled", "0")) == "1":
                raise ConfigurationError(
                    "--store is a Redis Cluster node: the keys live on every primary, and "
                    "one node's list would miss keys in doubt, so this command refuses a "
                    "cluster (it supports one Redis server, or a primary with replicas). "
                    "Settle a cluster's keys with the middleware's reconcile hook"
                )
            async for name in client.scan_iter(match=pattern, count=1000):
                text = name.decode("utf-8", "surrogateescape")
                value: Any = await client.get(name)
                if isinstance(value, bytes) and value.startswith(b"P:") and text.endswith("}"):
                    found.append((text[len(head) : -1], value))
        finally:
            await client.aclose()
        return found


class _Postgres:
    def __init__(self, dsn: str, table: str) -> None:
        from ._postgres import PostgresStore

        self.store = PostgresStore(dsn, table=table, create=False, min_size=0, max_size=2)
        self.dsn = dsn

    async def _value(self, query: Any, params: Sequence[Any] = ()) -> int:
        import psycopg

        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            cur = await conn.execute(query, params)
            row = await cur.fetchone()
        return 0 if row is None or row[0] is None else int(row[0])

    async def now_ms(self) -> int:
        """The store's clock (``clock_timestamp()``), in Unix milliseconds."""
        return await self._value(
            "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
        )

    async def ttl_ms(self, record_key: str) -> int:
        """The record's remaining lifetime; 0 when it is gone."""
        from psycopg import sql

        query = sql.SQL(
            "SELECT floor(extract(epoch FROM expires_at - clock_timestamp()) * 1000)::bigint "
            "FROM {} WHERE key = %s"
        ).format(sql.Identifier(*self.store.table.split(".")))
        return max(0, await self._value(query, (record_key,)))

    async def scan(self) -> list[tuple[str, bytes]]:
        import psycopg
        from psycopg import sql

        query = sql.SQL(
            "SELECT key, value FROM {} WHERE substr(value, 1, 2) = 'P:'::bytea "
            "AND expires_at > clock_timestamp()"
        ).format(sql.Identifier(*self.store.table.split(".")))
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            cur = await conn.execute(query)
            return [(str(k), bytes(v)) for k, v in await cur.fetchall()]


def _open(ns: argparse.Namespace) -> _Redis | _Postgres:
    url = ns.store
    if url is None:
        raise ConfigurationError(
            f"server {ns.server_command} needs --store URL: the server's redis://... or "
            "postgresql://... store"
        )
    if url.startswith(("redis://", "rediss://", "unix://")):
        return _Redis(url, ns.prefix)
    if url.startswith(("postgresql://", "postgres://")):
        return _Postgres(url, ns.table)
    raise ConfigurationError("--store must be a redis://, rediss://, unix:// or postgresql:// URL")


def _run(ns: argparse.Namespace) -> int:
    for name, default in _DEFAULTS.items():
        if not hasattr(ns, name):
            setattr(ns, name, default)
    try:
        backend = _open(ns)
    except AgentKeyError as exc:
        print(f"agentkey: {exc}", file=sys.stderr)
        return EXIT_USAGE

    async def go() -> int:
        try:
            code: int = await ns.func_command(ns, backend)
            return code
        finally:
            await backend.store.aclose()

    try:
        return asyncio.run(go())
    except AgentKeyError as exc:
        print(f"agentkey: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # the store could not be reached
        print(f"agentkey: the store could not be reached ({type(exc).__name__})", file=sys.stderr)
        return EXIT_USAGE


async def _doubts(backend: _Redis | _Postgres, now: int) -> list[_Doubt]:
    try:
        rows = await backend.scan()
    except AgentKeyError:
        raise
    except Exception as exc:
        raise ConfigurationError(
            f"could not list the store's records ({type(exc).__name__}); check --store and "
            "that the store is up"
        ) from None
    found = [d for k, v in rows if (d := _in_doubt(k, v, now)) is not None]
    return sorted(found, key=lambda d: d.record.lease_end_ms)


def _print(rows: Sequence[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        for row in rows:
            print(json.dumps(row, sort_keys=True))
        return
    if not rows:
        print("no keys in doubt")
        return
    header = ("SINCE", "WHY", "PRINCIPAL", "ROUTE", "KEY")
    lines = [header] + [
        (
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(row["since"])),
            row["why"],
            row["principal"],
            f"{row['method'] or ''} {row['route'] or ''}".strip(),
            row["key"],
        )
        for row in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())


async def _doubt(ns: argparse.Namespace, backend: _Redis | _Postgres) -> int:
    rows = [d.row() for d in (await _doubts(backend, await backend.now_ms()))[: ns.limit]]
    _print(rows, ns.json)
    return EXIT_OK  # a listing: nothing in doubt is no error


async def _settle(ns: argparse.Namespace, backend: _Redis | _Postgres) -> int:
    now = await backend.now_ms()  # the store's clock: "in doubt" is the server's verdict
    matches = [
        d
        for d in await _doubts(backend, now)
        if ns.key in (shown_key(d.key), d.key)
        and (ns.principal is None or ns.principal == d.principal)
    ]
    if not matches:
        print(f"agentkey: no key {ns.key!r} is in doubt in this store", file=sys.stderr)
        return EXIT_FOUND_NOTHING
    if len(matches) > 1:
        print(
            f"agentkey: {len(matches)} keys in doubt print as {ns.key!r}; pass --principal",
            file=sys.stderr,
        )
        return EXIT_USAGE
    doubt = matches[0]
    store, owner, record = backend.store, doubt.record.owner, doubt.record
    ttl = 0
    if ns.not_run:
        # Its handler may still be alive: its lease lapsed (the store was down while it
        # ran?) less than one lock_ttl ago. lock_ttl is three renewal intervals.
        alive_until = record.lease_end_ms + (3 * record.renew_ms or 15_000)
        if record.phase != "in_doubt" and now < alive_until and not ns.force:
            print(
                f"agentkey: the lease of {shown_key(doubt.key)} lapsed only "
                f"{(now - record.lease_end_ms) / 1000:g} s ago (store clock), and its handler "
                f"may still be running; --not-run would let a retry run the step beside it. "
                f"Wait {(alive_until - now) / 1000:g} s more, or pass --force once you know "
                "the handler is gone",
                file=sys.stderr,
            )
            return EXIT_USAGE
        done = await store.release(doubt.record_key, owner)
    else:
        outcome = _ran_outcome(ns, doubt, now)
        ttl = ns.result_ttl or await backend.ttl_ms(doubt.record_key)
        if ttl <= 0:
            print(
                f"agentkey: the record of {shown_key(doubt.key)} has no lifetime left to "
                "keep; pass --result-ttl SECONDS (the server's result_ttl)",
                file=sys.stderr,
            )
            return EXIT_USAGE
        done = await store.finish(doubt.record_key, owner, encode_outcome(outcome), ttl_ms=ttl)
    if not done:
        print(
            f"agentkey: the record of {shown_key(doubt.key)} changed meanwhile (its handler "
            "finished or someone settled it); run doubt again",
            file=sys.stderr,
        )
        return EXIT_FOUND_NOTHING
    row = doubt.row() | {"settled": "ran" if ns.ran else "not run"}
    if ns.ran:
        row["kept_s"] = ttl / 1000
    if ns.json:
        _print([row], True)
    else:
        then = (
            "the next request with the key runs the step"
            if ns.not_run
            else f"replayed for {ttl / 1000:g} s"
            + ("" if ns.result_ttl else ", the in-doubt record's remaining lifetime")
        )
        print(f"settled {row['key']}: {row['settled']} ({then})")
    return EXIT_OK


def _ran_outcome(ns: argparse.Namespace, doubt: _Doubt, now: int) -> StoredOutcome:
    binding = doubt.record.binding
    if ns.body is None:
        body = problem_body(
            500,
            "step_failed",
            "an operator settled this step as ran after it was in doubt; its answer was not "
            "recorded, so read its result from the target system. It is not run again under "
            "this key",
        )
        return StoredOutcome(
            "FAILED", 500, (("content-type", PROBLEM_TYPE),), body, None, now, binding
        )
    try:
        json.loads(ns.body)
    except ValueError:
        raise ConfigurationError("--body must be JSON (the answer to replay)") from None
    if not is_storable(ns.status):
        raise ConfigurationError(f"--status {ns.status} is not a final answer (2xx, or a 4xx)")
    headers = (("content-type", "application/json"),)
    return StoredOutcome("COMPLETED", ns.status, headers, ns.body.encode(), None, now, binding)
