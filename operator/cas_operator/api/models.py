"""Typed models of the CodingAgentServing spec: the single source of truth of the CRD schema.

`crdgen` turns these models into the OpenAPI v3 structural schema in `crds/`; the operator parses
the live object's spec with the same models (`CodingAgentServingSpec.model_validate`), so a field
is defined once. Cross-field rules live twice on purpose: as CEL (`x-kubernetes-validations`, so
the API server rejects bad specs at `kubectl apply`) and as Python checks in `desired.validate`
(for clusters that predate CEL and for the operator's own defence); tests keep them in step.

GitOps rule: no schema defaults inside list items (they make Argo CD report perpetual drift).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from cas_operator.api import constants as c


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    """One CEL validation rule with the message users see when it fails."""
    entry = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


def _config(*rules: dict[str, str], title: str | None = None) -> ConfigDict:
    extra: dict[str, Any] = {}
    if rules:
        extra["x-kubernetes-validations"] = list(rules)
    return ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        json_schema_extra=extra or None,
        title=title,
        use_enum_values=False,
    )


class Spec(BaseModel):
    """Base of every spec model: camelCase on the wire, unknown fields rejected."""

    model_config = _config()


# ---------------------------------------------------------------------------------------------
# Model families SGLang 0.5.23 treats differently under prefill context parallelism
# ---------------------------------------------------------------------------------------------

# Keys of `desired.layersplit.KNOWN_MODELS` (matched, like there, against the lowercased last
# path segment of `model.name` by prefix); a unit test keeps both in step. DSA: a DeepSeek
# Sparse Attention indexer (GLM-5, DeepSeek-V3.2). MLA_MODELS: MLA without DSA.
DSA_MODELS = ("glm-5", "deepseek-v3.2")
MLA_MODELS = ("deepseek-v3", "deepseek-r1", "kimi-k2")
MAX_MODEL_NAME_LENGTH = 256  # bounds the CEL regex cost below
# SGLang refuses DSA prefill CP above 8 GPUs (model_overrides/deepseek_v2.py:123).
MAX_DSA_CP_TENSOR_PARALLEL = 8
MAX_REQUEST_RATE = 100000.0  # requests per second of one fleet
MAX_TOKENS = 10_000_000  # per request, input or output
AUTO_NEEDS_BUDGET = (
    "ratio.gpuBudget is required in Auto mode: the most GPUs the operator may give both pools"
)


def _name_matches(prefixes: tuple[str, ...]) -> str:
    # `[.]`, not a backslash: a CEL string literal has no backslash-dot escape.
    alternatives = "|".join(p.replace(".", "[.]") for p in prefixes)
    return f"self.model.name.lowerAscii().matches('^(.*/)?({alternatives})[^/]*$')"


IS_DSA = _name_matches(DSA_MODELS)
IS_MLA_WITHOUT_DSA = f"({_name_matches(MLA_MODELS)} && !{IS_DSA})"
PREFILL_CP = "(has(self.prefill) && self.prefill.contextParallel > 1)"
LAYER_SPLIT_SET = "(has(self.prefill) && has(self.prefill.layerSplit) && self.prefill.layerSplit)"

# ---------------------------------------------------------------------------------------------
# Enums
# ---------------------------------------------------------------------------------------------


class KvReclaim(StrEnum):
    STRICT = "Strict"
    UPSTREAM = "Upstream"


class TransferBackend(StrEnum):
    MOONCAKE = "mooncake"
    NIXL = "nixl"


class SpeculativeAlgorithm(StrEnum):
    EAGLE = "EAGLE"
    EAGLE3 = "EAGLE3"
    NEXTN = "NEXTN"


class RatioMode(StrEnum):
    FIXED = "Fixed"
    RECOMMEND = "Recommend"
    AUTO = "Auto"


class StorageBackend(StrEnum):
    NONE = "none"
    FILE = "file"
    MOONCAKE = "mooncake"


class RouterPolicy(StrEnum):
    """How a router picks the prefill (and decode) of each request."""

    CACHE_AWARE = "cache_aware"
    ROUND_ROBIN = "round_robin"
    POWER_OF_TWO = "power_of_two"
    RANDOM = "random"
    MANUAL = "manual"  # a worker per session routing key, assigned at random, then kept
    CONSISTENT_HASHING = "consistent_hashing"  # smg: a worker per session key by a hash ring


# The policies that route by the session key the client sends (router.ROUTING_KEY_HEADERS).
KEYED_POLICIES = (RouterPolicy.MANUAL, RouterPolicy.CONSISTENT_HASHING)


class RouterImplementation(StrEnum):
    """Which router binary the router pods run (the same flags, discovery and worker API)."""

    SGLANG_ROUTER = "sglang-router"  # PyPI sglang-router 0.3.2: python3 -m sglang_router...
    SMG = "smg"  # its successor, Shepherd Model Gateway 1.13: python3 -m smg.launch_router


class GuardAction(StrEnum):
    DRAIN = "Drain"
    REPLACE = "Replace"
    OBSERVE = "Observe"


class RolloutStrategy(StrEnum):
    ROLLING = "Rolling"
    CANARY = "Canary"


class AdmissionMode(StrEnum):
    AUTO = "Auto"  # the planner's capacity for the pools (a model with an instance profile)
    FIXED = "Fixed"  # the numbers in the spec
    OFF = "Off"


class OperatorUpgradePolicy(StrEnum):
    """What a new operator version that renders the same spec's engine pods differently does:
    keep the pods as they run (Hold) or roll them to its rendering (Roll)."""

    HOLD = "Hold"
    ROLL = "Roll"


# ---------------------------------------------------------------------------------------------
# Kubernetes pass-through types (kept small and list-item defaults free)
# ---------------------------------------------------------------------------------------------

Quantity = Annotated[str | int, Field(json_schema_extra={"x-kubernetes-int-or-string": True})]


class Resources(Spec):
    """Container resources beyond the GPUs the pool shape implies (nvidia.com/gpu is set)."""

    requests: dict[str, Quantity] | None = None
    limits: dict[str, Quantity] | None = None


class Toleration(Spec):
    key: str | None = None
    operator: str | None = Field(default=None, json_schema_extra={"enum": ["Exists", "Equal"]})
    value: str | None = None
    effect: str | None = Field(
        default=None, json_schema_extra={"enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]}
    )
    toleration_seconds: int | None = None


_K8S_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class KeyRef(Spec):
    """One key of a Secret or ConfigMap in the resource's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=_K8S_NAME)
    key: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")
    optional: bool | None = None


