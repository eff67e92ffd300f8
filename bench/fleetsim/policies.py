"""Replica policies run inside the fleet simulator: ours, fixed, and a mean-based baseline.

A policy is called every simulator tick with lagged :class:`Metrics` and the :class:`FleetView`
and returns target (prefill, decode) replicas. State lives in the policy object.

- :class:`FixedPolicy`: constant replicas (today's ``Fixed`` mode).
- :class:`SwitchPolicy`: clairvoyant, for the online bound of a shift scenario only: one split
  until the shift, another from the instant it happens (shrinking first, growing into the GPUs
  freed, as the budget allows); no online policy knows either the instant or the new split.
- :class:`RatioPlannerPolicy`: ours. Slow loop: every ``slow_s`` the model in ``ratio.py`` is
  run on a forecast (max of the recent and smoothed arrival rate, times a headroom) built from
  the observed lengths, first-turn share and tool pauses; its recommendation passes through
  ``next_replicas`` (bounded steps, hysteresis, cooldown >= pod start, budget incl. draining
  pods, drain-confirm-then-grow). While a side is failing the slow loop re-plans after
  ``replan_s`` (the load no longer matches the plan). Fast loop: every tick, when TTFT p90 or
  decode KV is over its limit, one bounded step above the slow target on the side at fault;
  at the cap, a saturated decode with a healthy prefill takes prefill's rebalance step at once.
  With ``operator_inputs`` (the bench's ``ours-operator``) the slow loop plans from what the
  operator has instead: the resource's declared workload with the request shape the fleet
  measured, held within its band (``desired.recommend.planner_workload``,
  ``autoscale.signals.kept_shape``), the measured rate with the operator's headroom
  (``desired.recommend.planned_rate``), held while the routers refuse or the fleet is behind
  (``autoscale.signals.planning_load``), raised while it rises to where it will be one pod
  start later (``autoscale.signals.forecast``, on the arrival rates of the last ticks, as the
  operator keeps them), and the model's hit rate rescaled by the
  measured one once the prefill pool has settled after its last change or a prefill pod's start
  (``autoscale.signals.settled_hit_rate``), and on real sessions the prefill engines' prompt
  reuse times (``Metrics.reuse``, quantised as the operator quantises them), from which the
  model draws its hit-rate curve; the p95 prompt, first-turn share and tool pause, which the
  operator does not measure, are the planner's defaults.
- :class:`MeanBasedPolicy`: a Dynamo-style throughput planner from its published equations:
  ``N_P = ceil(rate * ISL / thpt_P)`` and ``N_D = ceil(rate * OSL / thpt_D)``, where the
  per-instance throughputs come from the profile at mean lengths, a fixed prefix hit rate and
  the ITL target, and the load prediction is the last interval's rate; no KV-capacity, tail,
  transfer or plan-dependent hit-rate terms, scaled every interval without hysteresis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from cas_operator.api.models import WorkloadSpec
from cas_operator.autoscale.controller import (
    ControlConfig,
    ControlState,
    CurrentReplicas,
    failing_sides,
    fast_adjust,
    next_replicas,
    rush_to_decode,
)
from cas_operator.autoscale.model import (
    Bounds,
    InstanceProfile,
    ModelLimits,
    ObservedSignals,
    RatioRecommendation,
    SloInputs,
    WorkloadInputs,
)
from cas_operator.autoscale.reuse import quantized_profile
from cas_operator.autoscale.search import recommend
from cas_operator.autoscale.signals import (
    MoveHold,
    RateHistory,
    Shape,
    forecast,
    held_while_short,
    kept_shape,
    planning_load,
    settled_hit_rate,
    trend_reading,
)
from cas_operator.desired.recommend import planned_rate, planner_workload

from .engine import FleetConfig, FleetView, Metrics

METRIC_WINDOW_S = FleetConfig.metric_window_s  # the window the simulator's metrics cover by default
FLEET_READY_S = 0.0  # the simulated fleet's first pods are Ready, caches cold, at its start


@dataclass
class FixedPolicy:
    prefill: int
    decode: int

    def __call__(self, now: float, m: Metrics, fleet: FleetView) -> tuple[int, int]:
        return self.prefill, self.decode


@dataclass
class SwitchPolicy:
    """``before`` until ``at``, then ``after`` within ``budget`` instances (see the module)."""

    before: tuple[int, int]
    after: tuple[int, int]
    at: float
    budget: int  # instances (the GPU budget / GPUs per instance)
    prefill: InstanceProfile  # the profiles `with_admission` sizes the limit from
    decode: InstanceProfile

    def __call__(self, now: float, m: Metrics, fleet: FleetView) -> tuple[int, int]:
        if now < self.at:
            return self.before
        p, d = self.after
        if p > fleet.prefill:  # grow into what the other pool's pods left
            p = max(fleet.prefill, min(p, self.budget - fleet.decode_pods))
        if d > fleet.decode:
            d = max(fleet.decode, min(d, self.budget - max(fleet.prefill_pods, p)))
        return p, d


def _rates_of(m: Metrics) -> ObservedSignals:
    """The window's and the recent arrival rate, as the operator measures them."""
    return ObservedSignals(arrival_rate=m.arrival_rate, recent_arrival_rate=m.recent_arrival_rate)


