"""What a leaked operator token can do, on the local stack's API server (issue 41, item 4).

The chart's identity is installed as `helm install` would make it (all namespaces: a
ClusterRole; a release of this test's own, whose cluster-scoped objects are removed
afterwards), and a kubeconfig holds its ServiceAccount token. Every attempt below is a real
request with that token: `kubectl auth can-i` for what RBAC grants, then writes an attacker
would send, each of which RBAC or the chart's ValidatingAdmissionPolicy `<release>-own-objects`
must refuse. The operator's normal paths under the same policy are shown by every e2e test
that runs it under the chart's identity and finds no refusal in the audit log
(`chart.refusals`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cas_operator.desired.resources.meta import stable_hash
from e2e.runtime import chart
from tests.paths import load_sample

pytestmark = pytest.mark.e2e
Kubectl = Callable[..., str]
POLICY_LOAD_S = 30.0  # the API server loads a new admission policy asynchronously


@pytest.fixture
def leaked(
    cluster: Any, kubectl: Kubectl, namespace: str, crds: None, tmp_path: Path
) -> Iterator[Callable[..., tuple[int, str]]]:
    """`leaked(*kubectl_args, stdin=None) -> (exit code, output)` as the chart's
    all-namespaces identity (a release of its own in `namespace`)."""
    release = f"cas-leak-{stable_hash(namespace)}"
    identity = chart.install_identity(kubectl, cluster.kubeconfig, tmp_path / "kubeconfig",
                                      release=release, namespace=namespace)  # fmt: skip

    def run(*args: str, stdin: str | None = None) -> tuple[int, str]:
        done = chart.kubectl_as(identity, cluster.kubectl_path, *args, stdin=stdin)
        return done.returncode, (done.stdout + done.stderr).strip()

    try:
        yield run
    finally:
        chart.remove_cluster_scoped(kubectl, release, namespace)


def await_policy(kubectl: Kubectl, leaked: Any, namespace: str) -> None:
    """Where the chart has the policy, wait until the API server enforces it (it loads a new
    policy asynchronously): a bare ConfigMap from the token is refused."""
    policies = kubectl("get", "validatingadmissionpolicies", "-o", "name")
    release = f"cas-leak-{stable_hash(namespace)}"
    if f"/{release}-own-objects" not in policies:
        return  # an older chart: nothing to wait for
    probe = {"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": "probe", "namespace": namespace}}  # fmt: skip
    deadline = time.monotonic() + POLICY_LOAD_S
    while leaked("create", "-f", "-", stdin=json.dumps(probe))[0] == 0:
        kubectl("delete", "configmap", "probe", "-n", namespace)
        assert time.monotonic() < deadline, "the admission policy was not enforced in 30 s"
        time.sleep(1.0)


def fleet_meta(name: str, namespace: str, fleet: str = "demo") -> dict[str, Any]:
    """Metadata that looks like a fleet's child: the labels and a controller reference to a
    CodingAgentServing (the API server cannot tell a forged one)."""
    owner = {"apiVersion": "serving.cas.dev/v1alpha1", "kind": "CodingAgentServing",
             "name": fleet, "uid": "00000000-0000-0000-0000-000000000001", "controller": True,
             "blockOwnerDeletion": False}  # fmt: skip
    labels = {"app.kubernetes.io/managed-by": "cas-operator", "cas.dev/name": fleet}
    return {"name": name, "namespace": namespace, "labels": labels, "ownerReferences": [owner]}


# (what the token asks, namespace or "" for all) -> RBAC's answer: "no" for each
CANNOT = [
    ("list secrets", ""), ("watch secrets", ""), ("list configmaps", ""),
    ("update deployments", ""), ("delete serviceaccounts", ""), ("create pods", ""),
    ("create pods --subresource=exec", ""), ("create serviceaccounts --subresource=token", ""),
    ("bind clusterroles", ""),
    ("escalate roles", ""), ("create clusterrolebindings", ""), ("impersonate users", ""),
    ("update secrets", "kube-system"), ("list nodes", ""),
    ("delete codingagentservings", ""), ("create codingagentservings", ""),
]  # fmt: skip


def test_rbac_grants_no_reads_of_other_secrets_or_configmaps_nor_any_escalation(
    leaked: Any,
) -> None:
    """Regression (issue 41): the chart's ClusterRole granted list/watch on ConfigMaps,
    update on Deployments and delete on ServiceAccounts, Roles and RoleBindings, which the
    operator never sends. `kubectl auth can-i` with the token: none of these, nor any way to
    read Secrets in bulk, mint tokens, bind or escalate RBAC, or run pods directly."""
    granted = []
    for verb_resource, where in CANNOT:
        scope = ("-n", where) if where else ("--all-namespaces",)
        _, out = leaked("auth", "can-i", *verb_resource.split(), *scope)
        if out != "no":
            granted.append(f"{verb_resource} {where or 'everywhere'}: {out}")
    assert granted == [], granted
    _, out = leaked("auth", "can-i", "create", "secrets", "-n", "kube-system")
    assert out == "yes"  # RBAC grants it (the keys Secret, any namespace): admission bounds it


def test_every_write_outside_the_fleets_own_objects_is_refused(
    leaked: Any, kubectl: Kubectl, namespace: str
) -> None:
    """Regression (issue 41): with the chart's token, a `kubernetes.io/service-account-token`
    Secret for any account (kube-system's included) minted that account's token, and any
    Deployment, Service, ConfigMap, Role or RoleBinding anywhere could be created, patched or
    deleted. Each attempt below is refused by RBAC or by the admission policy
    `<release>-own-objects`, including the ones that carry a fleet's labels and a forged
    controller reference; the one write of a fleet's shape goes through."""
    ns = namespace
    kubectl("create", "deployment", "users-app", "--image=app:1", "-n", ns)
    kubectl("create", "secret", "generic", "users-secret", "--from-literal=k=v", "-n", ns)
    kubectl("create", "serviceaccount", "users-sa", "-n", ns)
    kubectl("create", "role", "powerful", "--verb=get,create", "--resource=secrets", "-n", ns)
    resource = load_sample("minimal.yaml")
    resource["metadata"]["name"] = "demo"
    kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(resource))
    await_policy(kubectl, leaked, ns)
    ok = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": fleet_meta("demo-plan", ns)}
    code, out = leaked("create", "-f", "-", stdin=json.dumps(ok))
    assert code == 0, f"a write of a fleet's shape was refused: {out}"

    token = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/service-account-token",
             "metadata": {"name": "minted", "namespace": "kube-system", "annotations": {
                 "kubernetes.io/service-account.name": "default"}}}  # fmt: skip
    forged_token = json.loads(json.dumps(token))
    forged_token["metadata"].update(fleet_meta("demo-keys", "kube-system"))
    forged_token["metadata"]["annotations"] = token["metadata"]["annotations"]
    loot = {"apiVersion": "v1", "kind": "Secret", "stringData": {"k": "v"},
            "metadata": {"name": "loot", "namespace": ns}}  # fmt: skip
    image = {"spec": {"template": {"spec": {"containers": [{"name": "app", "image": "evil:1"}]}}}}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": fleet_meta("demo-router", ns),
            "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]}  # fmt: skip
    node_port = {"apiVersion": "v1", "kind": "Service", "metadata": fleet_meta("demo-open", ns),
                 "spec": {"type": "NodePort", "selector": {"cas.dev/name": "demo"},
                          "ports": [{"port": 80}]}}  # fmt: skip
    open_all = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": fleet_meta("demo-engines", ns),
                "spec": {"podSelector": {}, "ingress": [{}]}}  # fmt: skip
    create = ("create", "-f", "-")
    patch = ("--type=merge", "--patch-file=/dev/stdin")
    attempts: dict[str, tuple[Any, tuple[str, ...]]] = {
        "a service-account-token Secret in kube-system": (token, create),
        "the same, labelled and owned as a fleet's": (forged_token, create),
        "an unlabelled Opaque Secret": (loot, create),
        "patching a Deployment the operator does not own":
            (image, ("patch", "deployment", "users-app", "-n", ns, *patch)),
        "deleting it": ("", ("delete", "deployment", "users-app", "-n", ns, "--wait=false")),
        # RBAC grants deleting Secrets (a fleet's retired keys copies, by name): not this one
        "deleting a Secret the operator does not own":
            ("", ("delete", "secret", "users-secret", "-n", ns, "--wait=false")),
        "patching the namespace's CA ConfigMap": (
            {"data": {"ca.crt": "x"}}, ("patch", "cm", "kube-root-ca.crt", "-n", ns, *patch)),
        "binding cluster-admin":
            (_binding(ns, "demo-router", "ClusterRole", "cluster-admin"), create),
        "binding a Role the operator holds (RBAC's escalation check passes)":
            (_binding(ns, "demo-router", "Role", "powerful"), create),
        "a Role granting Secrets": (role, create),
        "a Deployment whose pods run as another ServiceAccount":
            (_deployment(ns, "users-sa"), create),
        "a NodePort Service": (node_port, create),
        "a NetworkPolicy opening every pod of the namespace": (open_all, create),
        "changing a fleet's engine image": (
            {"spec": {"engine": {"image": "evil:1"}}}, ("patch", "cas", "demo", "-n", ns, *patch)),
    }  # fmt: skip
    accepted = {}
    for what, (body, args) in attempts.items():
        code, out = leaked(*args, stdin=body if isinstance(body, str) else json.dumps(body))
        if code == 0:
            accepted[what] = out
    _clean_up_minted(kubectl)
    assert accepted == {}, accepted
    assert kubectl("get", "deployment", "users-app", "-n", ns, "-o",
                   "jsonpath={.spec.template.spec.containers[0].image}") == "app:1"  # fmt: skip


