"""Instance profiles as packaged data, and builders from a profile file to planner inputs.

Data flow: a JSON file in this folder (one model on one GPU type, every number with its source
under ``sources``) -> :func:`load_spec` -> :class:`ProfileSpec` -> :func:`prefill_profile` /
:func:`decode_profile` -> :class:`cas_operator.autoscale.model.InstanceProfile` for one instance
shape. The only I/O is reading the packaged JSON.

Shapes follow the CodingAgentServing CRD and SGLang: a prefill instance is ``tp`` GPUs and its
context parallelism (``--attn-cp-size``) divides ``tp`` - CP adds no GPUs, it changes how the
same GPUs split attention and, with LayerSplit, how much KV the instance caches. A decode
instance is ``dp`` GPUs with DP attention. So one planner instance is one resource instance
whenever the shapes match, and ``recommend.py`` maps counts 1:1.

LayerSplit: without it every context-parallel rank holds every layer's KV, so a CP group caches
no more tokens than one rank. With it each rank holds a contiguous block of ``ceil(L / cp)`` of
the ``L`` layers of both the latent KV and the DSA indexer cache, plus one scratch layer of each
for the layer being broadcast (SGLang 0.5.23: srt/layers/cp/utils.py:76-91 and
srt/model_executor/pool_configurator.py:605-626; see ``cas_operator.desired.layersplit``), so
per-rank bytes per token are ``B * (ceil(L / cp) + 1) / L`` and capacity grows by
``L / (ceil(L / cp) + 1)``.

Per-rank links: MLA KV is replicated over the TP ranks, so each rank loads its own copy of a
host-tier prefix over its own PCIe link (its layer block with LayerSplit,
``layer_split_load_share``), and a decode rank pulls a request's KV from ONE prefill TP rank -
from every CP rank with LayerSplit, from CP rank 0 otherwise (SGLang 0.5.23:
srt/disaggregation/common/conn.py:1482-1513). The receiving side is one decode DP rank. So one
decode rank's TP index is 0 under DP attention, so every transfer of a prefill instance leaves
from the same rank (``cp`` ranks with LayerSplit): the prefill side's link is one GPU's NIC
share (``nic_bytes_per_s_per_node / gpus_per_node``) times that, while a decode instance
receives on all its DP ranks at once, one NIC share per request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from importlib import resources

from cas_operator.autoscale.model import InstanceProfile

__all__ = [
    "ProfileSpec",
    "available",
    "decode_profile",
    "layer_split_capacity_factor",
    "layer_split_load_share",
    "load_spec",
    "prefill_profile",
]


@dataclass(frozen=True)
class ProfileSpec:
    """One model on one GPU type; field meanings and sources are in the JSON files."""

    name: str
    model: str
    gpu: str
    kv_bytes_per_token: float
    num_layers: int
    hbm_bytes_per_gpu: float
    mem_fraction_static: float
    weight_bytes_per_gpu: float
    host_cache_bytes_per_node: float
    gpus_per_node: int
    prefill_tp: int
    prefill_overhead_s: float
    prefill_tokens_per_s_per_node: float
    prefill_attn_s_per_token_pair: float
    prefill_cp_efficiency: float
    host_load_bytes_per_s_per_node: float
    decode_dp: int
    decode_step_base_s: float
    decode_step_per_seq_s: float
    decode_step_per_ctx_token_s: float
    decode_accept_length: float
    decode_max_running_per_gpu: int
    nic_bytes_per_s_per_node: float
    pod_start_s: float
    drain_s: float

    @property
    def kv_bytes_per_gpu(self) -> float:
        """HBM left for KV after the static memory fraction and the weight shard."""
        return max(
            0.0, self.hbm_bytes_per_gpu * self.mem_fraction_static - self.weight_bytes_per_gpu
        )


def available() -> list[str]:
    """Names of the packaged profiles."""
    root = resources.files(__name__)
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def load_spec(name: str) -> ProfileSpec:
    """Read one packaged profile; unknown keys other than ``sources`` are an error."""
    text = resources.files(__name__).joinpath(f"{name}.json").read_text(encoding="utf-8")
    raw = json.loads(text)
    raw.pop("sources", None)
    names = {f.name for f in fields(ProfileSpec)}
    unknown = set(raw) - names
    if unknown:
        raise ValueError(f"profile {name}: unknown keys {sorted(unknown)}")
    return ProfileSpec(**{k: raw[k] for k in names})


def layer_split_capacity_factor(cp: int, num_layers: int) -> float:
    """How many more tokens a CP group caches with LayerSplit than one rank (1.0 at cp=1): each
    rank holds ``ceil(num_layers / cp)`` layers plus one scratch layer of KV and indexer."""
    if cp <= 1:
        return 1.0
    return num_layers / (-(-num_layers // cp) + 1)


def layer_split_load_share(cp: int, num_layers: int) -> float:
    """Share of a token's KV bytes the busiest rank loads from the host tier with LayerSplit:
    its ``ceil(num_layers / cp)`` owned layers (the scratch layer is filled by broadcast)."""
    if cp <= 1:
        return 1.0
    return -(-num_layers // cp) / num_layers


def prefill_profile(
    spec: ProfileSpec, *, tp: int | None = None, cp: int = 1, layer_split: bool = True
) -> InstanceProfile:
    """A prefill instance of ``tp`` GPUs (default ``spec.prefill_tp``) with context parallelism
    ``cp`` inside TP (``cp`` divides ``tp``; ValueError otherwise).

    Throughput scales with the instance's nodes (``tp / gpus_per_node``), times the CP
    efficiency when ``cp > 1``; MLA KV is replicated across TP ranks, so the cache holds one
    rank's worth of tokens, times the LayerSplit factor when it is on.
    """
    gpus = spec.prefill_tp if tp is None else tp
    if cp < 1 or gpus < 1 or gpus % cp:
        raise ValueError(f"context parallel size {cp} must divide tensor parallel size {gpus}")
    nodes = gpus / spec.gpus_per_node
    per_rank_tokens = spec.kv_bytes_per_gpu / spec.kv_bytes_per_token
    factor = layer_split_capacity_factor(cp, spec.num_layers) if layer_split else 1.0
    # Each rank loads its own copy of a host-tier prefix over its own PCIe link: all layers
    # when replicated (MLA KV is replicated over TP), its block of layers with LayerSplit.
    share = layer_split_load_share(cp, spec.num_layers) if layer_split else 1.0
    rank_load_bytes_per_s = spec.host_load_bytes_per_s_per_node / spec.gpus_per_node
    eff = spec.prefill_cp_efficiency if cp > 1 else 1.0
    speedup = nodes * eff
    senders = cp if layer_split else 1
    return InstanceProfile(
        name=f"{spec.name}/prefill-tp{gpus}-cp{cp}{'-ls' if layer_split else ''}",
        gpus=gpus,
        cp=cp,
        layer_split=layer_split,
        kv_bytes_per_token=spec.kv_bytes_per_token,
        kv_capacity_tokens=per_rank_tokens * factor,
        host_cache_tokens=spec.host_cache_bytes_per_node * nodes / spec.kv_bytes_per_token,
        prefill_overhead_s=spec.prefill_overhead_s,
        prefill_s_per_token=1.0 / (spec.prefill_tokens_per_s_per_node * speedup),
        prefill_attn_s_per_token_pair=spec.prefill_attn_s_per_token_pair / speedup,
        host_load_s_per_token=spec.kv_bytes_per_token * share / rank_load_bytes_per_s,
        decode_step_base_s=spec.decode_step_base_s,
        decode_step_per_seq_s=spec.decode_step_per_seq_s,
        decode_step_per_ctx_token_s=spec.decode_step_per_ctx_token_s,
        accept_length=spec.decode_accept_length,
        max_running=spec.decode_max_running_per_gpu * gpus,
        nic_bytes_per_s=_rank_nic(spec) * senders,  # every transfer leaves from these ranks
        flow_bytes_per_s=_rank_nic(spec) * senders,
        pod_start_s=spec.pod_start_s,
        drain_s=spec.drain_s,
    )


def _rank_nic(spec: ProfileSpec) -> float:
    return spec.nic_bytes_per_s_per_node / spec.gpus_per_node


def decode_profile(spec: ProfileSpec, *, dp: int | None = None) -> InstanceProfile:
    """A decode instance of ``dp`` GPUs with DP attention (each rank holds its own requests)."""
    gpus = dp or spec.decode_dp
    nodes = gpus / spec.gpus_per_node
    return InstanceProfile(
        name=f"{spec.name}/decode-dp{gpus}",
        gpus=gpus,
        cp=1,
        layer_split=False,
        kv_bytes_per_token=spec.kv_bytes_per_token,
        kv_capacity_tokens=gpus * spec.kv_bytes_per_gpu / spec.kv_bytes_per_token,
        host_cache_tokens=0.0,
        prefill_overhead_s=spec.prefill_overhead_s,
        prefill_s_per_token=1.0 / (spec.prefill_tokens_per_s_per_node * nodes),
        prefill_attn_s_per_token_pair=spec.prefill_attn_s_per_token_pair / nodes,
        host_load_s_per_token=0.0,
        decode_step_base_s=spec.decode_step_base_s,
        decode_step_per_seq_s=spec.decode_step_per_seq_s,
        decode_step_per_ctx_token_s=spec.decode_step_per_ctx_token_s * spec.decode_dp / gpus,
        accept_length=spec.decode_accept_length,
        max_running=spec.decode_max_running_per_gpu * gpus,
        nic_bytes_per_s=spec.nic_bytes_per_s_per_node * nodes,
        flow_bytes_per_s=_rank_nic(spec),  # one DP rank receives each request
        pod_start_s=spec.pod_start_s,
        drain_s=spec.drain_s,
    )
