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


def defaults_inside_list_items(node: object, path: str = "", in_items: bool = False) -> list[str]:
    """Schema paths (`.spec.engine.env[].x`) of every `default` below an array's `items`."""
    if not isinstance(node, dict):
        return []
    found = [path] if in_items and "default" in node else []
    for name, child in node.get("properties", {}).items():
        found += defaults_inside_list_items(child, f"{path}.{name}", in_items)
    if "items" in node:
        found += defaults_inside_list_items(node["items"], f"{path}[]", True)
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        found += defaults_inside_list_items(extra, f"{path}{{}}", in_items)
    return found


def test_no_schema_defaults_inside_list_items() -> None:
    """GitOps guard: a default inside a list item is filled in by the API server on every
    item, so Argo CD's diff of the user's list against the stored one never converges
    (perpetual OutOfSync). The walk itself is checked on a schema that has one."""
    from cas_operator.api.crdgen import build_crd

    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert defaults_inside_list_items(schema) == []
    planted = {"properties": {"env": {"items": {"properties": {"x": {"default": 1}}}}}}
    assert defaults_inside_list_items(planted) == [".env[].x"]
