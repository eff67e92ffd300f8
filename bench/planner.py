"""P:D ratio planner benchmark on the fleet simulator (``make bench-planner``).

For each scenario, run side by side on one workload seed:
- ``fixed-1:1``: half the budget to each pool;
- ``best-fixed``: the static split that is best on the steady scenario, used everywhere;
- ``mean-based``: a Dynamo-style throughput planner (mean lengths, fixed 90% hit rate);
- ``ours``: ``ratio.recommend`` + ``next_replicas`` (slow and fast loop), behind the product's
  admission as sglang-router 0.3.2 enforces it (a bucket of what the pools hold before any
  request waits for decode KV, refilled by 1 per router, that gets a token back when a
  response ends: ``with_admission``);
- ``ours-smg``: the same with smg's admission (``router.implementation: smg``): a token bucket
  at the planner's stable rate, and no more requests in flight than the pools hold;
- ``ours-operator``: ``ours`` with the slow loop planning through the operator's own functions
  (``RatioPlannerPolicy.operator_inputs``: the resource's declared workload fields, the
  measured request shape held within its band, the measured rate with the operator's headroom,
  the demand held while throttled; no forecast): the gap to ``ours`` is mostly what the planner
  gains from measuring the workload's mix (p95 prompt, first-turn share, tool pause), which
  the operator does not yet;
- ``exhaustive``: the best static split of the budget for this scenario, found by simulating
  every split (coarse stride, then the neighbourhood of the best);
- ``online-bound`` (scenarios with a shift): hindsight is not reachable online there (the best
  static split of the post-shift window is a bad one before it, and a pod start lies between),
  so the bench also runs a clairvoyant switch: the best split of the pre-shift load until the
  shift, the best of a few post-shift splits (around the exhaustive one) from the instant of
  the shift, with and without the product's admission, the best of these (a reference, not a
  bound: its move is naive). Beside it the pod-start bound: at the shift the fleet holds the
  pre-shift load's best split, and no pod it starts then serves before the pod start time, so
  no online policy beats: the pre-shift best until the shift, then for one pod start time that
  split's goodput at the shifted load (with admission, simulated), then the exhaustive split's
  (each phase at its best static goodput). For the output shift
  it also reports the goodput after the shift against the capacity of the fleet's ready pools
  at the new request shape: what each pair of them serves in the simulator (static, the shifted
  load from the start, the product's admission), and the planner's model's rate for them, as it
  is and calibrated by the settled fleet's measured hit rate as the planner calibrates it.

Reports goodput (requests meeting both SLOs per second), goodput per GPU, SLO attainment,
average and peak GPUs and scale actions; prints one table and writes JSON.

Usage: python bench/planner.py [--quick] [--scale-tables] [--out bench/results/planner.json]
"""

from __future__ import annotations

import argparse
import collections
import functools
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from bench.fleetsim import FleetConfig, Modifier, SessionMix, SessionWorkload
from bench.fleetsim.calibration import simulated_prompts
from bench.fleetsim.engine import (
    ADMISSION_BURST_S,
    ROUTINGS,
    FleetView,
    Limit,
    Metrics,
    SimResult,
    Simulator,
)
from bench.fleetsim.policies import (
    METRIC_WINDOW_S,
    MeanBasedPolicy,
    RatioPlannerPolicy,
    SwitchPolicy,
)
from cas_operator.api.models import WorkloadSpec
from cas_operator.autoscale import profiles as pf
from cas_operator.autoscale.model import (
    Bounds,
    InstanceProfile,
    ModelLimits,
    ObservedSignals,
    SloInputs,
    WorkloadInputs,
)
from cas_operator.autoscale.search import hit_scale, recommend
from cas_operator.autoscale.signals import SHAPE_BAND, Shape, kept_shape
from cas_operator.desired.admission import (
    ROUTER_032_REFILL,
    highest_rate,
    in_flight_at,
    sustainable_rate,
)

SLO = SloInputs(ttft_s=3.0, itl_ms=50.0)
SPEC = pf.load_spec("glm5-fp8-h200")
# Session starts per second of the steady scenario: with SessionMix's defaults (the real
# sessions' figures, 56 requests a session) about 8.6 req/s of 121K-token prompts, near what
# the 256-GPU budget serves at its best split.
STEADY_SESSION_RATE = 0.18


@dataclass(frozen=True)
class Scenario:
    name: str
    mix: SessionMix
    modifiers: tuple[Modifier, ...] = ()
    budget: int = 256
    nic_factor: float = 1.0
    host_cache_factor: float = 1.0
    duration_s: float = 3600.0
    warmup_s: float = 900.0
    breaks_mean_model: str = ""
    shift_s: float | None = None  # when the load shifts for good (its modifiers start there)
    routing: str = "cache_aware"  # a key of `ROUTINGS`: how every method's fleet routes

    def profiles(self) -> tuple[InstanceProfile, InstanceProfile]:
        p = pf.prefill_profile(SPEC)
        d = pf.decode_profile(SPEC)
        p = replace(
            p,
            nic_bytes_per_s=p.nic_bytes_per_s * self.nic_factor,
            flow_bytes_per_s=p.flow_bytes_per_s * self.nic_factor,
            host_cache_tokens=p.host_cache_tokens * self.host_cache_factor,
            pod_start_s=600.0,
        )
        d = replace(
            d,
            nic_bytes_per_s=d.nic_bytes_per_s * self.nic_factor,
            flow_bytes_per_s=d.flow_bytes_per_s * self.nic_factor,
            pod_start_s=600.0,
        )
        return p, d


