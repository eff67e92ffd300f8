"""The anomaly loop through the OPERATOR PROCESS, on the local stack, end to end.

Unlike test_anomaly_cluster.py (which calls `anomaly_tick` itself), nothing here drives the loop:
a CodingAgentServing is applied, the operator (`python -m cas_operator`, watching only the
test's namespace, reading PromQL from a real Prometheus when one is installed) builds its
pools, the pod runner turns the engine pods into sims and the router pod into the real SGLang
router (PD mode, Kubernetes discovery) at the pod IPs (e2e/fleet/livestack.py), and traffic flows
through that router. Then a fault goes into sims and only the operator's anomaly loop (5 s period)
may act. Guards: the operator must take the one faulty decode (and only it) out of rotation,
list it in status.draining, let its controller replace it and route to the replacement; a
fault on every decode is a fleet-wide incident (Degraded/FleetWideAnomaly) with no drain.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cas_engine.sim.fleet import router_available
from e2e.fleet.fleetview import (
    NAME,
    Kubectl,
    cas_status,
    condition,
    control_key,
    requests_served,
    router_workers,
    serving_decodes,
    speculative_sample,
)
from e2e.fleet.livestack import LiveStack, MakeLiveStack, http_ok, resource_live
from e2e.runtime.podrunner import ROUTER_SHIM, readiness_url, router_launch_for
from e2e.traffic.simload import LoadStats, set_fault, steady_traffic
from e2e.waits import wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(200),
    pytest.mark.skipif(not router_available(), reason="sglang-router not installed"),
]
ROOT = Path(__file__).resolve().parents[2]
DECODES = 3
SIM_ARGS = ["--sim-speedup", "40", "--log-level", "warning"]


def wait_status(
    kubectl: Kubectl, namespace: str, what: str, done: Callable[[dict[str, Any]], Any], t: float
) -> dict[str, Any]:
    """Poll the resource's status until `done(status)`; on timeout fail with the last one."""
    last: dict[str, Any] = {}

    def probe() -> dict[str, Any] | None:
        nonlocal last
        last = cas_status(kubectl, namespace)
        return last if done(last) else None

    try:
        result: dict[str, Any] = wait_for(what, probe, t)
    except TimeoutError as exc:
        shown = {k: last.get(k) for k in ("anomaly", "draining", "conditions")}
        raise AssertionError(f"{exc}; last status: {json.dumps(shown, indent=1)}") from None
    return result


@pytest.fixture
def fleet(
    live_stack: MakeLiveStack,
    namespace: str,
    kubectl: Kubectl,
    crds: None,
) -> Iterator[tuple[LiveStack, str]]:
    """The live stack for the test namespace with the resource applied and serving; yields the
    stack and the URL of the router pod once it routes to every decode."""
    stack = live_stack(SIM_ARGS)
    cas = speculative_sample(DECODES, window_s=60, maxDrainingPercent=34)
    with resource_live(stack, kubectl, cas, log=lambda line: print(f"[live] {line}")) as router:
        key = control_key(kubectl, namespace)
        decodes = wait_for(f"{DECODES} serving decodes", lambda: len(
            serving_decodes(kubectl, namespace)) == DECODES and serving_decodes(
            kubectl, namespace), 60)  # fmt: skip
        wait_for("the router to list every decode", lambda: http_ok(f"{router}/readiness")
                 and set(decodes.values()) <= router_workers(router, key), 60)  # fmt: skip
        yield stack, router


async def traffic_until_observed(
    router: str, kubectl: Kubectl, namespace: str
) -> tuple[asyncio.Event, LoadStats, asyncio.Task[None]]:
    """Steady chat traffic through the router pod until the operator reports a decode anomaly
    rate (the loop sees healthy data before any fault)."""
    stop, stats = asyncio.Event(), LoadStats()
    task = asyncio.create_task(
        steady_traffic(router, stop, stats, concurrency=4, max_requests=20_000)
    )
    await asyncio.to_thread(
        wait_status, kubectl, namespace, "the operator's first decode anomaly rate",
        lambda s: "decode" in (s.get("anomaly") or {}).get("pools", {}), 60,
    )  # fmt: skip
    return stop, stats, task


