"""Adapter from a CodingAgentServing spec to the P:D ratio planner (`ratio.recommend`).

Data flow: spec.workload / slo / ratio + the pools' instance shapes -> planner inputs with the
packaged instance profile of the model (GLM-5 or DeepSeek-V3 on H200) -> `RatioRecommendation`
-> instance counts in the resource's own shapes (the planner sizes GPUs per role; its profile
instances may be shaped differently, so counts are converted through GPUs and rounded up).

Pure and cached: the same spec gives the same answer, computed once per process (the search
takes up to a second). Observed signals are not fed in yet (see the issue notes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from cas_operator.api.models import CodingAgentServingSpec, RatioMode
from cas_operator.planning.profiles import decode_profile, load_spec, prefill_profile
from cas_operator.planning.ratio import Bounds, SloInputs, WorkloadInputs, recommend
from cas_operator.planning.shapes import InstanceShape
from cas_operator.planning.validate import layer_split_enabled

PROFILE_BY_MODEL = (("glm-5", "glm5-fp8-h200"), ("deepseek-v3", "deepseek-v3-bf16kv-h200"))


@dataclass(frozen=True)
class Recommendation:
    """The planner's answer in the resource's terms, or why there is none."""

    prefill: int | None
    decode: int | None
    reason: str
    ttft_p90_seconds: float | None = None
    itl_milliseconds: float | None = None
    hit_rate: float | None = None
    meets_slo: bool | None = None

    @property
    def ratio(self) -> str | None:
        if self.prefill is None or self.decode is None:
            return None
        return f"{self.prefill}:{self.decode}"


def profile_for(model_name: str) -> str | None:
    key = model_name.rsplit("/", 1)[-1].lower()
    for prefix, profile in PROFILE_BY_MODEL:
        if key.startswith(prefix):
            return profile
    return None


def recommendation_for(
    spec: CodingAgentServingSpec, prefill: InstanceShape, decode: InstanceShape
) -> Recommendation | None:
    """None in Fixed mode; otherwise the planner's counts (or the reason it has none)."""
    if spec.ratio.mode == RatioMode.FIXED:
        return None
    if spec.workload.request_rate is None:
        return Recommendation(None, None, "set workload.requestRate to get a recommendation")
    profile = profile_for(spec.model.name)
    if profile is None:
        return Recommendation(None, None, f"no instance profile for model {spec.model.name!r}")
    workload = WorkloadInputs(
        request_rate=spec.workload.request_rate,
        avg_input_tokens=spec.workload.avg_input_tokens,
        avg_output_tokens=spec.workload.avg_output_tokens,
        prefix_cache_hit_rate=spec.workload.prefix_cache_hit_rate,
    )
    slo = SloInputs(ttft_s=spec.slo.ttft_seconds, itl_ms=spec.slo.itl_milliseconds)
    return _recommend(
        profile,
        workload,
        slo,
        Bounds(gpu_budget=spec.ratio.gpu_budget),
        prefill.context_parallel,
        layer_split_enabled(spec.prefill),
        (prefill.gpus, decode.gpus),
    )


@lru_cache(maxsize=256)
def _recommend(
    profile: str,
    workload: WorkloadInputs,
    slo: SloInputs,
    bounds: Bounds,
    cp: int,
    layer_split: bool,
    instance_gpus: tuple[int, int],
) -> Recommendation:
    """The planner's search (up to a second), cached on its frozen inputs."""
    spec = load_spec(profile)
    prefill_instance = prefill_profile(spec, cp=cp, layer_split=layer_split)
    decode_instance = decode_profile(spec)
    result = recommend(workload, slo, prefill_instance, decode_instance, bounds)
    prefill_gpus, decode_gpus = instance_gpus
    return Recommendation(
        prefill=max(1, math.ceil(result.n_prefill * prefill_instance.gpus / prefill_gpus)),
        decode=max(1, math.ceil(result.n_decode * decode_instance.gpus / decode_gpus)),
        reason=result.reason,
        ttft_p90_seconds=round(result.ttft_p90_s, 3),
        itl_milliseconds=round(result.itl_ms, 2),
        hit_rate=round(result.hit_rate, 4),
        meets_slo=result.meets_slo,
    )
