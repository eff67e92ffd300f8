"""Auto mode's damped replica step and the measured load that feeds the planner.

Pure pieces (`autoscale/signals.py`, `autoscale/controller.py`) against hand-computed cases;
then the operator's side: the fleet tick hands `status.autoscaler` to the passes and asks for
one, and the reconcile applies the autoscaler's counts to the Deployments.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from cas_operator.api import constants as c
from cas_operator.autoscale.controller import (
    AutoInputs,
    AutoState,
    ControlState,
    ScaleHint,
    auto_step,
    failing_sides,
)
from cas_operator.autoscale.model import ObservedSignals, SloInputs
from cas_operator.autoscale.signals import observed_signals, quantized
from cas_operator.observe.histogram import histogram_quantile
from cas_operator.observe.types import PodSignals, PodView
from cas_operator.reconcile.core import Measured, reconcile
from tests.fakes import MemoryKube

SLO = SloInputs(ttft_s=2.0, itl_ms=50.0)
QUIET = ObservedSignals()
T0 = 1_000_000.0


def view(name: str, role: str, **signals: Any) -> PodView:
    return PodView(name, role, True, True, None, PodSignals(**signals))


def inputs(p: int, d: int, **kw: Any) -> AutoInputs:
    defaults: dict[str, Any] = dict(
        current=AutoState(p, d),
        prefill_pods=p,
        decode_pods=d,
        prefill_gpus=8,
        decode_gpus=8,
        slo=SLO,
        pod_start_s=60.0,
    )
    defaults.update(kw)
    return AutoInputs(**defaults)


# --------------------------------------------------------------- measured load


def test_observed_load_from_pod_counters() -> None:
    """Arrivals = decode pods' finished requests over the window; hit rate = prefill cached /
    prompt tokens; a pod whose signal is unavailable counts for nothing."""
    pods = [
        view(
            "p0",
            c.ROLE_PREFILL,
            prompt_tokens=1000.0,
            cached_tokens=900.0,
            queued=4.0,
            requests=60.0,
        ),
        view(
            "p1",
            c.ROLE_PREFILL,
            prompt_tokens=3000.0,
            cached_tokens=2100.0,
            queued=0.0,
            requests=60.0,
        ),
        view("d0", c.ROLE_DECODE, requests=30.0, token_usage=0.5, aborted=0.0, queued=1.0),
        view("d1", c.ROLE_DECODE, requests=90.0, token_usage=0.7, aborted=6.0, queued=0.0),
        PodView("d2", c.ROLE_DECODE, True, True, None, PodSignals(error="scrape failed")),
    ]
    o = observed_signals(pods, window_s=60.0)
    assert o.arrival_rate == pytest.approx(2.0)  # (30 + 90) / 60, not counting prefill too
    assert o.hit_rate == pytest.approx(3000.0 / 4000.0)
    assert o.prefill_queue_depth == pytest.approx(2.0)
    assert o.decode_kv_usage == pytest.approx(0.6)
    assert o.decode_queue_depth == pytest.approx(0.5)
    assert o.aborts_per_s == pytest.approx(0.1)
    assert (o.prefill_replicas, o.decode_replicas) == (2, 2)


def test_ttft_p90_from_the_decode_pods_histograms() -> None:
    """Regression: Auto's TTFT rules (prefill failing = TTFT over SLO with a prefill queue)
    had no input in the operator. p90 interpolates inside the bucket like PromQL's
    histogram_quantile, over the decode pods' merged buckets (prefill pods' only as fallback)."""
    inf = math.inf
    d0 = ((1.0, 8.0), (4.0, 8.0), (8.0, 10.0), (inf, 10.0))
    d1 = ((1.0, 2.0), (4.0, 2.0), (8.0, 10.0), (inf, 10.0))
    pre = ((0.5, 5.0), (inf, 5.0))
    pods = [
        view("d0", c.ROLE_DECODE, ttft_buckets=d0),
        view("d1", c.ROLE_DECODE, ttft_buckets=d1),
        view("p0", c.ROLE_PREFILL, ttft_buckets=pre),
    ]
    # merged: 10 of 20 under 1 s, all 20 under 8 s; rank 18 falls in (4, 8]: 4 + 4 * 8/10
    assert observed_signals(pods, 60.0).ttft_p90_s == pytest.approx(7.2)
    assert observed_signals(pods[2:], 60.0).ttft_p90_s == pytest.approx(0.45)
    assert histogram_quantile(0.9, [(1.0, 0.0), (inf, 0.0)]) is None  # no requests: unknown
    assert histogram_quantile(0.9, [(1.0, 1.0), (inf, 10.0)]) == 1.0  # in +Inf: top bound


def test_itl_from_the_decode_pods_histograms_makes_decode_fail_over_its_slo() -> None:
    """Regression (issue 15): the ITL SLO had no measured input (ObservedSignals.itl_ms was
    never set), so a decode pool slowing every token stayed "not failing". The median of the
    decode pods' per-token histogram (SGLang divides a chunk's interval over its tokens) is
    compared with the SLO's mean ITL per request."""
    inf = math.inf
    slow = ((0.02, 1.0), (0.05, 2.0), (0.1, 10.0), (inf, 10.0))
    pods = [view("d0", c.ROLE_DECODE, itl_buckets=slow),
            view("p0", c.ROLE_PREFILL, itl_buckets=((0.001, 9.0), (inf, 9.0)))]  # fmt: skip
    o = observed_signals(pods, 60.0)
    assert o.itl_ms == pytest.approx(50.0 + 50.0 * 3.0 / 8.0)  # rank 5 in (0.05, 0.1]
    slo = SloInputs(ttft_s=4.0, itl_ms=40.0)
    assert failing_sides(o, slo) == (False, True)
    assert failing_sides(ObservedSignals(itl_ms=45.0), slo) == (False, False)  # within 1.2x
    assert observed_signals(pods[1:], 60.0).itl_ms is None  # prefill pods do not decode


