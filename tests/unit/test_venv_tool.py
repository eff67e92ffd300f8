"""`tools/venv.py`, which `make setup` runs: the key of the cached third-party virtualenv.

Regression guarded: a clone reusing a cached virtualenv built for other dependencies (a key that
missed the SGLang requirements file, an extra or a --no-deps pin) would test against the wrong
packages; an extra that pyproject.toml does not define must stop the build, not install less."""

from __future__ import annotations

from pathlib import Path

import pytest
from tools.venv import ROOT, cache_key, requirements


def test_the_key_follows_every_input_of_the_cached_virtualenv(tmp_path: Path) -> None:
    reqs = requirements(ROOT / "pyproject.toml", ["dev", "operator", "engine"])
    assert "setuptools>=69" in reqs and any(r.startswith("kopf") for r in reqs)
    pins = tmp_path / "sglang.txt"
    pins.write_text("torch==2.14.1\n")
    key = cache_key(reqs, pins, ["sglang==0.5.23"])
    assert cache_key(reqs, pins, ["sglang==0.5.23"]) == key  # stable for the same inputs
    assert cache_key(reqs, pins, ["sglang==0.5.24"]) != key
    assert cache_key([*reqs, "numpy>=2"], pins, ["sglang==0.5.23"]) != key
    pins.write_text("torch==2.15.0\n")
    assert cache_key(reqs, pins, ["sglang==0.5.23"]) != key


def test_an_unknown_extra_stops_the_build() -> None:
    with pytest.raises(SystemExit, match=r"no such extras.*gpu"):
        requirements(ROOT / "pyproject.toml", ["dev", "gpu"])
