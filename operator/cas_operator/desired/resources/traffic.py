"""The objects a Gateway splits a fleet's traffic with (`spec.gateway`): the Services
`<name>-stable` and `<name>-canary`, each selecting one revision's routers, and either the
HTTPRoute `<name>` (owned, attached to `gateway.parentRefs`) whose two backendRefs carry the
weights, or the weights set on the user's own HTTPRoute (`gateway.httpRoute`,
`route_weights`: only the `weight` of its backendRefs to those two Services changes)."""

from __future__ import annotations

import copy
from typing import Any

from cas_operator.api import constants as c
from cas_operator.desired.plan import Plan
from cas_operator.desired.resources.meta import Manifest, Owner, base_labels, metadata
from cas_operator.desired.traffic import Split

GATEWAY_API_VERSION = "gateway.networking.k8s.io/v1"
ROUTE_PORT = 80


def track_service_name(name: str, track: str) -> str:
    """`<name>-stable` / `<name>-canary`."""
    return f"{name}-{track}"


def build_track_service(owner: Owner, plan: Plan, track: str, revision: str) -> Manifest:
    """A Service over one revision's routers, for the Gateway's backendRefs."""
    labels = base_labels(plan.name, c.APP_ROUTER, c.ROLE_ROUTER)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner, track_service_name(plan.name, track), labels),
        "spec": {
            "selector": {
                c.LABEL_NAME: plan.name,
                c.LABEL_ROLE: c.ROLE_ROUTER,
                c.LABEL_REVISION: revision,
            },
            "ports": [{"name": "http", "port": ROUTE_PORT, "targetPort": "http"}],
        },
    }


def backend_refs(name: str, canary_weight: int) -> list[dict[str, Any]]:
    return [
        {"name": track_service_name(name, "stable"), "port": ROUTE_PORT,
         "weight": 100 - canary_weight},
        {"name": track_service_name(name, "canary"), "port": ROUTE_PORT,
         "weight": canary_weight},
    ]  # fmt: skip


def build_http_route(owner: Owner, plan: Plan, canary_weight: int) -> Manifest:
    """The fleet's HTTPRoute on the named Gateways: every request to the two Services by
    weight (the canary's share is `canary_weight`)."""
    gateway = plan.spec.gateway
    assert gateway is not None and gateway.parent_refs
    spec: dict[str, Any] = {
        "parentRefs": [
            ref.model_dump(by_alias=True, exclude_none=True) for ref in gateway.parent_refs
        ],
        "rules": [{"backendRefs": backend_refs(plan.name, canary_weight)}],
    }
    if gateway.hostnames:
        spec["hostnames"] = list(gateway.hostnames)
    labels = base_labels(plan.name, c.APP_ROUTER, c.ROLE_ROUTER)
    return {
        "apiVersion": GATEWAY_API_VERSION,
        "kind": "HTTPRoute",
        "metadata": metadata(owner, plan.name, labels),
        "spec": spec,
    }


def build_traffic(owner: Owner, plan: Plan, split: Split) -> list[Manifest]:
    """The Services and (when the operator owns it) the HTTPRoute for `split`; nothing
    without `spec.gateway`."""
    gateway = plan.spec.gateway
    if gateway is None:
        return []
    canary = split.canary if split.canary is not None and split.build_current else split.stable
    weight = split.route_weight
    out = [
        build_track_service(owner, plan, "stable", split.stable),
        build_track_service(owner, plan, "canary", canary),
    ]
    if gateway.parent_refs:
        out.append(build_http_route(owner, plan, weight))
    return out


def route_weights(route: Manifest, name: str, canary_weight: int) -> Manifest | None:
    """The user's HTTPRoute with the weights of its backendRefs to `<name>-stable` and
    `<name>-canary` set (every other field as it was); None when it already has them. Raises
    ValueError when no rule refers to both Services (the route must name them)."""
    wanted = {
        track_service_name(name, "stable"): 100 - canary_weight,
        track_service_name(name, "canary"): canary_weight,
    }
    patched = copy.deepcopy(route)
    found = False
    for rule in patched.get("spec", {}).get("rules") or []:
        refs = rule.get("backendRefs") or []
        named = {ref.get("name") for ref in refs if ref.get("kind", "Service") == "Service"}
        if not set(wanted) <= named:
            continue
        found = True
        for ref in refs:
            if ref.get("name") in wanted and ref.get("kind", "Service") == "Service":
                ref["weight"] = wanted[ref["name"]]
    if not found:
        raise ValueError(
            f"HTTPRoute {route.get('metadata', {}).get('name')} has no rule with backendRefs "
            f"to both {' and '.join(sorted(wanted))}"
        )
    return None if patched == route else patched