def test_no_counters_means_unknown_not_zero() -> None:
    o = observed_signals([view("d0", c.ROLE_DECODE, running=3.0)], window_s=60.0)
    assert o.arrival_rate is None and o.hit_rate is None


def test_quantized_load_is_stable_under_noise() -> None:
    """Regression guard: the planner's answer is cached on its inputs; a steady load that
    jitters by a percent must give the same (cached) inputs tick after tick."""
    a = quantized(ObservedSignals(arrival_rate=41.3, hit_rate=0.875, decode_kv_usage=0.615))
    b = quantized(ObservedSignals(arrival_rate=40.6, hit_rate=0.872, decode_kv_usage=0.618))
    assert a == b and a.arrival_rate == 41.0


# --------------------------------------------------------------- one step


def test_grows_in_bounded_steps_toward_the_planner() -> None:
    state = auto_step(inputs(4, 4), (10, 4), QUIET, None, T0)
    assert state.replicas == (6, 4)  # a step is at most 25% of the fleet (8 instances)
    assert state.control.last_prefill_change == T0
    assert math.isinf(state.control.last_decode_change)


def test_auto_step_takes_its_cooldown_from_the_observed_pod_start_time() -> None:
    """The step hands `pod_start_s` (measured from the pods) to the controller as the floor of
    its cooldown; the rule itself (cooldown >= pod start, no oscillation on a constant target)
    is pinned once, at the controller: test_ratio_control.py."""
    first = auto_step(inputs(4, 4), (10, 4), QUIET, None, T0)
    held = auto_step(inputs(6, 4, current=first), (10, 4), QUIET, None, T0 + 59)
    assert held.replicas == (6, 4) and "cooldown" in held.reason
    later = auto_step(inputs(6, 4, current=held), (10, 4), QUIET, None, T0 + 61)
    assert 6 < later.replicas[0] <= 10 and later.replicas[1] == 4


