"""Histograms of engine latencies as the observe layer returns them (pure): merge the pods'
windowed buckets, read a quantile the way Prometheus' `histogram_quantile` does."""

from __future__ import annotations

import math
from collections.abc import Sequence

from cas_operator.observe.types import PodSignals

__all__ = ["histogram_quantile", "merged_buckets"]


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


def merged_buckets(signals: Sequence[PodSignals], itl: bool = False) -> list[tuple[float, float]]:
    """One histogram from the pods' TTFT (or ITL) buckets (counts summed per bound)."""
    merged: dict[float, float] = {}
    for s in signals:
        for bound, count in (s.itl_buckets if itl else s.ttft_buckets) or ():
            merged[bound] = merged.get(bound, 0.0) + count
    return sorted(merged.items())
