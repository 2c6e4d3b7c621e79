"""``ServerOptions``: how a server front end claims, records and replays keys, as one value.

The HTTP middleware (:class:`~agentkey.server.IdempotencyMiddleware`) and the MCP
middleware (``agentkey.integrations.mcp.IdempotentToolsMiddleware``) take the same
value, validated once here, so the two front ends of one server cannot disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .._canonical import Profile
from .._exceptions import ConfigurationError
from .._validate import choice, flag, number, replace, whole
from ._decide import REPLAY_HEADER, BodyFingerprint, DecisionEvent, KeyFormat, check_replay_header
from ._lifecycle import MutationStarts
from ._stores import Store

__all__ = ["ServerOptions"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerOptions:
    """How a protected route or tool claims, records and replays a key.

    Every field has a production default; derive variants with ``replace()``. One value
    configures both middlewares alike; a field marked *HTTP* has no counterpart in MCP
    (a tool's arguments are always canonical JSON, its result stays inline and is
    marked replayed in ``_meta``) and the MCP middleware does not read it.

    - ``require_key``: a protected request without a key is refused (HTTP 400
      ``idempotency_key_missing``; MCP ``key-required``) and nothing runs. True by
      default in both middlewares: a server that adopts idempotency and silently runs
      keyless requests runs a client's resend twice, which is exactly what this library
      exists to prevent, and it fails quietly where a refusal says at once which clients
      still send no key. A server that must keep serving such clients while they
      migrate (most MCP clients send no key yet) sets ``require_key=False``: keyless
      calls then run unprotected, and the MCP middleware names the key fields it reads
      in the result's ``_meta``, so a client learns where to send one.
    - ``key_format``: ``"any"`` (agentkey keys ``<plan>:<step>:<hash>``, checked against
      the body, and opaque keys such as UUIDs) or ``"agentkey"`` (those only).
    - ``hash_profile``: the canonical JSON profile a body or the arguments are hashed by
      (``"python"`` or ``"jcs"``).
    - ``body_fingerprint`` (*HTTP*): what an opaque key's body is compared by:
      ``"bytes"`` as sent (a re-serialised retry gets 422 ``payload_mismatch``, never a
      second run) or ``"canonical"`` (equivalent JSON is one body; parses every body).
    - ``lock_ttl``: seconds a claim's lease lasts (15). Renewed every third of that
      while the handler or tool runs, so a claim whose server died is known within one
      lease. At least 1 ms, and no more than ``result_ttl``.
    - ``auto_renew``: False turns the renewal off: a claim then lives ``lock_ttl``
      unless the handler calls ``claim.renew()`` or ``claim.keep_alive()``.
    - ``hold_in_flight``: seconds (0 to 60) a duplicate of a request in flight waits for
      it and gets its replay, before a 409 / ``in-progress`` (0: at once).
    - ``result_ttl``: seconds a finished record lives (24 h).
    - ``retry_after``: whole seconds a client is told to wait on a 409 or 503 (1).
    - ``max_body_bytes`` (*HTTP*): larger request bodies get 413 (1 MiB).
    - ``max_recorded_bytes``: the largest answer recorded (1 MiB); a larger one reaches
      its caller but is not stored, and every resend of the key is told so.
    - ``max_inline_bytes`` (*HTTP*): larger answers go to the blob store (100 KiB).
    - ``replay_header`` (*HTTP*): the header, set to ``true``, on a replayed answer.
    - ``mutation_starts``: ``"on_run"`` (the side effect may have started as soon as the
      handler runs: a crash or a failure leaves the key in doubt) or ``"on_mark"`` (only
      once it awaits ``claim.begin_mutation()``).
    - ``reconcile_timeout``: seconds (up to 300) an async reconcile hook may take.
    """

    require_key: bool = True
    key_format: KeyFormat = "any"
    hash_profile: Profile = "python"
    body_fingerprint: BodyFingerprint = "bytes"
    lock_ttl: float = 15.0
    auto_renew: bool = True
    hold_in_flight: float = 0.0
    result_ttl: float = 86_400.0
    retry_after: int = 1
    max_body_bytes: int = 1024 * 1024
    max_recorded_bytes: int = 1024 * 1024
    max_inline_bytes: int = 100 * 1024
    replay_header: str = REPLAY_HEADER
    mutation_starts: MutationStarts = "on_run"
    reconcile_timeout: float = 5.0

    def __post_init__(self) -> None:
        name = "ServerOptions."
        flag(name + "require_key", self.require_key)
        choice(name + "key_format", self.key_format, ("any", "agentkey"), _KEY_FORMATS)
        choice(name + "hash_profile", self.hash_profile, ("python", "jcs"))
        choice(name + "body_fingerprint", self.body_fingerprint, _FINGERPRINTS, _BODIES)
        lock_ttl = number(name + "lock_ttl", self.lock_ttl, least=0.001)
        flag(name + "auto_renew", self.auto_renew)
        number(name + "hold_in_flight", self.hold_in_flight, most=60)
        if number(name + "result_ttl", self.result_ttl, least=0.001) < lock_ttl:
            raise ConfigurationError(
                f"{name}result_ttl ({self.result_ttl:g} s) must be at least lock_ttl "
                f"({lock_ttl:g} s): a finished record must outlive the lease that wrote it"
            )
        whole(name + "retry_after", self.retry_after, unit="seconds")
        whole(name + "max_body_bytes", self.max_body_bytes)
        whole(name + "max_recorded_bytes", self.max_recorded_bytes)
        whole(name + "max_inline_bytes", self.max_inline_bytes)
        choice(name + "mutation_starts", self.mutation_starts, _STARTS, _STARTS_MEANING)
        number(name + "reconcile_timeout", self.reconcile_timeout, above=True, most=300)
        try:  # kept as given; the middleware compares it lowercase
            check_replay_header(self.replay_header)
        except ConfigurationError as exc:
            raise ConfigurationError(f"{name}{exc}") from None

    def replace(self, **changes: Any) -> ServerOptions:
        """A copy with ``changes`` applied (validated like the original)."""
        return replace(self, changes)

    @property
    def lock_ttl_ms(self) -> int:
        """``lock_ttl`` in whole milliseconds (at least 3: a third of it renews the lease)."""
        return max(3, round(self.lock_ttl * 1000))

    @property
    def result_ttl_ms(self) -> int:
        """``result_ttl`` in whole milliseconds (never shorter than the lease)."""
        return max(self.lock_ttl_ms, round(self.result_ttl * 1000))


_KEY_FORMATS = "agentkey and opaque keys, or agentkey keys only"
_FINGERPRINTS: tuple[BodyFingerprint, ...] = ("bytes", "canonical")
_BODIES = "an opaque key's body compared by its bytes, or by its canonical JSON"
_STARTS: tuple[MutationStarts, ...] = ("on_run", "on_mark")
_STARTS_MEANING = (
    "the side effect may have started as soon as the handler runs, or at "
    "await claim.begin_mutation()"
)


# --- what both front ends check of their own arguments -------------------------------


def options_or_default(options: object) -> ServerOptions:
    """``options``, or the defaults for None; a ConfigurationError for anything else."""
    if options is None:
        return ServerOptions()
    if not isinstance(options, ServerOptions):
        raise ConfigurationError(
            f"options must be an agentkey.server.ServerOptions, got a {type(options).__name__}; "
            "build one with ServerOptions(lock_ttl=..., ...)"
        )
    return options


def check_store(store: object) -> Store:
    """``store`` when it implements :class:`Store`."""
    if not isinstance(store, Store):
        raise ConfigurationError(
            "store must implement agentkey.server.Store (MemoryStore, RedisStore, "
            f"PostgresStore ...), got a {type(store).__name__}"
        )
    return store


def check_hooks(hooks: object) -> tuple[Callable[[DecisionEvent], object], ...]:
    """``hooks`` as a tuple of callables taking one :class:`DecisionEvent`."""
    if callable(hooks) or isinstance(hooks, (str, bytes)) or not isinstance(hooks, Iterable):
        raise ConfigurationError(
            "hooks must be a sequence of callables taking one DecisionEvent, got a "
            f"{type(hooks).__name__}; wrap one hook in a list: hooks=[hook]"
        )
    out = tuple(hooks)
    for hook in out:
        if not callable(hook):
            raise ConfigurationError(
                f"hooks must be callables taking one DecisionEvent, one is a {type(hook).__name__}"
            )
    return out