class PodField(StrEnum):
    """The pod fields an engine may read (the downward API's, less labels and annotations)."""

    NAME = "metadata.name"
    NAMESPACE = "metadata.namespace"
    UID = "metadata.uid"
    NODE_NAME = "spec.nodeName"
    HOST_IP = "status.hostIP"
    POD_IP = "status.podIP"


class FieldRef(Spec):
    field_path: PodField


class EnvVarSource(Spec):
    """Where a variable's value comes from: exactly one of a Secret key, a ConfigMap key or a
    pod field. Nothing else (no resourceFieldRef, no unknown fields)."""

    model_config = _config(
        cel(
            "[has(self.secretKeyRef), has(self.configMapKeyRef), has(self.fieldRef)]"
            ".filter(x, x).size() == 1",
            "valueFrom takes exactly one of secretKeyRef, configMapKeyRef, fieldRef",
        ),
    )

    secret_key_ref: KeyRef | None = None
    config_map_key_ref: KeyRef | None = None
    field_ref: FieldRef | None = None


class EnvVar(Spec):
    model_config = _config(
        cel(
            "!(has(self.value) && has(self.valueFrom))",
            "an env var has value or valueFrom, not both",
        ),
    )

    name: str = Field(min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    value: str | None = Field(default=None, max_length=32768)
    value_from: EnvVarSource | None = None


# ---------------------------------------------------------------------------------------------
# Spec sections
# ---------------------------------------------------------------------------------------------


class ModelSpec(Spec):
    """What to serve. `numLayers` overrides the built-in table used to plan LayerSplit shards."""

    name: str = Field(
        min_length=1,
        max_length=MAX_MODEL_NAME_LENGTH,
        description="Model name, e.g. zai-org/GLM-5-FP8.",
    )
    path: str | None = Field(default=None, description="Path inside the pod (defaults to name).")
    served_model_name: str | None = None
    num_layers: int | None = Field(default=None, ge=1, le=1024)
    pvc_name: str | None = Field(
        default=None, description="PersistentVolumeClaim holding the weights, mounted at /models."
    )


class SpeculativeSpec(Spec):
    algorithm: SpeculativeAlgorithm
    draft_model_path: str | None = None
    num_steps: int = Field(default=3, ge=1, le=16)
    eagle_topk: int = Field(default=1, ge=1, le=16)
    num_draft_tokens: int = Field(default=4, ge=1, le=64)


_OWNED_FLAGS_RE = "^(" + "|".join(sorted(c.OWNED_ENGINE_FLAGS)) + ")(=.*)?$"
_RESERVED_ENV = ", ".join(f"'{name}'" for name in sorted(c.RESERVED_ENGINE_ENV))
_RESERVED_PREFIXES = ", ".join(f"'{prefix}'" for prefix in c.RESERVED_ENGINE_ENV_PREFIXES)


class RdmaSpec(Spec):
    """RDMA for KV transfers (mooncake over InfiniBand/RoCE): the device resource the
    cluster's RDMA device plugin offers, and IPC_LOCK for pinned memory. Pods that have it
    are above the "restricted" Pod Security level (their namespace must allow it)."""

    resource: str = Field(
        default="rdma/hca",
        min_length=1,
        max_length=253,
        pattern=r"^([a-z0-9.-]+/)?[A-Za-z0-9._-]+$",
        description="Extended resource name of one RDMA device (the device plugin's).",
    )
    count: int = Field(default=1, ge=1, le=16, description="RDMA devices per engine pod.")


class EngineSpec(Spec):
    model_config = _config(
        cel(
            "!has(self.speculative) || self.speculative.algorithm == 'NEXTN' "
            "|| has(self.speculative.draftModelPath)",
            "speculative.draftModelPath is required for EAGLE and EAGLE3 (NEXTN uses the "
            "model's own MTP layers)",
        ),
        cel(
            f"!has(self.args) || self.args.all(a, !a.matches('{_OWNED_FLAGS_RE}') "
            f"&& !a.startsWith('{c.OWNED_ENGINE_FLAG_PREFIX}'))",
            "engine.args must not set a flag the operator renders from the spec (the model, "
            "ports, PD mode, parallelism, HiCache, speculative decoding, --cas-*): set the "
            "spec field instead",
            ".args",
        ),
        cel(
            f"!has(self.env) || self.env.all(e, !(e.name in [{_RESERVED_ENV}]) "
            f"&& ![{_RESERVED_PREFIXES}].exists(p, e.name.startsWith(p)))",
            "engine.env must not set a variable the operator, the engine layer (cas_engine) or "
            f"LeaderWorkerSet sets or reads ({', '.join(sorted(c.RESERVED_ENGINE_ENV))}, "
            f"{', '.join(p + '*' for p in c.RESERVED_ENGINE_ENV_PREFIXES)}): set the spec "
            "field instead",
            ".env",
        ),
    )

    image: str = Field(default="cas-engine:sglang-v0.5.23", min_length=1)
    version: str = Field(default="0.5.23", description="SGLang version inside the image.")
    args: list[Annotated[str, Field(max_length=c.MAX_ENGINE_ARG_LENGTH)]] | None = Field(
        default=None,
        max_length=c.MAX_ENGINE_ARGS,
        description="Extra SGLang arguments, appended (not the flags the operator renders).",
    )
    env: list[EnvVar] | None = Field(default=None, max_length=c.MAX_ENGINE_ARGS)
    kv_reclaim: KvReclaim = Field(
        default=KvReclaim.STRICT,
        description="Strict: decode reuses an aborted request's KV only after prefill acks.",
    )
    kv_quarantine_rooms: int = Field(
        default=64,
        ge=1,
        le=100_000,
        description="Strict reclaim: how many aborted requests' KV rooms a decode instance may "
        "hold waiting for prefill's safe-to-reclaim answer; past it the pod reports unhealthy "
        "(cas_kv_unhealthy_by_quarantine) and the anomaly loop drains and replaces it.",
    )
    drain_seconds: int = Field(
        default=600,
        ge=0,
        le=86_400,
        description="Most seconds a deleted engine pod waits for its requests in flight to "
        "finish before it stops (its preStop hook; terminationGracePeriodSeconds is this plus "
        "30). Long coding-agent generations run for minutes.",
    )
    shm_size: Quantity = Field(
        default="32Gi",
        description="Size of the pods' /dev/shm (memory-backed; NCCL and the HiCache host "
        "pool use it).",
    )
    rdma: RdmaSpec | None = Field(
        default=None,
        description="Opt in to RDMA devices and IPC_LOCK; without it engine pods meet the "
        '"restricted" Pod Security level.',
    )
    transfer_backend: TransferBackend = TransferBackend.MOONCAKE
    speculative: SpeculativeSpec | None = None


class WorkloadSpec(Spec):
    """Expected traffic: the ratio planner's inputs."""

    avg_input_tokens: int = Field(default=70000, ge=1, le=MAX_TOKENS)
    avg_output_tokens: int = Field(default=600, ge=1, le=MAX_TOKENS)
    prefix_cache_hit_rate: float = Field(default=0.9, ge=0.0, le=1.0)
    request_rate: float | None = Field(
        default=None, ge=0.0, le=MAX_REQUEST_RATE, description="Requests per second."
    )


class SloSpec(Spec):
    ttft_seconds: float = Field(default=4.0, gt=0.0)
    itl_milliseconds: float = Field(default=50.0, gt=0.0)


POOL_RULES = (
    cel(
        "self.tensorParallel <= self.gpusPerNode || self.tensorParallel % self.gpusPerNode == 0",
        "tensorParallel above gpusPerNode must be a multiple of gpusPerNode",
        ".tensorParallel",
    ),
)


class PoolSpec(Spec):
    """Fields shared by the prefill and the decode pool."""

    replicas: int | None = Field(
        default=None, ge=0, le=10000, description="Instances; unset = from ratio / the planner."
    )
    tensor_parallel: int = Field(default=8, ge=1, le=256)
    gpus_per_node: int = Field(default=8, ge=1, le=16)
    resources: Resources | None = None
    node_selector: dict[str, str] | None = None
    tolerations: list[Toleration] | None = None


class PrefillPoolSpec(PoolSpec):
    model_config = _config(
        *POOL_RULES,
        cel(
            "self.tensorParallel % self.contextParallel == 0",
            "contextParallel must divide tensorParallel",
            ".contextParallel",
        ),
        cel(
            "!has(self.layerSplit) || !self.layerSplit || self.contextParallel > 1",
            "layerSplit requires contextParallel > 1",
            ".layerSplit",
        ),
    )

    context_parallel: int = Field(default=1, ge=1, le=64)
    layer_split: bool | None = Field(default=None, description="Default: on when cp > 1.")
    timeout_seconds: int = Field(
        default=60, ge=1, le=3600, description="Prefill time budget before decode aborts."
    )


class DecodePoolSpec(PoolSpec):
    model_config = _config(*POOL_RULES)


class RatioSpec(Spec):
    """P:D ratio. Fixed: replicas from the pools (or prefill:decode here)."""

    model_config = _config(
        cel("!has(self.min) || !has(self.max) || self.min <= self.max", "ratio.min must be <= max"),
        cel(
            "self.mode != 'Auto' || has(self.gpuBudget)",
            AUTO_NEEDS_BUDGET,
            ".gpuBudget",
        ),
    )

    mode: RatioMode = RatioMode.FIXED
    prefill: int = Field(default=1, ge=1, le=10000, description="Prefill instances per unit.")
    decode: int = Field(default=1, ge=1, le=10000, description="Decode instances per unit.")
    min: float | None = Field(default=None, gt=0.0, description="Lowest prefill/decode ratio.")
    max: float | None = Field(default=None, gt=0.0, description="Highest prefill/decode ratio.")
    gpu_budget: int | None = Field(
        default=None, ge=1, le=1_000_000, description="Most GPUs of both pools (Auto: required)."
    )
    scale_down_stabilization_seconds: int = Field(
        default=900,
        ge=0,
        le=86400,
        description="Auto: a pool shrinks only after its lower target held this long.",
    )
    rebalance_stabilization_seconds: int = Field(
        default=300,
        ge=0,
        le=86400,
        description="Auto at gpuBudget: a pool gives up an instance for the other one only "
        "after its lower target held this long.",
    )


class HiCacheSpec(Spec):
    model_config = _config(
        cel(
            "!self.enabled || self.hostMemoryRatio >= 1.0",
            "hicache.hostMemoryRatio must be >= 1.0 when HiCache is enabled",
            ".hostMemoryRatio",
        )
    )

    enabled: bool = False
    host_memory_ratio: float = Field(default=2.0, ge=0.0, le=64.0)
    storage_backend: StorageBackend = StorageBackend.NONE
    write_policy: str = Field(
        default="write_through",
        json_schema_extra={"enum": ["write_through", "write_through_selective", "write_back"]},
    )


class AdmissionSpec(Spec):
    """What the routers admit: the fleet's sustainable request rate, beyond which a request
    is answered 429 at once instead of queueing into a backlog that misses every TTFT."""

    model_config = _config(
        cel(
            "self.mode != 'Fixed' || has(self.requestsPerSecond)",
            "router.admission.requestsPerSecond is required in Fixed mode",
            ".requestsPerSecond",
        ),
    )

    mode: AdmissionMode = Field(
        default=AdmissionMode.AUTO,
        description="Auto: the highest rate at which the planner's model says the pools keep "
        "every queue stable "
        "(models with an instance profile: GLM-5, DeepSeek-V3; none otherwise); Fixed: "
        "requestsPerSecond and burst; Off: no limit.",
    )
    requests_per_second: float | None = Field(
        default=None, gt=0.0, le=MAX_REQUEST_RATE, description="Fixed: the fleet's admission rate."
    )
    burst: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="Fixed: requests admitted at once above the rate (default: 5 s of it).",
    )
    headroom: float = Field(
        default=1.0, ge=0.1, le=10.0, description="Auto: a factor on the planner's capacity."
    )


