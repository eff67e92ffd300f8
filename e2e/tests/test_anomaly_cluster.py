"""The whole loop on the local stack: real API server, KWOK pods made real by the pod runner,
`anomaly_tick` (observe -> decide -> act) with the operator's own `Kube` client.

A Deployment of decode engine pods carries the labels the operator's builders set; the pod
runner starts a sim at each pod IP; a client discovers workers by the `cas.dev/serving` label
(as the router does) and retries a failed request on another worker (see
e2e/fleet/anomaly_stack.py).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from cas_engine.sim.worker import REPEAT_JUDGED_BY_TOKENS
from cas_operator.anomaly.drain import ANNOTATION_DRAINING_SINCE, is_ready
from e2e.fleet.anomaly_stack import AnomalyStack, lone_pod, url_of
from e2e.fleet.fleetview import long_chat, running
from e2e.traffic.simload import LoadStats, set_fault, steady_traffic
from e2e.waits import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture
async def stack(kubeconfig: Path, namespace: str, tmp_path: Path) -> AsyncIterator[AnomalyStack]:
    s = AnomalyStack.start(kubeconfig, namespace, tmp_path / "sims")
    try:
        yield s
    finally:
        await s.close()


async def test_faulty_pod_is_drained_and_replaced_without_failed_requests(
    stack: AnomalyStack, kubectl: Callable[..., str]
) -> None:
    """Regression: the act step against a real API server - the bad pod leaves rotation (and
    only it), is deleted once idle, its controller's replacement serves, no client fails."""
    urls = stack.deploy(kubectl, 3)
    bad = stack.pod_names(urls)[urls[1]]
    router = await stack.start_traffic()
    await set_fault(urls[1], {"repetition": 0.5})
    onset = time.monotonic()
    drained = await stack.tick_until(
        lambda r: any(e[1] == "PodDraining" for e in r.events), timeout=60
    )
    out_of_rotation = time.monotonic() - onset
    deleted = await stack.tick_until(
        lambda r: any(e[1] == "PodReplaced" for e in r.events), timeout=60
    )
    fresh = stack.wait_serving(3, timeout=60)
    replaced = time.monotonic() - onset
    await stack.stop_traffic()
    print(f"\nanomaly: out of rotation {out_of_rotation:.1f}s, replacement serving "
          f"{replaced:.1f}s after onset; {router.ok} requests ok")  # fmt: skip
    assert drained is not None and deleted is not None, stack.events
    draining = [e for e in stack.events if e[1] == "PodDraining"]
    assert len(draining) == 1 and bad in draining[0][2], stack.events
    names = stack.pod_names(fresh)
    assert bad not in names.values() and len(names) == 3
    pods = stack.serving()
    assert all(ANNOTATION_DRAINING_SINCE not in (p["metadata"].get("annotations") or {})
               for p in pods)  # fmt: skip
    assert router.failures == [] and router.ok > 0, router.failures[:3]


async def test_fleet_wide_fault_degrades_and_drains_nothing(
    stack: AnomalyStack, kubectl: Callable[..., str]
) -> None:
    """Regression: every pod bad at once is a shared cause (bad weights, a bad rollout):
    draining them would take the fleet down. The loop must report Degraded and touch no pod."""
    urls = stack.deploy(kubectl, 3)
    await stack.start_traffic()
    for url in urls:
        await set_fault(url, {"repetition": 0.5})
    degraded = await stack.tick_until(lambda r: r.degraded is not None, timeout=60)
    for _ in range(5):  # and it stays that way: no drain on the following ticks
        await stack.tick()
    await stack.stop_traffic()
    assert degraded is not None and "fleet-wide" in str(degraded.degraded)
    assert not [e for e in stack.events if e[1] in ("PodDraining", "PodReplaced")], stack.events
    assert any(e[1] == "FleetWideAnomaly" for e in stack.events)
    assert len(stack.serving()) == 3


async def test_healthy_noisy_fleet_under_load_drains_nothing(
    stack: AnomalyStack, kubectl: Callable[..., str]
) -> None:
    """Regression: healthy pods with the production's residual bad-output rate (a few per
    10,000) under steady load must never be drained (false drains = 0)."""
    urls = stack.deploy(kubectl, 3)
    router = await stack.start_traffic()
    for url in urls:
        await set_fault(url, {"repetition": 0.0005})
    await stack.tick_until(lambda r: False, timeout=15)  # ~15 ticks of 1 s
    await stack.stop_traffic()
    assert not [e for e in stack.events if e[1] == "PodDraining"], stack.events
    assert len(stack.serving()) == 3 and router.ok > 100


