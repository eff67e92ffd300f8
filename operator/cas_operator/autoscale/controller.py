"""The one replica controller (pure): every change of the pools' instance counts is decided here.

Data flow, once per fleet tick for a resource (driven by `fleet_tick.py`):
1. pressure: sustained one-sided pressure in the pods' signals (`PodView`s) -> `suggest_scale`,
   a hint of one instance more on the starved side (or a shift at the GPU budget); shown in
   `status.anomaly.pressure` in every mode.
2. Auto only (`auto_step`): the planner's counts for the observed load (the slow loop, computed
   by the caller with `autoscale.search.recommend`) -> `fast_adjust` (one more instance on a side
   failing now) -> the pressure hint -> `next_replicas` (bounded step, deadband, scale-down only
   after the lower target held, cooldown >= pod start time, GPU budget counting pods not gone
   yet, at the cap shrink-then-grow, at once when decode is saturated and the planner wants more
   of it) -> ratio bounds -> a new `AutoState`, which the caller keeps in `status.autoscaler`
   (a restarted operator continues from it); the reconcile uses its counts as the pools'
   replicas.
`autoscale.loop.Autoscaler.step` runs both for a resource; `ScaleBounds` is the one ratio-bounds
and budget check.
Nothing here does I/O or reads a clock (`now` comes in).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from cas_operator.autoscale.model import Bounds, ObservedSignals, RatioRecommendation, SloInputs
from cas_operator.autoscale.signals import behind_load
from cas_operator.observe.types import PodView

DEFAULT_POD_START_SECONDS = 600.0  # until pods of this resource have been seen starting


# ---------------------------------------------------------------- pressure: is P:D wrong?


@dataclass(frozen=True)
class PressurePolicy:
    """Levels of the pressure signals; per-instance means over pods with data."""

    queue_high: float = 4.0  # waiting requests per instance that count as queueing
    prefill_aborts_high: float = 1.0  # prefill aborts (time budget) per instance per window
    busy_usage: float = 0.9  # KV usage that counts as a busy decode
    idle_queue: float = 0.5  # at most this many waiting per instance = idle side...
    idle_usage: float = 0.6  # ...and at most this KV usage (decode)
    sustain_observations: int = 3


@dataclass(frozen=True)
class PoolCounts:
    """Desired and ready instances per pool, and GPUs per instance."""

    prefill: int
    decode: int
    prefill_ready: int
    decode_ready: int
    prefill_gpus: int = 1
    decode_gpus: int = 1


@dataclass(frozen=True)
class ScaleBounds:
    """`ratio.min/max/gpuBudget`, plus GPUs a shift may borrow until the other side shrinks.

    The one bounds and budget check of every replica change: the pressure hint, Auto's step
    and the planned counts of a spec (`desired.replicas.budget_errors`) all ask it."""

    ratio_min: float | None = None
    ratio_max: float | None = None
    gpu_budget: int | None = None
    surge_gpus: int = 0

    def ratio_problem(self, prefill: int, decode: int) -> str | None:
        """Which bound P:D `prefill:decode` breaks ("ratio.min" / "ratio.max"), else None."""
        if prefill < 1 or decode < 1:
            return "ratio.min" if prefill < 1 else "ratio.max"
        value = prefill / decode
        if self.ratio_min is not None and value < self.ratio_min - 1e-9:
            return "ratio.min"
        if self.ratio_max is not None and value > self.ratio_max + 1e-9:
            return "ratio.max"
        return None

    def ratio_ok(self, prefill: int, decode: int) -> bool:
        return self.ratio_problem(prefill, decode) is None

    def fits(self, gpus: int, surge: bool = False) -> bool:
        """Whether `gpus` fit the budget (plus the surge allowance when `surge`)."""
        if self.gpu_budget is None:
            return True
        return gpus <= self.gpu_budget + (self.surge_gpus if surge else 0)


@dataclass(frozen=True)
class PressureState:
    prefill_streak: int = 0
    decode_streak: int = 0


@dataclass(frozen=True)
class ScaleHint:
    prefill: int
    decode: int
    reason: str


@dataclass(frozen=True)
class ScaleOutcome:
    hint: ScaleHint | None
    note: str  # why no hint, or what the hint does
    state: PressureState


@dataclass(frozen=True)
class PoolLoad:
    """Per-instance means of one pool's pressure signals (None when no pod had the gauge)."""

    queued: float | None
    aborted: float | None
    usage: float | None


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def pool_load(pods: list[PodView], role: str) -> PoolLoad:
    """Means over the pool's in-rotation pods whose signals are available."""
    sig = [p.signals for p in pods if p.role == role and p.in_rotation]
    ok = [s for s in sig if s is not None and s.error is None]
    return PoolLoad(
        queued=_mean([s.queued for s in ok]),
        aborted=_mean([s.aborted for s in ok]),
        usage=_mean([s.token_usage for s in ok]),
    )


