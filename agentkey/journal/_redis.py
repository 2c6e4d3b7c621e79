"""The journal in Redis, for a fleet of agents that share one record of their calls.

One string per call, ``<prefix>:{<plan>}:<key>``, holding the record as JSON; a
sorted set per plan, ``<prefix>:{<plan>}``, listing its calls by creation time,
and one per arguments hash, ``<prefix>:{<plan>}:args:<hash>``, listing the calls
with those arguments (what a repeat check asks: its cost does not grow with the
plan). All carry the plan in a hash tag, so a Redis Cluster keeps a plan's
records in one slot. A global sorted set,
``<prefix>:calls``, lists every call by its last change (for ``agentkey
journal``); a member whose record is gone is removed when it is listed or pruned.
What a route showed about honouring keys is one string per route,
``<prefix>:{evidence}:r:<route>``, expiring 30 days after it was last seen, listed
in ``<prefix>:{evidence}:index`` (by expiry, expiring with it).

Writing a call's start is one command and one round trip: a script, run by its
SHA1, that sets the record unless it exists (or returns it), lists it in the
plan's indexes and the global one, and reads the route's evidence. Its end is
another (a compare-and-set on the owner, and the global index). A server that
refuses one script's keys of several slots (a Redis Cluster node: CROSSSLOT, run
nothing) gets scripts that touch the plan's slot alone from then on, with the
global index and the evidence beside them in a pipeline (the same round trips).
Records of ended calls expire ``retention`` after their last change, and the
plan's indexes with them; a record of a call that may have run and is not settled
(pending, in doubt) never expires, nor does an index that lists one (each index's
unsettled records are listed in ``<index>~unsettled``, in the same slot). Redis's
persistence settings decide what a crash of Redis itself loses (``appendfsync
everysec`` loses at most a second).

Needs redis-py (``pip install 'agentkey-idempotency[redis]'``). Give it a URL
(both kinds of invoker then work), or a ``redis.Redis`` (``ToolInvoker``) or
``redis.asyncio.Redis`` (``AsyncToolInvoker``) client of your own.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import Collection, Sequence
from typing import Any

from .._clock import Clock
from .._exceptions import ConfigurationError, JournalError, missing_extra
from ._base import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_RETENTION,
    EVIDENCE_TTL,
    SETTLED,
    Begun,
    CallRecord,
    CallState,
    Evidence,
    afinish_missed,
    check_journal_options,
    finish_missed,
    is_live,
    journal_clock,
    malformed,
    prunable,
    repeats_among,
    settle_by_take_over,
)
from ._records import FIELDS, recorded, values_of

try:
    import redis
    import redis.asyncio as aioredis
    from redis.exceptions import NoPermissionError, NoScriptError, RedisError, ResponseError
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise missing_extra("redis", "redis", exc) from exc

__all__ = ["RedisJournal"]

#: Keep an index (KEYS[2], KEYS[3]) while one of its records is unsettled (never expires):
#: KEYS[4], KEYS[5] list each index's unsettled records. The record ``member``, whose
#: record TTL is ARGV[6] ('0': unsettled), joins or leaves them; an index with none left
#: expires ARGV[2] ms from now, one with any never does.
_KEEP = """
local function keep(member)
  for i = 2, 3 do
    if ARGV[6] == '0' then
      redis.call('SADD', KEYS[i + 2], member)
    else
      redis.call('SREM', KEYS[i + 2], member)
    end
  end
  for i = 2, 3 do
    if redis.call('SCARD', KEYS[i + 2]) > 0 then
      redis.call('PERSIST', KEYS[i])
    else
      redis.call('PEXPIRE', KEYS[i], ARGV[2])
    end
  end
end
"""
#: Set the record unless its key exists (then return it), and index it under its plan
#: (KEYS[2]) and its arguments (KEYS[3]); the record expires after ARGV[6] ms ('0': never).
#: With ARGV[5] = '1', first list the other calls with its arguments (a table of their keys;
#: then nothing is written) when one of them is not among the known keys, ARGV[8...].
#: (ARGV[7] is the record's last change: the global index's score, see _BEGIN_ONE.)
_BEGIN_BODY = """
local function begin()
  if ARGV[5] == '1' then
    local known = {}
    for i = 8, #ARGV do known[ARGV[i]] = true end
    local others, new = {}, false
    for _, key in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do
      if key ~= ARGV[4] then
        others[#others + 1] = key
        if not known[key] then new = true end
      end
    end
    if new then return others end
  end
  local existing = redis.call('GET', KEYS[1])
  if existing then return existing end
  if ARGV[6] == '0' then
    redis.call('SET', KEYS[1], ARGV[1])
  else
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[6])
  end
  for i = 2, 3 do
    redis.call('ZADD', KEYS[i], ARGV[3], ARGV[4])
  end
  keep(ARGV[4])
  return false
