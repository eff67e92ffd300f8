"""Prefix reuse times: what the operator's hit-rate model reads from every prefill engine.

Why: how many prompt tokens a prefill pool's cache hits depends on how long each prompt block
stays away before it comes back (tool pauses, human pauses, finished sessions), a heavy-tailed
distribution no engine metric showed. The engine measures it on its own traffic; the operator
sums the pools' histograms and sizes the cache with them (cas_operator.autoscale.reuse).

How: each request's prompt is cut into `block_size`-token blocks keyed by a hash of the whole
prefix up to them (two prompts share a key exactly as long as their tokens are equal). Only
blocks whose key falls in 1 in `sample_rate` of the hash space are tracked (spatial sampling,
as SHARDS: a tracked block is tracked every time, and each stands for `sample_rate` blocks).
A bounded "ghost" map remembers when each tracked block was last referenced, whether or not
the cache still holds it, so evicted blocks still yield reuse times.

API (engine-agnostic; used by the SGLang adapter and by the sim engine)::

    from prometheus_client import REGISTRY
    from cas_engine.prefixreuse import ReuseMetrics, ReuseTracker

    tracker = ReuseTracker(metrics=ReuseMetrics(REGISTRY))
    tracker.observe(prompt_token_ids)   # once per request, when it arrives

Metrics (all prompt tokens, counted on the prefill side):
- `cas_prefix_reuse_seconds` (histogram, token-weighted: a bucket counts tokens, not
  requests): tokens of tracked blocks by the time since their block was last referenced;
- `cas_prefix_first_seen_tokens_total`: tokens of tracked blocks never referenced before (or
  forgotten by the ghost map, which covers `ghost_entries * sample_rate` blocks);
- `cas_prefix_requests_total`, `cas_prefix_request_tokens_total` and
  `cas_prefix_request_token_squares_total`: requests, and the sum of their full-block tokens
  and of its squares (the size a token's request has, for the model's fluctuation);
- `cas_prefix_returning_prompt_tokens_total`: prompt tokens of requests that reuse a tracked
  block (the returning turns of sessions).

Modules: ``tracker`` (block keys, the ghost map, one request's outcome), ``metrics`` (the
Prometheus objects on a caller-supplied registry).
"""

from cas_engine.prefixreuse.metrics import REUSE_BUCKETS_S, ReuseMetrics, WeightedHistogram
from cas_engine.prefixreuse.tracker import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GHOST_ENTRIES,
    DEFAULT_SAMPLE_RATE,
    RequestReuse,
    ReuseTracker,
    block_keys,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_GHOST_ENTRIES",
    "DEFAULT_SAMPLE_RATE",
    "REUSE_BUCKETS_S",
    "RequestReuse",
    "ReuseMetrics",
    "ReuseTracker",
    "WeightedHistogram",
    "block_keys",
]
