"""The autoscale loop's stateful half: per resource, pressure streaks and Auto's last step.

Data flow, once per fleet tick for one resource (called by `fleet_tick.py` after the anomaly
tick, with the pods it left and their signals):
`PodView`s (engines, and routers for their refusals) -> `suggest_scale` (the pressure hint,
every mode) and, for `ratio.mode` Recommend/Auto, `signals.observed_signals` (the measured
load, with the routers' refusals); in Auto, the caller's plan for that load (`PlanNumbers`:
the planner's counts and the instance sizes, from `desired`) ->
`controller.auto_step` -> `AutoscaleResult`: the `status.autoscaler` entry, the measured load
and Auto's counts, which the reconcile reads (`reconcile.core.Measured`).
The measured request shape, which admission sizes the routers' limits for, is held within a
band (`signals.kept_shape`), so the limits move only when the shape really changed. While the
routers refuse or the fleet is behind, the planner sizes for the last unthrottled arrival
rate, not the admitted one (`signals.planning_load`), and for a hit rate measured only once the
prefill pool settled after its last change (Auto's, or a prefill pod that became Ready:
`prefill_changed_at`, `signals.settled_hit_rate`), and while the arrival rate rises, for where
it will be one pod start from now (`signals.forecast`, from the rates of the last ticks); while
the fleet is short of its plan (pods starting), for no less than the rate sized for before it
fell short (`signals.held_while_short`); in Auto, with the split the planner chose last
(`AutoState.planned`), which it keeps at the GPU cap unless another scores clearly more
(`ObservedSignals.planned_before`).
Ownership: `Autoscaler.pressure`, `.auto`, `.shapes`, `.unthrottled`, `.rates` and `.holds` (per
uid, memory only; `status.autoscaler` and `status.admission.requestShape` are the durable copies a
restarted operator resumes from). No I/O here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from cas_operator.api import constants as c
from cas_operator.api.models import CodingAgentServingSpec, RatioMode
from cas_operator.autoscale import signals
from cas_operator.autoscale.controller import (
    DEFAULT_POD_START_SECONDS,
    STATUS_KEY,
    AutoInputs,
    AutoState,
    ControlState,
    PoolCounts,
    PressureState,
    ScaleBounds,
    ScaleOutcome,
    auto_step,
    suggest_scale,
)
from cas_operator.autoscale.model import ObservedSignals, SloInputs
from cas_operator.observe.types import PodView
from cas_operator.types import Manifest, Status, parse_time, rfc3339


@dataclass(frozen=True)
class PlanNumbers:
    """What Auto's step needs from the resource's plan for the measured load."""

    replicas: tuple[int, int]  # the plan's current counts (Auto's, or the spec's before)
    planned: tuple[int, int] | None  # the planner's counts for the load, when it has them
    prefill_gpus: int
    decode_gpus: int
    prefill_nodes: int  # pods per instance
    decode_nodes: int


@dataclass(frozen=True)
class AutoscaleResult:
    scale: ScaleOutcome | None  # the pressure hint (None before the first pass wrote pools)
    entry: Status | None  # status.autoscaler (None in Fixed mode)
    observed: ObservedSignals | None
    auto_replicas: tuple[int, int] | None


@dataclass
class Autoscaler:
    """Per-resource state of the autoscale loop (see the module docstring)."""

    pressure: dict[str, PressureState] = field(default_factory=dict)
    auto: dict[str, AutoState] = field(default_factory=dict)
    shapes: dict[str, signals.Shape] = field(default_factory=dict)  # kept request shapes
    unthrottled: dict[str, float] = field(default_factory=dict)  # last unthrottled arrivals
    rates: dict[str, signals.RateHistory] = field(default_factory=dict)  # recent arrival rates
    holds: dict[str, signals.MoveHold] = field(default_factory=dict)  # the rate before a move

    def step(
        self,
        uid: str,
        spec: CodingAgentServingSpec,
        views: list[PodView],
        pods: Callable[[], list[Manifest]],
        status: Status,
        plan_for: Callable[[ObservedSignals], PlanNumbers | None],
        now: float,
        canary: str | None = None,
    ) -> AutoscaleResult:
        """One tick for one resource; `pods()` reads its engine pods (terminating ones
        included; Recommend and Auto need them, for when a prefill pod became Ready, Auto for
        its budget too, so Fixed never filters the snapshot),
        `status` its current status, `plan_for` plans it for a measured load. While a canary
        runs (`canary`: its revision) the load is still measured over both revisions, but
        nothing is sized from it: the rollout sizes both revisions' pools, and a pool's
        pressure hint or an Auto step against one revision's counts would be wrong; Auto
        keeps its counts until the rollout ends."""
        counts = pool_counts(status)
        scale = None
        if counts is not None and canary is None:
            bounds = ScaleBounds(spec.ratio.min, spec.ratio.max, spec.ratio.gpu_budget)
            scale = suggest_scale(views, counts, bounds, self.pressure.get(uid, PressureState()))
            self.pressure[uid] = scale.state
        window = float(spec.anomaly_guard.window_seconds)
        observed = signals.quantized(signals.observed_signals(views, window))
        observed = self._kept_shape(uid, observed, status)
        if spec.ratio.mode == RatioMode.FIXED:  # only admission reads the load: its shape
            self.auto.pop(uid, None)
            return AutoscaleResult(scale, None, signals.shape_only(observed), None)
        planning = self._planning_load(uid, observed, spec, status)
        engine_pods = pods()
        pod_start = pod_start_seconds(engine_pods)
        planning = self._forecast(uid, planning, window, pod_start, now)
        planning = self._held_while_short(uid, planning, counts, pod_start, now)
        shown = replace(
            observed,
            demand_rate=planning.demand_rate,
            forecast_rate=planning.forecast_rate,
            rate_cv=planning.rate_cv,
        )
        entry: Status = {"observed": observed_status(shown)}
        if uid in self.unthrottled:
            entry[UNTHROTTLED_KEY] = self.unthrottled[uid]
        before = AutoState.from_status(status.get(STATUS_KEY))
        auto = (self.auto.get(uid) or before) if spec.ratio.mode == RatioMode.AUTO else None
        held = signals.hit_held_until(planning, prefill_changed_at(auto, engine_pods), now, window)
        if held is not None:
            planning = replace(planning, hit_rate=None)
            entry[HIT_HELD_KEY] = rfc3339(held)
        if spec.ratio.mode != RatioMode.AUTO:
            self.auto.pop(uid, None)
            return AutoscaleResult(scale, entry, planning, None)
        if canary is not None:
            entry["held"] = f"canary {canary} rolling out: Auto keeps its counts until it ends"
            return AutoscaleResult(scale, entry, planning, auto.replicas if auto else None)
        # the planner keeps its last split at the cap unless another is clearly better
        planning = replace(planning, planned_before=auto.planned if auto else None)
        numbers = plan_for(planning)
        if numbers is None:  # the spec is invalid: the reconcile reports it
            return AutoscaleResult(scale, entry, planning, auto.replicas if auto else None)
        state = self._auto_step(uid, spec, auto, numbers, engine_pods, observed, scale, now)
        entry.update(state.to_status())
        return AutoscaleResult(scale, entry, planning, state.replicas)

    def _kept_shape(self, uid: str, observed: ObservedSignals, status: Status) -> ObservedSignals:
        """The measured load with the request shape this resource keeps (`kept_shape`): this
        process's last one, else what its status kept."""
        kept = self.shapes.get(uid) or signals.shape_in_status(status)
        shape = signals.kept_shape(kept, signals.shape_of(observed))
        if shape is not None:
            self.shapes[uid] = shape
        return signals.with_shape(observed, shape)

    def _planning_load(
        self, uid: str, observed: ObservedSignals, spec: CodingAgentServingSpec, status: Status
    ) -> ObservedSignals:
        """The measured load with the demand the planner sizes for while arrivals are
        throttled (`signals.planning_load`), from this process's last unthrottled rate, else
        the one its status kept."""
        held = self.unthrottled.get(uid)
        if held is None:
            held = unthrottled_in_status(status)
        load = signals.planning_load(observed, held, spec.slo.ttft_seconds)
        if load.unthrottled_rate is not None:
            self.unthrottled[uid] = load.unthrottled_rate
        return load.observed

    def _forecast(
        self, uid: str, planning: ObservedSignals, window: float, horizon: float, now: float
    ) -> ObservedSignals:
        """The planning load with where a rising arrival rate will be one pod start from now
        and how much it varies (`signals.forecast`), from this process's rates of the last
        ticks, each over the short rate window when measured (`signals.trend_reading`; a
        restarted operator starts a new history: no forecast for its first ticks)."""
        rate, counted_over = signals.trend_reading(planning, window)
        history = self.rates.get(uid, signals.RateHistory()).add(now, rate)
        self.rates[uid] = history
        return signals.forecast(planning, history, counted_over, horizon)

    def _held_while_short(
        self,
        uid: str,
        planning: ObservedSignals,
        counts: PoolCounts | None,
        pod_start: float,
        now: float,
    ) -> ObservedSignals:
        """The planning load held at the rate sized for before the fleet fell short of its
        plan, while its pods start (`signals.held_while_short`; memory only: a restarted
        operator holds from its first tick at the plan)."""
        short = counts is not None and (
            counts.prefill_ready < counts.prefill or counts.decode_ready < counts.decode
        )
        hold = self.holds.get(uid, signals.MoveHold())
        held = signals.held_while_short(planning, hold, short, now, pod_start)
        self.holds[uid] = held.hold
        return held.observed

    def _auto_step(
        self,
        uid: str,
        spec: CodingAgentServingSpec,
        current: AutoState | None,
        numbers: PlanNumbers,
        pods: list[Manifest],
        observed: ObservedSignals,
        scale: ScaleOutcome | None,
        now: float,
    ) -> AutoState:
        if current is None or current.replicas != numbers.replicas:
            p, d = numbers.replicas
            current = AutoState(p, d, current.control if current else ControlState())
        inputs = AutoInputs(
            current=current,
            prefill_pods=instances(pods, c.ROLE_PREFILL, numbers.prefill_nodes),
            decode_pods=instances(pods, c.ROLE_DECODE, numbers.decode_nodes),
            prefill_gpus=numbers.prefill_gpus,
            decode_gpus=numbers.decode_gpus,
            slo=SloInputs(ttft_s=spec.slo.ttft_seconds, itl_ms=spec.slo.itl_milliseconds),
            ratio_min=spec.ratio.min,
            ratio_max=spec.ratio.max,
            gpu_budget=spec.ratio.gpu_budget,
            pod_start_s=pod_start_seconds(pods),
            down_stable_s=spec.ratio.scale_down_stabilization_seconds,
            rebalance_stable_s=spec.ratio.rebalance_stabilization_seconds,
        )
        hint = scale.hint if scale is not None else None
        state = auto_step(inputs, numbers.planned or current.replicas, observed, hint, now)
        self.auto[uid] = state
        return state

    def forget(self, live: set[str]) -> None:
        """Drop the state of resources that are gone."""
        kept = (self.pressure, self.auto, self.shapes, self.unthrottled, self.rates, self.holds)
        for states in kept:
            for uid in set(states) - live:
                del states[uid]