@pytest.mark.parametrize(
    ("fault", "reason"),
    [({"repetition": 0.5}, "high_accept_rate"), ({"decode_corruption": 0.5}, "low_accept_length")],
    ids=["repetition", "corruption"],
)
async def test_operator_drains_and_replaces_the_faulty_decode(
    fleet: tuple[LiveStack, str], kubectl: Kubectl, namespace: str, fault: dict[str, float],
    reason: str,
) -> None:  # fmt: skip
    """Regression: with only the operator process acting, a decode that repeats itself (the
    high tail) or reads corrupted KV (collapsed acceptance, the low tail) leaves rotation for
    that reason (label gone, status.draining names it, the router pod no longer lists it), no
    healthy decode is touched, its controller's replacement joins the router and serves."""
    _, router = fleet
    key = control_key(kubectl, namespace)
    before = serving_decodes(kubectl, namespace)
    bad, bad_url = sorted(before.items())[1]
    stop, stats, load = await traffic_until_observed(router, kubectl, namespace)
    try:
        await set_fault(bad_url, fault)
        onset = time.monotonic()
        status = await asyncio.to_thread(
            wait_status, kubectl, namespace, f"{bad} in status.draining",
            lambda s: s.get("draining"), 90,
        )  # fmt: skip
        out_of_rotation = time.monotonic() - onset
        assert [d["pod"] for d in status["draining"]] == [bad], status["draining"]
        assert status["draining"][0]["reason"] == reason, status["draining"]
        events = json.loads(kubectl("get", "events", "-n", namespace, "-o", "json"))["items"]
        assert any(e["reason"] == "PodDraining" and bad in e["message"]
                   and e["involvedObject"]["name"] == NAME for e in events), [
            e["reason"] for e in events]  # fmt: skip
        assert bad not in serving_decodes(kubectl, namespace)
        assert set(before) - {bad} <= set(serving_decodes(kubectl, namespace))
        await asyncio.to_thread(
            wait_for, "the router pod to drop the drained decode",
            lambda: bad_url not in router_workers(router, key), 30,
        )  # fmt: skip
        dropped_at = time.monotonic()
        fresh = await asyncio.to_thread(
            wait_for, "a replacement decode serving",
            lambda: len(now := serving_decodes(kubectl, namespace)) == DECODES
            and bad not in now and now, 90,
        )  # fmt: skip
        (new,) = set(fresh) - set(before)
        new_url = fresh[new]  # the IP may be the drained pod's: a fresh sim counts from 0
        await asyncio.to_thread(
            wait_for, "the replacement to serve requests through the router",
            lambda: new_url in router_workers(router, key) and requests_served(new_url) > 0, 60,
        )  # fmt: skip
        replaced = time.monotonic() - onset
    finally:
        stop.set()
        await load
    after_drop = stats.failures_started_after(dropped_at)
    print(f"\noperator: out of rotation {out_of_rotation:.1f}s, replacement serving "
          f"{replaced:.1f}s after onset; {stats.ok} ok, {len(stats.failures)} failed "
          f"(of {stats.sent}), {len(after_drop)} after the router dropped it")  # fmt: skip
    assert after_drop == [] and stats.ok > 0, after_drop[:3]
    await asyncio.to_thread(
        wait_status, kubectl, namespace, "status.draining empty after the replacement",
        lambda s: not s.get("draining"), 30,
    )  # fmt: skip


