"""Operator scale benchmark (`make bench-operator`): N CodingAgentServings applied at once.

For each N (default 10, 50, 200) on a private local stack with roomy fake GPU nodes: start a
fresh operator, create N small fleets (1 prefill + 1 decode of 1 GPU, a router) at once,
poll until every resource is Ready, then report per resource the time from its creation to Ready
(median, p99), the time from its last pod Ready to its Ready condition ("once its pods run"),
the operator's reconcile latency, CPU seconds, peak memory and API requests per resource.
Prints one table and writes bench/results/operator_scale.json. Bounded: each round gives up
after --timeout seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from e2e.cluster.manifests import NodeShape  # noqa: E402
from e2e.cluster.stack import ClusterHandle, run_kubectl, start_cluster  # noqa: E402
from e2e.fleet.fleetview import apply_crds  # noqa: E402
from e2e.runtime.operator_process import OperatorProcess  # noqa: E402

RESULTS = REPO_ROOT / "bench" / "results" / "operator_scale.json"
METRICS_PORT = 18081
CLK_TCK = os.sysconf("SC_CLK_TCK")


def fleet(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "serving.cas.dev/v1alpha1",
        "kind": "CodingAgentServing",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "glm-5"},
            "prefill": {"replicas": 1, "tensorParallel": 1},
            "decode": {"replicas": 1, "tensorParallel": 1},
        },
    }


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def proc_usage(pid: int) -> tuple[float, float]:
    """(CPU seconds, peak RSS MiB) of a live process from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK
    peak = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            peak = int(line.split()[1]) / 1024
    return cpu, peak


def scrape(port: int, keep: Path | None = None) -> dict[str, float]:
    """Sum each metric family of the operator's /metrics (labels folded); `keep` saves the
    raw exposition text for a closer look."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    if keep is not None:
        keep.write_text(text)
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_part, value = line.rsplit(" ", 1)
        name = name_part.split("{", 1)[0]
        totals[name] = totals.get(name, 0.0) + float(value)
        if name.startswith("cas_operator_reconcile_seconds_") and 'trigger="' in name_part:
            trigger = name_part.split('trigger="', 1)[1].split('"', 1)[0]
            key = f"{name}:{trigger}"
            totals[key] = totals.get(key, 0.0) + float(value)
        if name == "cas_operator_api_requests_total":
            verb = name_part.split('verb="', 1)[1].split('"', 1)[0]
            kind = name_part.split('kind="', 1)[1].split('"', 1)[0]
            key = f"api:{verb} {kind}"
            totals[key] = totals.get(key, 0.0) + float(value)
    return totals


class ReadyTracker:
    """Three watch threads (resources, pods, Deployments) recording, per resource, when it was
    first seen Ready, when all its (>= 3) pods were Ready, and when all its (>= 3) Deployments
    reported every replica ready (the controllers' part is done; the rest is the operator's)."""

    def __init__(self, kubeconfig: Path, namespace: str, n: int) -> None:
        from kubernetes import config

        self.api_client = config.new_client_from_config(config_file=str(kubeconfig))
        self.namespace, self.n = namespace, n
        self.ready_at: dict[str, float] = {}
        self.pods_ready_at: dict[str, float] = {}
        self.workloads_ready_at: dict[str, float] = {}
        self._pods: dict[str, dict[str, bool]] = {}
        self._workloads: dict[str, dict[str, bool]] = {}
        self._stop = threading.Event()

    def start(self) -> None:
        for target in (self._watch_resources, self._watch_pods, self._watch_workloads):
            threading.Thread(target=self._loop, args=(target,), daemon=True).start()

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.ready_at) < self.n and time.monotonic() < deadline:
            time.sleep(0.2)
        self._stop.set()

    def _loop(self, target: Any) -> None:
        """Re-open a watch that the server closed, until stopped."""
        while not self._stop.is_set():
            try:
                target()
            except Exception as exc:  # a dropped watch: log and re-open
                print(f"watch restarted: {exc}", file=sys.stderr)
                time.sleep(0.5)

    def _stream(self, list_fn: Any, *args: Any) -> Any:
        from kubernetes import watch

        w = watch.Watch()
        for event in w.stream(list_fn, *args, timeout_seconds=60, deserialize=False):
            if self._stop.is_set():
                w.stop()
                return
            yield event["object"]

    def _watch_resources(self) -> None:
        from kubernetes import client

        api = client.CustomObjectsApi(self.api_client)
        group, version, plural = "serving.cas.dev", "v1alpha1", "codingagentservings"
        for obj in self._stream(
            api.list_namespaced_custom_object, group, version, self.namespace, plural
        ):
            conds = {c["type"]: c for c in obj.get("status", {}).get("conditions", [])}
            if conds.get("Ready", {}).get("status") == "True":
                self.ready_at.setdefault(obj["metadata"]["name"], time.monotonic())

    def _watch_pods(self) -> None:
        from kubernetes import client

        api = client.CoreV1Api(self.api_client)
        for pod in self._stream(api.list_namespaced_pod, self.namespace):
            meta = pod["metadata"]
            owner = meta.get("labels", {}).get("cas.dev/name", "")
            conds = pod.get("status", {}).get("conditions", [])
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conds)
            self._record(self._pods, self.pods_ready_at, owner, meta["name"], ready)

    def _watch_workloads(self) -> None:
        from kubernetes import client

        api = client.AppsV1Api(self.api_client)
        for dep in self._stream(api.list_namespaced_deployment, self.namespace):
            meta, st = dep["metadata"], dep.get("status", {})
            owner = meta.get("labels", {}).get("cas.dev/name", "")
            ready = (
                st.get("readyReplicas", 0) >= dep["spec"].get("replicas", 1)
                and st.get("observedGeneration", 0) >= meta["generation"]
            )
            self._record(self._workloads, self.workloads_ready_at, owner, meta["name"], ready)

    @staticmethod
    def _record(
        seen: dict[str, dict[str, bool]], first: dict[str, float], owner: str, name: str, ok: bool
    ) -> None:
        if not owner:
            return
        flags = seen.setdefault(owner, {})
        flags[name] = ok
        if len(flags) >= 3 and all(flags.values()):
            first.setdefault(owner, time.monotonic())


def _stamp(conditions: list[dict[str, Any]], kind: str) -> float | None:
    """Epoch seconds of a True condition's lastTransitionTime (1 s resolution)."""
    from datetime import datetime

    for cond in conditions:
        if cond.get("type") == kind and cond.get("status") == "True":
            stamp = cond.get("lastTransitionTime")
            return (
                datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if stamp else None
            )
    return None


