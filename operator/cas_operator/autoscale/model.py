"""The P:D queueing model for coding-agent traffic: its inputs, outputs and `evaluate` (pure).

No I/O, no clock, no client. `autoscale.search.recommend` searches plans with `evaluate`;
`desired.recommend` turns a CodingAgentServing spec into these inputs; the one replica
controller (`autoscale.controller`) reads `ObservedSignals` and `SloInputs` from here.

Model (per request class, see docs/planner.md for the derivation):

1. Hit rate depends on the plan. With the prefill engines' measured prompt reuse times
   (``WorkloadInputs.reuse``, a ``reuse.ReuseProfile`` the fleet tick sums from
   ``cas_prefix_*``), a returning turn's prefix hits with the probability ``reuse`` predicts
   for the pooled capacity at the planned rate: a token comes back after its measured reuse
   time and hits when the tokens referenced meanwhile, plus its own request's above it, fit
   (see ``autoscale/reuse.py``; within 0.01 of an exact LRU replay of real sessions).
   Without a measurement (before traffic, or engines that do not export it) the fallback is
   Che's approximation with exponential gaps: live sessions ``L = rate * cycle`` (Little's
   law; one request per cycle = tool pause + its own service time), each session's prefix an
   object of ``S`` tokens, ``T`` from ``capacity = L*S*(1 - exp(-T/cycle)) + end_rate*S*T``
   (live sessions plus finished ones that linger until evicted), P(hit) ``1 - exp(-T/cycle)``;
   on real sessions it asks for 1.4-3.4x the cache the replay needs (docs/planner.md), an
   error on the safe side that the measured hit rate (``search.hit_scale``) narrows at the
   running plan. Computed for the GPU tier and for GPU + host (HiCache) tier.
2. Uncached tokens per class: first turns miss (only a shared system prefix hits), returning
   hits prefill only their new tokens, returning misses prefill the whole context.
3. Prefill pool: hits queue at their cache home (one M/G/1 queue per instance, sticky load
   varying with the sessions homed there); misses go to the least-backlogged instance, so they
   level the under-loaded instances (water filling) and wait like one pooled M/G/n queue.
   Waiting times use the Allen-Cunneen-scaled Erlang C:
   ``P(W > t) = C(c, a) * exp(-2 (c*mu - lambda) t / (1 + cs^2))``. TTFT of a class is wait +
   its prefill time + KV transfer + one decode step; the p90 is solved exactly over the class
   mixture.
3a. Resident KV bounds prefill concurrency. An in-flight prefill keeps its whole context's KV
   resident on every CP rank from admission (host-tier prefix loaded first) until the decode
   side has pulled it, so an instance runs at most ``C = floor(capacity / context)`` requests
   at once (LayerSplit raises ``capacity`` by ``L / (ceil(L/cp) + 1)``). Per request the GPU is
   busy for the compute ``D``; the host load and the transfer hold KV without the GPU (``Z``).
   The instance's throughput is that of a closed network of one queue (``D``) and one delay
   (``Z``) with ``C`` jobs (exact mean value analysis, ``closed_throughput``): ``1/(D+Z)`` at
   ``C = 1``, ``1/D`` as ``C`` grows; ``1/X(C)`` is the service time the waits use. (In-flight
   KV is the most recently used prefix, so the LRU of step 1 already counts it.)
4. KV transfer: the whole context moves prefill -> decode; the link pool is the smaller of the
   two sides' NIC totals; one request's transfer runs at the smaller of the two sides'
   ``flow_bytes_per_s`` (the NICs that carry it, see ``profiles``), stretched by
   ``1 / (1 - rho_link)``.
5. Decode: per-instance active requests ``c`` from Little's law with the step time that itself
   depends on ``c`` and total context (closed-form fixed point). Constraints: ITL = step/accept
   under the SLO, and the 95th percentile of the summed context of ``c`` requests (per-request
   sd from the p95 context) under the KV capacity - not the mean. For comparing splits of a
   GPU cap, the probability that an instance's resident KV exceeds its capacity, with the
   count of requests on it Poisson (compound Poisson sum, ``kv_overflow``).

"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from statistics import NormalDist
from typing import Any

from cas_operator.autoscale.reuse import ReuseProfile, hit_probability

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
    context_sigma: float = 0.0  # lognormal log-sd of returning turns' contexts (0: all avg)
    prefix_cache_hit_rate: float | None = None  # declared; used only by mean-based baselines
    reuse: ReuseProfile | None = None  # measured prompt reuse times: the hit-rate curve's input
    # the arrival rate's variation from one metrics window to the next beyond counting noise
    # (coefficient of variation; `signals.rate_variation`): the decode KV cliff counts it
    rate_cv: float = 0.0

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
    """One instance shape (built by ``cas_operator.autoscale.profiles``); times in seconds."""

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
    nic_bytes_per_s: float  # the NICs that carry the instance's KV transfers, together
    flow_bytes_per_s: float  # one request's transfer from (or into) this instance
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
    # the arrival rate over the last `observe.types.RATE_WINDOW_S` (or the window when shorter):
    # what the trend and the variation read (`signals.forecast`)
    recent_arrival_rate: float | None = None
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
    avg_input_tokens: float | None = None  # per finished request (prefill pods)
    avg_output_tokens: float | None = None  # per finished request (decode pods)
    refused_rate: float | None = None  # the routers' 429s per second (admission), retries too
    demand_rate: float | None = None  # the rate to plan for while arrivals are throttled
    reuse: ReuseProfile | None = None  # prefill pods' prompt reuse times (cas_prefix_*), summed
    forecast_rate: float | None = None  # where a rising rate will be one pod start from now
    rate_cv: float | None = None  # the rate's window-to-window variation (`WorkloadInputs`)
    # the split the planner chose at its last tick (Auto's `status.autoscaler.planned`): a
    # split at the GPU cap replaces it only when it scores `search.MOVE_MARGIN` more
    planned_before: tuple[int, int] | None = None


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
    decode_kv_overflow: float  # P(one decode instance's resident KV exceeds its capacity)
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

    def cliff_goodput(self, rate: float) -> float:
        """Requests/s meeting both SLOs counting the decode KV cliff as a probability: the
        share meeting the TTFT target times the share of time decode KV holds its load
        (``1 - decode_kv_overflow``); zero when ITL, prefill or the link cannot keep up. For
        comparing splits of a GPU cap (`search._goodput_plan`), where the hard KV bound of
        ``expected_goodput`` puts decode on the cliff's edge."""
        if not (self.itl_ok and self.prefill_util < 1.0 and self.link_util < 1.0):
            return 0.0
        return rate * self.ttft_attainment * (1.0 - self.decode_kv_overflow)


