"""Pod security of the fleet's pods: the "restricted" Pod Security level by default.

Engine and router pods run as a non-root user (uid/gid 1000, whatever the image's USER), with
no privilege escalation, every capability dropped and the runtime's default seccomp profile;
engine pods get no service-account token (they never call the API; the router does, for its
pod discovery). `engine.rdma` is the one opt-out: it adds IPC_LOCK (pinned memory for RDMA)
and the RDMA device resource, which "restricted" (and "baseline") refuse, so such a fleet
needs a namespace that allows privileged pods. Engines write caches under $HOME, which is a
memory-backed emptyDir at /tmp (a non-root user cannot write the image's /root).

Keys: each fleet has a Secret with a router control-plane key (the router's `/workers` and
`/flush_cache`; sglang-router 0.3.2 `--control-plane-api-keys`) and an engine admin key
(SGLang 0.5.23 `--admin-api-key`: srt/utils/auth.py:119-141 refuses the admin endpoints,
weight updates, abort, flush, profiling, without it; /health and /metrics stay open). The
operator makes the Secret once (`build_keys_secret`, random keys) unless the user names one.
Pods never take their keys from that Secret but from an immutable copy of one version of its
content (`build_keys_copy`, `<name>-keys-<version>`, the version a hash of the keys and the
resource's uid): a new or replaced Secret is a new version, so a new pod template, so a new
revision of routers and engines together, while the old revision keeps running with the copy
its pods started with (and the operator asks its routers with that key). Pods get the keys
by secretKeyRef: the router in `$(VAR)` in its args (it reads them from nowhere else), the
engine in its environment only (`--cas-admin-key-env`), so a pod spec never holds a key.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from cas_operator.api import constants as c
from cas_operator.api.models import SecuritySpec
from cas_operator.desired.plan import Plan
from cas_operator.desired.resources.meta import (
    Manifest,
    Owner,
    base_labels,
    metadata,
    stable_hash,
)

RUN_AS: Final = 1000
HOME: Final = "/tmp"


def pod_security() -> dict[str, Any]:
    """The pod-level securityContext of every engine and router pod."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security(plan: Plan | None = None) -> dict[str, Any]:
    """A container's securityContext; an engine's with `engine.rdma` keeps IPC_LOCK."""
    capabilities: dict[str, Any] = {"drop": ["ALL"]}
    if plan is not None and plan.spec.engine.rdma is not None:
        capabilities["add"] = ["IPC_LOCK"]
    return {"allowPrivilegeEscalation": False, "capabilities": capabilities}


def rdma_resources(plan: Plan) -> dict[str, str]:
    """The RDMA device resource an engine pod requests (none without `engine.rdma`)."""
    rdma = plan.spec.engine.rdma
    return {rdma.resource: str(rdma.count)} if rdma is not None else {}


def keys_secret_name(name: str, security: SecuritySpec) -> str:
    """The Secret resource `name`'s keys come from: the user's, or the one the operator makes."""
    return security.keys_secret or f"{name}{c.KEYS_SECRET_SUFFIX}"


KEYS: Final = (c.KEY_ROUTER_CONTROL_PLANE, c.KEY_ENGINE_ADMIN)
KEYS_VERSION_LENGTH: Final = 10


def keys_version(uid: str, keys: Mapping[str, str]) -> str:
    """The version of a keys Secret's content: a hash of both keys and the resource's uid
    (another fleet with the same keys gets another version)."""
    return stable_hash(
        {"uid": uid, "keys": {k: keys.get(k, "") for k in KEYS}}, KEYS_VERSION_LENGTH
    )


def pods_keys_secret(plan: Plan) -> str:
    """The Secret the plan's pods take their keys from: the copy of its keys version."""
    if not plan.keys_version:
        return keys_secret_name(plan.name, plan.spec.security)
    return c.keys_copy_name(plan.name, plan.keys_version)


def keys_labels(plan: Plan) -> dict[str, str]:
    """The keys-version label of the plan's workloads and router pods (none before one)."""
    return {c.LABEL_KEYS: plan.keys_version} if plan.keys_version else {}


def key_env(plan: Plan, var: str, key: str) -> dict[str, Any]:
    """An env var holding one key of the plan's keys (the pod does not start without it)."""
    return {
        "name": var,
        "valueFrom": {"secretKeyRef": {"name": pods_keys_secret(plan), "key": key}},
    }


def router_control_plane_keys(var: str) -> str:
    """The router's one control-plane key, `id:name:role:key`, the key from env var `var`."""
    return f"{c.ROUTER_KEY_ID}:{c.ROUTER_KEY_ID}:admin:$({var})"


def build_keys_secret(owner: Owner, new_key: Callable[[], str]) -> Manifest:
    """The operator-made keys Secret `<name>-keys` (created when missing, never updated: its
    keys are random)."""
    data = {k: new_key() for k in KEYS}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": metadata(
            owner,
            f"{owner.name}{c.KEYS_SECRET_SUFFIX}",
            base_labels(owner.name, c.APP_KEYS),
        ),
        "stringData": data,
    }


def build_keys_copy(owner: Owner, version: str, keys: Mapping[str, str]) -> Manifest:
    """The immutable copy of one version of the fleet's keys, which pods take them from."""
    labels = {**base_labels(owner.name, c.APP_KEYS_COPY), c.LABEL_KEYS: version}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "immutable": True,
        "metadata": metadata(owner, c.keys_copy_name(owner.name, version), labels),
        "stringData": {k: keys[k] for k in KEYS},
    }