# What a fleet's routers run when `router.policy` is unset: the best one measured for each
# implementation, replaying real Claude Code sessions through a fleet with 2 prefills and
# 2 router replicas (docs/traffic.md, `make bench-replay`).
DEFAULT_ROUTER_POLICY = {
    RouterImplementation.SGLANG_ROUTER: RouterPolicy.MANUAL,
    RouterImplementation.SMG: RouterPolicy.CONSISTENT_HASHING,
}


class RouterSpec(Spec):
    model_config = _config(
        cel(
            "!has(self.policy) || self.policy != 'consistent_hashing' "
            "|| self.implementation == 'smg'",
            "router.policy consistent_hashing needs router.implementation smg "
            "(sglang-router 0.3.2 has no such policy)",
            ".policy",
        )
    )

    image: str | None = Field(default=None, description="Default: the engine image.")
    replicas: int = Field(
        default=2,
        ge=0,
        le=64,
        description="Router pods per revision, spread over nodes where they can be. With 1, "
        "draining that pod's node refuses new connections until its replacement is Ready.",
    )
    implementation: RouterImplementation = Field(
        default=RouterImplementation.SGLANG_ROUTER,
        description="sglang-router (0.3.2): sheds with a bare 429, and its limit gets a "
        "request back when a response ends: it holds bursts to what the pools hold, not a "
        "sustained overload (docs/planner.md, Admission control). smg (1.13): sheds with 429 "
        "and Retry-After: 2, bounds the requests in flight per router (Auto: what the pools hold "
        "before requests wait for decode KV; Fixed: burst), and serves only requests that "
        "name the served model (model.servedModelName, else model.name). The image must ship "
        "it (docs/architecture.md, The router).",
    )
    policy: RouterPolicy | None = Field(
        default=None,
        description="How the routers pick a prefill and a decode per request. Unset: the best "
        "measured on real coding-agent sessions for the implementation: consistent_hashing "
        "(smg) or manual (sglang-router), both keeping each session on one instance by the "
        "session id the client sends in X-SMG-Routing-Key (smg also reads "
        "X-Claude-Code-Session-Id); a request without one goes to a random instance "
        "(docs/traffic.md). consistent_hashing needs smg.",
    )
    retries: int = Field(
        default=2,
        ge=0,
        le=16,
        description="How many times the router resends a failed request (a 5xx, a quality-gate "
        "trip, a lost connection) before the client sees the error: at most retries + 1 "
        "attempts, each a new prefill and decode. The router (0.3.2) may pick the worker that "
        "just failed again. 0: no retry.",
    )
    resources: Resources | None = None
    admission: AdmissionSpec = Field(default_factory=AdmissionSpec)
    node_selector: dict[str, str] | None = Field(
        default=None, description="Where router pods run (they need no GPU)."
    )
    tolerations: list[Toleration] | None = None

    def effective_policy(self) -> RouterPolicy:
        """`policy`, or the implementation's default (`DEFAULT_ROUTER_POLICY`)."""
        return self.policy or DEFAULT_ROUTER_POLICY[self.implementation]


