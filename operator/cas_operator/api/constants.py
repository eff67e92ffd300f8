"""Names shared by the operator, its children and its users: API identity, labels, conditions."""

from typing import Final

GROUP: Final = "serving.cas.dev"
VERSION: Final = "v1alpha1"
KIND: Final = "CodingAgentServing"
PLURAL: Final = "codingagentservings"
SINGULAR: Final = "codingagentserving"
SHORT_NAMES: Final = ("cas",)
FIELD_MANAGER: Final = "cas-operator"

# Labels on every child. Never app.kubernetes.io/instance: Argo CD tracks applications by it.
LABEL_APP_NAME: Final = "app.kubernetes.io/name"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_PART_OF: Final = "app.kubernetes.io/part-of"
LABEL_NAME: Final = "cas.dev/name"
LABEL_ROLE: Final = "cas.dev/role"
LABEL_REVISION: Final = "cas.dev/revision"
LABEL_SERVING: Final = "cas.dev/serving"
MANAGED_BY: Final = "cas-operator"
APP_ENGINE: Final = "cas-engine"
APP_ROUTER: Final = "cas-router"

# Annotations.
ANNOTATION_SPEC_HASH: Final = "cas.dev/spec-hash"
ANNOTATION_BOOTSTRAP_PORT: Final = "sglang.ai/bootstrap-port"
# On an older revision's router Deployment: when the entry Service stopped sending to it.
ANNOTATION_RETIRING_SINCE: Final = "cas.dev/retiring-since"

# Prefill pods confirmed gone, per resource: a ConfigMap the operator keeps and decode pods mount
# (cas_operator/prefillgone writes it; cas_engine.kvfence.gone_feed reads the key).
PREFILL_GONE_SUFFIX: Final = "-prefill-gone"
PREFILL_GONE_KEY: Final = "prefills.json"
PREFILL_GONE_PENDING_KEY: Final = "pending-groups.json"  # operator only; decode ignores it
PREFILL_GONE_MOUNT: Final = "/etc/cas/prefill-gone"
APP_PREFILL_GONE: Final = "cas-prefill-gone"

# The fleet's keys Secret (`<name>-keys`, made by the operator unless spec.security.keysSecret
# names one): router and engine pods take their key by secretKeyRef; the operator reads the
# router key by name (its RBAC: get and create on Secrets, never list or watch).
KEYS_SECRET_SUFFIX: Final = "-keys"
KEY_ROUTER_CONTROL_PLANE: Final = "router-control-plane-key"
KEY_ENGINE_ADMIN: Final = "engine-admin-key"
ENV_ROUTER_CONTROL_PLANE_KEY: Final = "CAS_ROUTER_CONTROL_PLANE_KEY"
ENV_ENGINE_ADMIN_KEY: Final = "CAS_ENGINE_ADMIN_KEY"
APP_KEYS: Final = "cas-keys"
# The keys a revision's pods run with: a copy of the keys Secret per version of its content
# (`<name>-keys-<version>`, immutable), which pods take their keys from; the version is a label
# of the revision's workloads and router pods, so the operator asks each router with its key.
LABEL_KEYS: Final = "cas.dev/keys"
APP_KEYS_COPY: Final = "cas-keys-copy"


def keys_copy_name(name: str, version: str) -> str:
    """The Secret holding version `version` of resource `name`'s keys."""
    return f"{name}{KEYS_SECRET_SUFFIX}-{version}"


ROUTER_KEY_ID: Final = "cas-operator"  # id and name of the router's one control-plane key

ROLE_PREFILL: Final = "prefill"
ROLE_DECODE: Final = "decode"
ROLE_ROUTER: Final = "router"
POOL_ROLES: Final = (ROLE_PREFILL, ROLE_DECODE)  # the engine pools, in that order

