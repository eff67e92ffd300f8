"""The P:D plan search over the queueing model (pure): `recommend` and `scale_down_ok`.

Choice: the fewest GPUs meeting both SLOs, or - when that exceeds the budget - the most
SLO-meeting requests within it, decode first: near the smallest decode pool that holds at the
full rate, the split of the cap with the most requests meeting both SLOs when the decode KV
cliff is a probability (a short decode pool is a cliff under closed-loop agent traffic, a short
prefill pool a longer TTFT tail; `_cliff_split`), scored over the rates the plan may serve,
the most decode of near-ties, and kept from the last tick unless another split scores clearly
more; when the budget cannot hold both, the highest sustainable rate's plan with the leftover
spent decode first.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from cas_operator.autoscale.model import (
    Bounds,
    InstanceProfile,
    ModelLimits,
    ObservedSignals,
    PlanEvaluation,
    RatioRecommendation,
    SloInputs,
    WorkloadInputs,
    decode_state,
    evaluate,
)

# ---------------------------------------------------------------- search


def _first_true(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """Smallest n in [lo, hi] with ok(n), assuming ok is monotone; None when ok(hi) is false."""
    if lo > hi or not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass(frozen=True)
class _Ctx:
    slo: SloInputs
    prefill: InstanceProfile
    decode: InstanceProfile
    bounds: Bounds
    limits: ModelLimits
    hit_scale: float
    ttft_scale: float = 1.0
    planned_before: tuple[int, int] | None = None  # `ObservedSignals.planned_before`

    def eval(self, wl: WorkloadInputs, n_p: int, n_d: int) -> PlanEvaluation:
        return evaluate(
            wl,
            self.slo,
            self.prefill,
            self.decode,
            n_p,
            n_d,
            self.limits,
            self.hit_scale,
            self.ttft_scale,
        )


def _decode_ok(ev: PlanEvaluation) -> bool:
    return ev.itl_ok and ev.kv_ok


def _min_gpu_plan(ctx: _Ctx, wl: WorkloadInputs) -> PlanEvaluation | None:
    """Fewest-GPU feasible plan within the replica bounds (ignores the budget), or None."""
    b = ctx.bounds
    big_p = b.max_prefill
    n_d = _first_true(b.min_decode, b.max_decode, lambda n: _decode_ok(ctx.eval(wl, big_p, n)))
    if n_d is None:
        return None
    best: PlanEvaluation | None = None
    for extra in range(0, 8):
        nd = n_d + extra
        if nd > b.max_decode:
            break
        n_p = _first_true(b.min_prefill, b.max_prefill, lambda n: ctx.eval(wl, n, nd).feasible)  # noqa: B023
        if n_p is None:
            continue
        ev = ctx.eval(wl, n_p, nd)
        if best is None or ev.gpus < best.gpus:
            best = ev
        elif extra > 0 and n_p == best.n_prefill:
            break
    return best


def _goodput_plan(ctx: _Ctx, wl: WorkloadInputs, budget: int) -> tuple[PlanEvaluation, float]:
    """Plan with the most SLO-meeting requests within ``budget`` GPUs: (plan, goodput rate).

    Decode first: near the smallest decode pool whose KV and ITL hold at the full offered rate,
    every other GPU to prefill, the split with the most requests within the SLOs when decode
    KV overflow is a probability (`_cliff_split`), when prefill then keeps up (utilisation
    under 1); its goodput is the offered rate times the predicted TTFT attainment times the
    share of time decode KV holds. Under closed-loop agent traffic a short decode pool is a
    cliff (requests wait for KV admission and the wait counts toward TTFT), a short prefill
    pool only stretches the TTFT tail. When the budget cannot hold both, the highest rate
    whose fewest-GPU plan fits, with the leftover spent decode first (``_spend_leftover``).
    """
    b, gp, gd = ctx.bounds, ctx.prefill.gpus, ctx.decode.gpus
    top_d = min(b.max_decode, (budget - b.min_prefill * gp) // gd)
    n_d = _first_true(b.min_decode, top_d, lambda n: _decode_ok(ctx.eval(wl, b.min_prefill, n)))
    if n_d is not None:
        full = _cliff_split(ctx, wl, budget, n_d)
        if full.prefill_util < 1.0 and full.link_util < 1.0:
            return full, full.cliff_goodput(wl.request_rate)

    def plan_at(rate: float) -> PlanEvaluation | None:
        ev = _min_gpu_plan(ctx, replace(wl, request_rate=rate))
        return ev if ev is not None and ev.gpus <= budget else None

    lo, hi = 0.0, wl.request_rate
    best = None
    for _ in range(14):
        mid = (lo + hi) / 2.0
        ev = plan_at(mid)
        if ev is not None:
            lo, best = mid, ev
        else:
            hi = mid
    if best is None:
        return _best_split(ctx, wl, budget)
    return _spend_leftover(ctx, wl, best, budget, lo), lo


CLIFF_REACH = 2  # decode sizes tried either side of the smallest that holds the load

# The rate a split at the cap is scored over (`_spread_goodput`): three-point Gauss-Hermite
# nodes of a normal around the planned rate with a relative sd of RATE_SPREAD / sqrt(3)
# (11.5%). A plan serves for a pod start or more, and the rate over that time is not the rate
# just measured: on Mooncake's hour of arrivals the mean rate of the next 10-20 minutes was
# within a relative sd of 10% of the last minute's (docs/planner.md, "The search and its
# calibrations").
RATE_SPREAD = 0.2
_RATE_NODES = ((1.0 - RATE_SPREAD, 1.0 / 6.0), (1.0, 2.0 / 3.0), (1.0 + RATE_SPREAD, 1.0 / 6.0))

# Splits scoring within this share of the best are the model's tie: of them, the one with the
# most decode is planned (`leaned_to_decode`). The decode KV cliff is one-sided, and sharper
# in the product than the model's tail: behind round-robin decodes a request waits on its
# own decode, and on real sessions neighbouring splits that scored within 1-2% differed by
# 10-50% in the simulator on the short-of-decode side only (bench.planner_traces: the ramp
# planned 28P:4D at its first minutes' rate, scored 1.5% over 26P:6D, and served 91% of the
# online bound; leaning, 98%).
CLIFF_LEAN = 0.02

# A split at the cap other than the planner's last one must score this much more to replace
# it (`_kept_split`): every move idles the instances it moves for a pod start, and
# neighbouring splits score within a few percent of each other, less than their inputs move
# from tick to tick.
MOVE_MARGIN = 0.05


def _spread_goodput(ctx: _Ctx, wl: WorkloadInputs, n_p: int, n_d: int) -> float:
    """`PlanEvaluation.cliff_goodput` of (n_p, n_d) averaged over the rates the plan may
    serve (`RATE_SPREAD`). Why: the decode KV cliff is one-sided. A split on its edge at the
    measured rate scores a percent or two over its neighbour with one decode instance more,
    and loses half its goodput when the rate is 20% higher; on real sessions the static
    25P:7D served 8.4 req/s through a Mooncake-shaped surge where 27P:5D, the best split at
    its first minutes' rate, served 4.7 (bench.planner_traces)."""
    total = 0.0
    for factor, weight in _RATE_NODES:
        rate = wl.request_rate * factor
        total += weight * ctx.eval(replace(wl, request_rate=rate), n_p, n_d).cliff_goodput(rate)
    return total


