"""Prometheus metrics of prefix reuse (names in `cas_engine.prefixreuse`), registered on a
caller-supplied registry: prometheus-client's default ``REGISTRY`` in SGLang (multiprocess
mode, like the guard's), the worker's own in the sim engine, a fresh one in tests.

The reuse histogram counts tokens, not requests: `WeightedHistogram.observe_weighted` adds a
weight to the bucket (and weight x value to the sum) where `Histogram.observe` adds 1, on the
same value objects, so the exposition (and prometheus-client's multiprocess collector, which
sums bucket values across processes) is an ordinary histogram."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from cas_engine.prefixreuse.tracker import RequestReuse

# Seconds, log-spaced from a second to a day: reuse times of coding-agent sessions run from
# back-to-back tool calls to overnight pauses (bench.hitrate reads the same bounds).
REUSE_BUCKETS_S = (
    1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 240.0,
    300.0, 450.0, 600.0, 900.0, 1200.0, 1800.0, 2700.0, 3600.0, 5400.0, 7200.0, 10800.0,
    14400.0, 21600.0, 28800.0, 43200.0, 86400.0,
)  # fmt: skip


class WeightedHistogram(Histogram):
    """A histogram whose observations carry a weight (tokens)."""

    def observe_weighted(self, amount: float, weight: float) -> None:
        """Add `weight` to the bucket of `amount` (and `amount * weight` to the sum)."""
        self._raise_if_not_observable()  # type: ignore[no-untyped-call]
        self._sum.inc(amount * weight)
        for i, bound in enumerate(self._upper_bounds):
            if amount <= bound:
                self._buckets[i].inc(weight)
                break


class ReuseMetrics:
    """The prefix-reuse metrics of one engine."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.reuse = WeightedHistogram(
            "cas_prefix_reuse_seconds",
            "Prompt tokens by the time since their block was last referenced (token-weighted,"
            " sampled blocks scaled by the sample rate)",
            buckets=REUSE_BUCKETS_S,
            registry=registry,
        )
        self.first_seen = Counter(
            "cas_prefix_first_seen_tokens",
            "Prompt tokens of blocks never referenced before (sampled, scaled)",
            registry=registry,
        )
        self.requests = Counter(
            "cas_prefix_requests", "Requests whose prompt was tracked", registry=registry
        )
        self.request_tokens = Counter(
            "cas_prefix_request_tokens",
            "Full-block prompt tokens of tracked requests",
            registry=registry,
        )
        self.request_token_squares = Counter(
            "cas_prefix_request_token_squares",
            "Sum over tracked requests of their full-block prompt tokens squared",
            registry=registry,
        )
        self.returning_prompt_tokens = Counter(
            "cas_prefix_returning_prompt_tokens",
            "Prompt tokens of requests that reuse a block seen before",
            registry=registry,
        )

    def record(self, r: RequestReuse) -> None:
        for seconds in r.reuse_s:
            self.reuse.observe_weighted(seconds, r.block_tokens)
        self.first_seen.inc(r.first_seen_tokens)
        self.requests.inc()
        self.request_tokens.inc(r.request_tokens)
        self.request_token_squares.inc(float(r.request_tokens) ** 2)
        if r.returning:
            self.returning_prompt_tokens.inc(r.prompt_tokens)
