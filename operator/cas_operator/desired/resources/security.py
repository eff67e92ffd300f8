"""Pod security of the fleet's pods: the "restricted" Pod Security level by default.

Engine and router pods run as a non-root user (uid/gid 1000, whatever the image's USER), with
no privilege escalation, every capability dropped and the runtime's default seccomp profile;
engine pods get no service-account token (they never call the API; the router does, for its
pod discovery). `engine.rdma` is the one opt-out: it adds IPC_LOCK (pinned memory for RDMA)
and the RDMA device resource, which "restricted" (and "baseline") refuse, so such a fleet
needs a namespace that allows privileged pods. Engines write caches under $HOME, which is a
memory-backed emptyDir at /tmp (a non-root user cannot write the image's /root).
"""

from __future__ import annotations

from typing import Any, Final

from cas_operator.desired.plan import Plan

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
