"""Contract: every engine command line the operator renders passes SGLang 0.5.23's own checks.

Regression for "prefill pods with contextParallel > 1 crash at start" (issue 13): the operator
emitted `--enable-prefill-cp` without `--cp-strategy`, which SGLang's parallel hook refuses.
Each command line (samples through `cas_operator.render.render`, and generated specs over
model x tp x cp x layerSplit x gpusPerNode x HiCache x speculative x transfer backend) goes
through the launcher's flag split and SGLang's parser and resolution pipeline on CPU
(`tests/engine/sglang_contract.py` says what is stubbed). Both directions:

- a spec the operator accepts resolves in SGLang, to the layout the operator planned (tp,
  attention CP size, CP strategy, LayerSplit, nodes): SGLang silently rewriting one would make
  the status and the planner wrong without a crash;
- a spec SGLang refuses (or rewrites) is refused by the operator, naming a field.

Marked `sglang_real`: under CI a skip fails (tests/engine/conftest.py).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cas_engine.launch import build_cas_parser
from cas_operator.api import constants as c
from cas_operator.desired import build as plan_module
from cas_operator.desired.build import plan_raw
from cas_operator.desired.plan import InvalidSpec, Plan
from cas_operator.desired.resources import build_all
from cas_operator.desired.resources.meta import Owner
from cas_operator.desired.validate import owned_flag
from cas_operator.render import render
from tests.engine.sglang_contract import (
    MODEL_CONFIGS,
    MODEL_NAMES,
    SECRET_VALUES,
    PodCommand,
    engine_commands,
    fixture_for,
    resolve_with_sglang,
    sglang_argv,
    sglang_parser,
    write_model_dirs,
)
from tests.engine.sglang_real import sglang_import_problem
from tests.paths import load_sample

WHY_NOT = sglang_import_problem("sglang.srt.server_args", "sglang.srt.arg_groups.pipeline")
pytestmark = [pytest.mark.sglang_real, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]

SAMPLES = ["minimal.yaml", "glm5-long-context.yaml", "multinode-decode.yaml"]
GENERATED_EXAMPLES = 150
CHECKED: dict[str, int] = {
    "sample": 0,
    "generated": 0,
    "generated_refused": 0,
    "cp": 0,
    "layer_split": 0,
    "multi_node": 0,
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_model_dirs(tmp_path_factory.mktemp("models"))


def commands_of(plan: Plan) -> list[PodCommand]:
    return engine_commands(build_all(Owner(plan.name, plan.namespace, "uid"), plan))


def sglang_outcome(cmd: PodCommand, plan: Plan, dirs: dict[str, Path]) -> Any:
    """SGLang's resolved view of one pod's command line, or the exception it raised."""
    model_dir = dirs[fixture_for(plan.spec.model.name)]
    try:
        return resolve_with_sglang(sglang_argv(cmd.args, model_dir, model_dir, cmd.env), cmd.env)
    except (SystemExit, ValueError, AssertionError, NotImplementedError, RuntimeError) as exc:
        return exc


def layout_mismatches(view: Any, cmd: PodCommand, plan: Plan) -> list[str]:
    """Where SGLang's resolved layout differs from the operator's plan (empty: agrees)."""
    pool = plan.prefill if cmd.role == "prefill" else plan.decode
    shape = pool.shape
    cp = shape.context_parallel if cmd.role == "prefill" else 1
    want = {
        "disaggregation_mode": cmd.role,
        "tp_size": shape.tensor_parallel,
        "nnodes": shape.nodes,
        "attn_cp_size": cp,
        "enable_prefill_cp": cp > 1,
        "cp_strategy": plan.cp_strategy if cp > 1 else None,
        "enable_dsa_cache_layer_split": cmd.role == "prefill" and plan.layer_split,
    }
    return [
        f"{key}: operator {value!r}, SGLang {getattr(view, key)!r}"
        for key, value in want.items()
        if getattr(view, key) != value
    ]


def assert_sglang_accepts(plan: Plan, dirs: dict[str, Path]) -> int:
    commands = commands_of(plan)
    assert {c.role for c in commands} == {"prefill", "decode"}
    for cmd in commands:
        view = sglang_outcome(cmd, plan, dirs)
        assert not isinstance(view, BaseException), (
            f"SGLang refuses {cmd.workload} of an accepted spec: {type(view).__name__}: {view}\n"
            f"spec: {plan.spec.model_dump(by_alias=True, exclude_defaults=True)}\nargs: {cmd.args}"
        )
        assert layout_mismatches(view, cmd, plan) == [], cmd.args
        CHECKED["cp"] += int(view.enable_prefill_cp)
        CHECKED["layer_split"] += int(view.enable_dsa_cache_layer_split)
        CHECKED["multi_node"] += int(view.nnodes > 1)
    return len(commands)


# ---- samples ------------------------------------------------------------------------------------


@pytest.mark.parametrize("sample", SAMPLES)
def test_sample_command_lines_pass_sglang(sample: str, model_dirs: dict[str, Path]) -> None:
    """Every engine container of every sample, exactly as `cas-operator render` prints it."""
    resource = load_sample(sample)
    commands = engine_commands(render(resource))
    plan = plan_module.plan_raw("x", "default", resource["spec"])
    assert commands, sample
    for cmd in commands:
        view = sglang_outcome(cmd, plan, model_dirs)
        assert not isinstance(view, BaseException), f"{cmd.workload}: {view}\n{cmd.args}"
        assert layout_mismatches(view, cmd, plan) == [], cmd.args
        # the fleet's admin key reaches SGLang (its admin endpoints refuse without it)
        assert view.admin_api_key == SECRET_VALUES["engine-admin-key"], cmd.args
    CHECKED["sample"] += len(commands)


def test_sample_count() -> None:
    """Guards the coverage claim: 7 sample command lines (the LWS decode has leader and worker)."""
    total = sum(len(engine_commands(render(load_sample(s)))) for s in SAMPLES)
    assert total == 7


# ---- generated specs ----------------------------------------------------------------------------

SPECULATIVE = st.sampled_from(
    [None, {"algorithm": "NEXTN"}, {"algorithm": "EAGLE", "draftModelPath": "/models/draft"}]
)
HICACHE = st.sampled_from(
    [
        {"enabled": False},
        {"enabled": True, "hostMemoryRatio": 2, "storageBackend": "none"},
        {"enabled": True, "hostMemoryRatio": 2, "storageBackend": "mooncake"},
        {"enabled": True, "hostMemoryRatio": 3, "storageBackend": "file"},
    ]
)


@st.composite
def specs(draw: st.DrawFn) -> dict[str, Any]:
    fixture = draw(st.sampled_from(sorted(MODEL_CONFIGS)))
    model: dict[str, Any] = {"name": MODEL_NAMES[fixture]}
    if fixture == "qwen3-coder" and draw(st.booleans()):
        model["numLayers"] = MODEL_CONFIGS[fixture]["num_hidden_layers"]
    tp = draw(st.sampled_from([1, 2, 4, 8, 16]))
    # Mostly a divisor of tp (the specs worth running), sometimes any size (the refusals).
    cp_choices = [d for d in (1, 2, 4, 8, 16) if tp % d == 0]
    cp = draw(st.sampled_from(cp_choices) | st.sampled_from([1, 2, 4, 8, 16]))
    prefill: dict[str, Any] = {
        "replicas": 1,
        "tensorParallel": tp,
        "contextParallel": cp,
        "gpusPerNode": draw(st.sampled_from([4, 8])),
    }
    layer_split = draw(st.sampled_from([None, True, False]))
    if layer_split is not None:
        prefill["layerSplit"] = layer_split
    decode = {
        "replicas": 1,
        "tensorParallel": draw(st.sampled_from([1, 4, 8, 16])),
        "gpusPerNode": draw(st.sampled_from([4, 8])),
    }
    engine: dict[str, Any] = {"transferBackend": draw(st.sampled_from(["mooncake", "nixl"]))}
    speculative = draw(SPECULATIVE)
    if speculative is not None:
        engine["speculative"] = speculative
    return {
        "model": model,
        "engine": engine,
        "prefill": prefill,
        "decode": decode,
        "hicache": draw(HICACHE),
    }


def unvalidated_plan(raw: dict[str, Any]) -> Plan | None:
    """The plan the operator would build with its semantic validation switched off (None: no
    plan at all, e.g. tp not fitting whole nodes): what SGLang would get without the refusal."""
    with mock.patch.object(plan_module, "validate", lambda *a, **k: []):
        try:
            return plan_raw("x", "ns", copy.deepcopy(raw))
        except (InvalidSpec, ValueError):
            return None


@settings(
    max_examples=GENERATED_EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(raw=specs())
def test_generated_specs_agree_with_sglang(
    raw: dict[str, Any], model_dirs: dict[str, Path]
) -> None:
    """Accepted by the operator => SGLang accepts every pod and resolves the planned layout.
    Refused or rewritten by SGLang => refused by the operator, naming a field."""
    try:
        plan = plan_raw("x", "ns", copy.deepcopy(raw))
    except InvalidSpec as exc:
        assert exc.errors and all(e.field for e in exc.errors)
        CHECKED["generated_refused"] += 1
        return
    CHECKED["generated"] += assert_sglang_accepts(plan, model_dirs)


@pytest.mark.parametrize("model", ["zai-org/GLM-5-FP8", "deepseek-ai/DeepSeek-V3.2"])
@pytest.mark.parametrize(("tp", "cp"), [(2, 2), (4, 4), (8, 2), (8, 4), (8, 8)])
@pytest.mark.parametrize("hicache", [False, True])
def test_dsa_layer_split_grid(
    model: str, tp: int, cp: int, hicache: bool, model_dirs: dict[str, Path]
) -> None:
    """Every DSA CP shape the operator accepts, LayerSplit on by default, with NEXTN and with
    and without HiCache (the generated specs reach LayerSplit only rarely)."""
    raw = {
        "model": {"name": model},
        "engine": {"speculative": {"algorithm": "NEXTN"}},
        "prefill": {"replicas": 1, "tensorParallel": tp, "contextParallel": cp},
        "decode": {"replicas": 1},
        "hicache": {"enabled": hicache, "storageBackend": "mooncake" if hicache else "none"},
    }
    plan = plan_raw("x", "ns", raw)
    assert plan.layer_split and plan.cp_strategy == "interleave"
    CHECKED["generated"] += assert_sglang_accepts(plan, model_dirs)


def sglang_verdicts(raw: dict[str, Any], dirs: dict[str, Path]) -> list[str]:
    """What SGLang says about each pod of the unvalidated plan: 'ok' or why not."""
    plan = unvalidated_plan(raw)
    assert plan is not None
    verdicts = []
    for cmd in commands_of(plan):
        view = sglang_outcome(cmd, plan, dirs)
        if isinstance(view, BaseException):
            verdicts.append(f"{cmd.role}: {type(view).__name__}: {view}")
        else:
            verdicts.append("; ".join(layout_mismatches(view, cmd, plan)) or "ok")
    return verdicts


# Each SGLang rule the operator mirrors: the spec it refuses, the field it names, and what
# SGLang 0.5.23 does with the command line the operator would otherwise have rendered.
SGLANG_RULES = [
    (  # model_hook.py:187-191
        {"model": {"name": "deepseek-ai/DeepSeek-V3"},
         "prefill": {"contextParallel": 8, "layerSplit": True}},
        "prefill.layerSplit",
        "only supported for DSA",
    ),
    (  # model_hook.py:187-191 (Kimi-K2 is DeepseekV3ForCausalLM without index_topk)
        {"model": {"name": "moonshotai/Kimi-K2-Instruct"},
         "prefill": {"contextParallel": 8, "layerSplit": True}},
        "prefill.layerSplit",
        "only supported for DSA",
    ),
    (  # model_overrides/deepseek_v2.py:123-125
        {"model": {"name": "zai-org/GLM-5-FP8"},
         "prefill": {"tensorParallel": 16, "contextParallel": 4}},
        "prefill.tensorParallel",
        "tp_size <= 8",
    ),
    (  # model_hook.py:391-400
        {"model": {"name": "zai-org/GLM-5-FP8"}, "engine": {"transferBackend": "nixl"},
         "prefill": {"contextParallel": 4, "layerSplit": True}},
        "engine.transferBackend",
        "only supports the mooncake transfer backend",
    ),
    (  # model_overrides/deepseek_v2.py:209-210: attn_cp_size silently becomes tp_size
        {"model": {"name": "deepseek-ai/DeepSeek-V3"}, "prefill": {"contextParallel": 2}},
        "prefill.contextParallel",
        "attn_cp_size: operator 2, SGLang 8",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("raw", "field", "sglang_says"), SGLANG_RULES)
def test_what_sglang_refuses_the_operator_refuses(
    raw: dict[str, Any], field: str, sglang_says: str, model_dirs: dict[str, Path]
) -> None:
    with pytest.raises(InvalidSpec) as refused:
        plan_raw("x", "ns", copy.deepcopy(raw))
    assert field in [e.field for e in refused.value.errors]
    verdicts = sglang_verdicts(raw, model_dirs)
    assert any(sglang_says in v for v in verdicts), verdicts


def test_without_cp_strategy_sglang_refuses_prefill_cp(model_dirs: dict[str, Path]) -> None:
    """The issue itself: the old command line (no --cp-strategy) is refused by SGLang."""
    raw = {"model": {"name": "glm-5"}, "prefill": {"contextParallel": 4, "layerSplit": False}}
    plan = plan_raw("x", "ns", raw)
    (prefill,) = [c for c in commands_of(plan) if c.role == "prefill"]
    at = prefill.args.index("--cp-strategy")
    old = PodCommand(
        prefill.workload, "prefill", prefill.args[:at] + prefill.args[at + 2 :], prefill.env
    )
    outcome = sglang_outcome(old, plan, model_dirs)
    assert isinstance(outcome, ValueError) and "--cp-strategy must be set" in str(outcome)


# ---- long option names --------------------------------------------------------------------------


def _flags(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(raw=specs())
def test_engine_args_use_full_option_names(raw: dict[str, Any]) -> None:
    """Regression: `--tp` reached SGLang only as an argparse prefix of `--tp-size`; a new option
    starting the same way would make it ambiguous. Every flag must be a full option name of
    SGLang's parser (or of the launcher's, which has abbreviations off)."""
    sglang_options = set(_sglang_options())
    cas_options = set(build_cas_parser()._option_string_actions)
    samples = [load_sample(s)["spec"] for s in SAMPLES]
    for spec in [raw, *samples]:
        try:
            plan = plan_raw("x", "ns", copy.deepcopy(spec))
        except InvalidSpec:
            continue
        for cmd in commands_of(plan):
            for flag in _flags(cmd.args):
                known = cas_options if flag.startswith("--cas-") else sglang_options
                assert flag in known, f"{flag} is not a full option name ({cmd.workload})"


_OPTIONS: list[str] = []


def _sglang_options() -> list[str]:
    if not _OPTIONS:
        _OPTIONS.extend(sglang_parser()._option_string_actions)
    return _OPTIONS


def test_coverage_report() -> None:
    """Runs last in this module: how many command lines went through SGLang (see -rP)."""
    print(f"sglang contract: {CHECKED}")


# -- what engine.args and engine.env may not set (api.constants.OWNED_*) ---------------------

OWNED_PROBES = [
    load_sample("minimal.yaml"),
    load_sample("glm5-long-context.yaml"),
    load_sample("multinode-decode.yaml"),
    {"metadata": {"name": "eagle"}, "spec": {"model": {"name": "acme/coder"}, "engine": {
        "speculative": {"algorithm": "EAGLE", "draftModelPath": "/models/draft"}},
        "hicache": {"enabled": True, "storageBackend": "mooncake"}}},
]  # fmt: skip


def _rendered() -> tuple[set[str], set[str]]:
    """SGLang dests of every flag the operator renders (users' own args left out), and the
    env var names it renders, over plans that between them render every flag family."""
    parser = sglang_parser()
    dests: set[str] = set()
    env: set[str] = set()
    for resource in OWNED_PROBES:
        plan = plan_raw("x", "default", copy.deepcopy(resource["spec"]))
        users = len(plan.spec.engine.args or [])
        for cmd in commands_of(plan):
            ours = cmd.args[: len(cmd.args) - users] if users else cmd.args
            for arg in ours:
                if arg.startswith("--") and not arg.startswith(c.OWNED_ENGINE_FLAG_PREFIX):
                    dests.add(parser._option_string_actions[arg.split("=")[0]].dest)
            if "--cas-admin-key-env" in ours:  # the launcher hands SGLang the admin key flag
                dests.add(parser._option_string_actions["--admin-api-key"].dest)
            env |= set(cmd.env) - {var.name for var in plan.spec.engine.env or []}
    return dests, env


def test_owned_flags_are_every_sglang_option_for_what_the_operator_renders() -> None:
    """Regression: `engine.args` could override what the operator renders (`--tp 4` beside
    the pool's `--tp-size`; SGLang takes the last one, and aliases and abbreviations too), so
    the pods ran another layout than the plan. The deny list must name every option string
    SGLang 0.5.23 has for each rendered setting, and nothing else."""
    parser = sglang_parser()
    dests, _ = _rendered()
    options = {o: a.dest for o, a in parser._option_string_actions.items() if o.startswith("--")}
    owned_by_sglang = {o for o, dest in options.items() if dest in dests}
    assert owned_by_sglang == set(c.OWNED_ENGINE_FLAGS)
    # Every other SGLang option stays open to users, abbreviations of owned ones do not.
    refused = sorted(o for o, dest in options.items() if dest not in dests and owned_flag(o))
    assert refused == [], refused
    assert parser.allow_abbrev  # why owned_flag refuses prefixes
    for flag in c.OWNED_ENGINE_FLAGS:
        assert owned_flag(flag) == flag and owned_flag(f"{flag}=1") == flag


def test_owned_env_is_what_the_operator_renders() -> None:
    _, env = _rendered()
    assert env == set(c.OWNED_ENGINE_ENV)
