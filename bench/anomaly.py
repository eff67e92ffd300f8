"""Anomaly reaction benchmark: ``python bench/anomaly.py [--direct] [--injections N]``.

Operator mode (default, the product's path; needs Debian's ``prometheus`` and sglang-router):
the CRDs are applied and the minimal sample (4 decodes, NEXTN speculative decoding so the
engines' quality gate judges outputs, ``anomalyGuard.windowSeconds`` 60) goes into a fresh
namespace of the local cluster. :class:`e2e.fleet.livestack.LiveStack` runs the rest as in
e2e/tests/test_anomaly_operator.py: the pod runner turns engine pods into sims and the router pod
into the real SGLang router at its pod IP, a real Prometheus scrapes the sims, and
``python -m cas_operator -n <namespace>`` is a separate process - nothing here calls the loop.
Steady chat traffic flows through the router pod. Per injection one serving decode's sim gets a
repetition fault; measured from the onset: (a) out of rotation = its ``cas.dev/serving`` label
gone, (b) replacement serving = a new decode pod listed by the router pod's ``/workers`` that
has served requests; client failures after the router dropped the faulty pod are counted (must
be 0). After each injection the pool's drain cooldown (60 s) passes before the next one. Then
a healthy-but-noisy phase (every decode at 5 bad outputs per 10,000) counts false drains.

Direct mode (``--direct``, the earlier harness): a Deployment of sims, real Prometheus and
router, and this process calling ``anomaly_tick`` every ``--tick`` seconds
(e2e/fleet/anomaly_stack.py).

Cluster: the running ``make cluster-up`` stack; when none runs, a private one is started in
``run/bench-anomaly-<pid>/`` (pod IPs 127.23.x.y, apart from other local stacks) and stopped at
the end. The namespace is deleted and every process started here stopped at the end.

Offline part (always): the same planner replayed over hours of synthetic recorded counters of
a healthy noisy fleet (16 pods), false drains per hour at a 5 s tick.

Prints one table and writes a JSON result (default ``bench/results/anomaly.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import yaml

# Run as a script (like the other bench/*.py): the harness package e2e/ is at the repo root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cas_operator.anomaly.detect import GuardState, Policy, decide
from cas_operator.anomaly.drain import DrainPolicy
from cas_operator.api.models import AnomalyGuardSpec
from cas_operator.observe import PrometheusSource
from cas_operator.observe.types import PodSignals, PodView
from e2e.cluster.manifests import NodeShape
from e2e.cluster.stack import ClusterError, load_cluster, run_kubectl, start_cluster
from e2e.fleet.anomaly_stack import AnomalyStack
from e2e.fleet.fleetview import (
    NAME,
    Kubectl,
    apply_crds,
    cas_status,
    control_key,
    requests_served,
    role_pods,
    router_workers,
    serving_decodes,
    speculative_sample,
)
from e2e.fleet.livestack import LiveStack, http_ok, probed_by_runner, router_url
from e2e.runtime.prometheus import file_sd_scrape_config, prometheus_binary, start_prometheus
from e2e.traffic.simload import LoadStats, set_fault, steady_traffic
from e2e.waits import wait_for

NOISE_RATE = 0.0005  # repetition probability per request on healthy pods
ROOT = Path(__file__).resolve().parent.parent


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


async def live_direct(args: argparse.Namespace, kubeconfig: Path, run: Path) -> dict[str, Any]:
    """The cluster part, this process calling `anomaly_tick` (``--direct``)."""
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
    out: dict[str, Any] = {
        "mode": "direct",
        "out_of_rotation_s": [],
        "replacement_serving_s": [],
        "misses": 0,
    }
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
        await stack.tick_until(lambda r: False, timeout=args.noisy_seconds, every=args.tick)
        false = sum(1 for e in stack.events if e[1] == "PodDraining") - before
        out.update(
            healthy_seconds=args.noisy_seconds,
            false_drains=false,
            false_drains_per_hour=false * 3600 / args.noisy_seconds,
        )
    finally:
        await _stop_load(stop, traffic, load, out)
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


# -- operator mode: the operator process acts on its own ----------------------------------------

SIM_ARGS = ["--sim-speedup", "40", "--log-level", "warning"]
COOLDOWN_S = Policy().cooldown_seconds  # the pool's drain cooldown in the operator


async def _stop_load(
    stop: asyncio.Event, traffic: asyncio.Task[Any] | None, load: LoadStats, out: dict[str, Any]
) -> None:
    """End the load generator and record its request counts in `out`."""
    stop.set()
    if traffic is not None:
        await traffic
    out.update(requests_ok=load.ok, requests_failed=len(load.failures),
               failures_sample=load.failures[:3])  # fmt: skip


def create_namespace(kubectl: Kubectl, name: str) -> None:
    """`name` created and ready for pods (its default service account exists)."""
    kubectl("create", "namespace", name)
    wait_for(f"namespace {name}'s default service account",
             lambda: kubectl("get", "serviceaccount", "default", "-n", name, "-o", "name",
                             check=False), 30)  # fmt: skip


class LoadWatch:
    """Samples the 1-minute load average every 10 s while the bench runs (shared machine)."""

    def __init__(self) -> None:
        self.samples: list[float] = []

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.samples.append(os.getloadavg()[0])
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 10.0)

    def summary(self) -> dict[str, float]:
        s = self.samples or [os.getloadavg()[0]]
        return {
            "min": min(s),
            "median": statistics.median(s),
            "max": max(s),
            "cpus": os.cpu_count() or 0,
        }


async def live_operator(
    args: argparse.Namespace, kubeconfig: Path, kubectl_exe: Path | None, run: Path
) -> dict[str, Any]:
    """The cluster part through the operator process (see the module docstring)."""
    kubectl = _kubectl(kubeconfig, kubectl_exe)
    namespace = f"bench-anomaly-{uuid.uuid4().hex[:6]}"
    out: dict[str, Any] = {"mode": "operator", "namespace": namespace, "decodes": args.pods,
                           "out_of_rotation_s": [], "replacement_serving_s": [], "misses": 0,
                           "failures_after_router_drop": []}  # fmt: skip
    await asyncio.to_thread(apply_crds, kubectl)
    await asyncio.to_thread(create_namespace, kubectl, namespace)
    stack = LiveStack(kubeconfig, namespace, run / "live", sim_args=SIM_ARGS,
                      scrape_interval_s=args.scrape, operator_args=("-n", namespace))  # fmt: skip
    stop, load, watch_stop, watch = asyncio.Event(), LoadStats(), asyncio.Event(), LoadWatch()
    watcher = asyncio.create_task(watch.run(watch_stop))
    traffic: asyncio.Task[None] | None = None
    try:
        stack.start(log=lambda line: print(f"[live] {line}", flush=True))
        if stack.prometheus is None:
            raise RuntimeError("prometheus missing: the operator mode measures the PromQL path")
        manifest = probed_by_runner(speculative_sample(args.pods, args.window))
        kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(manifest))
        router = await asyncio.to_thread(_wait_fleet, kubectl, namespace, args.pods)
        print(f"[bench] router {router} routes to {args.pods} decodes", flush=True)
        traffic = asyncio.create_task(
            steady_traffic(router, stop, load, concurrency=4, max_requests=500_000)
        )
        await asyncio.to_thread(
            wait_for, "the operator's first decode anomaly rate",
            lambda: "decode" in (cas_status(kubectl, namespace).get("anomaly") or {}).get(
                "pools", {}), 90,
        )  # fmt: skip
        for i in range(args.injections):
            await _inject_operator(kubectl, namespace, router, args, load, out, i)
        out.update(await _noisy_phase(kubectl, namespace, args.noisy_seconds))
    except (TimeoutError, RuntimeError, ClusterError) as exc:  # keep what was measured
        out["error"] = str(exc)
        print(f"[bench] stopped: {exc}", flush=True)
    finally:
        await _stop_load(stop, traffic, load, out)
        watch_stop.set()
        await watcher
        out["load_average_1m"] = watch.summary()
        stack.close(log=lambda line: print(f"[live] {line}", flush=True))
        if stack.operator is not None:
            out["operator_log_tail"] = stack.operator.log_tail(10).splitlines()
        kubectl("delete", "namespace", namespace, "--wait=false", "--ignore-not-found",
                check=False)  # fmt: skip
    return out


def _wait_fleet(kubectl: Kubectl, namespace: str, decodes: int) -> str:
    """The router pod's URL once it is ready and lists every serving decode."""
    key = wait_for("the keys Secret", lambda: control_key(kubectl, namespace), 90)
    router: str = wait_for("router pod", lambda: router_url(
        role_pods(kubectl, namespace, "router"), NAME), 90)  # fmt: skip
    serving = wait_for(f"{decodes} serving decodes", lambda: len(
        now := serving_decodes(kubectl, namespace)) == decodes and now, 120)  # fmt: skip
    wait_for("the router to list every decode", lambda: http_ok(f"{router}/readiness")
             and set(serving.values()) <= router_workers(router, key), 90)  # fmt: skip
    return router


