"""An evicted LeaderWorkerSet worker through the OPERATOR PROCESS on the local stack: the real
API server (Eviction API, PodDisruptionBudgets), the real LeaderWorkerSet controller, the real
SGLang router (2 replicas) in PD mode, sims as the engine pods (e2e/fleet/livestack.py).

Regression guarded (issue 41, item 8): evicting or deleting an LWS worker pod never took its
leader out of rotation: the worker's preStop waits for a leader that keeps receiving requests,
and once the worker stops the group's requests fail. Now the operator takes the leader out
(serving label off, deregistered from every router replica) on its next tick. Measured here
too: LeaderWorkerSet v0.9's RecreateGroupOnPodRestart deletes the leader within a second, and
its preStop lets what it runs finish; before the fix the leader kept its serving label all
through its drain, so a router (re)discovering pods by label could take it back. Then the
recreated group's leader serves again, listed by every router, and is not drained.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from cas_engine.sim.fleet import router_available
from e2e.fleet.fleetview import Kubectl, control_key, long_chat, role_pods, router_workers, running
from e2e.fleet.livestack import MakeLiveStack, http_ok, resource_live
from e2e.tests.test_lifecycle_operator import decode_urls_serving, lws_sample
from e2e.waits import wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not router_available(), reason="sglang-router not installed"),
]
WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
TOKENS = 4000  # ~16 s at speedup 2: still running when the worker goes
STAY_S = 12.0  # a few operator ticks
DRAIN_REASON = "cas.dev/drain-reason"


def evict(kubectl: Kubectl, namespace: str, pod: str) -> None:
    """The Eviction API, as `kubectl drain` calls it (PodDisruptionBudgets honoured)."""
    body = {"apiVersion": "policy/v1", "kind": "Eviction",
            "metadata": {"name": pod, "namespace": namespace}}  # fmt: skip
    kubectl("create", "--raw", f"/api/v1/namespaces/{namespace}/pods/{pod}/eviction", "-f", "-",
            stdin=json.dumps(body))  # fmt: skip


def routers(kubectl: Kubectl, namespace: str) -> list[str]:
    pods = role_pods(kubectl, namespace, "router")
    return [f"http://{p['status']['podIP']}:8000" for p in pods if p["status"].get("podIP")]


def leader_state(kubectl: Kubectl, namespace: str, name: str, url: str, key: str) -> dict[str, Any]:
    raw = kubectl("get", "pod", name, "-n", namespace, "-o", "json", check=False)
    meta = json.loads(raw)["metadata"] if raw.strip() else {}
    return {
        "serving": (meta.get("labels") or {}).get("cas.dev/serving"),
        "deleting": bool(meta.get("deletionTimestamp")),
        "listed_by": [r for r in routers(kubectl, namespace) if url in router_workers(r, key)],
    }


async def test_an_evicted_worker_takes_its_leader_out_of_rotation_and_cuts_nothing(
    live_stack: MakeLiveStack, namespace: str, kubectl: Kubectl, crds: None
) -> None:
    stack = live_stack(["--sim-speedup", "2"])
    with resource_live(stack, kubectl, lws_sample(2), log=lambda s: print(f"[live] {s}")) as r:
        key = control_key(kubectl, namespace)
        leaders = await asyncio.to_thread(
            wait_for, "2 decode groups serving",
            lambda: (u := decode_urls_serving(kubectl, namespace)) and len(u) == 2 and u, 120,
        )  # fmt: skip
        wait_for("every router to list both leaders", lambda: all(
            http_ok(f"{u}/readiness") and set(leaders.values()) <= router_workers(u, key)
            for u in routers(kubectl, namespace)), 60)  # fmt: skip
        requests = [asyncio.create_task(asyncio.to_thread(long_chat, r, TOKENS)) for _ in "abcd"]
        busy = await asyncio.to_thread(
            wait_for, "a leader decoding",
            lambda: next((n for n, u in leaders.items() if running(u) > 0), None), 60,
        )  # fmt: skip
        pods = {p["metadata"]["name"]: p["metadata"]["labels"]
                for p in role_pods(kubectl, namespace, "decode")}  # fmt: skip
        (worker,) = [n for n, labels in pods.items() if labels[GROUP_INDEX] ==
                     pods[busy][GROUP_INDEX] and labels[WORKER_INDEX] != "0"]  # fmt: skip
        old_uid = pods_uid(kubectl, namespace, busy)
        evicted = time.monotonic()
        evict(kubectl, namespace, worker)
        url = leaders[busy]

        def out_of_rotation() -> dict[str, Any] | None:
            state = leader_state(kubectl, namespace, busy, url, key)
            print(f"[leader] {time.monotonic() - evicted:.1f}s {state}")
            return state if state["serving"] is None and not state["listed_by"] else None

        out = await asyncio.to_thread(wait_for, f"{busy} out of rotation", out_of_rotation, 20)
        took = time.monotonic() - evicted
        results = await asyncio.gather(*requests)
        back = await asyncio.to_thread(
            wait_for, f"{busy} recreated and serving",
            lambda: recreated_serving(kubectl, namespace, busy, old_uid, key), 90,
        )  # fmt: skip
        # the group comes back (LWS recreates it) and, a few ticks on, still serves: nothing
        # takes the new leader out for what its old group did
        await asyncio.sleep(STAY_S)
        after = leader_annotations(kubectl, namespace, busy)
        still = recreated_serving(kubectl, namespace, busy, old_uid, key)
    assert took <= 12, f"{busy} left rotation {took:.0f}s after its worker's eviction"
    assert results == [(200, TOKENS)] * 4, results
    assert still is not None and still == back, (back, still)
    assert DRAIN_REASON not in after, after
    print(f"{busy} out of rotation {took:.1f}s after its worker's eviction: {out}")


def pods_uid(kubectl: Kubectl, namespace: str, name: str) -> str | None:
    raw = kubectl("get", "pod", name, "-n", namespace, "-o", "json", check=False)
    return json.loads(raw)["metadata"]["uid"] if raw.strip() else None


def leader_annotations(kubectl: Kubectl, namespace: str, name: str) -> dict[str, str]:
    raw = kubectl("get", "pod", name, "-n", namespace, "-o", "json", check=False)
    return (json.loads(raw)["metadata"].get("annotations") or {}) if raw.strip() else {}


def recreated_serving(
    kubectl: Kubectl, namespace: str, name: str, old_uid: str | None, key: str
) -> str | None:
    """The uid of leader `name` once it is a new pod (not `old_uid`), serving and listed by
    every router replica; else None."""
    raw = kubectl("get", "pod", name, "-n", namespace, "-o", "json", check=False)
    if not raw.strip():
        return None
    pod = json.loads(raw)
    meta, ip = pod["metadata"], pod.get("status", {}).get("podIP")
    if meta["uid"] == old_uid or meta.get("deletionTimestamp") or not ip:
        return None
    if (meta.get("labels") or {}).get("cas.dev/serving") != "true":
        return None
    url = f"http://{ip}:30000"
    listed = [r for r in routers(kubectl, namespace) if url in router_workers(r, key)]
    return str(meta["uid"]) if listed and len(listed) == len(routers(kubectl, namespace)) else None
