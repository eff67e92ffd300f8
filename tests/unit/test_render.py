"""`cas-operator render -f FILE`: the children the operator would apply, printed with no cluster.

Guards the CLI path users review changes with (and the engine contract test reads): it must
print exactly what the reconcile builds, name every bad field of an invalid spec, and say
so when a file holds no CodingAgentServing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from cas_operator.api.models import parse_spec
from cas_operator.desired.build import build_plan
from cas_operator.desired.resources import build_all
from cas_operator.desired.resources.meta import Owner
from cas_operator.render import PLACEHOLDER_UID
from tests.paths import ROOT

SAMPLES = sorted((ROOT / "config" / "samples").glob("*.yaml"))


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cas_operator", "render", *args],
        input=stdin, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_render_prints_what_the_reconcile_builds_for_every_sample() -> None:
    for sample in SAMPLES:
        raw = yaml.safe_load(sample.read_text())
        name = raw["metadata"]["name"]
        plan = build_plan(name, "team-a", parse_spec(raw["spec"]))
        expected = build_all(Owner(name, "team-a", PLACEHOLDER_UID), plan)
        done = cli("-f", str(sample), "-n", "team-a")
        assert done.returncode == 0, done.stderr
        assert list(yaml.safe_load_all(done.stdout)) == expected, sample.name


def test_revision_of_prints_each_resource_and_its_revision() -> None:
    sample = ROOT / "config" / "samples" / "glm5-long-context.yaml"
    raw = yaml.safe_load(sample.read_text())
    plan = build_plan(raw["metadata"]["name"], "default", parse_spec(raw["spec"]))
    done = cli("-f", str(sample), "--revision-of")
    assert done.returncode == 0 and done.stdout == f"{plan.name}\t{plan.revision}\n"


def test_an_invalid_spec_names_its_fields_and_exits_2(tmp_path: Path) -> None:
    bad = {
        "apiVersion": "serving.cas.dev/v1alpha1",
        "kind": "CodingAgentServing",
        "metadata": {"name": "bad"},
        "spec": {"model": {"name": "glm-5"}, "prefill": {"tensorParallel": 8,
                 "contextParallel": 3}, "ratio": {"min": 2.0, "max": 1.0}},
    }  # fmt: skip
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    done = cli("-f", str(path))
    assert done.returncode == 2 and done.stdout == ""
    assert "bad: spec.prefill.contextParallel" in done.stderr
    assert "bad: spec.ratio.min" in done.stderr


def test_a_file_without_a_resource_is_refused() -> None:
    done = cli("-f", "-", stdin="apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    assert done.returncode == 2 and "no serving.cas.dev/v1alpha1 CodingAgentServing" in done.stderr
