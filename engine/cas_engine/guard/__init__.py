"""Speculative-decoding quality gate: abort requests whose accept statistics go bad.

Why: a request whose KV cache was corrupted (a reclaim or load race) makes the draft and the
target model disagree, so the accept length collapses towards 1; a request stuck in degenerate
repetition makes the draft right almost always, so the accept rate approaches 1. Once a request
has generated more than ``min_generated_tokens`` (128) tokens, the gate trips when accept length
< 1.4 (``low_accept_length``) or accept rate > 0.96 (``high_accept_rate``), over the request so
far or over the last ``window`` speculative verify steps.

API (engine-agnostic; used by the SGLang patch and by the sim engine)::

    from prometheus_client import REGISTRY
    from cas_engine.guard import GuardConfig, GuardMetrics, GuardMonitor, http_response

    cfg = GuardConfig.from_env()                      # or guard_config_from_args(ns)
    mon = GuardMonitor(cfg, capacity=256, metrics=GuardMetrics.create(REGISTRY, cfg))
    slot = mon.allocate("req-1")                      # or mon.open(own_slot, "req-1")
    trips = mon.observe(slots, accepted, proposed)    # once per verify step, numpy arrays
    for trip in trips:                                # rare: abort those requests
        status, headers, body = http_response(trip)   # non-streaming: 503, router retries
        final_bytes = sse_error_event(trip)           # streaming: error event + [DONE]
    mon.finish(slot)                                  # request ended: histograms, free slot

Modules: ``config`` (thresholds, CLI flags ``--cas-guard-*``, env ``CAS_GUARD_*``),
``monitor`` (the vectorised per-slot statistics), ``outcome`` (the trip and its retryable
HTTP/SSE forms), ``metrics`` (Prometheus objects on a caller-supplied registry).
"""

from cas_engine.guard.config import (
    GuardConfig,
    add_guard_arguments,
    guard_config_from_args,
)
from cas_engine.guard.metrics import GuardMetrics
from cas_engine.guard.monitor import GuardMonitor, RequestStats
from cas_engine.guard.outcome import (
    ERROR_TYPE,
    REASONS,
    RETRYABLE_HTTP_STATUS,
    GuardTrip,
    error_body,
    http_response,
    sse_error_event,
)

__all__ = [
    "ERROR_TYPE",
    "REASONS",
    "RETRYABLE_HTTP_STATUS",
    "GuardConfig",
    "GuardMetrics",
    "GuardMonitor",
    "GuardTrip",
    "RequestStats",
    "add_guard_arguments",
    "error_body",
    "guard_config_from_args",
    "http_response",
    "sse_error_event",
]
