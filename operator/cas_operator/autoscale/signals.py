"""Autoscale signals (pure): the load the fleet shows, from the pods' windowed metrics.

Data flow: per engine and router pod `PodSignals` over the anomaly window (the observe layer),
joined with the pod as `PodView` by the fleet tick -> `observed_signals` (arrival rate, hit
rate, prefill queue, decode KV use, TTFT p90 from the engines' histograms, aborts, the routers'
refusals, which status.admission shows, and the prefill pods' prompt reuse times, which the
planner's hit-rate curve reads: `prompt_reuse`) -> `quantized` (so the planner's cache hits in
steady state) -> `kept_shape` (the request shape, which admission (`desired.admission`) sizes for,
held within a band; the autoscale loop keeps it per resource, `status.admission.requestShape`
across restarts) -> `planning_load` (the arrival rate raised to the last unthrottled window's
while the routers refuse or the fleet is behind; the loop keeps that rate per resource) ->
`forecast` (while the arrival rate rises significantly over the last `TREND_HISTORY_S`, where
it will be one pod start from now; and how much it moves from window to window beyond counting
noise, `rate_variation`, which the decode KV cliff reads; the loop keeps the rates per
resource) -> `held_while_short` (while the fleet has fewer Ready instances than its plan, the
rate sized for before it fell short, at least; the loop keeps that rate per resource) -> the
planner
(`desired.recommend`) and the replica controller (`autoscale.controller`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from cas_operator.api import constants as c
from cas_operator.autoscale.model import ObservedSignals
from cas_operator.autoscale.reuse import ReuseProfile, profile_from_counts, quantized_profile
from cas_operator.observe.histogram import histogram_quantile, merged_buckets
from cas_operator.observe.types import PodSignals, PodView, rate_window

# ---------------------------------------------------------------- observed load


def _measured(pods: Sequence[PodView], role: str) -> list[PodSignals]:
    return [
        p.signals
        for p in pods
        if p.role == role and p.signals is not None and p.signals.error is None
    ]


def _total(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def prompt_reuse(prefill: Sequence[PodSignals]) -> ReuseProfile | None:
    """The prefill pods' prompt reuse over the window as one profile: their token-weighted
    reuse histograms summed per bound and their `cas_prefix_*` counters summed (the engines
    share bucket bounds: one image). None when no pod tracked a request in the window (before
    traffic, or engines without cas_engine's tracker): the planner then falls back to Che's
    approximation (`model.hit_probabilities`)."""
    pods = [s for s in prefill if s.reuse_buckets and s.reuse_requests]
    if not pods:
        return None
    buckets: dict[float, float] = {}
    for s in pods:
        for bound, tokens in s.reuse_buckets or ():
            buckets[bound] = buckets.get(bound, 0.0) + tokens
    return profile_from_counts(
        sorted(buckets.items()),
        first_seen_tokens=_total([s.first_seen_tokens for s in pods]) or 0.0,
        requests=_total([s.reuse_requests for s in pods]) or 0.0,
        request_tokens=_total([s.reuse_request_tokens for s in pods]) or 0.0,
        request_token_squares=_total([s.reuse_request_token_squares for s in pods]) or 0.0,
        returning_prompt_tokens=_total([s.returning_prompt_tokens for s in pods]),
    )


def observed_signals(pods: Sequence[PodView], window_s: float) -> ObservedSignals:
    """The fleet's load over the window: arrivals from the decode pods' finished requests (each
    PD request ends on one decode; prefill pods count when there are no decode numbers), hit
    rate from the prefill pods' cached/prompt tokens, mean prefill and decode queues, decode KV
    use, aborts on either side, TTFT p90 from the decode pods' TTFT histograms (the decode
    streams the answer, so its TTFT includes prefill, transfer and admission; prefill pods'
    when decodes have none), the median ITL from the decode pods' inter-token histograms, and
    the request shape: prompt tokens per request on the prefill pods, generated tokens per
    request on the decode pods (what admission control sizes for), the routers' 429s (a
    router that answered but never refused has no 429 series: zero), and the prefill pods'
    prompt reuse times, the hit-rate model's input (`prompt_reuse`); and the arrival rate over
    the last `rate_window` (`recent_arrival_rate`), which the trend and the variation read."""
    prefill, decode = _measured(pods, c.ROLE_PREFILL), _measured(pods, c.ROLE_DECODE)
    routers = [s for s in _measured(pods, c.ROLE_ROUTER) if s.responses is not None]
    ttft = histogram_quantile(0.9, merged_buckets(decode))
    if ttft is None:
        ttft = histogram_quantile(0.9, merged_buckets(prefill))
    # SGLang observes each chunk's interval divided over its tokens (speculative decoding
    # emits several at once), so the median token is the request's typical ITL: what the SLO's
    # mean ITL per request is compared with.
    itl_s = histogram_quantile(0.5, merged_buckets(decode, itl=True))
    window = max(window_s, 1.0)
    finished = _total([s.requests for s in decode]) or _total([s.requests for s in prefill])
    recent = _total([s.recent_requests for s in decode]) or _total(
        [s.recent_requests for s in prefill]
    )
    prompt = _total([s.prompt_tokens for s in prefill])
    cached = _total([s.cached_tokens for s in prefill])
    aborted = _total([s.aborted for s in prefill + decode])
    prefilled = _total([s.requests for s in prefill])
    generated = _total([s.generation_tokens for s in decode])
    return ObservedSignals(
        arrival_rate=None if finished is None else finished / window,
        recent_arrival_rate=None if recent is None else recent / rate_window(window),
        hit_rate=cached / prompt if prompt and cached is not None else None,
        prefill_replicas=len(prefill) or None,
        prefill_queue_depth=_mean([s.queued for s in prefill]),
        decode_kv_usage=_mean([s.token_usage for s in decode]),
        decode_replicas=len(decode) or None,
        decode_queue_depth=_mean([s.queued for s in decode]),
        aborts_per_s=None if aborted is None else aborted / window,
        ttft_p90_s=ttft,
        itl_ms=None if itl_s is None else itl_s * 1000.0,
        avg_input_tokens=prompt / prefilled if prompt and prefilled else None,
        avg_output_tokens=generated / finished if generated and finished else None,
        refused_rate=sum(s.refused or 0.0 for s in routers) / window if routers else None,
        reuse=prompt_reuse(prefill),
    )


SHAPE_BAND = 0.10  # a kept request length moves down when the measured one is this much shorter
SHAPE_GROW_BAND = 0.03  # and up when the measured one is this much longer

Shape = tuple[float, float]  # (prompt, generated) tokens per request


def kept_shape(
    kept: Shape | None,
    measured: Shape | None,
    band: float = SHAPE_BAND,
    grow_band: float = SHAPE_GROW_BAND,
) -> Shape | None:
    """The request shape admission sizes the routers' limits for: each length stays at its kept
    value until the measured one is more than `grow_band` longer or more than `band` shorter,
    then takes the measured one. A limit sized for it moves (and the routers' template with it)
    only when the shape really changed. Without a measurement (a quiet window) the kept shape
    stays; without a kept one the measured one is taken.

    Asymmetric, because the two errors are not alike: a kept length shorter than the requests
    sizes a limit above what the pools serve, and what it admits becomes the backlog the limit
    exists to refuse; a kept length longer than them refuses a little load the pools would
    serve. Prompts measured while the routers refuse are short (first turns are
    over-represented), and a symmetric band held them while the returning sessions' prompts
    grew back, so the limit stayed above what prefill served (docs/planner.md, "Admission
    control": "The band, asymmetric", with the benchmark's measurements)."""
    if measured is None:
        return kept
    if kept is None:
        return measured
    return (
        _within(kept[0], measured[0], band, grow_band),
        _within(kept[1], measured[1], band, grow_band),
    )


def _within(kept: float, measured: float, band: float, grow_band: float) -> float:
    change = measured / kept - 1.0
    return measured if change > grow_band or change < -band else kept


def shape_of(o: ObservedSignals | None) -> Shape | None:
    """The measured request shape, when both lengths were measured."""
    if o is None or not o.avg_input_tokens or not o.avg_output_tokens:
        return None
    return o.avg_input_tokens, o.avg_output_tokens


def with_shape(o: ObservedSignals, shape: Shape | None) -> ObservedSignals:
    """`o` with its request shape replaced (unchanged without one)."""
    if shape is None:
        return o
    return replace(o, avg_input_tokens=shape[0], avg_output_tokens=shape[1])


OVERLOAD_TTFT_FACTOR = 2.0  # TTFT p90 over this x the SLO: the fleet is behind its load


def behind_load(o: ObservedSignals, slo_ttft_s: float) -> bool:
    """Whether the fleet is behind its load: TTFT p90 over `OVERLOAD_TTFT_FACTOR` x the SLO."""
    return o.ttft_p90_s is not None and o.ttft_p90_s > OVERLOAD_TTFT_FACTOR * slo_ttft_s


REFUSED_SHARE = 0.01  # the routers refusing more than this share of arrivals cap the load


@dataclass(frozen=True)
class PlanningLoad:
    """The load the planner sizes for, and the rate the next window is held to."""

    observed: ObservedSignals  # the measured load, with `demand_rate` while throttled
    unthrottled_rate: float | None  # the arrival rate of the last window the fleet let in


def planning_load(
    o: ObservedSignals, unthrottled_rate: float | None, slo_ttft_s: float
) -> PlanningLoad:
    """The measured load as the planner should see it. While the routers refuse more than
    `REFUSED_SHARE` of the arrivals, or TTFT p90 is over `OVERLOAD_TTFT_FACTOR` x the SLO, the
    measured arrival rate is what the fleet let in, not what its clients want (the routers
    answer the rest 429, and agent sessions wait for their answers before the next turn, so
    arrivals fall exactly when the fleet is short): the planner's rate (`demand_rate`) is then
    never below the last unthrottled window's, and while TTFT is over, decode KV use (full of
    backlog) does not recalibrate the model. A planner sizing for the admitted rate shrank
    the fleet to the limit that throttled it (docs/results/2026-12-06-planner-history.md,
    "Open problems": the output shift's prefill drained 24 -> 11 behind the limit, then could
    not serve what the limit let in)."""
    rate = o.arrival_rate
    if rate is None:
        return PlanningLoad(o, unthrottled_rate)
    refusing = (o.refused_rate or 0.0) > REFUSED_SHARE * rate
    overloaded = behind_load(o, slo_ttft_s)
    if not refusing and not overloaded:
        return PlanningLoad(o, rate)
    held = max(rate, unthrottled_rate or 0.0)
    kv = None if overloaded else o.decode_kv_usage
    return PlanningLoad(replace(o, demand_rate=held, decode_kv_usage=kv), unthrottled_rate)


# ---------------------------------------------------------------- a rising load

TREND_HISTORY_S = 900.0  # the measured arrival rates a rising trend is fitted over
TREND_MIN_SAMPLES = 10
TREND_SIGNIFICANCE = 3.0  # a slope counts when it exceeds this many standard errors
TREND_MAX_RISE = 1.0  # the forecast adds at most this share of the rate
RATE_CV_STEP = 0.02  # the rate's measured variation, in steps of this


@dataclass(frozen=True)
class RateHistory:
    """The arrival rates measured at recent ticks, oldest first: (time, req/s), the last
    `TREND_HISTORY_S` seconds of them, and when this history first saw arrivals."""

    samples: tuple[tuple[float, float], ...] = ()
    first_arrivals: float | None = None

    def add(self, now: float, rate: float | None) -> RateHistory:
        """This history with ``rate`` measured at ``now`` (none without a rate), samples
        older than `TREND_HISTORY_S` dropped."""
        kept = tuple(s for s in self.samples if now - TREND_HISTORY_S <= s[0] < now)
        first = self.first_arrivals
        if rate is not None and rate > 0.0:
            kept += ((now, rate),)
            first = now if first is None else first
        return RateHistory(kept, first)


@dataclass(frozen=True)
class _Line:
    """A least-squares line through (time, rate) points."""

    n: int
    mean_rate: float
    slope: float
    stt: float  # sum of squared time deviations
    residual_var: float  # the rates' variance around the line (n - 2 degrees of freedom)
    span_s: float


def _fitted(history: RateHistory, window_s: float) -> _Line | None:
    """The line through the history's rates, those of the first window after arrivals began
    left out (a window that reaches back before the traffic, a new fleet, reads a rate that
    climbs until it is full, whatever the load does; after an operator restart its first
    window is only a delay); None with fewer than `TREND_MIN_SAMPLES` of them."""
    if history.first_arrivals is None:
        return None
    start = history.first_arrivals + window_s
    pts = tuple(p for p in history.samples if p[0] >= start)
    n = len(pts)
    if n < TREND_MIN_SAMPLES:
        return None
    t_mean = sum(t for t, _ in pts) / n
    r_mean = sum(r for _, r in pts) / n
    stt = sum((t - t_mean) ** 2 for t, _ in pts)
    if stt <= 0.0:
        return None
    slope = sum((t - t_mean) * (r - r_mean) for t, r in pts) / stt
    resid = sum((r - r_mean - slope * (t - t_mean)) ** 2 for t, r in pts) / (n - 2)
    return _Line(n, r_mean, slope, stt, resid, pts[-1][0] - pts[0][0])


def rising_slope(history: RateHistory, window_s: float) -> float:
    """How fast the arrival rate rises (req/s per second) when it rises significantly, else 0.

    A least-squares line through the history (`_fitted`); its slope counts when it is over
    `TREND_SIGNIFICANCE` standard errors. Consecutive ticks measure overlapping windows, so
    the error counts one independent sample per metrics window (``window_s``), not one per
    tick: a flat, noisy load does not read as a trend."""
    line = _fitted(history, window_s)
    if line is None:
        return 0.0
    independent = min(float(line.n), max(2.0, line.span_s / max(window_s, 1e-9)))
    stderr = (line.residual_var / (line.stt * independent / line.n)) ** 0.5
    return line.slope if line.slope > TREND_SIGNIFICANCE * stderr else 0.0


RATE_CV_MAX = 0.5  # a larger measured variation is read as this much


def rate_variation(history: RateHistory, window_s: float) -> float | None:
    """How much the arrival rate moves from one metrics window to the next, beyond the
    counting noise of measuring a rate over ``window_s``: the coefficient of variation of the
    history's rates around their least-squares line (a trend is not variation), with the
    Poisson counting variance of a rate measured over the window (``rate / window_s``)
    taken out; None without enough history (`_fitted`), at most `RATE_CV_MAX`. The decode KV
    cliff counts it (`model.kv_overflow`): a pool sized on the mean rate sits on the cliff in
    the bursts."""
    line = _fitted(history, window_s)
    if line is None or line.mean_rate <= 0.0:
        return None
    beyond = max(line.residual_var - line.mean_rate / max(window_s, 1.0), 0.0)
    return min(RATE_CV_MAX, math.sqrt(beyond) / line.mean_rate)


def trend_reading(o: ObservedSignals, window_s: float) -> tuple[float | None, float]:
    """The arrival rate a tick adds to the `RateHistory`, and the window it was counted over:
    the rate over the last `rate_window` when measured, else the metrics window's. Why: over
    the operator's default 300-s window consecutive readings overlap for 5 minutes, so the
    trend found three independent readings in 15 minutes and a ramp of real sessions was
    planned late (bench.planner_traces' ramp: 73% of the online bound, 87% with the trend read
    from 60-s rates); the plan itself still sizes for the window's rate."""
    if o.recent_arrival_rate is not None:
        return o.recent_arrival_rate, rate_window(window_s)
    return o.arrival_rate, window_s


def forecast(
    o: ObservedSignals, history: RateHistory, window_s: float, horizon_s: float
) -> ObservedSignals:
    """`o` with what the recent rates tell: `rate_cv`, how much the rate varies from window to
    window (`rate_variation`, in steps of `RATE_CV_STEP` so a steady load plans from the same
    inputs tick after tick), and `forecast_rate` while the arrival rate rises
    (`rising_slope`): the rate the planner sizes for (`demand_rate`, else the arrivals) plus
    the rise over ``horizon_s`` (the pods' start time: a plan made now serves when the pods it
    starts are Ready), at most `TREND_MAX_RISE` more. Why: the planner plans for the measured
    rate, and every move waits a pod start, so under a ramp of session starts it lagged behind
    the load for the whole run (real sessions, bench.planner_traces' ramp: 70% of the online
    bound; with the forecast 85%, docs/planner.md)."""
    varies = _step(rate_variation(history, window_s), RATE_CV_STEP)
    base = o.demand_rate or o.arrival_rate
    slope = rising_slope(history, window_s)
    if not base or slope <= 0.0:
        return replace(o, forecast_rate=None, rate_cv=varies)
    rise = min(slope * horizon_s, TREND_MAX_RISE * base)
    return replace(o, forecast_rate=_significant(base + rise), rate_cv=varies)


# ---------------------------------------------------------------- a fleet short of its plan

MOVE_HOLD_POD_STARTS = 2.0  # a fleet short of its plan this many pod starts is stuck: no hold


@dataclass(frozen=True)
class MoveHold:
    """The rate the planner sized for at the last tick the fleet stood at its plan (None
    before any), and since when the fleet has been short of its plan (None: it is not)."""

    rate: float | None = None
    short_since: float | None = None


@dataclass(frozen=True)
class HeldLoad:
    """The planning load after `held_while_short`, and the hold the next tick reads."""

    observed: ObservedSignals
    hold: MoveHold


def sized_rate(o: ObservedSignals) -> float | None:
    """The measured rate the planner sizes for (`desired.recommend.planned_rate` before its
    headroom): the demand (else the arrivals), or the forecast where it is higher."""
    measured = o.demand_rate or o.arrival_rate
    if not measured:
        return None
    return max(measured, o.forecast_rate or 0.0)


def held_while_short(
    o: ObservedSignals, hold: MoveHold, short: bool, now: float, pod_start_s: float
) -> HeldLoad:
    """`o`, and while the fleet is short of its plan (fewer Ready instances than desired on
    a side: a move or a growth whose pods are starting) with `demand_rate` at least the rate
    sized for at the last tick it stood at its plan. Why: a fleet short of instances answers
    slower, and agent sessions wait for their answers before their next turn, so arrivals
    fall exactly while a move is under way; read as less load, that fall reversed the move
    before its pods were Ready (real sessions, bench.planner_traces' Mooncake-shaped surge,
    seed 2: two prefill instances drained for 24P:8D, arrivals fell from 13 to 8 req/s
    where the static 25P:7D saw 13-17 in the same minutes, and the plan turned back to
    26P:6D; docs/planner.md, "Control"). Only a rise is taken while short. A fleet short
    for `MOVE_HOLD_POD_STARTS` pod starts is stuck (pods that never become Ready), not
    moving: the hold lapses and the measured rate counts again."""
    rate = sized_rate(o)
    if not short:
        return HeldLoad(o, MoveHold(rate))
    since = now if hold.short_since is None else hold.short_since
    kept = MoveHold(hold.rate, since)
    stuck = now - since > MOVE_HOLD_POD_STARTS * pod_start_s
    if hold.rate is None or stuck or (rate is not None and rate >= hold.rate):
        return HeldLoad(o, kept)
    return HeldLoad(replace(o, demand_rate=hold.rate), kept)


HIT_SETTLE_S = 600.0  # after a prefill pool change, its measured hit rate is a transient this long


def settled_hit_rate(
    o: ObservedSignals, last_prefill_change: float | None, now: float, window_s: float
) -> ObservedSignals:
    """`o` without its hit rate while the prefill pool changed less than `HIT_SETTLE_S` (or the
    metric window, when longer) ago. The planner rescales its modelled hit rate by the measured
    one (`search.recommend`), but right after a change the sessions moved off a drained pod, or
    onto a new one, prefill their whole context once: a dip that says nothing of the pool's
    steady state. Planned from, it made the TTFT target look unreachable at any rate, and Auto
    planned 26P:2D for a load whose answers had grown 4x (planner benchmark, the rebalance:
    measured 0.85 against a steady 0.93, minutes after a 21 -> 17 prefill cut)."""
    held = hit_held_until(o, last_prefill_change, now, window_s)
    return o if held is None else replace(o, hit_rate=None)


def hit_held_until(
    o: ObservedSignals, last_prefill_change: float | None, now: float, window_s: float
) -> float | None:
    """Until when `settled_hit_rate` holds back `o`'s measured hit rate; None when it does not
    (no hit rate, no known change, or the pool has settled)."""
    if last_prefill_change is None or o.hit_rate is None:
        return None
    settles = last_prefill_change + max(HIT_SETTLE_S, window_s)
    return settles if now < settles else None


def request_shape_status(shape: Shape) -> dict[str, float]:
    """`status.admission.requestShape`: the shape the limits are sized for, which a restarted
    operator keeps (`shape_in_status`) instead of rolling the routers to the declared one."""
    return {"inputTokens": shape[0], "outputTokens": shape[1]}


def shape_in_status(status: Mapping[str, Any] | None) -> Shape | None:
    """The request shape a resource's status kept (`request_shape_status`), if any."""
    found = ((status or {}).get("admission") or {}).get("requestShape") or {}
    try:
        inp, out = float(found["inputTokens"]), float(found["outputTokens"])
    except (KeyError, TypeError, ValueError):
        return None
    return (inp, out) if inp > 0 and out > 0 else None


def shape_only(o: ObservedSignals) -> ObservedSignals:
    """The measured request shape and the routers' refusals alone (Fixed mode: nothing else is
    planned from the load; admission sizes for the shape and shows the refusals)."""
    return ObservedSignals(
        avg_input_tokens=o.avg_input_tokens,
        avg_output_tokens=o.avg_output_tokens,
        refused_rate=o.refused_rate,
    )


def _significant(value: float | None, digits: int = 2) -> float | None:
    """`value` to `digits` significant digits (None and non-positive values as they are)."""
    if value is None or value <= 0:
        return value
    return float(f"{value:.{digits}g}")


def _step(value: float | None, step: float) -> float | None:
    return None if value is None else round(round(value / step) * step, 6)


def quantized(o: ObservedSignals) -> ObservedSignals:
    """Coarse values (2 significant digits, 2% steps; request lengths 3 digits, which
    `kept_shape` then holds steady) so a steady load gives identical planner inputs tick after
    tick: the planner's answer is cached and does not jitter."""
    return ObservedSignals(
        arrival_rate=_significant(o.arrival_rate),
        recent_arrival_rate=_significant(o.recent_arrival_rate),
        hit_rate=_step(o.hit_rate, 0.02),
        prefill_replicas=o.prefill_replicas,
        prefill_queue_depth=_significant(o.prefill_queue_depth),
        decode_kv_usage=_step(o.decode_kv_usage, 0.02),
        decode_replicas=o.decode_replicas,
        decode_queue_depth=_significant(o.decode_queue_depth),
        transfer_backlog_bytes=o.transfer_backlog_bytes,
        ttft_p90_s=_significant(o.ttft_p90_s),
        itl_ms=_significant(o.itl_ms),
        aborts_per_s=_significant(o.aborts_per_s),
        avg_input_tokens=_significant(o.avg_input_tokens, 3),
        avg_output_tokens=_significant(o.avg_output_tokens, 3),
        refused_rate=_significant(o.refused_rate),
        demand_rate=_significant(o.demand_rate),
        reuse=None if o.reuse is None else quantized_profile(o.reuse),
        forecast_rate=_significant(o.forecast_rate),
        rate_cv=o.rate_cv,
    )
