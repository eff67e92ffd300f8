"""Prefix-cache hit rate from the measured reuse times of prompt tokens (pure).

Data flow: the prefill engines export how long ago each prompt block was last referenced
(`cas_prefix_reuse_seconds`, token-weighted, spatially sampled; cas_engine.prefixreuse), the
tokens referenced for the first time, and their requests' sizes -> the observe layer reads the
windowed increases per pod -> `autoscale.signals.observed_signals` sums the prefill pods into
one `ReuseProfile` (`profile_from_counts`) -> `model.hit_probabilities` asks `hit_probability`
for the pool's GPU and GPU + host capacities at the planned request rate.

The model. A pooled LRU of ``C`` tokens (leaf-first, as SGLang's radix cache) keeps a block as
long as fewer than ``C`` tokens are in front of it. A token referenced again after ``tau``
seconds finds in front of it the distinct tokens referenced in between, ``W(tau)``, plus the
tokens of its own request that lie above it (they were referenced with it, but a radix tree
evicts leaves first): an offset uniform on ``[0, S)`` for a request of ``S`` tokens. So

    P(hit | tau) = P(W(tau) + offset < C)

``W(tau)`` has mean ``m(tau) = lambda * integral_0^tau P(R > t) dt`` (``lambda``: referenced
tokens per second, ``R``: a referenced token's reuse time, infinite for a first reference; the
"average eviction time" model of Hu et al. is the case without fluctuations), and it grows by
whole requests' contexts, so it fluctuates like a compound Poisson sum: variance
``m(tau) * S_b`` with ``S_b = E[S^2] / E[S]``, the request size a token sees. It is read as a
gamma distribution with that mean and variance; the offset's ``S`` is ``S_b`` too. The hit
share of referenced tokens is ``P(hit | tau)`` averaged over the measured reuse-time histogram
(linear inside a bucket, as Prometheus' `histogram_quantile` reads it; tokens past the last
finite bound never hit). Nothing is fitted: the measured distribution and sizes are the model.
On real Claude Code sessions (python -m bench.hitrate, docs/planner.md) it tracks an exact LRU
replay within 0.01 on average; without the fluctuation and the offset (a plain AET) it was
off by up to 0.10 at 25 live sessions and under-sized the cache for 90% hits by 27%.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

Buckets = tuple[tuple[float, float], ...]  # (upper bound s, cumulative value), +Inf last

NODES_PER_BUCKET = 2  # reuse times per histogram bucket the hit probability is averaged over
OFFSET_NODES = (0.125, 0.375, 0.625, 0.875)  # quantiles of the offset inside a request


@dataclass(frozen=True)
class ReuseProfile:
    """How referenced prompt tokens come back, over one window of the whole prefill pool.

    `reused`: per histogram bound (seconds, +Inf last), the share of referenced prompt tokens
    (those in full blocks) whose block was last referenced within that long before; the +Inf
    entry is the share seen before at all. `tokens_per_request`: referenced tokens per request
    (turns a request rate into ``lambda``). `size_biased_tokens`: ``E[S^2] / E[S]`` over the
    requests' referenced tokens ``S``. `returning_share`: prompt tokens of returning requests
    (those reusing a block seen before) per referenced token, which turns a hit share of
    referenced tokens into the returning requests' hit rate (None when not measured)."""

    reused: Buckets
    tokens_per_request: float
    size_biased_tokens: float
    returning_share: float | None = None

    @property
    def seen_share(self) -> float:
        """Share of referenced tokens seen before (what an unlimited cache would hit)."""
        return self.reused[-1][1] if self.reused else 0.0


def profile_from_counts(
    buckets: Sequence[tuple[float, float]],
    first_seen_tokens: float,
    requests: float,
    request_tokens: float,
    request_token_squares: float,
    returning_prompt_tokens: float | None = None,
) -> ReuseProfile | None:
    """A profile from one window's counts: cumulative reused tokens per bound (+Inf last),
    tokens referenced for the first time, requests, the sum of their referenced tokens and of
    its squares, and prompt tokens of returning requests. None when the window holds no
    reference or no request, or the histogram has no +Inf bucket."""
    ordered = sorted(buckets)
    if not ordered or not math.isinf(ordered[-1][0]) or requests <= 0 or request_tokens <= 0:
        return None
    total = ordered[-1][1] + max(first_seen_tokens, 0.0)
    if total <= 0:
        return None
    returning = None if returning_prompt_tokens is None else returning_prompt_tokens / total
    return ReuseProfile(
        reused=tuple((bound, count / total) for bound, count in ordered),
        tokens_per_request=request_tokens / requests,
        size_biased_tokens=request_token_squares / request_tokens,
        returning_share=returning,
    )