# How a fleet picks a prefill instance (``--router``, a key of the simulator's `ROUTINGS` but
# `manual`, which needs real sessions: bench.planner_traces): sglang-router's `cache_aware`, or
# smg's `consistent_hashing` on the session's id. The admission of each method is its own
# (`ours`: sglang-router's, `ours-smg`: smg's), so the router changes only the routing.
SYNTHETIC_ROUTINGS = ("cache_aware", "consistent_hashing")


def scenarios(quick: bool, routing: str = "cache_aware") -> list[Scenario]:
    """The issue's scenarios on a 256-GPU budget (32 instances of 8 GPUs), every fleet routed
    by ``routing``."""
    return [replace(sc, routing=routing) for sc in _scenarios(quick)]


def _scenarios(quick: bool) -> list[Scenario]:
    dur = 2400.0 if quick else 3600.0
    base = SessionMix(session_rate=STEADY_SESSION_RATE)
    out = [
        Scenario("steady", base, duration_s=dur),
        Scenario(
            "session-storm",
            base,
            (Modifier("session_rate", 3.0, 1200.0, 1500.0),),
            duration_s=dur,
            breaks_mean_model="cold first turns miss entirely",
        ),
        Scenario(
            "long-tool-pauses",
            replace(base, tool_pause_s=80.0),
            host_cache_factor=0.5,
            duration_s=dur,
            breaks_mean_model="hit rate falls with the working set",
        ),
        Scenario(
            "output-shift",
            base,
            (Modifier("output_tokens", 4.0, 900.0),),
            duration_s=dur,
            breaks_mean_model="decode KV on long-context tails",
            shift_s=900.0,
        ),
        # The NICs at 0.3 of the profile's: one transfer (75K tokens, 4.6 GB) leaves from one
        # prefill rank at 9 GB/s (0.5 s of the 3 s TTFT) and the senders queue under load, so
        # every split pays for the link (best static 18.0 req/s vs 21.5 at full NICs) and
        # 28P:4D collapses on it. At 0.04 (before transfers were per rank) one transfer alone
        # took 3.8 s and every split scored 0.
        Scenario(
            "transfer-bound",
            base,
            nic_factor=0.3,
            duration_s=dur,
            breaks_mean_model="KV transfer link saturates",
        ),
        # At the cap before the shift (prefill-heavy splits serve it best); at 15 minutes the
        # agents turn from reading (large tool results, short answers) to writing (small tool
        # results, long answers, fewer new sessions): the same 224 GPUs still serve it, but
        # the pre-shift best split collapses (quick static runs at two thirds of the steady
        # session rate: 23P:5D 6.7 req/s before, 0 after; 13P-16P 4.3 after), so the planner
        # has to shrink prefill, wait for the drain and grow decode. The 5 minutes before the
        # shift are measured too.
        Scenario(
            "budget-capped-rebalance",
            replace(base, session_rate=STEADY_SESSION_RATE * 2.0 / 3.0),
            (
                Modifier("new_tokens_per_turn", 0.25, 900.0),
                Modifier("output_tokens", 4.0, 900.0),
                Modifier("session_rate", 0.85, 900.0),
            ),
            budget=224,
            duration_s=dur,
            warmup_s=600.0,
            breaks_mean_model="budget cap: shrink prefill, wait for the drain, grow decode",
            shift_s=900.0,
        ),
        Scenario(
            "burst-shorter-than-pod-start",
            base,
            (Modifier("session_rate", 2.5, 1500.0, 1680.0),),
            duration_s=dur,
        ),
    ]
    return out


@functools.cache
def mix_shape(mix: SessionMix) -> tuple[float, float]:
    """(requests per session, mean prompt tokens) of the sessions `mix` draws (sessions end at
    their turn count or at `max_context`, whichever comes first)."""
    prompts = simulated_prompts(mix, 20_000, seed=0)
    return len(prompts) / 20_000, float(prompts.mean())


def _declared(sc: Scenario) -> WorkloadInputs:
    """What a user would write in the resource's workload fields for this scenario."""
    m = sc.mix
    turns, prompt = mix_shape(replace(m, session_rate=1.0))
    return WorkloadInputs(
        request_rate=m.session_rate * turns,
        avg_input_tokens=prompt,
        avg_output_tokens=m.output_tokens,
        first_turn_fraction=1.0 / turns,
        first_turn_input_tokens=m.first_input_tokens,
        tool_pause_s=m.tool_pause_s,
        prefix_cache_hit_rate=0.9,
    )


