"""The SGLang router in PD mode: per-revision Deployment discovering its revision's pods by label,
a stable Service for clients across revisions, and the RBAC its Kubernetes discovery needs."""

from __future__ import annotations

from typing import Any

from cas_operator.api import constants as c
from cas_operator.api.models import KEYED_POLICIES, RouterImplementation, RouterPolicy
from cas_operator.desired.admission import admission_for
from cas_operator.desired.plan import Plan
from cas_operator.desired.resources.meta import (
    Manifest,
    Owner,
    base_labels,
    metadata,
    selector_labels,
    with_user_keys,
)
from cas_operator.desired.resources.security import (
    container_security,
    key_env,
    keys_labels,
    pod_security,
    router_control_plane_keys,
)

# The router each implementation runs; both take the flags `router_args` renders
# (docs/results/smg-1.13-evaluation.md: every one parses unchanged in smg 1.13).
ROUTER_COMMANDS = {
    RouterImplementation.SGLANG_ROUTER: ["python3", "-m", "sglang_router.launch_router"],
    RouterImplementation.SMG: ["python3", "-m", "smg.launch_router"],
}
# The headers smg reads a session's routing key from (first present wins): its own, and the
# session id Claude Code sends on every request (one UUID per session, since 2.1.86).
# sglang-router 0.3.2 reads only X-SMG-Routing-Key and has no flag for more.
ROUTING_KEY_HEADERS = ("x-smg-routing-key", "x-claude-code-session-id")
# A deleted router pod keeps accepting this long before SIGTERM: the time for its endpoint to
# leave the entry Service everywhere (kube-proxy syncs at most once a second by default).
ROUTER_ENDPOINT_SETTLE_SECONDS = 5
# A router pod is Ready once it can route: both routers answer `/readiness` 503 ("insufficient
# healthy workers") until their discovery holds a healthy prefill AND decode, and 200 after,
# while `/health` is 200 as soon as they listen (measured with sglang-router 0.3.2 and smg
# 1.13 in PD mode: e2e/tests/test_router_readiness.py). Probed on `/health`, a new router (a
# roll, a scale-up, a drained node's replacement) joined the entry Service before it had any
# worker and answered its first requests 503.
ROUTER_READINESS_PATH = "/readiness"


def discovery_selector(plan: Plan, role: str) -> list[str]:
    """Pods of this role AND revision that are in rotation (drains remove `serving`)."""
    labels = {**selector_labels(plan.name, role, plan.revision), c.LABEL_SERVING: "true"}
    return [f"{k}={v}" for k, v in labels.items()]


def router_args(plan: Plan) -> list[str]:
    router = plan.spec.router
    args = [
        "--host",
        "0.0.0.0",
        "--port",
        str(c.ROUTER_PORT),
        "--pd-disaggregation",
        "--service-discovery",
        "--service-discovery-namespace",
        plan.namespace,
        "--service-discovery-port",
        str(c.ENGINE_PORT),
        "--prefill-selector",
        *discovery_selector(plan, c.ROLE_PREFILL),
        "--decode-selector",
        *discovery_selector(plan, c.ROLE_DECODE),
        *policy_args(plan),
        "--prometheus-host",
        "0.0.0.0",
        "--prometheus-port",
        str(c.ROUTER_METRICS_PORT),
        # /workers and /flush_cache refuse a request without this key (401)
        "--control-plane-api-keys",
        router_control_plane_keys(c.ENV_ROUTER_CONTROL_PLANE_KEY),
    ]
    args += admission_args(plan) + health_check_args()
    if router.retries == 0:
        return [*args, "--disable-retries"]
    # the router's "max retries" counts attempts: 1 is no retry (its --disable-retries help)
    return [*args, "--retry-max-retries", str(router.retries + 1)]


def policy_args(plan: Plan) -> list[str]:
    """The routing policy (`RouterSpec.effective_policy`). A keyed policy keeps a session on
    its prefill, where its prefix is cached; decodes hold no prefix, so they go round robin: a
    retry (a quality-gate trip's 503) then reaches another decode, where a keyed decode policy
    sent it back to the one that failed (one of two decodes failing every answer, 20 requests
    of 4 sessions, 4 attempts each: 3 failed with either router keyed on both sides, none
    with round robin decodes). On smg it reads the session key from `ROUTING_KEY_HEADERS`."""
    router = plan.spec.router
    policy = router.effective_policy()
    args = ["--policy", policy.value]
    if policy in KEYED_POLICIES:
        args += ["--decode-policy", RouterPolicy.ROUND_ROBIN.value]
        if router.implementation == RouterImplementation.SMG:
            args += ["--routing-key-headers", *ROUTING_KEY_HEADERS]
    return args


def admission_args(plan: Plan) -> list[str]:
    """Each router's token bucket (`desired.admission`: `Admission.limits` says what each
    implementation gets and why), 429 at once beyond it. With no limit, smg is told so (its
    default is a bound derived from the host)."""
    implementation = plan.spec.router.implementation
    admission = admission_for(plan)
    if admission is None:
        return (
            ["--max-concurrent-requests", "0"] if implementation == RouterImplementation.SMG else []
        )
    mine = admission.limits(implementation)
    return [
        "--rate-limit-tokens-per-second",
        str(mine.refill),
        "--max-concurrent-requests",
        str(mine.size),
        "--queue-size",
        "0",
    ]