def _prefill_starved(pre: PoolLoad, dec: PoolLoad, p: PressurePolicy) -> bool:
    """Prefill queueing or budget aborts while decode has room: too few prefill instances."""
    pressed = (pre.queued is not None and pre.queued >= p.queue_high) or (
        pre.aborted is not None and pre.aborted >= p.prefill_aborts_high
    )
    idle = (dec.queued is not None and dec.queued <= p.idle_queue) and (
        dec.usage is None or dec.usage <= p.idle_usage
    )
    return pressed and idle


def _decode_starved(pre: PoolLoad, dec: PoolLoad, p: PressurePolicy) -> bool:
    """Decode queueing or a full KV pool while prefill is idle: too few decode instances."""
    pressed = (dec.queued is not None and dec.queued >= p.queue_high) or (
        dec.usage is not None and dec.usage >= p.busy_usage
    )
    return pressed and pre.queued is not None and pre.queued <= p.idle_queue


def _gpus(prefill: int, decode: int, counts: PoolCounts) -> int:
    return prefill * counts.prefill_gpus + decode * counts.decode_gpus


def _finish_shift(counts: PoolCounts, bounds: ScaleBounds) -> ScaleHint | None:
    """Over budget after a surge: shrink the side that did not grow, once the other is ready."""
    if bounds.fits(_gpus(counts.prefill, counts.decode, counts)):
        return None
    if counts.prefill_ready < counts.prefill or counts.decode_ready < counts.decode:
        return None  # never scale one side down before the other's scale-up is ready
    for p, d, side in (
        (counts.prefill, counts.decode - 1, "decode"),
        (counts.prefill - 1, counts.decode, "prefill"),
    ):
        if bounds.ratio_ok(p, d) and bounds.fits(_gpus(p, d, counts)):
            return ScaleHint(p, d, f"shift complete: {side} down by one to return to budget")
    return None


def _grow(counts: PoolCounts, bounds: ScaleBounds, side: str, why: str) -> ScaleOutcome | str:
    """One more instance on `side`, within ratio bounds and budget (+ surge); else a note."""
    p = counts.prefill + (side == "prefill")
    d = counts.decode + (side == "decode")
    if not bounds.ratio_ok(p, d):
        return f"{side} pressure ({why}) but P:D {p}:{d} is outside the ratio bounds"
    if not bounds.fits(_gpus(p, d, counts), surge=True):
        return _shift(counts, bounds, side, why)
    return ScaleOutcome(
        ScaleHint(p, d, f"{side} up by one: {why}"), f"scale {side} up", PressureState()
    )


def _shift(counts: PoolCounts, bounds: ScaleBounds, side: str, why: str) -> ScaleOutcome | str:
    """At the GPU budget (no surge left): one instance moves to `side` from the other pool,
    which is idle (the pressure is one-sided). Published as a suggestion; Auto's step takes it
    by shrinking the other pool first and growing `side` only once the removed pods are gone
    (drain-confirm-then-grow), so the budget holds throughout. Else a note."""
    p = counts.prefill + (1 if side == "prefill" else -1)
    d = counts.decode + (1 if side == "decode" else -1)
    if not bounds.ratio_ok(p, d) or not bounds.fits(_gpus(p, d, counts)):
        return f"{side} pressure ({why}) but the GPU budget is spent"
    other = "decode" if side == "prefill" else "prefill"
    hint = ScaleHint(p, d, f"{side} up by one, {other} down by one at the GPU budget: {why}")
    return ScaleOutcome(hint, f"shift one instance to {side}", PressureState())


def suggest_scale(
    pods: list[PodView],
    counts: PoolCounts,
    bounds: ScaleBounds,
    state: PressureState,
    policy: PressurePolicy | None = None,
) -> ScaleOutcome:
    """One tick of the ratio retuner: sustained one-sided pressure -> one instance more there.

    A hint is never given while either pool is still scaling up (not all desired instances
    ready); a shift that surged above the budget is completed by shrinking the other side only
    once the grown side is ready.
    """
    policy = policy or PressurePolicy()
    pre, dec = pool_load(pods, "prefill"), pool_load(pods, "decode")
    new = PressureState(
        prefill_streak=state.prefill_streak + 1 if _prefill_starved(pre, dec, policy) else 0,
        decode_streak=state.decode_streak + 1 if _decode_starved(pre, dec, policy) else 0,
    )
    finish = _finish_shift(counts, bounds)
    if finish is not None:
        return ScaleOutcome(finish, "completing a shift", new)
    if counts.prefill_ready < counts.prefill or counts.decode_ready < counts.decode:
        return ScaleOutcome(None, "waiting for scaling in progress to become ready", new)
    for side, streak, load in (
        ("prefill", new.prefill_streak, pre),
        ("decode", new.decode_streak, dec),
    ):
        if streak >= policy.sustain_observations:
            why = f"queue {load.queued}, aborts {load.aborted} per instance, {streak} ticks"
            grown = _grow(counts, bounds, side, why)
            if isinstance(grown, str):
                return ScaleOutcome(None, grown, new)
            return replace(grown, state=new)
    return ScaleOutcome(None, "no sustained pressure", new)


