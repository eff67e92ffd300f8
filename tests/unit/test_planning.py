"""Pure planning: instance shapes, LayerSplit shards and KV footprint, replicas, rules (the
revision: test_revision.py)."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest

from cas_operator.api.models import CodingAgentServingSpec, parse_spec
from cas_operator.desired.build import build_plan
from cas_operator.desired.layersplit import (
    KNOWN_MODELS,
    kv_bytes_per_token_per_rank,
    layer_shards,
    lookup_model,
)
from cas_operator.desired.plan import InvalidSpec
from cas_operator.desired.replicas import fixed_replicas
from cas_operator.desired.shapes import instance_shape
from cas_operator.desired.validate import validate
from tests.paths import load_sample


def spec_of(**overrides: Any) -> CodingAgentServingSpec:
    raw: dict[str, Any] = {"model": {"name": "zai-org/GLM-5-FP8"}}
    raw.update(overrides)
    return parse_spec(raw)


@pytest.mark.parametrize(
    ("tp", "per_node", "nodes", "gpus_per_pod"),
    [(1, 8, 1, 1), (4, 8, 1, 4), (8, 8, 1, 8), (16, 8, 2, 8), (32, 8, 4, 8), (8, 4, 2, 4)],
)
def test_instance_shape(tp: int, per_node: int, nodes: int, gpus_per_pod: int) -> None:
    """Regression: a TP16 instance on 8-GPU nodes must span 2 pods of 8, not one pod of 16."""
    shape = instance_shape(tensor_parallel=tp, gpus_per_node=per_node)
    assert (shape.nodes, shape.gpus_per_pod, shape.gpus) == (nodes, gpus_per_pod, tp)
    assert shape.multi_node == (nodes > 1)


def test_instance_shape_rejects_partial_nodes() -> None:
    """Regression: TP12 on 8-GPU nodes cannot be placed on whole nodes."""
    with pytest.raises(ValueError, match="not a multiple"):
        instance_shape(tensor_parallel=12, gpus_per_node=8)


@pytest.mark.parametrize(
    ("layers", "cp", "counts"),
    [
        (78, 4, [20, 20, 19, 19]),
        (61, 8, [8, 8, 8, 8, 8, 7, 7, 7]),
        (8, 8, [1] * 8),
        (10, 3, [4, 3, 3]),
    ],
)
def test_layer_shards_are_contiguous_and_balanced(layers: int, cp: int, counts: list[int]) -> None:
    """Regression: shards must cover every layer once, in order, differing by at most one."""
    shards = layer_shards(layers, cp)
    assert [s.count for s in shards] == counts
    assert shards[0].first_layer == 0 and shards[-1].last_layer == layers - 1
    for before, after in itertools.pairwise(shards):
        assert after.first_layer == before.last_layer + 1


def test_layer_shards_reject_more_ranks_than_layers() -> None:
    with pytest.raises(ValueError):
        layer_shards(4, 8)


def test_kv_footprint_glm5_cp4() -> None:
    """LayerSplit keeps 20 of 78 layers of KV *and* indexer per rank, plus one scratch layer of
    each (SGLang 0.5.23 splits the indexer cache by layer too; hand-computed)."""
    footprint = kv_bytes_per_token_per_rank(KNOWN_MODELS["glm-5"], 4)
    assert footprint.replicated == 78 * (656 + 132)  # 61,464 B: the ~61 KB/token published
    assert footprint.layer_split == (20 + 1) * (656 + 132)  # 16,548 B
    assert 0.73 < footprint.saving < 0.74


def test_kv_footprint_matches_sglang_cell_size_formula() -> None:
    """Guards the model against SGLang's own sizing: (ceil(L / cp) + 1) layers of KV
    (cp/utils.py:76-91) and of indexer (pool_configurator.py:605-626) per rank."""
    for cp in (2, 3, 4, 8):
        footprint = kv_bytes_per_token_per_rank(KNOWN_MODELS["deepseek-v3.2"], cp)
        assert footprint.layer_split == (-(-61 // cp) + 1) * (656 + 132)


def test_kv_footprint_without_dsa_has_no_layer_split() -> None:
    """Regression: SGLang refuses LayerSplit without a DSA indexer, so it buys nothing."""
    footprint = kv_bytes_per_token_per_rank(KNOWN_MODELS["deepseek-v3"], 8)
    assert footprint.layer_split == footprint.replicated == 61 * 1152


def test_lookup_model_prefers_explicit_layers() -> None:
    """Regression: `model.numLayers` must override the table, and unknown models need it."""
    assert lookup_model("zai-org/GLM-5-FP8", None) == KNOWN_MODELS["glm-5"]
    assert lookup_model("zai-org/GLM-5-FP8", 80).num_layers == 80  # type: ignore[union-attr]
    assert lookup_model("acme/unknown-coder", None) is None
    assert lookup_model("acme/unknown-coder", 40).num_layers == 40  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("prefill", "decode", "ratio", "expected"),
    [
        ({}, {}, {}, (1, 1)),
        ({}, {}, {"prefill": 3, "decode": 2}, (3, 2)),
        ({"replicas": 4}, {"replicas": 1}, {"prefill": 3, "decode": 2}, (4, 1)),
        ({}, {"replicas": 4}, {"prefill": 3, "decode": 2}, (6, 4)),
        ({"replicas": 3}, {}, {"prefill": 3, "decode": 1}, (3, 1)),
        ({"replicas": 0}, {"replicas": 0}, {}, (0, 0)),
    ],
)
def test_fixed_replicas(
    prefill: dict[str, Any],
    decode: dict[str, Any],
    ratio: dict[str, Any],
    expected: tuple[int, int],
) -> None:
    """Regression: explicit pool replicas win; a missing side follows the ratio."""
    plan = fixed_replicas(spec_of(prefill=prefill, decode=decode, ratio=ratio))
    assert (plan.prefill, plan.decode) == expected


RULES = [
    ({"prefill": {"tensorParallel": 12}}, "prefill.tensorParallel"),
    ({"decode": {"tensorParallel": 12}}, "decode.tensorParallel"),
    ({"prefill": {"tensorParallel": 8, "contextParallel": 3}}, "prefill.contextParallel"),
    ({"prefill": {"layerSplit": True}}, "prefill.layerSplit"),
    ({"ratio": {"min": 2.0, "max": 1.0}}, "ratio.min"),
    ({"ratio": {"mode": "Auto"}}, "ratio.gpuBudget"),  # unbounded Auto: a runaway fleet
    ({"engine": {"args": ["--tp-size", "4"]}}, "engine.args[0]"),  # the pools' TP, overridden
    ({"engine": {"args": ["--mem-fraction-static", "0.8", "--tp", "2"]}}, "engine.args[2]"),
    ({"engine": {"args": ["--port=9000"]}}, "engine.args[0]"),  # the router's discovery port
    ({"engine": {"args": ["--cas-guard-enabled", "false"]}}, "engine.args[0]"),
    ({"engine": {"env": [{"name": "LWS_LEADER_ADDRESS", "value": "x"}]}}, "engine.env[0].name"),
    (
        {"engine": {"env": [{"name": "SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "value": "1"}]}},
        "engine.env[0].name",
    ),
    ({"engine": {"speculative": {"algorithm": "EAGLE"}}}, "engine.speculative.draftModelPath"),
    ({"hicache": {"enabled": True, "hostMemoryRatio": 0.5}}, "hicache.hostMemoryRatio"),
    ({"rollout": {"strategy": "Canary"}}, "rollout.steps"),
    ({"rollout": {"steps": [{"weight": 50}, {"weight": 10}]}}, "rollout.steps"),
    # sglang-router 0.3.2 has no such policy: its pods would exit at start (issue 40)
    ({"router": {"policy": "consistent_hashing"}}, "router.policy"),
]


@pytest.mark.parametrize(("overrides", "field"), RULES)
def test_each_rule_names_its_field(overrides: dict[str, Any], field: str) -> None:
    """Regression: every invalid spec is reported with the field the user must fix."""
    errors = validate(spec_of(**overrides))
    assert [e.field for e in errors] == [field]
    with pytest.raises(InvalidSpec, match=re.escape(field)):
        build_plan("x", "ns", spec_of(**overrides))


def test_layersplit_only_for_dsa_models() -> None:
    """Regression: SGLang refuses --enable-dsa-cache-layer-split without a DSA indexer
    (model_hook.py:187-191); the default is off there, an explicit true names the field."""
    for name in ("acme/coder", "deepseek-ai/DeepSeek-V3", "moonshotai/Kimi-K2-Instruct"):
        raw: dict[str, Any] = {"model": {"name": name, "numLayers": 40}}
        raw["prefill"] = {"contextParallel": 8}
        assert validate(parse_spec(raw)) == []
        assert not build_plan("x", "ns", parse_spec(raw)).layer_split
        raw["prefill"]["layerSplit"] = True
        assert [e.field for e in validate(parse_spec(raw))] == ["prefill.layerSplit"]
    assert build_plan("x", "ns", spec_of(prefill={"contextParallel": 2})).layer_split


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"prefill": {"tensorParallel": 16, "contextParallel": 2}}, "prefill.tensorParallel"),
        (
            {"prefill": {"contextParallel": 2, "layerSplit": True},
             "engine": {"transferBackend": "nixl"}},
            "engine.transferBackend",
        ),
        (
            {"model": {"name": "deepseek-ai/DeepSeek-V3"}, "prefill": {"contextParallel": 4}},
            "prefill.contextParallel",
        ),
    ],
)  # fmt: skip
def test_context_parallel_rules_sglang_enforces(overrides: dict[str, Any], field: str) -> None:
    """Regression: DSA CP is single-node (tp <= 8), LayerSplit is mooncake-only, and MLA
    without DSA runs one CP rank per GPU; each is refused naming the field."""
    assert [e.field for e in validate(spec_of(**overrides))] == [field]


def test_cp_strategy_follows_the_model() -> None:
    """Regression: SGLang refuses --enable-prefill-cp without --cp-strategy; DSA models get
    interleave (LayerSplit needs it), the others zigzag."""
    assert build_plan("x", "ns", spec_of()).cp_strategy is None
    assert build_plan("x", "ns", spec_of(prefill={"contextParallel": 4})).cp_strategy == (
        "interleave"
    )
    ds = spec_of(model={"name": "deepseek-ai/DeepSeek-V3"}, prefill={"contextParallel": 8})
    assert build_plan("x", "ns", ds).cp_strategy == "zigzag"
    nixl = spec_of(prefill={"contextParallel": 2}, engine={"transferBackend": "nixl"})
    assert not build_plan("x", "ns", nixl).layer_split  # the default follows the backend


def test_gpu_budget_and_ratio_bounds() -> None:
    """Regression: a plan above the GPU budget or outside ratio bounds is refused by field."""
    over = spec_of(prefill={"replicas": 4}, decode={"replicas": 4}, ratio={"gpuBudget": 56})
    with pytest.raises(InvalidSpec, match=r"ratio\.gpuBudget.*64 GPUs"):
        build_plan("x", "ns", over)
    skew = spec_of(prefill={"replicas": 5}, decode={"replicas": 1}, ratio={"max": 4})
    with pytest.raises(InvalidSpec, match=r"ratio\.max"):
        build_plan("x", "ns", skew)


def test_glm5_sample_plan() -> None:
    """The GLM-5 sample: 3 prefill (TP8/CP4, LayerSplit 20-20-19-19) + 2 decode = 40 GPUs."""
    raw = load_sample("glm5-long-context.yaml")
    plan = build_plan("glm5-agents", "default", parse_spec(raw["spec"]))
    assert (plan.prefill.replicas, plan.decode.replicas) == (3, 2)
    assert plan.prefill.gpus + plan.decode.gpus == 40
    assert plan.layout is not None and plan.layout.enabled
    assert [s.count for s in plan.layout.shards] == [20, 20, 19, 19]
    assert plan.prefill.workload_name == f"glm5-agents-prefill-{plan.revision}"


def test_layersplit_defaults_on_with_cp() -> None:
    plan = build_plan("x", "ns", spec_of(prefill={"contextParallel": 2}))
    assert plan.layout is not None and plan.layout.enabled
    plan = build_plan("x", "ns", spec_of(prefill={"contextParallel": 2, "layerSplit": False}))
    assert plan.layout is not None and not plan.layout.enabled


def _cel_regex(rule: str) -> str:
    return rule.split(".matches('", 1)[1].split("')", 1)[0]


@pytest.mark.parametrize(
    "name",
    [
        "zai-org/GLM-5-FP8", "GLM-5", "deepseek-ai/DeepSeek-V3.2-Exp", "deepseek-ai/DeepSeek-V3",
        "deepseek-ai/DeepSeek-V3.1", "deepseek-ai/DeepSeek-R1-0528", "moonshotai/Kimi-K2-Instruct",
        "Qwen/Qwen3-Coder-30B-A3B-Instruct", "acme/glm-5-tuned", "glm-5/other", "org/deepseek-v3x2",
    ],
)  # fmt: skip
def test_cel_model_families_mirror_the_table(name: str) -> None:
    """Regression: the CEL rules classify a model name (DSA, MLA without DSA) exactly as
    `lookup_model` does, so the API server and the planner refuse the same specs."""
    from cas_operator.api import models as m

    assert {k for k, v in KNOWN_MODELS.items() if v.dsa} == set(m.DSA_MODELS)
    assert {k for k, v in KNOWN_MODELS.items() if v.mla and not v.dsa} == set(m.MLA_MODELS)
    profile = lookup_model(name, None)
    dsa = re.search(_cel_regex(m.IS_DSA), name.lower()) is not None
    mla_only = dsa is False and re.search(_cel_regex(m.IS_MLA_WITHOUT_DSA), name.lower())
    assert dsa == (profile is not None and profile.dsa)
    assert bool(mla_only) == (profile is not None and profile.mla and not profile.dsa)
