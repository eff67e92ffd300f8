"""Adapter from a CodingAgentServing spec to the P:D ratio planner (`autoscale.search.recommend`).

Data flow: spec.workload / slo / ratio + the pools' instance shapes -> planner inputs with the
packaged instance profile of the model (GLM-5 or DeepSeek-V3 on H200) -> `RatioRecommendation`
-> instance counts in the resource's own shapes. The profiles are built in the resource's own
shapes (prefill: tensorParallel GPUs with contextParallel inside TP; decode: its GPUs with DP
attention), so counts map 1:1; only a shape the profile cannot express (contextParallel not
dividing tensorParallel) is planned in the profile's default shape and converted through GPU
totals, rounded up.

For DSA models (the ones SGLang runs LayerSplit for) it also compares the valid prefill shapes
(`contextParallel` dividing `tensorParallel`, with and without LayerSplit) for the declared
workload and names the cheapest (`ShapeAdvice`): changing the shape is a new revision, so it is
only ever advice, never applied by Auto.

Pure and cached: the same spec gives the same answer, computed once per process (the search
takes up to a second). The fleet tick's measured load (`observed`) replaces or rescales
the spec's estimates: the measured rate with headroom when above the declared one, the demand
held while the routers refuse (`planned_rate`), the measured request shape (held within a band
by the autoscale loop) in place of the declared lengths (`planner_workload`), the hit rate and
decode KV use rescaling the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from cas_operator.api.models import (
    MAX_DSA_CP_TENSOR_PARALLEL,
    CodingAgentServingSpec,
    RatioMode,
    WorkloadSpec,
)
from cas_operator.autoscale.model import (
    Bounds,
    InstanceProfile,
    ObservedSignals,
    SloInputs,
    WorkloadInputs,
)
from cas_operator.autoscale.profiles import ProfileSpec, decode_profile, load_spec, prefill_profile
from cas_operator.autoscale.reuse import request_mix
from cas_operator.autoscale.search import recommend
from cas_operator.autoscale.signals import shape_of, sized_rate
from cas_operator.desired.resolve import Resolved, resolve
from cas_operator.desired.shapes import InstanceShape

# Measured rates are planned with 10% to spare: on the planner benchmark, without it, the
# long-tool-pauses scenario fell from 18.0 to 14.7 req/s (seeds 1-3, median;
# docs/results/2026-12-06-planner-history.md).
PLAN_HEADROOM = 1.1

PROFILE_BY_MODEL = (("glm-5", "glm5-fp8-h200"), ("deepseek-v3", "deepseek-v3-bf16kv-h200"))


@dataclass(frozen=True)
class ShapePlan:
    """The planner's plan for one prefill shape: instances, GPUs of both pools, TTFT p90."""

    context_parallel: int
    layer_split: bool
    prefill: int
    decode: int
    gpus: int
    ttft_p90_seconds: float
    meets_slo: bool
    goodput_rps: float

    def better_than(self, other: ShapePlan) -> bool:
        """Worth a new revision: meets the SLOs when `other` does not, or both meet and this
        needs fewer GPUs, or neither meets and this serves 5% more within the SLOs."""
        if self.meets_slo != other.meets_slo:
            return self.meets_slo
        if self.meets_slo:
            return self.gpus < other.gpus
        return self.goodput_rps >= 1.05 * other.goodput_rps


@dataclass(frozen=True)
class ShapeAdvice:
    """The running prefill shape's plan next to the cheapest valid one (equal when it is)."""

    current: ShapePlan
    recommended: ShapePlan
    reason: str


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
    shape: ShapeAdvice | None = None
    hit_rate_curve: str | None = None  # which hit-rate curve gave `hit_rate` (`curve_name`)

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
    spec: CodingAgentServingSpec,
    prefill: InstanceShape,
    decode: InstanceShape,
    observed: ObservedSignals | None = None,
    resolved: Resolved | None = None,
) -> Recommendation | None:
    """None in Fixed mode; otherwise the planner's counts (or the reason it has none).
    `resolved` is `resolve(spec)` when the caller has it already.

    `observed` (the Auto loop's measured fleet signals, quantised by the caller so the cache
    hits in steady state) replaces or rescales the spec's workload estimates (`planned_rate`,
    `planner_workload`)."""
    if spec.ratio.mode == RatioMode.FIXED:
        return None
    rate = planned_rate(spec.workload.request_rate, observed)
    if rate is None:
        return Recommendation(
            None, None, "set workload.requestRate (or wait for measured traffic) to get one"
        )
    profile = profile_for(spec.model.name)
    if profile is None:
        return Recommendation(None, None, f"no instance profile for model {spec.model.name!r}")
    workload = planner_workload(spec.workload, rate, observed)
    slo = SloInputs(ttft_s=spec.slo.ttft_seconds, itl_ms=spec.slo.itl_milliseconds)
    resolved = resolved or resolve(spec)
    bounds = Bounds(gpu_budget=spec.ratio.gpu_budget)
    tp_cp = (prefill.tensor_parallel, prefill.context_parallel)
    gpus = (prefill.gpus, decode.gpus)
    result = _recommend(profile, workload, slo, bounds, tp_cp, resolved.layer_split, gpus, observed)
    if not resolved.dsa or result.prefill is None:
        return result
    advice = shape_advice(profile, workload, slo, bounds, tp_cp, resolved.layer_split, gpus)
    return replace(result, shape=advice)


