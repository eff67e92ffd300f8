"""Engine pools: pod template, Deployment (single-node instances) or LeaderWorkerSet (multi-node),
a headless Service and a PodDisruptionBudget per pool and revision."""

from __future__ import annotations

from typing import Any

from cas_operator.api import constants as c
from cas_operator.api.models import KvReclaim
from cas_operator.desired.plan import Plan, PoolPlan
from cas_operator.desired.resources.engine_args import LAUNCHER, engine_args, engine_env
from cas_operator.desired.resources.meta import (
    Manifest,
    Owner,
    base_labels,
    metadata,
    selector_labels,
    with_user_keys,
)
from cas_operator.desired.resources.security import (
    HOME,
    container_security,
    keys_labels,
    pod_security,
    rdma_resources,
)

GPU_RESOURCE = "nvidia.com/gpu"
PRESTOP = ["python3", "-m", "cas_engine.prestop"]
SHUTDOWN_MARGIN_S = 30  # after the preStop: SGLang's own shutdown on SIGTERM
STARTUP_SECONDS = 1800  # weight loading and CUDA graph capture of a large model


def pool_spec(plan: Plan, pool: PoolPlan) -> Any:
    return plan.spec.prefill if pool.role == c.ROLE_PREFILL else plan.spec.decode


def pod_labels(plan: Plan, pool: PoolPlan, *, serving: bool) -> dict[str, str]:
    labels = {
        **base_labels(plan.name, c.APP_ENGINE, pool.role),
        **selector_labels(plan.name, pool.role, plan.revision),
    }
    if serving:
        labels[c.LABEL_SERVING] = "true"
    return labels


def pool_labels(plan: Plan, pool: PoolPlan) -> dict[str, str]:
    """Labels of the pool's own objects (not pods): revision included so stale ones are found,
    and the keys version its pods run with (the retire step deletes a copy nothing runs)."""
    labels = base_labels(plan.name, c.APP_ENGINE, pool.role)
    return {**labels, c.LABEL_REVISION: plan.revision, **keys_labels(plan)}


def _resources(plan: Plan, pool: PoolPlan) -> dict[str, Any]:
    gpus = str(pool.shape.gpus_per_pod)
    user = pool_spec(plan, pool).resources
    rdma = rdma_resources(plan)
    requests = {**((user.requests or {}) if user else {}), GPU_RESOURCE: gpus, **rdma}
    limits = {**((user.limits or {}) if user else {}), GPU_RESOURCE: gpus, **rdma}
    return {"requests": requests, "limits": limits}


