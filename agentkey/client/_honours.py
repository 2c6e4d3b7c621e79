"""``honours_keys=``: whether the tool honours Idempotency-Key, said once per origin or route.

The invoker's option is ``True``/``False`` (every route of the invoker), ``None``
(learn it from the tool's answers), or a mapping of origins and route patterns to
``True``/``False``::

    honours_keys={
        "https://pay.example": True,                      # every path of that origin
        "https://api.example/v1/charges/*": True,          # paths under /v1/charges/
        "https://api.example/v1/refunds": False,           # that path only
    }

A declaration is scoped: its scheme, host and port must be the call's exactly
(``https://pay.example`` is ``https://pay.example:443``, never ``http://`` or
another port or a subdomain); a path is matched whole, and ``/*`` only at its end
matches the paths below it. The most specific entry wins (a path, then the longest
pattern, then the origin); a route no entry names is learnt from the tool's answers
as with ``None``. Nothing here does I/O.

A call's path is matched as it is sent: its dot segments removed (RFC 3986 5.2.4, as
httpx does), so ``/v1/charges/../refunds`` is ``/v1/refunds``. A path a server may read
otherwise (a percent-encoded dot segment ``%2e%2e``, which httpx sends as is and many
servers decode, or an encoded ``/``) is matched in each reading; when the readings are
declared differently the route is left undeclared (learnt from the answers), so such
a path never gains a declaration that another reading of it does not have. An entry
with a dot segment in its path is refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from .._exceptions import ConfigurationError
from ._net import Origin, origin_of

__all__ = ["Declarations", "honours_option"]

_EXAMPLE = (
    "e.g. honours_keys={'https://pay.example': True, 'https://api.example/v1/charges/*': True}"
)


@dataclass(frozen=True, slots=True)
class _Entry:
    origin: Origin
    path: str | None  # None: every path of the origin
    prefix: bool  # the path ended in "/*": the paths below it
    honours: bool

    def rank(self, origin: Origin, path: str) -> int | None:
        """How specifically this entry names ``origin`` + ``path`` (higher: more), or None."""
        if origin != self.origin:
            return None
        if self.path is None:
            return 0
        if self.prefix:
            return 1 + len(self.path) if path.startswith(self.path) else None
        return 1 << 20 if path == self.path else None


class Declarations:
    """The checked mapping of ``honours_keys=``: :meth:`of` says what it declares for a URL."""

    __slots__ = ("_entries",)

    def __init__(self, entries: tuple[_Entry, ...]) -> None:
        self._entries = entries

    def __repr__(self) -> str:
        return f"Declarations({len(self._entries)} entries)"

    def of(self, url: str) -> bool | None:
        """What the most specific entry naming ``url`` declares; None when none names it."""
        origin = origin_of(url)
        if origin is None:
            return None
        said = {self._of(origin, path) for path in _readings(urlsplit(url).path)}
        return said.pop() if len(said) == 1 else None  # readings that disagree: undeclared

    def _of(self, origin: Origin, path: str) -> bool | None:
        best: tuple[int, bool] | None = None
        for entry in self._entries:
            rank = entry.rank(origin, path)
            if rank is not None and (best is None or rank > best[0]):
                best = (rank, entry.honours)
        return None if best is None else best[1]


_ENCODED_DOT = re.compile("%2e", re.IGNORECASE)
_ENCODED_SLASH = re.compile("%2f", re.IGNORECASE)


def _without_dots(path: str, *, rfc: bool = False) -> str:
    """``path`` with its ``.`` and ``..`` segments removed (RFC 3986 5.2.4).

    As httpx does (``/a/b/..`` is ``/a``), or with ``rfc=True`` as the RFC's algorithm
    does (``/a/b/..`` is ``/a/``)."""
    segments = path.split("/")
    if "." not in segments and ".." not in segments:
        return path or "/"
    kept: list[str] = []
    for segment in segments:
        if segment == "..":
            if kept and kept != [""]:
                kept.pop()
        elif segment != ".":
            kept.append(segment)
    if rfc and segments[-1] in (".", "..") and kept and kept[-1] != "":
        kept.append("")
    joined = "/".join(kept)
    return joined if joined.startswith("/") else "/" + joined


def _readings(path: str) -> set[str]:
    """Each path a server may take ``path`` (as written in a URL) for: as httpx sends it,
    as the RFC reads it, and with percent-encoded dot segments and slashes decoded."""
    decoded = "/".join(
        _ENCODED_DOT.sub(".", segment) if _ENCODED_DOT.sub("", segment) in ("", ".") else segment
        for segment in path.split("/")
    )
    slashes = _ENCODED_SLASH.sub("/", decoded)
    return {_without_dots(p, rfc=rfc) for p in (path, decoded, slashes) for rfc in (False, True)}


def _entry(pattern: object, honours: object) -> _Entry:
    if not isinstance(pattern, str) or not isinstance(honours, bool):
        raise ConfigurationError(
            "honours_keys maps origins or route patterns (str) to True or False, got "
            f"{pattern!r}: {honours!r}; {_EXAMPLE}"
        )
    origin = origin_of(pattern)
    parts = urlsplit(pattern) if origin is not None else None
    if origin is None or parts is None or parts.query or parts.fragment or "?" in pattern:
        raise ConfigurationError(
            f"honours_keys entry {pattern!r} is not an origin or route: give an absolute "
            f"http(s) URL without query or fragment; {_EXAMPLE}"
        )
    if "@" in parts.netloc:
        raise ConfigurationError(
            f"honours_keys entry {pattern!r} carries user:password@; name the origin alone"
        )
    path = parts.path
    if _readings(path) != {path or "/"}:
        raise ConfigurationError(
            f"honours_keys entry {pattern!r} has a dot segment ('.', '..', '%2e') or an "
            "encoded '/' in its path: name the route as it is sent, e.g. "
            "'https://api.example/v1/refunds'"
        )
    if path in ("", "/", "/*"):
        return _Entry(origin, None, False, honours)
    prefix = path.endswith("/*")
    body = path[:-1] if prefix else path  # "/v1/charges/*" matches under "/v1/charges/"
    if "*" in body:
        raise ConfigurationError(
            f"honours_keys entry {pattern!r} has a '*' inside its path: a pattern may only end "
            "in '/*' (the paths below it); name each other path whole"
        )
    return _Entry(origin, body, prefix, honours)


def honours_option(option: object) -> tuple[bool | None, Declarations | None]:
    """``honours_keys=`` checked: ``(the bool for every route, or None; the mapping, or None)``.

    Raises :class:`~agentkey.ConfigurationError` for anything else, or for two entries
    that name one origin and path (``https://a.example`` and ``https://a.example:443``).
    """
    if option is None or isinstance(option, bool):
        return option, None
    if not isinstance(option, Mapping):
        raise ConfigurationError(
            "honours_keys must be True (the tool honours Idempotency-Key: resend what may "
            "have run), False (never resend it), None (learn it from the tool's answers) or a "
            f"mapping of origins or route patterns to True/False ({_EXAMPLE}), got {option!r}"
        )
    entries: dict[tuple[Origin, str | None, bool], _Entry] = {}
    for pattern, honours in option.items():
        entry = _entry(pattern, honours)
        name = (entry.origin, entry.path, entry.prefix)
        if name in entries:
            raise ConfigurationError(
                f"honours_keys names {pattern!r} twice (as {entry.origin} with the same "
                "path); keep one entry"
            )
        entries[name] = entry
    return None, Declarations(tuple(entries.values()))
