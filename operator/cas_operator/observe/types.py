"""The observe layer's contract: targets in, per-pod signals (or explicit errors) out.

`PodSignals` (one pod's metrics over a window) and `PodView` (a pod as the fleet tick saw it,
joined with its signals) are the shared inputs of the anomaly and autoscale loops."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from cas_operator.api import constants as c

# Engine metric names (cas_engine.guard / kvfence / sim; SGLang's scheduler names).
CHECKED: Final = "cas_guard_requests_checked_total"
TRIPS: Final = "cas_guard_trips_total"
UNHEALTHY: Final = "cas_kv_unhealthy_by_quarantine"
RUNNING: Final = "sglang:num_running_reqs"
QUEUED: Final = "sglang:num_queue_reqs"
ABORTED: Final = "sglang:num_aborted_requests_total"
TOKEN_USAGE: Final = "sglang:token_usage"
REQUESTS: Final = "sglang:num_requests_total"
# REQUESTS over the last RATE_WINDOW_S (the counters' key): the arrival rate the planner's trend
# and variation read, which a long anomaly window would smooth away (`signals.forecast`)
RECENT_REQUESTS: Final = "recent_requests"
RATE_WINDOW_S: Final = 60.0
PROMPT_TOKENS: Final = "sglang:prompt_tokens_total"
CACHED_TOKENS: Final = "sglang:cached_tokens_total"
GENERATION_TOKENS: Final = "sglang:generation_tokens_total"  # metrics_collector.py:1860
# feed the ratio autoscaler and the request shape admission is sized for
LOAD_COUNTERS: Final = (REQUESTS, PROMPT_TOKENS, CACHED_TOKENS, GENERATION_TOKENS)
TTFT_BUCKET: Final = "sglang:time_to_first_token_seconds_bucket"  # cumulative, label `le`
# SGLang 0.5.23 srt/observability/metrics_collector.py:2051; decode pods observe it per token.
ITL_BUCKET: Final = "sglang:inter_token_latency_seconds_bucket"
# Prompt reuse times from the prefill engines (cas_engine.prefixreuse): a token-weighted
# histogram (bucket values are tokens) and its counters, the hit-rate model's inputs.
REUSE_BUCKET: Final = "cas_prefix_reuse_seconds_bucket"
HISTOGRAMS: Final = (TTFT_BUCKET, ITL_BUCKET, REUSE_BUCKET)
FIRST_SEEN_TOKENS: Final = "cas_prefix_first_seen_tokens_total"
REUSE_REQUESTS: Final = "cas_prefix_requests_total"
REUSE_REQUEST_TOKENS: Final = "cas_prefix_request_tokens_total"
REUSE_REQUEST_TOKEN_SQUARES: Final = "cas_prefix_request_token_squares_total"
RETURNING_PROMPT_TOKENS: Final = "cas_prefix_returning_prompt_tokens_total"
REUSE_COUNTERS: Final = (
    FIRST_SEEN_TOKENS,
    REUSE_REQUESTS,
    REUSE_REQUEST_TOKENS,
    REUSE_REQUEST_TOKEN_SQUARES,
    RETURNING_PROMPT_TOKENS,
)
# Failed PD KV hand-offs (SGLang 0.5.23 srt/observability/metrics_collector.py:667-673).
KV_FAILURE_COUNTERS: Final = (
    "sglang:num_transfer_failed_reqs_total",
    "sglang:num_bootstrap_failed_reqs_total",
)
KV_FAILURES: Final = "kv_failures"  # the counters' key of their sum (one pod's)
# The router's answers by HTTP status (sglang-router 0.3.2 / smg; label `status_code`).
ROUTER_RESPONSES: Final = "smg_http_responses_total"
RESPONSES: Final = "responses"  # the counters' key of all of a router pod's answers
ERRORS_5XX: Final = "responses_5xx"  # ... and of those with a 5xx status
# ... and of those refused by the router's admission limit (measured on 0.3.2: its rate limiter's
# 429s are counted here, `status_code="429"`)
REFUSED: Final = "responses_429"
REASON_LOW: Final = "low_accept_length"
REASON_HIGH: Final = "high_accept_rate"
# PD queues of requests whose KV is not handed over yet (SGLang 0.5.23
# srt/observability/metrics_collector.py:583-605): a pod with any is not idle.
KV_TRANSFER_QUEUES: Final = (
    "sglang:num_prefill_bootstrap_queue_reqs",
    "sglang:num_prefill_inflight_queue_reqs",
    "sglang:num_decode_prealloc_queue_reqs",
    "sglang:num_decode_transfer_queue_reqs",
)
KV_TRANSFERS: Final = "kv_transfers"  # the gauges' key of their sum (one pod's)
GAUGES: Final = (UNHEALTHY, RUNNING, QUEUED, TOKEN_USAGE)


@dataclass(frozen=True)
class PodSignals:
    """One pod's metrics over the window (counts are increases; gauges are latest values).

    `error` set means the source could not measure this pod (timeout, missing series, stale):
    the pod is then "signal unavailable", whatever the other fields say.
    """

    checked: float | None = None
    trips_low_accept: float | None = None
    trips_high_accept: float | None = None
    unhealthy_by_quarantine: bool | None = None
    running: float | None = None
    queued: float | None = None
    aborted: float | None = None
    token_usage: float | None = None
    kv_transfers: float | None = None  # requests in the PD queues (KV_TRANSFER_QUEUES)
    requests: float | None = None  # finished requests in the window (load, for the autoscaler)
    # finished requests in the last `rate_window` (the window, when shorter than RATE_WINDOW_S)
    recent_requests: float | None = None
    prompt_tokens: float | None = None
    cached_tokens: float | None = None
    generation_tokens: float | None = None
    # TTFT histogram over the window: (bucket upper bound s, cumulative count), by bound
    ttft_buckets: tuple[tuple[float, float], ...] | None = None
    itl_buckets: tuple[tuple[float, float], ...] | None = None  # inter-token latency, the same way
    # prompt reuse over the window (REUSE_BUCKET: tokens by reuse seconds, cumulative; and the
    # REUSE_COUNTERS' increases), None where the engine does not export them
    reuse_buckets: tuple[tuple[float, float], ...] | None = None
    first_seen_tokens: float | None = None
    reuse_requests: float | None = None
    reuse_request_tokens: float | None = None
    reuse_request_token_squares: float | None = None
    returning_prompt_tokens: float | None = None
    kv_failures: float | None = None  # failed KV transfers and bootstraps in the window
    responses: float | None = None  # a router pod's answers in the window
    errors_5xx: float | None = None  # ... of which 5xx
    refused: float | None = None  # ... of which 429 (admission)
    error: str | None = None

    @property
    def trips(self) -> float | None:
        if self.trips_low_accept is None or self.trips_high_accept is None:
            return None
        return self.trips_low_accept + self.trips_high_accept


@dataclass(frozen=True)
class PodView:
    """A pod as the caller observed it, joined with its signals (None = no data at all)."""

    name: str
    role: str
    ready: bool
    serving: bool
    draining_since: float | None = None
    signals: PodSignals | None = None

    @property
    def in_rotation(self) -> bool:
        return self.serving and self.draining_since is None


@dataclass(frozen=True)
class PodTarget:
    """One engine or router pod to measure; `ip`/`port` are used by direct scraping only."""

    name: str
    role: str
    namespace: str = "default"
    ip: str | None = None
    port: int = 30000

    @classmethod
    def of(cls, pod: dict[str, Any]) -> PodTarget:
        """A pod of a fleet (an engine or a router), by its role label: routers export metrics
        on their own port, engines on their serving port."""
        meta = pod["metadata"]
        role = meta.get("labels", {}).get(c.LABEL_ROLE, "")
        port = c.ROUTER_METRICS_PORT if role == c.ROLE_ROUTER else c.ENGINE_PORT
        ip = pod.get("status", {}).get("podIP")
        return cls(meta["name"], role, meta.get("namespace", "default"), ip, port)


@dataclass
class Observation:
    """Signals by pod name; `error` names a source-wide problem (then every pod has one too)."""

    signals: dict[str, PodSignals] = field(default_factory=dict)
    error: str | None = None

    @classmethod
    def outage(cls, targets: Sequence[PodTarget], error: str) -> Observation:
        """The source is down: every pod's signal is unavailable for the same reason."""
        return cls({t.name: PodSignals(error=error) for t in targets}, error)


