"""Reconcile hooks: settle a call in doubt by asking whether it ran.

A call is in doubt when its request may have reached the tool and no answer
says whether it ran, and the tool is not known to honour Idempotency-Key, so
sending it again could run it twice. A ``reconcile=`` hook on the invoker is
asked instead: given the :class:`InDoubt` call, it returns a :class:`Verdict`.

- ``Verdict.ran(body)``: it ran; ``body`` is its answer (what the tool would
  have said). The invoker returns it as the call's result.
- ``Verdict.not_run()``: it did not run, and cannot still be running: the
  invoker sends it (again). Answer this only when that is certain: a request
  still on its way through the tool must not be mistaken for one that never came.
  The invoker believes it only once ``not_run_after`` seconds (60 by default; a
  hook object may set its own ``not_run_after`` attribute) have passed since the
  call's last request may have left (``InDoubt.last_sent_at``); before that it
  counts as "cannot tell yet".
- ``Verdict.in_doubt(reason)``: cannot tell; the call ends in
  :class:`~agentkey.OutcomeUnknown` and stays in doubt in the journal.

:class:`HttpLookup` is a ready-made hook for tools that can be asked over
HTTP whether an operation exists.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urljoin, urlsplit

from .._exceptions import ConfigurationError
from ..client._effects import Answer, Failure

__all__ = ["HttpLookup", "InDoubt", "Verdict"]

_PLACEHOLDERS = ("key", "plan", "step", "tool", "args_hash")
#: How long after a call's last request left an HttpLookup believes a 404 (seconds).
NOT_RUN_AFTER = 60.0


@dataclass(frozen=True, slots=True)
class InDoubt:
    """A call that may have run, as a reconcile hook sees it.

    ``args`` are the arguments that were sent; ``sent_at`` is when the first
    request was recorded (Unix seconds), ``attempts`` how many were sent;
    ``last_sent_at`` is when the last request may have left (Unix seconds; None
    when not known). A "not run" is believed only ``not_run_after`` seconds after it.
    """

    idempotency_key: str = field(repr=False)
    plan: str
    step: str | None
    tool: str | None
    args: Mapping[str, Any] = field(repr=False)
    method: str
    url: str = field(repr=False)
    sent_at: float
    attempts: int
    last_sent_at: float | None = None

    @property
    def args_hash(self) -> str | None:
        """The key's ``args_hash`` (None for a key that is not agentkey's)."""
        parts = self.idempotency_key.split(":")
        return parts[2] if len(parts) == 3 else None


@dataclass(frozen=True, slots=True)
class Verdict:
    """A reconcile hook's answer: ``happened`` True (ran), False (did not run) or None."""

    happened: bool | None
    body: Any = None
    status_code: int = 200
    reason: str | None = None

    @classmethod
    def ran(cls, body: Any = None, *, status_code: int = 200) -> Verdict:
        """It ran; ``body`` (JSON values, or bytes) is its answer."""
        if isinstance(status_code, bool) or not isinstance(status_code, int):
            raise ConfigurationError(f"status_code must be an int, got {status_code!r}")
        if not 200 <= status_code < 300:
            raise ConfigurationError(
                f"Verdict.ran takes the status of a successful answer (2xx), got {status_code}"
            )
        return cls(True, body, status_code)

    @classmethod
    def not_run(cls) -> Verdict:
        """It did not run and cannot still be running: sending it is safe."""
        return cls(False)

    @classmethod
    def in_doubt(cls, reason: str = "") -> Verdict:
        """It cannot be told; the call stays in doubt."""
        return cls(None, reason=reason or None)

    def content(self) -> bytes:
        """The answer's body as bytes (JSON-encoded unless it is bytes already)."""
        if isinstance(self.body, (bytes, bytearray)):
            return bytes(self.body)
        if self.body is None:
            return b""
        return json.dumps(self.body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def not_yet(verdict: Verdict, quiet: float | None, after: float, who: str) -> Verdict:
    """``verdict``, or "cannot tell yet" for a "not run" said before ``after`` seconds of
    quiet (a request of the call could still arrive); ``quiet`` None: long enough."""
    if verdict.happened is False and quiet is not None and quiet < after:
        return Verdict.in_doubt(
            f"{who} found no such call, but a request of it left {quiet:.1f} s ago and "
            f"could still arrive ('not run' is believed {after:g} s after the last request, "
            "not_run_after=); call again later"
        )
    return verdict


def not_run_after(hook: object) -> float:
    """How long after a call's last request ``hook``'s "not run" is believed (seconds)."""
    after = getattr(hook, "not_run_after", NOT_RUN_AFTER)
    if (
        isinstance(after, bool)
        or not isinstance(after, (int, float))
        or not 0 <= after < float("inf")
    ):
        raise ConfigurationError(
            "a reconcile= hook's not_run_after must be a number of seconds >= 0 (how long "
            f"after a request left its 'not run' is believed), got {after!r}"
        )
    return float(after)


class HttpLookup:
    """A reconcile hook that asks the tool's own origin whether the call ran.

    ``path`` is a path (relative to the tool's URL) with placeholders
    ``{key}``, ``{plan}``, ``{step}``, ``{tool}`` and ``{args_hash}``, each
    percent-encoded: ``"/charges/by-key/{key}"`` or
    ``"/operations?idempotency_key={key}"``. The invoker sends a GET there, with
    its credentials and the call's headers, and reads the answer:

    - 404 or 410: it did not run, once ``not_run_after`` seconds (60 by default) have
      passed since the call's last request may have left: before that, a request held
      in the network or still inside the tool could yet arrive, so the answer is
      "cannot tell yet" (the call stays in doubt; a later call asks again);
    - 2xx: it ran, and the body is its answer; unless ``ran`` is given: a
      function of the parsed JSON body that returns True (ran), False (did not
      run) or None (cannot tell), for lookups that answer 200 with an empty list;
    - anything else, or no answer: cannot tell.
    """

    __slots__ = ("_ran", "not_run_after", "path")

    def __init__(
        self,
        path: str,
        *,
        ran: Callable[[Any], bool | None] | None = None,
        not_run_after: float = NOT_RUN_AFTER,
    ) -> None:
        if (
            not isinstance(path, str)
            or not path.startswith("/")
            or path.startswith("//")
            or "://" in path
        ):
            raise ConfigurationError(
                f"HttpLookup path must be a path on the tool's origin such as "
                f"'/charges/by-key/{{key}}', got {path!r}"
            )
        try:
            path.format(**dict.fromkeys(_PLACEHOLDERS, "x"))
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigurationError(
                f"HttpLookup path {path!r} has a placeholder other than "
                f"{', '.join('{' + p + '}' for p in _PLACEHOLDERS)} ({exc})"
            ) from None
        if ran is not None and not callable(ran):
            raise ConfigurationError(f"ran must be a function of the JSON body, got {ran!r}")
        if (
            isinstance(not_run_after, bool)
            or not isinstance(not_run_after, (int, float))
            or not 0 <= not_run_after < float("inf")
        ):
            raise ConfigurationError(
                "not_run_after must be a number of seconds >= 0 (how long after a request "
                f"left a 404 is believed), got {not_run_after!r}"
            )
        self.not_run_after = float(not_run_after)
        self.path = path
        self._ran = ran

    def __repr__(self) -> str:
        return f"HttpLookup({self.path!r})"

    def url(self, tool_url: str, call: InDoubt) -> str:
        """The lookup's URL for ``call``, on the origin of ``tool_url``."""
        values = {
            "key": call.idempotency_key,
            "plan": call.plan,
            "step": call.step or "",
            "tool": call.tool or "",
            "args_hash": call.args_hash or "",
        }
        path = self.path.format(**{k: quote(v, safe="") for k, v in values.items()})
        parts = urlsplit(tool_url)
        return urljoin(f"{parts.scheme}://{parts.netloc}/", path.lstrip("/"))

    def verdict(self, reply: Answer | Failure, quiet: float | None = None) -> Verdict:
        """What the lookup's answer says about the call.

        ``quiet``: the seconds since the call's last request may have left (None:
        long enough). "Not run" is believed only once it is at least ``not_run_after``.
        """
        return not_yet(self._read(reply), quiet, self.not_run_after, "the lookup")

    def _read(self, reply: Answer | Failure) -> Verdict:
        if isinstance(reply, Failure):
            return Verdict.in_doubt(f"the lookup failed ({reply.description})")
        status = reply.status_code
        if status in (404, 410):
            return Verdict.not_run()
        if not 200 <= status < 300 or reply.oversize or reply.unreadable:
            return Verdict.in_doubt(f"the lookup answered {status}")
        try:
            body: Any = json.loads(reply.content) if reply.content.strip() else None
        except (ValueError, UnicodeDecodeError, RecursionError):
            return Verdict.in_doubt("the lookup's answer is not JSON")
        if self._ran is None:
            return Verdict.ran(body, status_code=200)
        said = self._ran(body)
        if said is True:
            return Verdict.ran(body)
        if said is False:
            return Verdict.not_run()
        return Verdict.in_doubt("the lookup's answer does not say")
