"""Resolve once what every later planning step reads: the model's KV profile and LayerSplit.

`build_plan` calls `resolve(spec)` once; validation, the LayerSplit layout, the planner's
recommendation and the engine's command line read the answer instead of looking the model
up (or re-deriving the LayerSplit default) again. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from cas_operator.api.models import CodingAgentServingSpec, PrefillPoolSpec
from cas_operator.desired.layersplit import ModelKvProfile, lookup_model


@dataclass(frozen=True)
class Resolved:
    """The model's KV profile (None: unknown model without `model.numLayers`) and whether the
    prefill pool runs LayerSplit."""

    model: ModelKvProfile | None
    layer_split: bool


def layer_split_enabled(pool: PrefillPoolSpec) -> bool:
    """LayerSplit defaults to on when the prefill pool uses context parallelism."""
    if pool.layer_split is None:
        return pool.context_parallel > 1
    return pool.layer_split


def resolve(spec: CodingAgentServingSpec) -> Resolved:
    return Resolved(
        model=lookup_model(spec.model.name, spec.model.num_layers),
        layer_split=layer_split_enabled(spec.prefill),
    )
