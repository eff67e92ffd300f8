"""Admission control sized from the plan (issue 18): the router's own limits, rendered.

Regression guarded: a fleet offered more than it serves queued every request into a backlog
that missed every TTFT (goodput collapsed to ~3% of a naive split in the planner benchmark);
nothing told the router the fleet's capacity.
"""

from __future__ import annotations

from typing import Any

import pytest

from cas_operator.api.models import parse_spec
from cas_operator.autoscale.model import SloInputs
from cas_operator.autoscale.profiles import load_spec
from cas_operator.desired.admission import admission_for, highest_rate, per_router, workload_of
from cas_operator.desired.build import build_plan
from cas_operator.desired.plan import InvalidSpec
from cas_operator.desired.recommend import instance_profiles
from cas_operator.desired.resources.router import router_args
from cas_operator.reconcile.status import admission_status
from tests.paths import load_sample


def plan_of(spec: dict[str, Any]) -> Any:
    return build_plan("demo", "ns", parse_spec(spec))


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


GLM5: dict[str, Any] = {
    "model": {"name": "zai-org/GLM-5-FP8"},
    "prefill": {"replicas": 2},
    "decode": {"replicas": 2},
}


def test_auto_admits_the_planners_capacity_and_follows_the_pools() -> None:
    small, large = plan_of(GLM5), plan_of({**GLM5, "prefill": {"replicas": 4}})
    a, b = admission_for(small), admission_for(large)
    assert a is not None and b is not None
    assert 0 < a.requests_per_second < b.requests_per_second  # more prefill, more capacity
    assert "within the SLOs" in a.basis
    args = router_args(small)
    assert flag(args, "--queue-size") == "0"  # beyond the limit: 429 at once, no backlog
    # sglang-router 0.3.2 (the default): what the pools hold, refilled by 1 (its bucket gets
    # a token back when a response ends: `Admission.limits`)
    assert flag(args, "--rate-limit-tokens-per-second") == "1"
    assert flag(args, "--max-concurrent-requests") == str(a.router_in_flight)
    assert router_args(large) != args  # the limit follows a replica change


def test_a_model_without_a_profile_gets_no_limit_and_says_why() -> None:
    plan = plan_of(load_sample("minimal.yaml")["spec"])
    assert admission_for(plan) is None
    assert "--rate-limit-tokens-per-second" not in router_args(plan)
    assert "no instance profile" in admission_status(plan)["basis"]


def test_fixed_and_off() -> None:
    fixed = plan_of({**GLM5, "router": {"admission": {"mode": "Fixed", "requestsPerSecond": 10}}})
    found = admission_for(fixed)
    assert found is not None and (found.router_rps, found.router_burst) == (5, 25)
    off = plan_of({**GLM5, "router": {"admission": {"mode": "Off"}}})
    assert admission_for(off) is None and "--queue-size" not in router_args(off)
    with pytest.raises(InvalidSpec, match=r"requestsPerSecond"):
        plan_of({**GLM5, "router": {"admission": {"mode": "Fixed"}}})


def test_each_router_gets_a_share_of_at_least_one_request_per_second() -> None:
    """The router's bucket refill is an integer: a fleet of 0.8 req/s over 2 routers admits 1
    per router (said in status), never 0 (which would refuse everything)."""
    share = per_router(0.8, 4, 2, "x")
    assert (share.router_rps, share.router_burst) == (1, 2)
    assert per_router(9.0, 45, 2, "x").router_rps == 4  # rounded to the closest