def planned_rate(declared: float | None, observed: ObservedSignals | None) -> float | None:
    """The rate the planner sizes for: the larger of the declared `workload.requestRate` and
    the measured rate (while the routers refuse or the fleet is behind, the demand held by
    `signals.planning_load`; while it rises, where it will be one pod start from now,
    `signals.forecast`; while the fleet is short of its plan, at least the rate sized for
    before, `signals.held_while_short`; `signals.sized_rate`) with `PLAN_HEADROOM` to spare;
    the declared one until traffic is measured (None when neither is there)."""
    measured = None if observed is None else sized_rate(observed)
    if measured is None:
        return declared
    return max(declared or 0.0, measured * PLAN_HEADROOM)


def planner_workload(
    declared: WorkloadSpec, rate: float, observed: ObservedSignals | None
) -> WorkloadInputs:
    """The planner's workload at `rate`: the request shape the fleet measured (prompt and
    generated tokens per request; the autoscale loop holds it within `signals.SHAPE_BAND`,
    `signals.kept_shape`) in place of the declared lengths once it has measured one, else the
    declared lengths; and the prefill pods' measured prompt reuse times, from which the model
    draws the hit-rate curve (`autoscale.reuse`; Che's approximation until they are measured);
    and how much the rate varies from window to window (`rate_cv`, the decode KV cliff's).
    The admission limit is sized for the same shape (`desired.admission`):
    a fleet whose answers grew 4x is planned for them, not for the spec's estimate, and the
    plan moves with the limit, only when the shape really changed."""
    inp, out = shape_of(observed) or (declared.avg_input_tokens, declared.avg_output_tokens)
    wl = WorkloadInputs(
        request_rate=rate,
        avg_input_tokens=float(inp),
        avg_output_tokens=float(out),
        prefix_cache_hit_rate=declared.prefix_cache_hit_rate,
        reuse=observed.reuse if observed is not None else None,
        rate_cv=(observed.rate_cv or 0.0) if observed is not None else 0.0,
    )
    if wl.reuse is None:
        return wl
    mix = request_mix(wl.reuse, wl.avg_input_tokens)
    wl = replace(
        wl,
        p95_input_tokens=mix.p95_input_tokens,
        context_sigma=mix.context_sigma,
        first_turn_sigma=max(wl.first_turn_sigma, mix.context_sigma),
    )
    if mix.first_turn_fraction is None or mix.new_tokens_per_turn is None:
        return wl
    return replace(
        wl,
        first_turn_fraction=mix.first_turn_fraction,
        new_tokens_per_turn=mix.new_tokens_per_turn,
    )


def prefill_shapes(tensor_parallel: int) -> list[tuple[int, bool]]:
    """Valid (contextParallel, layerSplit) of a DSA model's prefill at this tensorParallel:
    CP divides TP, CP > 1 only up to TP 8 (`MAX_DSA_CP_TENSOR_PARALLEL`), LayerSplit only
    with CP > 1."""
    shapes = [(1, False)]
    if tensor_parallel <= MAX_DSA_CP_TENSOR_PARALLEL:
        for cp in range(2, tensor_parallel + 1):
            if tensor_parallel % cp == 0:
                shapes += [(cp, False), (cp, True)]
    return shapes


def candidate_shapes(tensor_parallel: int, current: tuple[int, bool]) -> list[tuple[int, bool]]:
    """The shapes worth planning: CP > 1 without LayerSplit caches what CP 1 caches, loads and
    sends the same bytes and computes at the CP efficiency, so the model never prefers it to
    CP 1; it is planned only when it is the running shape."""
    return [
        (cp, split)
        for cp, split in prefill_shapes(tensor_parallel)
        if cp == 1 or split or (cp, split) == current
    ]


