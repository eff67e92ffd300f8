"""End-to-end checks of the pod network (issue 14): Services over sim pods have ready endpoints,
their ClusterIPs answer from the host and from inside a node namespace (kube-proxy, nftables),
a pod that leaves readiness leaves the EndpointSlice and gets no new requests, and an HTTPRoute
through the Gateway API implementation (Traefik) splits requests by backendRef weight.

Sim pods report their own pod name as their served model (``--served-model-name $(POD_NAME)``),
so ``GET /v1/models`` through a Service says which pod answered. Every address used lies in the
pod network's blackholed ranges (e2e.cluster.podnet); nothing leaves the machine.
"""

from __future__ import annotations

import functools
import http.client
import ipaddress
import json
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import manifests, podnet
from e2e.cluster.stack import GATEWAY_NAME, GATEWAY_NAMESPACE, ClusterHandle, gateway_host
from e2e.runtime.podrunner import PodRunner, kube_pod_deleter, kube_pod_lister, kube_status_patcher
from e2e.tests.conftest import in_ci
from e2e.tests.test_cluster import apply, get_json, wait_until

pytestmark = pytest.mark.e2e

Kubectl = Callable[..., str]
PORT = 30000


def require_pod_network(cluster: ClusterHandle) -> podnet.PodNetwork:
    """The cluster's pod network in netns mode; else skip with the reason (fail under CI, unless
    loopback mode was asked for with CAS_POD_NETWORK=loopback)."""
    net = cluster.network
    if net is not None and net.enabled:
        return net
    reason = net.reason if net is not None else "not a local stack (CAS_KUBECONFIG)"
    message = f"needs the pod network (Services with endpoints); loopback mode: {reason}"
    if in_ci() and net is not None and reason != "CAS_POD_NETWORK=loopback":
        pytest.fail(f"CI is set, so not skipping: {message}")
    pytest.skip(message)


@pytest.fixture
def pod_net(cluster: ClusterHandle) -> podnet.PodNetwork:
    return require_pod_network(cluster)


@pytest.fixture
def runner(
    pod_net: podnet.PodNetwork, kubeconfig: Path, namespace: str, tmp_path: Path
) -> Iterator[PodRunner]:
    """The pod runner for the test's namespace, syncing every 0.3 s in a thread."""
    r = PodRunner(kube_pod_lister(kubeconfig, namespace), tmp_path / "pods",
                  patch_status=kube_status_patcher(kubeconfig),
                  delete_pod=kube_pod_deleter(kubeconfig), restart_backoff_s=2.0,
                  network=pod_net)  # fmt: skip
    stop = threading.Event()
    thread = threading.Thread(target=r.run, args=(stop, 0.3), daemon=True)
    thread.start()
    try:
        yield r
    finally:
        stop.set()
        thread.join(timeout=30)


def sim_deployment(name: str, replicas: int, labels: dict[str, str]) -> dict[str, Any]:
    """Sim pods that leave readiness to the pod runner's probe of /health."""
    engine = {
        "name": "engine", "image": "cas.local/sim:none",
        "command": ["python3", "-m", "cas_engine.launch_server"],
        "args": ["--disaggregation-mode", "null", "--served-model-name", "$(POD_NAME)",
                 "--host", "0.0.0.0", "--port", str(PORT)],
        "ports": [{"name": "http", "containerPort": PORT}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"},
                           "periodSeconds": 1, "timeoutSeconds": 1, "failureThreshold": 2},
    }  # fmt: skip
    spec = {"containers": [engine], "tolerations": [manifests.READINESS_TOLERATION]}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": spec}}}  # fmt: skip


def service(name: str, selector: dict[str, str], port: int = 80) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
            "spec": {"selector": selector,
                     "ports": [{"name": "http", "port": port, "targetPort": "http"}]}}  # fmt: skip