async def test_operator_reports_a_fleet_wide_fault_and_drains_nothing(
    fleet: tuple[LiveStack, str], kubectl: Kubectl, namespace: str
) -> None:
    """Regression: when every decode degrades together, the operator must report the incident
    (Degraded, reason FleetWideAnomaly) and keep every decode in rotation."""
    _, router = fleet
    before = serving_decodes(kubectl, namespace)
    stop, stats, load = await traffic_until_observed(router, kubectl, namespace)
    try:
        for url in before.values():
            await set_fault(url, {"repetition": 0.5})
        status = await asyncio.to_thread(
            wait_status, kubectl, namespace, "Degraded/FleetWideAnomaly",
            lambda s: condition(s, "Degraded").get("reason") == "FleetWideAnomaly", 90,
        )  # fmt: skip
        assert (status.get("anomaly") or {}).get("fleetWide"), status.get("anomaly")
        await asyncio.sleep(11)  # one more operator tick (10 s) under the incident
        status = cas_status(kubectl, namespace)
    finally:
        for url in before.values():
            await set_fault(url, {"repetition": 0.0})
        stop.set()
        await load
    assert status.get("draining") in ([], None), status.get("draining")
    assert serving_decodes(kubectl, namespace) == before
    assert condition(status, "Degraded").get("status") == "True"
    assert stats.ok > 0


def test_router_pods_run_as_real_routers_at_their_pod_ip(tmp_path: Path) -> None:
    """Regression: the pod runner must start a router pod's SGLang router with the pod's own
    args, listening (HTTP and metrics) on the pod IP - where the operator deregisters draining
    workers - with discovery through the given kubeconfig; engine pods stay sims."""
    pod = {
        "metadata": {"name": "r", "namespace": "ns", "uid": "u1"},
        "spec": {"nodeName": "kwok-gpu-0", "containers": [{
            "name": "router", "command": ["python3", "-m", "sglang_router.launch_router"],
            "args": ["--host", "0.0.0.0", "--port", "8000", "--pd-disaggregation",
                     "--prometheus-host", "0.0.0.0", "--prometheus-port", "29000"],
            "ports": [{"name": "http", "containerPort": 8000}],
        }]},
        "status": {"phase": "Running", "podIP": "127.10.3.2"},
    }  # fmt: skip
    launch = router_launch_for(pod, "py", tmp_path / "kubeconfig")
    assert launch is not None and launch.argv[:4] == (
        "py", "-m", ROUTER_SHIM, "sglang_router.launch_router")  # fmt: skip
    assert launch.argv[4:] == (
        "--host",
        "127.10.3.2",
        "--port",
        "8000",
        "--pd-disaggregation",
        "--prometheus-host",
        "127.10.3.2",
        "--prometheus-port",
        "29000",
    )
    assert dict(launch.env)["KUBECONFIG"] == str(tmp_path / "kubeconfig")
    assert (launch.ip, launch.port) == ("127.10.3.2", 8000)
    assert (launch.prestop_sleep_s, launch.grace_s) == (0.0, 30.0)
    # smg's pods run smg (router.implementation: smg)
    smg = {
        **pod,
        "spec": {
            **pod["spec"],
            "containers": [
                {**pod["spec"]["containers"][0], "command": ["python3", "-m", "smg.launch_router"]}
            ],
        },
    }
    smg_launch = router_launch_for(smg, "py", tmp_path / "kubeconfig")
    assert smg_launch is not None and smg_launch.argv[3] == "smg.launch_router", smg_launch
    # as a kubelet: the pod's grace, and a preStop sleep before the SIGTERM (issue 15)
    pod["spec"]["terminationGracePeriodSeconds"] = 95
    pod["spec"]["containers"][0]["lifecycle"] = {"preStop": {"sleep": {"seconds": 5}}}
    launch = router_launch_for(pod, "py", tmp_path / "kubeconfig")
    assert launch is not None and (launch.prestop_sleep_s, launch.grace_s) == (5.0, 95.0)
    # the runner plays the router's readinessProbe too (a replacement router is not Ready
    # before it listens, as under a kubelet)
    pod["spec"]["containers"][0]["readinessProbe"] = {
        "httpGet": {"path": "/health", "port": "http"}
    }
    assert readiness_url(launch, pod) == "http://127.10.3.2:8000/health"
    pod["status"]["podIP"] = "10.0.0.7"  # not bindable here: not ours to run
    assert router_launch_for(pod, "py", tmp_path / "kubeconfig") is None
