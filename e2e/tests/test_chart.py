"""The Helm chart against the local API server, with the pinned helm (``make bins``).

What the chart promises a platform team, each checked through the real component: it lints and
renders for the values people use (default, namespaced, HA, minimal) into objects the API
server accepts (server-side dry run); its schema refuses bad values naming the field; the CRD
upgrade path in NOTES.txt works; the operator run under the chart's own ServiceAccount token
(namespaced Roles, nothing cluster-scoped) reconciles a fleet with zero 401/403 answers in the
API server's audit log; the admission policy lets that identity change only labels and
annotations of the operator's own pods.

The operator-core suite runs its session operator under the chart's all-namespaces identity
(see ``test_operator_core.operator``); this module's operators watch one namespace only.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster.stack import ClusterHandle
from e2e.fleet.fleetview import cas_status, condition
from e2e.runtime import chart
from e2e.runtime.operator_process import OperatorProcess
from e2e.waits import pause, wait_for
from tests.paths import load_sample

pytestmark = pytest.mark.e2e
Kubectl = Callable[..., str]
READY_TIMEOUT_S = 120.0


def variants(watch: str) -> dict[str, dict[str, Any]]:
    """The values people install with (``watch``: a namespace that exists)."""
    return {
        "default": {},
        "namespaced": {"watchNamespaces": [watch]},
        "ha": {"replicas": 3, "prometheusUrl": "http://prometheus.monitoring:9090"},
        "minimal": {"admissionPolicy": {"enabled": False}, "resources": {}},
        "capped": {"maxGpusPerResource": 64},
        "dashboard": {"metrics": {"grafanaDashboard": {"enabled": True}}},
    }


def wait_until(what: str, probe: Callable[[], Any], timeout: float = READY_TIMEOUT_S) -> Any:
    return wait_for(what, probe, timeout)


def test_helm_lint_passes_for_every_values_variant(namespace: str) -> None:
    for name, values in variants(namespace).items():
        done = chart.helm("lint", "--strict", str(chart.CHART_DIR), *chart.set_flags(values))
        assert "0 chart(s) failed" in done.stdout, (name, done.stdout)


def test_every_rendered_object_passes_the_api_servers_dry_run(
    kubectl: Kubectl, namespace: str
) -> None:
    """Regression: templates that render but that the API server would refuse at install (a
    CEL expression that does not compile, a bad RBAC rule) pass `helm lint`; only the server
    knows. Each variant, CRDs included, goes through `kubectl apply --dry-run=server`."""
    for name, values in variants(namespace).items():
        objects = chart.template("cas-chart-dry", namespace, values, crds=True)
        kinds = {o["kind"] for o in objects}
        assert {"Deployment", "ServiceAccount", "CustomResourceDefinition"} <= kinds, name
        if name == "namespaced":
            assert "ClusterRole" not in kinds and "Role" in kinds, sorted(kinds)
        if name == "default":
            assert {"ClusterRole", "ValidatingAdmissionPolicy"} <= kinds, sorted(kinds)
            assert not [o for o in objects if o["metadata"]["name"].endswith("-dashboard")]
        if name == "dashboard":  # the file e2e/tests/test_dashboard.py queries, as Grafana loads it
            (board,) = [o for o in objects if o["metadata"]["name"] == "cas-chart-dry-dashboard"]
            assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
            shipped = (chart.CHART_DIR / "dashboards" / "cas-fleet.json").read_text()
            assert json.loads(board["data"]["cas-fleet.json"]) == json.loads(shipped)
        out = kubectl("apply", "--dry-run=server", "--server-side", "--force-conflicts",
                      "-f", "-", stdin=yaml.safe_dump_all(objects))  # fmt: skip
        assert out.count("(server dry run)") == len(objects), (name, out)


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"replicas": 0}, "/replicas"),
        ({"watchNamespaces": ["Not_A_Namespace"]}, "/watchNamespaces/0"),
        ({"replica": 2}, "replica"),  # a typo is refused, not ignored
        ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
        ({"prometheusUrl": "prometheus:9090"}, "/prometheusUrl"),
        ({"maxGpusPerResource": 0}, "/maxGpusPerResource"),
    ],
)
def test_the_values_schema_refuses_bad_values_naming_the_field(
    values: dict[str, Any], field: str
) -> None:
    done = chart.helm("template", "r", str(chart.CHART_DIR), *chart.set_flags(values), check=False)
    assert done.returncode != 0, done.stdout[:400]
    assert field in done.stderr, done.stderr


def test_the_gpu_cap_value_reaches_the_operator_as_the_limit_it_enforces(namespace: str) -> None:
    """Regression (issue 15): `OperatorLimits` said the chart's `maxGpusPerResource` sets the
    cap, but the chart had no such value. The rendered Deployment's variable is what
    `OperatorLimits.from_env` reads, and unset means no cap."""
    from cas_operator.api.limits import MAX_GPUS_ENV, OperatorLimits

    def operator_env(values: dict[str, Any]) -> dict[str, str]:
        objects = chart.template("cas-chart-cap", namespace, values)
        deployment = next(o for o in objects if o["kind"] == "Deployment")
        env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        return {e["name"]: e["value"] for e in env if "value" in e}

    capped = operator_env({"maxGpusPerResource": 64})
    assert capped[MAX_GPUS_ENV] == "64"
    assert OperatorLimits.from_env(capped).max_gpus_per_resource == 64
    assert OperatorLimits.from_env(operator_env({})).max_gpus_per_resource is None


def test_the_documented_crd_upgrade_path_applies_over_installed_crds(kubectl: Kubectl) -> None:
    """Helm never upgrades `crds/`; NOTES.txt says how to, and that command works on a cluster
    that has them already (field managers other than Helm's included)."""
    notes = (chart.CHART_DIR / "templates" / "NOTES.txt").read_text()
    assert "helm show crds" in notes and "--server-side --force-conflicts" in notes
    kubectl("apply", "--server-side", "-f", str(chart.CHART_DIR / "crds"))
    crds = chart.helm("show", "crds", str(chart.CHART_DIR)).stdout
    out = kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", stdin=crds)
    assert "codingagentservings.serving.cas.dev serverside-applied" in out, out


@pytest.fixture
def release_namespace(kubectl: Kubectl, namespace: str) -> Iterator[str]:
    """A second namespace for the chart's release (the operator's own), deleted afterwards."""
    name = f"{namespace[:50]}-ops"
    kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


def test_the_operator_under_the_namespaced_charts_identity_meets_no_refusal(
    cluster: ClusterHandle,
    kubectl: Kubectl,
    crds: None,
    namespace: str,
    release_namespace: str,
    tmp_path: Path,
) -> None:
    """Regression (issue 17): the chart granted a ClusterRole whatever `watchNamespaces` said,
    and kopf lists Namespaces and CRDs cluster-wide. With named namespaces the chart renders a
    Role per namespace and nothing cluster-scoped; the operator, given those namespaces, turns
    kopf's scanning off. Under that token a fleet comes up and scales, and the audit log holds
    its requests and not one 401/403."""
    identity = chart.install_identity(
        kubectl, cluster.kubeconfig, tmp_path / "kubeconfig", release="cas-chart-ns",
        namespace=release_namespace, values={"watchNamespaces": [namespace]},
    )  # fmt: skip
    operator = OperatorProcess(
        identity.kubeconfig, tmp_path / "operator.log",
        extra_args=("-n", namespace, "--leader-elect", "--leader-elect-namespace",
                    release_namespace, "--leader-elect-name", identity.release),
    )  # fmt: skip
    operator.start()
    try:
        manifest = load_sample("minimal.yaml")
        kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(manifest))
        wait_until("minimal Ready under the chart's token", lambda: _ready(kubectl, namespace))
        patch = json.dumps({"spec": {"decode": {"replicas": 2}}})
        kubectl("patch", "cas", "minimal", "-n", namespace, "--type=merge", "-p", patch)
        wait_until("two decode replicas ready", lambda: _decode_ready(kubectl, namespace) == 2)
    finally:
        operator.stop()
    events = chart.audit_events(cluster.audit_log, identity.username)
    verbs = {(e["verb"], e.get("objectRef", {}).get("resource")) for e in events}
    assert ("patch", "codingagentservings") in verbs and ("create", "leases") in verbs, verbs
    refused = chart.refusals(events)
    assert refused.rbac == [] and refused.other == [], (refused, operator.log_tail(40))