def ready_endpoints(kubectl: Kubectl, namespace: str, svc: str) -> dict[str, bool]:
    """Endpoint address -> ready, over the Service's EndpointSlices."""
    label = f"kubernetes.io/service-name={svc}"
    out = {}
    for sl in get_json(kubectl, "endpointslices", "-n", namespace, "-l", label)["items"]:
        for ep in sl.get("endpoints") or []:
            for addr in ep["addresses"]:
                out[addr] = bool((ep.get("conditions") or {}).get("ready"))
    return out


def who(url: str, timeout: float = 3.0, host: str | None = None) -> str:
    """The served model (= pod name) of the sim answering ``url``/v1/models (``host``: the
    Host header, a route's hostname on the shared Gateway)."""
    request = urllib.request.Request(f"{url}/v1/models", headers={"Host": host} if host else {})
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return str(json.loads(resp.read())["data"][0]["id"])


def who_from_pod(netns: str, pod_ip: str, url: str) -> str:
    """Same as :func:`who`, but sent as pod ``pod_ip`` would: from inside its node namespace
    ``netns``, with its IP as the source."""
    out = subprocess.run(["ip", "netns", "exec", netns, "curl", "-sf", "--max-time", "3",
                          "--interface", pod_ip, f"{url}/v1/models"],
                         capture_output=True, text=True,
                         check=True, timeout=10).stdout  # fmt: skip
    return str(json.loads(out)["data"][0]["id"])


def deploy_echo(kubectl: Kubectl, namespace: str, replicas: int) -> tuple[str, list[str]]:
    """A sim Deployment plus Service ``echo``; wait for ``replicas`` ready endpoints, all
    inside the pod CIDR. Returns (ClusterIP URL, pod names)."""
    labels = {"app": "echo"}
    apply(kubectl, namespace, sim_deployment("echo", replicas, labels), service("echo", labels))
    eps = wait_until(f"{replicas} ready endpoints of Service echo",
                     lambda: (e := ready_endpoints(kubectl, namespace, "echo"))
                     and sum(e.values()) == replicas and e, 90)  # fmt: skip
    assert all(ipaddress.ip_address(a) in ipaddress.ip_network(podnet.POD_CIDR) for a in eps)
    ip = get_json(kubectl, "service", "echo", "-n", namespace)["spec"]["clusterIP"]
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(podnet.SERVICE_CIDR)
    pods = get_json(kubectl, "pods", "-n", namespace, "-l", "app=echo")["items"]
    return f"http://{ip}:80", sorted(p["metadata"]["name"] for p in pods)


def wait_service_answers(url: str) -> None:
    """kube-proxy programs new Services within a sync; wait for the first answer."""

    def answers() -> bool:
        try:
            who(url, timeout=1.0)
            return True
        except OSError:
            return False

    wait_until(f"{url} to answer", answers, 30)


def test_service_clusterip_reaches_sim_pods_from_host_and_pods(
    kubectl: Kubectl, namespace: str, runner: PodRunner, pod_net: podnet.PodNetwork
) -> None:
    """Regression: pod IPs on loopback (the API server refuses them in EndpointSlices), so a
    Service over engine pods had no endpoints and its ClusterIP went nowhere."""
    url, pods = deploy_echo(kubectl, namespace, 2)
    wait_service_answers(url)
    # Both endpoints get requests through the ClusterIP. kube-proxy programs the second
    # endpoint in its own sync after the EndpointSlice lists it (seen in CI: 40 requests right
    # after the first answer all went to one pod), so sample until both answered, bounded.
    seen: Counter[str] = Counter()

    def both_answered() -> bool:
        seen.update(who(url) for _ in range(10))
        return set(seen) == set(pods)

    wait_until(f"both endpoints of {url} to answer", both_answered, 30)
    assert set(seen) == set(pods), seen
    # From a pod (each of them: the other endpoint is on another node, or the same pod hairpins).
    for name in pods:
        ip = get_json(kubectl, "pod", name, "-n", namespace)["status"]["podIP"]
        netns = pod_net.netns_for_ip(ip)
        assert netns is not None, ip
        from_pod = Counter(who_from_pod(netns, ip, url) for _ in range(20))
        assert set(from_pod) <= set(pods) and from_pod, from_pod


