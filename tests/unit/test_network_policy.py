"""The fleet's NetworkPolicies: what each admits, that they select exactly the fleet's engine
and router pods, and that turning them off removes them (the real API server validates and
stores them in e2e/tests/test_security_operator.py; no local CNI enforces them)."""

from __future__ import annotations

from typing import Any

import pytest

from cas_operator.api import constants as c
from cas_operator.api.limits import OperatorLimits
from cas_operator.desired.build import plan_raw
from cas_operator.desired.plan import InvalidSpec
from cas_operator.desired.resources import build_all
from cas_operator.desired.resources.meta import Owner
from cas_operator.reconcile.core import reconcile
from tests.fakes import MemoryKube

SPEC: dict[str, Any] = {"model": {"name": "glm-5"}}
MULTINODE: dict[str, Any] = {"model": {"name": "glm-5"}, "decode": {"tensorParallel": 16}}


def children(spec: dict[str, Any], namespace: str | None = "cas-system") -> list[dict[str, Any]]:
    plan = plan_raw("demo", "ns", spec, limits=OperatorLimits(operator_namespace=namespace))
    return build_all(Owner("demo", "ns", "uid"), plan)


def policies(manifests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {m["metadata"]["name"]: m["spec"] for m in manifests if m["kind"] == "NetworkPolicy"}


def pod_labels(manifests: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Labels of every pod template (Deployments, and LWS leader and worker templates)."""
    found = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "containers" in node.get("spec", {}) and "labels" in node.get("metadata", {}):
                found.append(node["metadata"]["labels"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for m in manifests:
        if m["kind"] in ("Deployment", "LeaderWorkerSet"):
            walk(m["spec"])
    return found


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


@pytest.mark.parametrize("spec", [SPEC, MULTINODE], ids=["deployments", "leaderworkerset"])
def test_each_policy_selects_exactly_its_pods(spec: dict[str, Any]) -> None:
    """Regression guard: a pod label the policy selector does not carry leaves the pods it
    should protect open, silently; a selector that also matched the routers would cut
    clients off the serving port."""
    manifests = children(spec)
    found = policies(manifests)
    engines, router = found["demo-engines"]["podSelector"], found["demo-router"]["podSelector"]
    templates = pod_labels(manifests)
    assert len(templates) >= 3
    for labels in templates:
        is_router = labels[c.LABEL_ROLE] == c.ROLE_ROUTER
        assert selects(engines, labels) is not is_router, labels
        assert selects(router, labels) is is_router, labels
        # every fleet pod is a peer of the engines (KV, bootstrap, LWS rendezvous)
        fleet = found["demo-engines"]["ingress"][0]["from"][0]["podSelector"]
        assert selects(fleet, labels) and "ports" not in found["demo-engines"]["ingress"][0]


def test_engines_admit_the_operator_and_prometheus_on_the_engine_port_only() -> None:
    ingress = policies(children(SPEC))["demo-engines"]["ingress"]
    assert len(ingress) == 2
    assert ingress[1]["ports"] == [{"protocol": "TCP", "port": c.ENGINE_PORT}]
    operator, prometheus = ingress[1]["from"]
    assert operator == {
        "podSelector": {"matchLabels": {c.LABEL_APP_NAME: "cas-operator"}},
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "cas-system"}},
    }
    assert prometheus["podSelector"] == {"matchLabels": {c.LABEL_APP_NAME: "prometheus"}}
    assert prometheus["namespaceSelector"] == {}
    # an operator outside a pod (no POD_NAMESPACE): its label in any namespace
    unknown = policies(children(SPEC, namespace=None))["demo-engines"]["ingress"][1]["from"][0]
    assert unknown["namespaceSelector"] == {}


def test_router_serves_anyone_by_default_and_only_the_named_clients_when_set() -> None:
    router = policies(children(SPEC))["demo-router"]["ingress"]
    assert router[0] == {"ports": [{"protocol": "TCP", "port": c.ROUTER_PORT}]}  # no `from`
    assert router[1]["ports"] == [{"protocol": "TCP", "port": c.ROUTER_METRICS_PORT}]
    spec = {
        **SPEC,
        "security": {
            "networkPolicy": {
                "clientsFrom": [
                    {"namespaceLabels": {"team": "agents"}},
                    {"cidr": "10.20.0.0/16"},
                ],
                "metricsFrom": [{"podLabels": {"app": "vm-agent"}, "namespaceLabels": {}}],
            }
        },
    }
    found = policies(children(spec))
    serving = found["demo-router"]["ingress"][0]["from"]
    assert serving[0]["podSelector"]["matchLabels"] == {c.LABEL_APP_NAME: "cas-operator"}
    assert serving[1:] == [
        {"namespaceSelector": {"matchLabels": {"team": "agents"}}},
        {"ipBlock": {"cidr": "10.20.0.0/16"}},
    ]
    scraper = {"podSelector": {"matchLabels": {"app": "vm-agent"}}, "namespaceSelector": {}}
    assert found["demo-router"]["ingress"][1]["from"] == [scraper]
    assert found["demo-engines"]["ingress"][1]["from"][1:] == [scraper]


@pytest.mark.parametrize(
    ("peer", "field"),
    [
        ({}, "clientsFrom[0]"),
        ({"cidr": "10.0.0.0/8", "podLabels": {"a": "b"}}, "clientsFrom[0]"),
        ({"cidr": "10.0.0.0/33"}, "clientsFrom[0].cidr"),
    ],
)
def test_a_bad_peer_is_refused_naming_it(peer: dict[str, Any], field: str) -> None:
    spec = {**SPEC, "security": {"networkPolicy": {"clientsFrom": [peer]}}}
    with pytest.raises(InvalidSpec) as err:
        plan_raw("demo", "ns", spec)
    assert f"security.networkPolicy.{field}" in str(err.value)


def test_turned_off_there_are_none_and_a_full_pass_removes_the_operators() -> None:
    kube = MemoryKube()
    run = {"name": "demo", "namespace": "ns", "uid": "uid-np", "generation": 1}
    reconcile(kube, raw_spec=SPEC, full_apply=True, **run)  # type: ignore[arg-type]
    assert ("NetworkPolicy", "demo-engines") in kube.objects
    off = {**SPEC, "security": {"networkPolicy": {"enabled": False}}}
    assert policies(children(off)) == {}
    reconcile(kube, raw_spec=off, full_apply=True, **run)  # type: ignore[arg-type]
    assert ("NetworkPolicy", "demo-engines") not in kube.objects
    assert ("NetworkPolicy", "demo-router") not in kube.objects
