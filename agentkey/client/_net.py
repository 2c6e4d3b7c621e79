"""URL rules shared by the invoker, the token providers and the checker (no I/O, no httpx).

- :func:`origin_of` and :class:`Origin`: what "same origin" means everywhere.
- :func:`is_loopback`: the only hosts plain http may carry a secret to.
- :func:`may_carry_credentials` and :func:`require_secure`: the plain-http rule
  for bearer tokens, client credentials and credential headers.
- :func:`redact_url`: a URL made fit for a message (no user info, query or fragment,
  which can hold passwords and signatures).
- :func:`scrub` and :func:`scrub_json`: server-provided text with every credential
  agentkey sent cut out, before anything else is done to it (a server may echo
  the bearer token, the client secret or the refresh token it received).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import quote, quote_plus, urlsplit, urlunsplit

from .._exceptions import InsecureTransport

__all__ = [
    "REDACTED",
    "Origin",
    "has_control_character",
    "is_loopback",
    "may_carry_credentials",
    "origin_of",
    "redact_url",
    "require_secure",
    "scrub",
    "scrub_json",
    "secret_forms",
]

#: What stands in a message for a credential a server echoed.
REDACTED = "<redacted>"
_SHORTEST_SECRET = 4


@dataclass(frozen=True, slots=True, order=True)
class Origin:
    """scheme://host:port, with the default port filled in."""

    scheme: str
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"


def has_control_character(url: str) -> bool:
    """True when ``url`` holds a control character (httpx refuses it with its own error)."""
    return any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in url)


def origin_of(url: str) -> Origin | None:
    """The origin of an absolute http(s) URL, or None when it has none (or cannot be sent)."""
    if has_control_character(url):
        return None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        return None
    if "[" in parts.netloc and not _is_ipv6(parts.hostname):
        return None  # Python 3.10's urlsplit lets "https://[zz]/" through; 3.11 refuses it
    return Origin(scheme, parts.hostname.lower(), port or (443 if scheme == "https" else 80))


def _is_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host.partition("%")[0])
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8 and ::1: the hosts plain http may carry secrets to."""
    name = host.strip("[]").lower().rstrip(".")
    if name == "localhost":
        return True  # not "*.localhost": a resolver is free to send those elsewhere
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def may_carry_credentials(origin: Origin) -> bool:
    """True for https anywhere, and for plain http to a loopback host only."""
    return origin.scheme == "https" or is_loopback(origin.host)


def require_secure(url: str, *, what: str) -> None:
    """Raise InsecureTransport unless ``url`` is https, or http to a loopback host.

    ``what`` names the secret in the message ("a bearer token", "client credentials").
    """
    origin = origin_of(url)
    if origin is None or not may_carry_credentials(origin):
        raise InsecureTransport(
            f"refusing to send {what} to {redact_url(url)}: credentials travel only over "
            "https (plain http is allowed to loopback hosts alone); use an https:// URL"
        )


def redact_url(url: str) -> str:
    """``scheme://host[:port]/path`` of ``url``: no user info, query or fragment; never raises.

    Control characters are percent-encoded, so the result fits on one line of a message.
    """
    try:
        parts = urlsplit(url)
    except ValueError:  # "http://[zz" and the like
        return "<a URL that cannot be parsed>"
    host = parts.netloc.rpartition("@")[2]
    text = urlunsplit((parts.scheme, host, parts.path, "", ""))
    return "".join(f"%{ord(ch):02X}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch for ch in text)


def secret_forms(values: Iterable[str]) -> tuple[str, ...]:
    """The credentials in ``values`` as a server may echo them: as sent, and form-encoded.

    Longest first, so a secret that contains another is cut out whole. Values shorter
    than 4 characters are left out: no real credential is that short, and cutting
    such a string out of every word would leave a message unreadable.
    """
    forms: set[str] = set()
    for value in values:
        if len(value) >= _SHORTEST_SECRET:
            forms.update((value, quote(value, safe=""), quote_plus(value)))
    return tuple(sorted(forms, key=len, reverse=True))


def scrub(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every one of ``secrets`` (longest first) replaced by ``<redacted>``."""
    for secret in secrets:
        if secret and secret in text:
            text = text.replace(secret, REDACTED)
    return text


def scrub_json(value: object, secrets: tuple[str, ...]) -> object:
    """A copy of the parsed JSON ``value`` whose strings (keys too) hold none of ``secrets``.

    Iterative, so a body nested as deep as the JSON parser allows cannot exhaust the stack.
    """
    if not secrets:
        return value
    root = _scrubbed(value, secrets)
    todo = [root] if isinstance(root, (dict, list)) else []
    while todo:
        node = todo.pop()
        pairs = node.items() if isinstance(node, dict) else enumerate(node)
        for slot, item in list(pairs):
            child = _scrubbed(item, secrets)
            node[slot] = child
            if isinstance(child, (dict, list)):
                todo.append(child)
    return root


def _scrubbed(item: object, secrets: tuple[str, ...]) -> object:
    """One JSON value made safe on its own level: a string scrubbed, a container copied."""
    if isinstance(item, str):
        return scrub(item, secrets)
    if isinstance(item, dict):
        return {scrub(k, secrets) if isinstance(k, str) else k: v for k, v in item.items()}
    if isinstance(item, list):
        return list(item)
    return item