end
"""
#: The begin alone: every key in the plan's slot (a server that refuses _BEGIN_ONE's keys
#: of three slots, a Redis Cluster node, gets this and the other two in a pipeline).
_BEGIN = _KEEP + _BEGIN_BODY + "return begin()\n"
#: The begin and what a call's start also needs, in one round trip and one command: unless
#: other calls were listed (nothing was written), the call joins the global index (KEYS[6],
#: scored ARGV[7]); returns {what begin() returned, the route's evidence (KEYS[7])}.
_BEGIN_ONE = (
    _KEEP
    + _BEGIN_BODY
    + """
local found = begin()
if type(found) ~= 'table' then redis.call('ZADD', KEYS[6], ARGV[7], ARGV[4]) end
return {found, redis.call('GET', KEYS[7])}
"""
)
#: Replace the record when its state, owner and last change are still ARGV[3..5]
#: (take over) or when its owner is still ARGV[4] (finish: ARGV[3] is empty); ARGV[7] is
#: its call's key. The record
#: expires after ARGV[6] ms ('0': never, a call not settled); its plan's indexes (KEYS[2],
#: KEYS[3]) as _KEEP says.
_SWAP_BODY = """
local function swap()
  local current = redis.call('GET', KEYS[1])
  if not current then return 0 end
  local ok, record = pcall(cjson.decode, current)
  if not ok then return 0 end
  local owner = record['owner']
  if owner == cjson.null then owner = '' end
  if owner ~= ARGV[4] then return 0 end
  if ARGV[3] ~= '' then
    if record['state'] ~= ARGV[3] or record['updated_at'] ~= tonumber(ARGV[5]) then return 0 end
  end
  if ARGV[6] == '0' then
    redis.call('SET', KEYS[1], ARGV[1])
  else
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[6])
  end
  keep(ARGV[7])
  return 1
end
"""
_SWAP = _KEEP + _SWAP_BODY + "return swap()\n"
#: A finish in one command: the swap, then the call's entry in the global index (KEYS[6])
#: scored its last change (ARGV[8]), whether the swap was made or not (as the pipeline did).
_SWAP_ONE = (
    _KEEP
    + _SWAP_BODY
    + """
local done = swap()
redis.call('ZADD', KEYS[6], ARGV[8], ARGV[7])
return done
"""
)
#: Delete the record if it is still ARGV[1], and its entries in its plan's indexes (which
#: expire ARGV[3] ms from now once no unsettled record is left in them).
_DELETE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
for i = 2, 3 do
  redis.call('ZREM', KEYS[i], ARGV[2])
  redis.call('SREM', KEYS[i + 2], ARGV[2])
  if redis.call('SCARD', KEYS[i + 2]) == 0 then redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
end
return 1
"""
#: Remember a route's evidence (KEYS[1]) for ARGV[3] ms, keeping when it was first seen
#: while it lasted; list it in KEYS[2] by expiry (ARGV[4]) and drop the expired ones. The
#: index lives as long as its longest entry (ARGV[6] ms at least): a short-lived entry
#: (``learn(ttl=)``) never shortens it.
_LEARN = """
local first = tonumber(ARGV[5])
local known = redis.call('GET', KEYS[1])
if known then
  local ok, data = pcall(cjson.decode, known)
  if ok and type(data) == 'table' and tonumber(data['first_seen']) then
    first = tonumber(data['first_seen'])
  end
end
local value = cjson.encode({marker = ARGV[1], first_seen = first, last_seen = tonumber(ARGV[5]),
                            expires_at = tonumber(ARGV[4])})
redis.call('SET', KEYS[1], value, 'PX', ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[5])
if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[6]) then redis.call('PEXPIRE', KEYS[2], ARGV[6]) end
return 1
"""


