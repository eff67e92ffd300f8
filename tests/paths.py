"""Paths and sample loading shared by tests (import as `tests.paths`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "config" / "samples"


def load_sample(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((SAMPLES / name).read_text())
    return data