# ---------------------------------------------------------------- the reuse-time curve


def _points(profile: ReuseProfile) -> tuple[tuple[float, float], ...]:
    """The reused share as a piecewise-linear function of time: (0, 0), then every finite
    bound (cumulative shares made monotone)."""
    points = [(0.0, 0.0)]
    for bound, share in profile.reused:
        if math.isinf(bound) or bound <= points[-1][0]:
            continue
        points.append((bound, max(share, points[-1][1])))
    return tuple(points)


def _occupied(points: Sequence[tuple[float, float]], t: float) -> float:
    """``integral_0^t P(R > u) du``: the distinct tokens one referenced token per second
    leaves behind in ``t`` seconds (the mean of ``W(t)`` per unit ``lambda``)."""
    area = 0.0
    for (a, ha), (b, hb) in itertools.pairwise(points):
        if t <= b:
            h = ha + (hb - ha) * (t - a) / (b - a)
            return area + (t - a) * (1.0 - (ha + h) / 2.0)
        area += (b - a) * (1.0 - (ha + hb) / 2.0)
    last_t, last_h = points[-1]
    return area + (t - last_t) * (1.0 - last_h)


@functools.lru_cache(maxsize=64)
def _nodes(profile: ReuseProfile) -> tuple[tuple[float, float], ...]:
    """(share of referenced tokens, mean ``W`` per unit ``lambda``) at `NODES_PER_BUCKET`
    reuse times inside every finite bucket (uniform inside a bucket)."""
    points = _points(profile)
    nodes = []
    for (a, ha), (b, hb) in itertools.pairwise(points):
        share = (hb - ha) / NODES_PER_BUCKET
        if share <= 0.0:
            continue
        for j in range(NODES_PER_BUCKET):
            nodes.append((share, _occupied(points, a + (b - a) * (j + 0.5) / NODES_PER_BUCKET)))
    return tuple(nodes)


# ---------------------------------------------------------------- the hit probability


def _normal_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


def gamma_cdf(shape: float, x: float) -> float:
    """The regularized lower incomplete gamma ``P(shape, x)``: series below ``shape + 1``,
    continued fraction above, Wilson-Hilferty's normal approximation past shape 100."""
    if x <= 0.0:
        return 0.0
    if shape <= 1e-12:
        return 1.0
    if shape > 100.0:
        v = 1.0 / (9.0 * shape)
        return _normal_cdf(((x / shape) ** (1.0 / 3.0) - (1.0 - v)) / math.sqrt(v))
    if x > shape + 12.0 * math.sqrt(shape) + 40.0:
        return 1.0
    log_front = shape * math.log(x) - x - math.lgamma(shape)
    if x < shape + 1.0:
        term = total = 1.0 / shape
        a = shape
        for _ in range(500):
            a += 1.0
            term *= x / a
            total += term
            if term < total * 1e-12:
                break
        return min(1.0, total * math.exp(log_front))
    tiny = 1e-300
    b = x + 1.0 - shape
    c, d = 1.0 / tiny, 1.0 / b
    frac = d
    for i in range(1, 500):
        an = -i * (i - shape)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        step = d * c
        frac *= step
        if abs(step - 1.0) < 1e-12:
            break
    return max(0.0, 1.0 - math.exp(log_front) * frac)


def _fits(mean: float, size: float, room: float) -> float:
    """P(W < room) for ``W`` gamma with mean `mean` and variance ``mean * size``."""
    if room <= 0.0:
        return 0.0
    if size <= 0.0:
        return 1.0 if mean < room else 0.0
    return gamma_cdf(mean / size, room / size)


@functools.lru_cache(maxsize=8192)
def reused_share_hit(profile: ReuseProfile, capacity_tokens: float, request_rate: float) -> float:
    """Share of all referenced prompt tokens that hit a pooled LRU of `capacity_tokens` at
    `request_rate` requests per second (module doc)."""
    if capacity_tokens <= 0.0:
        return 0.0
    rate = max(request_rate, 0.0) * profile.tokens_per_request
    size = profile.size_biased_tokens
    total = 0.0
    for share, occupied in _nodes(profile):
        mean = rate * occupied
        fits = sum(_fits(mean, size, capacity_tokens - u * size) for u in OFFSET_NODES)
        total += share * fits / len(OFFSET_NODES)
    return total