def _workload_fields(sc: Scenario) -> WorkloadSpec:
    """The same estimates in the resource's `spec.workload` (all the operator's planner has
    besides what it measures); the request rate left to the measurement, as in Auto."""
    d = _declared(sc)
    return WorkloadSpec.model_validate(
        {
            "avgInputTokens": int(d.avg_input_tokens),
            "avgOutputTokens": int(d.avg_output_tokens),
            "prefixCacheHitRate": d.prefix_cache_hit_rate,
        }
    )


def budget_bounds(budget: int) -> Bounds:
    """The replica bounds of a fleet of 8-GPU instances within ``budget`` GPUs: each pool at
    least one instance, the GPU budget the cap."""
    n = budget // 8
    return Bounds(
        min_prefill=1, max_prefill=n - 1, min_decode=1, max_decode=n - 1, gpu_budget=budget
    )


def _bounds(sc: Scenario) -> Bounds:
    return budget_bounds(sc.budget)


@dataclass(frozen=True)
class AdmissionVariant:
    """A candidate change to `router.admission: Auto`, measured here before it goes into the
    product (`bench/admission_variants.py`). `PRODUCT` is the product as it is."""

    shape_band: float = SHAPE_BAND  # the band the request shape is held in (`kept_shape`)
    prefill_allowance_s: float | None = None  # smg's bound: rate x this, not x the TTFT target
    headroom: float = 1.0  # `router.admission.headroom`: on the rate and smg's bound
    # sglang-router 0.3.2 (`ours`): "product", as `desired.admission` sizes it (what the pools
    # hold, a refill of 1 per router) and as it behaves (a token back when a response ends);
    # "rate", sized as before issue 41 (the rate, 5 s of it), as it behaves; "pure-bucket",
    # sized so and taken for a plain token bucket, as this bench did before issue 41
    router_032: str = "product"


PRODUCT = AdmissionVariant()


# the run start (`run_start`) of this benchmark's method names
_BASE_METHOD = {"exhaustive-point": "fixed", "ours-smg": "ours", "ours-operator": "ours"}


def _run(
    sc: Scenario,
    method: str,
    split: tuple[int, int] | None,
    seed: int,
    variant: AdmissionVariant = PRODUCT,
) -> dict[str, Any]:
    p, d = sc.profiles()
    n = sc.budget // 8
    start = run_start(
        _BASE_METHOD.get(method, method),
        split,
        (p, d),
        _declared(sc),
        sc.budget,
        switch_at=sc.shift_s,
        in_flight_bound=method == "ours-smg",
        operator_inputs=_workload_fields(sc) if method == "ours-operator" else None,
        variant=variant,
    )
    n_p, n_d = start.n_prefill, start.n_decode
    cfg = FleetConfig(
        prefill=p,
        decode=d,
        n_prefill=n_p,
        n_decode=n_d,
        max_prefill=n,
        max_decode=n,
        duration_s=sc.duration_s,
        warmup_s=sc.warmup_s,
        seed=seed,
        admission=start.admission,
        routing=ROUTINGS[sc.routing],
    )
    wl = SessionWorkload(sc.mix, sc.modifiers, seed=seed)
    t0 = time.perf_counter()
    res = Simulator(cfg, workload=wl, policy=start.policy).run()
    g = res.goodput(SLO.ttft_s, SLO.itl_ms)
    g.update(
        wall_s=time.perf_counter() - t0,
        peak_gpus=float(res.peak_gpus),
        scale_actions=float(res.scale_actions),
        start=f"{n_p}P:{n_d}D",
        end=f"{res.series[-1]['prefill']:.0f}P:{res.series[-1]['decode']:.0f}D"
        if res.series
        else f"{n_p}P:{n_d}D",
        retractions=float(res.retractions),
        shed=float(res.shed),
        limit_changes=float(_limit_changes(res)),
    )
    if method.startswith("ours") and sc.shift_s is not None:
        g["after_shift"] = after_shift(sc, res, seed, variant)
    return g


def _limit_changes(res: SimResult) -> int:
    """Ticks after warm-up at which the admission limit moved (each one a new router template,
    so a roll of the routers)."""
    rates = [r["admit_rate"] for r in res.series if r["t"] >= res.warmup_s]
    return sum(1 for a, b in itertools.pairwise(rates) if a != b)


