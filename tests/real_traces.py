"""Where tests find the real traces (../shared/traces from the repository root), and what they
do without them: skip on a developer's machine, fail under CI (a CI run must never pass by
skipping the tests that read real traffic; the same rule as e2e/tests/conftest.py's in_ci)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.paths import ROOT

TRACES = Path(os.environ.get("CAS_TRACES_DIR", ROOT.parent / "shared" / "traces"))
CLAUDE_SESSIONS = TRACES / "claude-code-sessions.tar.gz"
MOONCAKE = TRACES / "mooncake-conversation.jsonl"
AZURE = TRACES / "azure-code-2023.csv"


def in_ci() -> bool:
    """True when the ``CI`` environment variable says so."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require(path: Path) -> Path:
    """`path` when it exists; else skip the test, or fail it under CI."""
    if path.exists():
        return path
    reason = f"{path} is missing (the real traces live in ../shared/traces; CAS_TRACES_DIR)"
    if in_ci():
        pytest.fail(f"CI is set, so not skipping: {reason}")
    pytest.skip(reason)
