"""The wire tests: the URL rules of client._net, and client._http with httpx and its httpx2 fork."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "httpx2: drives the wire through a user's httpx2 client (`nox -s httpx2`)"
    )
