"""The planner benchmark's `ours-operator` (`RatioPlannerPolicy.operator_inputs`): its slow loop
plans from what the operator has, through the operator's own `desired.recommend.planner_workload`,
so the gap between `ours` and `ours-operator` in docs/planner.md is the planner's measured
workload mix, not a difference of code."""

from __future__ import annotations

from dataclasses import replace

from bench.fleetsim.engine import FleetView, Metrics
from bench.fleetsim.policies import RatioPlannerPolicy
from bench.planner import SLO, _bounds, _workload_fields, scenarios
from cas_operator.autoscale.model import WorkloadInputs
from cas_operator.autoscale.signals import HIT_SETTLE_S
from cas_operator.desired.recommend import PLAN_HEADROOM

SC = next(s for s in scenarios(True) if s.name == "output-shift")
P, D = SC.profiles()
_VIEW = FleetView(20, 8, 20, 8)


def _metrics(inp: float, out: float, first_turns: float = 0.3, pause: float = 60.0) -> Metrics:
    return Metrics(5.0, 0.9, 1.0, 15.0, inp, 2.5 * inp, out, first_turns, pause, 0.0, 0.5, 0)


def _planned(policy: RatioPlannerPolicy, seen: list[Metrics]) -> WorkloadInputs:
    wl = None
    for m in seen:
        wl = policy._workload(m, 10.0)
    assert wl is not None
    return wl


def test_operator_inputs_plan_from_the_kept_shape_and_the_declared_mix() -> None:
    """Regression: the benchmark's planner read the measured p95 prompt, first-turn share and
    tool pause, which the operator does not measure, so its `ours` was not the product's
    planner. With `operator_inputs` those are the planner's defaults whatever the fleet shows,
    and the lengths are the measured ones held within their band, as the operator keeps them."""
    product = RatioPlannerPolicy(P, D, SLO, _bounds(SC), operator_inputs=_workload_fields(SC))
    wl = _planned(product, [_metrics(70_000.0, 400.0), _metrics(71_500.0, 370.0)])
    assert (wl.avg_input_tokens, wl.avg_output_tokens) == (70_000.0, 400.0)  # within the band
    defaults = WorkloadInputs(request_rate=10.0, avg_input_tokens=1.0, avg_output_tokens=1.0)
    assert wl.first_turn_fraction == defaults.first_turn_fraction
    assert wl.tool_pause_s == defaults.tool_pause_s and wl.p95_input_tokens is None
    shifted = _planned(product, [_metrics(70_000.0, 1_600.0)])
    assert shifted.avg_output_tokens == 1_600.0  # out of the band: the measured length
    bench = RatioPlannerPolicy(P, D, SLO, _bounds(SC))
    mixed = _planned(bench, [_metrics(70_000.0, 400.0)])
    assert (mixed.first_turn_fraction, mixed.tool_pause_s) == (0.3, 60.0)


def test_operator_inputs_hold_the_demand_behind_the_limit_as_the_operator_does() -> None:
    """The benchmark's operator loop holds the last unthrottled rate while the simulated
    routers refuse (`signals.planning_load`) and adds the operator's headroom, as
    `desired.recommend.planned_rate` does; the simulator's refusals reach its metrics."""
    product = RatioPlannerPolicy(P, D, SLO, _bounds(SC), operator_inputs=_workload_fields(SC))
    free = replace(_metrics(70_000.0, 400.0), arrival_rate=20.0)
    wl, _ = product._operator_load(0.0, free, _VIEW)
    assert wl.request_rate == 20.0 * PLAN_HEADROOM
    behind = replace(free, arrival_rate=8.0, refused_rate=30.0)
    wl, observed = product._operator_load(0.0, behind, _VIEW)
    assert wl.request_rate == 20.0 * PLAN_HEADROOM
    assert observed.decode_kv_usage is not None  # TTFT is fine: KV use still calibrates


def test_operator_inputs_carry_the_hit_rate_once_the_prefill_pool_settled() -> None:
    """The operator rescales the model's hit rate by the measured one (`search.recommend`), so
    the benchmark's operator loop must too (it did not: `ours-operator` planned the output shift
    without it, and with it the operator's planner answered 1P:31D); within `HIT_SETTLE_S` of
    the loop's last prefill change the dip of moved sessions is not planned from
    (`signals.settled_hit_rate`), nor within it of the simulated pods' start."""
    product = RatioPlannerPolicy(P, D, SLO, _bounds(SC), operator_inputs=_workload_fields(SC))
    seen = _metrics(70_000.0, 400.0)
    _, observed = product._operator_load(HIT_SETTLE_S - 1.0, seen, _VIEW)
    assert observed.hit_rate is None  # the simulated pods became Ready at 0, caches cold
    _, observed = product._operator_load(1_000.0, seen, _VIEW)
    assert observed.hit_rate == seen.hit_rate and observed.prefill_replicas == _VIEW.prefill
    product.state = replace(product.state, last_prefill_change=900.0)
    _, observed = product._operator_load(1_000.0, seen, _VIEW)
    assert observed.hit_rate is None
    _, observed = product._operator_load(900.0 + HIT_SETTLE_S, seen, _VIEW)
    assert observed.hit_rate == seen.hit_rate
