"""The fleet's NetworkPolicies: what each admits, that every peer names its namespaces, that
they select exactly the fleet's engine and router pods, and that turning them off removes them
(the real API server validates and stores them in e2e/tests/test_security_operator.py;
e2e/tests/test_network_policy_enforced.py has a real NetworkPolicy implementation enforce
them on the local stack's pod network)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from cas_operator.api import constants as c
from cas_operator.api.limits import OperatorLimits
from cas_operator.api.models import parse_spec
from cas_operator.desired.build import plan_raw
from cas_operator.desired.plan import InvalidSpec
from cas_operator.desired.resources import build_all
from cas_operator.desired.resources.meta import Owner
from cas_operator.desired.resources.network import build_network_policies, check_scoped
from cas_operator.reconcile.core import reconcile
from tests.fakes import MemoryKube

SPEC: dict[str, Any] = {"model": {"name": "glm-5"}}
MULTINODE: dict[str, Any] = {"model": {"name": "glm-5"}, "decode": {"tensorParallel": 16}}


def children(
    spec: dict[str, Any],
    namespace: str | None = "cas-system",
    scrapers: tuple[str, ...] = ("monitoring",),
) -> list[dict[str, Any]]:
    limits = OperatorLimits(operator_namespace=namespace, scraper_namespaces=scrapers)
    plan = plan_raw("demo", "ns", spec, limits=limits)
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


def test_engines_admit_the_operator_and_the_named_scrapers_on_the_engine_port_only() -> None:
    ingress = policies(children(SPEC))["demo-engines"]["ingress"]
    assert len(ingress) == 2
    assert ingress[1]["ports"] == [{"protocol": "TCP", "port": c.ENGINE_PORT}]
    operator, prometheus = ingress[1]["from"]
    assert operator == {
        "podSelector": {"matchLabels": {c.LABEL_APP_NAME: "cas-operator"}},
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "cas-system"}},
    }
    assert prometheus == {
        "podSelector": {"matchLabels": {c.LABEL_APP_NAME: "prometheus"}},
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    }


def test_without_settings_no_peer_admits_every_namespace() -> None:
    """Regression (issue 41, item 2): the scraper peer was Prometheus pods in ANY namespace
    (`namespaceSelector: {}`), and without POD_NAMESPACE the operator peer too: any namespace
    reached every engine port by labelling a pod `app.kubernetes.io/name=prometheus`. With no
    operator namespace and no scraper namespace there is no such peer at all: the engines
    admit only the fleet, the routers' metrics port no one."""
    found = policies(children(SPEC, namespace=None, scrapers=()))
    assert found["demo-engines"]["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": {c.LABEL_NAME: "demo"}}}]}
    ]
    assert found["demo-router"]["ingress"] == [
        {"ports": [{"protocol": "TCP", "port": c.ROUTER_PORT}]}
    ]


def test_router_serves_anyone_by_default_and_only_the_named_clients_when_set() -> None:
    router = policies(children(SPEC))["demo-router"]["ingress"]
    assert router[0] == {"ports": [{"protocol": "TCP", "port": c.ROUTER_PORT}]}  # no `from`
    assert router[1]["ports"] == [{"protocol": "TCP", "port": c.ROUTER_METRICS_PORT}]
    vm_agent = {"podLabels": {"app": "vm-agent"}, "namespaceLabels": {"team": "obs"}}
    spec = {
        **SPEC,
        "security": {
            "networkPolicy": {
                "clientsFrom": [
                    {"namespaceLabels": {"team": "agents"}},
                    {"cidr": "10.20.0.0/16"},
                    {"podLabels": {"app": "ide"}, "namespaceLabels": {}},  # every namespace's
                ],
                "metricsFrom": [vm_agent],
            }
        },
    }
    found = policies(children(spec))
    serving = found["demo-router"]["ingress"][0]["from"]
    assert serving[0]["podSelector"]["matchLabels"] == {c.LABEL_APP_NAME: "cas-operator"}
    assert serving[1:] == [
        {"namespaceSelector": {"matchLabels": {"team": "agents"}}},
        {"ipBlock": {"cidr": "10.20.0.0/16"}},
        {"podSelector": {"matchLabels": {"app": "ide"}}, "namespaceSelector": {}},
    ]
    scraper = {"podSelector": {"matchLabels": {"app": "vm-agent"}},
               "namespaceSelector": {"matchLabels": {"team": "obs"}}}  # fmt: skip
    assert found["demo-router"]["ingress"][1]["from"] == [scraper]
    assert found["demo-engines"]["ingress"][1]["from"][1:] == [scraper]


@pytest.mark.parametrize(
    ("peer", "field"),
    [
        ({"podLabels": {"app": "prometheus"}, "namespaceLabels": {}}, "[0].namespaceLabels"),
        ({"cidr": "0.0.0.0/0"}, "[0].cidr"),
    ],
)
def test_a_metrics_peer_that_names_no_namespace_is_refused(
    peer: dict[str, Any], field: str
) -> None:
    """Issue 41, item 2: `metricsFrom` may not open the engine port to every namespace or
    every address (the CRD's CEL rule refuses it at apply; this is the operator's check)."""
    spec = {**SPEC, "security": {"networkPolicy": {"metricsFrom": [peer]}}}
    with pytest.raises(InvalidSpec) as err:
        plan_raw("demo", "ns", spec)
    assert f"security.networkPolicy.metricsFrom{field}" in str(err.value)


def test_the_builder_refuses_to_render_an_open_peer() -> None:
    """The last line (pure): a rendered policy with a peer selecting every namespace or
    address, or a rule without `from`, is refused; the router's serving port may be open."""
    policy = {
        "metadata": {"name": "demo-engines"},
        "spec": {"ingress": [
            {"from": [{"podSelector": {"matchLabels": {"a": "b"}}}]},
            {"from": [{"podSelector": {}, "namespaceSelector": {}}], "ports": [{"port": 30000}]},
            {"from": [{"ipBlock": {"cidr": "::/0"}}], "ports": [{"port": 29000}]},
            {"ports": [{"port": 8000}]},
        ]},
    }  # fmt: skip
    assert check_scoped(policy) == [
        "demo-engines: ingress[1].from[0]: namespaceSelector {} selects every namespace",
        "demo-engines: ingress[2].from[0]: ipBlock ::/0 is every address",
        "demo-engines: ingress[3] admits every source",
    ]
    assert len(check_scoped(policy, frozenset({8000}))) == 2
    plan = plan_raw("demo", "ns", SPEC)
    spec = {**SPEC, "security": {"networkPolicy": {"metricsFrom": [{"namespaceLabels": {}}]}}}
    unchecked = replace(plan, spec=parse_spec(spec))  # past the spec's validation
    with pytest.raises(InvalidSpec, match="selects every namespace"):
        build_network_policies(Owner("demo", "ns", "uid"), unchecked)


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
