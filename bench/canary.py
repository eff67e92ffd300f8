"""Canary rollouts under load: ``python bench/canary.py [--out FILE]`` (``make bench-canary``).

One fleet of the minimal sample (1 prefill : 2 decodes, NEXTN, sims as the engine pods, the
real SGLang router per revision, the operator as its own process, Prometheus feeding the
analysis: e2e/fleet/livestack.py) served through the local stack's Gateway (Traefik), with the
operator's HTTPRoute carrying the canary's weight. Bounded load through the Gateway records
every request and the prefill/decode pair that served it (e2e/traffic/recorded.py). Two runs:

- ``promote``: an engine change through steps 25% and 50% (30 s each, analysis over 30 s),
  then promotion; reports the seconds of each step (from its weight taking effect to the next
  weight), the seconds from the spec change to the old revision gone, requests failed and
  served by a mixed-revision pair;
- ``bad canary``: an engine change whose decodes corrupt half their requests' KV (the sim's
  ``decode_corruption`` fault) at a 25% step analysed over 60 s; reports the seconds from the
  canary's first traffic to the abort and to its weight back at 0, the requests it served
  (exposure) against the target (its weight x the requests of one analysis window), requests
  failed, and mixed pairs.

Prints a table and writes ``bench/results/canary.json``; exits non-zero when a request failed
in ``promote``, any mixed pair was served, the bad canary was not aborted within one window
(+ one tick), or it served requests after its weight went back to 0.
Cluster: the running ``make cluster-up`` stack (with its pod network), or a private one.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.anomaly import _kubectl, create_namespace
from e2e.cluster.stack import ClusterHandle, load_cluster, start_cluster
from e2e.fleet.canaryview import (
    answers,
    canary_sample,
    patch_engine,
    rollout,
    route_weight,
    serving_stably,
    workloads_of,
)
from e2e.fleet.fleetview import NAME, Kubectl, apply_crds
from e2e.fleet.livestack import LiveStack, probed_by_runner
from e2e.paths import REPO_ROOT
from e2e.traffic.recorded import PodBook, RecordedLoad, check_pairs
from e2e.waits import wait_for

SIM_ARGS = ["--sim-speedup", "10", "--log-level", "warning"]
WORKERS, TOKENS = 4, 200
TICK_S = 5.0


class Watch:
    """Polls the rollout once a second and keeps when each canary weight took effect."""

    def __init__(self, kubectl: Kubectl, namespace: str) -> None:
        self.kubectl, self.namespace = kubectl, namespace
        self.weights: list[tuple[float, int]] = []  # (monotonic, weight in the route)
        self.last: dict[str, Any] = {}

    def poll(self) -> dict[str, Any]:
        self.last = rollout(self.kubectl, self.namespace)
        weight = route_weight(self.kubectl, self.namespace)
        if weight is not None and (not self.weights or self.weights[-1][1] != weight):
            self.weights.append((time.monotonic(), weight))
        return self.last

    def until(self, what: str, done: Callable[[dict[str, Any]], bool], timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if done(self.poll()):
                return time.monotonic()
            time.sleep(1.0)
        raise TimeoutError(f"{what}: not within {timeout:.0f}s (last: {self.last})")


@contextlib.contextmanager
def fleet(
    kubeconfig: Path, run: Path, cas: dict[str, Any], gateway: str
) -> Iterator[tuple[Kubectl, str, LiveStack]]:
    """A namespace with the live stack and `cas` Ready and reachable through the Gateway."""
    kubectl = _kubectl(kubeconfig)
    namespace = f"bench-canary-{uuid.uuid4().hex[:6]}"
    apply_crds(kubectl)
    create_namespace(kubectl, namespace)
    stack = LiveStack(kubeconfig, namespace, run / namespace, sim_args=SIM_ARGS,
                      scrape_interval_s=2.0, operator_args=("-n", namespace))  # fmt: skip
    try:
        stack.start(log=lambda line: print(f"[live] {line}", flush=True))
        kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(probed_by_runner(cas)))
        wait_for("the fleet Ready", lambda: serving_stably(kubectl, namespace), 180)
        wait_for("the Gateway to reach the fleet", lambda: answers(gateway), 120)
        yield kubectl, namespace, stack
    finally:
        stack.close(log=lambda line: print(f"[live] {line}", flush=True))
        kubectl("delete", "namespace", namespace, "--wait=false", "--ignore-not-found",
                check=False)  # fmt: skip
        # No pod runner plays the kubelet any more: the pods would hold their nodes' GPUs
        # until their grace ran out, and the next run's fleet could not schedule.
        kubectl("delete", "pods", "--all", "-n", namespace, "--force", "--grace-period=0",
                "--wait=false", "--ignore-not-found", check=False)  # fmt: skip


def promote(kubeconfig: Path, run: Path, gateway: str) -> dict[str, Any]:
    steps = [{"weight": 25, "pauseSeconds": 30}, {"weight": 50, "pauseSeconds": 30}]
    cas = canary_sample(gateway=True, steps=steps)
    with fleet(kubeconfig, run, cas, gateway) as (kubectl, namespace, _):
        book = PodBook(kubectl, namespace, NAME).start()
        load = RecordedLoad(gateway, workers=WORKERS, tokens=TOKENS).start()
        time.sleep(10)
        old = serving_stably(kubectl, namespace)["revision"]  # type: ignore[index]
        watch = Watch(kubectl, namespace)
        changed = time.monotonic()
        patch_engine(kubectl, namespace, {"env": [{"name": "CAS_BENCH_BUILD", "value": "2"}]})
        watch.until("promoted", lambda s: s.get("phase") == "Stable"
                    and s.get("stableRevision") not in (None, old), 600)  # fmt: skip
        gone = watch.until("the old revision retired",
                           lambda s: not workloads_of(kubectl, namespace, old), 600)  # fmt: skip
        served = load.stop()
        book.stop()
    check = check_pairs(served, book)
    # seconds each weight held, from taking effect in the route to the next one
    per_step = {
        f"{weight}%": round(t2 - t1, 1)
        for (t1, weight), (t2, _) in itertools.pairwise(watch.weights[1:])
    }
    return {
        "run": "promote",
        "weights": [w for _, w in watch.weights],
        "step_seconds": per_step,
        "seconds_to_promoted_and_retired": round(gone - changed, 1),
        "sent": len(served),
        "failed": len(check.failed),
        "mixed_pairs": len(check.mixed),
        "unknown_pairs": len(check.unknown),
        "by_revision": check.by_revision,
    }


def bad_canary(kubeconfig: Path, run: Path, gateway: str) -> dict[str, Any]:
    window = 60
    steps = [{"weight": 25, "pauseSeconds": window}]
    cas = canary_sample(gateway=True, steps=steps, windowSeconds=window)
    with fleet(kubeconfig, run, cas, gateway) as (kubectl, namespace, _):
        book = PodBook(kubectl, namespace, NAME).start()
        load = RecordedLoad(gateway, workers=WORKERS, tokens=TOKENS).start()
        time.sleep(10)
        watch = Watch(kubectl, namespace)
        patch_engine(kubectl, namespace, {"args": ["--sim-fault", "decode_corruption=0.5"]})
        onset = watch.until("traffic on the canary", lambda s: int(s.get("weight", 0)) > 0, 300)
        canary = watch.last["canaryRevision"]
        aborted = watch.until("aborted", lambda s: s.get("phase") == "Aborted", window + 60)
        zero = watch.until("weight back at 0", lambda _: watch.weights[-1][1] == 0, 60)
        time.sleep(20)
        served = load.stop()
        book.stop()
    check = check_pairs(served, book)
    window_traffic = [s for s in served if onset <= s.started < onset + window]
    after = [s for s in served if s.ok and s.started > zero + 3
             and book.revision(s.decode, s.ended) == canary]  # fmt: skip
    exposed = check.by_revision.get(canary, 0) + sum(1 for s in check.failed if s.started >= onset)
    return {
        "run": "bad canary",
        "weight": 25,
        "window_seconds": window,
        "seconds_onset_to_abort": round(aborted - onset, 1),
        "seconds_onset_to_weight_0": round(zero - onset, 1),
        "exposed": exposed,
        "exposure_target": round(0.25 * len(window_traffic), 1),
        "served_after_weight_0": len(after),
        "sent": len(served),
        "failed": len(check.failed),
        "mixed_pairs": len(check.mixed),
        "reason": watch.last.get("reason", ""),
    }


@contextlib.contextmanager
def cluster() -> Iterator[ClusterHandle]:
    """`make cluster-up`'s stack, else a private one (with its pod network and Gateway)."""
    running = load_cluster()
    if running is not None:
        yield running
        return
    run_dir = REPO_ROOT / "run" / f"bench-canary-{os.getpid()}"
    handle = start_cluster(run_dir, log=lambda msg: print(f"[cluster] {msg}", flush=True))
    try:
        yield handle
    finally:
        for msg in handle.stop():
            print(f"[cluster] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/canary.py")
    p.add_argument("--out", type=Path, default=Path("bench/results/canary.json"))
    args = p.parse_args(argv)
    with cluster() as handle:
        gateway = handle.gateway_url
        if gateway is None:
            print("the cluster runs no Gateway (start it with its pod network)", file=sys.stderr)
            return 2
        run = REPO_ROOT / "run" / f"bench-canary-live-{os.getpid()}"
        results = [promote(handle.kubeconfig, run, gateway),
                   bad_canary(handle.kubeconfig, run, gateway)]  # fmt: skip
    good, bad = results
    print(
        f"\npromote: weights {good['weights']}, seconds each weight held {good['step_seconds']}, "
        f"{good['seconds_to_promoted_and_retired']} s to promoted and retired; "
        f"{good['sent']} sent, {good['failed']} failed, {good['mixed_pairs']} mixed pairs"
    )
    print(f"bad canary at {bad['weight']}%: aborted {bad['seconds_onset_to_abort']} s after its "
          f"first traffic (window {bad['window_seconds']} s), weight 0 after "
          f"{bad['seconds_onset_to_weight_0']} s; exposed {bad['exposed']} requests (target "
          f"<= {bad['exposure_target']}), {bad['served_after_weight_0']} after weight 0; "
          f"{bad['sent']} sent, {bad['failed']} failed, "
          f"{bad['mixed_pairs']} mixed pairs")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    ok = (good["failed"] == 0 and good["mixed_pairs"] == 0 and bad["mixed_pairs"] == 0
          and bad["seconds_onset_to_abort"] <= bad["window_seconds"] + TICK_S
          and bad["served_after_weight_0"] == 0)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
