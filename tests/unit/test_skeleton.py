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
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_crd_bounds_use_openapi_v3_booleans() -> None:
    """Regression: pydantic's numeric exclusiveMinimum is rejected by the API server's
    OpenAPI v3.0 schema ("expected boolean"); the generator must translate it."""
    import yaml

    from cas_operator.api.crdgen import build_crd

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key in ("exclusiveMinimum", "exclusiveMaximum"):
                if key in node:
                    assert isinstance(node[key], bool), node
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    crd = build_crd()
    walk(crd)
    assert yaml.safe_load(yaml.safe_dump(crd)) == crd