def _ready(kubectl: Kubectl, namespace: str) -> bool:
    return condition(cas_status(kubectl, namespace), "Ready").get("status") == "True"


def _decode_ready(kubectl: Kubectl, namespace: str) -> int:
    return int(cas_status(kubectl, namespace).get("decode", {}).get("readyReplicas") or 0)


def _pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "c", "image": "engine:1"}]},
    }


def test_the_admission_policy_lets_the_operator_change_only_labels_of_its_own_pods(
    cluster: ClusterHandle,
    kubectl: Kubectl,
    namespace: str,
    release_namespace: str,
    tmp_path: Path,
) -> None:
    """Regression (issue 17): RBAC's `patch pods` let the operator's token change any pod in
    the cluster, image included. The chart's ValidatingAdmissionPolicy allows that identity
    label/annotation changes and deletes of pods labelled managed-by=cas-operator, nothing
    else; the admin is untouched by it."""
    identity = chart.install_identity(
        kubectl, cluster.kubeconfig, tmp_path / "kubeconfig", release="cas-chart-vap",
        namespace=release_namespace,
    )  # fmt: skip
    own = _pod("own", {"app.kubernetes.io/managed-by": "cas-operator"})
    kubectl(
        "apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump_all([own, _pod("foreign", {})])
    )

    def as_operator(*args: str) -> str:
        done = chart.kubectl_as(identity, cluster.kubectl_path, "-n", namespace, *args)
        return done.stdout + done.stderr

    # The API server loads a new policy asynchronously: until then a label change goes
    # through, so each probe sets a new value (a repeated one would be a no-op, never refused).
    attempts = iter(range(10_000))
    refused = wait_until("the policy to refuse a foreign pod's label", lambda: (
        out if "cas-operator may change or delete only pods" in (
            out := as_operator("label", "--overwrite", "pod", "foreign",
                               f"probe={next(attempts)}")) else None
    ), timeout=30)  # fmt: skip
    assert "ValidatingAdmissionPolicy" in refused, refused
    labelled = as_operator("label", "pod", "own", "cas.dev/serving=false")
    assert "labeled" in labelled, labelled
    image = json.dumps({"spec": {"containers": [{"name": "c", "image": "attacker:1"}]}})
    swapped = as_operator("patch", "pod", "own", "--type=strategic", "-p", image)
    assert "only the labels and annotations" in swapped, swapped
    unmanaged = json.dumps({"metadata": {"labels": {"app.kubernetes.io/managed-by": None}}})
    assert "only the labels and annotations" in as_operator(
        "patch", "pod", "own", "--type=merge", "-p", unmanaged
    )
    assert "cas-operator may change or delete only" in as_operator(
        "delete", "pod", "foreign", "--wait=false"
    )
    assert "deleted" in as_operator("delete", "pod", "own", "--wait=false")
    kubectl("label", "pod", "foreign", "-n", namespace, "owner=admin")  # the admin is not bound


