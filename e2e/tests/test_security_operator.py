"""The fleet's keys and NetworkPolicies, through the OPERATOR PROCESS on the local stack:
the real API server and Secret, the real SGLang router (0.3.2) in PD mode, sims as the engine
pods (their auth is SGLang's own decision code: cas_engine.sim.auth).

Regression (issue 17): the router's `/workers` API had no key, so anyone who reached the entry
point could deregister workers or register their own URL and receive users' prompts; SGLang's
admin endpoints (weight updates, abort, flush) were open on every engine pod. Now the operator
makes a keys Secret per fleet, the pods take it by secretKeyRef, and the operator's own
deregistrations carry the key (the drain and scale-down tests exercise that path). There was
no NetworkPolicy either: the operator now applies one for the engines and one for the routers,
which the real API server validates; their selectors are checked against the pods it lists (no
local CNI enforces them: see docs/local-stack.md).
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from typing import Any

import pytest
import yaml

from cas_engine.sim.fleet import router_available
from cas_operator.api import constants as c
from e2e.fleet.fleetview import Kubectl, long_chat, role_pods, router_workers
from e2e.fleet.livestack import MakeLiveStack, http_ok, resource_live
from e2e.paths import REPO_ROOT as ROOT
from e2e.waits import wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not router_available(), reason="sglang-router not installed"),
]


def status_of(method: str, url: str, key: str | None, body: Any = None) -> int:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def keys_of(kubectl: Kubectl, namespace: str) -> dict[str, str]:
    selector = f"{c.LABEL_APP_NAME}={c.APP_KEYS}"
    found = json.loads(kubectl("get", "secrets", "-n", namespace, "-l", selector, "-o", "json"))
    (secret,) = found["items"]
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


async def test_the_router_worker_api_and_engine_admin_endpoints_need_the_fleets_keys(
    live_stack: MakeLiveStack, namespace: str, kubectl: Kubectl, crds: None
) -> None:
    cas: dict[str, Any] = yaml.safe_load((ROOT / "config/samples/minimal.yaml").read_text())
    stack = live_stack(["--sim-speedup", "20"])
    with resource_live(stack, kubectl, cas, log=lambda s: print(f"[live] {s}")) as router:
        keys = keys_of(kubectl, namespace)
        control, admin = keys[c.KEY_ROUTER_CONTROL_PLANE], keys[c.KEY_ENGINE_ADMIN]
        assert control != admin
        decode = next(
            f"http://{p['status']['podIP']}:{c.ENGINE_PORT}"
            for p in role_pods(kubectl, namespace, "decode")
            if p.get("status", {}).get("podIP")
        )
        wait_for("the router to list the decode", lambda: http_ok(f"{router}/readiness")
                 and decode in router_workers(router, control), 60)  # fmt: skip
        # the worker API: refused without the key or with another, listed with it
        workers = f"{router}/workers"
        assert status_of("GET", workers, None) == 401
        assert status_of("GET", workers, admin) == 401
        assert status_of("GET", workers, control) == 200
        intruder = {"url": "http://10.255.0.9:30000", "worker_type": "decode"}
        assert status_of("POST", workers, None, intruder) == 401
        assert "http://10.255.0.9:30000" not in router_workers(router, control)
        # SGLang's admin endpoints on an engine pod: the admin key only
        flush = f"{decode}/flush_cache"
        assert status_of("POST", flush, None) == 401
        assert status_of("POST", flush, control) == 401
        assert status_of("POST", flush, admin) == 200
        # ...while clients, probes and Prometheus need no key
        assert long_chat(router, 8) == (200, 8)
        # /health as the kubelet probes it: SGLang's (and these sims') take over a second
        probe_s = c.ENGINE_HEALTH_TIMEOUT_SECONDS
        assert http_ok(f"{decode}/health", timeout=probe_s) and http_ok(f"{decode}/metrics")
        # no pod spec holds a key: they reference the Secret
        pods = kubectl("get", "pods", "-n", namespace, "-o", "json")
        assert control not in pods and admin not in pods


def selected(kubectl: Kubectl, namespace: str, selector: dict[str, str]) -> set[str]:
    query = ",".join(f"{k}={v}" for k, v in selector.items())
    found = json.loads(kubectl("get", "pods", "-n", namespace, "-l", query, "-o", "json"))
    return {p["metadata"]["name"] for p in found["items"]}


async def test_the_fleets_network_policies_are_stored_and_select_exactly_its_pods(
    live_stack: MakeLiveStack, namespace: str, kubectl: Kubectl, crds: None
) -> None:
    cas: dict[str, Any] = yaml.safe_load((ROOT / "config/samples/minimal.yaml").read_text())
    name = cas["metadata"]["name"]
    stack = live_stack(["--sim-speedup", "20"])
    with resource_live(stack, kubectl, cas, log=lambda s: print(f"[live] {s}")):
        stored = json.loads(kubectl("get", "networkpolicies", "-n", namespace, "-o", "json"))
        by_name = {p["metadata"]["name"]: p["spec"] for p in stored["items"]}
        assert set(by_name) == {f"{name}-engines", f"{name}-router"}
        engines = {p["metadata"]["name"] for r in ("prefill", "decode")
                   for p in role_pods(kubectl, namespace, r)}  # fmt: skip
        routers = {p["metadata"]["name"] for p in role_pods(kubectl, namespace, "router")}
        assert engines and routers
        engine_selector = by_name[f"{name}-engines"]["podSelector"]["matchLabels"]
        router_selector = by_name[f"{name}-router"]["podSelector"]["matchLabels"]
        assert selected(kubectl, namespace, engine_selector) == engines
        assert selected(kubectl, namespace, router_selector) == routers
        fleet = by_name[f"{name}-engines"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
        assert selected(kubectl, namespace, fleet) == engines | routers
        # turned off, the operator removes them
        off = {"spec": {"security": {"networkPolicy": {"enabled": False}}}}
        kubectl("patch", "cas", name, "-n", namespace, "--type=merge", "-p", json.dumps(off))
        wait_for("the policies removed", lambda: not json.loads(kubectl(
            "get", "networkpolicies", "-n", namespace, "-o", "json"))["items"], 60)  # fmt: skip
