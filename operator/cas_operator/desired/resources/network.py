"""The fleet's NetworkPolicies (ingress only), one for its engine pods and one for its routers.

Engine pods (`<name>-engines`) accept:
- every port from the fleet's own pods (`cas.dev/name`): the routers' requests, decode's
  registration at a prefill's bootstrap port, the KV transfers (mooncake picks its own ports),
  and an LWS group's rendezvous and NCCL traffic between its leader and workers;
- the engine port from the operator pod (its metrics scrape without Prometheus) and from the
  metrics scrapers (`security.networkPolicy.metricsFrom`; default: Prometheus pods, labelled
  `app.kubernetes.io/name=prometheus`, in any namespace). An engine's metrics are on its serving
  port, so a scraper could also call generation; the admin endpoints need the admin key.
Router pods (`<name>-router`) accept the serving port from clients (`clientsFrom`; default:
anyone) and from the operator (its deregistrations), and the metrics port from the scrapers.

The operator pod is matched by `app.kubernetes.io/name=cas-operator` in its own namespace
(`Plan.operator_namespace`; unknown: in any namespace). Egress is not restricted (engines load
weights, reach the bootstrap of other prefills). Kubelet probes come from the node, which
NetworkPolicy implementations admit.
"""

from __future__ import annotations

from typing import Any, Final

from cas_operator.api import constants as c
from cas_operator.api.models import NetworkPeer
from cas_operator.desired.plan import Plan
from cas_operator.desired.resources.meta import Manifest, Owner, base_labels, metadata

OPERATOR_APP: Final = "cas-operator"  # the chart's app.kubernetes.io/name of the operator pod
PROMETHEUS_APP: Final = "prometheus"  # the Prometheus Operator's label on Prometheus pods
ENGINES_SUFFIX: Final = "-engines"
ROUTER_SUFFIX: Final = "-router"


def network_policy_names(name: str) -> tuple[str, str]:
    return f"{name}{ENGINES_SUFFIX}", f"{name}{ROUTER_SUFFIX}"


def peer(p: NetworkPeer) -> dict[str, Any]:
    """A spec peer as a NetworkPolicyPeer."""
    if p.cidr is not None:
        return {"ipBlock": {"cidr": p.cidr}}
    out: dict[str, Any] = {}
    if p.pod_labels is not None:
        out["podSelector"] = _selector(p.pod_labels)
    if p.namespace_labels is not None:
        out["namespaceSelector"] = _selector(p.namespace_labels)
    return out


def _selector(labels: dict[str, str]) -> dict[str, Any]:
    """A label selector; no labels is `{}`, which selects everything."""
    return {"matchLabels": dict(labels)} if labels else {}


def operator_peer(plan: Plan) -> dict[str, Any]:
    namespaces: dict[str, Any] = {}
    if plan.operator_namespace:
        namespaces = {"matchLabels": {"kubernetes.io/metadata.name": plan.operator_namespace}}
    return {
        "podSelector": {"matchLabels": {c.LABEL_APP_NAME: OPERATOR_APP}},
        "namespaceSelector": namespaces,
    }


def scraper_peers(plan: Plan) -> list[dict[str, Any]]:
    chosen = plan.spec.security.network_policy.metrics_from
    if chosen is None:
        return [
            {
                "podSelector": {"matchLabels": {c.LABEL_APP_NAME: PROMETHEUS_APP}},
                "namespaceSelector": {},
            }
        ]
    return [peer(p) for p in chosen]


def _port(number: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": number}]


def _policy(owner: Owner, plan: Plan, name: str, app: str, ingress: list[Any]) -> Manifest:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(owner, name, base_labels(plan.name, app)),
        "spec": {
            "podSelector": {"matchLabels": {c.LABEL_NAME: plan.name, c.LABEL_APP_NAME: app}},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def build_engine_policy(owner: Owner, plan: Plan) -> Manifest:
    fleet = {"podSelector": {"matchLabels": {c.LABEL_NAME: plan.name}}}
    ingress = [
        {"from": [fleet]},
        {"from": [operator_peer(plan), *scraper_peers(plan)], "ports": _port(c.ENGINE_PORT)},
    ]
    name, _ = network_policy_names(plan.name)
    return _policy(owner, plan, name, c.APP_ENGINE, ingress)


def build_router_policy(owner: Owner, plan: Plan) -> Manifest:
    clients = plan.spec.security.network_policy.clients_from
    serving: dict[str, Any] = {"ports": _port(c.ROUTER_PORT)}
    if clients is not None:  # no `from`: every source
        serving["from"] = [operator_peer(plan), *(peer(p) for p in clients)]
    ingress = [
        serving,
        {"from": scraper_peers(plan), "ports": _port(c.ROUTER_METRICS_PORT)},
    ]
    _, name = network_policy_names(plan.name)
    return _policy(owner, plan, name, c.APP_ROUTER, ingress)


def build_network_policies(owner: Owner, plan: Plan) -> list[Manifest]:
    """Both policies, or none when `security.networkPolicy.enabled` is false."""
    if not plan.spec.security.network_policy.enabled:
        return []
    return [build_engine_policy(owner, plan), build_router_policy(owner, plan)]
