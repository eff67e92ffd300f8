"""The load the planner sizes for (`autoscale.signals.planning_load`, `desired.recommend.
planned_rate`): the measured arrival rate, with headroom, until the routers refuse or the fleet
falls behind; then the last unthrottled window's rate, because what arrives then is only what
the fleet let in; and while the fleet is short of its plan, no less than the rate sized for
before it fell short (`signals.held_while_short`)."""

from __future__ import annotations

from cas_operator.autoscale.model import ObservedSignals
from cas_operator.autoscale.signals import (
    MOVE_HOLD_POD_STARTS,
    MoveHold,
    held_while_short,
    planning_load,
)
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


POD_START = 600.0


def test_a_fleet_short_of_its_plan_is_planned_for_the_rate_before_it_fell_short() -> None:
    """Regression (issue 39, real sessions' Mooncake-shaped surge, seed 2): a move drained two
    prefill instances for 24P:8D; while the decode pods started, the short fleet answered
    slower, the agent sessions' next turns came later, and arrivals fell from 13 to 8 req/s
    (the static 25P:7D saw 13-17 in the same minutes); the planner read that as less load and
    turned back to 26P:6D before the move's pods were Ready. While short, the rate sized for
    at the plan (its forecast too) is held; a rise is taken; at its plan again the measured
    rate counts."""
    at_plan = held_while_short(
        ObservedSignals(arrival_rate=12.0, forecast_rate=13.0), MoveHold(), False, 0.0, POD_START
    )
    assert at_plan.hold == MoveHold(13.0) and at_plan.observed.demand_rate is None
    fell = held_while_short(ObservedSignals(arrival_rate=8.0), at_plan.hold, True, 60.0, POD_START)
    assert fell.observed.demand_rate == 13.0 and fell.observed.arrival_rate == 8.0
    assert fell.hold == MoveHold(13.0, 60.0)
    assert planned_rate(None, fell.observed) == 13.0 * PLAN_HEADROOM
    rose = held_while_short(ObservedSignals(arrival_rate=15.0), fell.hold, True, 120.0, POD_START)
    assert rose.observed.demand_rate is None and rose.hold == MoveHold(13.0, 60.0)
    back = held_while_short(ObservedSignals(arrival_rate=8.0), rose.hold, False, 700.0, POD_START)
    assert back.observed.demand_rate is None and back.hold == MoveHold(8.0)


def test_a_fleet_short_for_longer_than_a_move_takes_is_stuck_and_not_held() -> None:
    """Pods that never become Ready keep a fleet short for good: after
    `MOVE_HOLD_POD_STARTS` pod starts the hold lapses and the measured rate counts again."""
    hold = MoveHold(13.0, 0.0)
    stuck_at = MOVE_HOLD_POD_STARTS * POD_START + 1.0
    still = held_while_short(
        ObservedSignals(arrival_rate=8.0), hold, True, stuck_at - 2.0, POD_START
    )
    assert still.observed.demand_rate == 13.0
    stuck = held_while_short(ObservedSignals(arrival_rate=8.0), hold, True, stuck_at, POD_START)
    assert stuck.observed.demand_rate is None and stuck.hold == hold
    # nothing sized before the fleet fell short (a new fleet's pods starting): nothing held
    new = held_while_short(ObservedSignals(arrival_rate=8.0), MoveHold(), True, 0.0, POD_START)
    assert new.observed.demand_rate is None and new.hold == MoveHold(None, 0.0)