# The routers' own check of each worker. Their discovery adds a pod when it turns Ready but
# drops it only when it is deleted, so a worker whose process died (a crash, an OOM kill) stays
# in rotation until these checks fail: by default every 60 s, three in a row. Meanwhile each
# request paired with a dead decode waits for its prefill's bootstrap timeout (300 s in SGLang
# 0.5.23, SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT in srt/environ.py) before the retry, and the
# failures count against the healthy prefill's circuit breaker too. A refused connection fails
# at once, so a dead worker leaves after about interval x threshold; a live one is judged by
# SGLang's own /health (c.ENGINE_HEALTH_TIMEOUT_SECONDS), so a busy engine is not dropped.
HEALTH_CHECK_INTERVAL_SECONDS = 5
HEALTH_FAILURE_THRESHOLD = 2


def health_check_args() -> list[str]:
    return [
        "--health-check-interval-secs",
        str(HEALTH_CHECK_INTERVAL_SECONDS),
        "--health-failure-threshold",
        str(HEALTH_FAILURE_THRESHOLD),
        "--health-check-timeout-secs",
        str(c.ENGINE_HEALTH_TIMEOUT_SECONDS),
    ]


def service_account_name(plan: Plan) -> str:
    return f"{plan.name}-router"


def _router_labels(plan: Plan) -> dict[str, str]:
    return base_labels(plan.name, c.APP_ROUTER, c.ROLE_ROUTER)


def build_router_deployment(owner: Owner, plan: Plan) -> Manifest:
    router = plan.spec.router
    # the keys version: the operator asks each router pod with the key it started with
    labels = {**_router_labels(plan), c.LABEL_REVISION: plan.revision, **keys_labels(plan)}
    container: dict[str, Any] = {
        "name": "router",
        "image": router.image or plan.spec.engine.image,
        "command": ROUTER_COMMANDS[router.implementation],
        "args": router_args(plan),
        "env": [key_env(plan, c.ENV_ROUTER_CONTROL_PLANE_KEY, c.KEY_ROUTER_CONTROL_PLANE)],
        "ports": [
            {"name": "http", "containerPort": c.ROUTER_PORT},
            {"name": "metrics", "containerPort": c.ROUTER_METRICS_PORT},
        ],
        "readinessProbe": {
            "httpGet": {"path": ROUTER_READINESS_PATH, "port": "http"},
            "periodSeconds": 5,
        },
        "livenessProbe": {
            "httpGet": {"path": "/liveness", "port": "http"},
            "periodSeconds": 15,
            "failureThreshold": 4,
        },
        "securityContext": container_security(),
        "lifecycle": {"preStop": {"sleep": {"seconds": ROUTER_ENDPOINT_SETTLE_SECONDS}}},
    }
    if router.resources:
        container["resources"] = router.resources.model_dump(by_alias=True, exclude_none=True)
    user = plan.spec.pod_metadata
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(c.ROUTER_METRICS_PORT)}
    selector = selector_labels(plan.name, c.ROLE_ROUTER, plan.revision)
    placement: dict[str, Any] = {
        # one node's drain or failure takes one router, not all: its PDB lets the drain evict
        # the next only once a replacement serves
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "labelSelector": {"matchLabels": selector},
                            "topologyKey": "kubernetes.io/hostname",
                        },
                    }
                ]
            }
        }
    }
    if router.node_selector:
        placement["nodeSelector"] = dict(router.node_selector)
    if router.tolerations:
        placement["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in router.tolerations
        ]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(owner, plan.router_name, labels),
        "spec": {
            "replicas": plan.router_replicas,
            "selector": {"matchLabels": selector_labels(plan.name, c.ROLE_ROUTER, plan.revision)},
            "template": {
                "metadata": {
                    "labels": with_user_keys(labels, user.labels, "labels"),
                    "annotations": with_user_keys(annotations, user.annotations, "annotations"),
                },
                "spec": {
                    "serviceAccountName": service_account_name(plan),
                    "securityContext": pod_security(),
                    # SIGTERM: it stops accepting and finishes what it proxies (measured with
                    # sglang-router 0.3.2); long generations need the engines' grace. The
                    # preStop sleep comes first: a deleted pod's endpoint leaves the Service
                    # (EndpointSlice, then every kube-proxy and gateway) only after a moment,
                    # and a router that stopped accepting at once refused what still came.
                    "terminationGracePeriodSeconds": plan.spec.engine.drain_seconds
                    + 30
                    + ROUTER_ENDPOINT_SETTLE_SECONDS,
                    "containers": [container],
                    **placement,
                },
            },
        },
    }


def build_router_pdb(owner: Owner, plan: Plan) -> Manifest:
    """At most one router pod of the revision voluntarily disrupted at a time."""
    labels = {**_router_labels(plan), c.LABEL_REVISION: plan.revision}
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(owner, plan.router_name, labels),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(plan.name, c.ROLE_ROUTER, plan.revision)},
        },
    }


def build_router_service(owner: Owner, plan: Plan) -> Manifest:
    """The fleet's entry point, named after the resource: the revision's routers (during a
    roll the reconcile points it at the revision that serves: `reconcile.core.point_entry`)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner, plan.name, _router_labels(plan)),
        "spec": {
            "selector": selector_labels(plan.name, c.ROLE_ROUTER, plan.revision),
            "ports": [
                {"name": "http", "port": 80, "targetPort": "http"},
                {"name": "metrics", "port": c.ROUTER_METRICS_PORT, "targetPort": "metrics"},
            ],
        },
    }


def build_service_account(owner: Owner, plan: Plan) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(owner, service_account_name(plan), _router_labels(plan)),
    }


def build_role(owner: Owner, plan: Plan) -> Manifest:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": metadata(owner, service_account_name(plan), _router_labels(plan)),
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
    }


def build_role_binding(owner: Owner, plan: Plan) -> Manifest:
    name = service_account_name(plan)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": metadata(owner, name, _router_labels(plan)),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": plan.namespace}],
    }