class _Script:
    """A Lua script run by its SHA1 (EVALSHA: the text goes to a server once, not with every
    call). A server that does not know it (restarted, flushed, evicted) answers NOSCRIPT
    without running anything; the text is sent then (EVAL, which also caches it). So is it
    to a user whose ACL refuses EVALSHA but allows EVAL (NOPERM: nothing ran either)."""

    __slots__ = ("sha", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()  # noqa: S324 - Redis's name for it

    def __call__(
        self, client: redis.Redis, keys: Sequence[str | bytes], args: Sequence[Any]
    ) -> Any:
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except (NoScriptError, NoPermissionError):  # nothing ran: send the text
            return client.eval(self.text, len(keys), *keys, *args)

    async def run(
        self, client: aioredis.Redis, keys: Sequence[str | bytes], args: Sequence[Any]
    ) -> Any:
        """The same on an asyncio client."""
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except (NoScriptError, NoPermissionError):
            return await client.eval(self.text, len(keys), *keys, *args)


_RUN_BEGIN_ONE = _Script(_BEGIN_ONE)
_RUN_SWAP = _Script(_SWAP)
_RUN_SWAP_ONE = _Script(_SWAP_ONE)


def _cross_slot(exc: ResponseError) -> bool:
    """Whether a server refused a script's keys for lying in several slots (a Redis Cluster
    node, a proxy of a sharded database): then the script did not run."""
    text = str(exc)
    return "CROSSSLOT" in text or "same slot" in text


#: One encoder, built once (the same output as ``json.dumps(..., separators=(",", ":"))``).
_json = json.JSONEncoder(separators=(",", ":")).encode


#: The text of recent floats: a call's times recur (``created_at``, ``updated_at`` and
#: ``lease_until`` in both its records and in its scripts' arguments), and a float's
#: shortest ``repr`` is the dearest part of writing them. Bounded; zero is never kept
#: (0.0 and -0.0 are one key and two texts).
_FLOATS: dict[float, str] = {}


def _float_text(value: float) -> str:
    """``repr(value)`` of a float, remembered."""
    text = _FLOATS.get(value)
    if text is None:
        text = repr(value)
        if value:
            if len(_FLOATS) >= 256:
                _FLOATS.clear()
            _FLOATS[value] = text
    return text


def _number(value: Any) -> Any:
    """A float as the bytes redis-py sends for it (``repr(value).encode()``), made here so
    that one value sent twice is written out once; anything else as it is."""
    return _float_text(value).encode() if type(value) is float else value


def _sends_utf8(encoder: Any) -> bool:
    """Whether a client's encoder (``get_encoder()``) sends a str as its UTF-8 bytes (the
    default): then the journal hands it those bytes itself, the same on the wire, and
    redis-py skips its type checks and codec look-up for each of a script's arguments."""
    name = str(getattr(encoder, "encoding", "")).lower().replace("_", "-")
    return name in ("utf-8", "utf8") and getattr(encoder, "encoding_errors", None) == "strict"


#: Each field's ``"name":`` (with the separator before it), in :data:`FIELDS` order
#: without ``body``; the record's JSON writes them in that order, then ``body64``.
_HEADS = tuple(
    ("{" if not i else ",") + _json(name) + ":"
    for i, name in enumerate(name for name in FIELDS if name != "body")
)
_BODY_AT, _STATE_AT = FIELDS.index("body"), FIELDS.index("state")


def _value_text(value: Any) -> str | None:
    """``value``'s JSON text as ``json.dumps`` writes it, for the types a record's fields
    hold (str, None, int, finite float, bool); None for anything else."""
    kind = type(value)
    if kind is str:
        return _json(value)  # the encoder's own escaping (ASCII), as for any str
    if value is None:
        return "null"
    if kind is float:
        return _float_text(value) if math.isfinite(value) else None
    if kind is int:
        return repr(value)
    if kind is bool:
        return "true" if value else "false"
    return None


def _encode(record: CallRecord) -> str:
    """The record as its JSON string: every field but ``body``, in order, then ``body64``.

    Written field by field (the same text as :func:`_encode_data`, which writes any
    record whose values are of other types), so that each float's text comes from
    :func:`_float_text`."""
    values = list(values_of(record))
    values[_STATE_AT] = record.state.value
    body = values.pop(_BODY_AT)
    parts = []
    for head, value in zip(_HEADS, values, strict=True):
        text = _value_text(value)
        if text is None:
            return _encode_data(record)
        parts.append(head + text)
    if body is not None:
        parts.append(',"body64":"' + base64.b64encode(body).decode() + '"}')
    else:
        parts.append(',"body64":null}')
    return "".join(parts)


def _encode_data(record: CallRecord) -> str:
    """:func:`_encode` through ``json`` (a dict of the fields), for any value."""
    data = dict(zip(FIELDS, values_of(record), strict=True))
    data["state"] = record.state.value
    body = data.pop("body")
    data["body64"] = None if body is None else base64.b64encode(body).decode()
    return _json(data)


def _decode(raw: bytes | str) -> CallRecord:
    """The record ``raw`` holds; ValueError or TypeError when it holds none."""
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object")
    body64 = data.pop("body64", None)
    data["state"] = CallState(data["state"])
    data["body"] = None if body64 is None else base64.b64decode(body64)
    return CallRecord(**data)


_BAD = (ValueError, TypeError, KeyError)


def _decoded(raws: Sequence[Any], where: str) -> list[CallRecord]:
    """The records of ``raws`` (None: gone, skipped); a malformed one is reported, skipped."""
    found = []
    for raw in raws:
        if raw is None:
            continue
        try:
            found.append(_decode(raw))
        except _BAD as exc:
            malformed(where, exc)
    return found


def _one(raw: Any, key: str, where: str) -> CallRecord | None:
    if raw is None:
        return None
    try:
        return _decode(raw)
    except _BAD as exc:
        raise malformed(where, exc, key=key) from None


class RedisJournal:
    """The journal in Redis (or Valkey, or a Redis Cluster).

    ``redis`` is a URL (``redis://host:6379/0``), a ``redis.Redis`` or a
    ``redis.asyncio.Redis``. ``prefix`` names the journal's keys.
    """

    def __init__(
        self,
        redis_: str | redis.Redis | aioredis.Redis,
        *,
        prefix: str = "agentkey:journal",
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        retention: float = DEFAULT_RETENTION,
        clock: Clock | None = None,
    ) -> None:
        self.max_body_bytes, self.retention = check_journal_options(max_body_bytes, retention)
        if not isinstance(prefix, str) or not prefix or any(c in prefix for c in "{}"):
            raise ConfigurationError(f"prefix must be a non-empty str without braces: {prefix!r}")
        self.prefix = prefix
        self._clock = journal_clock(clock)
        self._sync: redis.Redis | None = None
        self._async: aioredis.Redis | None = None
        self._url: str | None = None
        if isinstance(redis_, str):
            if not redis_.startswith(("redis://", "rediss://", "unix://")):
                raise ConfigurationError(
                    f"RedisJournal takes a redis:// URL or a client, got {redis_[:40]!r}"
                )
            self._url = redis_
        elif isinstance(redis_, aioredis.Redis):
            self._async = redis_
        elif isinstance(redis_, redis.Redis):
            self._sync = redis_
        else:
            raise ConfigurationError(
                "RedisJournal takes a redis:// URL, a redis.Redis or a redis.asyncio.Redis, "
                f"got {type(redis_).__name__}"
            )
        self._utf8 = _sends_utf8(self._encoder())
        #: A call's script keys (begin and finish use the same ones), as sent: by
        #: (prefix, plan, key, args_hash); cleared when full.
        self._names: dict[tuple[str, str, str, str | None], tuple[str | bytes, ...]] = {}
        self.supports_sync = self._async is None
        self.supports_async = self._sync is None
        # A call's start and end each run one script over keys of three slots (the plan's,
        # the global index's, the evidence's): one command per round trip. A server that
        # refuses keys of several slots in one script makes this True for good: each script
        # then touches the plan's slot alone, the rest goes beside it in a pipeline.
        self._split = False

    def __repr__(self) -> str:
        return f"RedisJournal(prefix={self.prefix!r})"

    # --- clients and names --------------------------------------------------------------

    def _encoder(self) -> Any:
        """The encoder of the client this journal sends through (None: not known). A URL's
        query can set ``encoding=`` and ``encoding_errors=``: it is read from a client built
        from the URL (which opens no connection), so that a latin-1 URL keeps its keys in
        latin-1 like every other command; a URL redis-py refuses leaves the journal on
        redis-py's encoding, and the error to its first command, as before."""
        client = self._sync if self._sync is not None else self._async
        if client is not None:
            return client.get_encoder()
        try:
            probe = redis.Redis.from_url(self._url or "")
        except Exception:  # any refusal: said again, typed, at its first command
            return None
        try:
            return probe.get_encoder()
        finally:
            probe.close()

    def _client(self) -> redis.Redis:
        if self._sync is None:
            if self._url is None:
                raise ConfigurationError(f"{self!r} was given an asyncio client: use the a-methods")
            self._sync = redis.Redis.from_url(self._url)
        return self._sync

    def _aclient(self) -> aioredis.Redis:
        if self._async is None:
            if self._url is None:
                raise ConfigurationError(f"{self!r} was given a sync client: use the sync methods")
            self._async = aioredis.Redis.from_url(self._url)
        return self._async

    def _record_key(self, plan: str, key: str) -> str:
        return f"{self.prefix}:{{{plan}}}:{key}"

    def _plan_key(self, plan: str) -> str:
        return f"{self.prefix}:{{{plan}}}"

    def _args_key(self, plan: str, args_hash: str) -> str:
        return f"{self.prefix}:{{{plan}}}:args:{args_hash}"

    def _index_key(self, plan: str, args_hash: str | None) -> str:
        """Where ``find`` lists the candidates: the arguments' index when it has a hash."""
        return self._plan_key(plan) if args_hash is None else self._args_key(plan, args_hash)

    @property
    def _calls_key(self) -> str:
        return f"{self.prefix}:calls"

    def _evidence_key(self, route: str) -> str:
        return f"{self.prefix}:{{evidence}}:r:{route}"

    @property
    def _evidence_index(self) -> str:
        return f"{self.prefix}:{{evidence}}:index"

    def _ttl_ms(self) -> int:
        return int(self.retention * 1000)

    def _record_ttl_ms(self, record: CallRecord) -> int:
        """How long a record lasts: ``retention`` once its call ended; 0 (for ever) before."""
        return self._ttl_ms() if record.state in SETTLED else 0

    def _wire(self, text: str) -> str | bytes:
        """``text`` as the script's argument: its UTF-8 bytes when the client would send
        exactly those (:func:`_sends_utf8`), else the str for the client to encode."""
        return text.encode() if self._utf8 else text

    def _keys_of(self, record: CallRecord) -> tuple[str | bytes, ...]:
        name = (self.prefix, record.plan, record.key, record.args_hash)
        keys = self._names.get(name)
        if keys is None:
            indexes = [
                self._plan_key(record.plan),
                self._index_key(record.plan, record.args_hash),  # the plan's again when None
            ]
            unsettled = [f"{index}~unsettled" for index in indexes]  # same slot: {plan}
            texts = [self._record_key(record.plan, record.key), *indexes, *unsettled]
            keys = tuple(self._wire(k) for k in texts)
            if len(self._names) >= 1024:
                self._names.clear()
            self._names[name] = keys
        return keys

    def _begin_args(
        self, record: CallRecord, repeats: bool, known: Collection[str] | None = None
    ) -> tuple[tuple[str | bytes, ...], list[Any]]:
        wire = self._wire
        look = "1" if repeats and record.args_hash is not None else "0"
        created = _number(record.created_at)
        updated = created if record.updated_at is record.created_at else record.updated_at
        args = [
            wire(_encode(record)),
            self._ttl_ms(),
            created,
            wire(record.key),
            wire(look),
            self._record_ttl_ms(record),
            _number(updated),
        ]
        return self._keys_of(record), [*args, *(wire(k) for k in known or ())]

    def _swap_args(
        self, record: CallRecord, previous: CallRecord | None
    ) -> tuple[tuple[str | bytes, ...], list[Any]]:
        wire = self._wire
        keys = self._keys_of(record)
        ttl = self._record_ttl_ms(record)
        if previous is None:  # finish: the owner must still be this record's
            empty = wire("")
            args = [
                wire(_encode(record)), self._ttl_ms(), empty, wire(record.owner or ""), empty, ttl
            ]  # fmt: skip
        else:
            args = [
                wire(_encode(record)),
                self._ttl_ms(),
                wire(previous.state.value),
                wire(previous.owner or ""),
                wire(repr(float(previous.updated_at))),
                ttl,
            ]
        return keys, [*args, wire(record.key)]

    def _begin_more(self, record: CallRecord) -> tuple[str | bytes, str | bytes]:
        """The begin script's keys beyond :meth:`_keys_of`: the global index, the evidence."""
        return self._wire(self._calls_key), self._wire(self._evidence_key(record.route))

    def _begun(self, record: CallRecord, raw: Any, evidence: Any) -> Begun:
        existing = _one(raw, record.key, repr(self))
        if existing is None:
            return recorded(self._evidence_of(evidence))
        return Begun(existing, self._evidence_of(evidence), is_live(existing, self._clock.time()))

    def _evidence_data(self, route: str, raw: Any) -> Evidence | None:
        """The evidence ``raw`` holds, if it is well formed and in force."""
        if raw is None:
            return None
        try:
            data = json.loads(raw)
            found = Evidence(
                route,
                str(data["marker"]),
                float(data["first_seen"]),
                float(data["last_seen"]),
                float(data["expires_at"]),
            )
        except (*_BAD, AttributeError):
            return None
        return found if found.marker and self._clock.time() <= found.expires_at else None

    def _evidence_of(self, raw: Any) -> str | None:
        found = self._evidence_data("", raw)
        return None if found is None else found.marker

    def _learn_args(
        self, route: str, evidence: str, ttl: float | None = None
    ) -> tuple[list[str], list[Any]]:
        now = self._clock.time()
        keys = [self._evidence_key(route), self._evidence_index]
        ttl = EVIDENCE_TTL if ttl is None else ttl
        ttl_ms = max(1, int(ttl * 1000))
        index_ms = max(ttl_ms, int(EVIDENCE_TTL * 1000))
        return keys, [evidence, route, ttl_ms, repr(now + ttl), repr(now), index_ms]

    def _wrap(self, exc: RedisError) -> JournalError:
        return JournalError(
            f"the Redis journal failed ({type(exc).__name__}); the call was not sent. Check "
            "that Redis is reachable, or pass another journal",
            sent=False,
        )

    # --- synchronous ---------------------------------------------------------------------

    def begin(
        self, record: CallRecord, *, repeats: bool = False, known: Collection[str] | None = None
    ) -> Begun:
        seen = set(known or ())  # the keys looked at: the script writes unless others came
        client = self._client()
        while True:
            keys, args = self._begin_args(record, repeats, seen)
            try:
                raw, evidence = self._begin_once(client, record, keys, args)
                if not isinstance(raw, list):
                    return self._begun(record, raw, evidence)
                # Other calls with these arguments: nothing was written (nor is listed).
                raws = client.mget([self._record_key(record.plan, _text(k)) for k in raw])
            except RedisError as exc:
                raise self._wrap(exc) from None
            earlier = _repeats(record, raws, known)
            if earlier:
                return Begun(None, self._evidence_of(evidence), False, earlier)
            # Other tools' calls with these arguments, or runtime calls: look again past
            # them, in the same atomic script (a copy that wrote meanwhile is seen).
            seen.update(map(_text, raw))

    def _begin_once(
        self,
        client: redis.Redis,
        record: CallRecord,
        keys: Sequence[str | bytes],
        args: list[Any],
    ) -> tuple[Any, Any]:
        """Run the begin script: (what it found, the route's evidence), in one round trip."""
        if not self._split:
            try:
                found, evidence = _RUN_BEGIN_ONE(client, [*keys, *self._begin_more(record)], args)
                return found, evidence
            except ResponseError as exc:
                if not _cross_slot(exc):
                    raise
                self._split = True
        with client.pipeline(transaction=False) as pipe:
            pipe.zscore(self._calls_key, record.key)
            pipe.eval(_BEGIN, len(keys), *keys, *args)
            pipe.zadd(self._calls_key, {record.key: record.updated_at})
            pipe.get(self._evidence_key(record.route))
            listed, found, _, evidence = pipe.execute()
        if isinstance(found, list) and listed is None:  # nothing written: nor is it listed
            client.zrem(self._calls_key, record.key)  # (a record listed before stays so)
        return found, evidence

    def take_over(self, record: CallRecord, previous: CallRecord) -> bool:
        keys, args = self._swap_args(record, previous)
        return bool(_RUN_SWAP(self._client(), keys, args))

    def finish(self, record: CallRecord) -> bool:
        keys, args = self._swap_args(record, None)
        client = self._client()
        done = None
        if not self._split:
            try:
                more = [*args, _number(record.updated_at)]
                done = _RUN_SWAP_ONE(client, [*keys, self._wire(self._calls_key)], more)
            except ResponseError as exc:
                if not _cross_slot(exc):
                    raise
                self._split = True
        if done is None:
            with client.pipeline(transaction=False) as pipe:
                pipe.eval(_SWAP, len(keys), *keys, *args)
                pipe.zadd(self._calls_key, {record.key: record.updated_at})
                done, _ = pipe.execute()
        if done:
            return True
        raise finish_missed(self, record)

    def get(self, key: str) -> CallRecord | None:
        plan = key.partition(":")[0]
        raw = self._client().get(self._record_key(plan, key))
        return _one(raw, key, repr(self))

    def find(
        self,
        plan: str,
        *,
        tool: str | None = None,
        args_hash: str | None = None,
        call_id: str | None = None,
    ) -> list[CallRecord]:
        client = self._client()
        keys = client.zrange(self._index_key(plan, args_hash), 0, -1)
        raws = client.mget([self._record_key(plan, _text(k)) for k in keys]) if keys else []
        return _filtered(_decoded(raws, repr(self)), tool, args_hash, call_id)

    def calls(
        self,
        *,
        plan: str | None = None,
        states: Sequence[CallState] | None = None,
        limit: int = 100,
    ) -> list[CallRecord]:
        try:
            found = self._listed(plan, limit)
        except RedisError as exc:
            advice = (
                "Redis refused a command: check that nothing else writes under the "
                "journal's prefix, or give it a prefix of its own"
                if isinstance(exc, ResponseError)
                else "Check that Redis is reachable, or pass another journal"
            )
            raise JournalError(
                f"the Redis journal failed ({type(exc).__name__}) while listing calls; "
                f"no record was changed. {advice}",
                sent=False,
            ) from None
        wanted = set(states) if states is not None else None
        found = [r for r in found if wanted is None or r.state in wanted]
        return sorted(found, key=lambda r: r.updated_at, reverse=True)[:limit]

    def _listed(self, plan: str | None, limit: int) -> list[CallRecord]:
        """The records :meth:`calls` chooses from: a plan's, or the newest of the index."""
        if plan is not None:
            found = self.find(plan)
        else:
            client = self._client()
            keys = [_text(k) for k in client.zrevrange(self._calls_key, 0, 10 * limit)]
            with client.pipeline(transaction=False) as pipe:  # one round trip, any slot
                for k in keys:
                    pipe.get(self._record_key(k.partition(":")[0], k))
                raws = pipe.execute() if keys else []
            gone = [k for k, raw in zip(keys, raws, strict=True) if raw is None]
            if gone:  # their records expired: the index forgets them too
                client.zrem(self._calls_key, *gone)
            found = _decoded(raws, repr(self))
        return found

    def learn(self, route: str, evidence: str, *, ttl: float | None = None) -> None:
        keys, args = self._learn_args(route, evidence, ttl)
        self._client().eval(_LEARN, len(keys), *keys, *args)

    def evidence(self) -> list[Evidence]:
        client = self._client()
        routes = [
            _text(r) for r in client.zrangebyscore(self._evidence_index, self._clock.time(), "+inf")
        ]
        raws = client.mget([self._evidence_key(r) for r in routes]) if routes else []
        found = [self._evidence_data(r, raw) for r, raw in zip(routes, raws, strict=True)]
        return sorted((e for e in found if e is not None), key=lambda e: (-e.last_seen, e.route))

    def forget(self, route: str) -> bool:
        client = self._client()
        with client.pipeline(transaction=False) as pipe:
            pipe.delete(self._evidence_key(route))
            pipe.zrem(self._evidence_index, route)
            deleted, _ = pipe.execute()
        return bool(deleted)

    def settle(
        self, key: str, state: CallState, *, reason: str, force: bool = False
    ) -> CallRecord | None:
        settled = settle_by_take_over(self, key, state, reason, force=force, now=self._clock.time())
        if settled is not None:
            self._client().zadd(self._calls_key, {key: settled.updated_at})
        return settled

    def prune(self, *, older_than: float, include_unsettled: bool = False) -> int:
        client = self._client()
        now = self._clock.time()
        cutoff = now - older_than
        count = 0
        for key in [_text(k) for k in client.zrangebyscore(self._calls_key, 0, cutoff)]:
            name = self._record_key(key.partition(":")[0], key)
            raw = client.get(name)
            if raw is None:  # expired: only its entry in the index was left
                client.zrem(self._calls_key, key)
                continue
            try:
                found = _decode(raw)
            except _BAD as exc:
                malformed(repr(self), exc, key=key)
                continue
            if not prunable(found, cutoff, include_unsettled=include_unsettled, now=now):
                continue
            keys = self._keys_of(found)
            if client.eval(_DELETE, len(keys), *keys, raw, key, self._ttl_ms()):
                client.zrem(self._calls_key, key)
                count += 1
        return count

    def close(self) -> None:
        if self._sync is not None and self._url is not None:
            self._sync.close()
            self._sync = None

    # --- asyncio -------------------------------------------------------------------------

    async def abegin(
        self, record: CallRecord, *, repeats: bool = False, known: Collection[str] | None = None
    ) -> Begun:
        client = self._aclient()
        seen = set(known or ())  # as in begin()
        while True:
            keys, args = self._begin_args(record, repeats, seen)
            try:
                raw, evidence = await self._abegin_once(client, record, keys, args)
                if not isinstance(raw, list):
                    return self._begun(record, raw, evidence)
                raws = await client.mget([self._record_key(record.plan, _text(k)) for k in raw])
            except RedisError as exc:
                raise self._wrap(exc) from None
            earlier = _repeats(record, raws, known)
            if earlier:
                return Begun(None, self._evidence_of(evidence), False, earlier)
            seen.update(map(_text, raw))

    async def _abegin_once(
        self,
        client: aioredis.Redis,
        record: CallRecord,
        keys: Sequence[str | bytes],
        args: list[Any],
    ) -> tuple[Any, Any]:
        """:meth:`_begin_once` on the asyncio client."""
        if not self._split:
            try:
                more = self._begin_more(record)
                found, evidence = await _RUN_BEGIN_ONE.run(client, [*keys, *more], args)
                return found, evidence
            except ResponseError as exc:
                if not _cross_slot(exc):
                    raise
                self._split = True
        async with client.pipeline(transaction=False) as pipe:
            pipe.zscore(self._calls_key, record.key)
            pipe.eval(_BEGIN, len(keys), *keys, *args)
            pipe.zadd(self._calls_key, {record.key: record.updated_at})
            pipe.get(self._evidence_key(record.route))
            listed, found, _, evidence = await pipe.execute()
        if isinstance(found, list) and listed is None:
            await client.zrem(self._calls_key, record.key)
        return found, evidence

    async def atake_over(self, record: CallRecord, previous: CallRecord) -> bool:
        keys, args = self._swap_args(record, previous)
        return bool(await _RUN_SWAP.run(self._aclient(), keys, args))

    async def afinish(self, record: CallRecord) -> bool:
        keys, args = self._swap_args(record, None)
        client = self._aclient()
        done = None
        if not self._split:
            try:
                more = [*args, _number(record.updated_at)]
                done = await _RUN_SWAP_ONE.run(client, [*keys, self._wire(self._calls_key)], more)
            except ResponseError as exc:
                if not _cross_slot(exc):
                    raise
                self._split = True
        if done is None:
            async with client.pipeline(transaction=False) as pipe:
                pipe.eval(_SWAP, len(keys), *keys, *args)
                pipe.zadd(self._calls_key, {record.key: record.updated_at})
                done, _ = await pipe.execute()
        if done:
            return True
        raise await afinish_missed(self, record)

    async def aget(self, key: str) -> CallRecord | None:
        plan = key.partition(":")[0]
        raw = await self._aclient().get(self._record_key(plan, key))
        return _one(raw, key, repr(self))

    async def afind(
        self,
        plan: str,
        *,
        tool: str | None = None,
        args_hash: str | None = None,
        call_id: str | None = None,
    ) -> list[CallRecord]:
        client = self._aclient()
        keys = await client.zrange(self._index_key(plan, args_hash), 0, -1)
        raws = await client.mget([self._record_key(plan, _text(k)) for k in keys]) if keys else []
        return _filtered(_decoded(raws, repr(self)), tool, args_hash, call_id)

    async def alearn(self, route: str, evidence: str, *, ttl: float | None = None) -> None:
        keys, args = self._learn_args(route, evidence, ttl)
        await self._aclient().eval(_LEARN, len(keys), *keys, *args)

    async def aclose(self) -> None:
        if self._async is not None and self._url is not None:
            await self._async.aclose()
            self._async = None


def _repeats(
    record: CallRecord, raws: Sequence[Any], known: Collection[str] | None = None
) -> tuple[CallRecord, ...]:
    return repeats_among(record, _decoded(raws, "the Redis journal"), known=known)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _filtered(
    records: Sequence[CallRecord], tool: str | None, args_hash: str | None, call_id: str | None
) -> list[CallRecord]:
    found = [
        r
        for r in records
        if (tool is None or r.tool == tool)
        and (args_hash is None or r.args_hash == args_hash)
        and (call_id is None or r.call_id == call_id)
    ]
    return sorted(found, key=lambda r: (r.created_at, r.key))
