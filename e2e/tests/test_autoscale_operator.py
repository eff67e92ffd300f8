"""Auto mode through the OPERATOR PROCESS on the local stack: a starved prefill pool is grown,
and a decode pool whose KV is full is grown.

The minimal sample in `ratio.mode: Auto` (its model has no planner profile, so the operator
acts on measured pressure alone): 1 prefill : 2 decode sims behind the real SGLang router pod
(e2e/fleet/livestack.py). Long prompts flow; then the prefill sim is slowed 40x (`slow_prefill`)
- the skewed P:D ratio the production report reproduced its anomalies with. Only the
operator's anomaly loop may act. Guards: it must raise the prefill pool's replicas by one
step (status.autoscaler, the Deployment, a second prefill pod serving; the measured TTFT p90
up from milliseconds to seconds), keep P/D inside
ratio.min/max, never touch the decode pool, and report who owns the replicas. The reverse: a
1:1 fleet whose sims hold only DECODE_KV_TOKENS of KV, under long answers, must get a second
decode and keep its prefill pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cas_engine.sim.fleet import router_available
from e2e.fleet.fleetview import NAME, Kubectl, role_pods
from e2e.fleet.livestack import LiveStack, MakeLiveStack, http_ok, resource_live
from e2e.traffic.simload import LoadStats, set_fault, steady_traffic
from e2e.waits import wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not router_available(), reason="sglang-router not installed"),
]
ROOT = Path(__file__).resolve().parents[2]
SIM_ARGS = ["--sim-speedup", "20", "--log-level", "warning"]


def manifest() -> dict[str, Any]:
    cas: dict[str, Any] = yaml.safe_load((ROOT / "config/samples/minimal.yaml").read_text())
    cas["spec"]["ratio"] = {"mode": "Auto", "prefill": 1, "decode": 2, "min": 0.25, "max": 1.0,
                            "gpuBudget": 64}  # fmt: skip
    cas["spec"]["anomalyGuard"] = {"windowSeconds": 60}
    return cas


def get(kubectl: Kubectl, namespace: str, *what: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(kubectl("get", *what, "-n", namespace, "-o", "json"))
    return out


def ready_ips(kubectl: Kubectl, namespace: str, role: str) -> list[str]:
    return [p["status"]["podIP"] for p in role_pods(kubectl, namespace, role)
            if p.get("status", {}).get("podIP") and any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in p["status"].get("conditions", []))]  # fmt: skip


def pool_replicas(kubectl: Kubectl, namespace: str) -> dict[str, int]:
    items = get(kubectl, namespace, "deployments", "-l", f"cas.dev/name={NAME}")["items"]
    return {d["metadata"]["labels"]["cas.dev/role"]: d["spec"]["replicas"] for d in items}


@contextlib.contextmanager
def live_fleet(
    live_stack: MakeLiveStack, namespace: str, kubectl: Kubectl, cas: dict[str, Any],
    pools: tuple[int, int], sim_args: list[str] = SIM_ARGS,
) -> Iterator[tuple[LiveStack, str]]:  # fmt: skip
    """The live stack serving `cas` once `pools` (prefill, decode) pods are ready and the
    router pod answers; yields the stack and the router pod's URL."""
    stack = live_stack(sim_args)
    with resource_live(stack, kubectl, cas, log=lambda line: print(f"[live] {line}")) as router:
        counts = lambda: (len(ready_ips(kubectl, namespace, "prefill")),  # noqa: E731
                          len(ready_ips(kubectl, namespace, "decode")))  # fmt: skip
        wait_for(f"{pools[0]} prefill + {pools[1]} decode ready", lambda: counts() == pools, 60)
        wait_for("router ready", lambda: http_ok(f"{router}/readiness"), 60)
        yield stack, router


@pytest.fixture
def fleet(
    live_stack: MakeLiveStack,
    namespace: str,
    kubectl: Kubectl,
    crds: None,
) -> Iterator[tuple[LiveStack, str]]:
    with live_fleet(live_stack, namespace, kubectl, manifest(), (1, 2)) as live:
        yield live


