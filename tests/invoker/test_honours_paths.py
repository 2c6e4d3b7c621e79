"""``honours_keys=`` mappings match a call's path as it is sent (review F6).

Pure logic (no I/O): a declaration is looked up for the path httpx sends (dot segments
removed), and a path a server may read otherwise (percent-encoded dots or slashes) is
declared only when every reading is declared alike.
"""

from __future__ import annotations

import httpx
import pytest

from agentkey import ConfigurationError
from agentkey.client._honours import Declarations, honours_option

API = "https://api.example"


def declarations(mapping: dict[str, bool]) -> Declarations:
    _, declared = honours_option(mapping)
    assert declared is not None
    return declared


CHARGES_TRUE = declarations({f"{API}/v1/charges/*": True, f"{API}/v1/refunds": False})


@pytest.mark.parametrize(
    "path",
    ["/v1/charges/../refunds", "/v1/charges/./../refunds", "/v1/charges/a/b/../../../refunds"],
)
def test_a_path_with_dot_segments_is_declared_as_the_path_httpx_sends(path: str) -> None:
    """``/v1/charges/../refunds`` is sent as ``/v1/refunds``, declared False (before: True,
    from the charges pattern)."""
    assert httpx.URL(API + path).raw_path == b"/v1/refunds"
    assert CHARGES_TRUE.of(API + path) is False


@pytest.mark.parametrize(
    "path",
    [
        "/v1/charges/%2e%2e/refunds",
        "/v1/charges/%2E%2E/refunds",
        "/v1/charges/.%2e/refunds",
        "/v1/charges/%2e./refunds",
        "/v1/charges/x/%2e%2e/%2E%2E/refunds",
        "/v1/charges/x%2F..%2F..%2Frefunds",
    ],
)
def test_an_encoded_dot_path_read_two_ways_gains_no_declaration(path: str) -> None:
    """httpx sends ``%2e%2e`` as is (under charges: True) and a server may decode it (the
    refunds route: False): the readings disagree, so the route is undeclared, never True
    (before: True)."""
    assert CHARGES_TRUE.of(API + path) is None


def test_a_dot_segment_never_climbs_out_to_a_broader_true() -> None:
    """A False pattern is not escaped into the origin's True by ``..`` (before: True), and
    readings that agree keep their declaration."""
    mixed = declarations({API: True, f"{API}/v1/refunds/*": False})
    assert mixed.of(f"{API}/v1/refunds/x/../y") is False
    assert mixed.of(f"{API}/v1/charges/../refunds/r1") is False
    assert mixed.of(f"{API}/v1/charges/%2e%2e/refunds/r1") is None
    # Readings that agree keep their declaration: dots inside one declared area, names.
    assert CHARGES_TRUE.of(f"{API}/v1/charges/a/%2e%2e/b") is True
    assert CHARGES_TRUE.of(f"{API}/v1/charges/./c") is True
    assert CHARGES_TRUE.of(f"{API}/v1/charges/a%2eb") is True
    assert declarations({API: True}).of(f"{API}/v1/../../x/%2e%2e/y") is True


@pytest.mark.parametrize(
    "entry", ["/v1/charges/../refunds", "/v1/./refunds", "/v1/%2e%2e/refunds", "/v1/a%2Fb/*"]
)
def test_an_entry_with_dot_segments_is_refused(entry: str) -> None:
    """An entry must name the route as it is sent: a dot segment or encoded '/' in its path
    is a ConfigurationError (before: accepted, and matched nothing httpx sends)."""
    with pytest.raises(ConfigurationError, match="dot segment"):
        honours_option({API + entry: True})