class NetworkPeer(Spec):
    """Who may connect: pods by labels (in this namespace, or in the namespaces whose labels
    match `namespaceLabels`; `{}` there means every namespace, which only `clientsFrom`
    accepts), or an IP range."""

    model_config = _config(
        cel(
            "has(self.cidr) != (has(self.podLabels) || has(self.namespaceLabels))",
            "a network peer is either cidr or pod/namespace labels",
            "",
        ),
        cel(
            # Kubernetes' CIDR library (CEL, 1.31 and later): Go's netip.ParsePrefix, no
            # IPv4-mapped IPv6; and no bits beyond the prefix length, which a NetworkPolicy's
            # ipBlock.cidr refuses under strict IP/CIDR validation (KEP-4858)
            "!has(self.cidr) || (isCIDR(self.cidr) && cidr(self.cidr) == cidr(self.cidr).masked())",
            "cidr must be an IP range such as 10.0.0.0/8 or fd00::/8 (no bits set beyond the "
            "prefix length, no leading zeros)",
            ".cidr",
        ),
    )

    pod_labels: dict[str, str] | None = Field(default=None, max_length=16)
    namespace_labels: dict[str, str] | None = Field(default=None, max_length=16)
    cidr: str | None = Field(default=None, max_length=64, pattern=r"^[0-9a-fA-F:.]+/[0-9]{1,3}$")


