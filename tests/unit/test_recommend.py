"""Ratio modes in the operator: Fixed ignores the planner, Recommend reports, Auto steps toward
it (through the autoscaler)."""

from __future__ import annotations

from typing import Any

from cas_operator.api.models import parse_spec
from cas_operator.autoscale.model import ObservedSignals
from cas_operator.autoscale.profiles import load_spec as load_spec_profile
from cas_operator.desired.build import build_plan
from cas_operator.desired.recommend import (
    ShapePlan,
    candidate_shapes,
    convert_count,
    instance_profiles,
    prefill_shapes,
)
from cas_operator.reconcile.status import ratio_status
from tests.paths import load_sample
from tests.unit.test_real_traffic_model import PROFILE


def glm5(**ratio: Any) -> dict[str, Any]:
    raw: dict[str, Any] = load_sample("glm5-long-context.yaml")["spec"]
    raw["ratio"] = {**raw["ratio"], **ratio}
    return raw


def test_fixed_mode_never_consults_the_planner() -> None:
    plan = build_plan("x", "ns", parse_spec(glm5(mode="Fixed")))
    assert plan.recommendation is None
    assert "recommended" not in ratio_status(plan)


def test_recommend_reports_without_changing_replicas() -> None:
    """Regression: Recommend is the GitOps-friendly mode: it must never change replicas."""
    plan = build_plan("x", "ns", parse_spec(glm5(mode="Recommend")))
    assert (plan.prefill.replicas, plan.decode.replicas) == (3, 2)
    status = ratio_status(plan)
    assert status["replicasOwner"] == "spec"
    assert status["recommended"] is not None and ":" in status["recommended"]
    assert status["predicted"]["ttftP90Seconds"] > 0 and 0 < status["predicted"]["hitRate"] <= 1
    assert "GPUs" in status["recommendationReason"]


def test_recommend_needs_a_request_rate() -> None:
    raw = glm5(mode="Recommend")
    del raw["workload"]["requestRate"]
    plan = build_plan("x", "ns", parse_spec(raw))
    assert plan.recommendation is not None and plan.recommendation.ratio is None
    assert "requestRate" in ratio_status(plan)["recommendationReason"]


def test_auto_starts_from_the_spec_counts_and_then_takes_the_autoscalers() -> None:
    """Regression (issue 15): before the autoscaler's first step, Auto applied the planner's
    answer at once, an undamped jump (here 3:2 -> 5:3; 2:4 -> 10:20 for a fleet switched to
    Auto under load). Until the autoscaler steps the spec's counts run; its damped steps then
    move them toward the planner's."""
    plan = build_plan("x", "ns", parse_spec(glm5(mode="Auto", min=0.1, max=10)))
    rec = plan.recommendation
    assert rec is not None and rec.prefill is not None and rec.decode is not None
    assert (rec.prefill, rec.decode) != (3, 2)
    assert (plan.prefill.replicas, plan.decode.replicas) == (3, 2)
    assert plan.replicas.reason.endswith(
        f"until the autoscaler steps; the planner says {rec.ratio}"
    )
    assert ratio_status(plan)["replicasOwner"] == "operator (Auto)"
    stepped = build_plan("x", "ns", parse_spec(glm5(mode="Auto", min=0.1, max=10)), None, (4, 3))
    assert (stepped.prefill.replicas, stepped.decode.replicas) == (4, 3)
    assert stepped.prefill.gpus + stepped.decode.gpus <= 64


def test_auto_keeps_the_spec_counts_when_the_planner_breaks_a_bound() -> None:
    """Regression: a planner answer outside ratio.min/max must not turn the spec invalid."""
    plan = build_plan("x", "ns", parse_spec(glm5(mode="Auto", min=1.4, max=1.6)))
    assert (plan.prefill.replicas, plan.decode.replicas) == (3, 2)
    off = build_plan("x", "ns", parse_spec(glm5(mode="Auto", min=1.4, max=1.6)), None, (1, 9))
    assert (off.prefill.replicas, off.decode.replicas) == (3, 2)
    assert "rejected" in off.replicas.reason


