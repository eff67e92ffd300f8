"""Read-only views of one CodingAgentServing's fleet on a cluster, shared by the operator-process
e2e tests and `make bench-anomaly` (one copy of "which decodes serve", "what the router lists").

Everything goes through a `kubectl(*args, check=True) -> stdout` callable (the tests' fixture or
the bench's wrapper) and plain HTTP to pod IPs on loopback; nothing here changes the cluster
except `apply_crds`.
"""

from __future__ import annotations

import base64
import json
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

import yaml

from cas_operator.api import constants as c
from e2e.cluster.api import condition as condition_status
from e2e.cluster.api import raw_get
from e2e.paths import REPO_ROOT as ROOT
from e2e.waits import wait_for

NAME = "minimal"  # the sample's resource name
ENGINE_PORT = 30000
Kubectl = Callable[..., str]


def speculative_sample(decodes: int, window_s: int, **guard: Any) -> dict[str, Any]:
    """The minimal sample with 1 prefill : `decodes` decode and NEXTN speculative decoding
    (without it the engines' quality gate has nothing to judge), Fixed ratio, a guard window of
    `window_s` and any other `anomalyGuard` fields in `guard` (camelCase)."""
    cas: dict[str, Any] = yaml.safe_load((ROOT / "config/samples/minimal.yaml").read_text())
    cas["spec"]["engine"] = {"speculative": {"algorithm": "NEXTN", "numSteps": 3,
                                             "eagleTopk": 1, "numDraftTokens": 4}}  # fmt: skip
    cas["spec"]["decode"] = {"replicas": decodes}
    cas["spec"]["ratio"] = {"mode": "Fixed", "prefill": 1, "decode": decodes}
    cas["spec"]["anomalyGuard"] = {"windowSeconds": window_s, **guard}
    return cas


CRD = "customresourcedefinitions.apiextensions.k8s.io/codingagentservings.serving.cas.dev"


def apply_crds(kubectl: Kubectl) -> None:
    """Our CRDs, server-side, and wait until they are established.

    Not ``kubectl wait --for=condition=Established``: on a CRD the API server has only just
    created, ``.status.conditions`` is still absent, and kubectl then fails at once ("accessor
    error: <nil> is of the type <nil>") instead of waiting; a fresh-clone CI run lost its
    whole first e2e group to that. The condition is polled instead."""
    kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
    wait_for("our CRD Established", lambda: crd_established(kubectl), 60, interval=0.1)


def crd_established(kubectl: Kubectl) -> bool:
    """Whether the API server serves our CRD (its Established condition is True); False while
    the CRD has no conditions yet."""
    crd = json.loads(kubectl("get", CRD, "-o", "json"))
    return condition_status(crd, "Established") == "True"


def rest_get(kubectl: Kubectl, path: str) -> dict[str, Any] | None:
    """The JSON at API path `path`, or None where nothing is there. Straight from the API
    server where the kubectl callable can (the e2e fixture, `ClusterKubectl.rest_get`: no
    kubectl process per poll), else `kubectl get --raw` (a bench's plain function)."""
    direct: Callable[[str], dict[str, Any] | None] | None = getattr(kubectl, "rest_get", None)
    return direct(path) if direct is not None else raw_get(kubectl, path)


def labelled_pods(kubectl: Kubectl, namespace: str, selector: str) -> list[dict[str, Any]]:
    """Every pod of `namespace` matching the label `selector` (`a=b,c=d`), as the API sends."""
    query = urllib.parse.quote(selector)
    found = rest_get(kubectl, f"/api/v1/namespaces/{namespace}/pods?labelSelector={query}")
    items: list[dict[str, Any]] = (found or {}).get("items") or []
    return items


def role_pods(
    kubectl: Kubectl, namespace: str, role: str, name: str = NAME
) -> list[dict[str, Any]]:
    """Live (not being deleted) pods of the resource with `role`."""
    pods = labelled_pods(kubectl, namespace, f"cas.dev/name={name},cas.dev/role={role}")
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def serving_decodes(kubectl: Kubectl, namespace: str, name: str = NAME) -> dict[str, str]:
    """Name -> URL of decode pods labelled cas.dev/serving=true with an IP."""
    return {
        p["metadata"]["name"]: f"http://{p['status']['podIP']}:{ENGINE_PORT}"
        for p in role_pods(kubectl, namespace, "decode", name)
        if (p["metadata"].get("labels") or {}).get("cas.dev/serving") == "true"
        and p.get("status", {}).get("podIP")
    }


def cas_status(kubectl: Kubectl, namespace: str, name: str = NAME) -> dict[str, Any]:
    """The resource's status ({} before the operator wrote one); raises if it does not exist."""
    path = f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{namespace}/{c.PLURAL}/{name}"
    found = rest_get(kubectl, path)
    if found is None:
        raise LookupError(f"{c.PLURAL}/{name} not found in namespace {namespace}")
    status: dict[str, Any] = found.get("status") or {}
    return status


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})


def entry_url_when_serving(kubectl: Kubectl, namespace: str, name: str = NAME) -> str | None:
    """``http://<ClusterIP>`` of the resource's entry Service once a router answers through it
    (kube-proxy has rules for a Ready router), else None: a router pod being Ready is not
    enough, kube-proxy syncs after the EndpointSlice changes."""
    ip = kubectl("get", "service", name, "-n", namespace, "-o", "jsonpath={.spec.clusterIP}")
    url = f"http://{ip}"
    try:
        with urllib.request.urlopen(f"{url}/readiness", timeout=3) as resp:
            return url if resp.status == 200 else None
    except OSError:
        return None


def control_key(kubectl: Kubectl, namespace: str) -> str:
    """The router control-plane key of the namespace's one fleet (its keys Secret; "" while
    the operator has not made it)."""
    selector = f"{c.LABEL_APP_NAME}={c.APP_KEYS}"
    found = json.loads(kubectl("get", "secrets", "-n", namespace, "-l", selector, "-o", "json"))
    if not found["items"]:
        return ""
    (secret,) = found["items"]
    return base64.b64decode(secret["data"][c.KEY_ROUTER_CONTROL_PLANE]).decode()


def router_workers(router: str, key: str) -> set[str]:
    """Worker URLs the router pod lists, asked with the fleet's control-plane key (empty when
    it does not answer)."""
    ask = urllib.request.Request(f"{router}/workers", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(ask, timeout=3) as resp:
            return {w["url"] for w in json.loads(resp.read()).get("workers", [])}
    except OSError:
        return set()


def requests_served(url: str) -> float:
    """`sglang:num_requests_total` of the sim at `url`; 0 while it does not answer (a
    replacement can be listed before its server is up)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=3) as resp:
            text = resp.read().decode()
    except OSError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sglang:num_requests_total"))  # fmt: skip


def long_chat(router: str, tokens: int) -> tuple[int, int]:
    """One non-streaming chat request of exactly `tokens` generated tokens through `router`:
    (HTTP status, completion tokens); a connection cut raises."""
    body = {"model": "sim", "messages": [{"role": "user", "content": "refactor the module"}],
            "max_tokens": tokens, "ignore_eos": True}  # fmt: skip
    req = urllib.request.Request(f"{router}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=180) as resp:
            return resp.status, int(json.loads(resp.read())["usage"]["completion_tokens"])
    except urllib.error.HTTPError as exc:
        return exc.code, 0


def running(url: str) -> int:
    """Requests in flight at the engine at `url` (its preStop hook's reading); 0 while it does
    not answer."""
    from cas_engine.prestop import in_flight

    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=3) as resp:
            return in_flight(resp.read().decode()) or 0
    except OSError:
        return 0
