"""End-to-end checks of the local stack itself (the harness every operator e2e test relies on).

Each test guards one promise of ``e2e/cluster.py``: the pinned apiserver version, KWOK GPU
nodes, pods of workloads going Running on them, LWS groups reconciled (with its webhooks), and
the garbage collector honouring owner references.
"""

from __future__ import annotations

import ipaddress
import json
import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import yaml

import e2e.manifests as manifests
from e2e.bins import read_versions

pytestmark = pytest.mark.e2e

Kubectl = Callable[..., str]
WAIT_S = 60.0


def wait_until(what: str, probe: Callable[[], Any], timeout: float = WAIT_S) -> Any:
    """Poll ``probe`` every 0.25 s until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.25)


def get_json(kubectl: Kubectl, *args: str) -> dict[str, Any]:
    return dict(json.loads(kubectl("get", *args, "-o", "json")))


def apply(kubectl: Kubectl, namespace: str, *objs: dict[str, Any]) -> None:
    kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump_all(objs))


def running_pods(kubectl: Kubectl, namespace: str, selector: str) -> list[dict[str, Any]]:
    """Pods matching ``selector`` that are Running and Ready."""
    pods = get_json(kubectl, "pods", "-n", namespace, "-l", selector)["items"]
    ready = []
    for pod in pods:
        conds = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}
        if pod["status"].get("phase") == "Running" and conds.get("Ready") == "True":
            ready.append(pod)
    return ready


def wait_running(
    kubectl: Kubectl, namespace: str, selector: str, count: int
) -> list[dict[str, Any]]:
    """Wait until exactly ``count`` pods matching ``selector`` are Running and Ready."""

    def probe() -> list[dict[str, Any]] | None:
        pods = running_pods(kubectl, namespace, selector)
        return pods if len(pods) == count else None

    return list(wait_until(f"{count} running pods with {selector}", probe))


def container(name: str, gpus: int = 0) -> dict[str, Any]:
    limits = {manifests.GPU_RESOURCE: str(gpus)} if gpus else {}
    return {"name": name, "image": "cas.local/sim:none", "resources": {"limits": limits}}


@pytest.mark.skipif(bool(os.environ.get("CAS_KUBECONFIG")), reason="a user-provided cluster")
def test_apiserver_reports_pinned_version(kubectl: Kubectl) -> None:
    """Regression: the build's version ldflags got lost and the apiserver says v0.0.0-master."""
    version = json.loads(kubectl("version", "-o", "json"))
    pinned = read_versions()["KUBERNETES_VERSION"]
    assert version["serverVersion"]["gitVersion"] == pinned
    assert version["clientVersion"]["gitVersion"] == pinned


def test_kwok_nodes_ready_with_gpus(kubectl: Kubectl) -> None:
    """Regression: fake nodes not Ready, or without the GPUs / pool label / loopback pod CIDR
    that scheduling engine pods and the later process runner depend on."""
    selector = f"{manifests.KWOK_NODE_LABEL}={manifests.KWOK_NODE_LABEL_VALUE}"
    nodes = get_json(kubectl, "nodes", "-l", selector)["items"]
    assert len(nodes) >= manifests.NodeShape().count
    loopback = ipaddress.IPv4Network("127.0.0.0/8")
    for node in nodes:
        conds = {c["type"]: c["status"] for c in node["status"]["conditions"]}
        assert conds.get("Ready") == "True", node["metadata"]["name"]
        assert node["status"]["allocatable"][manifests.GPU_RESOURCE] == "8"
        assert node["metadata"]["labels"][manifests.NODE_POOL_LABEL] == "gpu-h200"
        assert ipaddress.IPv4Network(node["spec"]["podCIDR"]).subnet_of(loopback)
        taints = [t["key"] for t in node["spec"].get("taints", [])]
        assert not taints, f"{node['metadata']['name']} is tainted: {taints}"


def test_deployment_pods_become_running(kubectl: Kubectl, namespace: str) -> None:
    """Regression: scheduler or KWOK pod stages missing, so workload pods stay Pending; or pod
    IPs outside the node's loopback pod CIDR."""
    labels = {"app": "gpu-web"}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "gpu-web"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [container("engine", gpus=4)]},
            },
        },
    }
    apply(kubectl, namespace, deployment)
    pods = wait_running(kubectl, namespace, "app=gpu-web", 2)
    for pod in pods:
        node = get_json(kubectl, "node", pod["spec"]["nodeName"])
        cidr = ipaddress.ip_network(node["spec"]["podCIDR"])
        assert ipaddress.ip_address(pod["status"]["podIP"]) in cidr
    status = get_json(kubectl, "deployment", "gpu-web", "-n", namespace)["status"]
    assert status.get("readyReplicas") == 2


def test_lws_group_has_leader_and_worker(kubectl: Kubectl, namespace: str) -> None:
    """Regression: LWS controller or its webhooks not running, so a LeaderWorkerSet never gets
    its leader StatefulSet, worker pods, or the labels its pod webhook injects."""
    lws = {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "prefill"},
        "spec": {
            "replicas": 1,
            "leaderWorkerTemplate": {
                "size": 2,
                "workerTemplate": {"spec": {"containers": [container("engine", gpus=8)]}},
            },
        },
    }
    apply(kubectl, namespace, lws)
    selector = "leaderworkerset.sigs.k8s.io/name=prefill"
    pods = wait_running(kubectl, namespace, selector, 2)
    names = sorted(p["metadata"]["name"] for p in pods)
    assert names == ["prefill-0", "prefill-0-1"]
    indexes = sorted(
        p["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/worker-index"] for p in pods
    )
    assert indexes == ["0", "1"]
    assert len({p["spec"]["nodeName"] for p in pods}) == 2, "8-GPU pods must land on two nodes"


def test_garbage_collector_deletes_dependents(kubectl: Kubectl, namespace: str) -> None:
    """Regression: the controller-manager runs without the garbage collector, so children with
    an ownerReference outlive their owner (the operator's delete path relies on it)."""
    apply(
        kubectl, namespace, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}}
    )
    uid = get_json(kubectl, "configmap", "owner", "-n", namespace)["metadata"]["uid"]
    child = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "child",
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}
            ],
        },
    }
    apply(kubectl, namespace, child)
    kubectl("delete", "configmap", "owner", "-n", namespace)
    wait_until(
        "the dependent ConfigMap to be garbage-collected",
        lambda: (
            not kubectl(
                "get", "configmap", "child", "-n", namespace, "--ignore-not-found", "-o", "name"
            )
        ),
    )
