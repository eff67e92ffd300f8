"""Every child of one CodingAgentServing, in the order they are applied."""

from __future__ import annotations

from cas_operator.desired.plan import Plan
from cas_operator.desired.resources.config import build_plan_configmap
from cas_operator.desired.resources.meta import Manifest, Owner, with_spec_hash
from cas_operator.desired.resources.network import build_network_policies
from cas_operator.desired.resources.pools import build_pdb, build_pool_service, build_workload
from cas_operator.desired.resources.router import (
    build_role,
    build_role_binding,
    build_router_deployment,
    build_router_pdb,
    build_router_service,
    build_service_account,
)


def build_all(owner: Owner, plan: Plan) -> list[Manifest]:
    """Identity, config and NetworkPolicies, then Services and PDBs (the router's too), then
    pools, then the router last."""
    manifests = [
        build_service_account(owner, plan),
        build_role(owner, plan),
        build_role_binding(owner, plan),
        build_plan_configmap(owner, plan),
        *build_network_policies(owner, plan),
    ]
    for pool in plan.pools:
        manifests += [build_pool_service(owner, plan, pool), build_pdb(owner, plan, pool)]
    manifests += [build_workload(owner, plan, pool) for pool in plan.pools]
    manifests.append(build_router_pdb(owner, plan))
    manifests += [build_router_deployment(owner, plan), build_router_service(owner, plan)]
    return [with_spec_hash(m) for m in manifests]