def server_stamped_lag(resources: dict[str, Any], pods: dict[str, Any]) -> list[float]:
    """Per Ready resource: its Ready condition's transition time minus its last pod's Ready
    transition time, both stamped by their writers (KWOK, the operator) on this host: the
    operator's share without the benchmark's own watch lag."""
    last_pod: dict[str, float] = {}
    for pod in pods["items"]:
        owner = pod["metadata"].get("labels", {}).get("cas.dev/name")
        at = _stamp(pod.get("status", {}).get("conditions", []), "Ready")
        if owner and at is not None:
            last_pod[owner] = max(last_pod.get(owner, 0.0), at)
    lags = []
    for res in resources["items"]:
        at = _stamp(res.get("status", {}).get("conditions", []), "Ready")
        name = res["metadata"]["name"]
        if at is not None and name in last_pod:
            lags.append(at - last_pod[name])
    return lags


class Round:
    """One N: apply, poll to Ready, collect numbers."""

    def __init__(self, cluster: ClusterHandle, n: int, timeout: float) -> None:
        self.cluster, self.n, self.timeout = cluster, n, timeout
        self.namespace = f"bench-{n}-{int(time.time())}"

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        return run_kubectl(
            self.cluster.kubectl_path, self.cluster.kubeconfig, *args, stdin=stdin, timeout=120
        )

    def create_all(self, names: list[str]) -> dict[str, float]:
        """Create every resource concurrently (16 clients); returns each one's creation time."""
        from concurrent.futures import ThreadPoolExecutor

        from kubernetes import client, config

        api = client.CustomObjectsApi(
            config.new_client_from_config(config_file=str(self.cluster.kubeconfig))
        )

        def create(name: str) -> tuple[str, float]:
            api.create_namespaced_custom_object(
                "serving.cas.dev", "v1alpha1", self.namespace, "codingagentservings", fleet(name)
            )
            return name, time.monotonic()

        with ThreadPoolExecutor(max_workers=16) as pool:
            return dict(pool.map(create, names))

    def poll(self) -> tuple[dict[str, float], dict[str, float], dict[str, float], dict[str, float]]:
        """Create all, then follow watches (no polling load on the shared cores): first-seen
        Ready per resource, per resource's last pod Ready and last workload ready."""
        names = [f"fleet-{i:04d}" for i in range(self.n)]
        self.kubectl("create", "namespace", self.namespace)
        tracker = ReadyTracker(self.cluster.kubeconfig, self.namespace, self.n)
        tracker.start()
        created_at = self.create_all(names)
        tracker.wait(self.timeout)
        to_ready = {k: v - created_at[k] for k, v in tracker.ready_at.items()}
        return to_ready, tracker.pods_ready_at, tracker.workloads_ready_at, tracker.ready_at

    def run(self) -> dict[str, Any]:
        log_path = REPO_ROOT / "run" / f"bench-operator-{self.n}.log"
        operator = OperatorProcess(self.cluster.kubeconfig, log_path, metrics_port=METRICS_PORT)
        operator.start()
        try:
            time.sleep(3.0)
            to_ready, pods_ready_abs, workloads_ready_abs, ready_abs = self.poll()
            cpu, peak = proc_usage(operator.pid)
            stamped = server_stamped_lag(
                json.loads(
                    self.kubectl("get", "codingagentservings", "-n", self.namespace, "-o", "json")
                ),
                json.loads(self.kubectl("get", "pods", "-n", self.namespace, "-o", "json")),
            )
            metrics = scrape(METRICS_PORT, log_path.with_suffix(".metrics"))
        finally:
            operator.stop()
            self.kubectl("delete", "namespace", self.namespace, "--wait=false")
        after_pods = [ready_abs[k] - pods_ready_abs[k] for k in ready_abs if k in pods_ready_abs]
        after_workloads = [
            ready_abs[k] - workloads_ready_abs[k] for k in ready_abs if k in workloads_ready_abs
        ]
        count = metrics.get("cas_operator_reconcile_seconds_count", 0.0) or 1.0
        return {
            "n": self.n,
            "ready": len(to_ready),
            "apply_to_ready_median_s": statistics.median(to_ready.values()) if to_ready else None,
            "apply_to_ready_p99_s": percentile(list(to_ready.values()), 0.99),
            "pods_to_ready_median_s": statistics.median(after_pods) if after_pods else None,
            "pods_to_ready_p99_s": percentile(after_pods, 0.99),
            "workloads_to_ready_median_s": (
                statistics.median(after_workloads) if after_workloads else None
            ),
            "workloads_to_ready_p99_s": percentile(after_workloads, 0.99),
            "pods_to_ready_server_stamps_median_s": (
                statistics.median(stamped) if stamped else None
            ),
            "pods_to_ready_server_stamps_p99_s": percentile(stamped, 0.99),
            "refresh_wait_mean_ms": round(
                1000
                * metrics.get("cas_operator_refresh_wait_seconds_sum", 0.0)
                / (metrics.get("cas_operator_refresh_wait_seconds_count") or 1.0),
                1,
            ),
            "reconcile_mean_ms": 1000
            * metrics.get("cas_operator_reconcile_seconds_sum", 0)
            / count,
            "reconciles": int(count),
            "reconcile_mean_ms_by_trigger": {
                t: round(
                    1000
                    * metrics.get(f"cas_operator_reconcile_seconds_sum:{t}", 0.0)
                    / (metrics.get(f"cas_operator_reconcile_seconds_count:{t}") or 1.0),
                    1,
                )
                for t in ("spec", "resume", "refresh", "timer")
            },
            "guard_tick_mean_ms": round(
                1000
                * metrics.get("cas_operator_guard_tick_seconds_sum", 0.0)
                / (metrics.get("cas_operator_guard_tick_seconds_count") or 1.0),
                1,
            ),
            "operator_cpu_s": cpu,
            "operator_peak_mib": peak,
            "api_requests_per_resource": metrics.get("cas_operator_api_requests_total", 0) / self.n,
            "problems": metrics.get("cas_operator_reconcile_problems_total", 0.0),
            "api_requests_by_call_per_resource": {
                k.removeprefix("api:"): round(v / self.n, 2)
                for k, v in sorted(metrics.items(), key=lambda kv: -kv[1])
                if k.startswith("api:")
            },
        }


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'N':>5} {'ready':>6} {'apply->Ready p50/p99 s':>24} {'pods->Ready p50/p99 s':>23} "
        f"{'workloads->Ready p50/p99 s':>27} {'reconcile ms':>13} {'CPU s':>7} "
        f"{'peak MiB':>9} {'API req/res':>11}"
    )
    lines = [head]
    nan = float("nan")
    for r in rows:
        apply_p50, pods_p50 = (
            r["apply_to_ready_median_s"] or nan,
            r["pods_to_ready_median_s"] or nan,
        )
        workloads_p50 = r.get("workloads_to_ready_median_s") or nan
        lines.append(
            f"{r['n']:>5} {r['ready']:>6} "
            f"{apply_p50:>11.2f}/{r['apply_to_ready_p99_s']:<12.2f}"
            f"{pods_p50:>10.2f}/{r['pods_to_ready_p99_s']:<12.2f}"
            f"{workloads_p50:>14.2f}/{r.get('workloads_to_ready_p99_s', nan):<12.2f}"
            f"{r['reconcile_mean_ms']:>13.1f} {r['operator_cpu_s']:>7.1f} "
            f"{r['operator_peak_mib']:>9.0f} {r['api_requests_per_resource']:>11.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="10,50,200")
    parser.add_argument("--timeout", type=float, default=600.0, help="per round, seconds")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON results file")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    shape = NodeShape(count=8, gpus=128, pods=250)
    cluster = start_cluster(REPO_ROOT / "run" / "bench-operator", shape=shape, log=print)
    try:
        apply_crds(cluster.kubectl)
        rows = []
        for n in sizes:
            rows.append(Round(cluster, n, args.timeout).run())
            print(table(rows[-1:]), flush=True)
            print(
                f"reconcile mean ms by trigger {rows[-1]['reconcile_mean_ms_by_trigger']}, "
                f"anomaly tick mean {rows[-1]['guard_tick_mean_ms']} ms",
                flush=True,
            )
            print(f"API requests per resource: {rows[-1]['api_requests_by_call_per_resource']}")
            print(
                "pods->Ready by server stamps p50/p99 s: "
                f"{rows[-1]['pods_to_ready_server_stamps_median_s']}/"
                f"{rows[-1]['pods_to_ready_server_stamps_p99_s']}, "
                f"refresh wait mean {rows[-1]['refresh_wait_mean_ms']} ms",
                flush=True,
            )
    finally:
        cluster.stop()
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rounds": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