def test_scale_down_waits_for_the_lower_target_to_hold() -> None:
    """Hysteresis: one low reading does not shrink a pool; a target that held 15 min does."""
    s = auto_step(inputs(8, 8), (8, 4), QUIET, None, T0)
    assert s.replicas == (8, 8) and s.control.down_since_decode == T0
    s = auto_step(inputs(8, 8, current=s), (8, 4), QUIET, None, T0 + 899)
    assert s.replicas == (8, 8)
    s = auto_step(inputs(8, 8, current=s), (8, 4), QUIET, None, T0 + 901)
    assert s.replicas == (8, 6)


def test_stabilization_windows_come_from_the_resource() -> None:
    """ratio.scaleDownStabilizationSeconds / rebalanceStabilizationSeconds reach the step: a
    shorter scale-down window shrinks sooner; at the budget cap a plan that moves a decode to
    prefill takes it after the rebalance window, and the prefill grows only once that decode
    pod is gone (drain-confirm-then-grow). (The fast loop alone no longer takes a decode the
    plan sized: `test_at_the_cap_the_fast_loop_takes_only_what_the_plan_would_give`.)"""
    quick = dict(down_stable_s=60.0)
    s = auto_step(inputs(8, 8, **quick), (8, 4), QUIET, None, T0)
    s = auto_step(inputs(8, 8, current=s, **quick), (8, 4), QUIET, None, T0 + 61)
    assert s.replicas == (8, 6)
    cap = dict(gpu_budget=24, ratio_max=2.0, rebalance_stable_s=20.0)
    starved = ObservedSignals(ttft_p90_s=9.0, prefill_queue_depth=4.0)
    s = auto_step(inputs(1, 2, **cap), (2, 1), starved, None, T0)
    assert s.replicas == (1, 2)  # the decode's lower target starts its rebalance window
    s = auto_step(inputs(1, 2, current=s, **cap), (2, 1), starved, None, T0 + 21)
    assert s.replicas == (1, 1)
    s = auto_step(inputs(1, 1, current=s, decode_pods=2, **cap), (2, 1), starved, None, T0 + 81)
    assert s.replicas == (1, 1)  # the removed decode pod still holds its GPUs
    s = auto_step(inputs(1, 1, current=s, **cap), (2, 1), starved, None, T0 + 82)
    assert s.replicas == (2, 1)


def test_at_the_cap_the_fast_loop_takes_only_what_the_plan_would_give() -> None:
    """Regression (real sessions, the ramp): with TTFT p90 over the SLO at every split (long
    cold prefills hold the instances their sessions are homed on), prefill always read as
    failing, and at the cap the fast loop took a decode the plan had sized for the load
    (28P:4D -> 29P:3D), where decode KV filled and TTFT reached minutes. At the cap the fast
    loop now moves an instance only from a side the plan itself wants smaller; a plan that
    sized both sides holds (the pressure hint still moves one from an idle side)."""
    cap = dict(gpu_budget=256, rebalance_stable_s=20.0)
    starved = ObservedSignals(ttft_p90_s=9.0, prefill_queue_depth=4.0, decode_kv_usage=0.5)
    s = auto_step(inputs(28, 4, **cap), (28, 4), starved, None, T0)
    for k in range(1, 6):
        s = auto_step(inputs(28, 4, current=s, **cap), (28, 4), starved, None, T0 + 30 * k)
    assert s.replicas == (28, 4)


def test_a_saturated_decode_at_the_cap_takes_prefill_at_once() -> None:
    """Auto passes the simulator-proven rush (docs/results/2026-12-06-planner-history.md,
    budget-capped rebalance): at the budget cap, with decode KV full AND requests waiting for
    it, and the planner asking for more decode, prefill's lower target is taken now; KV full
    alone, or a starving prefill, keeps the rebalance wait (a storm's prefill pressure passes;
    a cut decode collapsed)."""
    cap = inputs(6, 2, gpu_budget=64)
    saturated = ObservedSignals(decode_kv_usage=0.97, decode_queue_depth=3.0)
    assert auto_step(cap, (4, 4), saturated, None, T0).prefill < 6
    full_only = ObservedSignals(decode_kv_usage=0.97, decode_queue_depth=0.0)
    assert auto_step(cap, (4, 4), full_only, None, T0).prefill == 6
    starving = ScaleHint(prefill=7, decode=2, reason="prefill queue")
    assert auto_step(cap, (4, 4), saturated, starving, T0).prefill == 6
    assert auto_step(cap, (6, 2), saturated, None, T0).prefill == 6  # the planner is content


