"""Auto mode: the operator owns the pools' replicas and moves them toward the planner's answer
in damped steps (pure).

Data flow, once per anomaly tick for a resource with `ratio.mode: Auto` (driven by
`fleet_guard.py`): the pods' signals over the window -> `observed_signals` (arrival rate, hit
rate, prefill queue, decode KV use, aborts) -> the caller's planner recommendation for that
load (slow loop) -> `auto_step`: the anomaly loop's sustained-pressure hint and
`ratio.fast_adjust` (one more instance on a side failing now) -> `ratio.next_replicas` (bounded
step, deadband, scale-down only after the lower target held, cooldown >= pod start time, GPU
budget counting pods not gone yet, at the cap shrink-then-grow, at once when decode is saturated
and the planner wants more of it) -> ratio bounds -> a new
`AutoState`. The caller keeps it in `status.autoscaler` (a restarted operator continues from
it) and the reconcile uses its counts as the pools' replicas.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cas_operator.api import constants as c
from cas_operator.planning.anomaly import PodSignals, PodView, ScaleHint
from cas_operator.planning.ratio import (
    Bounds,
    ControlConfig,
    ControlState,
    CurrentReplicas,
    ObservedSignals,
    RatioRecommendation,
    SloInputs,
    fast_adjust,
    next_replicas,
    rush_to_decode,
)

STATUS_KEY = "autoscaler"
DEFAULT_POD_START_SECONDS = 600.0  # until pods of this resource have been seen starting


@dataclass(frozen=True)
class AutoState:
    """The replicas Auto mode set, the controller's memory, and why (status.autoscaler)."""

    prefill: int
    decode: int
    control: ControlState = field(default_factory=ControlState)
    reason: str = ""

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
        }

    @classmethod
    def from_status(cls, raw: Any) -> AutoState | None:
        """The state a previous tick (or operator process) wrote; None when absent or bad."""
        if not isinstance(raw, dict):
            return None
        try:
            control = ControlState(
                last_prefill_change=_epoch(raw.get("lastPrefillChange")),
                last_decode_change=_epoch(raw.get("lastDecodeChange")),
                down_since_prefill=_optional(raw.get("downSincePrefill")),
                down_since_decode=_optional(raw.get("downSinceDecode")),
            )
            return cls(int(raw["prefill"]), int(raw["decode"]), control, str(raw.get("reason", "")))
        except (KeyError, TypeError, ValueError):
            return None

    @property
    def replicas(self) -> tuple[int, int]:
        return self.prefill, self.decode


def _finite(value: float) -> float | None:
    return None if math.isinf(value) else round(value, 3)


def _epoch(value: Any) -> float:
    return -math.inf if value is None else float(value)


def _optional(value: Any) -> float | None:
    return None if value is None else float(value)


# ---------------------------------------------------------------- observed load


def _measured(pods: Sequence[PodView], role: str) -> list[PodSignals]:
    return [p.signals for p in pods
            if p.role == role and p.signals is not None and p.signals.error is None]  # fmt: skip


def _total(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) buckets sorted by
    bound: linear inside the bucket the rank falls in; the highest finite bound when it falls
    in +Inf; None without observations (pure)."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0 or not math.isinf(buckets[-1][0]):
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            share = (rank - below) / (count - below) if count > below else 1.0
            return lower + (bound - lower) * share
        lower, below = bound, count
    return lower


def merged_buckets(signals: Sequence[PodSignals]) -> list[tuple[float, float]]:
    """One histogram from the pods' TTFT buckets (counts summed per bound)."""
    merged: dict[float, float] = {}
    for s in signals:
        for bound, count in s.ttft_buckets or ():
            merged[bound] = merged.get(bound, 0.0) + count
    return sorted(merged.items())


def observed_signals(pods: Sequence[PodView], window_s: float) -> ObservedSignals:
    """The fleet's load over the window: arrivals from the decode pods' finished requests (each
    PD request ends on one decode; prefill pods count when there are no decode numbers), hit
    rate from the prefill pods' cached/prompt tokens, mean prefill and decode queues, decode KV
    use, aborts on either side, and TTFT p90 from the decode pods' TTFT histograms (the decode
    streams the answer, so its TTFT includes prefill, transfer and admission; prefill pods'
    when decodes have none)."""
    prefill, decode = _measured(pods, c.ROLE_PREFILL), _measured(pods, c.ROLE_DECODE)
    ttft = histogram_quantile(0.9, merged_buckets(decode))
    if ttft is None:
        ttft = histogram_quantile(0.9, merged_buckets(prefill))
    window = max(window_s, 1.0)
    finished = _total([s.requests for s in decode]) or _total([s.requests for s in prefill])
    prompt = _total([s.prompt_tokens for s in prefill])
    cached = _total([s.cached_tokens for s in prefill])
    aborted = _total([s.aborted for s in prefill + decode])
    return ObservedSignals(
        arrival_rate=None if finished is None else finished / window,
        hit_rate=cached / prompt if prompt and cached is not None else None,
        prefill_replicas=len(prefill) or None,
        prefill_queue_depth=_mean([s.queued for s in prefill]),
        decode_kv_usage=_mean([s.token_usage for s in decode]),
        decode_replicas=len(decode) or None,
        decode_queue_depth=_mean([s.queued for s in decode]),
        aborts_per_s=None if aborted is None else aborted / window,
        ttft_p90_s=ttft,
    )