async def test_auto_mode_grows_a_starved_prefill_pool(
    fleet: tuple[LiveStack, str], kubectl: Kubectl, namespace: str
) -> None:
    _, router = fleet
    (prefill_ip,) = ready_ips(kubectl, namespace, "prefill")
    status = get(kubectl, namespace, "cas", NAME)["status"]
    assert status["ratio"]["replicasOwner"] == "operator (Auto)"
    assert pool_replicas(kubectl, namespace) == {"prefill": 1, "decode": 2, "router": 2}
    stop, stats = asyncio.Event(), LoadStats()
    prompt = "def handler(request):\n    return route(request)\n" * 400  # ~4.8K tokens each
    load = asyncio.create_task(steady_traffic(router, stop, stats, concurrency=12, max_tokens=20,
                                              max_requests=5_000, prompt_body=prompt))  # fmt: skip
    try:
        await set_fault(f"http://{prefill_ip}:30000", {"slow_prefill": 40})
        onset, ttft_seen = time.monotonic(), [0.0]  # the highest TTFT p90 the status showed

        def grown() -> dict[str, Any] | None:
            s = get(kubectl, namespace, "cas", NAME).get("status", {})
            auto = s.get("autoscaler") or {}
            observed = auto.get("observed") or {}
            ttft_seen[0] = max(ttft_seen[0], observed.get("ttftP90Seconds") or 0.0)
            return s if auto.get("prefill", 1) >= 2 else None

        status = await asyncio.to_thread(wait_for, "Auto to add a prefill", grown, 150)
        decided = time.monotonic() - onset
        auto = status["autoscaler"]
        assert (auto["prefill"], auto["decode"]) == (2, 2), auto
        # TTFT p90 measured from the decode pods' histograms through Prometheus: a healthy sim
        # fleet answers in tens of milliseconds; the starved prefill pushes it past a second
        assert ttft_seen[0] > 1.0, ttft_seen
        assert 0.25 <= auto["prefill"] / auto["decode"] <= 1.0
        assert (
            "queue" in json.dumps(status.get("anomaly", {}).get("pressure", {})) or auto["reason"]
        ), status.get("anomaly")
        await asyncio.to_thread(
            wait_for, "a second prefill pod ready",
            lambda: len(ready_ips(kubectl, namespace, "prefill")) == 2, 60,
        )  # fmt: skip
        applied = time.monotonic() - onset
    finally:
        stop.set()
        await load
    assert pool_replicas(kubectl, namespace) == {"prefill": 2, "decode": 2, "router": 2}
    final = get(kubectl, namespace, "cas", NAME)["status"]
    assert final["ratio"]["current"] == "2:2"
    print(f"\nAuto: prefill +1 decided {decided:.1f}s and ready {applied:.1f}s after the "
          f"slowdown; {stats.ok} ok, {len(stats.failures)} failed of {stats.sent}")  # fmt: skip


DECODE_KV_TOKENS = 6_000  # four ~1.2K-token prompts fit; their outputs then overfill it


@pytest.fixture
def kv_bound_fleet(
    live_stack: MakeLiveStack,
    namespace: str,
    kubectl: Kubectl,
    crds: None,
) -> Iterator[tuple[LiveStack, str]]:
    """1 prefill : 1 decode in Auto, every sim with a KV pool of DECODE_KV_TOKENS."""
    cas = manifest()
    cas["spec"]["ratio"].update({"prefill": 1, "decode": 1})
    sims = [*SIM_ARGS, "--sim-kv-capacity", str(DECODE_KV_TOKENS)]
    with live_fleet(live_stack, namespace, kubectl, cas, (1, 1), sims) as live:
        yield live