# ---------------------------------------------------------------- fast loop


def failing_sides(
    observed: ObservedSignals, slo: SloInputs, tolerance: float = 1.2
) -> tuple[bool, bool]:
    """(prefill failing, decode failing) now: prefill when TTFT p90 is over ``tolerance`` x SLO
    with a prefill queue; decode when its KV is over 95%, when its measured median ITL is over
    ``tolerance`` x the ITL SLO (decode batches set the inter-token time), or TTFT is over with
    transferred requests waiting for decode admission. Aborts are not decode evidence (in PD
    most are prefill time-budget aborts)."""
    ttft_bad = observed.ttft_p90_s is not None and observed.ttft_p90_s > slo.ttft_s * tolerance
    prefill_bad = ttft_bad and (observed.prefill_queue_depth or 0.0) > 0.0
    kv_bad = (observed.decode_kv_usage or 0.0) > 0.95
    itl_bad = observed.itl_ms is not None and observed.itl_ms > slo.itl_ms * tolerance
    decode_bad = kv_bad or itl_bad or (ttft_bad and (observed.decode_queue_depth or 0.0) > 0.0)
    return prefill_bad, decode_bad


def decode_saturated(observed: ObservedSignals, kv_full: float = 0.95) -> bool:
    """Decode is the bottleneck now: its KV is over ``kv_full`` and transferred requests wait
    for admission (stronger evidence than :func:`failing_sides`, whose TTFT-with-a-queue rule
    also fires while a cold prefill pool, not decode, holds the tail)."""
    return (observed.decode_kv_usage or 0.0) > kv_full and (
        observed.decode_queue_depth or 0.0
    ) > 0.0


def rush_to_decode(
    observed: ObservedSignals,
    planned_decode: int,
    current_decode: int,
    prefill_pressed: bool = False,
) -> bool:
    """Whether ``next_replicas`` should rush capacity to decode (its ``decode_failing``):
    decode is the bottleneck (:func:`decode_saturated`), the slow loop's plan itself asks for
    more decode (the fast loop's one-instance nudge keeps the stability wait), and no other
    signal says prefill is short (``prefill_pressed``: the operator's starvation hint, a
    prefill queue with idle decodes). A TTFT over the SLO is no such signal here: it counts
    the wait for decode KV (the planner benchmark's output shift read 77 s)."""
    if not decode_saturated(observed) or planned_decode <= current_decode:
        return False
    return not prefill_pressed


