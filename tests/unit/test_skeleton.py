"""The layout rules that keep the project importable and its CRD in step with the models."""

from __future__ import annotations

import subprocess
import sys

from tests.paths import ROOT


def test_operator_folder_does_not_shadow_stdlib_operator() -> None:
    """Regression: an operator/__init__.py would make `import operator` load our folder."""
    assert not (ROOT / "operator" / "__init__.py").exists()
    code = "import operator, sys; print(operator.__file__); assert hasattr(operator, 'itemgetter')"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert "site-packages" not in out.stdout and "operator/__init__" not in out.stdout
    assert out.stdout.strip().endswith("operator.py")


def test_generated_crd_matches_models() -> None:
    """Regression: a model change without `make crds` ships a CRD that disagrees with the code."""
    check = ["--check", "crds/", "charts/cas-operator/crds/"]
    result = subprocess.run(
        [sys.executable, "-m", "cas_operator.api.crdgen", *check],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
