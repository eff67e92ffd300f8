"""Unit-test fixtures: process-wide caches start empty in every test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cas_operator.reconcile import ownership


@pytest.fixture(autouse=True)
def no_known_children() -> Iterator[None]:
    """`ownership.KNOWN` (children this process verified as owned) is empty in each test, so
    no test depends on another's applies."""
    ownership.KNOWN.clear()
    yield
    ownership.KNOWN.clear()
