"""LayerSplit planning: which contiguous block of layers each context-parallel rank owns.

Without LayerSplit every CP rank of a prefill instance holds every layer's KV. With it, rank r
holds the KV of its own block of layers and receives the others by broadcast before attention;
only the sparse-attention indexer cache stays replicated. `kv_bytes_per_token_per_rank` reports
both layouts so the status shows what LayerSplit buys.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelKvProfile:
    """Per-layer KV bytes per token; `indexer_bytes` is the replicated DSA indexer share."""

    num_layers: int
    kv_bytes: int
    indexer_bytes: int = 0


# Public architecture figures. GLM-5 (FP8 MLA: 512 latent + 64 rope dims, with DSA indexer of
# 128 fp8 dims + scale) is ~61 KB per token over 78 layers; DeepSeek-V3 MLA in bf16 is
# (512 + 64) * 2 B = 1152 B per layer, ~70 KB over 61 layers.
KNOWN_MODELS: dict[str, ModelKvProfile] = {
    "glm-5": ModelKvProfile(num_layers=78, kv_bytes=656, indexer_bytes=132),
    "deepseek-v3.2": ModelKvProfile(num_layers=61, kv_bytes=656, indexer_bytes=132),
    "deepseek-v3": ModelKvProfile(num_layers=61, kv_bytes=1152),
    "deepseek-r1": ModelKvProfile(num_layers=61, kv_bytes=1152),
    "kimi-k2": ModelKvProfile(num_layers=61, kv_bytes=1152),
}
GENERIC_KV_BYTES_PER_LAYER = 1152


def lookup_model(name: str, num_layers: int | None) -> ModelKvProfile | None:
    """Match a model name (e.g. `zai-org/GLM-5-FP8`) against the table; `num_layers` wins."""
    key = name.rsplit("/", 1)[-1].lower()
    profile = None
    for known in sorted(KNOWN_MODELS, key=len, reverse=True):
        if key.startswith(known):
            profile = KNOWN_MODELS[known]
            break
    if num_layers is None:
        return profile
    if profile is None:
        return ModelKvProfile(num_layers=num_layers, kv_bytes=GENERIC_KV_BYTES_PER_LAYER)
    return ModelKvProfile(num_layers, profile.kv_bytes, profile.indexer_bytes)


@dataclass(frozen=True)
class LayerShard:
    rank: int
    first_layer: int
    last_layer: int  # inclusive

    @property
    def count(self) -> int:
        return self.last_layer - self.first_layer + 1


def layer_shards(num_layers: int, cp_size: int) -> list[LayerShard]:
    """Contiguous, balanced blocks: the first `num_layers % cp` ranks take one layer more."""
    if cp_size < 1 or num_layers < cp_size:
        raise ValueError(f"cannot split {num_layers} layers over {cp_size} ranks")
    base, extra = divmod(num_layers, cp_size)
    shards, start = [], 0
    for rank in range(cp_size):
        count = base + (1 if rank < extra else 0)
        shards.append(LayerShard(rank, start, start + count - 1))
        start += count
    return shards


@dataclass(frozen=True)
class KvFootprint:
    """KV bytes per token held by the busiest CP rank, replicated vs LayerSplit."""

    replicated: int
    layer_split: int

    @property
    def saving(self) -> float:
        return 1.0 - self.layer_split / self.replicated if self.replicated else 0.0


def kv_bytes_per_token_per_rank(profile: ModelKvProfile, cp_size: int) -> KvFootprint:
    """Replicated: all layers' KV + indexer. LayerSplit: own block's KV + all indexer layers."""
    per_layer = profile.kv_bytes + profile.indexer_bytes
    replicated = profile.num_layers * per_layer
    largest = max(s.count for s in layer_shards(profile.num_layers, cp_size))
    split = largest * profile.kv_bytes + profile.num_layers * profile.indexer_bytes
    return KvFootprint(replicated=replicated, layer_split=split)
