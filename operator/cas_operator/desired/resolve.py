"""Resolve once what every later planning step reads: the model's KV profile, LayerSplit and
the context-parallel strategy.

`build_plan` calls `resolve(spec)` once; validation, the LayerSplit layout, the planner's
recommendation and the engine's command line read the answer instead of looking the model
up (or re-deriving the LayerSplit default) again. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from cas_operator.api.models import CodingAgentServingSpec, TransferBackend
from cas_operator.desired.layersplit import ModelKvProfile, lookup_model

# SGLang 0.5.23's `--cp-strategy` (srt/arg_groups/fields/parallel.py:157-163: zigzag or
# interleave; parallel_hook.py:150-153 refuses `--enable-prefill-cp` without one).
CP_INTERLEAVE = "interleave"
CP_ZIGZAG = "zigzag"


@dataclass(frozen=True)
class Resolved:
    """The model's KV profile (None: unknown model without `model.numLayers`), whether the
    prefill pool runs LayerSplit, and its `--cp-strategy` (None without context parallelism)."""

    model: ModelKvProfile | None
    layer_split: bool
    cp_strategy: str | None = None

    @property
    def dsa(self) -> bool:
        return self.model is not None and self.model.dsa


def layer_split_enabled(spec: CodingAgentServingSpec, model: ModelKvProfile | None) -> bool:
    """An explicit `prefill.layerSplit` wins (validation refuses what SGLang would). Unset, it
    is on where SGLang can run it: cp > 1, a DSA model, the mooncake transfer backend."""
    pool = spec.prefill
    if pool.layer_split is not None:
        return pool.layer_split
    return (
        pool.context_parallel > 1
        and model is not None
        and model.dsa
        and spec.engine.transfer_backend == TransferBackend.MOONCAKE
    )


def cp_strategy(spec: CodingAgentServingSpec, model: ModelKvProfile | None) -> str | None:
    """DSA models: interleave, the only strategy that keeps `--attn-cp-size` (zigzag resets it
    to tp, arg_groups/model_overrides/deepseek_v2.py:126-134), that DeepSeek-V3.2 accepts
    (arg_groups/parallel_hook.py:122-131) and that LayerSplit accepts (model_hook.py:381-387).
    Other models: zigzag, the split MLA CP implements (layers/attention/flashattention_backend.py:
    1962 "q is rank-local zigzag-split"; deepseek_v2.py:190: no round-robin split for
    MLA) and the one MiMo V2 requires (parallel_hook.py:132-139)."""
    if spec.prefill.context_parallel <= 1:
        return None
    return CP_INTERLEAVE if model is not None and model.dsa else CP_ZIGZAG


def resolve(spec: CodingAgentServingSpec) -> Resolved:
    model = lookup_model(spec.model.name, spec.model.num_layers)
    return Resolved(
        model=model,
        layer_split=layer_split_enabled(spec, model),
        cp_strategy=cp_strategy(spec, model),
    )