class NetworkPolicySpec(Spec):
    model_config = _config(
        cel(
            "!has(self.metricsFrom) || self.metricsFrom.all(p, "
            "(!has(p.namespaceLabels) || size(p.namespaceLabels) > 0) "
            "&& (!has(p.cidr) || !p.cidr.endsWith('/0')))",
            "a metricsFrom peer must name its namespaces: namespaceLabels {} selects every "
            "namespace and a /0 cidr every address",
            ".metricsFrom",
        ),
    )

    enabled: bool = Field(
        default=True,
        description="NetworkPolicies for the fleet's engine and router pods (your CNI must "
        "enforce NetworkPolicy). false: none, and the operator deletes its own.",
    )
    clients_from: list[NetworkPeer] | None = Field(
        default=None,
        max_length=32,
        description="Who may call the router's serving port. Default: anyone.",
    )
    metrics_from: list[NetworkPeer] | None = Field(
        default=None,
        max_length=32,
        description="Who may scrape the engines' and routers' metrics ports (an engine's is its "
        "serving port); each peer names its namespaces. Default: pods labelled "
        "app.kubernetes.io/name=prometheus in the operator's metrics-scraper namespaces "
        "(cas-operator --metrics-scraper-namespace, the chart's metricsScraperNamespaces); "
        "none set: no scraper.",
    )