def _two_digits(value: float | None) -> float | None:
    if value is None or value <= 0:
        return value
    return float(f"{value:.2g}")


def _step(value: float | None, step: float) -> float | None:
    return None if value is None else round(round(value / step) * step, 6)


def quantized(o: ObservedSignals) -> ObservedSignals:
    """Coarse values (2 significant digits, 2% steps) so a steady load gives identical planner
    inputs tick after tick: the planner's answer is cached and does not jitter."""
    return ObservedSignals(
        arrival_rate=_two_digits(o.arrival_rate),
        hit_rate=_step(o.hit_rate, 0.02),
        prefill_replicas=o.prefill_replicas,
        prefill_queue_depth=_two_digits(o.prefill_queue_depth),
        decode_kv_usage=_step(o.decode_kv_usage, 0.02),
        decode_replicas=o.decode_replicas,
        decode_queue_depth=_two_digits(o.decode_queue_depth),
        transfer_backlog_bytes=o.transfer_backlog_bytes,
        ttft_p90_s=_two_digits(o.ttft_p90_s),
        itl_ms=o.itl_ms,
        aborts_per_s=_two_digits(o.aborts_per_s),
    )


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


def _target(counts: tuple[int, int]) -> RatioRecommendation:
    """`next_replicas` reads only the counts of its recommendation."""
    p, d = counts
    return RatioRecommendation(p, d, 0, 0.0, 0.0, 0.0, 0.0, True, "auto target")


def _ratio_ok(p: int, d: int, lo: float | None, hi: float | None) -> bool:
    return (lo is None or p / d >= lo - 1e-9) and (hi is None or p / d <= hi + 1e-9)


def _between(value: int, a: int, b: int) -> bool:
    return min(a, b) <= value <= max(a, b)


def _within_ratio(
    current: tuple[int, int], proposed: tuple[int, int], lo: float | None, hi: float | None
) -> tuple[int, int]:
    """As much of the proposed step as keeps P/D inside [lo, hi]: the step itself, else one
    side moved only as far as the bounds allow (never past its proposal), else one side's
    change alone, else no change (a step never leaves the bounds the user set)."""
    (cp, cd), (pp, pd) = current, proposed
    if _ratio_ok(pp, pd, lo, hi):
        return pp, pd
    p = min(max(pp, math.ceil(lo * pd) if lo else 1), math.floor(hi * pd) if hi else pp)
    if p >= 1 and _between(p, cp, pp) and _ratio_ok(p, pd, lo, hi):
        return p, pd
    d = max(pd, math.ceil(pp / hi) if hi else 1)
    d = min(d, math.floor(pp / lo) if lo else d)
    if d >= 1 and _between(d, cd, pd) and _ratio_ok(pp, d, lo, hi):
        return pp, d
    for p, d in ((pp, cd), (cp, pd)):
        if _ratio_ok(p, d, lo, hi):
            return p, d
    return cp, cd


def _at_budget(inputs: AutoInputs) -> bool:
    if inputs.gpu_budget is None:
        return False
    used = inputs.current.prefill * inputs.prefill_gpus + inputs.current.decode * inputs.decode_gpus
    return used + min(inputs.prefill_gpus, inputs.decode_gpus) > inputs.gpu_budget


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
        want = (_follow(want[0], cur.prefill, pressure.prefill),
                _follow(want[1], cur.decode, pressure.decode))  # fmt: skip
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
    urgent = rush_to_decode(observed, inputs.slo, planned[1], cur.decode, starving)
    decision = next_replicas(existing, _target(want), cur.control, now, config, urgent)
    p, d = _within_ratio(
        cur.replicas, (decision.prefill, decision.decode), inputs.ratio_min, inputs.ratio_max
    )
    control = decision.state
    if p == cur.prefill:
        control = ControlState(cur.control.last_prefill_change, control.last_decode_change,
                               control.down_since_prefill, control.down_since_decode)  # fmt: skip
    if d == cur.decode:
        control = ControlState(control.last_prefill_change, cur.control.last_decode_change,
                               control.down_since_prefill, control.down_since_decode)  # fmt: skip
    why = f"target {want[0]}:{want[1]} (planner {planned[0]}:{planned[1]}); {decision.reason}"
    if (p, d) != (decision.prefill, decision.decode):
        why += f"; {decision.prefill}:{decision.decode} held by ratio bounds"
    return AutoState(p, d, control, why)