def _clean_up_minted(kubectl: Kubectl) -> None:
    """A Secret the old chart let the token make in kube-system goes at once (the test fails)."""
    kubectl("delete", "secret", "minted", "demo-keys", "-n", "kube-system", "--ignore-not-found",
            check=False)  # fmt: skip


def _binding(namespace: str, name: str, kind: str, role: str) -> dict[str, Any]:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": fleet_meta(name, namespace),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": name}]}  # fmt: skip


def _deployment(namespace: str, account: str) -> dict[str, Any]:
    labels = {"cas.dev/name": "demo"}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": fleet_meta("demo-x", namespace),
            "spec": {"selector": {"matchLabels": labels}, "template": {
                "metadata": {"labels": labels},
                "spec": {"serviceAccountName": account,
                         "containers": [{"name": "c", "image": "attacker:1"}]}}}}  # fmt: skip


def test_of_a_users_httproute_only_the_canary_weights_may_change(
    leaked: Any, kubectl: Kubectl, namespace: str
) -> None:
    """`spec.gateway.httpRoute` names a user's HTTPRoute whose weights the operator sets
    (read, then written whole with its resourceVersion, as `reconcile.core.set_route_weights`
    does). With the token, that write goes through the admission policy; the same write
    changing another backend's weight, a backend's name or the hostnames is refused."""
    ns = namespace
    route = {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
             "metadata": {"name": "users-route", "namespace": ns},
             "spec": {"parentRefs": [{"name": "gw"}], "hostnames": ["app.example"], "rules": [
                 {"backendRefs": [{"name": "demo-stable", "port": 80, "weight": 100},
                                  {"name": "demo-canary", "port": 80, "weight": 0},
                                  {"name": "other", "port": 80, "weight": 5}]}]}}  # fmt: skip
    kubectl("create", "-f", "-", stdin=json.dumps(route))
    await_policy(kubectl, leaked, ns)
    url = f"/apis/gateway.networking.k8s.io/v1/namespaces/{ns}/httproutes/users-route"

    def put(change: Callable[[dict[str, Any]], None]) -> tuple[int, str]:
        current = json.loads(kubectl("get", "--raw", url))
        change(current)
        return leaked("replace", "--raw", url, "-f", "-", stdin=json.dumps(current))

    def refs(obj: dict[str, Any]) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = obj["spec"]["rules"][0]["backendRefs"]
        return found

    def canary(obj: dict[str, Any]) -> None:
        refs(obj)[0]["weight"], refs(obj)[1]["weight"] = 90, 10

    code, out = put(canary)
    assert code == 0, out
    assert [r["weight"] for r in refs(json.loads(kubectl("get", "--raw", url)))] == [90, 10, 5]
    refused = {
        "another backend's weight": lambda o: refs(o)[2].update(weight=50),
        "a backend's name": lambda o: refs(o)[1].update(name="evil"),
        "the hostnames": lambda o: o["spec"].update(hostnames=["evil.example"]),
        "a label": lambda o: o["metadata"].setdefault("labels", {}).update(x="y"),
    }
    accepted = {what: out for what, change in refused.items() if (out := put(change))[0] == 0}
    assert accepted == {}, accepted
