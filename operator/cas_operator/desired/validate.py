"""Semantic validation: what the CRD schema cannot say (or a pre-CEL cluster did not check).

Each rule returns `SpecError`s naming the field in the user's (camelCase) terms; the reconcile
turns them into a `PermanentError` and a `Degraded` condition with reason `InvalidSpec`.
The CEL rules in `api/models.py` are mirrored here so both layers agree (a test checks each).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from cas_operator.api import constants as c
from cas_operator.api.limits import MAX_GPUS_ENV, OperatorLimits
from cas_operator.api.models import (
    ANNOTATION_KEY,
    DSA_MODELS,
    MAX_ANNOTATIONS_BYTES,
    MAX_DSA_CP_TENSOR_PARALLEL,
    MAX_QUALIFIED_NAME,
    MAX_QUALIFIED_PREFIX,
    QUALIFIED_NAME,
    CodingAgentServingSpec,
    EnvVar,
    PoolSpec,
    PrefillPoolSpec,
    RatioMode,
    RouterImplementation,
    RouterPolicy,
    SpeculativeAlgorithm,
    TransferBackend,
)
from cas_operator.desired.resolve import Resolved, resolve


@dataclass(frozen=True)
class SpecError:
    field: str
    message: str

    def __str__(self) -> str:
        return f"spec.{self.field}: {self.message}"


def _pool_errors(role: str, pool: PoolSpec) -> list[SpecError]:
    errors = []
    tp, per_node = pool.tensor_parallel, pool.gpus_per_node
    if tp > per_node and tp % per_node:
        errors.append(
            SpecError(
                f"{role}.tensorParallel",
                f"{tp} is above gpusPerNode {per_node} and not a multiple of it",
            )
        )
    if isinstance(pool, PrefillPoolSpec):
        cp = pool.context_parallel
        if tp % cp:
            errors.append(SpecError(f"{role}.contextParallel", f"{cp} does not divide tp {tp}"))
        if pool.layer_split and cp <= 1:
            errors.append(SpecError(f"{role}.layerSplit", "requires contextParallel > 1"))
    return errors


def _layer_split_errors(spec: CodingAgentServingSpec, resolved: Resolved) -> list[SpecError]:
    if not resolved.layer_split:
        return []
    profile = resolved.model
    errors = []
    if spec.engine.transfer_backend != TransferBackend.MOONCAKE:
        # SGLang 0.5.23 srt/arg_groups/model_hook.py:391-400
        errors.append(
            SpecError(
                "engine.transferBackend",
                f"prefill.layerSplit needs mooncake, not {spec.engine.transfer_backend.value}",
            )
        )
    if profile is None or not profile.dsa:
        # SGLang 0.5.23 srt/arg_groups/model_hook.py:187-191 (`is_deepseek_dsa`)
        return [
            *errors,
            SpecError(
                "prefill.layerSplit",
                f"model {spec.model.name!r} is not a DSA (sparse-attention indexer) model; "
                f"LayerSplit needs one of {', '.join(DSA_MODELS)}",
            ),
        ]
    if profile.num_layers < spec.prefill.context_parallel:
        errors.append(
            SpecError(
                "prefill.contextParallel",
                f"{spec.prefill.context_parallel} ranks exceed the {profile.num_layers} layers",
            )
        )
    return errors


def _context_parallel_errors(spec: CodingAgentServingSpec, resolved: Resolved) -> list[SpecError]:
    """What SGLang 0.5.23 refuses, or silently changes, for the model's family under prefill CP
    (the CEL rules on `CodingAgentServingSpec` say the same by model name)."""
    pool = spec.prefill
    profile = resolved.model
    if pool.context_parallel <= 1 or profile is None:
        return []
    if profile.dsa and pool.tensor_parallel > MAX_DSA_CP_TENSOR_PARALLEL:
        # srt/arg_groups/model_overrides/deepseek_v2.py:123-125 asserts tp_size <= 8
        return [
            SpecError(
                "prefill.tensorParallel",
                f"{pool.tensor_parallel} is above {MAX_DSA_CP_TENSOR_PARALLEL}: SGLang runs DSA "
                "context parallelism on one node only",
            )
        ]
    if profile.mla and not profile.dsa and pool.context_parallel != pool.tensor_parallel:
        # srt/arg_groups/model_overrides/deepseek_v2.py:209-210 sets attn_cp_size = tp_size
        return [
            SpecError(
                "prefill.contextParallel",
                f"{pool.context_parallel} must equal tensorParallel {pool.tensor_parallel} for "
                f"model {spec.model.name!r} (MLA without DSA): SGLang runs one "
                "context-parallel rank per GPU",
            )
        ]
    return []


def _ratio_errors(spec: CodingAgentServingSpec) -> list[SpecError]:
    ratio = spec.ratio
    errors = []
    if ratio.min is not None and ratio.max is not None and ratio.min > ratio.max:
        errors.append(SpecError("ratio.min", f"{ratio.min} is above ratio.max {ratio.max}"))
    if ratio.mode == RatioMode.AUTO and ratio.gpu_budget is None:
        errors.append(
            SpecError("ratio.gpuBudget", "required in Auto mode (the most GPUs for both pools)")
        )
    return errors


def owned_flag(arg: str) -> str | None:
    """The operator's flag that user argument `arg` would set, or None. SGLang's parser takes
    unambiguous abbreviations (`--tp` for `--tp-size`), so a prefix of an owned flag counts."""
    flag = arg.split("=", 1)[0]
    if not flag.startswith("--") or len(flag) < 3:
        return None
    if flag.startswith(c.OWNED_ENGINE_FLAG_PREFIX) or flag in c.OWNED_ENGINE_FLAGS:
        return flag
    return next((f for f in sorted(c.OWNED_ENGINE_FLAGS) if f.startswith(flag)), None)


def _engine_errors(spec: CodingAgentServingSpec) -> list[SpecError]:
    errors = []
    spec_dec = spec.engine.speculative
    if (
        spec_dec
        and spec_dec.algorithm != SpeculativeAlgorithm.NEXTN
        and not spec_dec.draft_model_path
    ):
        errors.append(
            SpecError(
                "engine.speculative.draftModelPath", f"required for {spec_dec.algorithm.value}"
            )
        )
    for i, arg in enumerate(spec.engine.args or []):
        if (owned := owned_flag(arg)) is not None:
            why = f"{arg!r} sets {owned}, which the operator renders from the spec; set the field"
            errors.append(SpecError(f"engine.args[{i}]", why))
    for i, var in enumerate(spec.engine.env or []):
        if (reserved := reserved_env(var.name)) is not None:
            where, text = f"engine.env[{i}].name", f"{var.name} is reserved: {reserved}"
            errors.append(SpecError(where, text))
        errors += _env_source_errors(f"engine.env[{i}]", var)
    return errors


def reserved_env(name: str) -> str | None:
    """Why `engine.env` may not set `name` (the CRD's CEL rule on `engine.env`), or None."""
    if name in c.OWNED_ENGINE_ENV:
        return "the operator sets it from the spec"
    if name.startswith(c.OWNED_ENGINE_ENV_PREFIX):
        return "LeaderWorkerSet sets it"
    if name in c.ENGINE_LAYER_ENV or name.startswith(c.ENGINE_LAYER_ENV_PREFIX):
        return "the engine layer (cas_engine) reads or sets it; the operator configures it"
    return None


def _env_source_errors(where: str, var: EnvVar) -> list[SpecError]:
    """The CRD's CEL rules on an env var, for specs that did not come through the API server."""
    if var.value is not None and var.value_from is not None:
        return [SpecError(where, "an env var has value or valueFrom, not both")]
    source = var.value_from
    if source is None:
        return []
    chosen = [source.secret_key_ref, source.config_map_key_ref, source.field_ref]
    if sum(x is not None for x in chosen) != 1:
        why = "takes exactly one of secretKeyRef, configMapKeyRef, fieldRef"
        return [SpecError(f"{where}.valueFrom", why)]
    return []


def _hicache_errors(spec: CodingAgentServingSpec) -> list[SpecError]:
    if spec.hicache.enabled and spec.hicache.host_memory_ratio < 1.0:
        return [SpecError("hicache.hostMemoryRatio", "must be >= 1.0 when HiCache is enabled")]
    return []


def _rollout_errors(spec: CodingAgentServingSpec) -> list[SpecError]:
    """The CRD's rules on rollout and gateway (for specs that did not come through the API
    server), and what a canary needs to split traffic at all."""
    rollout, gateway = spec.rollout, spec.gateway
    errors = []
    if rollout.strategy.value == "Canary" and not rollout.steps:
        errors.append(SpecError("rollout.steps", "a Canary rollout needs at least one step"))
    weights = [step.weight for step in rollout.steps or []]
    if weights != sorted(weights):
        errors.append(SpecError("rollout.steps", f"weights must not decrease: {weights}"))
    for i, step in enumerate(rollout.steps or []):
        if step.pause_seconds is not None and step.pause_until_promoted is not None:
            why = "a step pauses for pauseSeconds or until promoted, not both"
            errors.append(SpecError(f"rollout.steps[{i}].pauseUntilPromoted", why))
    if rollout.strategy.value == "Canary" and gateway is None and spec.router.replicas < 1:
        why = "a Canary rollout without spec.gateway splits traffic by router replicas: at least 1"
        errors.append(SpecError("router.replicas", why))
    admission = spec.router.admission
    if admission.mode.value == "Fixed" and admission.requests_per_second is None:
        why = "required in Fixed mode"
        errors.append(SpecError("router.admission.requestsPerSecond", why))
    if gateway is not None and (gateway.parent_refs is None) == (gateway.http_route is None):
        why = "names parentRefs (an HTTPRoute the operator owns) or httpRoute (yours), not both"
        errors.append(SpecError("gateway", why))
    return errors


def surge_errors(
    spec: CodingAgentServingSpec, full_gpus: int, prefill_gpus: int, decode_gpus: int
) -> list[SpecError]:
    """A canary and its stable revision together may hold `ratio.gpuBudget` (or the full
    pools) plus `rollout.maxSurgeGpus`: that must fit one instance of each role per revision
    (`desired.traffic.surge_limit` is the same rule at run time)."""
    budget, surge = spec.ratio.gpu_budget, spec.rollout.max_surge_gpus
    if spec.rollout.strategy.value != "Canary" or (budget is None and surge is None):
        return []
    limit = (budget or full_gpus) + (surge or 0)
    least = 2 * (prefill_gpus + decode_gpus)
    if limit >= least:
        return []
    why = (
        f"a canary and its stable revision need at least one instance of each role each "
        f"({least} GPUs); the budget plus the surge allow {limit}"
    )
    return [SpecError("rollout.maxSurgeGpus", why)]


def _network_errors(spec: CodingAgentServingSpec) -> list[SpecError]:
    """Each peer is an IP range or labels, not both, not neither; a `metricsFrom` peer names
    its namespaces: not `namespaceLabels: {}` (every namespace), not a /0 range (the CRD's CEL
    rules too; `desired.resources.network.check_scoped` checks the rendered policies)."""
    policy = spec.security.network_policy
    errors = []
    for field, peers in (
        ("clientsFrom", policy.clients_from),
        ("metricsFrom", policy.metrics_from),
    ):
        for i, peer in enumerate(peers or []):
            labelled = peer.pod_labels is not None or peer.namespace_labels is not None
            where = f"security.networkPolicy.{field}[{i}]"
            if (peer.cidr is not None) == labelled:
                errors.append(SpecError(where, "a network peer is either cidr or labels"))
            elif peer.cidr is not None and not _is_cidr(peer.cidr):
                errors.append(SpecError(f"{where}.cidr", f"{peer.cidr!r} is not an IP range"))
            elif field == "metricsFrom" and peer.namespace_labels == {}:
                errors.append(SpecError(f"{where}.namespaceLabels", EVERY_NAMESPACE))
            elif field == "metricsFrom" and (peer.cidr or "").endswith("/0"):
                errors.append(SpecError(f"{where}.cidr", f"{peer.cidr} is every address"))
    return errors


EVERY_NAMESPACE = (
    "{} selects every namespace: name the scrapers' namespaces "
    "(kubernetes.io/metadata.name: <namespace>)"
)


def _is_cidr(text: str) -> bool:
    """What the CRD's rule accepts: `isCIDR` (Go's netip.ParsePrefix, which also refuses a
    leading zero in the prefix length; no IPv4-mapped IPv6 address) and no bits set beyond the
    prefix length (`ip_network` strict), as a NetworkPolicy's ipBlock.cidr requires."""
    bits = text.partition("/")[2]
    if not bits.isdigit() or (len(bits) > 1 and bits.startswith("0")):
        return False
    try:
        network = ipaddress.ip_network(text, strict=True)
    except ValueError:
        return False
    return not (isinstance(network, ipaddress.IPv6Network) and network.network_address.ipv4_mapped)


def _pod_metadata_errors(spec: CodingAgentServingSpec) -> list[SpecError]:
    """The CRD's CEL rules on `podMetadata` keys and the annotations' total size (values are
    checked by the models' patterns); Kubernetes' own rules for a pod's metadata."""
    meta = spec.pod_metadata
    errors = []
    for kind, keys, pattern in (
        ("labels", meta.labels, QUALIFIED_NAME),
        ("annotations", meta.annotations, ANNOTATION_KEY),
    ):
        for key in keys or {}:
            if not _qualified(key, pattern):
                why = "not a qualified name ([prefix/]name, name at most 63 characters)"
                errors.append(SpecError(f"podMetadata.{kind}[{key!r}]", why))
    total = sum(len(k.encode()) + len(v.encode()) for k, v in (meta.annotations or {}).items())
    if total > MAX_ANNOTATIONS_BYTES:
        why = f"{total} bytes of keys and values, above Kubernetes' {MAX_ANNOTATIONS_BYTES}"
        errors.append(SpecError("podMetadata.annotations", why))
    return errors


def _qualified(key: str, pattern: str) -> bool:
    prefix, slash, _ = key.partition("/")
    short = not slash or len(prefix) <= MAX_QUALIFIED_PREFIX
    return len(key) <= MAX_QUALIFIED_NAME and short and re.fullmatch(pattern, key) is not None


def _router_errors(spec: CodingAgentServingSpec) -> list[SpecError]:
    """consistent_hashing is smg's only (the CRD's CEL rule on `router` too): sglang-router
    0.3.2's `--policy` has no such choice, so its pods would exit at start."""
    router = spec.router
    if router.policy == RouterPolicy.CONSISTENT_HASHING and (
        router.implementation != RouterImplementation.SMG
    ):
        return [SpecError("router.policy", "consistent_hashing needs router.implementation smg")]
    return []


def limit_errors(spec: CodingAgentServingSpec, limits: OperatorLimits) -> list[SpecError]:
    """Auto mode grows up to `ratio.gpuBudget`: that must fit the operator's cap."""
    cap, budget = limits.max_gpus_per_resource, spec.ratio.gpu_budget
    if cap is None or budget is None or budget <= cap:
        return []
    why = f"{budget} is above this operator's cap of {cap} GPUs per resource ({MAX_GPUS_ENV})"
    return [SpecError("ratio.gpuBudget", why)]


def validate(spec: CodingAgentServingSpec, resolved: Resolved | None = None) -> list[SpecError]:
    """All semantic errors of a parsed spec (empty when valid); `resolved` is `resolve(spec)`
    when the caller has it already."""
    resolved = resolved or resolve(spec)
    return [
        *_pool_errors("prefill", spec.prefill),
        *_pool_errors("decode", spec.decode),
        *_layer_split_errors(spec, resolved),
        *_context_parallel_errors(spec, resolved),
        *_ratio_errors(spec),
        *_engine_errors(spec),
        *_hicache_errors(spec),
        *_rollout_errors(spec),
        *_network_errors(spec),
        *_pod_metadata_errors(spec),
        *_router_errors(spec),
    ]
