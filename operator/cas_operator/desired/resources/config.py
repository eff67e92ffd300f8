"""The ConfigMap that records the resolved plan, for humans and tools (`kubectl get cm`)."""

from __future__ import annotations

import json

from cas_operator.desired.plan import Plan
from cas_operator.desired.resources.meta import Manifest, Owner, base_labels, metadata


def plan_summary(plan: Plan) -> dict[str, object]:
    """The plan as plain data; also the source of the status' plan fields."""
    summary: dict[str, object] = {
        "revision": plan.revision,
        "ratio": plan.replicas.ratio,
        "ratioReason": plan.replicas.reason,
        "prefill": {
            "replicas": plan.prefill.replicas,
            "gpusPerInstance": plan.prefill.shape.gpus,
            "nodesPerInstance": plan.prefill.shape.nodes,
            "contextParallel": plan.prefill.shape.context_parallel,
        },
        "decode": {
            "replicas": plan.decode.replicas,
            "gpusPerInstance": plan.decode.shape.gpus,
            "nodesPerInstance": plan.decode.shape.nodes,
        },
        "gpus": plan.prefill.gpus + plan.decode.gpus,
    }
    if plan.layout is not None:
        summary["layerSplit"] = {
            "enabled": plan.layout.enabled,
            "numLayers": plan.layout.num_layers,
            "layersPerRank": [s.count for s in plan.layout.shards],
            "kvBytesPerTokenPerRank": (
                plan.layout.footprint.layer_split
                if plan.layout.enabled
                else plan.layout.footprint.replicated
            ),
            "kvBytesPerTokenPerRankReplicated": plan.layout.footprint.replicated,
            "kvBytesPerTokenPerRankLayerSplit": plan.layout.footprint.layer_split,
        }
    return summary


def build_plan_configmap(owner: Owner, plan: Plan) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(owner, f"{plan.name}-plan", base_labels(plan.name, "cas-plan")),
        "data": {"plan.json": json.dumps(plan_summary(plan), indent=2, sort_keys=True)},
    }
