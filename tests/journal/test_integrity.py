"""What the journal keeps, and for how long: malformed records, expiry in Redis, evidence.

A record the journal cannot read is reported and skipped, never a crash of the listing;
Redis keys of ended calls expire with their records, and nothing that may have run does;
evidence that a route honours keys is a typed record that expires, is refreshed when seen
again, and can be listed and forgotten on every journal.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentkey.cli import main
from agentkey.journal import CallRecord, CallState, SQLiteJournal
from agentkey.journal._base import current_owner
from agentkey.testing import FakeClock
from tests._loopback import RedisServer
from tests._postgres import PostgresServer

DAY = 24 * 3600.0
NOW = 1_800_000_000.0
ROUTE = "POST https://tools.test/charge"


def record(plan: str, n: int = 0, **fields: Any) -> CallRecord:
    now = fields.pop("now", time.time())
    base: dict[str, Any] = {
        "key": f"{plan}:step_{n:03d}:" + f"{n:064x}",
        "plan": plan,
        "step": f"step_{n:03d}",
        "tool": "charge",
        "args_hash": f"{n:064x}",
        "route": ROUTE,
        "created_at": now,
        "updated_at": now,
        "owner": "gone-host:1:x:1",
        "lease_until": now - 1,
    }
    base.update(fields)
    return CallRecord(**base)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


# --- a malformed record ---------------------------------------------------------------------


def _plant_sqlite(request: pytest.FixtureRequest, tmp_path: Path, plan: str) -> str:
    path = tmp_path / "journal.sqlite3"
    journal = SQLiteJournal(path)
    journal.begin(record(plan, 0))
    journal.begin(record(plan, 1))
    journal.close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE agentkey_calls SET state = 'archived' WHERE step = 'step_001'")
    conn.close()
    return str(path)


def _plant_redis(request: pytest.FixtureRequest, tmp_path: Path, plan: str) -> str:
    import redis

    from agentkey.journal import RedisJournal

    server: RedisServer = request.getfixturevalue("redis_proc")
    journal = RedisJournal(server.url)
    journal.begin(record(plan, 0))
    bad = record(plan, 1)
    journal.begin(bad)
    journal.close()
    client = redis.Redis.from_url(server.url)
    client.set(f"agentkey:journal:{{{plan}}}:{bad.key}", b"\x00not json")
    client.close()
    return server.url


def _plant_postgres(request: pytest.FixtureRequest, tmp_path: Path, plan: str) -> str:
    import psycopg

    from agentkey.journal import PostgresJournal

    pg: PostgresServer = request.getfixturevalue("postgres_proc")
    journal = PostgresJournal(pg.dsn)
    journal.begin(record(plan, 0))
    journal.begin(record(plan, 1))
    journal.close()
    with psycopg.connect(pg.dsn) as conn:
        conn.execute(
            "UPDATE agentkey_calls SET state = 'archived' WHERE plan = %s AND step = 'step_001'",
            (plan,),
        )
    return pg.dsn


@pytest.mark.parametrize("kind", ["sqlite", "redis", "postgres"])
def test_a_malformed_record_is_reported_and_skipped(
    request: pytest.FixtureRequest, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """One record the journal cannot read (SQLite and PostgreSQL: state 'archived'; Redis: a
    value that is not JSON): `list` and `doubt` show the others and name the bad one on
    stderr; `show` of it says so (the old code crashed with ValueError / JSONDecodeError)."""
    plan = f"plan{uuid.uuid4().hex[:12]}"
    where = {"sqlite": _plant_sqlite, "redis": _plant_redis, "postgres": _plant_postgres}[kind](
        request, tmp_path, plan
    )
    good, bad = record(plan, 0), record(plan, 1)
    for command in ("list", "doubt"):
        code, out, err = run(capsys, "journal", "--journal", where, "--json", command,
                             "--plan", plan)  # fmt: skip
        assert code == 0, err
        assert [json.loads(line)["step"] for line in out.splitlines()] == ["step_000"]
        if command == "list":  # (doubt asks the SQL journals for its states alone)
            assert "cannot be read" in err
            assert "was skipped" in err
            assert bad.key not in err
    code, out, err = run(capsys, "journal", "--journal", where, "list")
    assert code == 0
    code, out, err = run(capsys, "journal", "--journal", where, "show", bad.key)
    assert code == 3
    assert "cannot be read" in err
    assert bad.key not in err
    code, out, err = run(capsys, "journal", "--journal", where, "show", good.key)
    assert code == 0


# --- Redis expiry ---------------------------------------------------------------------------


def test_redis_keys_expire_with_their_records_and_a_call_in_doubt_never_does(
    redis_proc: RedisServer,
) -> None:
    """retention=60: a pending record never expires (it may have run), nor do the indexes
    that list it (old code: they expired, and find() and the repeat look-up lost the call);
    once every member is answered the record and the indexes expire; evidence expires after
    30 days, and the global list forgets a record that expired."""
    import redis

    from agentkey.journal import RedisJournal

    prefix = f"agentkey:t{uuid.uuid4().hex[:10]}"
    journal = RedisJournal(redis_proc.url, prefix=prefix, retention=60)
    client = redis.Redis.from_url(redis_proc.url)
    plan = f"plan{uuid.uuid4().hex[:8]}"
    pending = record(plan, 0, owner=current_owner(), lease_until=time.time() + 60)
    journal.begin(pending)
    name = f"{prefix}:{{{plan}}}:{pending.key}"
    indexes = [f"{prefix}:{{{plan}}}", f"{prefix}:{{{plan}}}:args:{pending.args_hash}"]
    assert client.pttl(name) == -1  # may have run: kept until settled
    assert [client.pttl(index) for index in indexes] == [-1, -1]  # and so is what lists it
    other = record(plan, 1, args_hash=pending.args_hash, now=time.time())
    other = other.with_(owner=current_owner(), lease_until=time.time() + 60)
    journal.begin(other)
    journal.finish(other.with_(state=CallState.ANSWERED, status_code=201))
    assert [client.pttl(index) for index in indexes] == [-1, -1]  # one member still pending
    assert [c.key for c in journal.find(plan, args_hash=pending.args_hash)] == [
        pending.key,
        other.key,
    ]
    journal.finish(pending.with_(state=CallState.ANSWERED, status_code=201))
    assert 0 < client.pttl(name) <= 60_000
    assert all(0 < client.pttl(index) <= 60_000 for index in indexes)
    assert client.exists(*(f"{index}~unsettled" for index in indexes)) == 0
    journal.learn(ROUTE, "protection header")
    evidence_keys = [k.decode() for k in client.scan_iter(f"{prefix}:*evidence*")]
    assert evidence_keys
    assert all(0 < client.pttl(k) <= 30 * DAY * 1000 for k in evidence_keys)
    client.delete(name, f"{prefix}:{{{plan}}}:{other.key}")  # as if they expired
    assert client.zscore(f"{prefix}:calls", pending.key) is not None
    assert journal.calls(plan=None) == []
    assert client.zscore(f"{prefix}:calls", pending.key) is None  # the list forgot it too
    journal.close()
    client.close()


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_a_redis_begin_past_another_tools_call_stays_atomic_against_a_racing_copy(
    redis_proc: RedisServer, monkeypatch: pytest.MonkeyPatch, driver: str
) -> None:
    """Another tool's call with the same arguments, and two copies of one call racing, the
    second written between the first's two round trips: the first finds it as its repeat
    and writes nothing (old code: its retry did not look again, both were written, sent)."""
    import asyncio

    from agentkey.journal import RedisJournal
    from agentkey.journal import _redis as module

    prefix = f"agentkey:t{uuid.uuid4().hex[:10]}"
    first, second = (RedisJournal(redis_proc.url, prefix=prefix) for _ in range(2))
    plan = f"plan{uuid.uuid4().hex[:8]}"
    same = {"args_hash": "a" * 64, "owner": current_owner(), "lease_until": time.time() + 60}
    first.begin(record(plan, 0, tool="refund", **same))
    one, two = record(plan, 1, **same), record(plan, 2, **same)
    real = module._repeats
    raced: list[Any] = []

    def racing(rec: CallRecord, raws: Any, known: Any = None) -> Any:
        if rec.key == one.key and not raced:  # between the first copy's round trips
            raced.append(second.begin(two, repeats=True))
        return real(rec, raws, known)

    monkeypatch.setattr(module, "_repeats", racing)
    if driver == "sync":
        begun = first.begin(one, repeats=True)
    else:

        async def begin() -> Any:
            try:
                return await first.abegin(one, repeats=True)
            finally:
                await first.aclose()

        begun = asyncio.run(begin())
    assert raced[0].existing is None
    assert raced[0].earlier == ()  # the second copy was written
    assert [r.key for r in begun.earlier] == [two.key]  # the first found it: nothing written
    assert first.get(one.key) is None
    first.close()
    second.close()


def test_a_missed_finish_whose_write_back_loses_says_the_outcome_was_not_recorded(
    redis_proc: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A finish over an operator's verdict whose write-back loses to another change: the
    error says the outcome was not recorded (old code: "recorded over that verdict", false)."""
    from agentkey import JournalError
    from agentkey.journal import RedisJournal

    journal = RedisJournal(redis_proc.url, prefix=f"agentkey:t{uuid.uuid4().hex[:10]}")
    first = record(f"plan{uuid.uuid4().hex[:8]}", 0, owner=current_owner())
    journal.begin(first)
    verdict = first.with_(state=CallState.NOT_SENT, owner=None, source="operator",
                          reason="did not run", updated_at=first.updated_at + 1)  # fmt: skip
    assert journal.take_over(verdict, first)
    monkeypatch.setattr(journal, "take_over", lambda record, previous: False)  # another won
    done = first.with_(state=CallState.ANSWERED, status_code=201, updated_at=verdict.updated_at)
    with pytest.raises(JournalError, match="that outcome was not recorded") as caught:
        journal.finish(done)
    assert "recorded over that verdict" not in str(caught.value)
    assert journal.get(first.key) == verdict
    journal.close()