def test_planner_instances_are_the_resources_instances_when_shapes_match() -> None:
    """Regression: profiles used to model a prefill instance as tp x cp GPUs while the CRD puts
    CP inside TP, so a TP8 CP4 pool's counts were converted through 32-GPU instances and came
    back 4x too large. The planner now plans in the resource's own shapes (1:1), and converts
    through GPU totals only for a shape the profile cannot express."""
    spec = load_spec_profile("glm5-fp8-h200")
    p, d = instance_profiles(spec, (8, 4), True, (8, 8))
    assert (p.gpus, p.cp, d.gpus) == (8, 4, 8)
    assert convert_count(5, p.gpus, 8) == 5
    p, _ = instance_profiles(spec, (12, 8), True, (12, 8))  # 8 does not divide 12
    assert p.gpus == spec.prefill_tp
    assert convert_count(5, p.gpus, 12) == 4  # 40 GPUs in 12-GPU instances, rounded up
    plan = build_plan("x", "ns", parse_spec(glm5(mode="Recommend")))
    rec = plan.recommendation
    assert rec is not None and rec.prefill is not None and rec.decode is not None
    assert rec.prefill * plan.prefill.shape.gpus + rec.decode * plan.decode.shape.gpus <= 64


def test_prefill_shapes_are_the_ones_sglang_accepts() -> None:
    """Guards the shape list behind status.ratio.prefillShape: CP divides TP, CP > 1 only up
    to TP 8 for DSA models, LayerSplit only with CP > 1 (the same rules `validate` enforces)."""
    assert prefill_shapes(8) == [
        (1, False),
        (2, False),
        (2, True),
        (4, False),
        (4, True),
        (8, False),
        (8, True),
    ]
    assert prefill_shapes(16) == [(1, False)]
    assert (3, True) in prefill_shapes(6) and (4, True) not in prefill_shapes(6)
    # replicated CP is planned only when it runs (the model never prefers it to CP 1)
    assert candidate_shapes(8, (4, True)) == [(1, False), (2, True), (4, True), (8, True)]
    assert (4, False) in candidate_shapes(8, (4, False))


def _plan(gpus: int, meets: bool, goodput: float, cp: int = 4) -> ShapePlan:
    return ShapePlan(cp, True, 3, 2, gpus, 3.0, meets, goodput)


def test_shape_advice_prefers_slo_then_gpus_then_goodput() -> None:
    """Guards the ordering of shapes: meeting the SLOs beats any GPU count, fewer GPUs win
    among shapes that meet them, and without one that meets them only a 5% goodput gain is
    worth a new revision (so the advice does not churn on noise)."""
    assert _plan(64, True, 5.0).better_than(_plan(40, False, 9.0))
    assert _plan(40, True, 5.0).better_than(_plan(48, True, 5.0))
    assert not _plan(48, True, 9.0).better_than(_plan(48, True, 5.0))
    assert _plan(64, False, 6.4).better_than(_plan(64, False, 6.0))
    assert not _plan(64, False, 6.2).better_than(_plan(64, False, 6.0))