async def _inject_operator(kubectl: Kubectl, namespace: str, router: str,
                           args: argparse.Namespace, load: LoadStats, out: dict[str, Any],
                           i: int) -> None:  # fmt: skip
    """One fault on one serving decode; only the operator process may react. Appends the two
    times (or a miss) and the failures after the router dropped the pod to `out`; returns
    once the pool's drain cooldown has passed and the pool serves `args.pods` decodes again."""
    before = await asyncio.to_thread(serving_decodes, kubectl, namespace)
    key = control_key(kubectl, namespace)
    listed = router_workers(router, key)
    candidates = sorted(n for n, u in before.items() if u in listed)
    bad = candidates[i % len(candidates)]
    bad_url = before[bad]
    await set_fault(bad_url, {"repetition": 0.5})
    onset = time.monotonic()
    print(f"[bench] injection {i + 1}: repetition 0.5 on {bad}", flush=True)
    try:
        await asyncio.to_thread(
            wait_for, f"{bad} out of rotation",
            lambda: bad not in serving_decodes(kubectl, namespace), 120,
        )  # fmt: skip
    except TimeoutError:
        out["misses"] += 1
        await set_fault(bad_url, {"repetition": 0.0})
        return
    drained_at = time.monotonic()
    out["out_of_rotation_s"].append(drained_at - onset)
    await asyncio.to_thread(wait_for, "the router pod to drop the drained decode",
                            lambda: bad_url not in router_workers(router, key), 60)  # fmt: skip
    dropped_at = time.monotonic()
    fresh: dict[str, str] = await asyncio.to_thread(
        wait_for, "a replacement decode serving",
        lambda: len(now := serving_decodes(kubectl, namespace)) == args.pods
        and bad not in now and now, 180,
    )  # fmt: skip
    new_url = next(u for n, u in fresh.items() if n not in before)
    await asyncio.to_thread(
        wait_for, "the replacement to serve requests through the router",
        lambda: new_url in router_workers(router, key) and requests_served(new_url) > 0, 90,
    )  # fmt: skip
    out["replacement_serving_s"].append(time.monotonic() - onset)
    out["failures_after_router_drop"].append(len(load.failures_started_after(dropped_at)))
    print(f"[bench] injection {i + 1}: out of rotation {drained_at - onset:.1f}s, replacement "
          f"serving {out['replacement_serving_s'][-1]:.1f}s", flush=True)  # fmt: skip
    await asyncio.to_thread(
        wait_for, "status.draining empty",
        lambda: not cas_status(kubectl, namespace).get("draining"), 90,
    )  # fmt: skip
    rest = drained_at + COOLDOWN_S + 5.0 - time.monotonic()  # + one operator tick
    if rest > 0:
        await asyncio.sleep(rest)