# --- evidence as data -----------------------------------------------------------------------


def test_evidence_is_a_record_refreshed_when_seen_again_and_forgotten_on_request(
    journal_factory: Callable[..., Any],
) -> None:
    """learn() keeps route, marker, first and last seen and expiry; seeing it again moves the
    expiry on (so it lasts past 30 days from the first sight); forget() drops it, and begin
    no longer reports it; an expired one is neither listed nor used."""
    from agentkey.journal import Evidence

    clock = FakeClock(wall=NOW)
    journal = journal_factory(clock=clock)
    journal.learn(ROUTE, "protection header")
    first = Evidence(ROUTE, "protection header", NOW, NOW, NOW + 30 * DAY)
    assert journal.evidence() == [first]
    clock.advance(20 * DAY)
    journal.learn(ROUTE, "replay marker")
    journal.learn("PATCH https://tools.test/charge", "protection header")
    clock.advance(15 * DAY)  # day 35: past 30 days from the first sight, not from the last
    listed = journal.evidence()
    assert listed[1] == Evidence(ROUTE, "replay marker", NOW, NOW + 20 * DAY, NOW + 50 * DAY)
    assert [e.route for e in listed] == ["PATCH https://tools.test/charge", ROUTE]
    assert journal.begin(record("plan-e", 0, route=ROUTE)).evidence == "replay marker"
    assert journal.forget(ROUTE) is True
    assert journal.forget(ROUTE) is False
    assert [e.route for e in journal.evidence()] == ["PATCH https://tools.test/charge"]
    assert journal.begin(record("plan-e", 1, route=ROUTE)).evidence is None
    clock.advance(16 * DAY)  # day 51: the PATCH route was last seen at day 20
    assert journal.evidence() == []
    journal.learn(ROUTE, "replay marker")  # seen afresh after it expired: a new first sight
    assert journal.evidence()[0].first_seen == NOW + 51 * DAY


