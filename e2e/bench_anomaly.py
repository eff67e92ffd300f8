"""Anomaly reaction benchmark: ``python -m e2e.bench_anomaly [--injections N] [--out FILE]``.

Live part (needs the local cluster, ``make cluster-up``, and Debian's ``prometheus``): a
Deployment of decode engine pods run by the pod runner, scraped by a real Prometheus every
``--scrape`` seconds (file_sd targets written by the runner), steady traffic from a client that
discovers workers by label, and ``guard_tick`` every ``--tick`` seconds reading PromQL - the
production path. For each injection one serving pod's sim gets a repetition fault; measured
from the fault's onset: time until the pod is out of rotation (label removed) and until its
replacement serves again. Then a healthy-but-noisy phase (every pod at 5 bad outputs per
10,000) counts false drains, reported per hour.

Offline part (always): the same planner replayed over hours of synthetic recorded counters of
a healthy noisy fleet (16 pods), false drains per hour at a 5 s tick.

Prints one table and writes a JSON result (default ``bench/results/anomaly.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from cas_operator.api.models import AnomalyGuardSpec
from cas_operator.drain import DrainPolicy
from cas_operator.observe import PrometheusSource
from cas_operator.planning.anomaly import GuardState, PodSignals, PodView, Policy, decide
from e2e.anomaly_stack import AnomalyStack, wait_for
from e2e.cluster import load_cluster, run_kubectl
from e2e.prometheus import file_sd_scrape_config, prometheus_binary, start_prometheus
from e2e.simload import LoadStats, set_fault, steady_traffic

NOISE_RATE = 0.0005  # repetition probability per request on healthy pods


def offline_false_drains(hours: float, pods: int = 16, seed: int = 7) -> dict[str, Any]:
    """Replay a healthy noisy fleet's counters (5 s ticks, 300 s window) through `decide`."""
    rng = np.random.default_rng(seed)
    tick, window = 5.0, 300
    ticks = int(hours * 3600 / tick)
    back = int(window / tick)
    per_tick = rng.poisson(20.0, size=(ticks, pods)).astype(float)
    rates = rng.uniform(2e-4, 8e-4, size=pods)  # each pod its own residual rate
    trips = rng.binomial(per_tick.astype(int), rates).astype(float)
    cum_c, cum_t = np.cumsum(per_tick, axis=0), np.cumsum(trips, axis=0)
    spec, state, drains, started = AnomalyGuardSpec(), GuardState(), 0, time.perf_counter()
    for t in range(back, ticks):
        checked = cum_c[t] - cum_c[t - back]
        tripped = cum_t[t] - cum_t[t - back]
        views = [
            PodView(f"d{i}", "decode", True, True, None,
                    PodSignals(checked=float(checked[i]), trips_low_accept=float(tripped[i]),
                               trips_high_accept=0.0))
            for i in range(pods)
        ]  # fmt: skip
        decision = decide(spec, views, state, t * tick)
        state = decision.state
        drains += len(decision.drains)
    elapsed = time.perf_counter() - started
    return {
        "hours": hours,
        "pods": pods,
        "false_drains": drains,
        "false_drains_per_hour": drains / hours,
        "decide_ms_per_tick": 1000 * elapsed / max(1, ticks - back),
    }


async def live(args: argparse.Namespace, kubeconfig: Path, run: Path) -> dict[str, Any]:
    """The cluster part (see the module docstring)."""
    namespace = f"bench-anomaly-{uuid.uuid4().hex[:6]}"
    kubectl = _kubectl(kubeconfig)
    kubectl("create", "namespace", namespace)
    sd = run / "targets.json"
    sd.write_text("[]")
    prom = start_prometheus(run, [file_sd_scrape_config(sd, args.scrape)], interval_s=args.scrape)
    stack = AnomalyStack.start(kubeconfig, namespace, run / "sims", sd_file=sd)
    stack.source = PrometheusSource(prom.url, stale_seconds=6 * args.scrape)
    stack.spec = AnomalyGuardSpec(window_seconds=args.window)
    stack.policy = Policy(cooldown_seconds=0)  # injections follow each other closely
    stack.drain_policy = DrainPolicy()
    out: dict[str, Any] = {"out_of_rotation_s": [], "replacement_serving_s": [], "misses": 0}
    stop, load = asyncio.Event(), LoadStats()
    traffic: asyncio.Task[None] | None = None
    try:
        router_url = stack.start_sglang_router(kubeconfig, run / "router")
        urls = await asyncio.to_thread(stack.deploy, kubectl, args.pods, 120)
        await asyncio.sleep(3.0)  # the router's discovery adds the workers
        traffic = asyncio.create_task(steady_traffic(router_url, stop, load, max_requests=10**7))
        await asyncio.sleep(2 * args.scrape)  # Prometheus has scraped every pod
        for i in range(args.injections):
            await _inject_once(stack, args, out, i)
            urls = await asyncio.to_thread(stack.wait_serving, args.pods, 120)
        for url in urls:
            await set_fault(url, {"repetition": NOISE_RATE})
        before = sum(1 for e in stack.events if e[1] == "PodDraining")
        await stack.tick_until(lambda r: False, timeout=args.healthy_seconds, every=args.tick)
        false = sum(1 for e in stack.events if e[1] == "PodDraining") - before
        out.update(
            healthy_seconds=args.healthy_seconds,
            false_drains=false,
            false_drains_per_hour=false * 3600 / args.healthy_seconds,
        )
    finally:
        stop.set()
        if traffic is not None:
            await traffic
        out.update(requests_ok=load.ok, requests_failed=len(load.failures),
                   failures_sample=load.failures[:3])  # fmt: skip
        await stack.close()
        prom.stop()
        kubectl("delete", "namespace", namespace, "--wait=false", check=False)
    return out