def after_shift(
    sc: Scenario, res: SimResult, seed: int, variant: AdmissionVariant = PRODUCT
) -> dict[str, Any]:
    """Goodput after the shift against the ready pools' capacity at the new request shape,
    averaged over the ticks after the shift: what each pair of ready pools serves in the
    simulator (a static split with the shifted load from the start behind the product's default
    admission, sglang-router's rate; `tick_weighted`), and the planner's model's within-SLO rate
    of those pools, as it is and calibrated as the planner calibrates it (`settled_hit_scale`);
    and, once the fleet settled (its last 600 s), the end pools' goodput against the
    simulator's for them."""
    assert sc.shift_s is not None
    p, d = sc.profiles()
    after = res.arrival >= sc.shift_s
    shape = replace(
        _declared(sc),
        avg_input_tokens=float(res.input_tokens[after].mean()),
        avg_output_tokens=float(res.output_tokens[after].mean()),
    )
    ticks = [r for r in res.series if r["t"] >= sc.shift_s]
    settled_ticks = [r for r in ticks if r["t"] >= sc.duration_s - 600.0] or ticks[-1:]
    scale = settled_hit_scale(shape, settled_ticks, p, d, _bounds(sc))
    capacity = ready_pools_capacity(shape, ticks, p, d)
    calibrated = ready_pools_capacity(shape, ticks, p, d, scale)

    @functools.cache
    def simulated(n_p: int, n_d: int) -> float:
        run = _run(shifted_from_start(sc), "fixed-admitted", (n_p, n_d), seed, variant)
        return float(run["goodput_rps"])

    served = tick_weighted(ticks, simulated)
    good = _good(res, sc.shift_s, sc.duration_s)
    end = (int(ticks[-1]["prefill"]), int(ticks[-1]["decode"]))
    settled = _good(res, sc.duration_s - 600.0, sc.duration_s)
    check = simulated(*end)
    end_model = highest_rate(shape, SLO, p, d, *end, within_slo=True)
    end_calibrated = highest_rate(shape, SLO, p, d, *end, within_slo=True, hit_scale=scale)
    return {
        "goodput_rps": good,
        "simulated_capacity_rps": served,
        "share_of_simulated_capacity": good / served if served else 0.0,
        "model_capacity_rps": capacity,
        "share_of_model_capacity": good / capacity if capacity else 0.0,
        "hit_scale": scale,
        "calibrated_capacity_rps": calibrated,
        "share_of_calibrated_capacity": good / calibrated if calibrated else 0.0,
        "end_split": f"{end[0]}P:{end[1]}D",
        "settled_goodput_rps": settled,
        "end_split_simulated_rps": check,
        "end_split_model_rps": end_model,
        "end_split_calibrated_rps": end_calibrated,
        "settled_share_of_simulated": settled / check if check else 0.0,
    }


def tick_weighted(ticks: list[dict[str, float]], serves: Callable[[int, int], float]) -> float:
    """`serves(prefill, decode)` of the ready pools, averaged over `ticks` (the simulator's
    series rows). Each distinct pair of pools is asked once: the pools stay the same for most
    ticks, and an answer may be a search or a whole simulation."""
    pools = collections.Counter((int(r["ready_prefill"]), int(r["ready_decode"])) for r in ticks)
    total = sum(count * serves(n_p, n_d) for (n_p, n_d), count in pools.items())
    return total / max(len(ticks), 1)


def ready_pools_capacity(
    shape: WorkloadInputs,
    ticks: list[dict[str, float]],
    p: InstanceProfile,
    d: InstanceProfile,
    hit_scale: float = 1.0,
) -> float:
    """The model's within-SLO rate of the ready pools at `shape`, averaged over `ticks`, with
    the hit rate rescaled by `hit_scale`."""
    return tick_weighted(
        ticks,
        lambda n_p, n_d: highest_rate(
            shape, SLO, p, d, n_p, n_d, within_slo=True, hit_scale=hit_scale
        ),
    )


def settled_hit_scale(
    shape: WorkloadInputs,
    settled: list[dict[str, float]],
    p: InstanceProfile,
    d: InstanceProfile,
    bounds: Bounds,
) -> float:
    """The planner's calibration of its modelled hit rate (`autoscale.search.hit_scale`: the
    measured over the modelled, at the measured rate and prefill size) from the settled fleet:
    the mean over `settled` (series rows, the last ticks at the end split). The settled fleet's
    and not each tick's: right after a prefill change the sessions moved re-prefill once, a dip
    that says nothing of the pools' capacity (`autoscale.signals.settled_hit_rate`)."""
    n = max(len(settled), 1)
    observed = ObservedSignals(
        arrival_rate=sum(r["arrival_rate"] for r in settled) / n,
        hit_rate=sum(r["hit_rate"] for r in settled) / n,
        prefill_replicas=int(settled[-1]["ready_prefill"]),
    )
    return hit_scale(shape, SLO, p, d, bounds, observed, ModelLimits())


def shifted_from_start(sc: Scenario) -> Scenario:
    """The scenario with its shifted load from the first second (no shift left to react to)."""
    return replace(sc, modifiers=tuple(replace(m, start_s=0.0) for m in sc.modifiers), shift_s=None)


def _good(res: SimResult, t0: float, t1: float) -> float:
    """Requests that arrived in [t0, t1) and met both SLOs, per second."""
    m = (res.arrival >= t0) & (res.arrival < t1)
    ok = (res.ttft[m] <= SLO.ttft_s) & (res.itl[m] * 1000.0 <= SLO.itl_ms)
    return float(ok.sum()) / max(t1 - t0, 1e-9)