def fast_adjust(
    target: tuple[int, int],
    current: tuple[int, int],
    observed: ObservedSignals,
    slo: SloInputs,
    tolerance: float = 1.2,
    at_budget: bool = False,
    decode_kv_keep: float = 0.8,
    prefill_ttft_keep: float = 0.8,
) -> tuple[int, int]:
    """Fast loop: raise the slow loop's target one instance above the current size on the side
    that is failing now (TTFT p90 over ``tolerance`` x SLO with a prefill queue; decode KV over
    95%, or TTFT over with transferred requests waiting for decode admission). Aborts are not
    decode evidence: in PD most are prefill time-budget aborts, which the anomaly loop's
    pressure hint turns into prefill growth. Off the budget cap it never lowers anything; at
    the cap (``at_budget``) the side that is not failing gives up one instance so the other can
    grow after it drained, unless the slow loop's target wants that side to grow (decode: when
    the target wants it smaller; see the code's comment); with both failing at the cap
    neither is raised and the slow loop's target stands.
    ``next_replicas`` then bounds the steps and orders them.

    Decode is never lowered below the size its observed KV use needs (used fraction x current
    size / ``decode_kv_keep``): a plan for a lower decode count made on other signals (a session
    storm reads as prefill demand, while the sessions it starts will soon fill decode) must not
    cut KV that is in use, since a decode shortage is a cliff under closed-loop traffic. Except
    at the cap while the fleet is behind its load (`signals.behind_load`: TTFT p90 over twice the
    SLO) and decode is not the side failing: decode's KV then holds what the routers let in
    for the current split, and the floor kept a misallocated fleet there for good (planner
    benchmark, output shift, seed 3 at full length: 14P:18D with the plan asking for 16-18
    prefill, TTFT p90 10-15 s to the end of the run, KV 79-93% used). The lower target still
    waits out the rebalance hold and the cooldown (``next_replicas``).

    Prefill is never lowered while TTFT p90 is over ``prefill_ttft_keep`` x the SLO and no
    request waits for decode (then the TTFT is prefill's, or on its way there): the model's
    prefill is optimistic at some shapes, and a plan for fewer prefill instances made from
    lengths and rates alone took a pool already near its TTFT over it (planner benchmark,
    output shift: 15 -> 13 prefill at TTFT p90 4.3 s against a 3 s SLO, with no prefill queue
    counted, then 30-50 s for ten minutes). A failing or queueing decode still takes prefill's
    instance at the cap (its wait is in that TTFT). The price: a pool whose prompts alone keep
    TTFT near the SLO does not shrink at low load either. At the cap a plan that moves prefill
    to decode is not held: the planner reads the measured TTFT (`search.ttft_scale`)."""
    want_p, want_d = target
    prefill_bad, decode_bad = failing_sides(observed, slo, tolerance)
    if prefill_bad:
        want_p = max(want_p, current[0] + 1)
    if decode_bad:
        want_d = max(want_d, current[1] + 1)
    if at_budget and prefill_bad and decode_bad:
        # Both failing at the cap: neither side has a donor, so neither is raised. A raise
        # could not grow (the budget holds it) and only reset the other side's rebalance
        # hold: on real sessions behind round-robin decodes, where prefill's TTFT and
        # decode's KV wait fail together in most windows of a busy fleet, a ramp held 28P:4D
        # for its whole run while every plan from minute 8 asked for 26P:6D
        # (bench.planner_traces, seed 1: 85% of the online bound; 91% with both dropped).
        want_p, want_d = target
    elif at_budget and prefill_bad != decode_bad:
        # Only from a side the slow loop does not itself want to grow: the fast loop corrects
        # what the model misses, it does not overrule the model's own call that a side is short
        # (a closed-loop backlog keeps decode KV full at the right split; taking prefill for it
        # anyway walked a capped fleet from 13P:15D to 11P:17D, away from the plan's 14P:14D).
        # Decode gives an instance only when the plan wants it smaller too: on real sessions,
        # whose TTFT p90 is over the SLO at every split (long cold prefills hold the instances
        # their sessions are homed on), prefill always read as failing, and taking a decode the
        # plan had sized for the load walked a capped fleet from 28P:4D to 29P:3D, where decode
        # KV filled. Without a donor the raise is dropped: it would only reset the holds.
        if prefill_bad and target[1] < current[1]:
            want_d = min(want_d, current[1] - 1)
        elif prefill_bad:
            want_p = target[0]
        elif decode_bad and target[0] <= current[0]:
            want_p = min(want_p, current[0] - 1)
    kv_floor = not (at_budget and behind_load(observed, slo.ttft_s) and not decode_bad)
    if kv_floor and observed.decode_kv_usage is not None and want_d < current[1]:
        in_use = math.ceil(current[1] * observed.decode_kv_usage / decode_kv_keep - 1e-9)
        want_d = max(want_d, min(in_use, current[1]))
    near_slo = (observed.ttft_p90_s or 0.0) > prefill_ttft_keep * slo.ttft_s
    decode_waits = decode_bad or (observed.decode_queue_depth or 0.0) > 0.0
    # ...except at the cap when the plan moves prefill to decode: that is the model's call
    # that decode is short, made knowing the measured TTFT (`search.ttft_scale`), and on real
    # sessions, whose TTFT p90 is near or over the SLO at every split, the hold kept a fleet
    # at 27P:5D for a whole run while its plans asked for 24-26P (the simulator served 19%
    # more at 25P:7D).
    to_decode = at_budget and target[1] > current[1] and target[0] < current[0]
    if want_p < current[0] and near_slo and not decode_waits and not to_decode:
        want_p = current[0]
    return want_p, want_d


# ---------------------------------------------------------------- control


@dataclass(frozen=True)
class CurrentReplicas:
    """Spec replicas per pool and pods that still exist (spec + terminating/draining)."""

    prefill: int
    decode: int
    prefill_pods: int
    decode_pods: int


@dataclass(frozen=True)
class ControlConfig:
    """Controller knobs; ``cooldown_s`` is raised to the pod start time by ``effective``."""

    prefill_gpus: int
    decode_gpus: int
    bounds: Bounds
    pod_start_s: float = 600.0
    cooldown_s: float = 0.0
    max_step_fraction: float = 0.25
    deadband_fraction: float = 0.1
    down_stable_s: float = 900.0
    rebalance_stable_s: float = 300.0
    plan_step_s: float = 120.0  # growth toward the slow loop's plan during a cooldown: this apart

    def cooldown(self) -> float:
        return max(self.cooldown_s, self.pod_start_s)


@dataclass(frozen=True)
class ControlState:
    """What the controller remembers between ticks (the operator keeps it in status).

    A pool's last change (either way) holds its next scale-down for the cooldown; only its last
    growth holds its next growth (a pool cut a moment ago that is short now grows at once)."""

    last_prefill_change: float = -math.inf
    last_decode_change: float = -math.inf
    down_since_prefill: float | None = None
    down_since_decode: float | None = None
    last_prefill_growth: float = -math.inf
    last_decode_growth: float = -math.inf