@dataclass(frozen=True)
class RatioRecommendation:
    """What the planner recommends for one prefill and one decode shape."""

    n_prefill: int
    n_decode: int
    gpus: int
    ttft_p90_s: float
    itl_ms: float
    hit_rate: float
    goodput_rps: float
    meets_slo: bool
    reason: str


# ---------------------------------------------------------------- model pieces


def kv_concurrency(capacity_tokens: float, context_tokens: float) -> int:
    """In-flight prefills an instance can hold: whole contexts that fit in its KV capacity (0
    when one context does not fit: SGLang refuses such a request)."""
    if context_tokens <= 0.0:
        return 1_000_000
    return int(capacity_tokens // context_tokens)


def closed_throughput(busy_s: float, idle_s: float, population: int) -> float:
    """Requests/s of ``population`` jobs cycling through one queueing station (service
    ``busy_s``, the GPU) and one delay station (``idle_s``, KV resident without the GPU): exact
    mean value analysis. ``1/(busy+idle)`` at 1, rising to ``1/busy``; 0 with no population."""
    if population <= 0 or busy_s <= 0.0:
        return 0.0 if population <= 0 else math.inf
    population = min(population, 256)  # beyond that, within 1e-6 of 1/busy for idle < 50 busy
    queue = 0.0
    throughput = 0.0
    for n in range(1, population + 1):
        residence = busy_s * (1.0 + queue)
        throughput = n / (residence + idle_s)
        queue = throughput * residence
    return throughput


@dataclass(frozen=True)
class PrefillCapacity:
    """What one prefill instance sustains for one request shape (see ``prefill_capacity``)."""

    concurrency: int  # requests whose KV fits at once
    busy_s: float  # GPU seconds per request
    idle_s: float  # seconds its KV stays resident without the GPU (host load + transfer)
    throughput_rps: float  # closed_throughput at ``concurrency``


def prefill_capacity(
    prefill: InstanceProfile,
    context_tokens: float,
    cached_tokens: float,
    host_cached_tokens: float,
    transfer_bytes_per_s: float,
) -> PrefillCapacity:
    """Saturated throughput of one prefill instance for requests of ``context_tokens`` with
    ``cached_tokens`` of them cached (``host_cached_tokens`` of those on the host tier)."""
    new = max(context_tokens - cached_tokens, 0.0)
    busy = prefill.prefill_time(new, cached_tokens)
    load = prefill.host_load_s_per_token * host_cached_tokens
    xfer = context_tokens * prefill.kv_bytes_per_token / transfer_bytes_per_s
    c = kv_concurrency(prefill.kv_capacity_tokens, context_tokens)
    return PrefillCapacity(c, busy, load + xfer, closed_throughput(busy, load + xfer, c))


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
    """P(returning turn finds its prefix on GPU), P(on GPU or host) for pooled capacities:
    from the measured reuse times when `wl.reuse` is there, else Che's approximation with
    exponential gaps of `cycle_s` (module doc, item 1)."""
    if wl.reuse is not None:
        rate = wl.request_rate
        gpu = hit_probability(wl.reuse, gpu_tokens, rate)
        return gpu, max(gpu, hit_probability(wl.reuse, gpu_tokens + host_tokens, rate))
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
    load_s: float = 0.0  # of service_s: host-tier load, KV resident but the GPU free for others


CONTEXT_POINTS = 4  # quantile points of new tokens when contexts spread
# Contexts are spread over bins of these probabilities, finer toward the top: the TTFT p90 is
# set by the longest tenth (a long context's host load and KV transfer), which equal bins
# would fold into one point at their median.
TAIL_BINS = (0.5, 0.25, 0.15, 0.07, 0.025, 0.005)


def _tail_points(sigma: float) -> list[tuple[float, float]]:
    """(probability, conditional mean) of a mean-1 lognormal over `TAIL_BINS`: the mean of
    each bin, so the points keep the distribution's mean."""
    nd = NormalDist()
    out, lo = [], 0.0
    for p in TAIL_BINS:
        hi = min(lo + p, 1.0)
        a = nd.inv_cdf(lo) if lo > 0.0 else -math.inf
        b = nd.inv_cdf(hi) if hi < 1.0 else math.inf
        mass = _phi(b) - _phi(a)
        out.append((mass, (_phi(b - sigma) - _phi(a - sigma)) / mass))
        lo = hi
    return out


def _phi(z: float) -> float:
    return 0.0 if z == -math.inf else 1.0 if z == math.inf else NormalDist().cdf(z)


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
    # (probability, input, cached, host-cached, sticky: a hit routed to its cache home)
    spec: list[tuple[float, float, float, float, bool]] = []
    firsts = _lognormal_points(w.first_turn_sigma)
    spec += [(f / len(firsts), first * m, min(shared, first * m), 0.0, False) for m in firsts]
    spread = w.context_sigma > 0.0
    contexts = _tail_points(w.context_sigma) if spread else [(1.0, 1.0)]
    news = _lognormal_points(w.new_tokens_sigma, CONTEXT_POINTS if spread else 6)
    for share, c in contexts:
        ctx = avg * c
        q = ret * share / len(news)
        for m in news:
            n = min(new * m, ctx)
            spec.append((q * p_gpu, ctx, ctx - n, 0.0, True))
            spec.append((q * max(p_any - p_gpu, 0.0), ctx, ctx - n, ctx - n, True))
    for share, c in contexts:
        ctx = avg * c
        spec.append((ret * (1.0 - p_any) * share, ctx, min(shared, ctx), 0.0, False))
    return [
        _Class(
            p,
            inp,
            cached,
            prefill.prefill_time(inp - cached, cached, host),
            sticky=sticky,
            load_s=prefill.host_load_s_per_token * host,
        )
        for p, inp, cached, host, sticky in spec
        if p > 0.0
    ]


_Wait = tuple[float, float, float]  # (share of requests, P(wait > 0), tail rate theta)
_Waits = Sequence[_Wait]  # a waiting-time mixture


def _tail_terms(
    classes: Sequence[_Class], extra_s: Sequence[float], waits: Sequence[_Waits]
) -> list[tuple[float, float, float, float]]:
    """(delay D, mass, mass that waits, tail rate theta) per class and wait group."""
    return [
        (c.service_s + x, share * c.prob, share * c.prob * wait_prob, theta)
        for c, x, mix in zip(classes, extra_s, waits, strict=True)
        for share, wait_prob, theta in mix
    ]


def _tail_at(terms: Sequence[tuple[float, float, float, float]], t: float) -> float:
    total = 0.0
    for d, mass, waiting, theta in terms:
        if t < d:
            total += mass
        elif theta <= 0.0:
            total += waiting
        else:
            total += waiting * math.exp(-theta * (t - d))
    return total


def _ttft_tail(
    classes: Sequence[_Class], extra_s: Sequence[float], waits: Sequence[_Waits], t: float
) -> float:
    """P(W + D > t): D is the class delay; W is the class's wait mixture over instance groups,
    each with an atom at 0 and an exponential tail of rate ``theta`` with mass P(wait > 0)."""
    return _tail_at(_tail_terms(classes, extra_s, waits), t)


ATTAINMENT_NOISE = 1e-9  # the tail's sum of class masses is exact only to float rounding


def _attainment(share: float) -> float:
    """A share of requests meeting the TTFT target, in [0, 1], with float noise around 0 read
    as 0: the tail sums class masses, so a split that serves none came out at +-6e-15, and the
    planner's ties at zero goodput (`search._best_split`) missed it."""
    return 0.0 if share < ATTAINMENT_NOISE else min(share, 1.0)


def _ttft_quantile(
    classes: Sequence[_Class], extra_s: Sequence[float], waits: Sequence[_Waits], q: float
) -> float:
    """Smallest t with P(W + D > t) <= 1 - q (bisection to 0.1 ms; the tail is monotone)."""
    terms = _tail_terms(classes, extra_s, waits)
    slowest = min((theta for *_, theta in terms if theta > 0.0), default=0.0)
    target = 1.0 - q
    lo, hi = 0.0, max(d for d, *_ in terms) + (50.0 / slowest if slowest > 0 else 1e6)
    if _tail_at(terms, hi) > target:
        return math.inf
    while hi - lo > 1e-4:
        mid = (lo + hi) / 2.0
        if _tail_at(terms, mid) > target:
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


def decode_state(wl: WorkloadInputs, decode: InstanceProfile, n_decode: int) -> tuple[float, float]:
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


def kv_overflow(wl: WorkloadInputs, active: float, capacity_tokens: float) -> float:
    """P(the resident KV of one decode instance exceeds ``capacity_tokens``) with ``active``
    requests on it on average: the count is Poisson (arrivals and departures independent of
    each other, M/G/inf), each request's context drawn from the measured mix, so the sum is a
    compound Poisson of mean ``active * m`` and variance ``active * E[X^2] = active * (m^2 +
    sd^2)`` (normal approximation). The count's own variance dominates at the few to tens of
    requests an instance of long-context agents holds: ``_kv_need``'s fixed count misses it.

    When the rate itself varies from minute to minute (``rate_cv``, measured), the count is a
    mixed Poisson whose mean moves with it: its variance gains ``(rate_cv * active)^2``, so the
    sum's gains ``(rate_cv * active * m)^2``. Why: a decode pool held on its expected count
    sat on the cliff in the bursts of a Mooncake-shaped load, which no mean reveals
    (bench.planner_traces' surge: 27P:5D served 4.7 req/s where 26P:6D served 8.3)."""
    if not math.isfinite(active):
        return 1.0
    if active <= 0.0:
        return 0.0
    w = wl.resolved()
    mean = w.avg_input_tokens + w.avg_output_tokens
    sd = max((w.p95_input_tokens or mean) - w.avg_input_tokens, 0.0) / Z95
    moving = w.rate_cv * active * mean
    spread = math.sqrt(active * (mean * mean + sd * sd) + moving * moving)
    return 1.0 - NormalDist().cdf((capacity_tokens - active * mean) / spread)


@dataclass(frozen=True)
class ModelLimits:
    """Utilisation caps that keep the plan off the knee of each queue."""

    max_prefill_util: float = 0.9
    max_link_util: float = 0.8
    kv_headroom: float = 0.7  # calibrated on the simulator: long tails fragment per-instance KV
    queue_pool: int = 1  # instances sharing one queue: sticky prefix routing pools poorly
    kv_scale: float = 1.0  # observed / modelled decode KV use (set by ``recommend``)
    session_imbalance: bool = True  # per-instance load varies with the sessions homed there
    # Misses (first turns, evicted prefixes) go to the least-backlogged instance and wait in
    # one pooled queue. The product's routers do not: the keyed policies (smg's
    # consistent_hashing, sglang-router's manual) send every request of a session to the
    # instance its id maps to, and cache_aware sends a returning turn home and a new session to
    # the instance with the smallest tree, blind to load unless the instances' request counts
    # differ by more than 64 (never, for prefill queues of a few requests), so by default
    # misses queue where they land.
    balanced_misses: bool = False


def _pool_capacity(
    classes: Sequence[_Class],
    transfer_s: Sequence[float],
    context_tokens: float,
    prefill: InstanceProfile,
) -> PrefillCapacity:
    """``prefill_capacity`` over the class mixture: mean GPU and mean resident-idle seconds,
    concurrency from the mean context (every class is a whole context held until sent)."""
    busy = sum(c.prob * (c.service_s - c.load_s) for c in classes)
    idle = sum(c.prob * (c.load_s + x) for c, x in zip(classes, transfer_s, strict=True))
    c = kv_concurrency(prefill.kv_capacity_tokens, context_tokens)
    return PrefillCapacity(c, busy, idle, closed_throughput(busy, idle, c))


def evaluate(
    wl: WorkloadInputs,
    slo: SloInputs,
    prefill: InstanceProfile,
    decode: InstanceProfile,
    n_prefill: int,
    n_decode: int,
    limits: ModelLimits = ModelLimits(),
    hit_scale: float = 1.0,
    ttft_scale: float = 1.0,
) -> PlanEvaluation:
    """Predict TTFT p90, ITL, hit rate and constraint status of one plan (see module doc).
    `hit_scale` and `ttft_scale` calibrate the model by what the fleet measured
    (`search.hit_scale`, `search.ttft_scale`): the hit probabilities times the first, the TTFT
    distribution stretched by the second."""
    w = wl.resolved()
    active, step = decode_state(w, decode, n_decode)
    itl_ms = step / decode.accept_length * 1000.0
    kv_frac = (
        _kv_need(w, active) * limits.kv_scale / (decode.kv_capacity_tokens * limits.kv_headroom)
    )
    # Hit rate: one fixed-point pass on the session cycle (pause + ~TTFT + decode time).
    decode_s = w.avg_output_tokens * (step if math.isfinite(step) else 1.0) / decode.accept_length
    cycle = w.tool_pause_s + decode_s + prefill.prefill_overhead_s
    link_bw = min(n_prefill * prefill.nic_bytes_per_s, n_decode * decode.nic_bytes_per_s)
    p_gpu, p_any = hit_probabilities(
        w, n_prefill * prefill.kv_capacity_tokens, n_prefill * prefill.host_cache_tokens, cycle
    )
    p_gpu, p_any = min(1.0, p_gpu * hit_scale), min(1.0, p_any * hit_scale)
    classes = _request_classes(w, prefill, p_gpu, p_any)
    total_in = sum(c.prob * c.input_tokens for c in classes)
    link_util = w.request_rate * total_in * prefill.kv_bytes_per_token / link_bw
    flow_bw = min(prefill.flow_bytes_per_s, decode.flow_bytes_per_s) * max(1.0 - link_util, 1e-3)
    transfer = [c.input_tokens * prefill.kv_bytes_per_token / flow_bw for c in classes]
    capacity = _pool_capacity(classes, transfer, w.avg_input_tokens, prefill)
    hit_rate = sum(c.prob * c.cached for c in classes) / total_in if total_in else 0.0
    mean_s = 1.0 / capacity.throughput_rps if capacity.throughput_rps > 0.0 else math.inf
    served = sum(c.prob * c.service_s for c in classes)
    second = sum(c.prob * c.service_s**2 for c in classes)
    cs2 = max(second / served**2 - 1.0, 0.0) if served > 0 else 0.0
    util = w.request_rate * mean_s / n_prefill
    first_step = decode.decode_step(active, active * w.avg_input_tokens) if active < 1e12 else 1.0
    extra = [x + first_step for x in transfer]
    if util < 1.0 and math.isfinite(step):
        live = w.request_rate * cycle
        if limits.balanced_misses:
            sticky_work = sum(c.prob * c.service_s for c in classes if c.sticky) / served
        else:  # the product's router places misses blind to load: they queue like the hits
            sticky_work = 1.0
        hits, misses = _prefill_waits(
            w.request_rate, n_prefill, mean_s, cs2, live, limits, sticky_work
        )
        waits = [hits if c.sticky or not limits.balanced_misses else misses for c in classes]
        ttft = _ttft_quantile(classes, extra, waits, slo.ttft_quantile) * ttft_scale
        attain = _attainment(1.0 - _ttft_tail(classes, extra, waits, slo.ttft_s / ttft_scale))
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
        decode_kv_overflow=kv_overflow(w, active, decode.kv_capacity_tokens / limits.kv_scale),
        ttft_ok=ttft <= slo.ttft_s and util <= limits.max_prefill_util,
        itl_ok=itl_ms <= slo.itl_ms and active <= decode.max_running,
        kv_ok=kv_frac <= 1.0,
        link_ok=link_util <= limits.max_link_util,
    )