def test_budget_is_never_exceeded_counting_pods_still_terminating() -> None:
    """At the cap growth waits for terminating pods: 8 decode pods still exist though the
    spec says 6, so prefill (4 -> 6 wanted) may not grow onto their GPUs yet."""
    s = auto_step(inputs(4, 6, decode_pods=8, gpu_budget=96), (6, 6), QUIET, None, T0)
    assert s.replicas == (4, 6)
    s = auto_step(inputs(4, 6, decode_pods=6, gpu_budget=96), (6, 6), QUIET, None, T0)
    assert s.replicas == (6, 6) and s.replicas[0] * 8 + s.replicas[1] * 8 <= 96


def test_ratio_bounds_hold_every_step() -> None:
    s = auto_step(inputs(2, 4, ratio_max=0.5), (4, 4), QUIET, None, T0)
    assert s.replicas == (2, 4) and "held by ratio bounds" in s.reason
    s = auto_step(inputs(2, 4, ratio_max=0.75), (4, 4), QUIET, None, T0)
    assert s.replicas == (3, 4)


def test_sustained_prefill_pressure_raises_prefill_even_when_the_planner_is_content() -> None:
    """The anomaly loop's starvation hint is the fast loop for prefill (no TTFT signal)."""
    hint = ScaleHint(prefill=3, decode=2, reason="prefill queue")
    s = auto_step(inputs(2, 2), (2, 2), QUIET, hint, T0)
    assert s.replicas == (3, 2)


def test_prefill_timeouts_grow_prefill_not_decode() -> None:
    """Guards Auto against growing decode on a starved prefill's aborts (decode idle)."""
    hint = ScaleHint(prefill=2, decode=2, reason="prefill aborts")
    aborting = ObservedSignals(aborts_per_s=0.02, decode_kv_usage=0.0, decode_queue_depth=0.0)
    s = auto_step(inputs(1, 2), (1, 2), aborting, hint, T0)
    assert s.replicas == (2, 2)


def test_decode_kv_exhaustion_adds_decode() -> None:
    s = auto_step(inputs(2, 2), (2, 2), ObservedSignals(decode_kv_usage=0.97), None, T0)
    assert s.replicas == (2, 3)


def test_state_round_trips_through_status() -> None:
    state = AutoState(3, 5, ControlState(T0, -math.inf, None, T0 + 5, T0 - 60, -math.inf), "why")
    assert AutoState.from_status(state.to_status()) == state
    planned = replace(state, planned=(4, 4))  # the planner's counts, which the next plan keeps
    assert AutoState.from_status(planned.to_status()) == planned
    assert AutoState.from_status({**state.to_status(), "planned": {"prefill": 0}}) == state
    assert AutoState.from_status({"prefill": "x"}) is None
    assert AutoState.from_status(None) is None
    # a status written before growth was kept apart: its last change holds growth as well
    older = {"prefill": 3, "decode": 5, "lastPrefillChange": T0, "lastDecodeChange": None}
    restored = AutoState.from_status(older)
    assert restored is not None and restored.control.last_prefill_growth == T0
    assert math.isinf(restored.control.last_decode_growth)


def test_the_routers_refusals_are_summed_over_the_routers_that_answered() -> None:
    routers = [
        view("r0", c.ROLE_ROUTER, responses=100.0, refused=30.0),
        view("r1", c.ROLE_ROUTER, responses=50.0),  # refused nothing: no 429 series
        PodView("r2", c.ROLE_ROUTER, True, True, None, PodSignals(error="scrape failed")),
    ]
    assert observed_signals(routers, 60.0).refused_rate == 0.5
    assert observed_signals(routers[2:], 60.0).refused_rate is None


