"""The fleet's NetworkPolicies (ingress only), one for its engine pods and one for its routers.

Engine pods (`<name>-engines`) accept:
- every port from the fleet's own pods (`cas.dev/name`): the routers' requests, decode's
  registration at a prefill's bootstrap port, the KV transfers (mooncake picks its own ports),
  and an LWS group's rendezvous and NCCL traffic between its leader and workers;
- the engine port from the operator pod (its metrics scrape without Prometheus) and from the
  metrics scrapers (`security.networkPolicy.metricsFrom`; default: Prometheus pods, labelled
  `app.kubernetes.io/name=prometheus`, in the operator's metrics-scraper namespaces,
  `Plan.scraper_namespaces`; none set: no scraper). An engine's metrics are on its serving
  port, so a scraper could also call generation; the admin endpoints need the admin key.
Router pods (`<name>-router`) accept the serving port from clients (`clientsFrom`; default:
anyone) and from the operator (its deregistrations), and the metrics port from the scrapers.

The operator pod is matched by `app.kubernetes.io/name=cas-operator` in its own namespace
(`Plan.operator_namespace`); unknown (the operator runs outside a pod), no operator peer.
Every peer names its namespaces: `check_scoped` refuses a rendered policy with a peer that
selects every namespace or every address (or a rule without `from`, every source), but on the
router's serving port, which is open to every client unless `clientsFrom` says otherwise.
Egress is not restricted (engines load weights, reach the bootstrap of other prefills).
Kubelet probes come from the node, which NetworkPolicy implementations admit.
"""

from __future__ import annotations

from typing import Any, Final

from cas_operator.api import constants as c
from cas_operator.api.models import NetworkPeer
from cas_operator.desired.plan import InvalidSpec, Plan
from cas_operator.desired.resources.meta import Manifest, Owner, base_labels, metadata
from cas_operator.desired.validate import SpecError

OPERATOR_APP: Final = "cas-operator"  # the chart's app.kubernetes.io/name of the operator pod
PROMETHEUS_APP: Final = "prometheus"  # the Prometheus Operator's label on Prometheus pods
NAMESPACE_NAME_LABEL: Final = "kubernetes.io/metadata.name"  # set by the API server, immutable
SELECTOR_KEYS: Final = ("matchLabels", "matchExpressions")
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


def namespace_named(name: str) -> dict[str, Any]:
    """The namespaceSelector of exactly namespace `name` (its immutable name label)."""
    return {"matchLabels": {NAMESPACE_NAME_LABEL: name}}


def operator_peers(plan: Plan) -> list[dict[str, Any]]:
    """The operator pod in its namespace; none when that is not known."""
    if not plan.operator_namespace:
        return []
    return [
        {
            "podSelector": {"matchLabels": {c.LABEL_APP_NAME: OPERATOR_APP}},
            "namespaceSelector": namespace_named(plan.operator_namespace),
        }
    ]


def scraper_peers(plan: Plan) -> list[dict[str, Any]]:
    """`metricsFrom`, else Prometheus pods of each of the operator's scraper namespaces."""
    chosen = plan.spec.security.network_policy.metrics_from
    if chosen is not None:
        return [peer(p) for p in chosen]
    return [
        {
            "podSelector": {"matchLabels": {c.LABEL_APP_NAME: PROMETHEUS_APP}},
            "namespaceSelector": namespace_named(namespace),
        }
        for namespace in plan.scraper_namespaces
    ]


def open_peer(found: dict[str, Any]) -> str | None:
    """Why a NetworkPolicyPeer admits every namespace or every address; None: it is scoped
    (a podSelector alone is the policy's own namespace)."""
    namespaces = found.get("namespaceSelector")
    if namespaces is not None and not any(namespaces.get(k) for k in SELECTOR_KEYS):
        return "namespaceSelector {} selects every namespace"
    cidr = str((found.get("ipBlock") or {}).get("cidr", ""))
    if cidr.endswith("/0"):
        return f"ipBlock {cidr} is every address"
    return None


def check_scoped(policy: Manifest, open_ports: frozenset[int] = frozenset()) -> list[str]:
    """What admits more than named namespaces in a rendered policy (pure): a rule without
    `from` (every source) or an open peer, on any port but `open_ports`."""
    problems = []
    for i, rule in enumerate(policy["spec"].get("ingress") or []):
        ports = frozenset(int(p["port"]) for p in rule.get("ports") or [])
        if ports and ports <= open_ports:
            continue
        where = f"{policy['metadata']['name']}: ingress[{i}]"
        if not rule.get("from"):
            problems.append(f"{where} admits every source")
        for j, found in enumerate(rule.get("from") or []):
            why = open_peer(found)
            if why is not None:
                problems.append(f"{where}.from[{j}]: {why}")
    return problems


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
    ingress: list[dict[str, Any]] = [{"from": [fleet]}]
    metrics = [*operator_peers(plan), *scraper_peers(plan)]
    if metrics:  # an empty `from` would admit every source
        ingress.append({"from": metrics, "ports": _port(c.ENGINE_PORT)})
    name, _ = network_policy_names(plan.name)
    return _policy(owner, plan, name, c.APP_ENGINE, ingress)


def build_router_policy(owner: Owner, plan: Plan) -> Manifest:
    clients = plan.spec.security.network_policy.clients_from
    serving: dict[str, Any] = {"ports": _port(c.ROUTER_PORT)}
    if clients is not None:  # no `from`: every source
        serving["from"] = [*operator_peers(plan), *(peer(p) for p in clients)]
    ingress = [serving]
    scrapers = scraper_peers(plan)
    if scrapers:  # none: the metrics port admits no one
        ingress.append({"from": scrapers, "ports": _port(c.ROUTER_METRICS_PORT)})
    _, name = network_policy_names(plan.name)
    return _policy(owner, plan, name, c.APP_ROUTER, ingress)


def build_network_policies(owner: Owner, plan: Plan) -> list[Manifest]:
    """Both policies, or none when `security.networkPolicy.enabled` is false. Raises
    InvalidSpec when one would admit more than named namespaces (`check_scoped`; the spec's
    validation refuses such peers first, so this is the last line)."""
    if not plan.spec.security.network_policy.enabled:
        return []
    policies = [build_engine_policy(owner, plan), build_router_policy(owner, plan)]
    clients = frozenset({c.ROUTER_PORT})  # the serving port: open to clients by design
    problems = check_scoped(policies[0]) + check_scoped(policies[1], clients)
    if problems:
        raise InvalidSpec([SpecError("security.networkPolicy", p) for p in problems])
    return policies