@dataclass
class RatioPlannerPolicy:
    """Ours: model-based slow loop + bounded fast loop through ``next_replicas``."""

    prefill: InstanceProfile
    decode: InstanceProfile
    slo: SloInputs
    bounds: Bounds
    slow_s: float = 300.0
    replan_s: float = 120.0  # earliest re-plan while a side is failing (the load has changed)
    start_s: float = 150.0  # first slow loop once the metric window holds real traffic
    calibrate: bool = True  # rescale the decode KV model by the observed KV use
    headroom: float = 1.1
    smoothing: float = 0.3
    down_stable_s: float = 600.0
    max_step_fraction: float = 0.25
    shared_prefix_tokens: float = 2000.0
    limits: ModelLimits = field(default_factory=ModelLimits)
    state: ControlState = field(default_factory=ControlState)
    target: tuple[int, int] | None = None
    last_slow: float = -math.inf
    ewma_rate: float | None = None
    last_rec: RatioRecommendation | None = None
    recommendations: int = 0
    healthy: Metrics | None = None  # last window in which the fleet kept up (TTFT near SLO)
    overload_factor: float = 2.0
    operator_inputs: WorkloadSpec | None = None  # plan from what the operator has (module doc)
    kept: Shape | None = None  # the request shape held within its band (`operator_inputs`)
    unthrottled_rate: float | None = None  # `signals.planning_load`'s (`operator_inputs`)
    rates: RateHistory = field(default_factory=RateHistory)  # every tick's (`operator_inputs`)
    hold: MoveHold = field(default_factory=MoveHold)  # `signals.held_while_short`'s
    metric_window_s: float = METRIC_WINDOW_S  # the fleet's (`FleetConfig.metric_window_s`)

    def _workload(self, m: Metrics, rate: float, rate_cv: float | None = None) -> WorkloadInputs:
        if self.operator_inputs is not None:
            if m.avg_input_tokens > 0 and m.avg_output_tokens > 0:
                self.kept = kept_shape(self.kept, (m.avg_input_tokens, m.avg_output_tokens))
            shape = ObservedSignals(
                avg_input_tokens=self.kept[0] if self.kept else None,
                avg_output_tokens=self.kept[1] if self.kept else None,
                reuse=None if m.reuse is None else quantized_profile(m.reuse),
                rate_cv=rate_cv,
            )
            return planner_workload(self.operator_inputs, rate, shape)
        return WorkloadInputs(
            request_rate=rate,
            avg_input_tokens=max(m.avg_input_tokens, 1.0),
            avg_output_tokens=max(m.avg_output_tokens, 1.0),
            p95_input_tokens=max(m.p95_input_tokens, m.avg_input_tokens, 1.0),
            first_turn_fraction=min(max(m.first_turn_fraction, 0.01), 1.0),
            tool_pause_s=max(m.tool_pause_s, 0.1),
            shared_prefix_tokens=self.shared_prefix_tokens,
        )

    def _observed(self, m: Metrics, fleet: FleetView) -> ObservedSignals | None:
        """Decode KV in use plus what waits for it, as a share of ready capacity."""
        if not self.calibrate or fleet.decode <= 0:
            return None
        cap = fleet.decode * self.decode.kv_capacity_tokens
        usage = m.decode_kv_usage + m.decode_waiting * m.avg_input_tokens / cap
        return ObservedSignals(
            arrival_rate=m.arrival_rate, decode_kv_usage=usage, decode_replicas=fleet.decode
        )

    def _slow(self, now: float, m: Metrics, fleet: FleetView) -> tuple[int, int] | None:
        """One slow-loop recommendation on forecast load (``_forecast``), or on what the
        operator plans for (``_operator_load``) with ``operator_inputs``."""
        if m.arrival_rate <= 0 or m.avg_output_tokens <= 0:
            return None
        if self.operator_inputs is not None:
            wl, observed = self._operator_load(now, m, fleet)
        else:
            wl, observed = self._forecast(m, fleet)
        if self.last_rec is not None:  # kept at the cap unless beaten (as Auto's status does)
            before = (self.last_rec.n_prefill, self.last_rec.n_decode)
            observed = replace(observed or ObservedSignals(), planned_before=before)
        rec = recommend(
            wl,
            self.slo,
            self.prefill,
            self.decode,
            self.bounds,
            observed=observed,
            limits=self.limits,
        )
        self.last_rec = rec
        self.recommendations += 1
        return rec.n_prefill, rec.n_decode

    def _forecast(
        self, m: Metrics, fleet: FleetView
    ) -> tuple[WorkloadInputs, ObservedSignals | None]:
        """The planner's load: the larger of the measured and the smoothed rate, with headroom,
        and the measured workload mix.

        Under overload the measured load is throttled, not lower: agent sessions wait for
        their answer before sending the next turn, so the arrival rate falls and first turns
        (open loop) take a larger share exactly when the fleet is short. While the TTFT p90 is
        over ``overload_factor`` x the SLO, the rate never falls below the last healthy
        window's, the first-turn share is that window's, and decode KV use (full of backlog)
        does not recalibrate the model; lengths are taken as measured.
        """
        a = self.smoothing
        self.ewma_rate = (
            m.arrival_rate
            if self.ewma_rate is None
            else a * m.arrival_rate + (1 - a) * self.ewma_rate
        )
        rate = max(m.arrival_rate, self.ewma_rate) * self.headroom
        wl = self._workload(m, rate)
        observed = self._observed(m, fleet)
        if m.ttft_p90_s <= self.overload_factor * self.slo.ttft_s:
            self.healthy = m
        elif self.healthy is not None:
            h = self.healthy
            wl = replace(
                wl,
                request_rate=max(rate, h.arrival_rate * self.headroom),
                first_turn_fraction=min(max(h.first_turn_fraction, 0.01), 1.0),
            )
            observed = None
        return wl, self._with_ttft(observed, m, fleet)

    def _with_ttft(
        self, observed: ObservedSignals | None, m: Metrics, fleet: FleetView
    ) -> ObservedSignals | None:
        """`observed` with the window's TTFT p90 and the ready pools it was measured on, which
        stretch the model's TTFT (`search.ttft_scale`), as the operator passes them."""
        ready_p, ready_d = fleet.ready
        if m.ttft_p90_s <= 0 or not ready_p or not ready_d:
            return observed
        base = observed or ObservedSignals(arrival_rate=m.arrival_rate)
        return replace(
            base, ttft_p90_s=m.ttft_p90_s, prefill_replicas=ready_p, decode_replicas=ready_d
        )

    def _operator_load(
        self, now: float, m: Metrics, fleet: FleetView
    ) -> tuple[WorkloadInputs, ObservedSignals]:
        """What the operator plans for, through its own functions: the measured rate, or while
        the routers refuse or TTFT is over twice the SLO the last unthrottled window's
        (``signals.planning_load``), while it rises where it will be a pod start from now
        (``signals.forecast``), while the fleet is short of its plan no less than the rate
        sized for before (``signals.held_while_short``), with the operator's headroom
        (``planned_rate``); the hit rate rescales the model's once the prefill pool has
        settled after its last change (``signals.settled_hit_rate``)."""
        seen = replace(
            _rates_of(m),
            ttft_p90_s=m.ttft_p90_s,
            refused_rate=m.refused_rate,
            decode_kv_usage=m.decode_kv_usage,
            hit_rate=m.hit_rate if m.hit_rate > 0 else None,  # 0: no prompt in the window
        )
        load = planning_load(seen, self.unthrottled_rate, self.slo.ttft_s)
        self.unthrottled_rate = load.unthrottled_rate
        window = self.metric_window_s
        _, counted_over = trend_reading(seen, window)
        ahead = forecast(load.observed, self.rates, counted_over, self.prefill.pod_start_s)
        ahead = self._held_while_short(ahead, now, fleet)
        rate = planned_rate(None, ahead)
        assert rate is not None  # `_slow` plans only from a window with arrivals
        hit = settled_hit_rate(load.observed, self._prefill_changed_at(), now, window)
        calibrate = load.observed.decode_kv_usage is not None
        kv = self._observed(m, fleet) if calibrate else None
        observed = kv or ObservedSignals(arrival_rate=m.arrival_rate)
        observed = replace(observed, hit_rate=hit.hit_rate, prefill_replicas=fleet.prefill)
        with_ttft = self._with_ttft(observed, m, fleet)
        assert with_ttft is not None
        return self._workload(m, rate, ahead.rate_cv), with_ttft

    def _held_while_short(
        self, ahead: ObservedSignals, now: float, fleet: FleetView
    ) -> ObservedSignals:
        """As `autoscale.loop.Autoscaler._held_while_short`: short while fewer instances are
        Ready than the spec asks on a side."""
        ready_p, ready_d = fleet.ready
        short = ready_p < fleet.prefill or ready_d < fleet.decode
        held = held_while_short(ahead, self.hold, short, now, self.prefill.pod_start_s)
        self.hold = held.hold
        return held.observed

    def _prefill_changed_at(self) -> float:
        """As `autoscale.loop.prefill_changed_at`: the loop's last prefill change, or the
        latest moment a prefill pod became Ready (the run's start, or a growth's pods one pod
        start after it)."""
        s = self.state
        grown_ready = s.last_prefill_growth + self.prefill.pod_start_s
        return max(s.last_prefill_change, grown_ready, FLEET_READY_S)

    def __call__(self, now: float, m: Metrics, fleet: FleetView) -> tuple[int, int]:
        if self.operator_inputs is not None:  # the operator keeps every tick's arrival rate
            rate, _ = trend_reading(_rates_of(m), self.metric_window_s)
            self.rates = self.rates.add(now, rate)
        observed = ObservedSignals(
            ttft_p90_s=m.ttft_p90_s,
            prefill_queue_depth=m.prefill_backlog_s - self.slo.ttft_s,
            decode_kv_usage=m.decode_kv_usage,
            decode_queue_depth=float(m.decode_waiting),
        )
        failing = failing_sides(observed, self.slo)
        # A side failing now means the load no longer matches the last plan: re-plan on the
        # latest window after ``replan_s`` instead of waiting out the slow period.
        due = self.slow_s if not any(failing) else min(self.slow_s, self.replan_s)
        if now >= self.start_s and now - self.last_slow >= due:
            new = self._slow(now, m, fleet)
            if new is not None:
                self.target = new
                self.last_slow = now
        if self.target is None:
            return fleet.prefill, fleet.decode
        budget = self.bounds.gpu_budget
        held = fleet.prefill_pods * self.prefill.gpus + fleet.decode_pods * self.decode.gpus
        at_budget = budget is not None and held + min(self.prefill.gpus, self.decode.gpus) > budget
        want_p, want_d = fast_adjust(
            self.target, (fleet.prefill, fleet.decode), observed, self.slo, at_budget=at_budget
        )
        rec = RatioRecommendation(
            n_prefill=want_p,
            n_decode=want_d,
            gpus=0,
            ttft_p90_s=0.0,
            itl_ms=0.0,
            hit_rate=0.0,
            goodput_rps=0.0,
            meets_slo=True,
            reason="sim",
        )
        cfg = ControlConfig(
            prefill_gpus=self.prefill.gpus,
            decode_gpus=self.decode.gpus,
            bounds=self.bounds,
            pod_start_s=self.prefill.pod_start_s,
            down_stable_s=self.down_stable_s,
            max_step_fraction=self.max_step_fraction,
        )
        cur = CurrentReplicas(fleet.prefill, fleet.decode, fleet.prefill_pods, fleet.decode_pods)
        urgent = rush_to_decode(observed, self.target[1], fleet.decode)
        dec = next_replicas(
            cur, rec, self.state, now, cfg, decode_failing=urgent, planned=self.target
        )
        self.state = dec.state
        return dec.prefill, dec.decode


