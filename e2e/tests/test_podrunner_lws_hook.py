"""The pod runner runs an LWS worker's preStop hook as a kubelet would (no cluster needed).

Regression guarded (issue 41, item 8, the harness half): the runner ran only hooks of the form
`python3 -m cas_engine.prestop ...`, so an LWS worker (whose hook is a shell line waiting on
`$LWS_LEADER_ADDRESS`) got SIGTERM at once and its pod object vanished within a second of its
deletion: nothing on the local stack showed a worker that waits on its leader, as in a cluster.
"""

from __future__ import annotations

from pathlib import Path

from cas_operator.api.models import parse_spec
from cas_operator.desired.build import build_plan
from cas_operator.desired.resources.pools import pod_template
from e2e.runtime.podrunner import PodRunner, prestop_for

LEADER = "demo-decode-r1-0.demo-decode-r1.ns"  # what LWS injects: <lws>-<group>.<subdomain>.<ns>


def worker_container() -> dict[str, object]:
    """The worker container the operator renders for a TP2 decode over 2 nodes."""
    decode = {"replicas": 1, "tensorParallel": 2, "gpusPerNode": 1}
    spec = parse_spec({"model": {"name": "glm-5"}, "decode": decode})
    plan = build_plan("demo", "ns", spec).at_revision("r1")
    worker = pod_template(plan, plan.decode, serving=False)
    container: dict[str, object] = worker["spec"]["containers"][0]
    return container


def test_a_workers_hook_waits_on_its_leader_at_the_leaders_pod_ip(tmp_path: Path) -> None:
    hook = prestop_for(worker_container(), "/py", "100.96.2.7", {"LWS_LEADER_ADDRESS": LEADER})
    assert hook[:3] == ("/py", "-m", "cas_engine.prestop"), hook
    assert hook[hook.index("--host") + 1] == LEADER and "--grace" in hook, hook
    runner = PodRunner(lambda: [], tmp_path)
    runner.pod_ips = {("ns", "demo-decode-r1-0"): "100.96.3.4"}
    resolved = runner._at_pod_ip(hook, "ns")
    assert resolved[resolved.index("--host") + 1] == "100.96.3.4", resolved
    assert runner._at_pod_ip(hook, "other") == hook  # unknown: left as the cluster DNS name
