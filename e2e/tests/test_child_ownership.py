"""The operator never writes over, nor garbage-collects, an object under a child's name that
its resource does not control (issue 41, item 5), on the real API server: a user's Service
`demo` and ServiceAccount `demo-router` made before a resource `demo`.

The operator runs as a process under the namespaced chart's identity (a release of its own in
the test's namespace, removed afterwards), and the API server's audit log shows what it sent.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.runtime import chart
from e2e.runtime.operator_process import OperatorProcess
from tests.paths import load_sample

pytestmark = pytest.mark.e2e
Kubectl = Callable[..., str]


@pytest.fixture
def operator_here(
    cluster: Any, kubectl: Kubectl, namespace: str, crds: None, tmp_path: Path
) -> Iterator[tuple[OperatorProcess, chart.ChartIdentity]]:
    """An operator watching only `namespace`, under its own namespaced chart release."""
    with chart.namespaced_operator(kubectl, cluster.kubeconfig, namespace, tmp_path) as found:
        yield found


def wait_until(what: str, probe: Callable[[], Any], timeout: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def get(kubectl: Kubectl, *args: str) -> Any:
    out = kubectl("get", *args, "-o", "json", "--ignore-not-found", check=False)
    return json.loads(out) if out.strip() else None


def degraded(kubectl: Kubectl, namespace: str, name: str) -> dict[str, Any]:
    cas = get(kubectl, "cas", name, "-n", namespace) or {}
    found = [x for x in cas.get("status", {}).get("conditions", []) if x["type"] == "Degraded"]
    return dict(found[0]) if found else {}


def test_a_users_objects_under_child_names_are_neither_changed_nor_collected(
    operator_here: tuple[OperatorProcess, chart.ChartIdentity],
    cluster: Any,
    kubectl: Kubectl,
    namespace: str,
) -> None:
    """Regression (issue 41): the operator's forced server-side apply overwrote a user's
    Service `demo` and ServiceAccount `demo-router` with the children of a resource `demo`
    (selector, ports, labels), added its owner reference, and the garbage collector deleted
    both with the resource. Now the resource is Degraded naming both, the operator sends no
    write for either (audit log), the router's RoleBinding and pods do not hand out the user's
    account, the resource's other children are made, and deleting it leaves both as they were.
    """
    operator, identity = operator_here
    kubectl("create", "service", "clusterip", "demo", "--tcp=5432:5432", "-n", namespace)
    kubectl("create", "serviceaccount", "demo-router", "-n", namespace)
    users = (("service", "demo"), ("serviceaccount", "demo-router"))
    before = {kind: get(kubectl, kind, name, "-n", namespace) for kind, name in users}
    resource = load_sample("minimal.yaml")
    resource["metadata"]["name"] = "demo"
    kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(resource))

    def named_both() -> dict[str, Any]:
        found = degraded(kubectl, namespace, "demo")
        message = found.get("message", "")
        ok = "Service demo exists" in message and "ServiceAccount demo-router exists" in message
        return found if ok else {}

    found = wait_until("Degraded naming both objects", named_both)
    assert found["reason"] == "ChildNotOwned", found
    assert "RoleBinding demo-router not applied" in found["message"], found
    deployments = wait_until("the resource's engine Deployments", lambda: [
        d for d in (get(kubectl, "deploy", "-n", namespace, "-l", "cas.dev/name=demo") or {})
        .get("items", []) if d["metadata"]["labels"]["cas.dev/role"] != "router"])  # fmt: skip
    assert len(deployments) == 2, [d["metadata"]["name"] for d in deployments]
    assert get(kubectl, "rolebinding", "demo-router", "-n", namespace) is None
    for kind, obj in before.items():
        now = get(kubectl, kind, obj["metadata"]["name"], "-n", namespace)
        assert now["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"], (kind, now)

    writes = [e for e in chart.audit_events(cluster.audit_log, identity.username)
              if e.get("verb") in ("create", "update", "patch", "delete")
              and (e.get("objectRef", {}).get("resource"), e["objectRef"].get("name"))
              in (("services", "demo"), ("serviceaccounts", "demo-router"))]  # fmt: skip
    assert writes == [], [(e["verb"], e["objectRef"]) for e in writes]

    kubectl("delete", "cas", "demo", "-n", namespace, "--wait=true", timeout=60)
    children = ("deploy", "-n", namespace, "-l", "cas.dev/name=demo")
    wait_until("the resource's children collected",
               lambda: not (get(kubectl, *children) or {}).get("items"))  # fmt: skip
    for kind, obj in before.items():
        now = get(kubectl, kind, obj["metadata"]["name"], "-n", namespace)
        assert now is not None, f"{kind} {obj['metadata']['name']} was garbage-collected"
        assert now["metadata"]["uid"] == obj["metadata"]["uid"]
        assert now["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"], now
    refused = chart.refusals(chart.audit_events(cluster.audit_log, identity.username))
    assert refused.rbac == [] and refused.other == [], (refused, operator.log_tail(40))