class SecuritySpec(Spec):
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)
    keys_secret: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
        description="A Secret in this namespace with the keys `router-control-plane-key` (the "
        "router's /workers API) and `engine-admin-key` (SGLang's admin endpoints). Default: "
        "the operator makes `<name>-keys` with random keys, owned by this resource.",
    )


# Kubernetes' rules for object metadata (k8s.io/apimachinery pkg/util/validation/validation.go
# and pkg/api/validation/objectmeta.go): a key is a qualified name, an optional DNS-1123
# subdomain prefix (at most 253) and "/", then a name of at most 63 (alphanumerics, "-", "_",
# "." inside); annotation keys are checked lowercased (`IsQualifiedName(strings.ToLower(k))`);
# a label value is at most 63 of the same name characters, or empty; all annotations of an
# object together at most 256 KiB (keys and values, in bytes). CEL strings have no "\."
# escape, so a literal dot is "[.]".
_DNS_LABEL = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_NAME_PART = "([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]"
QUALIFIED_NAME = f"^({_DNS_LABEL}([.]{_DNS_LABEL})*/)?{_NAME_PART}$"
# An annotation key's prefix may have capitals (checked lowercased). Both layers check ASCII
# only: a key Go's ToLower brings to ASCII (the Kelvin sign) is refused here, accepted there.
_ANY_CASE_LABEL = "[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?"
ANNOTATION_KEY = f"^({_ANY_CASE_LABEL}([.]{_ANY_CASE_LABEL})*/)?{_NAME_PART}$"
MAX_QUALIFIED_PREFIX = 253
MAX_QUALIFIED_NAME = MAX_QUALIFIED_PREFIX + 1 + 63
LABEL_VALUE = "^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
MAX_LABEL_VALUE = 63
MAX_ANNOTATIONS_BYTES = 256 * 1024
MAX_POD_METADATA_KEYS = 64  # bounds the CEL rules' cost (a map of unknown size is not allowed)


def _qualified(key: str, pattern: str) -> str:
    """CEL: `key` is a qualified name (its prefix, before the one "/", at most 253)."""
    return (
        f"{key}.size() <= {MAX_QUALIFIED_NAME} && {key}.matches('{pattern}') "
        f"&& (!{key}.contains('/') || {key}.indexOf('/') <= {MAX_QUALIFIED_PREFIX})"
    )


LabelValue = Annotated[str, Field(max_length=MAX_LABEL_VALUE, pattern=LABEL_VALUE)]
AnnotationValue = Annotated[str, Field(max_length=MAX_ANNOTATIONS_BYTES)]


class PodMetadata(Spec):
    """Labels and annotations added to every engine and router pod (the operator's own keys
    win; a key it sets or any `cas.dev/` key is dropped, and `status.warnings` says so).
    Keys and values are checked as Kubernetes checks a pod's, at apply."""

    model_config = _config(
        cel(
            f"!has(self.labels) || self.labels.all(k, {_qualified('k', QUALIFIED_NAME)})",
            "podMetadata.labels keys must be qualified names, as Kubernetes requires of a "
            "label key: an optional DNS subdomain prefix and '/', then at most 63 letters, "
            "digits, '-', '_' or '.', starting and ending with a letter or digit "
            "(e.g. 'team' or 'example.com/team')",
            ".labels",
        ),
        cel(
            f"!has(self.annotations) || self.annotations.all(k, {_qualified('k', ANNOTATION_KEY)})",
            "podMetadata.annotations keys must be qualified names, as Kubernetes requires of "
            "an annotation key: an optional DNS subdomain prefix and '/', then at most 63 "
            "letters, digits, '-', '_' or '.', starting and ending with a letter or digit",
            ".annotations",
        ),
        cel(
            "!has(self.annotations) || self.annotations.map(k, bytes(k).size() "
            f"+ bytes(self.annotations[k]).size()).sum() <= {MAX_ANNOTATIONS_BYTES}",
            f"podMetadata.annotations must total at most {MAX_ANNOTATIONS_BYTES} bytes (keys "
            "and values), as Kubernetes requires of an object's annotations",
            ".annotations",
        ),
    )

    labels: dict[str, LabelValue] | None = Field(default=None, max_length=MAX_POD_METADATA_KEYS)
    annotations: dict[str, AnnotationValue] | None = Field(
        default=None, max_length=MAX_POD_METADATA_KEYS
    )