def hit_probability(profile: ReuseProfile, capacity_tokens: float, request_rate: float) -> float:
    """P(a prompt token seen before is still cached): the returning turn's prefix hit
    probability the planner's request classes use (`model._request_classes`)."""
    seen = profile.seen_share
    if seen <= 0.0:
        return 0.0
    return min(reused_share_hit(profile, capacity_tokens, request_rate) / seen, 1.0)


def returning_hit_rate(
    profile: ReuseProfile, capacity_tokens: float, request_rate: float
) -> float | None:
    """Cached over prompt tokens of returning requests (None without `returning_share`): what
    `python -m bench.hitrate` compares with an exact LRU replay."""
    if not profile.returning_share:
        return None
    share = reused_share_hit(profile, capacity_tokens, request_rate)
    return min(share / profile.returning_share, 1.0)


Z95 = 1.6448536269514722  # the standard normal's 95th percentile
FIRST_TURN_RATIO = 0.5  # a first prompt over the mean prompt (`WorkloadInputs.resolved`'s)


@dataclass(frozen=True)
class RequestMix:
    """The planner's request classes, read from a measured profile instead of defaults (see
    `request_mix`)."""

    first_turn_fraction: float | None  # None: not measured (no returning share)
    new_tokens_per_turn: float | None
    p95_input_tokens: float
    context_sigma: float


def request_mix(profile: ReuseProfile, avg_input_tokens: float) -> RequestMix:
    """What the measured reuse says of the request mix the queueing model spreads its classes
    over (`model._request_classes`), which it would otherwise take from defaults:

    - the prompts' spread: ``E[S^2] / E[S]`` over ``E[S]`` (the engines count both) is
      ``1 + cv^2``; read as a lognormal, its log-sd and its 95th percentile (the decode KV
      need's tail; the default 1.8x the mean is a lognormal of log-sd 0.45);
    - the first turns' share: their prompts are the referenced tokens of requests that reuse
      nothing, ``1 - returning_share``; at the model's first-turn size (`FIRST_TURN_RATIO` of
      the mean prompt) that many tokens are ``(1 - returning_share) / FIRST_TURN_RATIO`` of
      the requests;
    - the new tokens of a returning turn: the tokens of returning requests not seen before,
      ``1 - seen_share / returning_share`` of their prompt.

    On real Claude Code sessions the model's defaults (5% first turns, the mean prompt for
    every returning turn, p95 at 1.8x) under-stated the long prompts' share of the prefill
    tail and of decode KV (docs/planner.md, "Real traffic")."""
    mean = max(profile.tokens_per_request, 1.0)
    cv2 = max(profile.size_biased_tokens / mean - 1.0, 0.0)
    sigma = math.sqrt(math.log1p(cv2))
    p95 = avg_input_tokens * math.exp(Z95 * sigma - sigma * sigma / 2.0)
    returning = profile.returning_share
    if not returning:
        return RequestMix(None, None, p95, sigma)
    first_share = min(max(1.0 - returning, 0.0), 1.0)
    fraction = min(max(first_share / FIRST_TURN_RATIO, 1e-3), 1.0)
    new_share = min(max(1.0 - profile.seen_share / returning, 0.0), 1.0)
    return RequestMix(fraction, max(new_share * avg_input_tokens, 1.0), p95, sigma)


def _significant(value: float, digits: int) -> float:
    return float(f"{value:.{digits}g}") if value > 0 else value


def quantized_profile(profile: ReuseProfile) -> ReuseProfile:
    """`profile` in coarse steps (shares to 0.005, sizes to 3 and 2 significant digits), so a
    steady load gives the same planner input tick after tick (`signals.quantized`)."""
    reused = []
    floor = 0.0
    for bound, share in profile.reused:
        floor = max(floor, round(round(share / 0.005) * 0.005, 6))
        reused.append((bound, floor))
    returning = profile.returning_share
    return ReuseProfile(
        reused=tuple(reused),
        tokens_per_request=_significant(profile.tokens_per_request, 3),
        size_biased_tokens=_significant(profile.size_biased_tokens, 2),
        returning_share=None if returning is None else round(returning, 3),
    )