async def test_real_router_with_kubernetes_discovery_loses_no_request(
    stack: AnomalyStack, kubectl: Callable[..., str], kubeconfig: Path, tmp_path: Path
) -> None:
    """Regression: behind the REAL SGLang router discovering workers from the API server, a
    drained pod must stop receiving requests before it is deleted (the router ignores a pod
    that merely stops matching its selector, so the act step deregisters it), and no client
    request may fail during drain and replacement: no lost connection, no repeating answer,
    no error but the gate's retryable 503 that 0.3.2's retries now and then spend every
    attempt of on the faulty pod (`LoadStats.failures_beyond_rare_trips`; it failed one CI run
    with one such 503)."""
    router_url = stack.start_sglang_router(kubeconfig, tmp_path / "router")
    urls = stack.deploy(kubectl, 3)
    bad = stack.pod_names(urls)[urls[1]]
    await asyncio.to_thread(
        wait_for, "router sees 3 workers", lambda: router_workers(router_url) == 3, 60
    )
    stop, stats = asyncio.Event(), LoadStats()
    load = asyncio.create_task(
        steady_traffic(router_url, stop, stats, max_tokens=REPEAT_JUDGED_BY_TOKENS)
    )
    try:
        await asyncio.to_thread(wait_for, "traffic", lambda: stats.ok > 20, 30)
        await set_fault(urls[1], {"repetition": 0.5})
        deleted = await stack.tick_until(
            lambda r: any(e[1] == "PodReplaced" for e in r.events), timeout=90
        )
        stack.wait_serving(3, timeout=60)
        await asyncio.to_thread(wait_for, "router sees the replacement",
                                lambda: router_workers(router_url) == 3, 60)  # fmt: skip
        ok_before = stats.ok
        await asyncio.to_thread(wait_for, "traffic after", lambda: stats.ok > ok_before + 20, 30)
    finally:
        stop.set()
        await load
    assert deleted is not None, stack.events
    assert any(e[1] == "WorkerDeregistered" and bad in e[2] for e in stack.events), stack.events
    assert stats.failures_beyond_rare_trips() == [] and stats.ok > 40, stats.failures[:3]


async def test_the_real_router_registers_a_pod_only_once_it_is_ready(
    stack: AnomalyStack, kubectl: Callable[..., str], kubeconfig: Path, tmp_path: Path
) -> None:
    """Regression guard for docs/resource.md ("Health checks"): the operator relies on the real
    router's Kubernetes discovery registering a pod only once it is Running and Ready
    (sglang-router 0.3.2, `src/service_discovery.rs:121-124,196-197,408`), so an engine still
    loading its weights gets no request. A pod whose /health stays silent (as SGLang's does
    until its scheduler answers) must stay out of the router's workers, then join once it
    answers and turns Ready."""
    router_url = stack.start_sglang_router(kubeconfig, tmp_path / "router")
    stack.deploy(kubectl, 1)
    await asyncio.to_thread(wait_for, "router sees the ready pod",
                            lambda: router_workers(router_url) == 1, 60)  # fmt: skip
    name = "anomaly-demo-late"
    kubectl("apply", "-n", stack.namespace, "-f", "-",
            stdin=json.dumps(lone_pod(name, "hang=1")))  # fmt: skip

    def started() -> str | None:  # its sim answers its admin endpoint (health is silent)
        pod = stack.kube.get("Pod", stack.namespace, name)
        if not pod or not pod.get("status", {}).get("podIP"):
            return None
        url = url_of(pod)
        try:
            with urllib.request.urlopen(f"{url}/sim/fault", timeout=2):
                return url
        except OSError:
            return None

    url = await asyncio.to_thread(wait_for, "the late pod's sim", started, 60)
    watched_until = time.monotonic() + 15  # three readiness periods, every probe silent
    while time.monotonic() < watched_until:
        assert not pod_ready(stack, name), "a silent /health was taken for Ready"
        assert router_workers(router_url) == 1, "the router registered a pod not Ready"
        await asyncio.sleep(1)
    await set_fault(url, {"hang": 0})
    await asyncio.to_thread(wait_for, "the late pod Ready", lambda: pod_ready(stack, name), 60)
    await asyncio.to_thread(wait_for, "router sees the late pod once Ready",
                            lambda: router_workers(router_url) == 2, 60)  # fmt: skip


def pod_ready(stack: AnomalyStack, name: str) -> bool:
    return is_ready(stack.kube.get("Pod", stack.namespace, name) or {})


def router_workers(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/workers", timeout=2) as resp:
            return len(json.loads(resp.read())["workers"])
    except OSError:
        return -1


async def test_a_deleted_pod_finishes_its_request_behind_the_real_router(
    kubectl: Callable[..., str], kubeconfig: Path, namespace: str, tmp_path: Path
) -> None:
    """Regression (issue 15): a deleted engine pod (scale-down, retired revision, eviction)
    was stopped at once and cut the request it ran. With the operator's preStop hook (run by
    the pod runner as a kubelet does) a request in flight through the real SGLang router
    completes, longer after the delete than a plain SIGTERM's grace would have allowed."""
    stack = AnomalyStack.start(kubeconfig, namespace, tmp_path / "sims", speedup=1.0)
    try:
        router_url = stack.start_sglang_router(kubeconfig, tmp_path / "router")
        (url,) = stack.deploy(kubectl, 1, drain_seconds=120)
        pod = stack.pod_names([url])[url]
        await asyncio.to_thread(wait_for, "router sees the worker",
                                lambda: router_workers(router_url) == 1, 60)  # fmt: skip
        request = asyncio.create_task(asyncio.to_thread(long_chat, router_url, 1500))
        await asyncio.to_thread(wait_for, "the request running", lambda: running(url) > 0, 30)
        deleted = time.monotonic()
        kubectl("delete", "pod", pod, "-n", namespace, "--wait=false")
        status, tokens = await request
        took = time.monotonic() - deleted
        print(f"\npreStop: request finished {took:.1f}s after its pod was deleted")
        assert (status, tokens) == (200, 1500)
        assert took > 6.0, "finished within the plain SIGTERM grace: nothing was proven"
        fresh = stack.wait_serving(1, timeout=60)
        assert stack.pod_names(fresh)[fresh[0]] != pod
    finally:
        await stack.close()
