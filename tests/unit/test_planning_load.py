"""The load the planner sizes for (`autoscale.signals.planning_load`, `desired.recommend.
planned_rate`): the measured arrival rate, with headroom, until the routers refuse or the fleet
falls behind; then the last unthrottled window's rate, because what arrives then is only what
the fleet let in."""

from __future__ import annotations

from cas_operator.autoscale.model import ObservedSignals
from cas_operator.autoscale.signals import planning_load
from cas_operator.desired.recommend import PLAN_HEADROOM, planned_rate

SLO_TTFT = 3.0


def test_an_unthrottled_window_is_planned_as_measured_and_remembered() -> None:
    seen = ObservedSignals(arrival_rate=20.0, refused_rate=0.1, ttft_p90_s=2.5)
    load = planning_load(seen, 30.0, SLO_TTFT)
    assert (
        load.observed.demand_rate is None
        and load.observed == seen
        and load.unthrottled_rate == 20.0
    )
    assert planned_rate(None, load.observed) == 20.0 * PLAN_HEADROOM


def test_refusals_hold_the_demand_and_keep_the_kv_calibration() -> None:
    """Regression (issue 18): behind the admission limit the planner saw only the admitted
    rate and sized the fleet down to the limit that throttled it (the benchmark's output
    shift: prefill 24 -> 11 instances, then TTFT p90 45-55 s to the end of the run)."""
    seen = ObservedSignals(arrival_rate=8.4, refused_rate=40.0, ttft_p90_s=2.8, decode_kv_usage=0.9)
    load = planning_load(seen, 24.0, SLO_TTFT)
    assert load.observed.demand_rate == 24.0
    assert load.observed.arrival_rate == 8.4  # what was measured stays as measured
    assert load.observed.decode_kv_usage == 0.9  # TTFT is fine: KV use is a real reading
    assert load.unthrottled_rate == 24.0  # held, not replaced by the throttled reading
    assert planned_rate(None, load.observed) == 24.0 * PLAN_HEADROOM
    assert planned_rate(30.0, load.observed) == 30.0  # a larger declared rate stands


def test_overload_holds_the_demand_and_drops_the_backlogged_kv_reading() -> None:
    seen = ObservedSignals(arrival_rate=9.0, ttft_p90_s=7.0, decode_kv_usage=0.98)
    load = planning_load(seen, 20.0, SLO_TTFT)
    assert load.observed.demand_rate == 20.0
    assert load.observed.decode_kv_usage is None


def test_a_throttled_window_above_the_held_rate_plans_for_itself() -> None:
    seen = ObservedSignals(arrival_rate=26.0, refused_rate=5.0)
    load = planning_load(seen, 20.0, SLO_TTFT)
    assert load.observed.demand_rate == 26.0 and load.unthrottled_rate == 20.0


def test_nothing_measured_leaves_the_declared_rate() -> None:
    load = planning_load(ObservedSignals(), 20.0, SLO_TTFT)
    assert load.observed.demand_rate is None and load.unthrottled_rate == 20.0
    assert planned_rate(12.0, load.observed) == 12.0
    assert planned_rate(None, ObservedSignals(arrival_rate=0.0)) is None