class MetricsSource(Protocol):
    """A way to measure engine pods over a window; never raises for I/O problems."""

    def observe(self, targets: Sequence[PodTarget], window_seconds: float) -> Observation: ...


def bucket_key(le: str, histogram: str = TTFT_BUCKET) -> str:
    """The counters key of one bucket of a histogram (HISTOGRAMS; its `le` label as exposed)."""
    return f"{histogram}{{le={le}}}"


def _buckets(
    counters: dict[str, float], histogram: str = TTFT_BUCKET
) -> tuple[tuple[float, float], ...] | None:
    """(upper bound, windowed count) of every bucket of `histogram` in `counters`, by bound;
    None if none."""
    prefix = bucket_key("", histogram)[:-1]
    found = [(float(k[len(prefix) : -1]), v) for k, v in counters.items() if k.startswith(prefix)]
    return tuple(sorted(found)) or None


def rate_window(window_seconds: float) -> float:
    """The window `PodSignals.recent_requests` counts over: `RATE_WINDOW_S`, or the metrics
    window when that is shorter."""
    return min(window_seconds, RATE_WINDOW_S)


def signals_from(
    counters: dict[str, float], gauges: dict[str, float], *, has_guard: bool
) -> PodSignals:
    """Assemble PodSignals from windowed increases and latest gauges of one pod.

    `counters` keys: CHECKED, REASON_LOW, REASON_HIGH, ABORTED, LOAD_COUNTERS, RECENT_REQUESTS
    (`rate_window`'s increase of REQUESTS), REUSE_COUNTERS, KV_FAILURES, RESPONSES, ERRORS_5XX,
    REFUSED and `bucket_key(le, histogram)` per TTFT, ITL and reuse bucket (absent = series
    missing); `gauges` keys: GAUGES and KV_TRANSFERS (the sum of the pod's KV_TRANSFER_QUEUES;
    absent outside PD).
    A pod without guard series (a prefill, or an engine without the guard) gets None trip fields,
    which the planner reads as "insufficient data", not as healthy.
    """
    unhealthy = gauges.get(UNHEALTHY)
    return PodSignals(
        checked=counters.get(CHECKED) if has_guard else None,
        trips_low_accept=counters.get(REASON_LOW, 0.0) if has_guard else None,
        trips_high_accept=counters.get(REASON_HIGH, 0.0) if has_guard else None,
        unhealthy_by_quarantine=None if unhealthy is None else unhealthy > 0.5,
        running=gauges.get(RUNNING),
        queued=gauges.get(QUEUED),
        aborted=counters.get(ABORTED),
        token_usage=gauges.get(TOKEN_USAGE),
        kv_transfers=gauges.get(KV_TRANSFERS),
        requests=counters.get(REQUESTS),
        recent_requests=counters.get(RECENT_REQUESTS),
        prompt_tokens=counters.get(PROMPT_TOKENS),
        cached_tokens=counters.get(CACHED_TOKENS),
        generation_tokens=counters.get(GENERATION_TOKENS),
        ttft_buckets=_buckets(counters),
        itl_buckets=_buckets(counters, ITL_BUCKET),
        reuse_buckets=_buckets(counters, REUSE_BUCKET),
        first_seen_tokens=counters.get(FIRST_SEEN_TOKENS),
        reuse_requests=counters.get(REUSE_REQUESTS),
        reuse_request_tokens=counters.get(REUSE_REQUEST_TOKENS),
        reuse_request_token_squares=counters.get(REUSE_REQUEST_TOKEN_SQUARES),
        returning_prompt_tokens=counters.get(RETURNING_PROMPT_TOKENS),
        kv_failures=counters.get(KV_FAILURES),
        responses=counters.get(RESPONSES),
        errors_5xx=counters.get(ERRORS_5XX),
        refused=counters.get(REFUSED),
    )
