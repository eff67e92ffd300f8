"""SGLang-named metrics of the sim worker (plus ``cas_sim_*``), on the worker's own registry.

Ownership: one :class:`SimMetrics` per worker, built on the registry that ``/metrics`` serves;
the kvfence and guard metrics register on the same registry, so one scrape shows ``sglang:*``
and ``cas_*`` together, as in a real engine pod. Names and the ``model_name`` label follow
SGLang's scheduler/tokenizer metrics; gauges are refreshed by the scheduler after each step.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)


class SimMetrics:
    """The metric objects, labelled with the served model name."""

    def __init__(self, registry: CollectorRegistry, model_name: str, mode: str) -> None:
        lbl = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, lbl, registry=registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, lbl, registry=registry)

        self.running = gauge("sglang:num_running_reqs", "Running requests")
        self.queued = gauge("sglang:num_queue_reqs", "Requests waiting to run")
        self.used_tokens = gauge("sglang:num_used_tokens", "KV tokens in use")
        self.token_usage = gauge("sglang:token_usage", "KV usage fraction")
        self.gen_throughput = gauge("sglang:gen_throughput", "Generation throughput (tokens/s)")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "Prefix cache hit rate")
        self.accept_length = gauge("sglang:spec_accept_length", "Speculative accept length")
        self.accept_rate = gauge("sglang:spec_accept_rate", "Speculative accept rate")
        self.prefill_bootstrap = gauge(  # SGLang 0.5.23 srt/observability/metrics_collector.py:583
            "sglang:num_prefill_bootstrap_queue_reqs",
            "PD prefill: requests waiting for their decode's bootstrap",
        )
        self.prefill_inflight = gauge(
            "sglang:num_prefill_inflight_queue_reqs",
            "PD prefill: requests whose KV transfer is in flight",
        )
        self.decode_prealloc = gauge(
            "sglang:num_decode_prealloc_queue_reqs", "PD decode: requests waiting for a KV slot"
        )
        self.decode_transfer = gauge(
            "sglang:num_decode_transfer_queue_reqs",
            "PD decode: requests waiting for their KV transfer",
        )
        self.prompt_tokens = counter("sglang:prompt_tokens", "Prompt tokens processed")
        self.cached_tokens = counter("sglang:cached_tokens", "Prompt tokens served from cache")
        self.generation_tokens = counter("sglang:generation_tokens", "Generated tokens")
        self.requests = counter("sglang:num_requests", "Requests finished (any outcome)")
        self.aborted = counter("sglang:num_aborted_requests", "Requests aborted")
        # SGLang 0.5.23 srt/observability/metrics_collector.py:667-673 (PD decode side here)
        self.bootstrap_failed = counter(
            "sglang:num_bootstrap_failed_reqs", "PD: requests whose KV bootstrap failed"
        )
        self.transfer_failed = counter(
            "sglang:num_transfer_failed_reqs", "PD: requests whose KV transfer failed"
        )
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Time to first token",
            lbl,
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds",
            "Inter-token latency",
            lbl,
            buckets=_ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "End-to-end latency",
            lbl,
            buckets=_E2E_BUCKETS,
            registry=registry,
        )
        self.kv_corrupted = counter(
            "cas_sim_kv_corrupted_requests", "Requests whose KV slot did not hold their own content"
        )
        self.info = Info("cas_sim", "Simulated worker (no model)", registry=registry)
        self.info.info({"simulated": "true", "disaggregation_mode": mode, "model_name": model_name})
        self.model = model_name
        for metric in (
            self.aborted,
            self.kv_corrupted,
            self.requests,
            self.prompt_tokens,
            self.cached_tokens,
            self.generation_tokens,
            self.running,
            self.queued,
            self.used_tokens,
            self.token_usage,
            self.gen_throughput,
            self.cache_hit_rate,
            self.accept_length,
            self.accept_rate,
        ):
            metric.labels(model_name=model_name)  # export zeros from the start
