"""Run an engine pod's command line through SGLang 0.5.23's own parser and resolution hooks.

Used by ``test_engine_contract_sglang.py`` (marker ``sglang_real``). What SGLang gets is what
the pod's launcher gives it: the container's args through ``cas_engine.launch.plan_launch``
(which strips our ``--cas-*`` flags), the container's env, and Kubernetes' ``$(VAR)``
expansion of the LWS variables. Then ``sglang.srt.server_args.prepare_server_args`` (SGLang's
argparse parser) and ``ServerArgs.resolve_once`` (the whole resolution pipeline,
``srt/arg_groups/pipeline.py``: every hook that validates parallelism, CP, LayerSplit, HiCache,
speculative decoding and PD disaggregation).

Stubs, each only for what needs a GPU or a model download:

- ``--model-path`` points at a temporary directory with a ``config.json`` carrying the
  architecture fields SGLang keys its rules on (``architectures``, ``model_type``,
  ``index_topk`` for DSA, MLA dimensions); the value the operator emitted is replaced, nothing
  else. Draft model paths likewise.
- the platform facts (``runtime_context.override_platform``, SGLang's own test hook): an H200
  (CUDA, SM90), the GPU the samples name;
- ``serving_hook.get_device`` (called to default ``--device``) answers ``cuda``, and
  ``torch.cuda.get_device_capability`` answers (9, 0): both would initialise CUDA here.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from cas_engine.launch import plan_launch
from cas_engine.sglang.keys import argv_with_key

LAUNCHER = ["python3", "-m", "cas_engine.launch_server"]
# What Kubernetes substitutes for the LWS variables in a pod of group 0 (leader).
LWS_EXPANSION = {"$(LWS_LEADER_ADDRESS)": "10.0.0.1", "$(LWS_WORKER_INDEX)": "0"}
# What the kubelet reads from the fleet's keys Secret (by secretKeyRef) for these tests.
# A key that starts with "-", as a user's Secret (or a URL-safe random key, 1 in 64) may: the
# parser must still read it as the flag's value (regression: "--admin-api-key: expected one
# argument" at pod start).
SECRET_VALUES = {"engine-admin-key": "-admin-key-from-the-secret"}

_MLA = {
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
    "num_nextn_predict_layers": 1,
    "torch_dtype": "bfloat16",
    "rope_theta": 10000,
}
_DSA_INDEXER = {"index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64}

# The config.json fields SGLang reads for each model family of `desired.layersplit`.
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "glm-5": {
        **_MLA,
        **_DSA_INDEXER,
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "num_hidden_layers": 78,
        "hidden_size": 6144,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "q_lora_rank": 2048,
        "qk_nope_head_dim": 192,
        "v_head_dim": 256,
        "vocab_size": 154880,
        "max_position_embeddings": 202752,
        "intermediate_size": 12288,
        "index_n_heads": 32,
        "rope_theta": 1000000,
    },
    "deepseek-v3.2": {
        **_MLA,
        **_DSA_INDEXER,
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "num_hidden_layers": 61,
    },
    "deepseek-v3": {
        **_MLA,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
    },
    "kimi-k2": {
        **_MLA,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "num_hidden_layers": 61,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "n_routed_experts": 384,
        "num_nextn_predict_layers": 0,
    },
    # A model outside the table (the minimal sample): GQA, no MLA, no DSA.
    "qwen3-coder": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_hidden_layers": 48,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 262144,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "torch_dtype": "bfloat16",
        "rope_theta": 10000000,
        "rms_norm_eps": 1e-6,
    },
}
# Model names as users write them, by fixture.
MODEL_NAMES = {
    "glm-5": "zai-org/GLM-5-FP8",
    "deepseek-v3.2": "deepseek-ai/DeepSeek-V3.2",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "kimi-k2": "moonshotai/Kimi-K2-Instruct",
    "qwen3-coder": "Qwen/Qwen3-Coder-30B-A3B-Instruct",
}

H200 = {
    "is_cuda": True,
    "is_hip": False,
    "is_npu": False,
    "is_xpu": False,
    "is_musa": False,
    "is_mps": False,
    "is_sm90": True,
    "is_sm100": False,
    "is_sm100_or_sm110": False,
    "is_sm110": False,
    "is_sm120": False,
    "is_blackwell": False,
    "is_hopper_with_cuda_12_3": True,
    "has_amx": False,
    "has_flashinfer": True,
    "device_sm": 90,
    "device_capability": (9, 0),
}


def fixture_for(model_name: str) -> str:
    """The MODEL_CONFIGS key of a model name (the table's prefix rule; others: qwen3-coder)."""
    key = model_name.rsplit("/", 1)[-1].lower()
    for known in sorted(MODEL_CONFIGS, key=len, reverse=True):
        if key.startswith(known):
            return known
    return "qwen3-coder"


def write_model_dirs(root: Path) -> dict[str, Path]:
    dirs = {}
    for name, config in MODEL_CONFIGS.items():
        path = root / name
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(config))
        dirs[name] = path
    return dirs


