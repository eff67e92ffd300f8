"""LayerSplit planning: which contiguous block of layers each context-parallel rank owns.

Without LayerSplit every CP rank of a prefill instance holds every layer's KV and DSA indexer
cache. With it (SGLang's `--enable-dsa-cache-layer-split`, DSA models only), rank r holds its
own block of layers of both caches, plus one scratch layer of each that receives another rank's
layer by broadcast before attention. `kv_bytes_per_token_per_rank` reports both layouts so the
status shows what LayerSplit buys.

SGLang 0.5.23, the code this model follows:
- `srt/mem_cache/dsa_cache_layer_split.py:73-77` (`LayerSplitIndexKeyCache._layer_num_pages`):
  a rank allocates no index-key pages for the layers it does not own, and `:118-127` stores
  only owned layers; `:66` and `:332` allocate the one-layer remote scratch of the index cache
  and of the latent KV, `:316-329` the latent KV of owned layers only. The indexer cache is
  split by layer too, not replicated.
- `srt/layers/cp/utils.py:76-91` (`get_glm_dsa_layer_split_effective_num_layers`): the KV cell
  is sized for `ceil(layers / cp) + 1` layers; `srt/model_executor/pool_configurator.py:605-626`
  sizes the indexer cell for the busiest rank's owned layers `+ 1` (DSA models here compute
  top-k in every layer, so that is `ceil(layers / cp) + 1` as well).
- `srt/layers/cp/utils.py:94-106` (`get_layer_shard_range`): contiguous blocks, the first
  `layers % cp` ranks own one layer more (`layer_shards` below).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelKvProfile:
    """Per-layer bytes per token of the latent KV (`kv_bytes`) and of the DSA indexer cache
    (`indexer_bytes`). `dsa`: the model has a DSA (DeepSeek Sparse Attention) indexer, which
    SGLang's LayerSplit and interleave CP require; `mla`: the model uses MLA attention, whose
    non-DSA prefill CP SGLang runs with one CP rank per GPU (see `desired.validate`)."""

    num_layers: int
    kv_bytes: int
    indexer_bytes: int = 0
    dsa: bool = False
    mla: bool = False


# Public architecture figures. GLM-5 (FP8 MLA: 512 latent + 64 rope dims, with DSA indexer of
# 128 fp8 dims + scale) is ~61 KB per token over 78 layers; DeepSeek-V3 MLA in bf16 is
# (512 + 64) * 2 B = 1152 B per layer, ~70 KB over 61 layers.
# DSA: SGLang's `is_deepseek_dsa` (srt/configs/model_config.py:191-211) is an architecture in
# its list *and* an `index_topk` in config.json: GLM-5 (GlmMoeDsaForCausalLM) and DeepSeek-V3.2
# (DeepseekV32ForCausalLM) have one; DeepSeek-V3/R1 and Kimi-K2 (DeepseekV3ForCausalLM without
# `index_topk`) do not. `api.models.DSA_MODELS` / `MLA_MODELS` mirror these keys for CEL.
KNOWN_MODELS: dict[str, ModelKvProfile] = {
    "glm-5": ModelKvProfile(num_layers=78, kv_bytes=656, indexer_bytes=132, dsa=True, mla=True),
    "deepseek-v3.2": ModelKvProfile(
        num_layers=61, kv_bytes=656, indexer_bytes=132, dsa=True, mla=True
    ),
    "deepseek-v3": ModelKvProfile(num_layers=61, kv_bytes=1152, mla=True),
    "deepseek-r1": ModelKvProfile(num_layers=61, kv_bytes=1152, mla=True),
    "kimi-k2": ModelKvProfile(num_layers=61, kv_bytes=1152, mla=True),
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
    return replace(profile, num_layers=num_layers)


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
    """Replicated: every layer's KV + indexer. LayerSplit: the busiest rank's block of layers
    plus one scratch layer, of both the KV and the indexer cache (SGLang 0.5.23, see the module
    docstring). A model without a DSA indexer cannot run LayerSplit: both figures are equal."""
    per_layer = profile.kv_bytes + profile.indexer_bytes
    replicated = profile.num_layers * per_layer
    if not profile.dsa:
        return KvFootprint(replicated=replicated, layer_split=replicated)
    largest = max(s.count for s in layer_shards(profile.num_layers, cp_size))
    split = (largest + 1) * per_layer if cp_size > 1 else replicated
    return KvFootprint(replicated=replicated, layer_split=split)
