"""Canary rollouts through the OPERATOR PROCESS on the local stack: the real API server, the real
Gateway API implementation (Traefik) splitting by the operator's HTTPRoute weights, kube-proxy
for the entry Service, the real SGLang router per revision, sims as engines (each answer names
the prefill and decode that served it), Prometheus feeding the analysis.

Regressions guarded (issue 16): `rollout.strategy: Canary` was validated and then ignored (an
engine change rolled like Rolling); traffic must move by weight only once both canary roles are
Ready, no request may fail or be served by a prefill and a decode of different revisions, a
corrupting canary must be aborted within one analysis window and get no request after, an
inconclusive analysis must pause (not promote), and a restarted operator must resume there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest

from cas_engine.sim.fleet import router_available
from e2e.cluster.stack import ClusterHandle, gateway_host
from e2e.fleet.canaryview import (
    answers,
    canary_sample,
    patch_engine,
    rollout,
    route_weight,
    serving_stably,
    workloads_of,
)
from e2e.fleet.fleetview import NAME, Kubectl, cas_status, condition, entry_url_when_serving
from e2e.fleet.livestack import MakeLiveStack, resource_live
from e2e.traffic.recorded import PodBook, RecordedLoad, Served, check_pairs
from e2e.waits import pause, wait_for
from tests.unit.test_argocd_health import health

SIM_ARGS = ["--sim-speedup", "20"]
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(420),
    pytest.mark.skipif(not router_available(), reason="sglang-router not installed"),
]


def summary(served: list[Served], moments: list[tuple[float, str]] | None = None) -> str:
    """Counts, the first errors, and when the failures started and ended against the rollout's
    moments (seconds after the first request), which says which transition lost them."""
    failed = [s for s in served if not s.ok]
    text = f"{len(served)} sent, {len(failed)} failed: {[s.error for s in failed][:5]}"
    if failed and served:
        t0 = served[0].started
        when = [(round(t - t0, 1), what) for t, what in moments or []]
        text += (f"; failures from {failed[0].started - t0:.1f}s to {failed[-1].started - t0:.1f}s"
                 f"; rollout: {when}")  # fmt: skip
    return text


def test_an_engine_change_steps_through_the_gateway_and_promotes(
    live_stack: MakeLiveStack, namespace: str, kubectl: Kubectl, cluster: ClusterHandle,
    crds: None,
) -> None:  # fmt: skip
    gateway = cluster.gateway_url
    assert gateway is not None, "the local stack runs no Gateway (pod network off?)"
    stack = live_stack(SIM_ARGS)
    host = gateway_host(namespace)
    cas = canary_sample(gateway=True, steps=[{"weight": 50, "pauseSeconds": 10}], host=host)
    with resource_live(stack, kubectl, cas, log=lambda s: print(f"[live] {s}")):
        before = wait_for("the fleet Ready", lambda: serving_stably(kubectl, namespace), 120)
        wait_for("the Gateway to reach the fleet", lambda: answers(gateway, host), 90)
        book = PodBook(kubectl, namespace, NAME).start()
        load = RecordedLoad(gateway, workers=4, tokens=160, host=host).start()
        pause(5, "traffic flows before the change")
        patch_engine(kubectl, namespace, {"env": [{"name": "CAS_DEMO_BUILD", "value": "2"}]})
        weights: list[int] = []
        phases: list[str] = []
        reasons: list[str] = []
        moments: list[tuple[float, str]] = []

        def promoted() -> dict[str, Any] | None:
            weight, state = route_weight(kubectl, namespace), rollout(kubectl, namespace)
            if weight is not None and (not weights or weights[-1] != weight):
                weights.append(weight)
            if state.get("phase") and (not phases or phases[-1] != state["phase"]):
                phases.append(state["phase"])
            if state.get("reason") and (not reasons or reasons[-1] != state["reason"]):
                reasons.append(state["reason"])
                moments.append((time.monotonic(), f"{state['phase']}: {state['reason']}"))
                print(f"[rollout] {state['phase']}: {state['reason']}")
            new = cas_status(kubectl, namespace).get("revision")
            done = new != before["revision"] and state.get("stableRevision") == new
            gone = not workloads_of(kubectl, namespace, before["revision"])
            return state if done and gone else None

        try:
            final = wait_for("the canary promoted and the old revision retired", promoted, 300)
        except TimeoutError as exc:
            raise AssertionError(
                f"{exc}: {rollout(kubectl, namespace)}; weights {weights}"
            ) from exc
        pause(3, "the last answers come back")
        served = load.stop()
        book.stop()
    check = check_pairs(served, book)
    new = final["stableRevision"]
    assert check.failed == [], summary(served, moments)
    assert check.mixed == [] and check.unknown == [], (check.mixed[:5], check.unknown[:5])
    assert check.by_revision.get(before["revision"], 0) > 0 and check.by_revision.get(new, 0) > 0
    assert 50 in weights and weights[0] == 0, weights  # traffic moved by the route's weights
    assert "Progressing" in phases and phases[-1] == "Stable", phases


def test_a_corrupting_canary_is_aborted_within_one_window_and_then_gets_nothing(
    live_stack: MakeLiveStack, namespace: str, kubectl: Kubectl, cluster: ClusterHandle,
    crds: None,
) -> None:  # fmt: skip
    gateway = cluster.gateway_url
    assert gateway is not None
    stack = live_stack(SIM_ARGS)
    host = gateway_host(namespace)
    cas = canary_sample(gateway=True, steps=[{"weight": 50, "pauseSeconds": 60}], host=host,
                        windowSeconds=60)  # fmt: skip
    with resource_live(stack, kubectl, cas, log=lambda s: print(f"[live] {s}")):
        before = wait_for("the fleet Ready", lambda: serving_stably(kubectl, namespace), 120)
        wait_for("the Gateway to reach the fleet", lambda: answers(gateway, host), 90)
        book = PodBook(kubectl, namespace, NAME).start()
        load = RecordedLoad(gateway, workers=4, tokens=200, host=host).start()
        # the canary's engines corrupt half their requests' KV (the sim's decode fault)
        patch_engine(kubectl, namespace, {"args": ["--sim-fault", "decode_corruption=0.5"]})

        def weighted() -> dict[str, Any] | None:
            state = rollout(kubectl, namespace)
            return state if state.get("weight", 0) > 0 and state.get("stepStartedAt") else None

        shifted = wait_for("traffic on the canary", weighted, 120)
        moved_at = time.monotonic()
        aborted = wait_for(
            "the rollout aborted",
            lambda: (s := rollout(kubectl, namespace)).get("phase") == "Aborted" and s,
            90,
        )
        aborted_at = time.monotonic()
        status = cas_status(kubectl, namespace)
        wait_for("the canary's weight back to 0", lambda: route_weight(kubectl, namespace) == 0, 30)
        zero_at = time.monotonic()
        pause(15, "traffic after the abort: none may reach the canary")
        served = load.stop()
        wait_for("the canary retired", lambda: not workloads_of(
            kubectl, namespace, shifted["canaryRevision"]), 120)  # fmt: skip
        book.stop()
    canary = shifted["canaryRevision"]
    assert aborted["abortedRevision"] == canary and aborted["stableRevision"] == before["revision"]
    assert "gateTrips" in aborted["reason"] or "canary anomaly" in aborted["reason"], aborted
    assert aborted_at - moved_at <= 60 + 15, "not aborted within one analysis window (+ a tick)"
    degraded = condition(status, "Degraded")
    assert degraded.get("reason") == "RolloutAborted", degraded
    assert health({"metadata": {"generation": 2}, "status": status})["status"] == "Degraded"
    later = [s for s in served if s.started > zero_at + 3 and s.ok]
    on_canary = [s for s in later if book.revision(s.decode, s.ended) == canary]
    assert later and on_canary == [], (len(later), on_canary[:3])
    check = check_pairs(served, book)
    assert check.mixed == [], check.mixed[:5]
    exposed = check.by_revision.get(canary, 0)
    print(f"exposed to the canary: {exposed} of {len(served)}; failed {len(check.failed)}; "
          f"abort {aborted_at - moved_at:.0f}s after the shift")  # fmt: skip


def kubectl_cas(cluster: ClusterHandle, *args: str) -> str:
    """The `kubectl cas` plugin as a user runs it (its console script's module)."""
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    done = subprocess.run(
        [sys.executable, "-m", "cas_operator.kubectl_cas", *args],
        env=env, capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return done.stdout


def test_an_inconclusive_step_pauses_survives_a_restart_and_promotes_on_command(
    live_stack: MakeLiveStack, namespace: str, kubectl: Kubectl, cluster: ClusterHandle,
    crds: None,
) -> None:  # fmt: skip
    """Without a Gateway: the entry Service spans both revisions' routers (one each at 50%)."""
    stack = live_stack(SIM_ARGS)
    cas = canary_sample(gateway=False, steps=[{"weight": 50, "pauseSeconds": 5}],
                        minRequests=1_000_000)  # fmt: skip
    with resource_live(stack, kubectl, cas, log=lambda s: print(f"[live] {s}")):
        before = wait_for("the fleet Ready", lambda: serving_stably(kubectl, namespace), 120)
        entry = wait_for(
            "the entry Service", lambda: entry_url_when_serving(kubectl, namespace), 60
        )
        book = PodBook(kubectl, namespace, NAME).start()
        # kube-proxy spreads connections, not requests: a client that kept its connection
        # alive would stay on the stable router (the split by router replicas is per connection)
        load = RecordedLoad(entry, workers=3, tokens=120, fresh_connections=True).start()
        patch_engine(kubectl, namespace, {"env": [{"name": "CAS_DEMO_BUILD", "value": "3"}]})
        paused = wait_for(
            "the step paused on an inconclusive analysis",
            lambda: (s := rollout(kubectl, namespace)).get("phase") == "Paused" and s,
            180,
        )
        assert "inconclusive" in paused["reason"] and paused["weight"] == 50, paused
        selector = json.loads(kubectl("get", "service", NAME, "-n", namespace, "-o", "json"))
        assert "cas.dev/revision" not in selector["spec"]["selector"]
        obj = json.loads(kubectl("get", "cas", NAME, "-n", namespace, "-o", "json"))
        assert health(obj)["status"] == "Suspended", health(obj)
        assert "Paused" in kubectl_cas(cluster, "rollout", "status", NAME, "-n", namespace)
        pause(10, "both revisions serve through the entry Service meanwhile")
        during = check_pairs(load.snapshot(), book).by_revision
        assert during.get(paused["canaryRevision"], 0) > 0, during

        assert stack.operator is not None
        stack.operator.kill()
        stack.operator.start()
        pause(20, "several fleet ticks of the new process")
        resumed = rollout(kubectl, namespace)
        assert (resumed["phase"], resumed["step"], resumed["weight"]) == ("Paused", 0, 50)
        assert resumed["stepStartedAt"] == paused["stepStartedAt"], (resumed, paused)

        kubectl_cas(cluster, "rollout", "promote", NAME, "-n", namespace)
        final = wait_for(
            "promoted on command",
            lambda: (
                (s := rollout(kubectl, namespace)).get("phase") == "Stable"
                and s.get("stableRevision") == paused["canaryRevision"]
                and s
            ),
            180,
        )
        annotations = json.loads(kubectl("get", "cas", NAME, "-n", namespace, "-o", "json"))[
            "metadata"].get("annotations") or {}  # fmt: skip
        pause(5, "the promoted revision serves alone")
        served = load.stop()
        book.stop()
    assert "cas.dev/rollout-action" not in annotations, annotations
    check = check_pairs(served, book)
    assert check.failed == [], summary(served)
    assert check.mixed == [] and check.unknown == [], (check.mixed[:5], check.unknown[:5])
    assert check.by_revision.get(before["revision"], 0) > 0
    assert check.by_revision.get(final["stableRevision"], 0) > 0