@dataclass(frozen=True)
class PodCommand:
    """One engine container: which workload, its args and env as rendered."""

    workload: str
    role: str
    args: list[str]
    env: dict[str, str]


def kubelet_env(env: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """A container's env as the kubelet resolves it (Secret keys from SECRET_VALUES)."""
    out = {}
    for var in env:
        ref = (var.get("valueFrom") or {}).get("secretKeyRef")
        if "value" in var:
            out[var["name"]] = str(var["value"])
        elif ref is not None:
            out[var["name"]] = SECRET_VALUES[ref["key"]]
    return out


def engine_commands(manifests: Sequence[Mapping[str, Any]]) -> list[PodCommand]:
    """Every engine container (Deployment and LWS leader/worker templates) of a render."""
    found: list[PodCommand] = []

    def walk(node: Any, workload: str) -> None:
        if isinstance(node, dict):
            if node.get("command") == LAUNCHER:
                env = kubelet_env(node.get("env", []))
                args = [str(a) for a in node["args"]]
                role = args[args.index("--disaggregation-mode") + 1]
                found.append(PodCommand(workload, role, args, env))
            for value in node.values():
                walk(value, workload)
        elif isinstance(node, list):
            for value in node:
                walk(value, workload)

    for manifest in manifests:
        if manifest.get("kind") in ("Deployment", "LeaderWorkerSet"):
            walk(manifest, manifest["metadata"]["name"])
    return found


def sglang_argv(
    args: Sequence[str],
    model_dir: Path,
    draft_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """What SGLang's parser receives from the launcher (the admin key from the environment
    handed over as `cas_engine.sglang.keys` does), with the model path(s) made local and
    $(VAR) expanded as the kubelet does (from `env`, and LWS's variables)."""
    plan = plan_launch(list(args), env=dict(env or {}))
    argv = (
        plan.sglang_argv
        if plan.admin_key is None
        else argv_with_key(plan.sglang_argv, plan.admin_key)
    )
    expansion = {**LWS_EXPANSION, **{f"$({k})": v for k, v in (env or {}).items()}}
    out = []
    for arg in argv:
        for var, value in expansion.items():
            arg = arg.replace(var, value)
        out.append(arg)
    for flag, local in (("--model-path", model_dir), ("--speculative-draft-model-path", draft_dir)):
        if flag in out and local is not None:
            out[out.index(flag) + 1] = str(local)
    return out


@contextmanager
def _gpu_stubs(env: Mapping[str, str]) -> Iterator[None]:
    import sglang.srt.arg_groups.serving_hook as serving_hook
    from sglang.srt.runtime_context import override_platform

    with (
        override_platform(**H200),
        mock.patch.object(serving_hook, "get_device", lambda *a, **k: "cuda"),
        mock.patch("torch.cuda.get_device_capability", lambda *a, **k: (9, 0)),
        mock.patch.dict(os.environ, dict(env)),
    ):
        yield


def resolve_with_sglang(argv: Sequence[str], env: Mapping[str, str] | None = None) -> Any:
    """SGLang's parse and resolution of ``argv``; returns the resolved view (raises what SGLang
    raises: SystemExit from argparse, ValueError/AssertionError from the hooks)."""
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.server_args import prepare_server_args

    with _gpu_stubs(env or {}):
        server_args = prepare_server_args(list(argv))
        logging.disable(logging.WARNING)  # prepare_server_args reconfigured logging
        try:
            server_args.resolve_once()
        finally:
            logging.disable(logging.NOTSET)
        return resolved_view(server_args)


def sglang_parser() -> Any:
    """SGLang's own argparse parser, as ``prepare_server_args`` builds it."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    return parser
