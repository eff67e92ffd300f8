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
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from e2e.cluster import ClusterHandle, run_kubectl, start_cluster  # noqa: E402
from e2e.manifests import NodeShape  # noqa: E402
from e2e.operator_process import OperatorProcess  # noqa: E402

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


def scrape(port: int) -> dict[str, float]:
    """Sum each metric family of the operator's /metrics (labels folded)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_part, value = line.rsplit(" ", 1)
        name = name_part.split("{", 1)[0]
        totals[name] = totals.get(name, 0.0) + float(value)
    return totals


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

    def poll(self) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """Create all, then poll: first-seen Ready per resource and per resource's last pod."""
        names = [f"fleet-{i:04d}" for i in range(self.n)]
        self.kubectl("create", "namespace", self.namespace)
        created_at = self.create_all(names)
        ready_at: dict[str, float] = {}
        pods_ready_at: dict[str, float] = {}
        deadline = time.monotonic() + self.timeout
        while len(ready_at) < self.n and time.monotonic() < deadline:
            now = time.monotonic()
            items = json.loads(self.kubectl("get", "cas", "-n", self.namespace, "-o", "json"))
            for item in items["items"]:
                conds = {c["type"]: c for c in item.get("status", {}).get("conditions", [])}
                if conds.get("Ready", {}).get("status") == "True":
                    ready_at.setdefault(item["metadata"]["name"], now)
            pods = json.loads(self.kubectl("get", "pods", "-n", self.namespace, "-o", "json"))
            per_owner: dict[str, list[bool]] = {}
            for pod in pods["items"]:
                owner = pod["metadata"]["labels"].get("cas.dev/name", "")
                conds = {
                    c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])
                }
                per_owner.setdefault(owner, []).append(conds.get("Ready") == "True")
            for owner, flags in per_owner.items():
                if len(flags) >= 3 and all(flags):
                    pods_ready_at.setdefault(owner, now)
            time.sleep(0.25)
        to_ready = {k: v - created_at[k] for k, v in ready_at.items()}
        return to_ready, pods_ready_at, ready_at

    def run(self) -> dict[str, Any]:
        log_path = REPO_ROOT / "run" / f"bench-operator-{self.n}.log"
        operator = OperatorProcess(self.cluster.kubeconfig, log_path, metrics_port=METRICS_PORT)
        operator.start()
        try:
            time.sleep(3.0)
            to_ready, pods_ready_abs, ready_abs = self.poll()
            cpu, peak = proc_usage(operator.pid)
            metrics = scrape(METRICS_PORT)
        finally:
            operator.stop()
            self.kubectl("delete", "namespace", self.namespace, "--wait=false")
        after_pods = [ready_abs[k] - pods_ready_abs[k] for k in ready_abs if k in pods_ready_abs]
        count = metrics.get("cas_operator_reconcile_seconds_count", 0.0) or 1.0
        return {
            "n": self.n,
            "ready": len(to_ready),
            "apply_to_ready_median_s": statistics.median(to_ready.values()) if to_ready else None,
            "apply_to_ready_p99_s": percentile(list(to_ready.values()), 0.99),
            "pods_to_ready_median_s": statistics.median(after_pods) if after_pods else None,
            "pods_to_ready_p99_s": percentile(after_pods, 0.99),
            "reconcile_mean_ms": 1000
            * metrics.get("cas_operator_reconcile_seconds_sum", 0)
            / count,
            "reconciles": int(count),
            "operator_cpu_s": cpu,
            "operator_peak_mib": peak,
            "api_requests_per_resource": metrics.get("cas_operator_api_requests_total", 0) / self.n,
            "problems": metrics.get("cas_operator_reconcile_problems_total", 0.0),
        }


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'N':>5} {'ready':>6} {'apply->Ready p50/p99 s':>24} {'pods->Ready p50/p99 s':>23} "
        f"{'reconcile ms':>13} {'CPU s':>7} {'peak MiB':>9} {'API req/res':>11}"
    )
    lines = [head]
    nan = float("nan")
    for r in rows:
        apply_p50, pods_p50 = (
            r["apply_to_ready_median_s"] or nan,
            r["pods_to_ready_median_s"] or nan,
        )
        lines.append(
            f"{r['n']:>5} {r['ready']:>6} "
            f"{apply_p50:>11.2f}/{r['apply_to_ready_p99_s']:<12.2f}"
            f"{pods_p50:>10.2f}/{r['pods_to_ready_p99_s']:<12.2f}"
            f"{r['reconcile_mean_ms']:>13.1f} {r['operator_cpu_s']:>7.1f} "
            f"{r['operator_peak_mib']:>9.0f} {r['api_requests_per_resource']:>11.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="10,50,200")
    parser.add_argument("--timeout", type=float, default=600.0, help="per round, seconds")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    shape = NodeShape(count=8, gpus=128, pods=250)
    cluster = start_cluster(REPO_ROOT / "run" / "bench-operator", shape=shape, log=print)
    try:
        kubectl = [cluster.kubectl_path, cluster.kubeconfig]
        run_kubectl(*kubectl, "apply", "--server-side", "-f", str(REPO_ROOT / "crds"))
        crd = "crd/codingagentservings.serving.cas.dev"
        run_kubectl(*kubectl, "wait", "--timeout=60s", "--for=condition=Established", crd)
        rows = []
        for n in sizes:
            rows.append(Round(cluster, n, args.timeout).run())
            print(table(rows[-1:]), flush=True)
    finally:
        cluster.stop()
    print(table(rows))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"rounds": rows}, indent=2))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