@dataclass
class MeanBasedPolicy:
    """Dynamo-style planner: mean lengths, a fixed hit rate, throughput at the SLO."""

    prefill: InstanceProfile
    decode: InstanceProfile
    slo: SloInputs
    bounds: Bounds
    fixed_hit_rate: float = 0.9
    interval_s: float = 180.0
    last: float = -math.inf
    target: tuple[int, int] | None = None

    def prefill_thpt(self, isl: float) -> float:
        """Input tokens/s of one prefill instance at the mean ISL and the fixed hit rate."""
        cached = isl * self.fixed_hit_rate
        return isl / self.prefill.prefill_time(isl - cached, cached)

    def decode_thpt(self, isl: float) -> float:
        """Output tokens/s of one decode instance at the largest batch meeting the ITL target
        (mean context; KV capacity checked at the mean only)."""
        d = self.decode
        best = 0.0
        for b in range(1, d.max_running + 1):
            ctx = b * isl
            step = d.decode_step(b, ctx)
            if step / d.accept_length * 1000.0 > self.slo.itl_ms or ctx > d.kv_capacity_tokens:
                break
            best = b * d.accept_length / step
        return max(best, 1e-9)

    def __call__(self, now: float, m: Metrics, fleet: FleetView) -> tuple[int, int]:
        if now - self.last >= self.interval_s and m.arrival_rate > 0:
            self.last = now
            isl, osl = max(m.avg_input_tokens, 1.0), max(m.avg_output_tokens, 1.0)
            n_p = math.ceil(m.arrival_rate * isl / self.prefill_thpt(isl))
            n_d = math.ceil(m.arrival_rate * osl / self.decode_thpt(isl + osl / 2))
            self.target = self._clamp(n_p, n_d)
        return self.target if self.target else (fleet.prefill, fleet.decode)

    def _clamp(self, n_p: int, n_d: int) -> tuple[int, int]:
        b = self.bounds
        n_p = min(max(n_p, b.min_prefill), b.max_prefill)
        n_d = min(max(n_d, b.min_decode), b.max_decode)
        if b.gpu_budget is not None:
            gp, gd = self.prefill.gpus, self.decode.gpus
            total = n_p * gp + n_d * gd
            if total > b.gpu_budget:  # scale both down proportionally
                f = b.gpu_budget / total
                n_p = max(b.min_prefill, int(n_p * f))
                n_d = max(b.min_decode, (b.gpu_budget - n_p * gp) // gd)
        return n_p, n_d
