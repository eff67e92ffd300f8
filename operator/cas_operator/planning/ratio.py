"""P:D ratio planner for coding-agent traffic: a queueing model and a safe replica controller.

Pure: no I/O, no clock (time comes in as ``now``), no client. The operator's adapter turns the
CodingAgentServing spec and observed metrics into the frozen inputs below and reads back a
:class:`RatioRecommendation` (Recommend mode) or a :class:`ControlDecision` (Auto mode).

Model (per request class, see docs/planner.md for the derivation):

1. Hit rate depends on the plan. Live sessions ``L = rate * cycle`` (Little's law; a session sends
   one request per cycle = tool pause + its own service time). Each session's cached prefix is an
   object of ``S`` tokens in an LRU spread over the prefill pool by prefix-aware routing. Che's
   approximation gives the characteristic time ``T`` from
   ``capacity = L*S*(1 - exp(-T/cycle)) + end_rate*S*T`` (live sessions plus finished sessions
   that linger until evicted); a returning turn hits with probability ``1 - exp(-T/cycle)``.
   Computed for the GPU tier and for GPU + host (HiCache) tier.
2. Uncached tokens per class: first turns miss (only a shared system prefix hits), returning
   hits prefill only their new tokens, returning misses prefill the whole context.
3. Prefill pool: hits queue at their cache home (one M/G/1 queue per instance, sticky load
   varying with the sessions homed there); misses go to the least-backlogged instance, so they
   level the under-loaded instances (water filling) and wait like one pooled M/G/n queue.
   Waiting times use the Allen-Cunneen-scaled Erlang C:
   ``P(W > t) = C(c, a) * exp(-2 (c*mu - lambda) t / (1 + cs^2))``. TTFT of a class is wait +
   its prefill time + KV transfer + one decode step; the p90 is solved exactly over the class
   mixture.
4. KV transfer: the whole context moves prefill -> decode; the link pool is the smaller of the
   two sides' NIC totals; per-transfer time is stretched by ``1 / (1 - rho_link)``.
5. Decode: per-instance active requests ``c`` from Little's law with the step time that itself
   depends on ``c`` and total context (closed-form fixed point). Constraints: ITL = step/accept
   under the SLO, and the 95th percentile of the summed context of ``c`` requests (per-request
   sd from the p95 context) under the KV capacity - not the mean.

Choice: the fewest GPUs meeting both SLOs, or - when that exceeds the budget - the most
SLO-meeting requests within it, decode first: the smallest decode pool that holds at the full
rate and every other GPU on prefill (a short decode pool is a cliff under closed-loop agent
traffic, a short prefill pool a longer TTFT tail); when the budget cannot hold both, the highest
sustainable rate's plan with the leftover spent decode first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from statistics import NormalDist
from typing import Any

__all__ = [
    "Bounds",
    "ControlConfig",
    "ControlDecision",
    "ControlState",
    "CurrentReplicas",
    "InstanceProfile",
    "ObservedSignals",
    "PlanEvaluation",
    "RatioRecommendation",
    "SloInputs",
    "WorkloadInputs",
    "decode_saturated",
    "erlang_c",
    "evaluate",
    "failing_sides",
    "fast_adjust",
    "hit_probabilities",
    "next_replicas",
    "recommend",
    "rush_to_decode",
    "scale_down_ok",
]

Z95 = 1.645


# ---------------------------------------------------------------- inputs


@dataclass(frozen=True)
class WorkloadInputs:
    """Expected traffic. ``None`` fields are derived from the others (see ``resolved``)."""

    request_rate: float
    avg_input_tokens: float
    avg_output_tokens: float
    p95_input_tokens: float | None = None
    first_turn_fraction: float = 0.05
    first_turn_input_tokens: float | None = None
    new_tokens_per_turn: float | None = None
    tool_pause_s: float = 20.0
    shared_prefix_tokens: float = 2000.0
    first_turn_sigma: float = 0.5  # lognormal log-sd of first-turn input
    new_tokens_sigma: float = 1.0  # lognormal log-sd of new tokens per returning turn
    prefix_cache_hit_rate: float | None = None  # declared; used only by mean-based baselines

    def resolved(self) -> WorkloadInputs:
        """Fill derived fields: p95 = 1.8 x mean, first turn = half the mean context, and new
        tokens per turn from ``avg = first + g * (turns - 1) / 2`` with ``turns = 1/f``."""
        p95 = self.p95_input_tokens or 1.8 * self.avg_input_tokens
        first = self.first_turn_input_tokens or 0.5 * self.avg_input_tokens
        new = self.new_tokens_per_turn
        if new is None:
            turns = 1.0 / max(self.first_turn_fraction, 1e-6)
            new = 2.0 * max(self.avg_input_tokens - first, 0.0) / max(turns - 1.0, 1.0)
            new = max(new, 1.0)
        return replace(
            self, p95_input_tokens=p95, first_turn_input_tokens=first, new_tokens_per_turn=new
        )


@dataclass(frozen=True)
class SloInputs:
    """TTFT target at a quantile (p90 by default) and mean inter-token latency per request."""

    ttft_s: float
    itl_ms: float
    ttft_quantile: float = 0.9


@dataclass(frozen=True)
class InstanceProfile:
    """One instance shape (built by ``cas_operator.planning.profiles``); times in seconds."""

    name: str
    gpus: int
    cp: int
    layer_split: bool
    kv_bytes_per_token: float
    kv_capacity_tokens: float
    host_cache_tokens: float
    prefill_overhead_s: float
    prefill_s_per_token: float
    prefill_attn_s_per_token_pair: float
    host_load_s_per_token: float
    decode_step_base_s: float
    decode_step_per_seq_s: float
    decode_step_per_ctx_token_s: float
    accept_length: float
    max_running: int
    nic_bytes_per_s: float
    pod_start_s: float
    drain_s: float

    def prefill_time(self, new: float, cached: float, host_cached: float = 0.0) -> float:
        """Seconds to prefill ``new`` tokens over ``cached`` context (``host_cached`` of it
        loaded from the host tier first)."""
        attn = self.prefill_attn_s_per_token_pair * new * (cached + new / 2.0)
        load = self.host_load_s_per_token * host_cached
        return self.prefill_overhead_s + self.prefill_s_per_token * new + attn + load

    def prefill_time_array(self, new: Any, cached: Any, host_cached: Any = 0.0) -> Any:
        """``prefill_time`` over numpy arrays (same formula; used by the fleet simulator)."""
        attn = self.prefill_attn_s_per_token_pair * new * (cached + new / 2.0)
        load = self.host_load_s_per_token * host_cached
        return self.prefill_overhead_s + self.prefill_s_per_token * new + attn + load

    def decode_step(self, batch: float, context_tokens: float) -> float:
        """Seconds per verify step with ``batch`` requests holding ``context_tokens`` in all."""
        return (
            self.decode_step_base_s
            + self.decode_step_per_seq_s * batch
            + self.decode_step_per_ctx_token_s * context_tokens
        )


@dataclass(frozen=True)
class Bounds:
    """Replica bounds per pool and an optional GPU budget for both pools together."""

    min_prefill: int = 1
    max_prefill: int = 10_000
    min_decode: int = 1
    max_decode: int = 10_000
    gpu_budget: int | None = None


@dataclass(frozen=True)
class ObservedSignals:
    """Measured fleet state; every field optional. Rates per second, latencies in seconds."""

    arrival_rate: float | None = None
    hit_rate: float | None = None
    prefill_replicas: int | None = None
    prefill_queue_depth: float | None = None
    decode_kv_usage: float | None = None  # used (plus waiting) KV over capacity, 0..1+
    decode_replicas: int | None = None
    decode_queue_depth: float | None = None  # requests whose KV arrived, waiting for admission
    transfer_backlog_bytes: float | None = None
    ttft_p90_s: float | None = None
    itl_ms: float | None = None
    aborts_per_s: float | None = None  # reported only: a PD abort is mostly a prefill timeout


# ---------------------------------------------------------------- outputs


@dataclass(frozen=True)
class PlanEvaluation:
    """Predicted behaviour of one (N_P, N_D) at one request rate."""

    n_prefill: int
    n_decode: int
    gpus: int
    hit_rate: float
    ttft_p90_s: float
    itl_ms: float
    prefill_util: float
    link_util: float
    decode_active_per_instance: float
    decode_kv_need_fraction: float
    ttft_attainment: float
    ttft_ok: bool
    itl_ok: bool
    kv_ok: bool
    link_ok: bool

    @property
    def feasible(self) -> bool:
        return self.ttft_ok and self.itl_ok and self.kv_ok and self.link_ok

    def expected_goodput(self, rate: float) -> float:
        """Requests/s meeting both SLOs when ``rate`` is offered: zero when decode or the link
        cannot keep up, else the share of requests whose TTFT meets the target."""
        if not (self.itl_ok and self.kv_ok and self.link_util < 1.0):
            return 0.0
        return rate * self.ttft_attainment


@dataclass(frozen=True)
class RatioRecommendation:
    """What the planner recommends; ``cp_hint`` names a better prefill CP size (restart)."""

    n_prefill: int
    n_decode: int
    gpus: int
    ttft_p90_s: float
    itl_ms: float
    hit_rate: float
    goodput_rps: float
    meets_slo: bool
    reason: str
    cp_hint: int | None = None


# ---------------------------------------------------------------- model pieces


def erlang_c(servers: int, offered: float) -> float:
    """Probability an arrival waits in M/M/c with ``offered = lambda/mu`` (Erlang B recursion)."""
    if offered <= 0.0:
        return 0.0
    if offered >= servers:
        return 1.0
    b = 1.0
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    rho = offered / servers
    return b / (1.0 - rho * (1.0 - b))


def _che_time(capacity: float, live: float, size: float, end_rate: float, cycle: float) -> float:
    """Characteristic time T solving ``capacity = live*size*(1-e^(-T/cycle)) + end_rate*size*T``."""
    if capacity <= 0.0:
        return 0.0

    def occupied(t: float) -> float:
        return live * size * (1.0 - math.exp(-t / cycle)) + end_rate * size * t

    hi = cycle
    for _ in range(200):
        if occupied(hi) >= capacity:
            break
        hi *= 2.0
    else:
        return math.inf
    lo = 0.0
    for _ in range(60):
        mid = (lo + hi) / 2.0
        if occupied(mid) < capacity:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0


def hit_probabilities(
    wl: WorkloadInputs, gpu_tokens: float, host_tokens: float, cycle_s: float
) -> tuple[float, float]:
    """P(returning turn finds its prefix on GPU), P(on GPU or host) for pooled capacities."""
    w = wl.resolved()
    live = wl.request_rate * cycle_s
    size = float(w.avg_input_tokens) + w.avg_output_tokens
    end_rate = wl.request_rate * wl.first_turn_fraction
    out = []
    for cap in (gpu_tokens, gpu_tokens + host_tokens):
        t = _che_time(cap, live, size, end_rate, cycle_s)
        out.append(1.0 if math.isinf(t) else 1.0 - math.exp(-t / cycle_s))
    return out[0], out[1]


@dataclass(frozen=True)
class _Class:
    prob: float
    input_tokens: float
    cached: float
    service_s: float
    sticky: bool = True  # routed to its cache home (a hit); else to the least-backlogged instance


def _lognormal_points(sigma: float, k: int = 6) -> list[float]:
    """``k`` equal-probability points (bin medians) of a lognormal with mean 1."""
    if sigma <= 0.0:
        return [1.0]
    nd = NormalDist()
    return [math.exp(sigma * nd.inv_cdf((i + 0.5) / k) - sigma * sigma / 2.0) for i in range(k)]


def _request_classes(
    wl: WorkloadInputs, prefill: InstanceProfile, p_gpu: float, p_any: float
) -> list[_Class]:
    """First turns, returning GPU hits, host hits and misses with their prefill times; first
    turns and new tokens per turn are spread over lognormal quantile points."""
    w = wl.resolved()
    f = w.first_turn_fraction
    avg = w.avg_input_tokens
    first = w.first_turn_input_tokens or avg
    new = min(w.new_tokens_per_turn or avg, avg)
    shared = min(w.shared_prefix_tokens, first)
    ret = 1.0 - f
    spec: list[tuple[float, float, float, float]] = []
    firsts = _lognormal_points(w.first_turn_sigma)
    spec += [(f / len(firsts), first * m, min(shared, first * m), 0.0) for m in firsts]
    news = _lognormal_points(w.new_tokens_sigma)
    for m in news:
        n = min(new * m, avg)
        q = ret / len(news)
        spec.append((q * p_gpu, avg, avg - n, 0.0))
        spec.append((q * max(p_any - p_gpu, 0.0), avg, avg - n, avg - n))
    spec.append((ret * (1.0 - p_any), avg, shared, 0.0))
    n_first = len(firsts)
    return [
        _Class(
            p,
            inp,
            cached,
            prefill.prefill_time(inp - cached, cached, host),
            sticky=0 < i < len(spec) - 1 and i >= n_first,
        )
        for i, (p, inp, cached, host) in enumerate(spec)
        if p > 0.0
    ]


_Wait = tuple[float, float, float]  # (share of requests, P(wait > 0), tail rate theta)
_Waits = Sequence[_Wait]  # a waiting-time mixture


def _ttft_tail(
    classes: Sequence[_Class], extra_s: Sequence[float], waits: Sequence[_Waits], t: float
) -> float:
    """P(W + D > t): D is the class delay; W is the class's wait mixture over instance groups,
    each with an atom at 0 and an exponential tail of rate ``theta`` with mass P(wait > 0)."""
    total = 0.0
    for c, x, mix in zip(classes, extra_s, waits, strict=True):
        d = c.service_s + x
        for share, wait_prob, theta in mix:
            if t < d:
                total += share * c.prob
            elif theta <= 0.0:
                total += share * c.prob * wait_prob
            else:
                total += share * c.prob * wait_prob * math.exp(-theta * (t - d))
    return total


def _ttft_quantile(
    classes: Sequence[_Class], extra_s: Sequence[float], waits: Sequence[_Waits], q: float
) -> float:
    """Smallest t with P(W + D > t) <= 1 - q (bisection; the tail is monotone in t)."""
    delays = [c.service_s + x for c, x in zip(classes, extra_s, strict=True)]
    slowest = min((w[2] for mix in waits for w in mix if w[2] > 0.0), default=0.0)
    target = 1.0 - q
    lo, hi = 0.0, max(delays) + (50.0 / slowest if slowest > 0 else 1e6)
    if _ttft_tail(classes, extra_s, waits, hi) > target:
        return math.inf
    for _ in range(40):
        mid = (lo + hi) / 2.0
        if _ttft_tail(classes, extra_s, waits, mid) > target:
            lo = mid
        else:
            hi = mid
    return hi


def _water_level(loads: Sequence[tuple[float, float]]) -> float:
    """Level ``L`` with ``sum(w * max(f, L)) = 1`` over (load f, weight w) points: the load
    every under-loaded instance is filled up to by least-backlogged routing of misses."""
    lo, hi = 0.0, max(1.0, max(f for f, _ in loads))
    for _ in range(50):
        mid = (lo + hi) / 2.0
        if sum(w * max(f, mid) for f, w in loads) < 1.0:
            lo = mid
        else:
            hi = mid
    return hi


def _prefill_waits(
    rate: float,
    n: int,
    mean_s: float,
    cs2: float,
    live_sessions: float,
    limits: ModelLimits,
    sticky_share: float = 1.0,
) -> tuple[list[_Wait], list[_Wait]]:
    """Waiting-time mixtures of the prefill pool: (sticky hits, least-backlogged misses).

    Hits go to their cache home. Each instance carries the sessions homed on it, about
    Poisson(live/n) of them, so its sticky load varies with relative sd ``1/sqrt(live/n)``
    (five load points). Misses (first turns, evicted prefixes: ``1 - sticky_share`` of the
    work) go to the least-backlogged instance, so they fill the under-loaded instances up to a
    common level (water filling) and wait like one pooled M/G/n queue. Groups of
    ``queue_pool`` instances share a queue (M/G/c, Allen-Cunneen).
    """
    pool = max(1, min(limits.queue_pool, n))
    cv = 1.0 / math.sqrt(max(live_sessions / n, 1.0)) if limits.session_imbalance else 0.0
    points = [(z, 0.2) for z in (-1.2816, -0.5244, 0.0, 0.5244, 1.2816)] if cv else [(0.0, 1.0)]
    s = min(max(sticky_share, 0.0), 1.0)
    sticky = [(max(0.0, s * (1.0 + cv * z)), w) for z, w in points]
    level = _water_level(sticky)
    waits = []
    for (f_s, w), _ in zip(sticky, points, strict=True):
        f = max(f_s, level, 0.05)
        lam = rate * pool / n * f
        share = f_s * w / max(s, 1e-9) if s > 0 else w
        if lam * mean_s >= pool:
            waits.append((share, 1.0, 0.0))
            continue
        theta = 2.0 * (pool / mean_s - lam) / (1.0 + cs2)
        waits.append((share, erlang_c(pool, lam * mean_s), theta))
    offered = rate * mean_s
    if offered >= n:
        pooled = [(1.0, 1.0, 0.0)]
    else:
        pooled = [(1.0, erlang_c(n, offered), 2.0 * (n / mean_s - rate) / (1.0 + cs2))]
    return waits, pooled


def _decode_state(
    wl: WorkloadInputs, decode: InstanceProfile, n_decode: int
) -> tuple[float, float]:
    """(active requests per decode instance, seconds per step) at the Little's-law fixed point
    ``c = X * step(c)`` with ``X = rate * out / (n_decode * accept)``; inf when unstable."""
    w = wl.resolved()
    ctx = w.avg_input_tokens + w.avg_output_tokens / 2.0
    x = wl.request_rate * w.avg_output_tokens / (n_decode * decode.accept_length)
    slope = decode.decode_step_per_seq_s + decode.decode_step_per_ctx_token_s * ctx
    denom = 1.0 - x * slope
    if denom <= 0.0:
        return math.inf, math.inf
    active = x * decode.decode_step_base_s / denom
    return active, decode.decode_step(active, active * ctx)


def _kv_need(wl: WorkloadInputs, active: float) -> float:
    """95th percentile of the summed context of ``active`` requests (normal approximation)."""
    w = wl.resolved()
    mean = w.avg_input_tokens + w.avg_output_tokens
    sd = max((w.p95_input_tokens or mean) - w.avg_input_tokens, 0.0) / Z95
    return active * mean + Z95 * math.sqrt(max(active, 0.0)) * sd


@dataclass(frozen=True)
class ModelLimits:
    """Utilisation caps that keep the plan off the knee of each queue."""

    max_prefill_util: float = 0.9
    max_link_util: float = 0.8
    kv_headroom: float = 0.7  # calibrated on the simulator: long tails fragment per-instance KV
    queue_pool: int = 1  # instances sharing one queue: sticky prefix routing pools poorly
    kv_scale: float = 1.0  # observed / modelled decode KV use (set by ``recommend``)
    session_imbalance: bool = True  # per-instance load varies with the sessions homed there


def evaluate(
    wl: WorkloadInputs,
    slo: SloInputs,
    prefill: InstanceProfile,
    decode: InstanceProfile,
    n_prefill: int,
    n_decode: int,
    limits: ModelLimits = ModelLimits(),
    hit_scale: float = 1.0,
) -> PlanEvaluation:
    """Predict TTFT p90, ITL, hit rate and constraint status of one plan (see module doc)."""
    w = wl.resolved()
    active, step = _decode_state(w, decode, n_decode)
    itl_ms = step / decode.accept_length * 1000.0
    kv_frac = (
        _kv_need(w, active) * limits.kv_scale / (decode.kv_capacity_tokens * limits.kv_headroom)
    )
    # Hit rate: one fixed-point pass on the session cycle (pause + ~TTFT + decode time).
    decode_s = w.avg_output_tokens * (step if math.isfinite(step) else 1.0) / decode.accept_length
    cycle = w.tool_pause_s + decode_s + prefill.prefill_overhead_s
    p_gpu, p_any = hit_probabilities(
        w, n_prefill * prefill.kv_capacity_tokens, n_prefill * prefill.host_cache_tokens, cycle
    )
    p_gpu, p_any = min(1.0, p_gpu * hit_scale), min(1.0, p_any * hit_scale)
    classes = _request_classes(w, prefill, p_gpu, p_any)
    total_in = sum(c.prob * c.input_tokens for c in classes)
    hit_rate = sum(c.prob * c.cached for c in classes) / total_in if total_in else 0.0
    mean_s = sum(c.prob * c.service_s for c in classes)
    second = sum(c.prob * c.service_s**2 for c in classes)
    cs2 = max(second / mean_s**2 - 1.0, 0.0) if mean_s > 0 else 0.0
    offered = w.request_rate * mean_s
    util = offered / n_prefill
    link_bw = min(n_prefill * prefill.nic_bytes_per_s, n_decode * decode.nic_bytes_per_s)
    link_util = w.request_rate * total_in * prefill.kv_bytes_per_token / link_bw
    flow_bw = min(prefill.nic_bytes_per_s, decode.nic_bytes_per_s) * max(1.0 - link_util, 1e-3)
    first_step = decode.decode_step(active, active * w.avg_input_tokens) if active < 1e12 else 1.0
    extra = [c.input_tokens * prefill.kv_bytes_per_token / flow_bw + first_step for c in classes]
    if util < 1.0 and math.isfinite(step):
        live = w.request_rate * cycle
        sticky_work = sum(c.prob * c.service_s for c in classes if c.sticky)
        hits, misses = _prefill_waits(
            w.request_rate, n_prefill, mean_s, cs2, live, limits, sticky_work / mean_s
        )
        waits = [hits if c.sticky else misses for c in classes]
        ttft = _ttft_quantile(classes, extra, waits, slo.ttft_quantile)
        attain = 1.0 - _ttft_tail(classes, extra, waits, slo.ttft_s)
    else:
        ttft, attain = math.inf, 0.0
    return PlanEvaluation(
        n_prefill=n_prefill,
        n_decode=n_decode,
        gpus=n_prefill * prefill.gpus + n_decode * decode.gpus,
        hit_rate=hit_rate,
        ttft_p90_s=ttft,
        itl_ms=itl_ms,
        prefill_util=util,
        link_util=link_util,
        decode_active_per_instance=active,
        decode_kv_need_fraction=kv_frac,
        ttft_attainment=attain,
        ttft_ok=ttft <= slo.ttft_s and util <= limits.max_prefill_util,
        itl_ok=itl_ms <= slo.itl_ms and active <= decode.max_running,
        kv_ok=kv_frac <= 1.0,
        link_ok=link_util <= limits.max_link_util,
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

    def eval(self, wl: WorkloadInputs, n_p: int, n_d: int) -> PlanEvaluation:
        return evaluate(
            wl, self.slo, self.prefill, self.decode, n_p, n_d, self.limits, self.hit_scale
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

    Decode first: the smallest decode pool whose KV and ITL hold at the full offered rate, and
    every other GPU to prefill, when prefill then keeps up (utilisation under 1); its goodput is
    the offered rate times the predicted TTFT attainment. Under closed-loop agent traffic a
    short decode pool is a cliff (requests wait for KV admission and the wait counts toward
    TTFT), a short prefill pool only stretches the TTFT tail, so at the cap decode is sized for
    the load and prefill takes the rest. When the budget cannot hold both, the highest rate
    whose fewest-GPU plan fits, with the leftover spent decode first (``_spend_leftover``).
    """
    b, gp, gd = ctx.bounds, ctx.prefill.gpus, ctx.decode.gpus
    top_d = min(b.max_decode, (budget - b.min_prefill * gp) // gd)
    n_d = _first_true(b.min_decode, top_d, lambda n: _decode_ok(ctx.eval(wl, b.min_prefill, n)))
    if n_d is not None:
        n_p = min(b.max_prefill, (budget - n_d * gd) // gp)
        n_d = min(b.max_decode, (budget - n_p * gp) // gd)
        full = ctx.eval(wl, n_p, n_d)
        if full.prefill_util < 1.0 and full.link_util < 1.0:
            return full, full.expected_goodput(wl.request_rate)

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


def _best_split(ctx: _Ctx, wl: WorkloadInputs, budget: int) -> tuple[PlanEvaluation, float]:
    """No plan meets the p90 target at any rate: pick the split of the budget with the most
    requests meeting both SLOs (coarse scan, then the neighbourhood of the best)."""
    b, gp, gd = ctx.bounds, ctx.prefill.gpus, ctx.decode.gpus

    def at(n_p: int) -> tuple[float, PlanEvaluation] | None:
        n_d = min((budget - n_p * gp) // gd, b.max_decode)
        if n_d < b.min_decode:
            return None
        ev = ctx.eval(wl, n_p, n_d)
        return ev.expected_goodput(wl.request_rate), ev

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
    good, ev = max(scored, key=lambda r: r[0])
    return ev, good


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
    half a point) the best TTFT attainment the bounds allow, on the smallest workable decode."""
    b = ctx.bounds
    n_d = _first_true(
        b.min_decode, b.max_decode, lambda n: _decode_ok(ctx.eval(wl, b.max_prefill, n))
    )
    n_d = b.max_decode if n_d is None else n_d
    top = ctx.eval(wl, b.max_prefill, n_d).expected_goodput(wl.request_rate)
    n_p = _first_true(
        b.min_prefill,
        b.max_prefill,
        lambda n: ctx.eval(wl, n, n_d).expected_goodput(wl.request_rate) >= top * 0.995,
    )
    ev = ctx.eval(wl, b.max_prefill if n_p is None else n_p, n_d)
    return ev, ev.expected_goodput(wl.request_rate)


def _reason(ev: PlanEvaluation, meets: bool, rate: float, full: float) -> str:
    ratio = f"{ev.n_prefill}P:{ev.n_decode}D"
    detail = (
        f"hit {ev.hit_rate:.0%}, prefill util {ev.prefill_util:.0%}, "
        f"TTFT p90 {ev.ttft_p90_s:.2f}s, ITL {ev.itl_ms:.1f}ms, "
        f"decode KV {ev.decode_kv_need_fraction:.0%}, link {ev.link_util:.0%}"
    )
    if meets:
        return f"{ratio} is the fewest GPUs ({ev.gpus}) meeting both SLOs: {detail}"
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
    prefill_alternatives: Sequence[InstanceProfile] = (),
    limits: ModelLimits = ModelLimits(),
) -> RatioRecommendation:
    """Recommend (N_P, N_D) for ``workload`` (rate replaced by the observed one when larger).

    ``observed.hit_rate`` measured at ``observed.prefill_replicas`` rescales the modelled
    returning-turn hit probability (clamped to [0.5, 1.5]); ``observed.decode_kv_usage`` at
    ``observed.decode_replicas`` rescales the modelled decode KV need (clamped to [1.0, 2.5]).
    ``prefill_alternatives`` are other CP shapes of the prefill instance; one that needs 5%
    fewer GPUs (or gives 5% more goodput at the cap) is reported as ``cp_hint``.
    """
    wl = workload.resolved()
    seen = wl  # the load the observations were made at (the forecast may be higher)
    if observed is not None and observed.arrival_rate is not None:
        seen = replace(wl, request_rate=observed.arrival_rate)
        wl = replace(wl, request_rate=max(wl.request_rate, observed.arrival_rate))
    hit_scale = _hit_scale(seen, slo, prefill, decode, bounds, observed, limits)
    limits = replace(limits, kv_scale=_kv_scale(seen, decode, observed))
    ctx = _Ctx(slo, prefill, decode, bounds, limits, hit_scale)
    ev, rate, meets = _plan(ctx, wl)
    hint = None
    for alt in prefill_alternatives:
        if alt.cp == prefill.cp and alt.layer_split == prefill.layer_split:
            continue
        aev, arate, ameets = _plan(replace(ctx, prefill=alt), wl)
        better = (
            (ameets and meets and aev.gpus <= 0.95 * ev.gpus)
            or (ameets and not meets)
            or (not ameets and not meets and arate >= 1.05 * rate)
        )
        if better:
            hint = alt.cp
            ev, rate, meets = aev, arate, ameets
            ctx = replace(ctx, prefill=alt)
    if hint is not None:  # the recommendation itself stays on the running CP size
        ev, rate, meets = _plan(replace(ctx, prefill=prefill), wl)
    return RatioRecommendation(
        n_prefill=ev.n_prefill,
        n_decode=ev.n_decode,
        gpus=ev.gpus,
        ttft_p90_s=ev.ttft_p90_s,
        itl_ms=ev.itl_ms,
        hit_rate=ev.hit_rate,
        goodput_rps=rate,
        meets_slo=meets,
        reason=_reason(ev, meets, rate, wl.request_rate)
        + (f"; prefill CP {hint} would need fewer GPUs (restart)" if hint else ""),
        cp_hint=hint,
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
    active, _ = _decode_state(w, decode, observed.decode_replicas)
    if not math.isfinite(active):
        return 1.0
    model = active * (w.avg_input_tokens + w.avg_output_tokens / 2.0) / decode.kv_capacity_tokens
    if model < 0.05:
        return 1.0
    return min(2.5, max(1.0, observed.decode_kv_usage / model))


def _hit_scale(
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


def failing_sides(
    observed: ObservedSignals, slo: SloInputs, tolerance: float = 1.2
) -> tuple[bool, bool]:
    """(prefill failing, decode failing) now: prefill when TTFT p90 is over ``tolerance`` x SLO
    with a prefill queue; decode when its KV is over 95%, or TTFT is over with transferred
    requests waiting for decode admission. Aborts are not decode evidence (in PD most are
    prefill time-budget aborts)."""
    ttft_bad = observed.ttft_p90_s is not None and observed.ttft_p90_s > slo.ttft_s * tolerance
    prefill_bad = ttft_bad and (observed.prefill_queue_depth or 0.0) > 0.0
    kv_bad = (observed.decode_kv_usage or 0.0) > 0.95
    decode_bad = kv_bad or (ttft_bad and (observed.decode_queue_depth or 0.0) > 0.0)
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
    slo: SloInputs,
    planned_decode: int,
    current_decode: int,
    prefill_pressed: bool = False,
) -> bool:
    """Whether ``next_replicas`` should rush capacity to decode (its ``decode_failing``):
    decode is the bottleneck (:func:`decode_saturated`), prefill is not failing too (by TTFT,
    or ``prefill_pressed``: another signal such as the operator's starvation hint; both
    failing is overload, not a misallocation), and the slow loop's plan itself asks for more
    decode (the fast loop's one-instance nudge keeps the stability wait)."""
    prefill_failing = failing_sides(observed, slo)[0] or prefill_pressed
    return decode_saturated(observed) and not prefill_failing and planned_decode > current_decode


def fast_adjust(
    target: tuple[int, int],
    current: tuple[int, int],
    observed: ObservedSignals,
    slo: SloInputs,
    tolerance: float = 1.2,
    at_budget: bool = False,
    decode_kv_keep: float = 0.8,
) -> tuple[int, int]:
    """Fast loop: raise the slow loop's target one instance above the current size on the side
    that is failing now (TTFT p90 over ``tolerance`` x SLO with a prefill queue; decode KV over
    95%, or TTFT over with transferred requests waiting for decode admission). Aborts are not
    decode evidence: in PD most are prefill time-budget aborts, which the anomaly loop's
    pressure hint turns into prefill growth. Off the budget cap it never lowers anything; at
    the cap (``at_budget``) the side that is not failing gives up one instance so the other can
    grow after it drained, unless the slow loop's target wants that side to grow.
    ``next_replicas`` then bounds the steps and orders them.

    Decode is never lowered below the size its observed KV use needs (used fraction x current
    size / ``decode_kv_keep``): a plan for a lower decode count made on other signals (a session
    storm reads as prefill demand, while the sessions it starts will soon fill decode) must not
    cut KV that is in use, since a decode shortage is a cliff under closed-loop traffic."""
    want_p, want_d = target
    prefill_bad, decode_bad = failing_sides(observed, slo, tolerance)
    if prefill_bad:
        want_p = max(want_p, current[0] + 1)
    if decode_bad:
        want_d = max(want_d, current[1] + 1)
    if at_budget and prefill_bad != decode_bad:
        # Only from a side the slow loop does not itself want to grow: the fast loop corrects
        # what the model misses, it does not overrule the model's own call that a side is short
        # (a closed-loop backlog keeps decode KV full at the right split; taking prefill for it
        # anyway walked a capped fleet from 13P:15D to 11P:17D, away from the plan's 14P:14D).
        if prefill_bad and target[1] <= current[1]:
            want_d = min(want_d, current[1] - 1)
        elif decode_bad and target[0] <= current[0]:
            want_p = min(want_p, current[0] - 1)
    if observed.decode_kv_usage is not None and want_d < current[1]:
        in_use = math.ceil(current[1] * observed.decode_kv_usage / decode_kv_keep - 1e-9)
        want_d = max(want_d, min(in_use, current[1]))
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

    def cooldown(self) -> float:
        return max(self.cooldown_s, self.pod_start_s)


@dataclass(frozen=True)
class ControlState:
    """What the controller remembers between ticks (the operator keeps it in status)."""

    last_prefill_change: float = -math.inf
    last_decode_change: float = -math.inf
    down_since_prefill: float | None = None
    down_since_decode: float | None = None


@dataclass(frozen=True)
class ControlDecision:
    prefill: int
    decode: int
    state: ControlState
    reason: str


def _step_limit(current: int, frac: float) -> int:
    return max(1, math.ceil(current * frac))


def _side_target(
    current: int,
    want: int,
    lo: int,
    hi: int,
    last_change: float,
    down_since: float | None,
    now: float,
    cfg: ControlConfig,
    fleet_units: float = 0.0,
) -> tuple[int, float | None, str]:
    """One pool's next replicas ignoring the budget: bounded step, cooldown, deadband, and a
    scale-down only after the lower target has held for ``down_stable_s``.

    A step up is bounded by ``max_step_fraction`` of the larger of this pool and the whole
    fleet counted in this pool's instances (``fleet_units``), so a small pool can take over
    what a large one releases at the budget cap in one step; a step down by the pool itself."""
    want = min(max(want, lo), hi)
    cur = min(max(current, lo), hi)
    if cur != current:  # out of bounds: fix immediately, bounds beat cooldown
        return cur, None, "bounds"
    if now - last_change < cfg.cooldown():
        keep_since = down_since if want < current else None
        return current, keep_since, "cooldown"
    step = _step_limit(current, cfg.max_step_fraction)
    if want > current:
        up = _step_limit(max(current, math.floor(fleet_units)), cfg.max_step_fraction)
        return min(want, current + up), None, "up"
    deadband = max(1, math.floor(current * cfg.deadband_fraction))
    if current - want < deadband:
        return current, None, "deadband"
    since = now if down_since is None else down_since
    if now - since < cfg.down_stable_s:
        return current, since, "waiting"
    return max(want, current - step), None, "down"


def next_replicas(
    current: CurrentReplicas,
    recommendation: RatioRecommendation,
    state: ControlState,
    now: float,
    config: ControlConfig,
    decode_failing: bool = False,
) -> ControlDecision:
    """Bounded, hysteretic step from ``current`` toward ``recommendation``.

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
    p, p_since, p_why = _side_target(
        current.prefill,
        recommendation.n_prefill,
        b.min_prefill,
        b.max_prefill,
        state.last_prefill_change,
        state.down_since_prefill,
        now,
        config,
        held / config.prefill_gpus,
    )
    d, d_since, d_why = _side_target(
        current.decode,
        recommendation.n_decode,
        b.min_decode,
        b.max_decode,
        state.last_decode_change,
        state.down_since_decode,
        now,
        config,
        held / config.decode_gpus,
    )
    p, d, why = _fit_budget(current, p, d, config)
    # At the cap a pool that wants to grow is blocked until the other one shrinks: a lower
    # target on the other side that has held for ``rebalance_stable_s`` (instead of the longer
    # scale-in ``down_stable_s``) is then a rebalance step; cooldown and step bounds still
    # apply, and the growth follows only once the removed pods are gone.
    settled = now - config.rebalance_stable_s
    d_ready = d_why == "waiting" and d_since is not None and d_since <= settled
    if p < min(recommendation.n_prefill, b.max_prefill) and d_ready:
        d, d_since, d_why = _rebalance_down(
            current.decode, recommendation.n_decode, b.min_decode, config
        )
    p_ready = p_why == "waiting" and p_since is not None and p_since <= settled
    p_ready = p_ready or (decode_failing and p_why == "waiting")
    if d < min(recommendation.n_decode, b.max_decode) and p_ready:
        p, p_since, p_why = _rebalance_down(
            current.prefill, recommendation.n_prefill, b.min_prefill, config
        )
    new_state = ControlState(
        last_prefill_change=now if p != current.prefill else state.last_prefill_change,
        last_decode_change=now if d != current.decode else state.last_decode_change,
        down_since_prefill=p_since,
        down_since_decode=d_since,
    )
    return ControlDecision(p, d, new_state, f"prefill {p_why}, decode {d_why}{why}")


def _rebalance_down(
    current: int, want: int, lo: int, cfg: ControlConfig
) -> tuple[int, float | None, str]:
    """One bounded scale-down step toward ``want`` (never below the floor ``lo``)."""
    step = _step_limit(current, cfg.max_step_fraction)
    return max(want, lo, current - step), None, "rebalance"


def _fit_budget(
    current: CurrentReplicas, p: int, d: int, cfg: ControlConfig
) -> tuple[int, int, str]:
    """Hold growth that would exceed the budget, counting pods that have not gone yet."""
    budget = cfg.bounds.gpu_budget
    if budget is None:
        return p, d, ""
    gp, gd = cfg.prefill_gpus, cfg.decode_gpus
    # Pods that exist now (spec + terminating) keep their GPUs; growth adds new pods on top.
    pods_p = max(current.prefill_pods, current.prefill)
    pods_d = max(current.decode_pods, current.decode)
    note = ""
    grow_p = 0
    if p > current.prefill:
        room = budget - pods_p * gp - pods_d * gd
        grow_p = max(0, min(p - current.prefill, room // gp))
        if grow_p < p - current.prefill:
            note = "; prefill growth waits for decode drain/budget"
        p = current.prefill + grow_p
    if d > current.decode:
        room = budget - (pods_p + grow_p) * gp - pods_d * gd
        grow = max(0, min(d - current.decode, room // gd))
        if grow < d - current.decode:
            note += "; decode growth waits for prefill drain/budget"
        d = current.decode + grow
    return p, d, note
