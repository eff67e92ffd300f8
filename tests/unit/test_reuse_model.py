"""The hit-rate model from measured reuse times (cas_operator.autoscale.reuse).

Guards: the occupancy integral against closed forms, the gamma distribution against its
known cases, and the properties the planner relies on (more cache never hits less, shorter
pauses hit more at the same cache, an unlimited cache hits what was seen before)."""

from __future__ import annotations

import itertools
import math

import pytest

from cas_operator.autoscale.reuse import (
    ReuseProfile,
    gamma_cdf,
    hit_probability,
    profile_from_counts,
    returning_hit_rate,
    reused_share_hit,
)

BOUNDS = tuple(0.05 * 1.08**k for k in range(160))  # 0.05 s .. ~10^4 s, fine


def _exponential(mean_s: float, seen: float = 1.0, size: float = 1e-9) -> ReuseProfile:
    """Reuse times exponential with `mean_s`; `seen` of the tokens reused at all."""
    reused = tuple((b, seen * (1.0 - math.exp(-b / mean_s))) for b in BOUNDS)
    return ReuseProfile((*reused, (math.inf, seen)), 1000.0, size, None)


def test_without_fluctuation_it_is_the_aet_closed_form() -> None:
    """Exponential reuse times, every token reused, tiny requests: the LRU holds the tokens
    of the last T seconds, C = lambda * mean * (1 - e^(-T/mean)), so the hit share is
    C / (lambda * mean) (Che's approximation is exact for this case)."""
    profile = _exponential(mean_s=60.0)
    rate = 2.0  # requests/s -> lambda = 2000 tokens/s; lambda * mean = 120k tokens
    for capacity in (12_000.0, 60_000.0, 108_000.0):
        assert reused_share_hit(profile, capacity, rate) == pytest.approx(
            capacity / 120_000.0, abs=0.01
        )


def test_first_references_take_room_and_never_hit() -> None:
    """Half the tokens never seen before: they fill the cache for the whole T, so the same
    capacity holds a shorter T of the reused half."""
    half = _exponential(mean_s=60.0, seen=0.5)
    full = _exponential(mean_s=60.0, seen=1.0)
    assert reused_share_hit(half, 60_000.0, 2.0) / 0.5 < reused_share_hit(full, 60_000.0, 2.0)
    assert hit_probability(half, 1e12, 2.0) == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("shape", [0.3, 1.0, 2.0, 7.5, 40.0, 250.0])
def test_gamma_cdf_matches_known_values(shape: float) -> None:
    for x in (0.1, 0.5 * shape, shape, 2.0 * shape + 1.0):
        if shape == 1.0:
            expected = 1.0 - math.exp(-x)
        elif shape == 2.0:
            expected = 1.0 - math.exp(-x) * (1.0 + x)
        else:
            expected = _gamma_by_sum(shape, x)
        assert gamma_cdf(shape, x) == pytest.approx(expected, abs=2e-3)
    assert gamma_cdf(shape, 0.0) == 0.0


def _gamma_by_sum(shape: float, x: float, steps: int = 200_000) -> float:
    """P(shape, x) by the midpoint rule on the density (after ``u = v^(1/shape)`` below shape
    1, where the density is singular at 0): a reference for the test only."""
    if shape < 1.0:
        dv = x**shape / steps
        total = sum(math.exp(-(((i + 0.5) * dv) ** (1.0 / shape))) for i in range(steps))
        return total * dv / shape / math.gamma(shape)
    du = x / steps
    log_norm = math.lgamma(shape)
    total = sum(
        math.exp((shape - 1.0) * math.log((i + 0.5) * du) - (i + 0.5) * du - log_norm)
        for i in range(steps)
    )
    return total * du


def _trace_like(pause_scale: float = 1.0) -> ReuseProfile:
    """Heavy-tailed reuse times (lognormal, median 19 s x scale), 95% of tokens reused,
    100K-token requests."""
    mu, sigma = math.log(19.0 * pause_scale), 2.0
    reused = tuple(
        (b, 0.95 * 0.5 * math.erfc(-(math.log(b) - mu) / (sigma * math.sqrt(2.0)))) for b in BOUNDS
    )
    return ReuseProfile((*reused, (math.inf, 0.95)), 100_000.0, 180_000.0, 1.0)


def test_more_cache_never_hits_less_and_unlimited_hits_what_was_seen() -> None:
    profile = _trace_like()
    hits = [hit_probability(profile, c * 1e6, 0.5) for c in (0.25, 0.5, 1, 2, 4, 8, 16, 64, 1e4)]
    assert all(b >= a - 1e-9 for a, b in itertools.pairwise(hits))
    assert hits[0] < 0.5 < hits[-1] and hits[-1] > 0.97
    assert reused_share_hit(profile, 0.0, 0.5) == 0.0


def test_shorter_pauses_hit_more_at_the_same_cache_and_rate() -> None:
    """What Che's approximation with exponential gaps could not show: the hit rate moves with
    the think times, not only with the mean cycle."""
    slow, fast = _trace_like(1.0), _trace_like(0.25)
    assert hit_probability(fast, 2e6, 0.5) > hit_probability(slow, 2e6, 0.5) + 0.05


def test_big_requests_fluctuate_the_cache_and_lower_mid_range_hits() -> None:
    """The same reuse times with 10x bigger requests (same token rate): whole contexts come
    and go, so the cache a reference finds fluctuates more and its own request's upper blocks
    sit in front of it; near the knee that costs hits."""
    small = _trace_like()
    big = ReuseProfile(small.reused, small.tokens_per_request, 10 * small.size_biased_tokens, 1.0)
    assert reused_share_hit(big, 3e6, 0.5) < reused_share_hit(small, 3e6, 0.5) - 0.05


def test_profile_from_counts_normalises_one_window() -> None:
    buckets = [(10.0, 600.0), (math.inf, 900.0), (60.0, 800.0)]  # any order
    p = profile_from_counts(buckets, 100.0, 4.0, 1000.0, 300_000.0, 950.0)
    assert p is not None
    assert p.reused == ((10.0, 0.6), (60.0, 0.8), (math.inf, 0.9))
    assert p.tokens_per_request == 250.0 and p.size_biased_tokens == 300.0
    assert p.returning_share == pytest.approx(0.95)
    assert profile_from_counts([(10.0, 5.0)], 1.0, 1.0, 1.0, 1.0) is None  # no +Inf bucket
    assert profile_from_counts([(math.inf, 0.0)], 0.0, 1.0, 1.0, 1.0) is None  # no tokens
    assert profile_from_counts([(math.inf, 5.0)], 1.0, 0.0, 1.0, 1.0) is None  # no request


def test_returning_hit_rate_needs_the_returning_share() -> None:
    p = _trace_like()
    with_share = returning_hit_rate(p, 4e6, 0.5)
    assert with_share is not None and 0.0 < with_share <= 1.0
    no_share = ReuseProfile(p.reused, p.tokens_per_request, p.size_biased_tokens, None)
    assert returning_hit_rate(no_share, 4e6, 0.5) is None
