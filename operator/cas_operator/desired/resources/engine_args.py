"""SGLang and cas_engine command lines for prefill and decode pods, one function per flag family.

The pod runs `python3 -m cas_engine.launch_server <args>`: SGLang's own flags plus `--cas-*`
flags that configure strict KV reclaim and the speculative-decoding quality gate. User `args`
from `spec.engine.args` come last; they may not set a flag rendered here (the list, with every
alias SGLang has for it, is `api.constants.OWNED_ENGINE_FLAGS`; `desired.validate` refuses one).
"""

from __future__ import annotations

from cas_operator.api import constants as c
from cas_operator.api.models import KvReclaim
from cas_operator.desired.plan import Plan, PoolPlan
from cas_operator.desired.resources.security import key_env

LAUNCHER = ["python3", "-m", "cas_engine.launch_server"]
# LWS injects these into every container of a group; Kubernetes expands $(VAR) in args.
LWS_LEADER_ADDRESS = "$(LWS_LEADER_ADDRESS)"
LWS_WORKER_INDEX = "$(LWS_WORKER_INDEX)"


def fmt(value: float) -> str:
    """Numbers as SGLang parses them: integers without a trailing .0."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def server_args(plan: Plan) -> list[str]:
    return [
        "--model-path",
        plan.model_path,
        "--served-model-name",
        plan.served_model_name,
        "--host",
        "0.0.0.0",
        "--port",
        str(c.ENGINE_PORT),
        "--enable-metrics",
        # SGLang's admin key, from the fleet's keys Secret (desired/resources/security.py) in
        # this variable: the launcher hands it to SGLang off every command line, where SGLang
        # would publish it (/server_info's launch_command), and an older launcher refuses the
        # flag instead of starting with open admin endpoints (cas_engine.launch)
        "--cas-admin-key-env",
        c.ENV_ENGINE_ADMIN_KEY,
    ]


def disaggregation_args(plan: Plan, pool: PoolPlan) -> list[str]:
    args = [
        "--disaggregation-mode",
        pool.role,
        "--disaggregation-transfer-backend",
        plan.spec.engine.transfer_backend.value,
    ]
    if pool.role == c.ROLE_PREFILL:
        args += ["--disaggregation-bootstrap-port", str(c.BOOTSTRAP_PORT)]
    return args


def parallel_args(plan: Plan, pool: PoolPlan) -> list[str]:
    """TP always; multi-node rendezvous through the LWS leader; CP and LayerSplit on prefill.

    Full option names only: SGLang's parser allows prefixes (`--tp` for `--tp-size`), which a
    new SGLang option can make ambiguous. CP needs a `--cp-strategy` (SGLang 0.5.23
    srt/arg_groups/parallel_hook.py:151-154), interleave for DSA models (LayerSplit requires
    it, model_hook.py:381-387), zigzag otherwise (`desired.resolve.cp_strategy`).
    """
    shape = pool.shape
    args = ["--tp-size", str(shape.tensor_parallel)]
    if shape.multi_node:
        args += [
            "--nnodes",
            str(shape.nodes),
            "--node-rank",
            LWS_WORKER_INDEX,
            "--dist-init-addr",
            f"{LWS_LEADER_ADDRESS}:{c.DIST_INIT_PORT}",
        ]
    if pool.role == c.ROLE_PREFILL and shape.context_parallel > 1:
        assert plan.cp_strategy is not None  # resolve sets it whenever cp > 1
        args += [
            "--attn-cp-size",
            str(shape.context_parallel),
            "--enable-prefill-cp",
            "--cp-strategy",
            plan.cp_strategy,
        ]
        if plan.layer_split:
            args.append("--enable-dsa-cache-layer-split")
    return args


def hicache_args(plan: Plan, pool: PoolPlan) -> list[str]:
    """HiCache on prefill pods only: it is a tier of the radix (prefix) cache, which SGLang
    0.5.23 turns off on PD decode workers (srt/arg_groups/pd_disaggregation_hook.py:120-126)
    and then refuses HiCache (kv_cache_hook.py:393-397)."""
    hicache = plan.spec.hicache
    if not hicache.enabled or pool.role != c.ROLE_PREFILL:
        return []
    args = [
        "--enable-hierarchical-cache",
        "--hicache-ratio",
        fmt(hicache.host_memory_ratio),
        "--hicache-write-policy",
        hicache.write_policy,
    ]
    if hicache.storage_backend.value != "none":
        args += ["--hicache-storage-backend", hicache.storage_backend.value]
    return args


def speculative_args(plan: Plan) -> list[str]:
    spec = plan.spec.engine.speculative
    if spec is None:
        return []
    args = [
        "--speculative-algorithm",
        spec.algorithm.value,
        "--speculative-num-steps",
        str(spec.num_steps),
        "--speculative-eagle-topk",
        str(spec.eagle_topk),
        "--speculative-num-draft-tokens",
        str(spec.num_draft_tokens),
    ]
    if spec.draft_model_path:
        args += ["--speculative-draft-model-path", spec.draft_model_path]
    return args


def cas_args(plan: Plan, pool: PoolPlan) -> list[str]:
    """Our engine layer: reclaim mode on both roles; the quality gate where tokens are decoded.

    Without speculative decoding there is nothing for the gate to judge; with the guard
    disabled it still observes (metrics) but never aborts (`--cas-guard-enabled false`).
    """
    reclaim = "strict" if plan.spec.engine.kv_reclaim == KvReclaim.STRICT else "upstream"
    args = ["--cas-kv-reclaim", reclaim]
    guard = plan.spec.anomaly_guard
    if pool.role != c.ROLE_DECODE:
        return args
    if reclaim == "strict":  # decode holds the rooms of aborted requests
        args += ["--cas-kv-quarantine-rooms", str(plan.spec.engine.kv_quarantine_rooms)]
        args += ["--cas-prefill-gone-file", f"{c.PREFILL_GONE_MOUNT}/{c.PREFILL_GONE_KEY}"]
    if not guard.enabled or plan.spec.engine.speculative is None:
        return [*args, "--cas-guard-enabled", "false"]
    return [
        *args,
        "--cas-guard-enabled",
        "true",
        "--cas-guard-min-generated-tokens",
        str(guard.min_generated_tokens),
        "--cas-guard-min-accept-length",
        fmt(guard.min_accept_length),
        "--cas-guard-max-accept-rate",
        fmt(guard.max_accept_rate),
    ]


def engine_args(plan: Plan, pool: PoolPlan) -> list[str]:
    """The full argument list after the launcher module."""
    return [
        *server_args(plan),
        *disaggregation_args(plan, pool),
        *parallel_args(plan, pool),
        *hicache_args(plan, pool),
        *speculative_args(plan),
        *cas_args(plan, pool),
        *(plan.spec.engine.args or []),
    ]


def engine_env(plan: Plan) -> list[dict[str, object]]:
    """The prefill time budget through the SGLang variables that govern it, the admin key,
    then user env."""
    budget = str(plan.spec.prefill.timeout_seconds)
    env: list[dict[str, object]] = [
        {"name": "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "value": budget},
        {"name": "SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "value": budget},
        {"name": "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "value": "1"},
        key_env(plan, c.ENV_ENGINE_ADMIN_KEY, c.KEY_ENGINE_ADMIN),
    ]
    for var in plan.spec.engine.env or []:
        env.append(var.model_dump(mode="json", by_alias=True, exclude_none=True))
    return env