UNTHROTTLED_KEY = "unthrottledArrivalRate"  # in status.autoscaler: survives a restart
HIT_HELD_KEY = "hitRateHeldUntil"  # in status.autoscaler: the plan ignores the hit rate till then


def unthrottled_in_status(status: Status) -> float | None:
    """The last unthrottled arrival rate a resource's status kept (`UNTHROTTLED_KEY`)."""
    value = (status.get(STATUS_KEY) or {}).get(UNTHROTTLED_KEY)
    try:
        return float(value) if value is not None and float(value) > 0 else None
    except (TypeError, ValueError):
        return None


def pool_counts(status: Status) -> PoolCounts | None:
    """Desired and ready instances per pool from our own status (None before the first pass)."""
    prefill, decode = status.get("prefill"), status.get("decode")
    if not prefill or not decode:
        return None
    return PoolCounts(
        prefill=int(prefill["replicas"]),
        decode=int(decode["replicas"]),
        prefill_ready=int(prefill.get("readyReplicas", 0)),
        decode_ready=int(decode.get("readyReplicas", 0)),
        prefill_gpus=int(prefill.get("gpusPerInstance", 1)),
        decode_gpus=int(decode.get("gpusPerInstance", 1)),
    )


def instances(pods: list[Manifest], role: str, pods_per_instance: int) -> int:
    """Instances of one role that still hold GPUs (terminating pods included)."""
    count = sum(1 for p in pods if _role(p) == role)
    return -(-count // max(1, pods_per_instance))


def prefill_changed_at(auto: AutoState | None, pods: list[Manifest]) -> float | None:
    """When the prefill pool last changed: Auto's last change to its count, or the latest
    moment a prefill pod became Ready (a new pool, a pod grown, or one replaced), whichever is
    later; None when neither is known. Until the cache settles after it, the measured hit
    rate is a transient (`signals.settled_hit_rate`)."""
    times = [t for p in pods if _role(p) == c.ROLE_PREFILL and (t := _ready_at(p)) is not None]
    if auto is not None and math.isfinite(auto.control.last_prefill_change):
        times.append(auto.control.last_prefill_change)
    return max(times) if times else None


def pod_start_seconds(pods: list[Manifest]) -> float:
    """p90 of creation -> Ready over the resource's pods that became Ready (the autoscaler's
    cooldown is at least this); the default until one has been seen."""
    starts = []
    for pod in pods:
        created = parse_time(pod["metadata"].get("creationTimestamp"))
        ready_at = _ready_at(pod)
        if ready_at is not None and created is not None:
            starts.append(max(1.0, ready_at - created))
    if not starts:
        return DEFAULT_POD_START_SECONDS
    starts.sort()
    return starts[min(len(starts) - 1, int(0.9 * len(starts)))]


def _role(pod: Manifest) -> str | None:
    role: str | None = pod["metadata"].get("labels", {}).get(c.LABEL_ROLE)
    return role


def _ready_at(pod: Manifest) -> float | None:
    """When the pod last became Ready, while it is; None when it is not or its status does
    not say."""
    for cond in pod.get("status", {}).get("conditions", []):
        if cond.get("type") == "Ready" and cond.get("status") == "True":
            return parse_time(cond.get("lastTransitionTime"))
    return None


def observed_status(o: ObservedSignals) -> Status:
    """The measured load as status shows it (None fields left out)."""
    fields = {
        "arrivalRate": o.arrival_rate,
        "hitRate": o.hit_rate,
        "prefillQueue": o.prefill_queue_depth,
        "decodeKvUsage": o.decode_kv_usage,
        "decodeQueue": o.decode_queue_depth,
        "ttftP90Seconds": o.ttft_p90_s,
        "itlMilliseconds": o.itl_ms,
        "abortsPerSecond": o.aborts_per_s,
        "refusedPerSecond": o.refused_rate,
        "demandRate": o.demand_rate,
        "forecastRate": o.forecast_rate,
        "rateVariation": o.rate_cv,
    }
    return {k: v for k, v in fields.items() if v is not None}