# Ports the engine and the router listen on inside their pods.
ENGINE_PORT: Final = 30000
BOOTSTRAP_PORT: Final = 8998
DIST_INIT_PORT: Final = 20000
ROUTER_PORT: Final = 8000
ROUTER_METRICS_PORT: Final = 29000

# How long a check of an engine's /health may take (kubelet probes and the routers' checks).
# SGLang's /health runs a one-token generation, looks for the scheduler's answer first after a
# second and gives up with 503 after SGLANG_HEALTH_CHECK_TIMEOUT, 20 s (sglang 0.5.23
# srt/entrypoints/http_server.py:218 and 777-796): a healthy engine never answers within the
# kubelet's default 1 s, and a busy one may take seconds. Waiting past 20 s takes SGLang's verdict.
ENGINE_HEALTH_TIMEOUT_SECONDS: Final = 25

# Condition types and reasons (Kubernetes conventions: CamelCase reasons).
COND_READY: Final = "Ready"
COND_PROGRESSING: Final = "Progressing"
COND_DEGRADED: Final = "Degraded"
COND_ANOMALY_SIGNAL: Final = "AnomalySignalAvailable"

REASON_INVALID_SPEC: Final = "InvalidSpec"
REASON_LWS_MISSING: Final = "LeaderWorkerSetNotInstalled"
REASON_APPLY_FAILED: Final = "ApplyFailed"
REASON_NOT_OWNED: Final = "ChildNotOwned"  # an object under a child's name is someone else's
REASON_KEYS_SECRET: Final = "KeysSecretUnusable"
REASON_ALL_READY: Final = "AllPoolsReady"
REASON_WAITING: Final = "WaitingForPools"
REASON_ROLLING: Final = "RollingOutRevision"
REASON_RECONCILED: Final = "Reconciled"
REASON_AS_EXPECTED: Final = "AsExpected"
REASON_FLEET_ANOMALY: Final = "FleetWideAnomaly"
REASON_SIGNAL_UNAVAILABLE: Final = "AnomalySignalUnavailable"
REASON_NOT_OBSERVED: Final = "NotObservedYet"
REASON_OPERATOR_UPGRADE_HELD: Final = "OperatorUpgradeHeld"
REASON_SPEC_WARNING: Final = "SpecWarning"
REASON_INVALID_ROUTE: Final = "HTTPRouteUnusable"  # gateway.httpRoute lacks our backendRefs
REASON_CANARY: Final = "CanaryProgressing"
REASON_ROLLOUT_PAUSED: Final = "RolloutPaused"
REASON_PROMOTING: Final = "CanaryPromoting"
REASON_ROLLOUT_ABORTED: Final = "RolloutAborted"
# On the resource: a user's rollout command (promote, skip, abort, retry), consumed once.
ANNOTATION_ROLLOUT_ACTION: Final = "cas.dev/rollout-action"

LWS_API_VERSION: Final = "leaderworkerset.x-k8s.io/v1"
LWS_WORKER_INDEX_LABEL: Final = "leaderworkerset.sigs.k8s.io/worker-index"  # set by LWS; 0 = leader
LWS_GROUP_INDEX_LABEL: Final = "leaderworkerset.sigs.k8s.io/group-index"  # set by LWS on every pod
# The ReplicaSet controller removes the pods with the lowest cost first on a scale-down.
ANNOTATION_POD_DELETION_COST: Final = "controller.kubernetes.io/pod-deletion-cost"
LOWEST_DELETION_COST: Final = str(-(2**31))  # an int32, as the controller parses it


