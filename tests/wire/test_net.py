"""The URL rules in agentkey.client._net: origins, loopback, the plain-http rule and redaction."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkey._exceptions import InsecureTransport
from agentkey.client._net import (
    Origin,
    has_control_character,
    is_loopback,
    may_carry_credentials,
    origin_of,
    redact_url,
    require_secure,
)


@given(st.ip_addresses())
def test_loopback_is_exactly_127_8_and_ipv6_1(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> None:
    """is_loopback agrees with the ipaddress module for every IPv4 and IPv6 address."""
    assert is_loopback(str(address)) is address.is_loopback
    assert is_loopback(f"[{address}]") is address.is_loopback


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("localhost", True),
        ("LOCALHOST.", True),
        ("tool.localhost", False),
        ("localhost.evil.com", False),
        ("127.0.0.1.nip.io", False),
        ("", False),
    ],
)
def test_loopback_names(host: str, loopback: bool) -> None:
    """Only the name localhost itself counts, never a name that merely contains it."""
    assert is_loopback(host) is loopback


def test_origin_of() -> None:
    """Origins fill in default ports, ignore case and path, and refuse what cannot be sent."""
    assert origin_of("https://Tool.TEST:443/x") == origin_of("https://tool.test/y")
    assert origin_of("http://tool.test") == Origin("http", "tool.test", 80)
    assert str(origin_of("http://[::1]:8000/")) == "http://::1:8000"
    for bad in ("ftp://tool.test", "/relative", "https://", "https://a\nb/", "https://[zz]/"):
        assert origin_of(bad) is None, bad
    assert origin_of("https://tool.test:99999/") is None  # a port out of range


@given(st.text(max_size=60))
def test_origin_of_never_raises(url: str) -> None:
    """Any text gives an Origin or None; an Origin is always http(s) with a host and a port."""
    origin = origin_of(url)
    if origin is not None:
        assert origin.scheme in ("http", "https")
        assert origin.host
        assert 0 <= origin.port <= 65535


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("https://tool.example/x", True),
        ("HTTPS://tool.example/x", True),
        ("http://127.0.0.1:8000/x", True),
        ("http://127.9.9.9/x", True),
        ("http://localhost/x", True),
        ("http://[::1]:80/x", True),
        ("http://localhost.evil.com/x", False),
        ("http://tool.localhost/x", False),
        ("http://127.0.0.1.nip.io/x", False),
        ("http://tool.example/x", False),
        ("ws://127.0.0.1/x", False),
        ("https:///no-host", False),
    ],
)
def test_require_secure(url: str, ok: bool) -> None:
    """Credentials go over https anywhere, and over http only to loopback."""
    origin = origin_of(url)
    assert (origin is not None and may_carry_credentials(origin)) is ok
    if ok:
        require_secure(url, what="a bearer token")
    else:
        with pytest.raises(InsecureTransport, match="refusing to send a bearer token"):
            require_secure(url, what="a bearer token")


def test_require_secure_message_has_no_secret() -> None:
    """The refusal names the host and path, never user info or a query."""
    with pytest.raises(InsecureTransport) as info:
        require_secure("http://user:hunter2@tool.example/x?sig=s3cret#frag", what="a token")
    assert "tool.example/x" in str(info.value)
    assert "hunter2" not in str(info.value)
    assert "s3cret" not in str(info.value)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://u:p@tool.test:8443/a/b?sig=x#f", "https://tool.test:8443/a/b"),
        ("https://tool.test/status?token=abc", "https://tool.test/status"),
        ("/relative/path?q=1", "/relative/path"),
        ("http://[zz", "<a URL that cannot be parsed>"),
        ("https://tool.test/a\x00b\x7f", "https://tool.test/a%00b%7F"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    """Redaction keeps scheme, host, port and path, and drops user info, query and fragment."""
    assert redact_url(url) == shown


secrets = st.text(st.characters(min_codepoint=0x61, max_codepoint=0x7A), min_size=12, max_size=20)


@given(secrets, secrets, st.sampled_from(["https", "http"]))
def test_redact_url_never_shows_userinfo_query_or_fragment(
    password: str, signature: str, scheme: str
) -> None:
    """No password, query or fragment value survives redaction, whatever the URL."""
    url = f"{scheme}://me:{password}@tool.test/path?sig={signature}#{signature}"
    shown = redact_url(url)
    assert password not in shown
    assert signature not in shown
    assert shown == f"{scheme}://tool.test/path"


@given(st.text(max_size=80))
def test_redact_url_never_raises_and_is_one_line(url: str) -> None:
    """Any text redacts to a single line without control characters."""
    shown = redact_url(url)
    assert "\n" not in shown
    assert "\r" not in shown
    assert not has_control_character(shown)