ROUTERS = 2  # router replicas (`router.replicas`' default): sglang-router 0.3.2 refills per router


def with_admission(
    policy: Any,
    declared: WorkloadInputs,
    in_flight_bound: bool = False,
    variant: AdmissionVariant = PRODUCT,
) -> tuple[Any, Any]:
    """The product's `router.admission: Auto` next to `policy`, as each router enforces it
    (`desired.admission`), for the request shape the fleet measures (prompt and output tokens
    per request, held within a band by `autoscale.signals.kept_shape`), the declared one until
    it measures. The rate at which the planner's model says the ready pools keep every queue
    stable, and what the pools hold before requests wait for decode KV
    (`desired.admission.in_flight_at`, never below 5 s of the rate): with `in_flight_bound`
    (`router.implementation: smg`) the rate and a bound on the requests in flight at that;
    without (sglang-router 0.3.2), a bucket of that size that gets a token back when a response
    ends, refilled by `ROUTER_032_REFILL` per router (`variant.router_032` for the sizings
    before issue 41). The policy is wrapped to hand its metrics over. `variant` swaps in a
    candidate change (`AdmissionVariant`)."""
    p, d = policy.prefill, policy.decode
    measured: Shape | None = None  # the latest window's, once the fleet has measured one
    kept: Shape | None = None  # as the operator's: nothing until the first measurement

    def observing(now: float, m: Metrics, view: FleetView) -> tuple[int, int]:
        nonlocal measured
        if m.arrival_rate > 0 and m.avg_input_tokens > 0 and m.avg_output_tokens > 0:
            measured = (m.avg_input_tokens, m.avg_output_tokens)
        return policy(now, m, view)  # type: ignore[no-any-return]

    @functools.cache
    def limit(n_p: int, n_d: int, inp: float, out: float) -> Limit | None:
        wl = replace(declared, avg_input_tokens=inp, avg_output_tokens=out)
        stable = sustainable_rate(wl, SLO, p, d, n_p, n_d)
        if not stable:
            return None
        found = stable * variant.headroom
        if not in_flight_bound and variant.router_032 == "pure-bucket":
            return Limit(found)
        if not in_flight_bound and variant.router_032 == "rate":
            return Limit(found, returns=True)
        held = in_flight_at(stable, wl, SLO, d, n_d)
        if variant.prefill_allowance_s is not None:
            held += stable * (variant.prefill_allowance_s - SLO.ttft_s)
        size = max(held * variant.headroom, found * ADMISSION_BURST_S)
        if not in_flight_bound:
            return Limit(ROUTERS * ROUTER_032_REFILL, size=size, returns=True)
        return Limit(found, size)

    def admission(n_p: int, n_d: int) -> Limit | None:
        nonlocal kept
        if n_p < 1 or n_d < 1:
            return None
        kept = kept_shape(kept, measured, variant.shape_band)
        shape = kept or (declared.avg_input_tokens, declared.avg_output_tokens)
        return limit(n_p, n_d, round(shape[0], 1), round(shape[1], 1))

    return observing, admission


@dataclass(frozen=True)
class RunStart:
    """A benchmark run's first replica counts, the policy that moves them (None: they stay)
    and the admission in front of the fleet (None: none)."""

    n_prefill: int
    n_decode: int
    policy: Any = None
    admission: Any = None