def test_admission_sizes_for_the_measured_request_shape() -> None:
    """Regression (issue 18, the planner benchmark's output shift): a limit sized for the
    declared shape kept admitting after outputs grew 4x (0.96 req/s within SLO); sized for the
    measured shape the fleet kept 4.42. Longer measured outputs give a lower limit, sized for
    the measured lengths themselves (no grid rounding them up), and status shows the shape a
    restarted operator resumes from."""
    from cas_operator.autoscale.model import ObservedSignals
    from cas_operator.autoscale.signals import quantized, shape_in_status

    spec = parse_spec({**GLM5, "workload": {"avgInputTokens": 70000, "avgOutputTokens": 600}})
    declared = admission_for(build_plan("demo", "ns", spec))
    plan = build_plan("demo", "ns", spec, quantized(ObservedSignals(
        avg_input_tokens=70_600.0, avg_output_tokens=2_400.0)))  # fmt: skip
    shifted = admission_for(plan)
    assert declared is not None and shifted is not None
    assert shifted.requests_per_second < declared.requests_per_second
    assert "70600 in/2400 out" in shifted.basis
    status = admission_status(plan)
    assert status["requestShape"] == {"inputTokens": 70_600.0, "outputTokens": 2_400.0}
    assert shape_in_status({"admission": status}) == (70_600.0, 2_400.0)


def test_auto_admits_up_to_the_rate_that_keeps_every_queue_stable() -> None:
    """Regression (issue 18, planner benchmark): a limit at the rate the model serves within
    the SLOs refused load the fleet drains (the model is conservative near capacity): steady,
    long tool pauses, burst and transfer-bound lost 8-17% of their goodput to it. The limit is
    the highest rate at which every queue stays stable; the within-SLO rate is shown beside."""
    plan = plan_of(GLM5)
    found = admission_for(plan)
    prefill, decode = instance_profiles(load_spec("glm5-fp8-h200"), (8, 1), False, (8, 8))
    wl, slo = workload_of(plan.spec), SloInputs(ttft_s=4.0, itl_ms=50.0)
    stable = highest_rate(wl, slo, prefill, decode, 2, 2, within_slo=False)
    within = highest_rate(wl, slo, prefill, decode, 2, 2, within_slo=True)
    assert found is not None and found.requests_per_second == pytest.approx(stable)
    assert stable > within and f"within the SLOs to {within:.3g}" in found.basis


def test_status_shows_what_the_routers_refused() -> None:
    from cas_operator.autoscale.model import ObservedSignals

    spec = parse_spec(GLM5)
    measured = build_plan("demo", "ns", spec, ObservedSignals(refused_rate=3.5))
    assert admission_status(measured)["refusedPerSecond"] == 3.5
    assert "refusedPerSecond" not in admission_status(build_plan("demo", "ns", spec))


def test_the_in_flight_bound_is_what_the_pools_hold_not_the_mean_at_the_rate() -> None:
    """smg's `--max-concurrent-requests` bounds requests in flight. Regression (planner
    benchmark, output shift): a bound at the mean in flight at the admitted rate refused the
    ordinary fluctuations around it (8.04 req/s against 8.69 with the rate alone). The bound is
    what the pools hold before requests wait for decode KV: above the mean at the rate, and
    lower for longer requests (each holds more KV)."""
    from cas_operator.autoscale.model import WorkloadInputs, evaluate
    from cas_operator.desired.admission import in_flight_at

    prefill, decode = instance_profiles(load_spec("glm5-fp8-h200"), (8, 1), False, (8, 8))
    slo = SloInputs(ttft_s=4.0, itl_ms=50.0)
    wl = workload_of(plan_of(GLM5).spec)
    rate = highest_rate(wl, slo, prefill, decode, 2, 2, within_slo=False)
    at = WorkloadInputs(**{**wl.__dict__, "request_rate": rate})
    mean = 2 * evaluate(at, slo, prefill, decode, 2, 2).decode_active_per_instance
    bound = in_flight_at(rate, wl, slo, decode, 2)
    assert bound > mean + rate * slo.ttft_s
    longer = WorkloadInputs(**{**wl.__dict__, "avg_output_tokens": 40_000.0})
    assert in_flight_at(rate, longer, slo, decode, 2) < bound
    assert in_flight_at(0.0, wl, slo, decode, 2) == 0.0