async def test_auto_mode_grows_a_kv_bound_decode_pool(
    kv_bound_fleet: tuple[LiveStack, str], kubectl: Kubectl, namespace: str
) -> None:
    """Regression guard for the decode direction of Auto (unit-tested in test_autoscale.py
    only until now): when the decode's KV fills and requests wait for decode admission (KV over
    95%, or TTFT over the SLO with that queue), the operator must add one decode, leave the
    prefill pool alone and keep P/D in bounds."""
    _, router = kv_bound_fleet
    assert pool_replicas(kubectl, namespace) == {"prefill": 1, "decode": 1, "router": 2}
    stop, stats = asyncio.Event(), LoadStats()
    prompt = "def handler(request):\n    return route(request)\n" * 100  # ~1.2K tokens each
    load = asyncio.create_task(steady_traffic(router, stop, stats, concurrency=12, max_tokens=400,
                                              max_requests=5_000, prompt_body=prompt))  # fmt: skip
    onset = time.monotonic()
    seen = {"decodeKvUsage": 0.0, "decodeQueue": 0.0}  # the highest values the status showed
    try:

        def grown() -> dict[str, Any] | None:
            s = get(kubectl, namespace, "cas", NAME).get("status", {})
            auto = s.get("autoscaler") or {}
            for key in seen:
                seen[key] = max(seen[key], (auto.get("observed") or {}).get(key) or 0.0)
            return s if auto.get("decode", 1) >= 2 else None

        status = await asyncio.to_thread(wait_for, "Auto to add a decode", grown, 150)
        decided = time.monotonic() - onset
        auto = status["autoscaler"]
        assert (auto["prefill"], auto["decode"]) == (1, 2), auto
        # decode evidence, not a prefill problem: KV nearly full, requests waiting for admission
        assert seen["decodeKvUsage"] > 0.8 and seen["decodeQueue"] > 0, seen
        await asyncio.to_thread(
            wait_for, "a second decode pod ready",
            lambda: len(ready_ips(kubectl, namespace, "decode")) == 2, 60,
        )  # fmt: skip
        applied = time.monotonic() - onset
    finally:
        stop.set()
        await load
    assert pool_replicas(kubectl, namespace)["prefill"] == 1
    print(f"\nAuto: decode +1 decided {decided:.1f}s and ready {applied:.1f}s after load onset "
          f"(highest observed {seen}); {stats.ok} ok, {len(stats.failures)} failed of "
          f"{stats.sent}")  # fmt: skip


@pytest.fixture
def capped_fleet(
    live_stack: MakeLiveStack,
    namespace: str,
    kubectl: Kubectl,
    crds: None,
) -> Iterator[tuple[LiveStack, str]]:
    """1 prefill : 2 decode in Auto at a 24-GPU budget (three 8-GPU instances: the cap)."""
    cas = manifest()
    cas["spec"]["ratio"].update({"max": 2.0, "gpuBudget": 24, "rebalanceStabilizationSeconds": 10})
    with live_fleet(live_stack, namespace, kubectl, cas, (1, 2)) as live:
        yield live


async def test_auto_mode_at_the_budget_gives_up_a_decode_before_growing_prefill(
    capped_fleet: tuple[LiveStack, str], kubectl: Kubectl, namespace: str
) -> None:
    """Regression guard for drain-confirm-then-grow at the GPU budget (unit-tested only until
    now): a starved prefill at the cap must get its second instance by taking one from the
    idle decode pool, and never while the removed decode pod still exists: engine pods
    (terminating ones included) never hold more than the 24-GPU budget."""
    _, router = capped_fleet
    (prefill_ip,) = ready_ips(kubectl, namespace, "prefill")
    stop, stats = asyncio.Event(), LoadStats()
    prompt = "def handler(request):\n    return route(request)\n" * 400  # ~4.8K tokens each
    load = asyncio.create_task(steady_traffic(router, stop, stats, concurrency=12, max_tokens=20,
                                              max_requests=5_000, prompt_body=prompt))  # fmt: skip
    most_pods = [0]  # the most engine pods (any state) seen at once: 8 GPUs each

    def rebalanced() -> bool:
        pods = get(kubectl, namespace, "pods", "-l", f"cas.dev/name={NAME}")["items"]
        engines = [p for p in pods if p["metadata"]["labels"]["cas.dev/role"] != "router"]
        most_pods[0] = max(most_pods[0], len(engines))
        return pool_replicas(kubectl, namespace) == {"prefill": 2, "decode": 1, "router": 2}

    try:
        await set_fault(f"http://{prefill_ip}:30000", {"slow_prefill": 40})
        onset = time.monotonic()
        await asyncio.to_thread(wait_for, "Auto to move an instance to prefill", rebalanced, 180)
        moved = time.monotonic() - onset
        await asyncio.to_thread(
            wait_for, "a second prefill pod ready",
            lambda: rebalanced() and len(ready_ips(kubectl, namespace, "prefill")) == 2, 60,
        )  # fmt: skip
    finally:
        stop.set()
        await load
    assert most_pods[0] <= 3, f"{most_pods[0]} engine pods of 8 GPUs at a 24-GPU budget"
    auto = get(kubectl, namespace, "cas", NAME)["status"]["autoscaler"]
    assert (auto["prefill"], auto["decode"]) == (2, 1), auto
    print(f"\nAuto at the cap: 1:2 -> 2:1 in {moved:.1f}s after the slowdown, at most "
          f"{most_pods[0]} engine pods; {stats.ok} ok, {len(stats.failures)} failed of "
          f"{stats.sent}")  # fmt: skip