def _probes(*, serving: bool) -> dict[str, Any]:
    if not serving:
        return {}
    # every probe waits for SGLang's own answer (ENGINE_HEALTH_TIMEOUT_SECONDS): with the
    # kubelet's default timeout of 1 s a healthy SGLang fails them all and never starts
    http = {"httpGet": {"path": "/health", "port": "http"},
            "timeoutSeconds": c.ENGINE_HEALTH_TIMEOUT_SECONDS}  # fmt: skip
    return {
        "startupProbe": {**http, "periodSeconds": 10, "failureThreshold": STARTUP_SECONDS // 10},
        "readinessProbe": {**http, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**http, "periodSeconds": 15, "failureThreshold": 8},
    }


def _lifecycle(plan: Plan, *, serving: bool) -> dict[str, Any]:
    """A deleted pod first waits for its requests in flight (cas_engine.prestop). An LWS
    worker has no server: it waits on its leader, which needs the worker for every request
    (exec hooks get no $(VAR) expansion, hence the shell for LWS_LEADER_ADDRESS)."""
    grace = str(plan.spec.engine.drain_seconds)
    if serving:
        command = [*PRESTOP, "--port", str(c.ENGINE_PORT), "--grace", grace]
    else:
        line = " ".join([*PRESTOP, '--host "$LWS_LEADER_ADDRESS"', "--port", str(c.ENGINE_PORT)])
        command = ["sh", "-c", f"exec {line} --grace {grace}"]
    return {"preStop": {"exec": {"command": command}}}


def _ports(pool: PoolPlan) -> list[dict[str, Any]]:
    ports = [{"name": "http", "containerPort": c.ENGINE_PORT}]
    if pool.role == c.ROLE_PREFILL:
        ports.append({"name": "bootstrap", "containerPort": c.BOOTSTRAP_PORT})
    if pool.shape.multi_node:
        ports.append({"name": "dist-init", "containerPort": c.DIST_INIT_PORT})
    return ports


def prefill_gone_name(cas_name: str) -> str:
    """The ConfigMap of a resource's prefill pods confirmed gone (cas_operator/prefillgone)."""
    return f"{cas_name}{c.PREFILL_GONE_SUFFIX}"


def _prefill_gone_volume(plan: Plan) -> tuple[dict[str, Any], dict[str, Any]]:
    """Decode reads which prefill pods are gone for good (strict reclaim frees their rooms).
    Optional: the operator creates it at the first confirmed end; the kubelet projects it then."""
    volume = {
        "name": "prefill-gone",
        "configMap": {"name": prefill_gone_name(plan.name), "optional": True},
    }
    return volume, {"name": "prefill-gone", "mountPath": c.PREFILL_GONE_MOUNT, "readOnly": True}


def _volumes(plan: Plan, pool: PoolPlan) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    shm = {"medium": "Memory", "sizeLimit": plan.spec.engine.shm_size}
    volumes: list[dict[str, Any]] = [
        {"name": "shm", "emptyDir": shm},
        {"name": "tmp", "emptyDir": {}},  # $HOME and /tmp of a non-root user
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": HOME},
    ]
    if plan.spec.model.pvc_name:
        volumes.append(
            {"name": "models", "persistentVolumeClaim": {"claimName": plan.spec.model.pvc_name}}
        )
        mounts.append({"name": "models", "mountPath": "/models", "readOnly": True})
    if pool.role == c.ROLE_DECODE and plan.spec.engine.kv_reclaim == KvReclaim.STRICT:
        volume, mount = _prefill_gone_volume(plan)
        volumes.append(volume)
        mounts.append(mount)
    return volumes, mounts


def pod_template(plan: Plan, pool: PoolPlan, *, serving: bool = True) -> Manifest:
    """The engine pod. `serving=False` is an LWS worker: no HTTP server, no router label."""
    volumes, mounts = _volumes(plan, pool)
    container = {
        "name": "engine",
        "image": plan.spec.engine.image,
        "command": LAUNCHER,
        "args": engine_args(plan, pool),
        "env": [{"name": "HOME", "value": HOME}, *engine_env(plan)],
        "ports": _ports(pool),
        "resources": _resources(plan, pool),
        "volumeMounts": mounts,
        "lifecycle": _lifecycle(plan, serving=serving),
        "securityContext": container_security(plan),
        **_probes(serving=serving),
    }
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(c.ENGINE_PORT)}
    if pool.role == c.ROLE_PREFILL:
        annotations[c.ANNOTATION_BOOTSTRAP_PORT] = str(c.BOOTSTRAP_PORT)
    spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "securityContext": pod_security(),
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": plan.spec.engine.drain_seconds + SHUTDOWN_MARGIN_S,
    }
    pool_cfg = pool_spec(plan, pool)
    if pool_cfg.node_selector:
        spec["nodeSelector"] = dict(pool_cfg.node_selector)
    if pool_cfg.tolerations:
        spec["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in pool_cfg.tolerations
        ]
    user = plan.spec.pod_metadata
    return {
        "metadata": {
            "labels": with_user_keys(
                pod_labels(plan, pool, serving=serving), user.labels, "labels"
            ),
            "annotations": with_user_keys(annotations, user.annotations, "annotations"),
        },
        "spec": spec,
    }


def pod_templates(plan: Plan, pool: PoolPlan) -> list[Manifest]:
    """Every pod template of the pool: the serving pod, and an LWS group's worker pod."""
    if pool.shape.multi_node:
        return [pod_template(plan, pool), pod_template(plan, pool, serving=False)]
    return [pod_template(plan, pool)]


def build_deployment(owner: Owner, plan: Plan, pool: PoolPlan) -> Manifest:
    """Single-node instances: one pod each."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(owner, pool.workload_name, pool_labels(plan, pool)),
        "spec": {
            "replicas": pool.replicas,
            "selector": {"matchLabels": selector_labels(plan.name, pool.role, plan.revision)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
            },
            "template": pod_template(plan, pool),
        },
    }


def build_leaderworkerset(owner: Owner, plan: Plan, pool: PoolPlan) -> Manifest:
    """Multi-node instances: one LWS group of `nodes` pods each; only the leader serves."""
    leader, worker = pod_templates(plan, pool)
    return {
        "apiVersion": c.LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": metadata(owner, pool.workload_name, pool_labels(plan, pool)),
        "spec": {
            "replicas": pool.replicas,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": pool.shape.nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }


def build_workload(owner: Owner, plan: Plan, pool: PoolPlan) -> Manifest:
    if pool.shape.multi_node:
        return build_leaderworkerset(owner, plan, pool)
    return build_deployment(owner, plan, pool)


def build_pool_service(owner: Owner, plan: Plan, pool: PoolPlan) -> Manifest:
    """Headless Service: stable DNS for the pool's pods (metrics, debugging, bootstrap)."""
    ports = [{"name": p["name"], "port": p["containerPort"]} for p in _ports(pool)]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner, pool.workload_name, pool_labels(plan, pool)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(plan.name, pool.role, plan.revision),
            "ports": ports,
        },
    }


def build_pdb(owner: Owner, plan: Plan, pool: PoolPlan) -> Manifest:
    """At most one instance of a pool voluntarily disrupted at a time (an LWS group's pods
    carry the pool's labels, so a node drain takes one group's leader or worker at a time)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(owner, pool.workload_name, pool_labels(plan, pool)),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(plan.name, pool.role, plan.revision)},
        },
    }