# --------------------------------------------------------------- the reconcile applies it


AUTO_SPEC = {
    "model": {"name": "glm-5"},
    "ratio": {"mode": "Auto", "gpuBudget": 64},
    "workload": {"requestRate": 2.0},
}


def pool_replicas(kube: MemoryKube) -> dict[str, int]:
    pools = [o for (k, _), o in kube.objects.items() if k == "Deployment"]
    return {
        o["metadata"]["labels"][c.LABEL_ROLE]: o["spec"]["replicas"]
        for o in pools
        if o["metadata"]["labels"].get(c.LABEL_ROLE) != c.ROLE_ROUTER
    }


def test_reconcile_applies_the_autoscalers_counts_and_says_who_owns_them() -> None:
    kube = MemoryKube()
    out = reconcile(
        kube,  # type: ignore[arg-type]
        name="demo",
        namespace="ns",
        uid="u",
        generation=1,
        raw_spec=AUTO_SPEC,
        full_apply=True,
        measured=Measured(auto_replicas=(3, 2)),
    )
    assert pool_replicas(kube) == {c.ROLE_PREFILL: 3, c.ROLE_DECODE: 2}
    assert out.status["ratio"]["current"] == "3:2"
    assert out.status["ratio"]["replicasOwner"] == "operator (Auto)"


def test_autoscaler_counts_beyond_the_budget_fall_back_to_the_spec() -> None:
    """A stale status.autoscaler (e.g. the budget was lowered since) never breaks a bound."""
    kube = MemoryKube()
    reconcile(
        kube,  # type: ignore[arg-type]
        name="demo",
        namespace="ns",
        uid="u",
        generation=1,
        raw_spec=AUTO_SPEC,
        full_apply=True,
        measured=Measured(auto_replicas=(6, 4)),
    )
    total = sum(pool_replicas(kube).values())
    assert total * 8 <= 64


def test_the_request_shape_is_measured_per_finished_request() -> None:
    """Prompt tokens per prefill request and generated tokens per decode request: the shape
    admission control sizes for (absent series: unknown, never zero)."""
    prefill = PodView("p0", "prefill", True, True,
                      signals=PodSignals(requests=10.0, prompt_tokens=700_000.0))  # fmt: skip
    decode = PodView("d0", "decode", True, True,
                     signals=PodSignals(requests=10.0, generation_tokens=24_000.0))  # fmt: skip
    seen = observed_signals([prefill, decode], 60.0)
    assert (seen.avg_input_tokens, seen.avg_output_tokens) == (70_000.0, 2_400.0)
    assert observed_signals([prefill], 60.0).avg_output_tokens is None


def test_auto_keeps_prefill_while_ttft_is_near_the_slo() -> None:
    """Auto's own step (not only the controller's `fast_adjust`): a planner answer with fewer
    prefill instances is held while TTFT p90 is over 0.8x the SLO and decode is healthy (the
    benchmark's output shift: 15 -> 13 at 4.3 s of a 3 s SLO, then 30-50 s for ten minutes),
    and taken, after its hold, once TTFT is clear of it."""
    near = ObservedSignals(ttft_p90_s=0.9 * SLO.ttft_s, decode_kv_usage=0.6)
    s = auto_step(inputs(8, 8), (6, 8), near, None, T0)
    s = auto_step(inputs(8, 8, current=s), (6, 8), near, None, T0 + 3600)
    assert s.replicas == (8, 8)
    clear = replace(near, ttft_p90_s=0.5 * SLO.ttft_s)
    s = auto_step(inputs(8, 8, current=s), (6, 8), clear, None, T0 + 3601)
    s = auto_step(inputs(8, 8, current=s), (6, 8), clear, None, T0 + 3601 + 901)
    assert s.replicas == (6, 8)