def run_start(
    method: str,
    split: tuple[int, int] | None,
    profiles: tuple[InstanceProfile, InstanceProfile],
    declared: WorkloadInputs,
    budget: int,
    *,
    switch_at: float | None = None,
    in_flight_bound: bool = False,
    operator_inputs: WorkloadSpec | None = None,
    metric_window_s: float = METRIC_WINDOW_S,
    variant: AdmissionVariant = PRODUCT,
) -> RunStart:
    """How a run of ``method`` starts, for both planner benchmarks (this one's synthetic
    scenarios and `bench.planner_traces`' real sessions), on ``budget`` GPUs of 8-GPU
    instances (`budget_bounds`):
    - ``fixed``: ``split`` (prefill, decode) throughout, no admission;
    - ``fixed-admitted``: the same behind the product's admission (`with_admission`);
    - ``switch`` / ``switch-admitted``: ``split`` is (prefill before, prefill after) of the
      instances, switched at ``switch_at`` (`SwitchPolicy`), without or behind admission;
    - ``ours``: the planner's plan for ``declared``, then Auto (`RatioPlannerPolicy`, fed
      ``operator_inputs``, the resource's workload fields, when given: it then plans through
      the operator's own functions from what the operator measures) behind the product's
      admission, smg's when ``in_flight_bound``;
    - ``mean-based``: `MeanBasedPolicy` from its own first sizing.
    ``variant`` swaps in a candidate admission (`AdmissionVariant`)."""
    p, d = profiles
    bounds = budget_bounds(budget)
    n = budget // 8
    if method in ("fixed", "fixed-admitted"):
        assert split is not None
        if method == "fixed":
            return RunStart(*split)
        static = SwitchPolicy(split, split, math.inf, n, p, d)
        return RunStart(*split, *with_admission(static, declared, in_flight_bound, variant))
    if method in ("switch", "switch-admitted"):
        assert split is not None and switch_at is not None
        before, after = split
        switch = SwitchPolicy((before, n - before), (after, n - after), switch_at, n, p, d)
        if method == "switch":
            return RunStart(before, n - before, switch)
        admitted = with_admission(switch, declared, in_flight_bound, variant)
        return RunStart(before, n - before, *admitted)
    if method == "ours":
        rec = recommend(declared, SLO, p, d, bounds)
        planner = RatioPlannerPolicy(
            p,
            d,
            SLO,
            bounds,
            operator_inputs=operator_inputs,
            metric_window_s=metric_window_s,
        )
        admitted = with_admission(planner, declared, in_flight_bound, variant)
        return RunStart(rec.n_prefill, rec.n_decode, *admitted)
    if method == "mean-based":
        mean = MeanBasedPolicy(p, d, SLO, bounds)
        isl = declared.avg_input_tokens
        n_p = math.ceil(declared.request_rate * isl / mean.prefill_thpt(isl))
        n_d = math.ceil(declared.request_rate * declared.avg_output_tokens / mean.decode_thpt(isl))
        return RunStart(*mean._clamp(n_p, n_d), mean)
    raise ValueError(method)


def _exhaustive(pool: ProcessPoolExecutor, sc: Scenario, seed: int, stride: int):
    n = sc.budget // 8
    splits = list(range(1, n, stride))
    futs = {k: pool.submit(_run, sc, "exhaustive-point", (k, n - k), seed) for k in splits}
    scores = {k: f.result() for k, f in futs.items()}
    best = max(scores, key=lambda k: scores[k]["goodput_rps"])
    near = [
        k
        for k in range(max(1, best - stride + 1), min(n - 1, best + stride - 1) + 1)
        if k not in scores
    ]
    futs = {k: pool.submit(_run, sc, "exhaustive-point", (k, n - k), seed) for k in near}
    scores.update({k: f.result() for k, f in futs.items()})
    best = max(scores, key=lambda k: scores[k]["goodput_rps"])
    return best, scores


def _online_bound(
    pool: ProcessPoolExecutor, sc: Scenario, seed: int, stride: int, post: dict[str, Any]
) -> dict[str, Any]:
    """The clairvoyant switch (see the module docstring): the pre-shift load's best split,
    then each of the post-shift splits within 2 of the exhaustive one, with and without
    admission; the best of these, with `pod_start_bound` beside it."""
    assert sc.shift_s is not None
    pre, pre_scores = _exhaustive(pool, replace(sc, modifiers=(), shift_s=None), seed, stride)
    n = sc.budget // 8
    best = post["split"]
    posts = range(max(1, best - 2), min(n - 1, best + 2) + 1)
    futs = {
        (k, method): pool.submit(_run, sc, method, (pre, k), seed)
        for k in posts
        for method in ("switch", "switch-admitted")
    }
    (k, method), f = max(futs.items(), key=lambda kv: kv[1].result()["goodput_rps"])
    held = _run(shifted_from_start(sc), "fixed-admitted", (pre, n - pre), seed)
    warm, end, start = sc.warmup_s, sc.duration_s, sc.profiles()[1].pod_start_s
    bound = (
        (sc.shift_s - warm) * pre_scores[pre]["goodput_rps"]
        + start * held["goodput_rps"]
        + (end - sc.shift_s - start) * post["goodput_rps"]
    ) / (end - warm)
    return {
        **f.result(),
        "switch": f"{pre}P:{n - pre}D -> {k}P:{n - k}D",
        "via": method,
        "pod_start_bound_rps": bound,
        "held_split_after_shift_rps": held["goodput_rps"],
    }


