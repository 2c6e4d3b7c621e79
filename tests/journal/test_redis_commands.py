"""What a call costs the Redis journal on the wire, counted by the Redis server itself.

A call's start is one command (a script that looks for the same call at another step,
writes the record, lists it in the plan's indexes and the global one, and reads the
route's evidence) and its end is another: one round trip each. A server that refuses a
script's keys of several slots (a Redis Cluster node) gets the one-slot scripts, with the
rest beside them in a pipeline; a server that forgot the scripts is sent their text.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkey import AsyncToolInvoker, PlanSession, ToolInvoker
from agentkey.journal import CallRecord, CallState, RedisJournal
from agentkey.journal._redis import _number
from tests._loopback import RedisServer, free_port, redis_server, serve
from tests.journal._tools import PlainTool

DRIVERS = ("sync", "async")


class Commands:
    """The commands clients send to a Redis server (MONITOR), scripts' own calls left out;
    only those that name ``mark`` (a journal's prefix) are kept."""

    def __init__(self, url: str, mark: str) -> None:
        self.url, self.mark = url, mark
        self.seen: list[str] = []
        self._monitor = redis.Redis.from_url(url)
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        with self._monitor.monitor() as feed:  # type: ignore[no-untyped-call]
            self._started.set()
            for each in feed.listen():
                command = str(each["command"])
                if each.get("client_type") == "lua" or self.mark not in command:
                    continue
                if command == f"ECHO {self.mark}:end":
                    return
                self.seen.append(command.split()[0].upper())

    def start(self) -> None:
        self._thread.start()
        assert self._started.wait(10)

    def stop(self) -> None:
        with redis.Redis.from_url(self.url) as client:
            client.echo(f"{self.mark}:end")
        self._thread.join(10)
        self._monitor.close()


def calls(
    driver: str, url: str, journal: RedisJournal, steps: list[Any], between: Callable[[], None]
) -> list[Any]:
    """Invoke ``steps[0]`` (connects, loads), then ``between()``, then the others."""
    options: dict[str, Any] = {"route_template": "/tools/{tool}", "journal": journal}
    if driver == "sync":
        try:
            with ToolInvoker(url, **options) as tools:
                first = [tools.invoke(steps[0])]
                between()
                return first + [tools.invoke(step) for step in steps[1:]]
        finally:
            journal.close()

    async def run() -> list[Any]:
        try:
            async with AsyncToolInvoker(url, **options) as tools:
                first = [await tools.invoke(steps[0])]
                await asyncio.to_thread(between)
                return first + [await tools.invoke(step) for step in steps[1:]]
        finally:
            await journal.aclose()

    return asyncio.run(run())


def listing(url: str, prefix: str) -> list[CallRecord]:
    """Every call the journal under ``prefix`` lists, read by a journal of its own."""
    reader = RedisJournal(url, prefix=prefix)
    try:
        return reader.calls(limit=100)
    finally:
        reader.close()


def ten_and_a_repeat() -> list[Any]:
    plan = PlanSession.new()
    fresh = [plan.step(index, "charge", {"amount": index}) for index in range(11)]
    return [*fresh, plan.step(11, "charge", {"amount": 3})]


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_fresh_call_costs_the_redis_journal_one_command_per_round_trip(
    driver: str, redis_proc: RedisServer
) -> None:
    """Ten fresh calls send the Redis journal two commands each (EVALSHA: its start, its
    end; five before, in two pipelines: EVAL, ZADD, GET, EVAL, ZADD); the tool runs each
    once, a repeat at another step is still found, and the records are whole."""
    prefix = f"cmd{uuid.uuid4().hex[:8]}"
    journal = RedisJournal(redis_proc.url, prefix=prefix)
    plain, steps = PlainTool(), ten_and_a_repeat()
    watch = Commands(redis_proc.url, prefix)
    with serve(plain) as url:
        results = calls(driver, url, journal, steps, watch.start)
    watch.stop()
    assert watch.seen[: 2 * 10] == ["EVALSHA", "EVALSHA"] * 10, watch.seen
    assert results[-1].repeat_of == "step_003"
    assert plain.executions["charge"] == 11
    listed = listing(redis_proc.url, prefix)
    assert len(listed) == 11
    assert {r.state for r in listed} == {CallState.ANSWERED}
    assert all(r.body is not None and r.status_code == 201 for r in listed)


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_redis_that_forgot_the_scripts_is_sent_their_text(
    driver: str, redis_proc: RedisServer
) -> None:
    """After SCRIPT FLUSH (a restarted Redis), the next start and end answer NOSCRIPT,
    which runs nothing: each is sent again as EVAL, then EVALSHA works again."""
    prefix = f"cmd{uuid.uuid4().hex[:8]}"
    journal = RedisJournal(redis_proc.url, prefix=prefix)
    plain, steps = PlainTool(), ten_and_a_repeat()[:3]

    def flush() -> None:
        with redis.Redis.from_url(redis_proc.url) as client:
            client.script_flush()

    with serve(plain) as url:
        results = calls(driver, url, journal, steps, flush)
    assert plain.executions["charge"] == 3
    assert all(r.status_code == 201 and r.repeat_of is None for r in results)
    listed = listing(redis_proc.url, prefix)
    assert len(listed) == 3
    assert {r.state for r in listed} == {CallState.ANSWERED}


@pytest.fixture(scope="module")
def cluster_node() -> Iterator[RedisServer]:
    """A one-node Redis Cluster that holds every slot: it refuses a script whose keys lie in
    several slots (CROSSSLOT), as every node of a real cluster does."""
    options = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
    # The bus port defaults to the port + 10000, past 65535 for a high free port: name one.
    options += ["--cluster-port", str(free_port())]
    with redis_server(*options) as node:
        with redis.Redis.from_url(node.url) as client:
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            deadline = time.monotonic() + 10
            while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                assert time.monotonic() < deadline, "the one-node cluster did not come up"
                time.sleep(0.05)
        yield node


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_cluster_node_gets_scripts_of_one_slot(driver: str, cluster_node: RedisServer) -> None:
    """On a Redis Cluster node the three-slot script is refused (it ran nothing): the
    journal sends the one-slot scripts with the rest in a pipeline from then on, and calls,
    repeats and the global listing work as before."""
    prefix = f"cmd{uuid.uuid4().hex[:8]}"
    journal = RedisJournal(cluster_node.url, prefix=prefix)
    plain, steps = PlainTool(), ten_and_a_repeat()
    watch = Commands(cluster_node.url, prefix)
    with serve(plain) as url:
        results = calls(driver, url, journal, steps, watch.start)
    watch.stop()
    assert "EVALSHA" not in watch.seen
    assert watch.seen[:6] == ["ZSCORE", "EVAL", "ZADD", "GET", "EVAL", "ZADD"]
    assert results[-1].repeat_of == "step_003"
    assert plain.executions["charge"] == 11
    listed = listing(cluster_node.url, prefix)
    assert len(listed) == 11
    assert {r.state for r in listed} == {CallState.ANSWERED}


def _pending(key: str) -> CallRecord:
    """A pending call of another host whose lease has ended, at ``key``'s step."""
    now = time.time()
    return CallRecord(
        key=key, plan="p", step=key.split(":")[1], tool="t", args_hash="ab" * 32,
        route="POST http://tool.test/t", state=CallState.PENDING, created_at=now,
        updated_at=now, owner="otherhost:1:n:1", lease_until=now - 1,
    )  # fmt: skip


@pytest.mark.parametrize("server", ["plain", "cluster"])
def test_a_start_that_finds_repeats_keeps_a_listed_call_listed(
    server: str, redis_proc: RedisServer, cluster_node: RedisServer
) -> None:
    """Two pending calls of the same arguments at steps 1 and 2; starting step 1 again finds
    step 2's: both stay in the global listing (`agentkey journal`), on one server and on a
    Cluster node (whose one-slot path took step 1 out of the listing before)."""
    url = redis_proc.url if server == "plain" else cluster_node.url
    prefix = f"cmd{uuid.uuid4().hex[:8]}"
    journal = RedisJournal(url, prefix=prefix)
    first, second = ("p:step_001:" + "ab" * 32, "p:step_002:" + "ab" * 32)
    try:
        journal.begin(_pending(first))
        journal.begin(_pending(second))
        begun = journal.begin(_pending(first), repeats=True)
    finally:
        journal.close()
    assert [r.key for r in begun.earlier] == [second]
    assert sorted(r.key for r in listing(url, prefix)) == [first, second]


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_user_refused_evalsha_is_sent_the_scripts_text(
    driver: str, redis_proc: RedisServer
) -> None:
    """A Redis user whose ACL refuses EVALSHA but allows EVAL (NOPERM ran nothing): calls
    are recorded through EVAL, each runs once, and none is refused."""
    user = f"u{uuid.uuid4().hex[:8]}"
    with redis.Redis.from_url(redis_proc.url) as admin:
        admin.acl_setuser(
            user, enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-evalsha"]
        )
    url = redis_proc.url.replace("redis://", f"redis://{user}:pw@")
    prefix = f"cmd{uuid.uuid4().hex[:8]}"
    plain, steps = PlainTool(), ten_and_a_repeat()[:3]
    with serve(plain) as tool:
        results = calls(driver, tool, RedisJournal(url, prefix=prefix), steps, lambda: None)
    assert plain.executions["charge"] == 3
    assert all(r.status_code == 201 for r in results)
    assert {r.state for r in listing(url, prefix)} == {CallState.ANSWERED}


def test_records_are_encoded_as_before() -> None:
    """The record's JSON is byte for byte what earlier versions wrote and read (every field
    but the body, then the body in base64): records of either version read the same."""
    from agentkey.journal._redis import _decode, _encode

    now = time.time()
    base = CallRecord(
        key="p:step_000:" + "ab" * 32,
        plan="p",
        step="step_000",
        tool="charge",
        args_hash="ab" * 32,
        route="POST http://tools.test/charge",
        created_at=now,
        updated_at=now,
        owner="host:1:abcd:1",
        lease_until=now + 300.25,
    )
    for record in (
        base,
        base.with_(
            state=CallState.ANSWERED, body=b'{"ok":"\xc3\xa9"}', body_size=12, honoured=True
        ),
        base.with_(state=CallState.IN_DOUBT, body=b"\xff\x00", status_code=502, reason="r\u00e9"),
        base.with_(state=CallState.FAILED, call_id="c1", context="t1", error="E", source="tool"),
    ):
        old = record.to_dict()
        old.pop("body", None)
        old["body64"] = None if record.body is None else base64.b64encode(record.body).decode()
        assert _encode(record) == json.dumps(old, separators=(",", ":"))
        assert _decode(_encode(record)) == record


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_client_on_either_protocol_reads_the_scripts_answers(
    protocol: int, redis_proc: RedisServer
) -> None:
    """The start script answers a pair (found, evidence) whose parts may be null: on a RESP2
    and a RESP3 client alike, a new call is written, a second start finds it, the evidence
    learnt for its route comes back, and its end is recorded."""
    client = redis.Redis.from_url(redis_proc.url, protocol=protocol)
    journal = RedisJournal(client, prefix=f"cmd{uuid.uuid4().hex[:8]}")
    now = time.time()
    record = CallRecord(
        key="p:step_000:" + "cd" * 32,
        plan="p",
        step="step_000",
        tool="charge",
        args_hash="cd" * 32,
        route="POST http://tools.test/charge",
        created_at=now,
        updated_at=now,
        owner="elsewhere:1:abcd:1",
        lease_until=now + 300,
    )
    try:
        first = journal.begin(record, repeats=True)
        assert (first.existing, first.evidence, first.earlier) == (None, None, ())
        journal.learn(record.route, "protection header")
        again = journal.begin(record.with_(owner="elsewhere:2:abcd:1"), repeats=True)
        assert again.existing == record
        assert again.evidence == "protection header"
        assert journal.finish(record.with_(state=CallState.ANSWERED, updated_at=now + 1))
        assert journal.get(record.key) == record.with_(state=CallState.ANSWERED, updated_at=now + 1)
    finally:
        client.close()


@pytest.mark.parametrize("plan", [None, "p"])
def test_listing_calls_of_a_stopped_redis_is_a_typed_error(plan: str | None) -> None:
    """``calls()`` on a Redis that is gone raises JournalError (sent=False) naming the
    listing and what to check, not redis-py's ConnectionError."""
    from agentkey import JournalError

    with redis_server() as server:
        journal = RedisJournal(server.url, prefix=f"cmd{uuid.uuid4().hex[:8]}")
        assert journal.calls(plan=plan) == []  # connected while it ran
        server.process.terminate()
        server.process.wait(10)
        try:
            with pytest.raises(JournalError) as caught:
                journal.calls(plan=plan)
        finally:
            journal.close()
    assert "while listing calls" in str(caught.value)
    assert "Check that Redis is reachable" in str(caught.value)
    assert caught.value.sent is False
    assert not isinstance(caught.value, redis.RedisError)


def _main_wire(journal: RedisJournal, record: CallRecord, op: str) -> list[Any]:
    """The keys and arguments main's journal gave redis-py for ``op`` (as str and numbers)."""
    from agentkey.journal._redis import _encode

    p = journal.prefix
    record_key = f"{p}:{{{record.plan}}}:{record.key}"
    plan_key = f"{p}:{{{record.plan}}}"
    index = plan_key if record.args_hash is None else f"{plan_key}:args:{record.args_hash}"
    keys = [record_key, plan_key, index, f"{plan_key}~unsettled", f"{index}~unsettled"]
    ttl = int(journal.retention * 1000)
    kept = ttl if record.state is not CallState.PENDING else 0
    calls = f"{p}:calls"
    if op == "begin":
        look = "1" if record.args_hash is not None else "0"
        args = [_encode(record), ttl, record.created_at, record.key, look, kept, record.updated_at]
        evidence = f"{p}:{{evidence}}:r:{record.route}"
        return [*keys, calls, evidence, *args, "p:k1", "p:k2"]
    args = [_encode(record), ttl, "", record.owner or "", "", kept, record.key]
    return [*keys, calls, *args, record.updated_at]


@pytest.mark.parametrize("encoding", ["utf-8", "latin-1", "utf-16"])
def test_a_begin_and_a_finish_send_the_bytes_main_sent(encoding: str) -> None:
    """The start and end scripts' keys and arguments reach the wire byte for byte as
    main's did (the journal now hands a UTF-8 client bytes, and a float written once),
    whatever the client's encoding, for a prefix and route outside ASCII."""
    from agentkey.journal._records import ended, pending

    client = redis.Redis(encoding=encoding)  # never connects: commands are only packed
    connection: Any = client.connection_pool.make_connection()  # its stubs are untyped
    journal = RedisJournal(client, prefix="jé")
    now = time.time()
    for args_hash, created in (("ab" * 32, now), (None, 1_700_000_000)):
        record = pending(
            "p:step_000:" + "cd" * 32, "p", "step_000", "charge", args_hash,
            "POST http://tools.test/chargé", None, None, created, "host:1:é:1", now + 300,
        )  # fmt: skip
        done = ended(
            record, CallState.ANSWERED, now + 1.25, 1, 201, "ok", "tool", None, None, None,
            b"{}", 2, None,
        )  # fmt: skip
        keys, args = journal._begin_args(record, True, ["p:k1", "p:k2"])
        sent = [*keys, *journal._begin_more(record), *args]
        main = _main_wire(journal, record, "begin")
        assert connection.pack_command("EVALSHA", "x", 7, *sent) == connection.pack_command(
            "EVALSHA", "x", 7, *main
        )
        keys, args = journal._swap_args(done, None)
        sent = [*keys, journal._wire(journal._calls_key), *args, _number(done.updated_at)]
        main = _main_wire(journal, done, "finish")
        assert connection.pack_command("EVALSHA", "x", 6, *sent) == connection.pack_command(
            "EVALSHA", "x", 6, *main
        )
    connection.disconnect()


class _Text(str):
    """A str of another type: the record goes through json whole."""


_ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e16, 1e-7, 5e-324, 1796616920.8233626]),
    st.text(),
    st.text().map(_Text),
)


