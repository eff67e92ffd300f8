"""The pod runner runs an LWS worker's preStop hook as a kubelet would (no cluster needed).

Regression guarded (issue 41, item 8, the harness half): the runner ran only hooks of the form
`python3 -m cas_engine.prestop ...`, so an LWS worker (whose hook is a shell line waiting on
`$LWS_LEADER_ADDRESS`) got SIGTERM at once and its pod object vanished within a second of its
deletion: nothing on the local stack showed a worker that waits on its leader, as in a cluster.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cas_operator.api.models import parse_spec
from cas_operator.desired.build import build_plan
from cas_operator.desired.resources.pools import pod_template
from e2e.runtime.podrunner import PodRunner, launch_for

LEADER = "demo-decode-r1-0.demo-decode-r1.ns"  # what LWS injects: <lws>-<group>.<subdomain>.<ns>


def worker_pod() -> dict[str, Any]:
    """A worker pod of a TP2 decode over 2 nodes, as the operator renders its template and
    LeaderWorkerSet's webhook completes it (the leader's address in its env)."""
    decode = {"replicas": 1, "tensorParallel": 2, "gpusPerNode": 1}
    spec = parse_spec({"model": {"name": "glm-5"}, "decode": decode})
    plan = build_plan("demo", "ns", spec).at_revision("r1")
    template = pod_template(plan, plan.decode, serving=False)
    container = template["spec"]["containers"][0]
    container["env"] = [*container.get("env", []), {"name": "LWS_LEADER_ADDRESS", "value": LEADER}]
    meta = {"name": "demo-decode-r1-0-1", "namespace": "ns", "uid": "u1"}
    pod_spec = {**template["spec"], "nodeName": "node-1"}
    return {"metadata": meta, "spec": pod_spec, "status": {"podIP": "127.0.5.7"}}


def test_a_workers_hook_waits_on_its_leader_at_the_leaders_pod_ip(tmp_path: Path) -> None:
    launch = launch_for(worker_pod(), "/py", [])
    assert launch is not None
    hook = launch.prestop
    assert hook[:3] == ("/py", "-m", "cas_engine.prestop"), hook
    assert hook[hook.index("--host") + 1] == LEADER and "--grace" in hook, hook
    runner = PodRunner(lambda: [], tmp_path)
    runner.pod_ips = {("ns", "demo-decode-r1-0"): "100.96.3.4"}
    resolved = runner._at_pod_ip(hook, "ns")
    assert resolved[resolved.index("--host") + 1] == "100.96.3.4", resolved
    assert runner._at_pod_ip(hook, "other") == hook  # unknown: left as the cluster DNS name