def run_bench(
    quick: bool,
    seed: int,
    workers: int,
    only: tuple[str, ...] = (),
    routing: str = "cache_aware",
) -> dict[str, Any]:
    scs = scenarios(quick, routing)
    out: dict[str, Any] = {
        "slo": {"ttft_p90_s": SLO.ttft_s, "itl_ms": SLO.itl_ms},
        "routing": routing,
        "seed": seed,
        "scenarios": {},
    }
    stride = 4 if quick else 2
    with ProcessPoolExecutor(max_workers=workers) as pool:
        steady = _exhaustive(pool, scs[0], seed, stride)
        best_steady = steady[0]
        for sc in scs:
            if only and sc.name not in only:
                continue
            n = sc.budget // 8
            best, scores = steady if sc is scs[0] else _exhaustive(pool, sc, seed, stride)
            steady_share = best_steady / (scs[0].budget // 8)
            bf = min(n - 1, max(1, round(steady_share * n)))
            jobs = {
                "fixed-1:1": pool.submit(_run, sc, "fixed", (n // 2, n - n // 2), seed),
                "best-fixed": pool.submit(_run, sc, "fixed", (bf, n - bf), seed),
                "mean-based": pool.submit(_run, sc, "mean-based", None, seed),
                "ours": pool.submit(_run, sc, "ours", None, seed),
                "ours-smg": pool.submit(_run, sc, "ours-smg", None, seed),
                "ours-operator": pool.submit(_run, sc, "ours-operator", None, seed),
            }
            rows = {k: f.result() for k, f in jobs.items()}
            rows["exhaustive"] = scores[best]
            if sc.shift_s is not None:
                post = {**scores[best], "split": best}
                rows["online-bound"] = _online_bound(pool, sc, seed, stride, post)
            out["scenarios"][sc.name] = {
                "budget": sc.budget,
                "breaks_mean_model": sc.breaks_mean_model,
                "exhaustive_split": f"{best}P:{n - best}D",
                "exhaustive_curve": {
                    f"{k}P:{n - k}D": v["goodput_rps"] for k, v in sorted(scores.items())
                },
                "methods": rows,
            }
            print(f"  done {sc.name}", file=sys.stderr, flush=True)
    return out


def table(result: dict[str, Any]) -> str:
    lines = [
        "| scenario | method | goodput req/s | goodput/GPU (x1000) | SLO attainment | avg GPUs "
        "| peak GPUs | scale actions | P:D start -> end |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, sc in result["scenarios"].items():
        ex = sc["methods"]["exhaustive"]["goodput_rps"]
        for method, r in sc["methods"].items():
            rel = f" ({r['goodput_rps'] / ex:.0%} of exh.)" if ex > 0 else ""
            lines.append(
                f"| {name} | {method} | {r['goodput_rps']:.2f}{rel} | "
                f"{1000 * r['goodput_per_gpu']:.1f} | {r['attainment']:.1%} | "
                f"{r['avg_gpus']:.0f} | {r['peak_gpus']:.0f} | {r['scale_actions']:.0f} | "
                f"{r.get('switch') or r['start'] + ' -> ' + r['end']} |"
            )
    return "\n".join(lines)


def criteria(result: dict[str, Any]) -> list[str]:
    """Ours and the operator's own loop (`ours-operator`, when it ran) against the issue's
    bars, per scenario: >= 95% of the better static split (fixed 1:1, best fixed) and >= 90% of
    exhaustive, or, where the load shifts, of the online bound; and the output shift's goodput
    after the shift against the fleet's capacity."""
    lines = []
    for name, sc in result["scenarios"].items():
        for method in ("ours", "ours-operator"):
            if method in sc["methods"]:
                lines += _criteria(name, method, sc["methods"])
    return lines


def _criteria(name: str, method: str, m: dict[str, Any]) -> list[str]:
    """`criteria`'s lines for one method of one scenario (`m`: the scenario's methods)."""
    ours = m[method]["goodput_rps"]
    static = max(m["fixed-1:1"]["goodput_rps"], m["best-fixed"]["goodput_rps"])
    ex = m["exhaustive"]["goodput_rps"]
    line = f"{name}: {method} {ours:.2f} = {_share(ours, static)} of the better static split, "
    line += f"{_share(ours, ex)} of exhaustive"
    if "online-bound" in m:
        switch = m["online-bound"]["goodput_rps"]
        bound = m["online-bound"]["pod_start_bound_rps"]
        line += (
            f"; {_share(ours, switch)} of the clairvoyant switch ({switch:.2f}), "
            f"{_share(ours, bound)} of the pod-start bound ({bound:.2f})"
        )
    lines = [line]
    shift = m[method].get("after_shift")
    if shift and name == "output-shift":
        lines.append(
            f"  after the shift {shift['goodput_rps']:.2f} req/s = "
            f"{shift['share_of_simulated_capacity']:.0%} of what the ready pools serve in the "
            f"simulator ({shift['simulated_capacity_rps']:.2f}: each pair static, the shifted "
            f"load from the start, the product's admission), "
            f"{shift['share_of_model_capacity']:.0%} of their capacity at the new "
            f"shape in the planner's model ({shift['model_capacity_rps']:.2f}), "
            f"{shift['share_of_calibrated_capacity']:.0%} of it calibrated by the settled "
            f"fleet's hit rate ({shift['calibrated_capacity_rps']:.2f}, hit x"
            f"{shift['hit_scale']:.3f}); settled at "
            f"{shift['end_split']}: {shift['settled_goodput_rps']:.2f} = "
            f"{shift['settled_share_of_simulated']:.0%} of what those pools serve in the "
            f"simulator with the shifted load ({shift['end_split_simulated_rps']:.2f}; the "
            f"model {shift['end_split_model_rps']:.2f}, calibrated "
            f"{shift['end_split_calibrated_rps']:.2f})"
        )
    return lines


def _share(value: float, of: float) -> str:
    return f"{value / of:.0%}" if of > 0 else "n/a"


def scale_tables(seed: int) -> dict[str, Any]:
    """Planner recommendations for 1,000- and 10,000-GPU fleets, with one simulator check
    each of ours vs 1:1 at the same budget."""
    p, d = pf.prefill_profile(SPEC), pf.decode_profile(SPEC)
    out: dict[str, Any] = {}
    for budget in (1000, 10_000):
        rows = []
        n = budget // 8
        for share in (0.3, 0.5, 0.7, 0.9, 1.0):
            rate = _max_rate(p, d, budget) * share
            wl = _scale_workload(rate)
            rec = recommend(wl, SLO, p, d, Bounds(max_prefill=n, max_decode=n, gpu_budget=budget))
            rows.append(
                {
                    "request_rate": rate,
                    "n_prefill": rec.n_prefill,
                    "n_decode": rec.n_decode,
                    "gpus": rec.gpus,
                    "ttft_p90_s": rec.ttft_p90_s,
                    "itl_ms": rec.itl_ms,
                    "hit_rate": rec.hit_rate,
                    "goodput_rps": rec.goodput_rps,
                }
            )
        # simulator check at 90% of the modelled capacity, 30 minutes after warm-up
        rate = rows[3]["request_rate"]
        mix = SessionMix(session_rate=rate / mix_shape(SessionMix(1.0))[0])
        checks = {}
        for label, (n_p, n_d) in {
            "planner": (rows[3]["n_prefill"], rows[3]["n_decode"]),
            "fixed-1:1": (n // 2, n - n // 2),
        }.items():
            cfg = FleetConfig(
                prefill=p,
                decode=d,
                n_prefill=n_p,
                n_decode=n_d,
                max_prefill=n,
                max_decode=n,
                duration_s=2700.0,
                warmup_s=900.0,
                seed=seed,
            )
            t0 = time.perf_counter()
            res = Simulator(cfg, workload=SessionWorkload(mix, seed=seed)).run()
            g = res.goodput(SLO.ttft_s, SLO.itl_ms)
            g["wall_s"] = time.perf_counter() - t0
            g["split"] = f"{n_p}P:{n_d}D"
            checks[label] = g
        out[str(budget)] = {"plans": rows, "sim_check": checks}
    return out


def _scale_workload(rate: float) -> WorkloadInputs:
    """The scale tables' workload: SessionMix's defaults (the real sessions' figures) at
    `rate`."""
    mix = SessionMix(1.0)
    turns, prompt = mix_shape(mix)
    return WorkloadInputs(
        request_rate=rate,
        avg_input_tokens=prompt,
        avg_output_tokens=mix.output_tokens,
        first_turn_fraction=1.0 / turns,
        first_turn_input_tokens=mix.first_input_tokens,
        tool_pause_s=mix.tool_pause_s,
    )


def _max_rate(p: InstanceProfile, d: InstanceProfile, budget: int) -> float:
    """Highest request rate the model says fits the budget within SLOs (bisection)."""
    lo, hi = 0.0, budget * 1.0
    n = budget // 8
    for _ in range(25):
        mid = (lo + hi) / 2
        rec = recommend(_scale_workload(mid), SLO, p, d, Bounds(max_prefill=n, max_decode=n))
        if rec.meets_slo and rec.gpus <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs, coarser exhaustive")
    ap.add_argument("--scale-tables", action="store_true", help="also 1k/10k-GPU tables")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--out", default="bench/results/planner.json")
    ap.add_argument(
        "--only", action="append", default=[], help="run only this scenario (repeatable)"
    )
    ap.add_argument(
        "--router", default="cache_aware", choices=SYNTHETIC_ROUTINGS, help="how fleets route"
    )
    args = ap.parse_args()
    t0 = time.perf_counter()
    result = run_bench(args.quick, args.seed, args.workers, tuple(args.only), args.router)
    print(table(result))
    result["criteria"] = criteria(result)
    print("\n".join(result["criteria"]))
    if args.scale_tables:
        result["scale"] = scale_tables(args.seed)
        for budget, s in result["scale"].items():
            print(f"\n{budget} GPUs")
            for r in s["plans"]:
                print(
                    f"  {r['request_rate']:8.1f} req/s -> {r['n_prefill']}P:{r['n_decode']}D "
                    f"({r['gpus']} GPUs) TTFT p90 {r['ttft_p90_s']:.2f}s "
                    f"ITL {r['itl_ms']:.1f}ms hit {r['hit_rate']:.1%}"
                )
            for k, g in s["sim_check"].items():
                print(
                    f"  sim {k} {g['split']}: goodput {g['goodput_rps']:.1f} req/s, "
                    f"attainment {g['attainment']:.1%}, {g['wall_s']:.1f}s wall"
                )
    result["wall_s"] = time.perf_counter() - t0
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1, default=float)
    print(f"\nwrote {args.out} in {result['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
