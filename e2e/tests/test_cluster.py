"""End-to-end checks of the local stack itself (the harness every operator e2e test relies on).

Each test guards one promise of ``e2e/cluster/stack.py``: the pinned apiserver version, KWOK GPU
nodes, pods of workloads going Running on them, LWS groups reconciled (with its webhooks), the
garbage collector honouring owner references, and readiness left to the pod runner's probe for
pods that opt in.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

import e2e.cluster.manifests as manifests
from e2e.cluster.bins import read_versions
from e2e.cluster.podnet import load_for_kubeconfig
from e2e.runtime.podrunner import PodRunner, kube_pod_deleter, kube_pod_lister, kube_status_patcher
from e2e.waits import wait_for

pytestmark = pytest.mark.e2e

Kubectl = Callable[..., str]
WAIT_S = 60.0


def wait_until(what: str, probe: Callable[[], Any], timeout: float = WAIT_S) -> Any:
    """Poll ``probe`` every 0.25 s until it returns something truthy; fail naming ``what``."""
    try:
        return wait_for(what, probe, timeout)
    except TimeoutError as exc:
        pytest.fail(str(exc))


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


CORDON = "node.kubernetes.io/unschedulable"


def test_kwok_nodes_ready_with_gpus(kubectl: Kubectl, kubeconfig: Path) -> None:
    """Regression: fake nodes not Ready, or without the GPUs / pool label / pod CIDR (inside
    the pod network's range, or loopback without one) that scheduling engine pods and the
    process runner depend on."""
    selector = f"{manifests.KWOK_NODE_LABEL}={manifests.KWOK_NODE_LABEL_VALUE}"
    nodes = get_json(kubectl, "nodes", "-l", selector)["items"]
    assert len(nodes) >= manifests.NodeShape().count
    net = load_for_kubeconfig(kubeconfig)
    loopback = net.networks()[0] if net else ipaddress.IPv4Network("127.0.0.0/8")
    for node in nodes:
        conds = {c["type"]: c["status"] for c in node["status"]["conditions"]}
        assert conds.get("Ready") == "True", node["metadata"]["name"]
        assert node["status"]["allocatable"][manifests.GPU_RESOURCE] == "8"
        assert node["metadata"]["labels"][manifests.NODE_POOL_LABEL] == "gpu-h200"
        assert ipaddress.IPv4Network(node["spec"]["podCIDR"]).subnet_of(loopback)
        # a cordon is another test's node drain at work (tests run side by side), not a fault
        taints = [t["key"] for t in node["spec"].get("taints", []) if t["key"] != CORDON]
        assert not taints, f"{node['metadata']['name']} is tainted: {taints}"


def test_deployment_pods_become_running(kubectl: Kubectl, namespace: str) -> None:
    """Regression: scheduler or KWOK pod stages missing, so workload pods stay Pending; or pod
    IPs outside the node's pod CIDR."""
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


def pod_ready(kubectl: Kubectl, namespace: str, selector: str) -> tuple[str, str] | None:
    """(name, Ready status) of the first Running pod matching ``selector`` that has an IP."""
    pods = get_json(kubectl, "pods", "-n", namespace, "-l", selector)["items"]
    for pod in pods:
        if pod["status"].get("phase") == "Running" and pod["status"].get("podIP"):
            conds = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}
            return pod["metadata"]["name"], conds.get("Ready", "")
    return None


@pytest.mark.skipif(bool(os.environ.get("CAS_KUBECONFIG")), reason="a user-provided cluster")
def test_probed_pods_are_ready_only_while_their_process_answers(
    kubectl: Kubectl, namespace: str, kubeconfig: Path, tmp_path: Path
) -> None:
    """Regression: KWOK marked every pod Ready at once, so a replacement engine pod joined the
    router before its sim listened and a client got a 502. A pod that tolerates the readiness
    marker must stay Running and not Ready (IP assigned) until the pod runner's probe of its
    readinessProbe answers, and lose Ready when its process dies; other pods keep KWOK's."""
    engine = {
        "name": "engine", "image": "cas.local/sim:none",
        "command": ["python3", "-m", "cas_engine.launch_server"],
        "args": ["--disaggregation-mode", "null", "--served-model-name", "probe-sim",
                 "--host", "0.0.0.0", "--port", "30000"],
        "ports": [{"name": "http", "containerPort": 30000}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}},
    }  # fmt: skip

    def deployment(name: str, tolerations: list[dict[str, str]]) -> dict[str, Any]:
        labels = {"app": name}
        spec = {"containers": [engine if tolerations else container("engine")],
                "tolerations": tolerations}  # fmt: skip
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
                "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                         "template": {"metadata": {"labels": labels}, "spec": spec}}}  # fmt: skip

    apply(
        kubectl,
        namespace,
        deployment("probed", [manifests.READINESS_TOLERATION]),
        deployment("plain", []),
    )
    wait_until("the plain pod Ready", lambda: (pod_ready(kubectl, namespace, "app=plain")
                                               or ("", ""))[1] == "True")  # fmt: skip
    name, ready = wait_until("the probed pod Running with an IP",
                             lambda: pod_ready(kubectl, namespace, "app=probed"))  # fmt: skip
    assert ready == "False", "KWOK marked a probed pod Ready before anything answered"
    runner = PodRunner(kube_pod_lister(kubeconfig, namespace), tmp_path / "logs",
                       patch_status=kube_status_patcher(kubeconfig),
                       delete_pod=kube_pod_deleter(kubeconfig),
                       network=load_for_kubeconfig(kubeconfig),
                       restart_backoff_s=60.0)  # fmt: skip
    try:

        def synced_ready() -> bool:
            runner.sync()
            return (pod_ready(kubectl, namespace, "app=probed") or ("", ""))[1] == "True"

        wait_until("the probed pod Ready once its sim answers", synced_ready, 30)
        status = get_json(kubectl, "deployment", "probed", "-n", namespace)["status"]
        assert status.get("readyReplicas") == 1
        os.kill(runner.running[(namespace, name)].record.pid, signal.SIGKILL)
        wait_until("the probed pod not Ready after its process died", lambda: not synced_ready())
    finally:
        runner.stop_all()


def test_the_fixtures_direct_reads_answer_as_kubectl_does(kubectl: Kubectl, namespace: str) -> None:
    """The `kubectl` fixture's `rest_get` (the tests' polls read the API server without a
    kubectl process) must see what kubectl sees: the same pods, None for what is not there.
    Regression guarded: a direct read that silently returned nothing would make every
    "wait until no pod" poll pass at once."""
    from e2e.fleet.fleetview import rest_get

    kubectl("create", "-n", namespace, "configmap", "direct-read", "--from-literal=a=b")
    via_kubectl = json.loads(kubectl("get", "configmap", "direct-read", "-n", namespace,
                                     "-o", "json"))  # fmt: skip
    direct = rest_get(kubectl, f"/api/v1/namespaces/{namespace}/configmaps/direct-read")
    assert getattr(kubectl, "rest_get", None) is not None, "the fixture reads through kubectl"
    assert direct is not None and direct["metadata"]["uid"] == via_kubectl["metadata"]["uid"]
    assert direct["data"] == {"a": "b"}
    assert rest_get(kubectl, f"/api/v1/namespaces/{namespace}/configmaps/absent") is None