async def _noisy_phase(kubectl: Kubectl, namespace: str, seconds: float) -> dict[str, Any]:
    """Every serving decode at NOISE_RATE for `seconds`; a decode that leaves rotation, shows up
    in status.draining or disappears is a false drain."""
    start_pods = await asyncio.to_thread(serving_decodes, kubectl, namespace)
    for url in start_pods.values():
        await set_fault(url, {"repetition": NOISE_RATE})
    print(f"[bench] noisy phase: {len(start_pods)} decodes at repetition {NOISE_RATE} "
          f"for {seconds:.0f}s", flush=True)  # fmt: skip
    drained: set[str] = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        now = await asyncio.to_thread(serving_decodes, kubectl, namespace)
        status = await asyncio.to_thread(cas_status, kubectl, namespace)
        drained |= set(start_pods) - set(now)
        drained |= {d["pod"] for d in status.get("draining") or []}
        await asyncio.sleep(2.0)
    for url in start_pods.values():
        with contextlib.suppress(Exception):
            await set_fault(url, {"repetition": 0.0})
    return {"healthy_seconds": seconds, "false_drains": len(drained),
            "false_drains_per_hour": len(drained) * 3600 / seconds,
            "false_drained_pods": sorted(drained)}  # fmt: skip


def _kubectl(kubeconfig: Path, exe: Path | None = None) -> Any:
    """``kubectl(*args, stdin=None, check=True)`` bound to the cluster of `kubeconfig`."""
    if exe is None:
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
    p = argparse.ArgumentParser(prog="python bench/anomaly.py")
    p.add_argument(
        "--direct",
        action="store_true",
        help="this process calls anomaly_tick (the earlier harness), not the operator",
    )
    p.add_argument("--injections", type=int, default=None, help="default 3 (direct: 5)")
    p.add_argument("--pods", type=int, default=4, help="decode pods")
    p.add_argument("--scrape", type=float, default=5.0, help="Prometheus scrape interval (s)")
    p.add_argument("--tick", type=float, default=5.0, help="direct mode: anomaly_tick period (s)")
    p.add_argument("--window", type=int, default=60, help="anomalyGuard.windowSeconds")
    p.add_argument(
        "--noisy-seconds",
        "--healthy-seconds",
        dest="noisy_seconds",
        type=float,
        default=None,
        help="healthy-but-noisy phase (s), default 180 (direct: 120)",
    )
    p.add_argument("--offline-hours", type=float, default=6.0)
    p.add_argument("--out", type=Path, default=Path("bench/results/anomaly.json"))
    args = p.parse_args(argv)
    if args.injections is None:
        args.injections = 5 if args.direct else 3
    if args.noisy_seconds is None:
        args.noisy_seconds = 120.0 if args.direct else 180.0
    result: dict[str, Any] = {"params": {k: str(v) for k, v in vars(args).items()}}
    result["offline"] = offline_false_drains(args.offline_hours)
    rc = 0
    if prometheus_binary() is None:
        print("live part skipped: needs prometheus (apt-get install prometheus)", file=sys.stderr)
    else:
        try:
            result["live"] = _run_live(args)
        except (ClusterError, TimeoutError, RuntimeError) as exc:
            print(f"live part failed: {exc}", file=sys.stderr)
            result["live_error"] = str(exc)
            rc = 1
    _print(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return rc


def _run_live(args: argparse.Namespace) -> dict[str, Any]:
    """The live part on the running local cluster, or on a private one started (and stopped)
    here when none runs."""
    with (
        _cluster() as (kubeconfig, kubectl_exe),
        tempfile.TemporaryDirectory(prefix="bench-anomaly-") as tmp,
    ):
        if args.direct:
            return asyncio.run(live_direct(args, kubeconfig, Path(tmp)))
        return asyncio.run(live_operator(args, kubeconfig, kubectl_exe, Path(tmp)))


@contextlib.contextmanager
def _cluster() -> Iterator[tuple[Path, Path | None]]:
    """(kubeconfig, kubectl) of ``make cluster-up``'s stack, else of a private stack in
    run/bench-anomaly-<pid>/ (pod IPs 127.23.x.y) stopped and removed on exit."""
    running = load_cluster()
    if running is not None:
        yield running.kubeconfig, running.kubectl_path
        return
    run_dir = ROOT / "run" / f"bench-anomaly-{os.getpid()}"
    print(f"no running cluster: starting a private one in {run_dir}", flush=True)
    handle = start_cluster(run_dir, shape=NodeShape(pod_cidr_prefix="127.23"),
                           log=lambda msg: print(f"[cluster] {msg}", flush=True))  # fmt: skip
    try:
        yield handle.kubeconfig, handle.kubectl_path
    finally:
        for msg in handle.stop():
            print(f"[cluster] {msg}", flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)


def _print(result: dict[str, Any]) -> None:
    off, lv = result["offline"], result.get("live")
    rows = [
        ("offline: false drains / hour (16 pods, 5 s tick)",
         f"{off['false_drains_per_hour']:.2f} ({off['false_drains']} in {off['hours']:g} h)"),
        ("offline: decide() per tick (ms)", f"{off['decide_ms_per_tick']:.2f}"),
    ]  # fmt: skip
    if lv:
        how = "operator process" if lv.get("mode") == "operator" else "direct anomaly_tick"
        rows += [
            (f"live ({how}): onset -> out of rotation (s, median / max)",
             _summary(lv["out_of_rotation_s"])),
            ("live: onset -> replacement serving (s, median / max)",
             _summary(lv["replacement_serving_s"])),
            ("live: injections measured / missed",
             f"{len(lv['out_of_rotation_s'])} / {lv['misses']}"),
        ]  # fmt: skip
        if "false_drains" in lv:
            rows.append(("live: false drains / hour (healthy noisy)",
                         f"{lv['false_drains_per_hour']:.1f} ({lv['false_drains']} in "
                         f"{lv['healthy_seconds']:.0f} s)"))  # fmt: skip
        if "failures_after_router_drop" in lv:
            rows.append(("live: client failures after the router dropped the pod",
                         str(sum(lv["failures_after_router_drop"]))))  # fmt: skip
        rows.append(("live: client requests ok / failed (all, incl. faulty answers)",
                     f"{lv['requests_ok']} / {lv['requests_failed']}"))  # fmt: skip
        if "load_average_1m" in lv:
            la = lv["load_average_1m"]
            rows.append(("live: load average 1 min (min / median / max, cpus)",
                         f"{la['min']:.1f} / {la['median']:.1f} / {la['max']:.1f}, "
                         f"{la['cpus']}"))  # fmt: skip
        if "error" in lv:
            rows.append(("live: stopped early", lv["error"]))
    if "live_error" in result:
        rows.append(("live: failed", result["live_error"]))
    width = max(len(r[0]) for r in rows)
    print("\nanomaly reaction benchmark")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


if __name__ == "__main__":
    raise SystemExit(main())
