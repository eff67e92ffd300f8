"""Views and steps of one fleet's canary rollout on a cluster, shared by
`e2e/tests/test_canary.py` and `make bench-canary` (bench/canary.py).

Everything goes through a `kubectl(*args, check=True) -> stdout` callable and plain HTTP; the
only changes are `patch_engine` (a new engine revision, as a GitOps sync would apply it).
"""

from __future__ import annotations

import json
from typing import Any

from e2e.cluster.stack import GATEWAY_NAME, GATEWAY_NAMESPACE
from e2e.fleet.fleetview import NAME, Kubectl, cas_status, condition, speculative_sample
from e2e.traffic.recorded import RecordedLoad


def canary_sample(
    *, gateway: bool, steps: list[dict[str, Any]], host: str | None = None, **analysis: Any
) -> dict[str, Any]:
    """The minimal sample, 1 prefill : 2 decodes with speculative decoding (the quality gate
    judges every request), a Canary rollout of `steps`; with `gateway`, served through the
    local stack's Gateway under `host` (`e2e.cluster.stack.gateway_host`; clients send it as
    the Host header). TTFT/ITL ratios are loose here: at a 50% step the canary's one decode
    carries what two stable decodes share (the stable pools keep their full size)."""
    cas = speculative_sample(decodes=2, window_s=30)
    cas["spec"]["rollout"] = {
        "strategy": "Canary",
        "steps": steps,
        "analysis": {"windowSeconds": 30, "minRequests": 10, "maxTtftRatio": 4,
                     "maxItlRatio": 4, **analysis},
    }  # fmt: skip
    if gateway:
        ref = {"name": GATEWAY_NAME, "namespace": GATEWAY_NAMESPACE}
        cas["spec"]["gateway"] = {"parentRefs": [ref], **({"hostnames": [host]} if host else {})}
    return cas


def patch_engine(kubectl: Kubectl, namespace: str, engine: dict[str, Any]) -> None:
    """A new engine revision, as a GitOps sync would apply it (speculative settings kept)."""
    current = json.loads(kubectl("get", "cas", NAME, "-n", namespace, "-o", "json"))
    merged = {**current["spec"]["engine"], **engine}
    body = json.dumps({"spec": {"engine": merged}})
    kubectl("patch", "cas", NAME, "-n", namespace, "--type=merge", "-p", body)


def rollout(kubectl: Kubectl, namespace: str) -> dict[str, Any]:
    found: dict[str, Any] = cas_status(kubectl, namespace).get("rollout") or {}
    return found


def serving_stably(kubectl: Kubectl, namespace: str) -> dict[str, Any] | None:
    status = cas_status(kubectl, namespace)
    ready = condition(status, "Ready").get("status") == "True"
    stable = (status.get("rollout") or {}).get("phase") == "Stable"
    return status if ready and stable else None


def answers(url: str, host: str | None = None) -> bool:
    load = RecordedLoad(url, workers=1, max_requests=1, tokens=8, timeout_s=10, host=host)
    return all(s.ok for s in load.start().stop()) and bool(load.served)


def workloads_of(kubectl: Kubectl, namespace: str, revision: str) -> list[str]:
    out = kubectl("get", "deployments", "-n", namespace, "-l",
                  f"cas.dev/name={NAME},cas.dev/revision={revision}", "-o", "name")  # fmt: skip
    return out.split()


def route_weight(kubectl: Kubectl, namespace: str) -> int | None:
    """The canary's weight in the operator's HTTPRoute (None: no route)."""
    out = kubectl("get", "httproute", NAME, "-n", namespace, "-o", "json", check=False)
    if not out.strip():
        return None
    refs = json.loads(out)["spec"]["rules"][0]["backendRefs"]
    return int(next(r["weight"] for r in refs if r["name"].endswith("-canary")))
