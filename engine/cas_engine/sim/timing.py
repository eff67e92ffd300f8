"""Timing model of one SGLang instance (8 GPUs, tp 8) serving a GLM-5-class MoE model.

Pure functions of :class:`TimingParams`; the worker calls them and sleeps the result (divided by
``--sim-speedup``). All numbers are APPROXIMATE, chosen to land within about 2x of published
figures, not measured by us:

- DeepSeek, "DeepSeek-V3/R1 Inference System Overview" (open-infra-index, Feb 2025), H800
  nodes of 8 GPUs: about 73.7k input tokens/s per node in prefill (cache hits included) and
  about 14.8k output tokens/s per node in decode, 20-22 tokens/s per user.
- LMSYS / SGLang, "Deploying DeepSeek with PD Disaggregation and Large-scale Expert Parallelism
  on 96 H100 GPUs" (May 2025): about 52.3k input and 22.3k output tokens/s per node for
  2,000-token inputs.
- H200 vs H100: 4.8 vs 3.35 TB/s HBM, 141 vs 80 GB: decode (memory bound) about 1.4x faster,
  and room for far more KV. GLM-5 (744B total / ~40B active, DSA sparse attention, MTP) is
  DeepSeek-V3-class in cost per token; its production report describes ~70K-token inputs at
  ~90% prefix-cache hit rate, which is what the load generator replays.

Derived defaults:

- prefill: 50k uncached tokens/s per instance at short context; the cost per token grows
  linearly with the context (``prefill_attn_ctx_tokens``: at 64K tokens of context a token costs
  twice as much); cached tokens cost nothing but a lookup; 15 ms fixed overhead per batch.
- decode: step time = 22 ms + 0.09 ms x running requests + 1 ms per million KV tokens read
  (MLA/DSA latent KV of ~35 KB/token at 8 x 4.8 TB/s). With MTP (3 draft tokens, accept length
  ~2.7) that is ~120 tokens/s per user at batch 1 and ~15k tokens/s per instance at batch 256.
- KV capacity: 2M tokens per instance (8 x 141 GB minus ~750 GB of FP8 weights, at ~70 KB per
  token with activations headroom).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TimingParams:
    """Cost-model constants (see module docstring for sources)."""

    prefill_tokens_per_s: float = 50_000.0
    prefill_attn_ctx_tokens: float = 65_536.0
    prefill_overhead_ms: float = 15.0
    decode_step_base_ms: float = 22.0
    decode_per_seq_ms: float = 0.09
    decode_per_mtok_ms: float = 1.0
    kv_capacity_tokens: int = 2_000_000
    block_size: int = 64


def prefill_seconds(p: TimingParams, new_tokens: int, total_tokens: int) -> float:
    """Modelled time to prefill ``new_tokens`` uncached tokens of a ``total_tokens`` prompt.

    The attention part of each new token reads the whole context, so the per-token cost grows
    with the average context position of the new tokens.
    """
    if new_tokens <= 0:
        return p.prefill_overhead_ms / 1000.0
    avg_ctx = total_tokens - new_tokens / 2.0
    per_token = (1.0 + avg_ctx / p.prefill_attn_ctx_tokens) / p.prefill_tokens_per_s
    return p.prefill_overhead_ms / 1000.0 + new_tokens * per_token


def decode_step_seconds(p: TimingParams, batch: int, kv_tokens: int) -> float:
    """Modelled time of one decode (verify) step for ``batch`` requests holding ``kv_tokens``."""
    ms = (
        p.decode_step_base_ms
        + p.decode_per_seq_ms * batch
        + p.decode_per_mtok_ms * (kv_tokens / 1e6)
    )
    return ms / 1000.0