PREVIOUS_CHART = Path(__file__).parent / "fixtures" / "chart-0.1.0"


def _children(kubectl: Kubectl, namespace: str) -> dict[str, tuple[str, int]]:
    """``kind/name -> (uid, generation)`` of every child of `minimal`, by its label."""
    kinds = (
        "deployments,services,poddisruptionbudgets,configmaps,serviceaccounts,roles,rolebindings"
    )
    out = kubectl("get", kinds, "-n", namespace, "-l", "cas.dev/name=minimal", "-o", "json")
    return {
        f"{o['kind']}/{o['metadata']['name']}": (
            o["metadata"]["uid"], int(o["metadata"].get("generation", 0))
        )
        for o in json.loads(out)["items"]
    }  # fmt: skip


def test_helm_upgrade_from_the_previous_chart_keeps_the_fleet_ready_and_every_child(
    cluster: ClusterHandle,
    kubectl: Kubectl,
    crds: None,
    namespace: str,
    release_namespace: str,
    tmp_path: Path,
) -> None:
    """Regression guard (issue 17): a chart upgrade that changes an immutable field (the
    Deployment's selector), takes ownership of an object another field manager holds, or
    drops a verb the running operator uses breaks fleets in place. `helm install` of the
    previous chart (0.1.0), a fleet under its ServiceAccount, `helm upgrade` to this chart and
    the operator restarted, as the new pod would be: the fleet stays Ready, no child is
    recreated or re-templated, and nothing was refused after the upgrade.

    0.1.0 lacked `codingagentservings/finalizers`, so on an API server with
    OwnerReferencesPermissionEnforcement (this one) its operator could not create a child:
    the test shows that, then grants the verb as such a cluster's admin had to."""
    release, kc = "cas-up", str(cluster.kubeconfig)
    helm_args = ("--kubeconfig", kc, "-n", release_namespace)
    chart.helm("install", release, str(PREVIOUS_CHART), *helm_args, "--skip-crds")
    identity = chart.identity_of(
        kubectl, cluster.kubeconfig, tmp_path / "kubeconfig", release=release,
        namespace=release_namespace,
    )  # fmt: skip
    operator = OperatorProcess(identity.kubeconfig, tmp_path / "operator.log",
                               extra_args=("-n", namespace))  # fmt: skip
    grant = _finalizers_grant(release, release_namespace)
    try:
        operator.start()
        manifest = yaml.safe_dump(load_sample("minimal.yaml"))
        kubectl("apply", "-n", namespace, "-f", "-", stdin=manifest)
        wait_until("0.1.0's operator refused its children", lambda: "can't set finalizers"
                   in operator.log_tail(200), timeout=60)  # fmt: skip
        kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(grant))
        wait_until("minimal Ready under chart 0.1.0", lambda: _ready(kubectl, namespace))
        before = _children(kubectl, namespace)
        since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        upgraded = chart.helm("upgrade", release, str(chart.CHART_DIR), *helm_args)
        assert "has been upgraded" in upgraded.stdout, upgraded.stdout
        history = chart.helm("history", release, *helm_args).stdout
        current = yaml.safe_load((chart.CHART_DIR / "Chart.yaml").read_text())["version"]
        assert f"cas-operator-{current}" in history, history
        kubectl("delete", "-f", "-", stdin=yaml.safe_dump_all(grant))  # the current chart grants it
        operator.stop()
        operator.start()  # the upgraded Deployment's new pod
        pause(15, "its resume pass and a few fleet ticks")
        assert _ready(kubectl, namespace)
        assert _children(kubectl, namespace) == before  # same uid and generation each
    finally:
        operator.stop()
        chart.helm("uninstall", release, *helm_args, check=False)
    events = chart.audit_events(cluster.audit_log, identity.username)
    refused = chart.refusals(e for e in events if e["requestReceivedTimestamp"] >= since)
    assert refused.rbac == [] and refused.other == [], (refused, operator.log_tail(40))


def _finalizers_grant(release: str, namespace: str) -> list[dict[str, Any]]:
    """What a hardened cluster's admin had to add to chart 0.1.0's RBAC; and Secrets and
    NetworkPolicies: this code stands in for 0.1.0's operator before the upgrade, and unlike
    that one it makes each fleet's keys Secret and NetworkPolicies (0.1.0's code never touched
    them, its chart never granted them)."""
    name = f"{release}-finalizers"
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": [{"apiGroups": ["serving.cas.dev"], "verbs": ["update"],
                   "resources": ["codingagentservings/finalizers"]},
                  {"apiGroups": [""], "verbs": ["get", "create"], "resources": ["secrets"]},
                  {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"],
                   "verbs": ["get", "create", "patch", "delete"]}],
    }  # fmt: skip
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": release, "namespace": namespace}],
    }  # fmt: skip
    return [role, binding]
