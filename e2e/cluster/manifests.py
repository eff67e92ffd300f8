"""Pure builders of the objects and config files the local stack needs (no I/O beyond reading
the manifests shipped next to the LWS binary).

- :func:`gpu_nodes`: the fake GPU nodes KWOK manages (capacity, pool label, a pod CIDR: the
  node namespace's range of :mod:`e2e.cluster.podnet`, or one inside 127.0.0.0/8 in loopback
  mode, so the pod runner can bind a pod's IP).
- :func:`kwok_config`: KWOK's default node and pod stages as one multi-document file, plus a
  stage that leaves pods opting in (a toleration) Running but not Ready for the pod runner.
- :func:`lws_config`: the LWS controller's configuration (webhook server on loopback with our
  certificate, no leader election, no internal cert rotation).
- :func:`lws_webhooks`: LWS's webhook configurations with its kustomize patches applied and the
  in-cluster Service reference replaced by a loopback URL plus our CA bundle.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

KWOK_NODE_LABEL = "type"
KWOK_NODE_LABEL_VALUE = "kwok"
NODE_POOL_LABEL = "cas.dev/node-pool"
GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True)
class NodeShape:
    """What every fake node advertises. 24 nodes: the e2e suite runs several fleets of up to
    40 GPUs side by side (pytest-xdist workers); at 8 nodes their pods waited for GPUs."""

    count: int = 24
    gpus: int = 8
    cpu: str = "64"
    memory: str = "512Gi"
    pods: int = 110
    pool: str = "gpu-h200"
    name_prefix: str = "kwok-gpu"
    pod_cidr_prefix: str = "127.10"  # first two octets; node i gets <prefix>.<i>.0/24


def node_pod_cidr(index: int, prefix: str = "127.10") -> str:
    """Pod CIDR of node ``index``: ``<prefix>.<index>.0/24`` (default loopback, one /24 each).

    Note: the API server refuses loopback addresses in EndpointSlices, so Services that select
    these pods get no endpoints (pods themselves, their IPs and pod-role discovery work).
    """
    return f"{prefix}.{index}.0/24"


def gpu_nodes(
    shape: NodeShape, kubelet_version: str, pod_cidr: Callable[[int], str] | None = None
) -> list[dict[str, Any]]:
    """Node objects (with status capacity) for KWOK to take over and mark Ready; node ``i``'s
    pod CIDR is ``pod_cidr(i)`` (the pod network's, :mod:`e2e.cluster.podnet`), else loopback."""
    nodes = []
    for i in range(shape.count):
        name = f"{shape.name_prefix}-{i}"
        cidr = pod_cidr(i) if pod_cidr else node_pod_cidr(i, shape.pod_cidr_prefix)
        resources = {
            "cpu": shape.cpu,
            "memory": shape.memory,
            "pods": str(shape.pods),
            "ephemeral-storage": "1Ti",
            GPU_RESOURCE: str(shape.gpus),
        }
        nodes.append(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "labels": {
                        KWOK_NODE_LABEL: KWOK_NODE_LABEL_VALUE,
                        NODE_POOL_LABEL: shape.pool,
                        "kubernetes.io/hostname": name,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                        "node.kubernetes.io/instance-type": f"fake-{shape.pool}",
                    },
                    "annotations": {"kwok.x-k8s.io/node": "fake"},
                },
                "spec": {"podCIDR": cidr, "podCIDRs": [cidr]},
                "status": {
                    "capacity": resources,
                    "allocatable": dict(resources),
                    "addresses": [
                        {"type": "InternalIP", "address": f"127.9.0.{i + 1}"},
                        {"type": "Hostname", "address": name},
                    ],
                    "nodeInfo": {
                        "architecture": "amd64",
                        "operatingSystem": "linux",
                        "kubeletVersion": kubelet_version,
                        "kubeProxyVersion": kubelet_version,
                    },
                },
            }
        )
    return nodes


# Pods that tolerate this (value PROBED_READINESS) are Running but not Ready under KWOK until
# whoever runs them (e2e.runtime.podrunner) finds their readinessProbe answering and says so: the
# kubelet's part, which KWOK's default stage skips by marking every pod Ready at once.
READINESS_TOLERATION_KEY = "kwok.cas.dev/readiness"
PROBED_READINESS = "probed"
READINESS_TOLERATION = {"key": READINESS_TOLERATION_KEY, "operator": "Equal",
                        "value": PROBED_READINESS, "effect": "NoSchedule"}  # fmt: skip
_PROBED = f'(.spec.tolerations // []) | .[] | select(.key == "{READINESS_TOLERATION_KEY}") | .value'
_POD_RUNNING_UNREADY = """\
{{ $now := Now }}
conditions:
- {lastTransitionTime: {{ $now | Quote }}, status: "True", type: Initialized}
- {lastTransitionTime: {{ $now | Quote }}, status: "False", type: Ready, reason: ReadinessProbe}
- {lastTransitionTime: {{ $now | Quote }}, status: "False", type: ContainersReady}
containerStatuses:
{{ range .spec.containers }}
- image: {{ .image | Quote }}
  name: {{ .name | Quote }}
  ready: false
  started: true
  restartCount: 0
  state:
    running:
      startedAt: {{ $now | Quote }}
{{ end }}
{{ with NodeIPsWith .spec.nodeName }}
hostIP: {{ index . 0 | Quote }}
hostIPs:
{{ range . }}
- ip: {{ . | Quote }}
{{ end }}
{{ end }}
{{ $podIPs := PodIPsWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) \
( or .metadata.name "" ) ( or .metadata.namespace "" ) }}
{{ with $podIPs }}
podIP: {{ index . 0 | Quote }}
podIPs:
{{ range . }}
- ip: {{ . | Quote }}
{{ end }}
{{ end }}
phase: Running
startTime: {{ $now | Quote }}
"""