@dataclass(frozen=True)
class ControlDecision:
    prefill: int
    decode: int
    state: ControlState
    reason: str


@dataclass(frozen=True)
class SideStep:
    """One pool's next replicas, since when a lower target has held, and why."""

    replicas: int
    down_since: float | None
    why: str


def _step_limit(current: int, frac: float) -> int:
    return max(1, math.ceil(current * frac))


def _side_target(
    current: int,
    want: int,
    lo: int,
    hi: int,
    last_change: tuple[float, float],
    down_since: float | None,
    now: float,
    cfg: ControlConfig,
    fleet_units: float = 0.0,
    planned: int | None = None,
) -> SideStep:
    """One pool's next replicas ignoring the budget: bounded step, cooldown, deadband, and a
    scale-down only after the lower target has held for ``down_stable_s``.

    ``last_change`` is (the last change either way, the last growth): the cooldown after the
    first holds a scale-down, after the second a growth beyond ``planned`` (the slow loop's
    count for this pool): a growth the fast signals ask for waits until the pods started last
    are measured, while a growth toward the model's plan (which does not read those pods'
    signals, so cannot run away on them) goes on in bounded steps. The lower target's hold
    clock runs through a cooldown, so a shrink the plan asked for during one is not delayed by
    it a second time.

    A step up is bounded by ``max_step_fraction`` of the larger of this pool and the whole
    fleet counted in this pool's instances (``fleet_units``), so a small pool can take over
    what a large one releases at the budget cap in one step; a step down by the pool itself.

    A target equal to the running count stops the hold clock: the hold is the time a lower
    target has held without a break. Before, a target equal to the running count started the
    clock (as a lower one inside the deadband does), so after a quiet spell the first noisy
    lower target at the cap was taken at once as a rebalance; on real sessions behind
    consistent hashing the fix served 1-9% more on average over three seeds per scenario
    (bench.planner_traces; docs/planner.md, "Current figures")."""
    want = min(max(want, lo), hi)
    cur = min(max(current, lo), hi)
    if cur != current:  # out of bounds: fix immediately, bounds beat cooldown
        return SideStep(cur, None, "bounds")
    if want == current:  # no lower target: no hold clock runs (see the docstring)
        return SideStep(current, None, "steady")
    changed, grew = last_change
    if want > current and now - grew < cfg.cooldown():
        if planned is None or planned <= current or now - grew < cfg.plan_step_s:
            return SideStep(current, None, "cooldown")
        want = min(want, planned)
    if want < current and now - changed < cfg.cooldown():
        return SideStep(current, now if down_since is None else down_since, "cooldown")
    step = _step_limit(current, cfg.max_step_fraction)
    if want > current:
        up = _step_limit(max(current, math.floor(fleet_units)), cfg.max_step_fraction)
        return SideStep(min(want, current + up), None, "up")
    since = now if down_since is None else down_since
    deadband = max(1, math.floor(current * cfg.deadband_fraction))
    if current - want < deadband:  # no scale-in; at the cap its hold can make a rebalance
        return SideStep(current, since, "deadband")
    if now - since < cfg.down_stable_s:
        return SideStep(current, since, "waiting")
    return SideStep(max(want, current - step), None, "down")


