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
    RATE_CV_STEP,
    TREND_HISTORY_S,
    TREND_MIN_SAMPLES,
    RateHistory,
    forecast,
    rate_variation,
    rising_slope,
    trend_reading,
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


def _levels(seed: int, cv: float, hold_s: float = 600.0):
    """A rate that jumps every ``hold_s`` to a new level around 10 req/s (coefficient of
    variation ``cv``, lognormal): a load whose mean moves from one stretch to the next."""
    rng = np.random.default_rng(seed)
    sigma = float(np.sqrt(np.log(1.0 + cv * cv)))
    levels = 10.0 * rng.lognormal(-sigma * sigma / 2.0, sigma, 100)
    return lambda t: float(levels[int(t // hold_s) % 100])


def test_a_steady_rate_reads_as_no_variation_and_a_swinging_one_as_its_own() -> None:
    """Regression (issue 39, the Mooncake-shaped surge): the decode KV cliff read only the mean
    rate. `rate_variation` measures how much the rate moves from window to window beyond the
    counting noise of a rate measured over the window (1 minute here, 5-s ticks):
    - a steady Poisson 2 req/s reads 0 in the median run (its windows' counting noise alone
      spreads the rates by 0.086 in the median run: read as variation, decode would be padded
      on every load);
    - a rate whose level moves every 2 minutes with a coefficient of variation of 0.2 reads
      0.15 in the median run (the windows average over a jump; 15 minutes hold only a
      few levels) and over 0.09 in most;
    - a ramp of 6 -> 9 req/s is a trend, not variation (its rates' own spread is 0.1).
    `forecast` carries it in `rate_cv`, in steps of `RATE_CV_STEP`."""
    window = 60.0
    steady = [_measured(s, lambda t: 2.0, window) for s in range(40)]
    read = [rate_variation(h, window) or 0.0 for h in steady]
    spread = [float(np.std([r for _, r in h.samples], ddof=1)) / 2.0 for h in steady]
    assert float(np.median(read)) < 0.02 and max(read) < 0.08
    assert float(np.median(spread)) > 0.07  # the counting noise: what taking it out guards
    swings = [
        rate_variation(_measured(s, _levels(s, 0.2, hold_s=120.0), window), window) or 0.0
        for s in range(40)
    ]
    assert 0.12 < float(np.median(swings)) < 0.22
    assert sum(v > 0.09 for v in swings) >= 36
    ramp = _measured(2, lambda t: 6.0 + 0.0033 * (t - (10_000.0 - TREND_HISTORY_S)), window)
    assert (rate_variation(ramp, window) or 0.0) < 0.04
    assert float(np.std([r for _, r in ramp.samples], ddof=1)) / 7.5 > 0.09  # the trend
    seen = ObservedSignals(arrival_rate=10.0)
    swinging = _measured(1, _levels(1, 0.2, hold_s=120.0), window)
    carried = forecast(seen, swinging, window, 600.0).rate_cv
    found = rate_variation(swinging, window)
    assert carried is not None and found is not None
    assert round(carried / RATE_CV_STEP, 6) == round(carried / RATE_CV_STEP)
    assert carried == pytest.approx(found, abs=RATE_CV_STEP / 2 + 1e-9)
    assert rate_variation(RateHistory(), window) is None


def test_the_trend_reads_the_short_windows_rate_when_measured() -> None:
    """`trend_reading`: the rate over the short window (`rate_window`: 60 s, or the metrics
    window when shorter) and that window when the engines' recent requests were measured,
    else the window's own rate and window (an engine without the counter's recent increase)."""
    both = ObservedSignals(arrival_rate=4.0, recent_arrival_rate=6.0)
    assert trend_reading(both, 300.0) == (6.0, 60.0)
    assert trend_reading(both, 30.0) == (6.0, 30.0)
    assert trend_reading(ObservedSignals(arrival_rate=4.0), 300.0) == (4.0, 300.0)
