"""A canary of the minimal sample (no speculative decoding) through the OPERATOR PROCESS on the
local stack: the real API server, kube-proxy for the entry Service (the split by router
replicas), the real SGLang router per revision, sims as engines, Prometheus feeding the
analysis.

Regression guarded (issue 41, item 9): without speculative decoding the engines' quality gate
judges nothing and exports no series, so the analysis's `gateTrips` gate stayed Inconclusive
and every canary step of such a fleet paused forever: the minimal sample's canary never
promoted. A gate that cannot apply is NotApplicable, and the status says so.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from cas_engine.sim.fleet import router_available
from e2e.fleet.canaryview import patch_engine, rollout, serving_stably
from e2e.fleet.fleetview import Kubectl, cas_status, entry_url_when_serving
from e2e.fleet.livestack import MakeLiveStack, resource_live
from e2e.paths import REPO_ROOT
from e2e.traffic.recorded import RecordedLoad
from e2e.waits import wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not router_available(), reason="sglang-router not installed"),
]


def minimal_canary() -> dict[str, Any]:
    """config/samples/minimal.yaml as shipped (no speculative decoding), with a short Canary:
    one 50% step of 5 s, a 15 s window and 5 requests for a verdict; latency ratios loose
    (the canary's one decode carries what the stable one carries, on a busy machine)."""
    cas: dict[str, Any] = yaml.safe_load((REPO_ROOT / "config/samples/minimal.yaml").read_text())
    assert "engine" not in cas["spec"]  # the sample runs no speculative decoding
    cas["spec"]["rollout"] = {
        "strategy": "Canary",
        "steps": [{"weight": 50, "pauseSeconds": 5}],
        "analysis": {"windowSeconds": 15, "minRequests": 5, "maxTtftRatio": 10,
                     "maxItlRatio": 10},
    }  # fmt: skip
    return cas


def test_the_minimal_samples_canary_promotes_with_the_gate_trip_gate_not_applicable(
    live_stack: MakeLiveStack, namespace: str, kubectl: Kubectl, crds: None
) -> None:
    stack = live_stack(["--sim-speedup", "20"])
    with resource_live(stack, kubectl, minimal_canary(), log=lambda s: print(f"[live] {s}")):
        before = wait_for("the fleet Ready", lambda: serving_stably(kubectl, namespace), 120)
        entry = wait_for(
            "the entry Service", lambda: entry_url_when_serving(kubectl, namespace), 60
        )
        # fresh connections: kube-proxy splits connections, not requests, between the routers
        load = RecordedLoad(entry, workers=2, tokens=60, fresh_connections=True).start()
        patch_engine(kubectl, namespace, {"env": [{"name": "CAS_DEMO_BUILD", "value": "2"}]})
        analyses: list[dict[str, Any]] = []

        def promoted() -> dict[str, Any] | None:
            state = rollout(kubectl, namespace)
            if state.get("analysis") and state["analysis"] not in analyses:
                analyses.append(state["analysis"])
                print(f"[rollout] {state.get('phase')}: {state.get('reason')}")
            new = cas_status(kubectl, namespace).get("revision")
            done = new != before["revision"] and state.get("stableRevision") == new
            return state if done else None

        try:
            wait_for("the canary promoted", promoted, 150)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}: {rollout(kubectl, namespace)}") from exc
        served = load.stop()
    passed = [a for a in analyses if a["verdict"] == "Pass"]
    assert passed, analyses
    gates = {g["name"]: g for g in passed[-1]["gates"]}
    assert gates["gateTrips"]["verdict"] == "NotApplicable", gates
    assert "no speculative decoding" in gates["gateTrips"]["limit"], gates
    assert "gateTrips not applicable" in passed[-1]["reason"], passed[-1]
    assert served and all(s.ok for s in served), [s.error for s in served if not s.ok][:5]