def test_pod_out_of_readiness_leaves_endpointslice_and_gets_no_requests(
    kubectl: Kubectl, namespace: str, runner: PodRunner
) -> None:
    """Regression: a pod failing its readiness probe stayed an endpoint and kept getting
    requests through the Service (readiness must reach the EndpointSlice and kube-proxy)."""
    url, pods = deploy_echo(kubectl, namespace, 2)
    wait_service_answers(url)
    victim = pods[0]
    pod = get_json(kubectl, "pod", victim, "-n", namespace)
    ip = pod["status"]["podIP"]
    req = urllib.request.Request(f"http://{ip}:{PORT}/sim/fault", data=b"hang=1", method="POST")
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200
    wait_until(
        f"{victim} ({ip}) not ready in the EndpointSlice",
        lambda: ready_endpoints(kubectl, namespace, "echo").get(ip) is False,
        60,
    )
    time.sleep(1.0)  # kube-proxy's sync after the EndpointSlice change (min sync period 1 s)
    seen = Counter(who(url) for _ in range(60))
    assert set(seen) == {pods[1]}, seen


def test_httproute_weights_split_requests_90_10_over_two_services(
    kubectl: Kubectl, namespace: str, runner: PodRunner, cluster: ClusterHandle
) -> None:
    """Regression: nothing on the local stack routed by Service, so weighted HTTPRoutes (canary
    splits between two fleets' entry Services) could not be tested. Through the Gateway API
    implementation (Traefik), 1,000 requests split 90/10 within +-3 points."""
    gateway = cluster.gateway_url
    assert gateway is not None, "the pod network is up but no Gateway was started"
    host = gateway_host(namespace)  # the shared Gateway: other tests' routes stay apart
    for name in ("stable", "canary"):
        labels = {"app": name}
        apply(kubectl, namespace, sim_deployment(name, 1, labels), service(name, labels))
    for name in ("stable", "canary"):
        ready = functools.partial(ready_endpoints, kubectl, namespace, name)
        wait_until(f"a ready endpoint of {name}", lambda r=ready: any(r().values()), 90)
    route = {
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
        "metadata": {"name": "split"},
        "spec": {"parentRefs": [{"name": GATEWAY_NAME, "namespace": GATEWAY_NAMESPACE}],
                 "hostnames": [host],
                 "rules": [{"backendRefs": [{"name": "stable", "port": 80, "weight": 90},
                                            {"name": "canary", "port": 80, "weight": 10}]}]},
    }  # fmt: skip
    apply(kubectl, namespace, route)
    pods = {p["metadata"]["name"]: p["metadata"]["labels"]["app"]
            for p in get_json(kubectl, "pods", "-n", namespace)["items"]}  # fmt: skip

    def both_answer() -> bool:
        try:
            seen = {pods.get(who(gateway, timeout=2.0, host=host)) for _ in range(30)}
        except OSError:
            return False
        return seen == {"stable", "canary"}

    wait_until("the HTTPRoute to reach both Services through the Gateway", both_answer, 60)
    counts: Counter[str] = Counter()
    conn = http.client.HTTPConnection(urllib.parse.urlsplit(gateway).netloc, timeout=5)
    try:
        for _ in range(1000):  # bounded; every address is inside the pod network
            conn.request("GET", "/v1/models", headers={"Host": host})
            body = conn.getresponse().read()
            counts[pods.get(json.loads(body)["data"][0]["id"], "?")] += 1
    finally:
        conn.close()
    assert sum(counts.values()) == 1000 and set(counts) == {"stable", "canary"}, counts
    assert abs(counts["stable"] / 1000 - 0.90) <= 0.03, counts
