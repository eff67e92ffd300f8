"""Small statistics shared by the loops that judge counts against rates (pure).

`exceeds` is the one-sided test the anomaly loop (a pod against its threshold and its pool)
and the rollout analysis (a canary against its stable revision) both use.
"""

from __future__ import annotations

import math

__all__ = ["exceeds", "poisson_sf"]


def poisson_sf(k: float, lam: float) -> float:
    """P(X >= k) for X ~ Poisson(lam), k rounded down; log-space so large lam cannot underflow."""
    n = math.floor(k)
    if n <= 0:
        return 1.0
    if lam <= 0.0:
        return 0.0
    if n > 5000:  # normal approximation with continuity correction; exact sums get long
        z = (n - 0.5 - lam) / math.sqrt(lam)
        return 0.5 * math.erfc(z / math.sqrt(2.0))
    if n > lam:  # upper tail: terms shrink geometrically from n on
        return min(1.0, _sum_pmf(range(n, n + 20000), lam))
    return max(0.0, 1.0 - _sum_pmf(range(n), lam))


def _sum_pmf(js: range, lam: float) -> float:
    """Sum of Poisson(lam) probabilities over `js`, stopping once terms stop mattering."""
    total = 0.0
    log_lam = math.log(lam)
    for j in js:
        term = math.exp(-lam + j * log_lam - math.lgamma(j + 1))
        total += term
        if j > lam and term < total * 1e-15:
            break
    return total


def exceeds(count: float, checked: float, rate: float, alpha: float) -> bool:
    """True when `count` events in `checked` trials are significantly above `rate`."""
    return count > checked * rate and poisson_sf(count, checked * rate) < alpha