@settings(max_examples=300, deadline=None)
@given(values=st.lists(_ANY, min_size=23, max_size=23), body=st.none() | st.binary())
def test_records_are_written_field_by_field_as_json_writes_them(
    values: list[Any], body: bytes | None
) -> None:
    """The record's JSON written field by field (floats' texts remembered) is the text
    json.dumps writes for the same fields, whatever the values' types: floats (zero and
    minus zero, NaN, infinities), big ints, bools, any text, str subclasses."""
    from agentkey.journal._records import FIELDS, record_of
    from agentkey.journal._redis import _encode, _encode_data

    for name in ("state", "body"):
        values[FIELDS.index(name)] = None
    record = record_of(values)
    object.__setattr__(record, "state", CallState.ANSWERED)
    object.__setattr__(record, "body", body)
    twice = record_of([v if type(v) is not float else -v for v in values])  # signs flipped
    object.__setattr__(twice, "state", CallState.PENDING)
    object.__setattr__(twice, "body", body)
    for each in (record, twice, record):
        assert _encode(each) == _encode_data(each)


@pytest.mark.parametrize("query", ["?encoding=latin-1", "?encoding_errors=replace"])
def test_a_url_that_sets_the_encoding_keeps_every_key_in_it(
    query: str, redis_proc: RedisServer
) -> None:
    """A journal built from a URL whose query sets the client's encoding writes its
    start's keys as every other command reads them: the call it began is found by
    ``get`` and ``calls``, all its keys spelt in one encoding (a UTF-8 guess sent them
    in UTF-8 where the client spoke latin-1, and the call ran again in a process of the
    previous version)."""
    prefix = f"jé{uuid.uuid4().hex[:8]}"
    key = "p:step_001:" + "ab" * 32
    journal = RedisJournal(redis_proc.url + query, prefix=prefix)
    try:
        journal.begin(_pending(key))
        found, listed = journal.get(key), journal.calls()
    finally:
        journal.close()
    assert found is not None
    assert found.key == key
    assert [r.key for r in listed] == [key]
    client = redis.Redis.from_url(redis_proc.url)
    try:  # one encoding for all of them (which one is redis-py's packer's to choose)
        spellings = [e for e in ("latin-1", "utf-8") if client.keys(prefix.encode(e) + b"*")]
    finally:
        client.close()
    assert len(spellings) == 1


def test_a_refused_listing_says_what_else_wrote_there(redis_proc: RedisServer) -> None:
    """``calls()`` over a key of the wrong type is JournalError naming the listing and
    the prefix's other writer, not advice to check that Redis is reachable."""
    from agentkey import JournalError

    prefix = f"cmd{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_proc.url)
    journal = RedisJournal(redis_proc.url, prefix=prefix)
    try:
        client.set(journal._calls_key, "not an index")
        with pytest.raises(JournalError) as caught:
            journal.calls()
    finally:
        journal.close()
        client.close()
    assert "while listing calls" in str(caught.value)
    assert "nothing else writes under the journal's prefix" in str(caught.value)
    assert caught.value.sent is False