class AnomalyGuardSpec(Spec):
    enabled: bool = True
    min_generated_tokens: int = Field(default=128, ge=1)
    min_accept_length: float = Field(default=1.4, ge=0.0)
    max_accept_rate: float = Field(default=0.96, ge=0.0, le=1.0)
    pod_anomaly_rate_threshold: float = Field(default=0.001, ge=0.0, le=1.0)
    window_seconds: int = Field(default=300, ge=10, le=86400)
    action: GuardAction = GuardAction.REPLACE
    max_draining_percent: int = Field(
        default=25,
        ge=0,
        le=100,
        description="Most of a pool that may be unavailable (draining, not Ready, or missing "
        "from its desired count) for the loop to start another drain.",
    )
    max_replacements_per_hour: int = Field(
        default=6,
        ge=0,
        le=1000,
        description="Most drains the loop starts in any hour, over both pools (kept in "
        "status.anomaly.recentDrains, so a restarted operator keeps counting).",
    )


class CanaryStep(Spec):
    """One canary step: the canary revision gets `weight` percent of requests, then the step
    holds (`pauseSeconds`, one analysis window when absent, or until promoted) while the
    analysis compares it with the stable revision."""

    model_config = _config(
        cel(
            "!(has(self.pauseSeconds) && has(self.pauseUntilPromoted))",
            "a step pauses for pauseSeconds or until promoted, not both",
            ".pauseUntilPromoted",
        ),
    )

    weight: int = Field(ge=0, le=100, description="Percent of requests the canary gets.")
    pause_seconds: int | None = Field(
        default=None,
        ge=0,
        le=7 * 86400,
        description="How long the step holds once its weight is in effect (the analysis runs "
        "throughout; the step ends only on a passing analysis). Absent: one analysis window.",
    )
    pause_until_promoted: bool | None = Field(
        default=None,
        description="Hold at this step until promoted (`kubectl cas rollout promote NAME` or "
        "the annotation cas.dev/rollout-action=promote); a failing analysis still aborts.",
    )


class AnalysisSpec(Spec):
    """How a canary step is judged against the stable revision over `windowSeconds`. A gate
    fails when the canary's count is significantly above its limit (one-sided Poisson test);
    fewer than `minRequests` canary requests, or metrics missing, is inconclusive: the
    rollout pauses, never promotes."""

    window_seconds: int = Field(
        default=120, ge=15, le=3600, description="The analysis window (seconds)."
    )
    min_requests: int = Field(
        default=50,
        ge=1,
        le=1_000_000,
        description="Canary requests the window must hold for a verdict.",
    )
    max_gate_trip_ratio: float = Field(
        default=2.0,
        ge=1.0,
        le=1000.0,
        description="The canary's quality-gate trip rate may be at most this times the "
        "stable revision's (or anomalyGuard.podAnomalyRateThreshold, if higher).",
    )
    max_error_ratio: float = Field(
        default=2.0,
        ge=1.0,
        le=1000.0,
        description="The share of 5xx answers of the canary's routers may be at most this "
        "times the stable routers' (or 1%, if higher).",
    )
    max_kv_transfer_failure_ratio: float = Field(
        default=2.0,
        ge=1.0,
        le=1000.0,
        description="The canary's failed KV transfers and bootstraps per request may be at "
        "most this times the stable revision's (or 0.1%, if higher).",
    )
    max_ttft_ratio: float = Field(
        default=1.5,
        ge=1.0,
        le=100.0,
        description="The canary's TTFT p90 may be at most this times the stable revision's.",
    )
    max_itl_ratio: float = Field(
        default=1.5,
        ge=1.0,
        le=100.0,
        description="The canary's median inter-token latency may be at most this times the "
        "stable revision's.",
    )
    max_anomaly_rate: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="An absolute cap on the canary's quality-gate trip rate.",
    )
    max_ttft_seconds: float | None = Field(
        default=None, gt=0.0, le=3600.0, description="An absolute cap on the canary's TTFT p90."
    )


class RolloutSpec(Spec):
    model_config = _config(
        cel(
            "self.strategy != 'Canary' || (has(self.steps) && size(self.steps) > 0)",
            "rollout.steps must list at least one step for a Canary rollout",
            ".steps",
        ),
    )

    strategy: RolloutStrategy = RolloutStrategy.ROLLING
    steps: list[CanaryStep] | None = Field(default=None, max_length=32)
    analysis: AnalysisSpec = Field(default_factory=AnalysisSpec)
    max_surge_gpus: int | None = Field(
        default=None,
        ge=0,
        le=1_000_000,
        description="Canary: the most GPUs both revisions may use together beyond "
        "ratio.gpuBudget (or beyond the stable pools' size, without a budget; 0 when unset); "
        "the stable pools give up instances (drained first) when the canary needs more. "
        "Without a budget and without this, the canary runs on top of the stable pools.",
    )
    on_operator_upgrade: OperatorUpgradePolicy = Field(
        default=OperatorUpgradePolicy.HOLD,
        description="Hold: a new operator version that renders this spec's engine pods "
        "differently leaves them as they run (status.heldRevision says what it would roll to); "
        "Roll: it rolls them like a spec change.",
    )