def test_the_evidence_command_lists_and_forgets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`agentkey journal evidence` lists routes (text and --json); --forget ROUTE drops one
    (exit 0), a route with none exits 1, and something that is not a route exits 2."""
    path = tmp_path / "journal.sqlite3"
    journal = SQLiteJournal(path)
    journal.learn(ROUTE, "protection header")
    journal.close()
    where = ["journal", "--journal", str(path)]
    code, out, _ = run(capsys, *where, "evidence")
    assert code == 0
    assert out.splitlines()[0].split() == ["LAST", "SEEN", "EXPIRES", "MARKER", "ROUTE"]
    assert ROUTE in out
    assert "protection header" in out
    code, out, _ = run(capsys, *where, "--json", "evidence")
    row = json.loads(out)
    assert (row["route"], row["marker"]) == (ROUTE, "protection header")
    assert row["expires_at"] - row["last_seen"] == 30 * DAY
    code, out, _ = run(capsys, *where, "evidence", "--forget", "post https://tools.test/charge?x=1")
    assert (code, out.strip()) == (0, f"forgot {ROUTE}")
    code, out, _ = run(capsys, *where, "evidence", "--forget", ROUTE)
    assert code == 1
    code, out, _ = run(capsys, *where, "evidence")
    assert (code, out.strip()) == (0, "no evidence")  # a listing exits 0, empty or not
    code, _, err = run(capsys, *where, "evidence", "--forget", "charge")
    assert code == 2
    assert "METHOD URL" in err


def test_the_retention_deletes_ended_calls_and_keeps_calls_in_doubt(tmp_path: Path) -> None:
    """SQLite's own pruning after ``retention``: an answered call goes, a pending call whose
    sender is gone (in doubt) stays until settled (the old code deleted it, and the step
    could then be sent again)."""
    clock = FakeClock(wall=NOW)
    path = tmp_path / "journal.sqlite3"
    journal = SQLiteJournal(path, retention=60, clock=clock)
    doubt = record("plan-r", 0, now=NOW)
    done = record("plan-r", 1, now=NOW, state=CallState.ANSWERED, status_code=201)
    journal.begin(doubt)
    journal.begin(done)
    journal.close()
    clock.advance(3600)
    again = SQLiteJournal(path, retention=60, clock=clock)  # prunes as it opens
    assert again.get(done.key) is None
    assert again.get(doubt.key) == doubt
    assert [r.key for r in again.calls(states=[CallState.PENDING])] == [doubt.key]
    again.close()


def test_an_open_sqlite_journal_prunes_every_ten_minutes_of_its_clock(tmp_path: Path) -> None:
    """Besides pruning as it opens, an open SQLite journal prunes when a call begins ten
    minutes (on its clock's monotonic time) after it last did: not at 599 s, at 601 s."""
    clock = FakeClock(wall=NOW)
    journal = SQLiteJournal(tmp_path / "journal.sqlite3", retention=60, clock=clock)
    done = record("plan-p", 0, now=NOW, state=CallState.ANSWERED, status_code=201)
    journal.begin(done)
    clock.advance(599)
    journal.begin(record("plan-p", 1, now=clock.time()))
    assert journal.get(done.key) == done  # past its retention, but no prune is due yet
    clock.advance(2)
    journal.begin(record("plan-p", 2, now=clock.time()))
    assert journal.get(done.key) is None
    journal.close()


def test_sqlite_reads_a_routes_evidence_again_a_minute_after_on_its_clock(tmp_path: Path) -> None:
    """A SQLite journal trusts evidence it read or learnt for a minute of its clock, then reads
    the file again: evidence another process forgot is still given at 59 s, not at 61 s."""
    clock = FakeClock(wall=NOW)
    path = tmp_path / "journal.sqlite3"
    mine, other = SQLiteJournal(path, clock=clock), SQLiteJournal(path, clock=clock)
    mine.learn(ROUTE, "protection header")
    assert other.forget(ROUTE) is True
    clock.advance(59)
    assert mine.begin(record("plan-c", 0, now=clock.time())).evidence == "protection header"
    clock.advance(2)
    assert mine.begin(record("plan-c", 1, now=clock.time())).evidence is None
    mine.close()
    other.close()