def test_dsa_resource_reports_its_prefill_shape_and_auto_keeps_it() -> None:
    """Issue 19: status.ratio.prefillShape names the running and the cheapest valid prefill
    shape with the planner's GPUs and TTFT for each; Auto never changes the shape (a shape
    change is a new revision), and a non-DSA model gets no shape advice."""
    plan = build_plan("x", "ns", parse_spec(glm5(mode="Recommend")))
    shape = ratio_status(plan)["prefillShape"]
    current, best = shape["current"], shape["recommended"]
    assert (current["contextParallel"], current["layerSplit"]) == (4, True)
    assert current["replicas"] == ratio_status(plan)["recommended"]  # the same search
    for s in (current, best):
        assert s["gpus"] <= 64 and s["ttftP90Seconds"] > 0
        assert (s["contextParallel"], s["layerSplit"]) in prefill_shapes(8)
    assert (best["meetsSlo"], best["goodputRps"]) >= (current["meetsSlo"], current["goodputRps"])
    # docs/planner.md ("What the operator does with it"): at the profile's numbers LayerSplit
    # adds nothing at 70K and CP 1 computes at full efficiency
    assert (best["contextParallel"], best["layerSplit"]) == (1, False)
    assert "new revision" in shape["reason"]
    auto = build_plan("x", "ns", parse_spec(glm5(mode="Auto", min=0.1, max=10)))
    assert (auto.prefill.shape.context_parallel, auto.layer_split) == (4, True)
    assert "prefillShape" in ratio_status(auto)
    raw = glm5(mode="Recommend")
    raw["model"] = {**raw["model"], "name": "deepseek-ai/DeepSeek-V3"}
    raw["prefill"] = {**raw["prefill"], "contextParallel": 1, "layerSplit": False}
    assert "prefillShape" not in ratio_status(build_plan("x", "ns", parse_spec(raw)))


def test_the_planner_sizes_for_the_request_shape_the_fleet_measured() -> None:
    """Regression (issue 18): the planner sized for the spec's declared lengths whatever the
    fleet measured, while admission sized its limit for the measured shape: a fleet whose
    answers grew 4x (600 -> 2,400 tokens) was still planned for 600, with the decode pool
    that length needs, and the benchmark's planner (which plans from measured lengths) was
    not the product's. The shape the loop keeps (`signals.kept_shape`) now replaces the
    declared lengths; without a measured shape the declared ones stand."""
    spec = parse_spec(glm5(mode="Recommend", min=0.1, max=10, gpuBudget=256))
    # 10 req/s measured, 11 with the planner's headroom: below the declared 12, which stands
    declared = build_plan("x", "ns", spec).recommendation
    unmeasured = build_plan("x", "ns", spec, ObservedSignals(arrival_rate=10.0)).recommendation
    longer = ObservedSignals(arrival_rate=10.0, avg_input_tokens=70000.0, avg_output_tokens=2400.0)
    measured = build_plan("x", "ns", spec, longer).recommendation
    assert declared is not None and unmeasured is not None and measured is not None
    assert (unmeasured.prefill, unmeasured.decode) == (declared.prefill, declared.decode)
    assert measured.decode is not None and declared.decode is not None
    assert measured.decode > declared.decode, (declared.ratio, measured.ratio)
    assert measured.shape is not None and declared.shape is not None  # the shape advice too
    assert measured.shape.current.decode > declared.shape.current.decode
    shorter = ObservedSignals(arrival_rate=10.0, avg_input_tokens=20000.0, avg_output_tokens=600.0)
    short = build_plan("x", "ns", spec, shorter).recommendation
    assert short is not None and short.prefill is not None and declared.prefill is not None
    assert short.prefill < declared.prefill, (declared.ratio, short.ratio)


def test_the_status_names_the_hit_rate_curve_the_planner_used() -> None:
    """Regression (issue 39): `status.ratio.predicted.hitRate` did not say which curve gave
    it, so a user could not tell a prediction from the engines' measured prompt reuse (within
    0.03 of an exact replay of real sessions) from the fallback's (Che's approximation, up to
    0.49 off). Without a reuse measurement the status names the fallback; with one, the
    measured curve, and the predicted hit rate is the one that curve gives."""
    spec = parse_spec(glm5(mode="Recommend", min=0.1, max=10, gpuBudget=256))
    unmeasured = ratio_status(build_plan("x", "ns", spec, ObservedSignals(arrival_rate=10.0)))
    assert unmeasured["predicted"]["hitRateCurve"].startswith("default: Che's approximation")
    observed = ObservedSignals(arrival_rate=10.0, reuse=PROFILE)
    measured = ratio_status(build_plan("x", "ns", spec, observed))
    assert measured["predicted"]["hitRateCurve"].startswith("measured prompt reuse")
    assert measured["predicted"]["hitRate"] != unmeasured["predicted"]["hitRate"]
