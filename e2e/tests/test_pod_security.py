"""Pod Security Admission, for real (issue 41, item 15): the local stack's API server runs its
own PodSecurity admission plugin, and a namespace labelled
`pod-security.kubernetes.io/enforce: restricted` is refused any pod that level does not allow.

Every sample in config/samples (whichever exist: a new sample is covered without editing this
file), reconciled by the operator under the chart's identity, has all its pods admitted there:
each role's, and every pod of a LeaderWorkerSet group. The chart's own Deployment, created in
such a namespace as `helm install` renders it, has its operator pod admitted too (the local
stack's nodes run no images, so it need not run). Pod Security refuses pods, never their
workloads, so each check waits for the pods the controllers create, and reads the
controllers' FailedCreate events for the API server's reason when one is missing.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.runtime import chart
from tests.paths import SAMPLES, load_sample

pytestmark = pytest.mark.e2e
Kubectl = Callable[..., str]
RESTRICTED = ("pod-security.kubernetes.io/enforce=restricted",
              "pod-security.kubernetes.io/enforce-version=latest")  # fmt: skip
TIMEOUT_S = 90.0
# Smaller pools, the same pod templates: the local stack's nodes have 8 GPUs each, shared with
# the other tests. Only sizes change (tensor parallelism where the sample's shape allows).
SHRINK: dict[str, dict[str, Any]] = {
    "minimal.yaml": {"prefill": {"tensorParallel": 1}, "decode": {"tensorParallel": 1}},
    "multinode-decode.yaml": {"decode": {"tensorParallel": 2, "gpusPerNode": 1}},
}


def samples() -> list[str]:
    return sorted(p.name for p in SAMPLES.glob("*.yaml"))


def shrunk(sample: str) -> dict[str, Any]:
    """The sample with one instance per pool (and `SHRINK`'s sizes)."""
    manifest = copy.deepcopy(load_sample(sample))
    spec = manifest["spec"]
    for pool in ("prefill", "decode"):
        spec.setdefault(pool, {}).update({"replicas": 1, **SHRINK.get(sample, {}).get(pool, {})})
    return manifest


def pods_by_role(kubectl: Kubectl, namespace: str, name: str) -> dict[str, int]:
    out = kubectl("get", "pods", "-n", namespace, "-l", f"cas.dev/name={name}", "-o", "json")
    found: dict[str, int] = {}
    for pod in json.loads(out)["items"]:
        role = pod["metadata"]["labels"].get("cas.dev/role", "")
        found[role] = found.get(role, 0) + 1
    return found


def expected_pods(kubectl: Kubectl, namespace: str, name: str) -> dict[str, int]:
    """Pods per role the fleet's workloads ask for: a Deployment's replicas, a
    LeaderWorkerSet's replicas times its group size."""
    wanted: dict[str, int] = {}
    for kind in ("deployments", "leaderworkersets"):
        out = kubectl("get", kind, "-n", namespace, "-l", f"cas.dev/name={name}", "-o", "json")
        for obj in json.loads(out)["items"]:
            role = obj["metadata"]["labels"]["cas.dev/role"]
            size = obj["spec"].get("leaderWorkerTemplate", {}).get("size", 1)
            wanted[role] = wanted.get(role, 0) + int(obj["spec"]["replicas"]) * int(size)
    return wanted


def refusals(kubectl: Kubectl, namespace: str) -> str:
    """The controllers' FailedCreate events that name Pod Security."""
    out = kubectl("get", "events", "-n", namespace, "--field-selector", "reason=FailedCreate",
                  "-o", "jsonpath={range .items[*]}{.message}{'\\n'}{end}")  # fmt: skip
    return "\n".join(line for line in out.splitlines() if "PodSecurity" in line)


def wait_for_pods(kubectl: Kubectl, namespace: str, names: list[str]) -> dict[str, Any]:
    """Until every named fleet has all its pods (each role present, each workload's count);
    fail with the Pod Security refusals if that does not happen."""
    deadline = time.monotonic() + TIMEOUT_S
    state: dict[str, Any] = {}
    while time.monotonic() < deadline:
        state = {n: (expected_pods(kubectl, namespace, n), pods_by_role(kubectl, namespace, n))
                 for n in names}  # fmt: skip
        if all(set(want) == {"prefill", "decode", "router"} and have == want
               for want, have in state.values()):  # fmt: skip
            return state
        time.sleep(1.0)
    pytest.fail(f"pods missing (expected, found per fleet): {state}\n"
                f"Pod Security refusals:\n{refusals(kubectl, namespace)}")  # fmt: skip


def test_every_samples_pods_are_admitted_in_a_restricted_namespace(
    cluster: Any, kubectl: Kubectl, namespace: str, crds: None, tmp_path: Path
) -> None:
    """Regression guard (issue 41): only the minimal and multinode-decode samples were shown
    to pass the API server's Pod Security admission at "restricted"; the long-context sample
    (context parallel, LayerSplit, HiCache on mooncake, NEXTN, a model PVC) and any sample
    added later were not. Every pod of every sample, LeaderWorkerSet workers included, is
    admitted, and no controller reports a Pod Security refusal."""
    kubectl("label", "namespace", namespace, *RESTRICTED)
    names = []
    with chart.namespaced_operator(kubectl, cluster.kubeconfig, namespace, tmp_path):
        for sample in samples():
            manifest = shrunk(sample)
            names.append(manifest["metadata"]["name"])
            kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(manifest))
        state = wait_for_pods(kubectl, namespace, names)
    assert len(names) == len(samples()) >= 3, names
    assert refusals(kubectl, namespace) == ""
    assert any(want.get("decode", 0) > 1 for want, _ in state.values())  # an LWS group's pods


def test_the_charts_operator_pod_is_admitted_in_a_restricted_namespace(
    kubectl: Kubectl, namespace: str
) -> None:
    """Regression guard (issue 41): the chart's Deployment claims the restricted level (docs/
    chart.md) but no test created it where that level is enforced. Its ServiceAccount and
    Deployment, as `helm template` renders them for a release in a restricted namespace: the
    ReplicaSet's pod is admitted."""
    kubectl("label", "namespace", namespace, *RESTRICTED)
    objects = [o for o in chart.template("cas-operator", namespace)
               if o["kind"] in ("ServiceAccount", "Deployment")]  # fmt: skip
    assert [o["kind"] for o in objects] == ["ServiceAccount", "Deployment"], objects
    kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump_all(objects))

    def admitted() -> bool:
        out = kubectl("get", "pods", "-n", namespace, "-l", "app.kubernetes.io/name=cas-operator",
                      "-o", "name")  # fmt: skip
        return bool(out.strip())

    deadline = time.monotonic() + TIMEOUT_S
    while not admitted():
        if time.monotonic() > deadline or refusals(kubectl, namespace):
            pytest.fail(f"the operator pod was not admitted:\n{refusals(kubectl, namespace)}")
        time.sleep(1.0)
    assert refusals(kubectl, namespace) == ""
