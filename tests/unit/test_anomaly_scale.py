"""Pressure signals -> P:D scale hints (pure): sustained, bounded, scale-up before scale-down."""

from __future__ import annotations

from cas_operator.autoscale.controller import (
    PoolCounts,
    PressureState,
    ScaleBounds,
    ScaleOutcome,
    suggest_scale,
)
from cas_operator.observe.types import PodSignals, PodView


def pods(prefill_queue: float, decode_queue: float, decode_usage: float = 0.3) -> list[PodView]:
    """Two prefill and four decode pods reporting the given per-instance gauges."""
    pre = PodSignals(queued=prefill_queue, aborted=0.0)
    dec = PodSignals(queued=decode_queue, token_usage=decode_usage, aborted=0.0)
    return [PodView(f"p{i}", "prefill", True, True, None, pre) for i in range(2)] + [
        PodView(f"d{i}", "decode", True, True, None, dec) for i in range(4)
    ]


def run(
    fleet: list[PodView], counts: PoolCounts, bounds: ScaleBounds, ticks: int
) -> list[ScaleOutcome]:
    state, out = PressureState(), []
    for _ in range(ticks):
        outcome = suggest_scale(fleet, counts, bounds, state)
        state = outcome.state
        out.append(outcome)
    return out


READY = PoolCounts(prefill=2, decode=4, prefill_ready=2, decode_ready=4)


def test_prefill_starvation_with_idle_decode_adds_prefill_after_sustain() -> None:
    """Regression: queueing prefill with idle decode (the production report's skewed ratio)
    must grow prefill by one, but only after the pressure is sustained, not on one spike."""
    out = run(pods(prefill_queue=8, decode_queue=0), READY, ScaleBounds(), ticks=3)
    assert [o.hint for o in out[:2]] == [None, None]
    hint = out[2].hint
    assert hint is not None and (hint.prefill, hint.decode) == (3, 4)


def test_busy_decode_is_not_prefill_starvation() -> None:
    """Regression: prefill queueing while decode is also saturated is load, not a bad ratio."""
    out = run(pods(prefill_queue=8, decode_queue=6, decode_usage=0.95), READY, ScaleBounds(), 5)
    assert all(o.hint is None for o in out)


def test_decode_pressure_adds_decode() -> None:
    """Regression: the reverse direction: full decode KV with idle prefill grows decode."""
    out = run(pods(prefill_queue=0, decode_queue=0, decode_usage=0.97), READY, ScaleBounds(), 3)
    hint = out[-1].hint
    assert hint is not None and (hint.prefill, hint.decode) == (2, 5)


def test_ratio_bound_and_budget_stop_growth() -> None:
    """Regression: hints must respect ratio.max and the GPU budget (no surge allowed). At the
    budget the idle side gives up an instance instead (a shift within the budget: Auto was
    stuck at 1:2 with a starved prefill on the local stack); where even that breaks a bound, or
    the freed GPUs are too few for the starved side's instance, there is no hint."""
    starving = pods(prefill_queue=8, decode_queue=0)
    capped = run(starving, READY, ScaleBounds(ratio_max=0.5), 3)[-1]
    assert capped.hint is None and "ratio bounds" in capped.note
    shifted = run(starving, READY, ScaleBounds(gpu_budget=6), 3)[-1].hint
    assert shifted is not None and (shifted.prefill, shifted.decode) == (3, 3)
    assert "GPU budget" in shifted.reason
    narrow = run(starving, READY, ScaleBounds(gpu_budget=6, ratio_max=0.8), 3)[-1]
    assert narrow.hint is None and "budget" in narrow.note  # 3:3 would break ratio.max
    wide = PoolCounts(prefill=2, decode=4, prefill_ready=2, decode_ready=4, prefill_gpus=2)
    spent = run(starving, wide, ScaleBounds(gpu_budget=8), 3)[-1]
    assert spent.hint is None and "budget" in spent.note  # one decode GPU frees too little


def test_no_hint_while_a_scale_up_is_not_ready() -> None:
    """Regression: stacking hints while the last one is still starting would overshoot."""
    counts = PoolCounts(prefill=3, decode=4, prefill_ready=2, decode_ready=4)
    out = run(pods(prefill_queue=8, decode_queue=0), counts, ScaleBounds(), 5)
    assert all(o.hint is None for o in out)
    assert "waiting" in out[-1].note


def test_shift_shrinks_the_other_side_only_after_the_surge_is_ready() -> None:
    """Regression: never scale decode down before the prefill scale-up is ready (a shift at a
    full GPU budget borrows one instance, then gives it back)."""
    bounds = ScaleBounds(gpu_budget=6, surge_gpus=1)
    grow = run(pods(prefill_queue=8, decode_queue=0), READY, bounds, 3)[-1].hint
    assert grow is not None and (grow.prefill, grow.decode) == (3, 4)
    starting = PoolCounts(prefill=3, decode=4, prefill_ready=2, decode_ready=4)
    assert suggest_scale(pods(0, 0), starting, bounds, PressureState()).hint is None
    ready = PoolCounts(prefill=3, decode=4, prefill_ready=3, decode_ready=4)
    finish = suggest_scale(pods(0, 0), ready, bounds, PressureState()).hint
    assert finish is not None and (finish.prefill, finish.decode) == (3, 3)