DNS_1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


# Gateway API v1.4.0's `Hostname`, the items of an HTTPRoute's spec.hostnames (apis/v1/
# shared_types.go:616-619, the same in its generated CRD): 1 to 253 characters, DNS labels
# with an optional leading "*." wildcard label.
GATEWAY_HOSTNAME = r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
GatewayHostname = Annotated[str, Field(min_length=1, max_length=253, pattern=GATEWAY_HOSTNAME)]


class ParentRef(Spec):
    """A Gateway (Gateway API) the fleet's HTTPRoute attaches to."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_1123_SUBDOMAIN)
    namespace: str | None = Field(default=None, min_length=1, max_length=63, pattern=DNS_1123_LABEL)
    section_name: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=DNS_1123_SUBDOMAIN
    )
    port: int | None = Field(default=None, ge=1, le=65535)


class GatewaySpec(Spec):
    """Serve through a Gateway API implementation: the operator owns the HTTPRoute `<name>`
    attached to `parentRefs`, or sets only the weights of the HTTPRoute you name
    (`httpRoute`: its backendRefs to the Services `<name>-stable` and `<name>-canary`). A
    canary's traffic split is then exact (HTTPRoute weights)."""

    model_config = _config(
        cel(
            "has(self.parentRefs) != has(self.httpRoute)",
            "gateway names parentRefs (an HTTPRoute the operator owns) or httpRoute (yours, "
            "whose weights the operator sets), not both",
            "",
        ),
    )

    parent_refs: list[ParentRef] | None = Field(default=None, min_length=1, max_length=8)
    hostnames: list[GatewayHostname] | None = Field(
        default=None,
        max_length=16,
        description="The HTTPRoute's hostnames, each as the Gateway API requires: a DNS name, "
        "optionally with a leading '*.' wildcard label.",
    )
    http_route: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=DNS_1123_SUBDOMAIN
    )


class CodingAgentServingSpec(Spec):
    """The whole spec. Sections with defaults are defaulted by the API server (default {}).

    The rules here join the model (by name, see DSA_MODELS) with the prefill pool: what SGLang
    0.5.23 refuses, or silently changes, under prefill context parallelism."""

    model_config = _config(
        cel(
            f"!{LAYER_SPLIT_SET} || {IS_DSA}",
            "prefill.layerSplit requires a model with a DSA indexer (GLM-5, DeepSeek-V3.2); "
            "SGLang refuses --enable-dsa-cache-layer-split for other models",
            ".prefill.layerSplit",
        ),
        cel(
            f"!{LAYER_SPLIT_SET} || !has(self.engine) || self.engine.transferBackend == 'mooncake'",
            "prefill.layerSplit requires engine.transferBackend mooncake",
            ".engine.transferBackend",
        ),
        cel(
            f"!{PREFILL_CP} || !{IS_DSA} "
            f"|| self.prefill.tensorParallel <= {MAX_DSA_CP_TENSOR_PARALLEL}",
            f"prefill.tensorParallel must be at most {MAX_DSA_CP_TENSOR_PARALLEL} with "
            "contextParallel > 1 for a DSA model (SGLang runs DSA context parallelism on one "
            "node only)",
            ".prefill.tensorParallel",
        ),
        cel(
            f"!{PREFILL_CP} || !{IS_MLA_WITHOUT_DSA} "
            "|| self.prefill.contextParallel == self.prefill.tensorParallel",
            "prefill.contextParallel must equal tensorParallel for an MLA model without DSA "
            "(DeepSeek-V3/R1, Kimi-K2): SGLang runs one context-parallel rank per GPU",
            ".prefill.contextParallel",
        ),
    )

    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec)
    slo: SloSpec = Field(default_factory=SloSpec)
    prefill: PrefillPoolSpec = Field(default_factory=PrefillPoolSpec)
    decode: DecodePoolSpec = Field(default_factory=DecodePoolSpec)
    ratio: RatioSpec = Field(default_factory=RatioSpec)
    hicache: HiCacheSpec = Field(default_factory=HiCacheSpec)
    router: RouterSpec = Field(default_factory=RouterSpec)
    anomaly_guard: AnomalyGuardSpec = Field(default_factory=AnomalyGuardSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    gateway: GatewaySpec | None = None
    pod_metadata: PodMetadata = Field(default_factory=PodMetadata)
    security: SecuritySpec = Field(default_factory=SecuritySpec)


def parse_spec(raw: dict[str, Any]) -> CodingAgentServingSpec:
    """Parse a live object's spec (camelCase) into the typed model; raises pydantic errors."""
    return CodingAgentServingSpec.model_validate(raw)