@lru_cache(maxsize=64)
def shape_advice(
    profile: str,
    workload: WorkloadInputs,
    slo: SloInputs,
    bounds: Bounds,
    prefill_tp_cp: tuple[int, int],
    layer_split: bool,
    instance_gpus: tuple[int, int],
) -> ShapeAdvice:
    """Plan every valid prefill shape for the declared workload (~0.1 s each, cached) and
    name the cheapest; the running shape wins ties, so the advice never churns."""
    spec = load_spec(profile)
    tp, cp = prefill_tp_cp
    running = (cp, layer_split and cp > 1)
    plans = {}
    for shape_cp, shape_ls in candidate_shapes(tp, running):
        prefill_instance, decode_instance = instance_profiles(
            spec, (tp, shape_cp), shape_ls, instance_gpus
        )
        result = recommend(workload, slo, prefill_instance, decode_instance, bounds)
        n_prefill = convert_count(result.n_prefill, prefill_instance.gpus, instance_gpus[0])
        n_decode = convert_count(result.n_decode, decode_instance.gpus, instance_gpus[1])
        plans[(shape_cp, shape_ls)] = ShapePlan(
            context_parallel=shape_cp,
            layer_split=shape_ls,
            prefill=n_prefill,
            decode=n_decode,
            gpus=n_prefill * instance_gpus[0] + n_decode * instance_gpus[1],
            ttft_p90_seconds=round(result.ttft_p90_s, 3),
            meets_slo=result.meets_slo,
            goodput_rps=round(result.goodput_rps, 3),
        )
    current = plans[running]
    best = current
    for plan in plans.values():
        if plan.better_than(best):
            best = plan
    return ShapeAdvice(current=current, recommended=best, reason=_shape_reason(current, best))


def _shape_name(plan: ShapePlan) -> str:
    return f"contextParallel {plan.context_parallel}" + (", layerSplit" if plan.layer_split else "")


def _shape_reason(current: ShapePlan, best: ShapePlan) -> str:
    if best is current:
        return f"{_shape_name(current)} is the cheapest valid prefill shape for the workload"
    if best.meets_slo and current.meets_slo:
        gain = f"with {best.gpus} GPUs against {current.gpus} now"
    elif best.meets_slo:
        gain = f"within the SLOs with {best.gpus} GPUs; {_shape_name(current)} cannot"
    else:
        gain = (
            f"{best.goodput_rps:.1f} req/s within the SLOs on {best.gpus} GPUs against "
            f"{current.goodput_rps:.1f} now"
        )
    return f"{_shape_name(best)} would serve {gain}; a shape change is a new revision"


@lru_cache(maxsize=256)
def _recommend(
    profile: str,
    workload: WorkloadInputs,
    slo: SloInputs,
    bounds: Bounds,
    prefill_tp_cp: tuple[int, int],
    layer_split: bool,
    instance_gpus: tuple[int, int],
    observed: ObservedSignals | None = None,
) -> Recommendation:
    """The planner's search (up to a second), cached on its frozen inputs."""
    spec = load_spec(profile)
    prefill_instance, decode_instance = instance_profiles(
        spec, prefill_tp_cp, layer_split, instance_gpus
    )
    result = recommend(workload, slo, prefill_instance, decode_instance, bounds, observed)
    prefill_gpus, decode_gpus = instance_gpus
    return Recommendation(
        prefill=convert_count(result.n_prefill, prefill_instance.gpus, prefill_gpus),
        decode=convert_count(result.n_decode, decode_instance.gpus, decode_gpus),
        reason=result.reason,
        ttft_p90_seconds=round(result.ttft_p90_s, 3),
        itl_milliseconds=round(result.itl_ms, 2),
        hit_rate=round(result.hit_rate, 4),
        meets_slo=result.meets_slo,
        hit_rate_curve=curve_name(workload),
    )


MEASURED_CURVE = "measured prompt reuse (autoscale.reuse)"
DEFAULT_CURVE = "default: Che's approximation with exponential gaps (no prompt reuse measured yet)"


def curve_name(workload: WorkloadInputs) -> str:
    """Which hit-rate curve the model used (`model.hit_probabilities`): the one drawn from the
    prefill engines' measured prompt reuse, or the fallback until a window holds it, which asks
    for 1.4-3.4x the cache real sessions need (docs/planner.md, "The hit-rate model")."""
    return MEASURED_CURVE if workload.reuse is not None else DEFAULT_CURVE


def instance_profiles(
    spec: ProfileSpec,
    prefill_tp_cp: tuple[int, int],
    layer_split: bool,
    instance_gpus: tuple[int, int],
) -> tuple[InstanceProfile, InstanceProfile]:
    """Planner profiles in the resource's own instance shapes (prefill ``tp`` GPUs with ``cp``
    inside TP, decode ``instance_gpus[1]`` GPUs); the profile's default prefill shape (same CP
    when it divides, else CP 1) only when ``cp`` does not divide ``tp``."""
    tp, cp = prefill_tp_cp
    try:
        prefill_instance = prefill_profile(spec, tp=tp, cp=cp, layer_split=layer_split)
    except ValueError:
        fallback_cp = cp if spec.prefill_tp % cp == 0 else 1
        prefill_instance = prefill_profile(spec, cp=fallback_cp, layer_split=layer_split)
    return prefill_instance, decode_profile(spec, dp=instance_gpus[1])


def convert_count(n: int, profile_gpus: int, shape_gpus: int) -> int:
    """Instances of the resource's shape holding ``n`` planner instances: the same count when
    the shapes match, else through GPU totals, rounded up (at least 1)."""
    if profile_gpus == shape_gpus:
        return max(1, n)
    return max(1, math.ceil(n * profile_gpus / shape_gpus))
