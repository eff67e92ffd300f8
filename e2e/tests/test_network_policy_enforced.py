"""The fleet's NetworkPolicies ENFORCED on the local stack's pod network: the operator process
renders them, the real API server stores them, and kube-network-policies (the reference
NetworkPolicy implementation kind uses: its policy engine and nftables/NFQUEUE dataplane,
e2e/runtime/netpol.py) decides every connection to the fleet's pods from other nodes.

Regression guarded (issue 41, item 2): the metrics peer was Prometheus pods in ANY namespace
(`namespaceSelector: {}`), so any namespace reached every engine port by labelling a pod
`app.kubernetes.io/name=prometheus`. Now the scraper's namespace is the operator's setting
(`--metrics-scraper-namespace`, the chart's `metricsScraperNamespaces`): a pod with the
scraper's labels in another namespace cannot connect to an engine or a router's metrics port;
a pod with the same labels in the scraper's namespace still can. The scraper pods here are pods
with that identity connecting from their own IP (the local stack's Prometheus runs on the host,
as root, which kube-network-policies admits like a node's kubelet), and every probe crosses
the host (the pods are on other nodes than the fleet's): connections between pods of one node
share that node's network namespace here and are not enforced.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from cas_engine.sim.fleet import router_available
from e2e.cluster.bins import resolve
from e2e.cluster.podnet import PodNetwork, load_for_kubeconfig
from e2e.cluster.stack import ClusterError, ClusterHandle
from e2e.fleet.fleetview import Kubectl, apply_crds, role_pods
from e2e.fleet.livestack import LiveStack, http_ok, resource_live
from e2e.paths import REPO_ROOT
from e2e.runtime import chart
from e2e.runtime.netpol import Enforcer, connect_from
from e2e.tests.conftest import in_ci
from e2e.waits import wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not router_available(), reason="sglang-router not installed"),
]
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}
ENGINE, ROUTER_SERVING, ROUTER_METRICS = 30000, 8000, 29000
BLOCKED = "TimeoutError"  # dropped on the way: no answer, not even a refusal


@pytest.fixture
def other_namespaces(namespace: str, kubectl: Kubectl) -> Iterator[tuple[str, str]]:
    """(the scraper's namespace, an unrelated one), made and removed with the test."""
    names = (f"{namespace}-mon", f"{namespace}-x")
    for name in names:
        kubectl("create", "namespace", name)
    try:
        yield names
    finally:
        for name in names:
            kubectl("delete", "namespace", name, "--wait=false", check=False)


def fleet() -> dict[str, Any]:
    """The minimal sample at one GPU per instance (nothing here needs more)."""
    cas: dict[str, Any] = yaml.safe_load((REPO_ROOT / "config/samples/minimal.yaml").read_text())
    cas["spec"]["prefill"] = {"replicas": 1, "tensorParallel": 1}
    cas["spec"]["decode"] = {"replicas": 1, "tensorParallel": 1}
    return cas


def probe_pod(kubectl: Kubectl, namespace: str, name: str, labels: dict[str, str],
              node: str) -> str:  # fmt: skip
    """A pod on `node` (KWOK runs it: it gets an IP of that node); its IP once it has one."""
    spec = {"nodeName": node, "containers": [{"name": "probe", "image": "probe"}]}
    pod = {"apiVersion": "v1", "kind": "Pod", "spec": spec,
           "metadata": {"name": name, "namespace": namespace, "labels": labels}}  # fmt: skip
    kubectl("apply", "-f", "-", stdin=json.dumps(pod))

    def ip() -> str | None:
        raw = kubectl("get", "pod", name, "-n", namespace, "-o", "json")
        found: str | None = json.loads(raw).get("status", {}).get("podIP")
        return found

    return str(wait_for(f"{namespace}/{name} with an IP", ip, 60))


def test_only_the_named_scraper_namespace_reaches_the_metrics_ports(
    cluster: ClusterHandle, namespace: str, kubectl: Kubectl, crds: None, tmp_path: Path,
    other_namespaces: tuple[str, str],
) -> None:  # fmt: skip
    network = require_enforcement(cluster)
    monitoring, elsewhere = other_namespaces
    stack = LiveStack(
        cluster.kubeconfig, namespace, tmp_path / "live", sim_args=["--sim-speedup", "20"],
        operator_args=("-n", namespace, "--metrics-scraper-namespace", monitoring),
        audit_log=cluster.audit_log,
    )  # fmt: skip
    enforcer = Enforcer(cluster.kubeconfig, (namespace,), tmp_path / "netpol")
    with resource_live(stack, kubectl, fleet(), log=lambda s: print(f"[live] {s}")):
        targets = wait_for("the fleet's pods answering", lambda: answering(kubectl, namespace), 120)
        ips = {p["status"]["podIP"] for p in targets.values()}
        wait_for("the fleet's NetworkPolicies", lambda: policies(kubectl, namespace) == 2, 60)
        enforcer.start()
        try:
            enforcer.wait_managing(ips)
            busy = {p["spec"]["nodeName"] for p in targets.values()}
            free = [n for n in nodes(kubectl) if n not in busy]
            intruder = probe_pod(kubectl, elsewhere, "intruder", PROMETHEUS, free[0])
            scraper = probe_pod(kubectl, monitoring, "prometheus", PROMETHEUS, free[1])
            stranger = probe_pod(kubectl, monitoring, "stranger", {"app": "x"}, free[0])
            probes = [(who, src, name, pod["status"]["podIP"], port)
                      for who, src in (("intruder", intruder), ("scraper", scraper),
                                       ("stranger", stranger))
                      for name, pod in targets.items() for port in ports_of(pod)]  # fmt: skip
            with ThreadPoolExecutor(8) as pool:  # a dropped SYN waits out its timeout
                outcomes = pool.map(lambda p: connect_from(network, p[1], p[3], p[4]), probes)
                seen = {(p[0], p[2], p[4]): o for p, o in zip(probes, outcomes, strict=True)}
        finally:
            print(f"[netpol] {enforcer.stop()}")
    print("\n".join(f"[probe] {k}: {v}" for k, v in sorted(seen.items())))
    for (who, name, port), outcome in seen.items():
        # the serving port: any client, by default; the rest: the named scraper only
        admitted = port == ROUTER_SERVING or who == "scraper"
        assert outcome == ("connected" if admitted else BLOCKED), (who, name, port, outcome)


def require_enforcement(cluster: ClusterHandle) -> PodNetwork:
    """The pod network with what cas-netpol needs; else skip with the reason, and under CI
    fail instead (`make test` builds cas-netpol with the other binaries and `make sysdeps`
    installs iptables), unless loopback mode was asked for (CAS_POD_NETWORK=loopback)."""
    network = load_for_kubeconfig(cluster.kubeconfig)
    reason = None
    if network is None or not network.enabled:
        reason = network.reason if network is not None else "not a local stack (CAS_KUBECONFIG)"
    elif not resolve().netpol.exists():
        reason = f"cas-netpol missing at {resolve().netpol} (make bins)"
    elif shutil.which("iptables-nft") is None:
        reason = "iptables-nft missing (make sysdeps)"
    if reason is None:
        assert network is not None
        return network
    if in_ci() and reason != "CAS_POD_NETWORK=loopback":
        pytest.fail(f"CI is set, so not skipping: {reason}")
    pytest.skip(f"needs NetworkPolicy enforcement: {reason}")


def answering(kubectl: Kubectl, namespace: str) -> dict[str, dict[str, Any]] | None:
    """The fleet's 4 pods by name once each one's process answers (from the host)."""
    pods = {p["metadata"]["name"]: p for role in ("prefill", "decode", "router")
            for p in role_pods(kubectl, namespace, role)}  # fmt: skip
    return pods if len(pods) == 4 and all(answers(p) for p in pods.values()) else None


def policies(kubectl: Kubectl, namespace: str) -> int:
    found = json.loads(kubectl("get", "networkpolicies", "-n", namespace, "-o", "json"))
    return len(found["items"])


def answers(pod: dict[str, Any]) -> bool:
    ip = pod.get("status", {}).get("podIP")
    if not ip:
        return False
    if pod["metadata"]["labels"].get("cas.dev/role") == "router":
        return http_ok(f"http://{ip}:{ROUTER_METRICS}/metrics")
    return http_ok(f"http://{ip}:{ENGINE}/metrics")


def ports_of(pod: dict[str, Any]) -> tuple[int, ...]:
    if pod["metadata"]["labels"].get("cas.dev/role") == "router":
        return (ROUTER_SERVING, ROUTER_METRICS)
    return (ENGINE,)


def nodes(kubectl: Kubectl) -> list[str]:
    found = json.loads(kubectl("get", "nodes", "-o", "json"))["items"]
    return sorted(n["metadata"]["name"] for n in found)


def test_a_metrics_peer_of_every_namespace_is_refused_at_apply(
    namespace: str, kubectl: Kubectl, crds: None
) -> None:
    """The CRD's CEL rule, by the real API server (the operator's own check is in
    tests/unit/test_network_policy.py): `metricsFrom` must name its namespaces. Our CRDs are
    applied again first: other sessions on the shared cluster apply theirs."""
    apply_crds(kubectl)
    for peer, word in (({"podLabels": PROMETHEUS, "namespaceLabels": {}}, "every namespace"),
                       ({"cidr": "0.0.0.0/0"}, "every address")):  # fmt: skip
        cas = fleet()
        cas["spec"]["security"] = {"networkPolicy": {"metricsFrom": [peer]}}
        with pytest.raises(ClusterError) as refused:
            kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-",
                    stdin=json.dumps(cas))  # fmt: skip
        said = str(refused.value)
        assert "spec.security.networkPolicy.metricsFrom" in said and word in said, said


def test_the_charts_scraper_namespaces_reach_the_operator(namespace: str) -> None:
    """The chart's `metricsScraperNamespaces` (default: monitoring, where kube-prometheus-stack
    usually runs) is what the operator reads; `[]` admits no scraper."""
    from cas_operator.api.limits import SCRAPER_NAMESPACES_ENV, OperatorLimits

    def limits(values: dict[str, Any]) -> OperatorLimits:
        objects = chart.template("cas-chart-scrapers", namespace, values)
        deployment = next(o for o in objects if o["kind"] == "Deployment")
        env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        return OperatorLimits.from_env({e["name"]: e["value"] for e in env if "value" in e})

    assert limits({}).scraper_namespaces == ("monitoring",)
    assert limits({"metricsScraperNamespaces": ["obs", "vm"]}).scraper_namespaces == ("obs", "vm")
    assert limits({"metricsScraperNamespaces": []}).scraper_namespaces == ()
    assert SCRAPER_NAMESPACES_ENV == "CAS_METRICS_SCRAPER_NAMESPACES"