async def _inject_once(stack: AnomalyStack, args: argparse.Namespace, out: dict[str, Any],
                       i: int) -> None:  # fmt: skip
    pods = stack.serving()
    target = pods[i % len(pods)]
    url = f"http://{target['status']['podIP']}:30000"
    await set_fault(url, {"repetition": 0.5})
    onset = time.monotonic()
    drained = await stack.tick_until(
        lambda r: any(e[1] == "PodDraining" for e in r.events), timeout=120, every=args.tick
    )
    if drained is None:
        out["misses"] += 1
        await set_fault(url, {"repetition": 0.0})
        return
    out["out_of_rotation_s"].append(time.monotonic() - onset)
    await stack.tick_until(
        lambda r: any(e[1] == "PodReplaced" for e in r.events), timeout=180, every=args.tick
    )
    await asyncio.to_thread(wait_for, "replacement", lambda: len(stack.serving()) == args.pods, 120)
    await asyncio.to_thread(stack.wait_serving, args.pods, 120)
    out["replacement_serving_s"].append(time.monotonic() - onset)


def _kubectl(kubeconfig: Path) -> Any:
    """``kubectl(*args, stdin=None, check=True)`` bound to the running cluster."""
    cluster = load_cluster()
    exe = cluster.kubectl_path if cluster is not None else None

    def kubectl(*a: str, stdin: str | None = None, check: bool = True, timeout: float = 60) -> str:
        return run_kubectl(exe, kubeconfig, *a, stdin=stdin, check=check, timeout=timeout)

    return kubectl


def _summary(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} / {max(values):.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m e2e.bench_anomaly")
    p.add_argument("--injections", type=int, default=5)
    p.add_argument("--pods", type=int, default=4)
    p.add_argument("--scrape", type=float, default=5.0, help="Prometheus scrape interval (s)")
    p.add_argument("--tick", type=float, default=5.0, help="operator timer interval (s)")
    p.add_argument("--window", type=int, default=60, help="anomalyGuard.windowSeconds")
    p.add_argument("--healthy-seconds", type=float, default=120.0)
    p.add_argument("--offline-hours", type=float, default=6.0)
    p.add_argument("--out", type=Path, default=Path("bench/results/anomaly.json"))
    args = p.parse_args(argv)
    result: dict[str, Any] = {"params": {k: str(v) for k, v in vars(args).items()}}
    result["offline"] = offline_false_drains(args.offline_hours)
    cluster = load_cluster()
    if cluster is None or prometheus_binary() is None:
        print("live part skipped: needs 'make cluster-up' and prometheus", file=sys.stderr)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-anomaly-") as tmp:
            result["live"] = asyncio.run(live(args, cluster.kubeconfig, Path(tmp)))
    _print(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


def _print(result: dict[str, Any]) -> None:
    off, lv = result["offline"], result.get("live")
    rows = [
        ("offline: false drains / hour (16 pods, 5 s tick)",
         f"{off['false_drains_per_hour']:.2f} ({off['false_drains']} in {off['hours']:g} h)"),
        ("offline: decide() per tick (ms)", f"{off['decide_ms_per_tick']:.2f}"),
    ]  # fmt: skip
    if lv:
        rows += [
            ("live: onset -> out of rotation (s, median / max)", _summary(lv["out_of_rotation_s"])),
            ("live: onset -> replacement serving (s, median / max)",
             _summary(lv["replacement_serving_s"])),
            ("live: injections missed", str(lv["misses"])),
            ("live: false drains / hour (healthy noisy)",
             f"{lv['false_drains_per_hour']:.1f} ({lv['false_drains']} in "
             f"{lv['healthy_seconds']:.0f} s)"),
            ("live: client requests ok / failed",
             f"{lv['requests_ok']} / {lv['requests_failed']}"),
        ]  # fmt: skip
    width = max(len(r[0]) for r in rows)
    print("\nanomaly reaction benchmark")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


if __name__ == "__main__":
    raise SystemExit(main())
