"""Which problem answers count as evidence that a route honours keys (issue 34).

Only explicit markers: every code of the dialect table (``PROBLEM_CODES``) in a known
dialect's ``type`` URI namespace, and the listed codes that name idempotency itself in
any field. A generic code in a plain field, or a sentence, never does (a plain tool's
``{"error": "missing_key"}`` counted for 30 days before). Pure logic: the answers are
built by hand; the same cases on a real tool are in test_evidence.py.
"""

from __future__ import annotations

import json

import pytest

from agentkey.client._effects import Answer
from agentkey.client._net import origin_of
from agentkey.client._policies import DEFAULT_RETRY_STATUSES
from agentkey.client._protocol import PROBLEM_CODES, ProtocolConfig, key_evidence

BASE = "https://tool.test"
_origin = origin_of(BASE)
assert _origin is not None
CFG = ProtocolConfig(base_origin=_origin, retry_statuses=DEFAULT_RETRY_STATUSES)


def answer(status: int, body: object, **headers: str) -> Answer:
    lowered = {k.lower(): v for k, v in headers.items()}
    return Answer(status, lowered, json.dumps(body).encode(), f"{BASE}/tools/x")


def uri(namespace: str, code: str) -> str:
    return namespace + code.replace("_", "-" if namespace == "urn:idemkit:" else "_")


@pytest.mark.parametrize("code", sorted(PROBLEM_CODES))
@pytest.mark.parametrize("namespace", ["urn:agentkey:problem:", "urn:idemkit:"])
def test_every_listed_code_in_a_dialects_type_is_evidence(namespace: str, code: str) -> None:
    """A listed code under agentkey's or idemkit's problem type namespace counts."""
    got = key_evidence(answer(409, {"type": uri(namespace, code), "title": "x"}), CFG)
    assert got == f"key problem answer ({code})"


@pytest.mark.parametrize("code", sorted(PROBLEM_CODES))
def test_a_bare_code_counts_only_when_it_names_idempotency(code: str) -> None:
    """``{"error": code}`` or Stripe's ``{"error": {"type": code}}`` count only for codes
    that say "idempotency" themselves; ``missing_key``, ``in_progress`` and the like are as
    likely a plain tool's own words."""
    expected = f"key problem answer ({code})" if "idempot" in code else None
    for body in ({"error": code}, {"code": code}, {"error": {"type": code, "message": "m"}}):
        assert key_evidence(answer(400, body), CFG) == expected, body


@pytest.mark.parametrize(
    "body",
    [
        {"error": "missing_key"},
        {"detail": "card fingerprint does not match"},
        {"code": "in_progress"},
        {"detail": "Idempotency key was previously used with a different request payload."},
        {"type": "https://example.com/problems/in_progress"},  # not a known namespace
        {"type": "urn:agentkey:problem:out_of_stock"},  # not a listed code
    ],
)
def test_sentences_generic_codes_and_unknown_types_are_not_evidence(body: object) -> None:
    """Free text, generic codes, other namespaces and unlisted codes never count."""
    assert key_evidence(answer(409, body), CFG) is None


def test_agentkeys_in_doubt_is_evidence() -> None:
    """agentkey's 409 in_doubt comes from its middleware: an explicit marker."""
    got = key_evidence(answer(409, {"type": "urn:agentkey:problem:in_doubt"}), CFG)
    assert got == "key problem answer (in_doubt)"


@pytest.mark.parametrize("code", ["not_run", "store_unavailable"])
def test_a_not_run_body_is_evidence_only_with_the_protection_header(code: str) -> None:
    """A 503 not_run body alone may be a gateway's copy of a downstream answer: no evidence
    (before: it was); beside Idempotency-Protected it is the header's evidence."""
    body = {"type": f"urn:agentkey:problem:{code}"}
    assert key_evidence(answer(503, body), CFG) is None
    marked = answer(503, body, **{"Idempotency-Protected": "true"})
    assert key_evidence(marked, CFG) == "protection header"