def next_replicas(
    current: CurrentReplicas,
    recommendation: RatioRecommendation,
    state: ControlState,
    now: float,
    config: ControlConfig,
    decode_failing: bool = False,
    planned: tuple[int, int] | None = None,
) -> ControlDecision:
    """Bounded, hysteretic step from ``current`` toward ``recommendation``.

    ``planned`` (the slow loop's counts, before the fast loop raised them): growth toward these
    is not held by the cooldown after a growth (see :func:`_side_target`).

    Safety: replicas stay within bounds; GPUs of existing pods (including ones still
    terminating) plus any growth never exceed the budget; a pool grows at the budget cap only
    after the other pool's scale-down has finished (its pods equal its spec).

    ``decode_failing`` (decode saturated now, :func:`decode_saturated`, while prefill is not
    failing; when both fail the fleet is overloaded rather than misallocated): at the cap, when
    the budget blocks decode growth, prefill's lower target (past the deadband) is taken as a
    rebalance step at once, without the ``rebalance_stable_s`` wait that filters noise in the
    slow loop's targets. Only in that direction: a decode shortage is a cliff under closed-loop
    agent traffic (requests wait for KV admission and the wait counts toward TTFT) while a
    prefill shortage stretches the TTFT tail, so capacity is rushed to decode but never taken
    from it in a hurry (a session storm's prefill pressure passes in minutes; a decode pool cut
    for it collapsed and stayed collapsed in the simulator). Cooldown, deadband and step bounds
    still apply, and the growth still waits for the removed prefill pods to go.
    """
    b = config.bounds
    held = current.prefill * config.prefill_gpus + current.decode * config.decode_gpus
    ps = _side_target(
        current.prefill,
        recommendation.n_prefill,
        b.min_prefill,
        b.max_prefill,
        (state.last_prefill_change, state.last_prefill_growth),
        state.down_since_prefill,
        now,
        config,
        held / config.prefill_gpus,
        None if planned is None else planned[0],
    )
    ds = _side_target(
        current.decode,
        recommendation.n_decode,
        b.min_decode,
        b.max_decode,
        (state.last_decode_change, state.last_decode_growth),
        state.down_since_decode,
        now,
        config,
        held / config.decode_gpus,
        None if planned is None else planned[1],
    )
    p, d, why = _fit_budget(current, ps.replicas, ds.replicas, config, planned)
    ps, ds = replace(ps, replicas=p), replace(ds, replicas=d)
    # At the cap a pool that wants to grow is blocked until the other one shrinks: a lower
    # target on the other side that has held for ``rebalance_stable_s`` (instead of the longer
    # scale-in ``down_stable_s``) is then a rebalance step; cooldown and step bounds still
    # apply, and the growth follows only once the removed pods are gone.
    settled = now - config.rebalance_stable_s
    if ps.replicas < min(recommendation.n_prefill, b.max_prefill) and _held(ds, settled):
        ds = _rebalance_down(current.decode, recommendation.n_decode, b.min_decode, config)
    # the rush also cuts through a cooldown (a prefill pool grown minutes ago must not keep a
    # saturated decode waiting for its pod start time), one step per `plan_step_s`
    rushed = now - state.last_prefill_change >= config.plan_step_s
    # (not a target inside the deadband: a stale one-instance target rushed would start a
    # cooldown that blocks the real rebalance; held, it is taken after the rebalance hold)
    rush = decode_failing and ps.why != "deadband" and ps.down_since is not None and rushed
    p_ready = _held(ps, settled) or rush
    if ds.replicas < min(recommendation.n_decode, b.max_decode) and p_ready:
        ps = _rebalance_down(current.prefill, recommendation.n_prefill, b.min_prefill, config)
    p, d = ps.replicas, ds.replicas
    new_state = ControlState(
        last_prefill_change=now if p != current.prefill else state.last_prefill_change,
        last_decode_change=now if d != current.decode else state.last_decode_change,
        down_since_prefill=ps.down_since,
        down_since_decode=ds.down_since,
        last_prefill_growth=now if p > current.prefill else state.last_prefill_growth,
        last_decode_growth=now if d > current.decode else state.last_decode_growth,
    )
    return ControlDecision(p, d, new_state, f"prefill {ps.why}, decode {ds.why}{why}")


def _held(side: SideStep, settled: float) -> bool:
    """A lower target waiting to be taken (or, for a rebalance, inside the deadband) that has
    held since `settled` or before. The deadband is the shrinking pool's: at the cap one
    instance moved from a large pool to a small one is a small change to the first and a large
    one to the second, and a deadband that reset the hold kept a trace scenario's fleet at
    27P:5D while its plans asked for 24-26 prefill for half an hour (docs/planner.md, "Real
    traffic")."""
    waiting = side.why in ("waiting", "deadband")
    return waiting and side.down_since is not None and side.down_since <= settled


def _rebalance_down(current: int, want: int, lo: int, cfg: ControlConfig) -> SideStep:
    """One bounded scale-down step toward ``want`` (never below the floor ``lo``)."""
    step = _step_limit(current, cfg.max_step_fraction)
    return SideStep(max(want, lo, current - step), None, "rebalance")


