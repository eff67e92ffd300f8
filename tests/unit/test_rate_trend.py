"""Planning for a rising load (`autoscale.signals.forecast`, `RateHistory`, `rising_slope`):
while the measured arrival rate rises significantly over the last 15 minutes, the planner sizes
for where it will be one pod start from now; a flat, noisy load reads as no trend.

Regression guarded: the planner planned for the last window's rate, and every move waited a
pod start, so under a ramp of real sessions' starts the fleet lagged the load for the whole run
(bench.planner_traces' ramp behind consistent hashing: ours 70% of the online bound; with the
forecast 85-88%, docs/planner.md)."""

from __future__ import annotations

import numpy as np
import pytest

from cas_operator.autoscale.model import ObservedSignals
from cas_operator.autoscale.signals import (
    TREND_HISTORY_S,
    TREND_MIN_SAMPLES,
    RateHistory,
    forecast,
    rising_slope,
)
from cas_operator.desired.recommend import PLAN_HEADROOM, planned_rate

WINDOW = 300.0  # the operator's default metrics window (anomalyGuard.windowSeconds)
TICK = 5.0  # the fleet tick


def _measured(
    seed: int, rate_at, window: float = WINDOW, tick: float = TICK, since: float = 0.0
) -> RateHistory:
    """The arrival rates the operator reads tick after tick from ``since`` to 10,000 s:
    Poisson arrivals at ``rate_at(t)`` per second, each tick's rate over the window ending then
    (consecutive windows overlap)."""
    rng = np.random.default_rng(seed)
    t_end = 10_000.0
    secs = np.arange(t_end - 2 * TREND_HISTORY_S - window, t_end)
    counts = rng.poisson([rate_at(float(t)) for t in secs])
    history = RateHistory()
    first = max(since, t_end - 2 * TREND_HISTORY_S)
    for now in np.arange(first + tick, t_end + 1e-9, tick):
        inside = (secs >= now - window) & (secs < now)
        history = history.add(float(now), float(counts[inside].sum()) / window)
    return history


def test_a_flat_noisy_rate_reads_as_no_trend() -> None:
    """At a steady 10 req/s, the windows' noise (overlapping windows, so far fewer independent
    readings than ticks) rarely reads as a rise: at most 3% of runs (2%, 8 of 400, when
    written). Counting every tick as an independent reading, 37% did."""
    flat = [_measured(seed, lambda t: 10.0) for seed in range(400)]
    assert sum(rising_slope(h, WINDOW) > 0 for h in flat) <= 12
    assert sum(rising_slope(h, TICK) > 0 for h in flat) > 100  # what the window count guards


def test_traffic_that_begins_does_not_read_as_a_ramp() -> None:
    """Regression: a new fleet's first window reaches back before its traffic, so the measured
    rate climbs for one window however flat the load; read as a ramp, it would double the
    first plans. The history leaves that window out: traffic switched on at a flat 10 req/s
    gives no forecast at any tick of its first 15 minutes (without the rule, most ticks of its
    second window gave one)."""
    rng = np.random.default_rng(3)
    counts = rng.poisson(10.0, 2000)  # arrivals per second from t = 0, the traffic's start
    history, blind, rising, naive = RateHistory(), RateHistory(), 0, 0
    for now in np.arange(TICK, 900.0 + 1e-9, TICK):
        rate = float(counts[max(0, int(now - WINDOW)) : int(now)].sum()) / WINDOW
        history = history.add(float(now), rate)
        blind = RateHistory(history.samples, -1e9)  # (as if arrivals had begun long before)
        rising += rising_slope(history, WINDOW) > 0
        naive += rising_slope(blind, WINDOW) > 0 and now <= 2 * WINDOW
    assert rising == 0
    assert naive > 20


def test_a_rising_rate_is_planned_where_it_will_be_one_pod_start_later() -> None:
    """A rate rising from 6 to 9 req/s over 15 minutes (0.0033 req/s a second): the slope is
    found within 30%, the forecast is the planning rate plus the rise over the pods' start
    time (600 s: +2 req/s), and the planner sizes for it with its headroom."""
    history = _measured(1, lambda t: 6.0 + 0.0033 * (t - (10_000.0 - TREND_HISTORY_S)))
    slope = rising_slope(history, WINDOW)
    assert slope == pytest.approx(0.0033, rel=0.3)
    seen = ObservedSignals(arrival_rate=9.0)
    ahead = forecast(seen, history, WINDOW, horizon_s=600.0)
    # (2 significant digits, as every planner input: a steady rise gives a cached answer)
    assert ahead.forecast_rate == pytest.approx(9.0 + slope * 600.0, rel=0.05)
    assert planned_rate(None, ahead) == pytest.approx(ahead.forecast_rate * PLAN_HEADROOM)
    # throttled: the rise is added to the demand the planner holds, not to the admitted rate
    held = forecast(ObservedSignals(arrival_rate=5.0, demand_rate=9.0), history, WINDOW, 600.0)
    assert held.forecast_rate == ahead.forecast_rate


def test_a_falling_or_short_history_adds_nothing_and_a_rise_is_capped() -> None:
    """No forecast from a falling rate, nor before `TREND_MIN_SAMPLES` ticks; a steep rise adds
    at most the rate itself (a burst's first minutes are not extrapolated without bound)."""
    falling = _measured(2, lambda t: 12.0 - 0.004 * (t - (10_000.0 - TREND_HISTORY_S)))
    seen = ObservedSignals(arrival_rate=8.0)
    assert forecast(seen, falling, WINDOW, 600.0).forecast_rate is None
    long_ago = -1e9  # arrivals began long before these histories
    short = RateHistory(tuple((float(t), 1.0 + t) for t in range(TREND_MIN_SAMPLES - 1)), long_ago)
    assert rising_slope(short, WINDOW) == 0.0
    steep = RateHistory(tuple((float(t), 1.0 + 0.1 * t) for t in range(0, 600, 5)), long_ago)
    assert rising_slope(RateHistory(steep.samples), WINDOW) == 0.0  # no arrivals seen yet
    capped = forecast(ObservedSignals(arrival_rate=60.0), steep, WINDOW, 600.0)
    assert capped.forecast_rate == 120.0


def test_the_history_keeps_the_last_fifteen_minutes_of_rates() -> None:
    """A tick adds its rate and drops those older than `TREND_HISTORY_S`; a tick without a
    measured rate adds nothing."""
    h = RateHistory()
    for now in range(0, 2000, 100):
        h = h.add(float(now), 5.0)
    h = h.add(2000.0, None)
    assert [t for t, _ in h.samples] == [float(t) for t in range(1100, 2000, 100)]