def kwok_config(stages_dir: Path) -> str:
    """KWOK's default stages (copied from its module by build-bins.sh) as one YAML stream, with
    pods that tolerate READINESS_TOLERATION_KEY=PROBED_READINESS split off ``pod-ready`` into
    ``pod-running-unready`` (Running, IPs assigned, not Ready; see READINESS_TOLERATION_KEY) and
    out of ``pod-delete``: the pod runner removes such a pod once it has stopped it, else
    ``pod-delete-at-deadline`` at its deletionTimestamp (the delete time plus its grace)."""
    files = sorted(stages_dir.glob("*.yaml"))
    if not files:
        raise FileNotFoundError(f"no KWOK stages in {stages_dir} (run e2e/cluster/build-bins.sh)")
    stages = [yaml.safe_load(f.read_text()) for f in files]
    ready = next((s for s in stages if s["metadata"]["name"] == "pod-ready"), None)
    if ready is None:
        raise ValueError(f"KWOK's pod-ready stage is missing from {stages_dir}")
    unready = copy.deepcopy(ready)
    unready["metadata"]["name"] = "pod-running-unready"
    unready["spec"]["next"] = {"statusTemplate": _POD_RUNNING_UNREADY}
    probed = {"key": _PROBED, "values": [PROBED_READINESS]}
    ready["spec"]["selector"]["matchExpressions"].append({**probed, "operator": "NotIn"})
    unready["spec"]["selector"]["matchExpressions"].append({**probed, "operator": "In"})
    # A deleted pod the runner runs stays (Terminating) until the runner has stopped it, as a
    # kubelet keeps it through its preStop hook and grace (e2e.runtime.podrunner).
    delete = next((s for s in stages if s["metadata"]["name"] == "pod-delete"), None)
    if delete is None:
        raise ValueError(f"KWOK's pod-delete stage is missing from {stages_dir}")
    backstop = copy.deepcopy(delete)  # ... or at its grace deadline (a kubelet's SIGKILL)
    delete["spec"]["selector"]["matchExpressions"].append({**probed, "operator": "NotIn"})
    backstop["metadata"]["name"] = "pod-delete-at-deadline"
    backstop["spec"]["selector"]["matchExpressions"].append({**probed, "operator": "In"})
    backstop["spec"]["delay"] = {
        "durationMilliseconds": 1000,
        "durationFrom": {"expressionFrom": ".metadata.deletionTimestamp"},
    }
    return yaml.safe_dump_all([*stages, unready, backstop], sort_keys=False)


def lws_config(*, webhook_port: int, cert_dir: Path, health_port: int) -> str:
    """The LWS controller's Configuration: loopback listeners, our certs, no leader election,
    metrics serving off (nothing scrapes the controller here)."""
    cfg = {
        "apiVersion": "config.lws.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "metrics": {"bindAddress": "0"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
    }
    return yaml.safe_dump(cfg, sort_keys=False)


def _apply_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    """Apply the JSON-patch ``replace``/``add`` ops on ``/webhooks/<i>`` that LWS ships."""
    for op in ops:
        parts = op["path"].strip("/").split("/")
        if op["op"] not in ("replace", "add") or len(parts) != 2 or parts[0] != "webhooks":
            raise ValueError(f"unsupported webhook patch op: {op}")
        doc["webhooks"][int(parts[1])] = copy.deepcopy(op["value"])


def lws_webhooks(webhook_dir: Path, *, port: int, ca_pem: bytes) -> list[dict[str, Any]]:
    """LWS's Mutating/ValidatingWebhookConfigurations pointed at ``https://127.0.0.1:<port>``.

    The kustomize patches (which add an objectSelector so only LWS pods hit the pod webhooks)
    are applied first; then each ``clientConfig.service`` becomes a ``url`` on loopback with
    ``caBundle`` set to our CA, and names get an ``lws-`` prefix.
    """
    docs = [d for d in yaml.safe_load_all((webhook_dir / "manifests.yaml").read_text()) if d]
    patches = {
        "MutatingWebhookConfiguration": webhook_dir / "mutating-patch.yaml",
        "ValidatingWebhookConfiguration": webhook_dir / "validating-patch.yaml",
    }
    ca_bundle = base64.b64encode(ca_pem).decode()
    for doc in docs:
        patch = patches.get(doc["kind"])
        if patch is not None and patch.exists():
            _apply_patch(doc, yaml.safe_load(patch.read_text()))
        doc["metadata"]["name"] = f"lws-{doc['metadata']['name']}"
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca_bundle}
    return docs
