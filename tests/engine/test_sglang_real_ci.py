"""The ``sglang_real`` guard in tests/engine/conftest.py: a skip fails under CI, passes locally.

Runs pytest in a subprocess on a throw-away directory holding that conftest and one marked test
that skips the way the real-SGLang tests do when SGLang does not import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.conftest import sglang_required

CONFTEST = Path(__file__).with_name("conftest.py")

MODULE_SKIP = """
import pytest

pytestmark = [pytest.mark.sglang_real, pytest.mark.skipif(True, reason="no module named psutil")]


def test_needs_sglang():
    pass
"""

INSIDE_SKIP = """
import pytest


@pytest.mark.sglang_real
def test_skips_inside():
    pytest.skip("sglang does not import here")


def test_unmarked_skip_is_left_alone():
    pytest.skip("not about sglang")
"""


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    (tmp_path / "test_inside_skip.py").write_text(INSIDE_SKIP)
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "CAS_REQUIRE_SGLANG")}
    clean.update(env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "--strict-markers"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=clean,
    )


@pytest.mark.parametrize("env", [{"CI": "true"}, {"CAS_REQUIRE_SGLANG": "1"}])
def test_skip_of_a_real_sglang_test_fails_under_ci(tmp_path: Path, env: dict[str, str]) -> None:
    """Regression: a broken SGLang install must fail CI, not skip the real-code tests."""
    proc = _run(tmp_path, **env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 failed, 1 skipped, 1 error" in out, out  # a skip in setup reports as an error
    assert "real-SGLang test skipped under CI (no module named psutil)" in out, out
    assert "real-SGLang test skipped under CI (sglang does not import here)" in out, out


def test_skip_is_allowed_outside_ci(tmp_path: Path) -> None:
    proc = _run(tmp_path, CI="false")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 skipped" in proc.stdout, proc.stdout


@pytest.mark.parametrize(
    ("env", "required"),
    [
        ({}, False),
        ({"CI": "true"}, True),
        ({"CI": "0"}, False),
        ({"CAS_REQUIRE_SGLANG": "1"}, True),
    ],
)
def test_sglang_required_reads_ci_and_the_override(env: dict[str, str], required: bool) -> None:
    assert sglang_required(env) is required