def _fit_budget(
    current: CurrentReplicas,
    p: int,
    d: int,
    cfg: ControlConfig,
    planned: tuple[int, int] | None = None,
) -> tuple[int, int, str]:
    """Hold growth that would exceed the budget, counting pods that have not gone yet.

    GPUs under the budget go first to growth toward the slow loop's plan (``planned``; decode
    before prefill), then to growth beyond it (the fast loop's one-instance raise; prefill
    before decode; without a plan, all growth is beyond it). Why: at the cap the plan frees an
    instance on one side for the other, and the instance freed is briefly room under the
    budget; a fast-loop raise of the side just shrunk (prefill's TTFT over the SLO, which on
    real sessions it is at every split) took it back before the plan's side could grow, and a
    Mooncake-shaped surge held 27P:5D for a whole run while its plans asked for 24-26 prefill
    (bench.planner_traces, issue 39)."""
    budget = cfg.bounds.gpu_budget
    if budget is None:
        return p, d, ""
    gp, gd = cfg.prefill_gpus, cfg.decode_gpus
    # Pods that exist now (spec + terminating) keep their GPUs; growth adds new pods on top.
    pods_p = max(current.prefill_pods, current.prefill)
    pods_d = max(current.decode_pods, current.decode)
    room = budget - pods_p * gp - pods_d * gd
    want_p, want_d = max(p - current.prefill, 0), max(d - current.decode, 0)
    plan_p, plan_d = planned if planned is not None else (current.prefill, current.decode)
    toward_p = min(want_p, max(plan_p - current.prefill, 0))
    toward_d = min(want_d, max(plan_d - current.decode, 0))
    grow_p = grow_d = 0
    for side, want in (("d", toward_d), ("p", toward_p), ("p", want_p), ("d", want_d)):
        gpus = gd if side == "d" else gp
        have = grow_d if side == "d" else grow_p
        add = max(0, min(want - have, room // gpus))
        room -= add * gpus
        if side == "d":
            grow_d += add
        else:
            grow_p += add
    note = ""
    if grow_p < want_p:
        note = "; prefill growth waits for decode drain/budget"
    if grow_d < want_d:
        note += "; decode growth waits for prefill drain/budget"
    p = current.prefill + grow_p if want_p else p
    d = current.decode + grow_d if want_d else d
    return p, d, note


# ---------------------------------------------------------------- Auto state


STATUS_KEY = "autoscaler"


@dataclass(frozen=True)
class AutoState:
    """The replicas Auto mode set, the controller's memory, the planner's counts it stepped
    toward (which the next plan keeps unless beaten: `ObservedSignals.planned_before`), and why
    (status.autoscaler)."""

    prefill: int
    decode: int
    control: ControlState = field(default_factory=ControlState)
    reason: str = ""
    planned: tuple[int, int] | None = None

    def to_status(self) -> dict[str, Any]:
        cs = self.control
        return {
            "prefill": self.prefill,
            "decode": self.decode,
            "reason": self.reason,
            "lastPrefillChange": _finite(cs.last_prefill_change),
            "lastDecodeChange": _finite(cs.last_decode_change),
            "downSincePrefill": cs.down_since_prefill,
            "downSinceDecode": cs.down_since_decode,
            "lastPrefillGrowth": _finite(cs.last_prefill_growth),
            "lastDecodeGrowth": _finite(cs.last_decode_growth),
            "planned": _counts_status(self.planned),
        }

    @classmethod
    def from_status(cls, raw: Any) -> AutoState | None:
        """The state a previous tick (or operator process) wrote; None when absent or bad."""
        if not isinstance(raw, dict):
            return None
        try:
            changed_p = _epoch(raw.get("lastPrefillChange"))
            changed_d = _epoch(raw.get("lastDecodeChange"))
            control = ControlState(
                last_prefill_change=changed_p,
                last_decode_change=changed_d,
                down_since_prefill=_optional(raw.get("downSincePrefill")),
                down_since_decode=_optional(raw.get("downSinceDecode")),
                # a status written before growth was kept apart: any change counts as growth
                last_prefill_growth=_epoch(
                    raw.get("lastPrefillGrowth", raw.get("lastPrefillChange"))
                ),
                last_decode_growth=_epoch(raw.get("lastDecodeGrowth", raw.get("lastDecodeChange"))),
            )
            reason = str(raw.get("reason", ""))
            planned = _counts(raw.get("planned"))
            return cls(int(raw["prefill"]), int(raw["decode"]), control, reason, planned)
        except (KeyError, TypeError, ValueError):
            return None

    @property
    def replicas(self) -> tuple[int, int]:
        return self.prefill, self.decode


def _finite(value: float) -> float | None:
    return None if math.isinf(value) else round(value, 3)


def _counts_status(counts: tuple[int, int] | None) -> dict[str, int] | None:
    return None if counts is None else {"prefill": counts[0], "decode": counts[1]}


def _counts(raw: Any) -> tuple[int, int] | None:
    """Counts `_counts_status` wrote; None when absent or not two positive counts (a status
    written before the planner's counts were kept has none)."""
    if not isinstance(raw, dict):
        return None
    try:
        p, d = int(raw["prefill"]), int(raw["decode"])
    except (KeyError, TypeError, ValueError):
        return None
    return (p, d) if p > 0 and d > 0 else None


def _epoch(value: Any) -> float:
    return -math.inf if value is None else float(value)


def _optional(value: Any) -> float | None:
    return None if value is None else float(value)


# ---------------------------------------------------------------- one step


@dataclass(frozen=True)
class AutoInputs:
    """Everything one step needs besides the target: sizes, bounds, SLOs, what exists now."""

    current: AutoState
    prefill_pods: int  # pods that exist (incl. terminating), for the budget
    decode_pods: int
    prefill_gpus: int  # per instance
    decode_gpus: int
    slo: SloInputs
    ratio_min: float | None = None
    ratio_max: float | None = None
    gpu_budget: int | None = None
    pod_start_s: float = DEFAULT_POD_START_SECONDS
    down_stable_s: float = ControlConfig.down_stable_s  # ratio.scaleDownStabilizationSeconds
    rebalance_stable_s: float = ControlConfig.rebalance_stable_s  # ratio.rebalance...Seconds

    @property
    def bounds(self) -> ScaleBounds:
        return ScaleBounds(self.ratio_min, self.ratio_max, self.gpu_budget)


def _target(counts: tuple[int, int]) -> RatioRecommendation:
    """`next_replicas` reads only the counts of its recommendation."""
    p, d = counts
    return RatioRecommendation(p, d, 0, 0.0, 0.0, 0.0, 0.0, True, "auto target")


def _between(value: int, a: int, b: int) -> bool:
    return min(a, b) <= value <= max(a, b)


def _within_ratio(
    current: tuple[int, int], proposed: tuple[int, int], bounds: ScaleBounds
) -> tuple[int, int]:
    """As much of the proposed step as keeps P/D inside [lo, hi]: the step itself, else one
    side moved only as far as the bounds allow (never past its proposal), else one side's
    change alone, else no change (a step never leaves the bounds the user set)."""
    (cp, cd), (pp, pd) = current, proposed
    lo, hi = bounds.ratio_min, bounds.ratio_max
    if bounds.ratio_ok(pp, pd):
        return pp, pd
    p = min(max(pp, math.ceil(lo * pd) if lo else 1), math.floor(hi * pd) if hi else pp)
    if p >= 1 and _between(p, cp, pp) and bounds.ratio_ok(p, pd):
        return p, pd
    d = max(pd, math.ceil(pp / hi) if hi else 1)
    d = min(d, math.floor(pp / lo) if lo else d)
    if d >= 1 and _between(d, cd, pd) and bounds.ratio_ok(pp, d):
        return pp, d
    for p, d in ((pp, cd), (cp, pd)):
        if bounds.ratio_ok(p, d):
            return p, d
    return cp, cd


def _at_budget(inputs: AutoInputs) -> bool:
    """No room for one more instance of the smaller kind."""
    used = inputs.current.prefill * inputs.prefill_gpus + inputs.current.decode * inputs.decode_gpus
    return not inputs.bounds.fits(used + min(inputs.prefill_gpus, inputs.decode_gpus))


def _follow(want: int, current: int, hint: int) -> int:
    """A pressure hint moves the target its way: up to at least the hint, or (a shift at the
    budget cap) down to at most it."""
    if hint > current:
        return max(want, hint)
    if hint < current:
        return min(want, hint)
    return want


def auto_step(
    inputs: AutoInputs,
    planned: tuple[int, int],
    observed: ObservedSignals,
    pressure: ScaleHint | None,
    now: float,
) -> AutoState:
    """One damped step from `inputs.current` toward `planned` (the planner's counts for the
    observed load), raised on a side the fast signals say is failing now."""
    cur = inputs.current
    want = fast_adjust(planned, cur.replicas, observed, inputs.slo, at_budget=_at_budget(inputs))
    if pressure is not None:  # sustained one-sided pressure from the anomaly loop
        want = (
            _follow(want[0], cur.prefill, pressure.prefill),
            _follow(want[1], cur.decode, pressure.decode),
        )
    config = ControlConfig(
        prefill_gpus=inputs.prefill_gpus,
        decode_gpus=inputs.decode_gpus,
        bounds=Bounds(gpu_budget=inputs.gpu_budget),
        pod_start_s=inputs.pod_start_s,
        down_stable_s=inputs.down_stable_s,
        rebalance_stable_s=inputs.rebalance_stable_s,
    )
    existing = CurrentReplicas(cur.prefill, cur.decode, inputs.prefill_pods, inputs.decode_pods)
    starving = pressure is not None and pressure.prefill > cur.prefill
    urgent = rush_to_decode(observed, planned[1], cur.decode, starving)
    decision = next_replicas(existing, _target(want), cur.control, now, config, urgent, planned)
    p, d = _within_ratio(cur.replicas, (decision.prefill, decision.decode), inputs.bounds)
    control = decision.state
    if p == cur.prefill:  # the ratio bounds held back the change the decision recorded
        control = replace(
            control,
            last_prefill_change=cur.control.last_prefill_change,
            last_prefill_growth=cur.control.last_prefill_growth,
        )
    if d == cur.decode:
        control = replace(
            control,
            last_decode_change=cur.control.last_decode_change,
            last_decode_growth=cur.control.last_decode_growth,
        )
    why = f"target {want[0]}:{want[1]} (planner {planned[0]}:{planned[1]}); {decision.reason}"
    if (p, d) != (decision.prefill, decision.decode):
        why += f"; {decision.prefill}:{decision.decode} held by ratio bounds"
    return AutoState(p, d, control, why, planned)
