"""Fixtures shared by the integration tests."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest

from tests._loops import close_leftover_loop


@pytest.fixture(autouse=True)
def _no_leftover_event_loop(request: pytest.FixtureRequest) -> Iterator[None]:
    """A framework's sync entry point leaves its event loop open: close it after the test."""
    yield
    if not inspect.iscoroutinefunction(request.function):  # pytest-asyncio owns those loops
        close_leftover_loop()