def _cliff_split(ctx: _Ctx, wl: WorkloadInputs, budget: int, n_d: int) -> PlanEvaluation:
    """The split of the cap near ``n_d`` (the smallest decode pool whose KV and ITL hold the
    offered rate), every other GPU on prefill, with the most requests meeting both SLOs when
    the decode KV cliff is a probability (`PlanEvaluation.cliff_goodput`) and the rate is
    known to `RATE_SPREAD` (`_spread_goodput`): decode takes an instance more while the
    overflow it avoids costs more requests than the TTFT attainment a prefill instance buys,
    one less while a prefill instance buys more; of splits within `CLIFF_LEAN` of the best,
    the one with the most decode (`leaned_to_decode`). The planner's last split stays unless
    this one scores `MOVE_MARGIN` more (`_kept_split`).

    Why: the hard bound (the 95th percentile of a fixed count of requests under 70% of the
    KV) is a yes/no answer at one rate: decode sat one instance from the cliff where prefill
    had TTFT attainment to spare, and one instance more than the goodput needed where prefill
    was short (real sessions, bench.planner_traces' high load: 25P:7D planned, 26P:6D served
    more; 27P:5D collapsed to half)."""
    b, gp, gd = ctx.bounds, ctx.prefill.gpus, ctx.decode.gpus
    # n_d first, then larger, then smaller: a tie (every split serving none) keeps n_d
    sizes = [n_d + k for k in range(CLIFF_REACH + 1)] + [n_d - k for k in range(1, CLIFF_REACH + 1)]
    splits = []
    for size in sizes:
        n_p = min(b.max_prefill, (budget - size * gd) // gp)
        nd = min(b.max_decode, (budget - n_p * gp) // gd)
        if n_p >= b.min_prefill and nd >= b.min_decode:
            splits.append((n_p, nd))
    if not splits:  # (n_d fits at the minimum prefill: the caller found it there)
        return ctx.eval(wl, b.min_prefill, n_d)
    scored = [(_spread_goodput(ctx, wl, n_p, nd), (n_p, nd)) for n_p, nd in splits]
    score, best = leaned_to_decode(scored)
    kept = _kept_split(ctx, wl, budget, best, score)
    return ctx.eval(wl, *(best if kept is None else kept))


def leaned_to_decode(scored: list[tuple[float, tuple[int, int]]]) -> tuple[float, tuple[int, int]]:
    """Of (score, (prefill, decode)) splits, the one with the most decode among those scoring
    within `CLIFF_LEAN` of the best (the first best when none scores above zero)."""
    top = max(scored, key=lambda s: s[0])
    if top[0] <= 0.0:
        return top
    near = [s for s in scored if s[0] >= (1.0 - CLIFF_LEAN) * top[0]]
    return max(near, key=lambda s: s[1][1])


def _kept_split(
    ctx: _Ctx, wl: WorkloadInputs, budget: int, best: tuple[int, int], score: float
) -> tuple[int, int] | None:
    """The planner's last split at this cap (its decode count, every other GPU on prefill)
    when it still keeps up and scores within `MOVE_MARGIN` of ``best``; else None (also when
    ``best`` serves none: every split ties at zero, and the tie goes to the smallest decode
    pool that holds the rate, not to a last split that may be short of decode). Why: on
    real sessions at a steady load the plan followed its inputs' noise between 27P:5D, 26P:6D
    and 25P:7D, changing the fleet seven times in 40 minutes where the best static split
    needed none, and a move reversed before its pods were Ready idled them for nothing
    (bench.planner_traces)."""
    if ctx.planned_before is None or score <= 0.0:  # nothing serves: no margin to keep within
        return None
    b, gp, gd = ctx.bounds, ctx.prefill.gpus, ctx.decode.gpus
    n_d = ctx.planned_before[1]
    n_p = min(b.max_prefill, (budget - n_d * gd) // gp)
    if (n_p, n_d) == best or n_p < b.min_prefill or not b.min_decode <= n_d <= b.max_decode:
        return None
    ev = ctx.eval(wl, n_p, n_d)
    if ev.prefill_util >= 1.0 or ev.link_util >= 1.0:
        return None
    return (n_p, n_d) if _spread_goodput(ctx, wl, n_p, n_d) >= (1 - MOVE_MARGIN) * score else None


def _best_split(ctx: _Ctx, wl: WorkloadInputs, budget: int) -> tuple[PlanEvaluation, float]:
    """No plan meets the p90 target at any rate: pick the split of the budget with the most
    requests meeting both SLOs (coarse scan, then the neighbourhood of the best); among splits
    that serve none within them (the offered rate is past what any split serves), the one
    whose busiest side is least loaded (`_worst_load`), which keeps its queues stable to the
    highest rate. Without that order the tie went to the first split scanned: 1P:31D at the
    planner benchmark's output shift, when a measured hit rate below the model's made the
    TTFT target unreachable."""
    b, gp, gd = ctx.bounds, ctx.prefill.gpus, ctx.decode.gpus

    def at(n_p: int) -> tuple[tuple[float, float], PlanEvaluation] | None:
        n_d = min((budget - n_p * gp) // gd, b.max_decode)
        if n_d < b.min_decode:
            return None
        ev = ctx.eval(wl, n_p, n_d)
        return (ev.expected_goodput(wl.request_rate), -_worst_load(ev, ctx.limits)), ev

    hi = min(b.max_prefill, (budget - b.min_decode * gd) // gp)
    if hi < b.min_prefill:
        return ctx.eval(wl, b.min_prefill, b.min_decode), 0.0
    stride = max(1, (hi - b.min_prefill) // 40)
    scored = [r for n in range(b.min_prefill, hi + 1, stride) if (r := at(n)) is not None]
    best = max(scored, key=lambda r: r[0])
    around = range(
        max(b.min_prefill, best[1].n_prefill - stride), min(hi, best[1].n_prefill + stride) + 1
    )
    scored = [r for n in around if (r := at(n)) is not None] + [best]
    (good, _), ev = max(scored, key=lambda r: r[0])
    return ev, good


def _worst_load(ev: PlanEvaluation, limits: ModelLimits) -> float:
    """The busiest side's load at the offered rate, each against its limit: prefill and link
    utilisation over their caps, the decode KV the load needs over the KV kept for it."""
    return max(
        ev.prefill_util / limits.max_prefill_util,
        ev.link_util / limits.max_link_util,
        ev.decode_kv_need_fraction,
    )


def _spend_leftover(
    ctx: _Ctx, wl: WorkloadInputs, plan: PlanEvaluation, budget: int, rate: float
) -> PlanEvaluation:
    """Give GPUs left under the budget by the plan that sustains ``rate``: decode first, up to
    the size whose KV and ITL hold at the full offered rate, then prefill, then decode again.

    Why this order: under closed-loop agent traffic an overloaded decode pool is a cliff (every
    request waits for KV admission and that wait counts toward TTFT), while an overloaded
    prefill pool degrades per instance (sticky routing queues only the hot instances). A
    proportional split of the leftover gives nearly all of it to the larger prefill side and
    leaves decode at the edge of its KV capacity - the budget-cap failure the simulator showed.
    """
    b = ctx.bounds
    gp, gd = ctx.prefill.gpus, ctx.decode.gpus
    n_p, n_d = plan.n_prefill, plan.n_decode
    left = budget - (n_p * gp + n_d * gd)
    room_d = min(b.max_decode - n_d, max(left, 0) // gd)
    want_d = _first_true(n_d, n_d + room_d, lambda n: _decode_ok(ctx.eval(wl, plan.n_prefill, n)))
    n_d = n_d + room_d if want_d is None else want_d
    left = budget - (n_p * gp + n_d * gd)
    n_p += min(b.max_prefill - n_p, max(left, 0) // gp)
    left = budget - (n_p * gp + n_d * gd)
    n_d += min(b.max_decode - n_d, max(left, 0) // gd)
    return ctx.eval(replace(wl, request_rate=rate), n_p, n_d)


def _plan(ctx: _Ctx, wl: WorkloadInputs) -> tuple[PlanEvaluation, float, bool]:
    """(plan, goodput rate, meets SLO at the full rate)."""
    ev = _min_gpu_plan(ctx, wl)
    budget = ctx.bounds.gpu_budget
    if ev is not None and (budget is None or ev.gpus <= budget):
        return ev, wl.request_rate, True
    if budget is None:
        plan, rate = _unbudgeted_best_effort(ctx, wl)
    else:
        plan, rate = _goodput_plan(ctx, wl, budget)
    return plan, rate, False


def _unbudgeted_best_effort(ctx: _Ctx, wl: WorkloadInputs) -> tuple[PlanEvaluation, float]:
    """No budget and no plan meets the SLOs within the bounds: the fewest GPUs reaching (within
    half a point) the best TTFT attainment the bounds allow, on the smallest workable decode;
    when no count serves any request within the SLOs, the fewest prefill instances under
    their utilisation cap (every count tied at zero, the fewest GPUs was 1 prefill)."""
    b = ctx.bounds
    n_d = _first_true(
        b.min_decode, b.max_decode, lambda n: _decode_ok(ctx.eval(wl, b.max_prefill, n))
    )
    n_d = b.max_decode if n_d is None else n_d
    top = ctx.eval(wl, b.max_prefill, n_d).expected_goodput(wl.request_rate)
    if top <= 0.0:  # no count serves any within the SLOs: the fewest that keep up
        cap = ctx.limits.max_prefill_util
        n_p = _first_true(
            b.min_prefill, b.max_prefill, lambda n: ctx.eval(wl, n, n_d).prefill_util < cap
        )
        ev = ctx.eval(wl, b.max_prefill if n_p is None else n_p, n_d)
        return ev, 0.0
    n_p = _first_true(
        b.min_prefill,
        b.max_prefill,
        lambda n: ctx.eval(wl, n, n_d).expected_goodput(wl.request_rate) >= top * 0.995,
    )
    ev = ctx.eval(wl, b.max_prefill if n_p is None else n_p, n_d)
    return ev, ev.expected_goodput(wl.request_rate)


def _reason(ev: PlanEvaluation, meets: bool, rate: float, full: float, capped: bool) -> str:
    ratio = f"{ev.n_prefill}P:{ev.n_decode}D"
    detail = (
        f"hit {ev.hit_rate:.0%}, prefill util {ev.prefill_util:.0%}, "
        f"TTFT p90 {ev.ttft_p90_s:.2f}s, ITL {ev.itl_ms:.1f}ms, "
        f"decode KV {ev.decode_kv_need_fraction:.0%}, link {ev.link_util:.0%}"
    )
    if meets:
        return f"{ratio} is the fewest GPUs ({ev.gpus}) meeting both SLOs: {detail}"
    if not capped:
        return (
            f"{ratio} is the best the replica bounds allow ({ev.gpus} GPUs): "
            f"{rate:.1f} of {full:.1f} req/s within SLO; {detail}"
        )
    if rate <= 0.0:
        return (
            f"no split of the cap ({ev.gpus} GPUs) serves {full:.1f} req/s within SLO; "
            f"{ratio}: {detail}"
        )
    return (
        f"{ratio} maximises goodput at the cap ({ev.gpus} GPUs): "
        f"{rate:.1f} of {full:.1f} req/s within SLO; {detail}"
    )


def recommend(
    workload: WorkloadInputs,
    slo: SloInputs,
    prefill: InstanceProfile,
    decode: InstanceProfile,
    bounds: Bounds = Bounds(),
    observed: ObservedSignals | None = None,
    limits: ModelLimits = ModelLimits(),
) -> RatioRecommendation:
    """Recommend (N_P, N_D) for ``workload`` (rate replaced by the observed one when larger).

    ``observed.hit_rate`` measured at ``observed.prefill_replicas`` rescales the modelled
    returning-turn hit probability (clamped to [0.5, 1.5]); ``observed.decode_kv_usage`` at
    ``observed.decode_replicas`` rescales the modelled decode KV need (clamped to [1.0, 2.5]);
    ``observed.ttft_p90_s`` at both stretches the modelled TTFT (`ttft_scale`);
    ``observed.planned_before`` is kept at the GPU cap unless a split beats it (`_kept_split`).
    Other prefill shapes are compared by ``cas_operator.desired.recommend.shape_advice``.
    """
    wl = workload.resolved()
    seen = wl  # the load the observations were made at (the forecast may be higher)
    if observed is not None and observed.arrival_rate is not None:
        seen = replace(wl, request_rate=observed.arrival_rate)
        wl = replace(wl, request_rate=max(wl.request_rate, observed.arrival_rate))
    scale = hit_scale(seen, slo, prefill, decode, bounds, observed, limits)
    limits = replace(limits, kv_scale=_kv_scale(seen, decode, observed))
    stretch = ttft_scale(seen, slo, prefill, decode, observed, limits, scale)
    before = observed.planned_before if observed is not None else None
    ctx = _Ctx(slo, prefill, decode, bounds, limits, scale, stretch, before)
    ev, rate, meets = _plan(ctx, wl)
    return RatioRecommendation(
        n_prefill=ev.n_prefill,
        n_decode=ev.n_decode,
        gpus=ev.gpus,
        ttft_p90_s=ev.ttft_p90_s,
        itl_ms=ev.itl_ms,
        hit_rate=ev.hit_rate,
        goodput_rps=rate,
        meets_slo=meets,
        reason=_reason(ev, meets, rate, wl.request_rate, bounds.gpu_budget is not None),
    )


def _kv_scale(
    wl: WorkloadInputs, decode: InstanceProfile, observed: ObservedSignals | None
) -> float:
    """Observed / modelled mean decode KV use at the observed decode size, clamped to
    [1.0, 2.5]; 1.0 without a usable observation or when the fleet is nearly idle. Never below
    1: the model already counts ~10-15% fewer active requests than a fleet holds (the batch a
    request sees is above the time-average batch), so a lower reading is a transient (new,
    short sessions whose contexts have not grown yet), not spare decode."""
    if observed is None or observed.decode_kv_usage is None or not observed.decode_replicas:
        return 1.0
    w = wl.resolved()
    active, _ = decode_state(w, decode, observed.decode_replicas)
    if not math.isfinite(active):
        return 1.0
    model = active * (w.avg_input_tokens + w.avg_output_tokens / 2.0) / decode.kv_capacity_tokens
    if model < 0.05:
        return 1.0
    return min(2.5, max(1.0, observed.decode_kv_usage / model))


def hit_scale(
    wl: WorkloadInputs,
    slo: SloInputs,
    prefill: InstanceProfile,
    decode: InstanceProfile,
    bounds: Bounds,
    observed: ObservedSignals | None,
    limits: ModelLimits,
) -> float:
    """Observed / modelled hit rate at the observed prefill size, clamped to [0.5, 1.5]."""
    if observed is None or observed.hit_rate is None or not observed.prefill_replicas:
        return 1.0
    n_d = bounds.max_decode  # decode size only shifts the session cycle; keep it unsaturated
    model = evaluate(wl, slo, prefill, decode, observed.prefill_replicas, n_d, limits).hit_rate
    if model <= 0.0:
        return 1.0
    return min(1.5, max(0.5, observed.hit_rate / model))


TTFT_SCALE_MAX = 2.5
TTFT_CALIBRATION_OVERLOAD = 2.0  # a TTFT p90 over this x the SLO is a backlog, not the model's


def ttft_scale(
    wl: WorkloadInputs,
    slo: SloInputs,
    prefill: InstanceProfile,
    decode: InstanceProfile,
    observed: ObservedSignals | None,
    limits: ModelLimits,
    hit: float = 1.0,
) -> float:
    """Measured / modelled TTFT p90 at the observed pools and rate, clamped to [1,
    `TTFT_SCALE_MAX`]; 1 without a usable observation. While the fleet is behind its load
    (TTFT p90 over `TTFT_CALIBRATION_OVERLOAD` x the SLO, a backlog the model does not
    describe) the cap: a window in which the fleet falls behind is never read as the model
    being right. Never below 1, as the KV calibration: a TTFT under the model's is read as a
    quiet window, not as spare prefill. Why: on real sessions the model's TTFT tail was short
    (first prompts with heavier tails than its classes, long cold prefills that hold an
    instance while the sessions homed on it wait), and it planned fewer prefill instances than
    the fleet needed (docs/planner.md, "Real traffic")."""
    if (
        observed is None
        or observed.ttft_p90_s is None
        or not observed.prefill_replicas
        or not observed.decode_replicas
    ):
        return 1.0
    if observed.ttft_p90_s > TTFT_CALIBRATION_OVERLOAD * slo.ttft_s:
        return TTFT_SCALE_MAX  # behind its load: never read as room to shrink prefill
    model = evaluate(
        wl, slo, prefill, decode, observed.prefill_replicas, observed.decode_replicas, limits, hit
    ).ttft_p90_s
    if not math.isfinite(model) or model <= 0.0:
        return 1.0
    return min(TTFT_SCALE_MAX, max(1.0, observed.ttft_p90_s / model))


def scale_down_ok(
    workload: WorkloadInputs,
    slo: SloInputs,
    prefill: InstanceProfile,
    decode: InstanceProfile,
    n_prefill: int,
    n_decode: int,
    limits: ModelLimits = ModelLimits(),
) -> bool:
    """Whether a smaller plan still meets both SLOs, with the hit rate recomputed for the
    smaller prefill cache (a fixed-hit-rate check would miss the loss the scale-down causes)."""
    return evaluate(workload, slo, prefill, decode, n_prefill, n_decode, limits).feasible