# Engine flags and env the operator renders from the spec's fields (desired.resources.
# engine_args): `engine.args` / `engine.env` may not set them. The flags are every option
# string SGLang 0.5.23's parser has for the settings rendered (aliases included; SGLang's
# parser also takes unambiguous abbreviations, which validate refuses too);
# tests/engine/test_engine_contract_sglang.py checks both against SGLang's own parser.
OWNED_ENGINE_FLAGS: Final = frozenset(
    {
        "--admin-api-key",
        "--attention-context-parallel-size",
        "--attn-cp-size",
        "--cp-strategy",
        "--disaggregation-bootstrap-port",
        "--disaggregation-mode",
        "--disaggregation-transfer-backend",
        "--dist-init-addr",
        "--enable-dsa-cache-layer-split",
        "--enable-hicache",
        "--enable-hierarchical-cache",
        "--enable-metrics",
        "--enable-prefill-cp",
        "--hicache-ratio",
        "--hicache-storage-backend",
        "--hicache-write-policy",
        "--host",
        "--model",
        "--model-path",
        "--nccl-init-addr",
        "--nnodes",
        "--node-rank",
        "--port",
        "--served-model-name",
        "--speculative-algorithm",
        "--speculative-draft-model",
        "--speculative-draft-model-path",
        "--speculative-eagle-topk",
        "--speculative-num-draft-tokens",
        "--speculative-num-steps",
        "--tensor-parallel-size",
        "--tp-size",
    }
)
OWNED_ENGINE_FLAG_PREFIX: Final = "--cas-"  # the launcher's own flags, all rendered
OWNED_ENGINE_ENV: Final = frozenset(
    {
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT",
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT",
        "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE",
        "HOME",  # the non-root user's writable home (desired/resources/security.py)
        ENV_ENGINE_ADMIN_KEY,  # SGLang's --admin-api-key, from the keys Secret
    }
)
OWNED_ENGINE_ENV_PREFIX: Final = "LWS_"  # LeaderWorkerSet injects these into every container
# The engine layer's own variables (cas_engine in the engine pods): its launcher's and plugin's
# configuration, which the operator renders as `--cas-*` flags or leaves at the safe default
# (flags > env > default: `CAS_HICACHE_CHECK=off` would skip the HiCache load-use check,
# `CAS_KV_RECLAIM=upstream` the strict reclaim of a pool without flags, `CAS_ENGINE_PATCHES`
# every patch), the guard's `CAS_GUARD_*`, and what the launcher sets or checks for SGLang
# (`SGLANG_PLUGINS`: which plugins load, ours included; `SGLANG_USE_PICKLE_IPC`: false makes
# the launcher refuse to start with the gate on; `PROMETHEUS_MULTIPROC_DIR`: launch_server.py).
# `engine.env` may not set them; tests/unit/test_engine_layer_env.py derives the set from
# cas_engine's source (engine/cas_engine/launch.py, launch_server.py, guard/config.py).
ENGINE_LAYER_ENV: Final = frozenset(
    {
        "CAS_ENGINE_PATCHES",
        "CAS_HICACHE_CHECK",
        "CAS_HICACHE_DETECTOR",
        "CAS_KV_QUARANTINE_ROOMS",
        "CAS_KV_RECLAIM",
        "CAS_PREFILL_GONE_FILE",
        "PROMETHEUS_MULTIPROC_DIR",
        "SGLANG_PLUGINS",
        "SGLANG_USE_PICKLE_IPC",
    }
)
ENGINE_LAYER_ENV_PREFIX: Final = "CAS_GUARD_"  # GuardConfig.from_env: CAS_GUARD_<FIELD>
# Everything `engine.env` may not set: the CRD's CEL rule and desired.validate read these.
RESERVED_ENGINE_ENV: Final = OWNED_ENGINE_ENV | ENGINE_LAYER_ENV
RESERVED_ENGINE_ENV_PREFIXES: Final = (OWNED_ENGINE_ENV_PREFIX, ENGINE_LAYER_ENV_PREFIX)
MAX_ENGINE_ARGS: Final = 128
MAX_ENGINE_ARG_LENGTH: Final = 1024

# "namespace/name" of the Lease the operator holds while it acts (`--leader-elect`).
LEADER_ELECTION_ENV: Final = "CAS_LEADER_ELECTION"
