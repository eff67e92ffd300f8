"""`make run`: the local control plane, the CRD, the operator and the sample fleets with live
traffic, then a live view of them until Ctrl-C (or `--duration`), then a clean teardown of what
this run started.

Data flow: start (or reuse) the cluster -> apply crds/ -> start the pod runner (a thread,
:mod:`e2e.runtime.podrunner`): every engine pod of the demo namespace becomes a ``cas_engine.sim``
process at its pod IP, every router pod the real SGLang router (``sglang_router``, PD mode,
Kubernetes discovery against this API server) at its pod IP, so the operator's router
deregistration (router pod IPs) works as in a cluster; the runner also writes the Prometheus
targets -> start Prometheus (Debian's, scraping those targets every 5 s; skipped with a note
when not installed) -> start `python -m cas_operator` as a process with ``CAS_PROMETHEUS_URL``
(its anomaly loop reads PromQL) -> apply the samples -> start the load generator
(:mod:`e2e.traffic.liveload`: coding-agent chat sessions through each resource's entry Service,
its ClusterIP, with the pod network; else through a router pod; with ``--trace PATH``, real
Claude Code sessions instead, :mod:`e2e.traffic.replayload`) -> print the one ``curl`` that
sends a chat request to the fleet ->
every 2 s print the status table, pods per role, conditions, traffic (req/s, errors, TTFT p50/p90
over 30 s; with ``--trace``, the replay's achieved prefix hit rate beside its bound) and the
anomaly loop's status (rate, draining pods) -> on exit stop, in this order, the load, the
operator, the runner's processes, Prometheus and, if this run started it, the cluster (else
delete the demo namespace). Logs: ``run/make-run/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from bench.replay.prompts import Scale
from bench.replay.sources import open_source
from e2e.cluster.stack import (
    ClusterHandle,
    default_run_dir,
    load_cluster,
    run_kubectl,
    start_cluster,
)
from e2e.fleet.fleetview import apply_crds, requests_served
from e2e.fleet.livestack import LiveStack, http_ok, probed_by_runner, router_url
from e2e.paths import REPO_ROOT
from e2e.runtime.podrunner import kube_pod_lister
from e2e.traffic.liveload import LiveLoad, format_summary
from e2e.traffic.replayload import TraceReplays, replay_line

SAMPLES = ("minimal.yaml", "glm5-long-context.yaml")
DEMO_NAMESPACE = "cas-demo"
LIVE_DIR = REPO_ROOT / "run" / "make-run"
SCRAPE_INTERVAL_S = 5.0
# The sims of the sample fleets: 20x faster than the modelled GPU, quiet logs (2 cores run
# the control plane, the operator, Prometheus, ~20 sims and the routers together).
SPEEDUP = 20.0
SIM_ARGS = ["--sim-speedup", str(SPEEDUP), "--log-level", "warning"]
FAULT = {"repetition": 0.5}  # --fault-after: half of one decode's answers degenerate
# --trace: real sessions' token counts / 16 (and the sims' caches with them: 2M tokens, the
# sim's default for a GLM-5-class instance, / 16), think times x 0.05
TRACE_SCALE = Scale(tokens=16, think=0.05)
TRACE_CACHE = 2_000_000 // TRACE_SCALE.tokens
TRACE_SESSIONS = 400  # session starts per fleet at most (Mooncake: requests)


def say(msg: str) -> None:
    print(f"[run] {msg}", flush=True)


def demo_manifests() -> list[dict[str, Any]]:
    """The samples, adapted to the fake nodes: no weights volume exists on a local cluster, and
    the pod runner decides engine pods' readiness from their probes (as a kubelet would)."""
    out = []
    for name in SAMPLES:
        manifest = yaml.safe_load((REPO_ROOT / "config" / "samples" / name).read_text())
        manifest["spec"]["model"].pop("pvcName", None)
        out.append(probed_by_runner(manifest))
    return out


def prefills(manifest: dict[str, Any]) -> int:
    """The manifest's prefill instances (1 when unset: the samples' Fixed 1:1 unit)."""
    return int((manifest["spec"].get("prefill") or {}).get("replicas") or 1)


def served_model(manifest: dict[str, Any]) -> str:
    model = manifest["spec"]["model"]
    return str(model.get("servedModelName") or model["name"])


class RouterFinder:
    """Where the load generator sends a resource's requests (asked before every request; probes
    cached for `ttl_s`): with the pod network, the fleet's entry Service
    (``http://<ClusterIP>:80``, the operator's Service named after the resource, kube-proxy
    balancing over its ready router pods) once it answers ``/readiness``; without one (loopback
    mode: Services have no endpoints), ``http://<router pod IP>:8000`` of a router pod that
    answers ``/readiness`` (the router has healthy workers)."""

    def __init__(
        self, kubeconfig: Path, namespace: str, ttl_s: float = 2.0, services: bool = False
    ) -> None:
        self.list_pods = kube_pod_lister(kubeconfig, namespace)
        self.entry_ips = entry_service_ips(kubeconfig, namespace) if services else None
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._ready: dict[str, str] = {}  # resource name -> router URL
        self._at = float("-inf")

    def __call__(self, name: str) -> str | None:
        with self._lock:
            if time.monotonic() - self._at > self.ttl_s:
                with contextlib.suppress(Exception):  # API hiccup: keep the last answer
                    if self.entry_ips is not None:
                        self._ready = self._probe_services(self.entry_ips())
                    else:
                        self._ready = self._probe(self.list_pods())
                self._at = time.monotonic()
            return self._ready.get(name)

    @staticmethod
    def _probe_services(ips: dict[str, str]) -> dict[str, str]:
        urls = {name: f"http://{ip}:80" for name, ip in ips.items()}
        return {n: u for n, u in urls.items() if http_ok(f"{u}/readiness")}

    @staticmethod
    def _probe(pods: list[dict[str, Any]]) -> dict[str, str]:
        names = {(p["metadata"].get("labels") or {}).get("cas.dev/name", "") for p in pods}
        urls = {name: router_url(pods, name) for name in names}
        return {n: u for n, u in urls.items() if u and http_ok(f"{u}/readiness")}


def entry_service_ips(kubeconfig: Path, namespace: str) -> Callable[[], dict[str, str]]:
    """A function returning resource name -> ClusterIP of its entry Service (the Service the
    operator names after the resource, labelled ``cas.dev/name``, with an ``http`` port 80)."""
    from kubernetes import client, config

    core = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))  # type: ignore[no-untyped-call]

    def ips() -> dict[str, str]:
        out = {}
        for svc in core.list_namespaced_service(namespace, _request_timeout=10).items:
            name = (svc.metadata.labels or {}).get("cas.dev/name")
            ports = [p.port for p in svc.spec.ports or [] if p.name == "http"]
            if name == svc.metadata.name and ports == [80] and svc.spec.cluster_ip:
                out[name] = svc.spec.cluster_ip
        return out

    return ips


def chat_curl(url: str, model: str) -> str:
    """The one command a user can paste to send a chat request to the fleet at `url`."""
    message = {"role": "user", "content": "Write a haiku about Kubernetes."}
    body = json.dumps({"model": model, "max_tokens": 64, "messages": [message]})
    return (f"curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-d '{body}'")  # fmt: skip


class Session:
    """What this run started, so teardown stops exactly that."""

    def __init__(self, cluster: ClusterHandle, started_cluster: bool) -> None:
        self.cluster = cluster
        self.started_cluster = started_cluster
        self.live: LiveStack | None = None
        self.load: LiveLoad | None = None
        self.replays: TraceReplays | None = None
        self.finder: RouterFinder | None = None
        net = cluster.network
        self.services = net is not None and net.enabled

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        return run_kubectl(
            self.cluster.kubectl_path, self.cluster.kubeconfig, *args, stdin=stdin, check=check
        )

    def start_live(self, sim_args: list[str]) -> None:
        """Pod runner (sims, real routers), Prometheus and the operator for the demo."""
        self.live = LiveStack(
            self.cluster.kubeconfig, DEMO_NAMESPACE, LIVE_DIR, sim_args=sim_args,
            scrape_interval_s=SCRAPE_INTERVAL_S, metrics_port=8081,
            operator_log=self.cluster.run_dir / "logs" / "operator.log",
        )  # fmt: skip
        self.live.start(log=say)

    def start_load(self, manifests: list[dict[str, Any]]) -> None:
        resources = {m["metadata"]["name"]: served_model(m) for m in manifests}
        finder = RouterFinder(self.cluster.kubeconfig, DEMO_NAMESPACE, services=self.services)
        self.finder = finder
        self.load = LiveLoad(resources, finder).start()

    def start_replays(self, manifests: list[dict[str, Any]], trace: Path, rate: float) -> None:
        """Real sessions from `trace` through each resource (instead of the synthetic load)."""
        finder = RouterFinder(self.cluster.kubeconfig, DEMO_NAMESPACE, services=self.services)
        self.finder = finder
        names = [m["metadata"]["name"] for m in manifests]
        self.replays = TraceReplays(
            open_source(trace, rate, TRACE_SESSIONS, seed=1),
            {m["metadata"]["name"]: served_model(m) for m in manifests},
            {m["metadata"]["name"]: prefills(m) * TRACE_CACHE for m in manifests},
            finder, TRACE_SCALE, ttft_slo_s=4.0 / SPEEDUP,
        ).start()  # fmt: skip
        say(f"replaying real sessions from {trace} through {', '.join(names)}")

    def announce_entry(self, manifests: list[dict[str, Any]], timeout_s: float = 240) -> None:
        """Once the first resource's entry point answers, print the curl to paste."""
        if self.finder is None or not manifests:
            return
        name, model = manifests[0]["metadata"]["name"], served_model(manifests[0])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            url = self.finder(name)
            if url:
                via = "entry Service (ClusterIP, kube-proxy)" if self.services else "router pod"
                say(f"{name} answers at {url} ({via}); send it a chat request:")
                print(f"\n    {chat_curl(url, model)}\n", flush=True)
                return
            time.sleep(2.0)
        say(f"{name} did not answer within {timeout_s:.0f}s; no curl to print yet")

    def teardown(self) -> None:
        if self.load is not None:
            say("stopping the load generator")
            self.load.stop()
        if self.replays is not None:
            say("stopping the replays")
            self.replays.stop()
        if self.live is not None:
            self.live.close(log=say)
        if self.started_cluster:
            say("stopping the local cluster")
            for line in self.cluster.stop():
                say(line)
        else:
            say(f"deleting namespace {DEMO_NAMESPACE}; leaving the cluster running")
            self.kubectl("delete", "namespace", DEMO_NAMESPACE, "--wait=false", check=False)


def open_cluster() -> tuple[ClusterHandle, bool]:
    """CAS_KUBECONFIG, else a running `make cluster-up`, else a new local stack."""
    external = os.environ.get("CAS_KUBECONFIG")
    if external:
        from e2e.cluster.bins import resolve

        path = Path(external).expanduser().resolve()
        return ClusterHandle(path.parent, path, {}, kubectl_path=resolve().kubectl), False
    running = load_cluster()
    if running is not None:
        say(f"reusing the running local cluster in {running.run_dir}")
        return running, False
    say("starting the local control plane (etcd, apiserver, controllers, KWOK, LWS)")
    started = time.monotonic()
    handle = start_cluster(default_run_dir(), log=say)
    say(f"control plane ready in {time.monotonic() - started:.1f}s")
    return handle, True


def status_table(session: Session) -> str:
    """`kubectl get cas`, pods per role, traffic, the anomaly loop and conditions, one screen."""
    table = session.kubectl("get", "cas", "-n", DEMO_NAMESPACE, "-o", "wide", check=False)
    data = json.loads(session.kubectl("get", "cas", "-n", DEMO_NAMESPACE, "-o", "json") or "{}")
    pods = json.loads(session.kubectl("get", "pods", "-n", DEMO_NAMESPACE, "-o", "json") or "{}")
    summary = session.live.summary() if session.live else ""
    lines = [table.rstrip(), "", summary, ""]
    traffic = session.load.summaries() if session.load else {}
    replays = session.replays.summaries() if session.replays else {}
    for item in data.get("items", []):
        name = item["metadata"]["name"]
        per_role: dict[str, list[str]] = {}
        for pod in pods.get("items", []):
            labels = pod["metadata"].get("labels", {})
            if labels.get("cas.dev/name") == name:
                phase = pod.get("status", {}).get("phase", "?")
                per_role.setdefault(labels.get("cas.dev/role", "?"), []).append(phase)
        roles = "  ".join(
            f"{role}: {len(p)} ({','.join(sorted(set(p)))})" for role, p in sorted(per_role.items())
        )
        lines.append(f"{name}: pods {roles or 'none yet'}")
        if name in traffic:
            window = session.load.window_s if session.load else 0.0
            lines.append(f"    traffic  {format_summary(traffic[name], window)}")
        if name in replays:
            lines.append(f"    replay   {replay_line(replays[name])}")
        lines.append(f"    anomaly  {anomaly_line(item.get('status') or {})}")
        for cond in item.get("status", {}).get("conditions", []):
            lines.append(
                f"    {cond['type']:<23} {cond['status']:<6} {cond.get('reason', ''):<25} "
                f"{cond.get('message', '')[:80]}"
            )
    return "\n".join(lines)


def anomaly_line(status: dict[str, Any]) -> str:
    """The anomaly loop's view of one resource: worst pool rate, incidents, draining pods."""
    anomaly = status.get("anomaly") or {}
    parts = [f"rate {anomaly.get('rate', 'n/a')}"]
    pools = anomaly.get("pools") or {}
    if pools:
        parts.append(" ".join(f"{role} {rate:.3%}" for role, rate in sorted(pools.items())))
    if anomaly.get("fleetWide"):
        parts.append(f"FLEET-WIDE: {anomaly['fleetWide'][:60]}")
    if anomaly.get("signalUnavailable"):
        parts.append(f"signal unavailable: {anomaly['signalUnavailable'][:60]}")
    draining = status.get("draining") or []
    pods = [f"{d['pod']} ({d.get('state')}, {d.get('reason', '')[:40]})" for d in draining]
    parts.append("draining: " + (", ".join(pods) or "none"))
    return "  ".join(parts)


def inject_fault(session: Session, manifests: list[dict[str, Any]]) -> str:
    """Make the busiest serving decode sim of the first resource with speculative decoding
    (the quality gate judges only then; a cache-aware router may send one decode most of the
    traffic) repeat itself half the time; returns what was done, for the view."""
    names = [m["metadata"]["name"] for m in manifests if m["spec"].get("engine", {}).get(
        "speculative")] or [m["metadata"]["name"] for m in manifests]  # fmt: skip
    selector = f"cas.dev/name={names[0]},cas.dev/role=decode,cas.dev/serving=true"
    pods = json.loads(
        session.kubectl("get", "pods", "-n", DEMO_NAMESPACE, "-l", selector, "-o", "json") or "{}"
    )
    urls = {f"http://{p['status']['podIP']}:30000": p["metadata"]["name"]
            for p in pods.get("items", []) if p.get("status", {}).get("podIP")}  # fmt: skip
    if not urls:
        return f"no serving decode of {names[0]} to inject a fault into"
    url = max(sorted(urls), key=requests_served)
    req = urllib.request.Request(
        f"{url}/sim/fault", data=json.dumps(FAULT).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=5):
            pass
    except OSError as exc:
        return f"fault injection into {urls[url]} failed: {exc}"
    return f"{time.strftime('%H:%M:%S')} injected {FAULT} into {urls[url]}"


def live_view(
    session: Session,
    duration: float | None,
    fault_after: float | None = None,
    manifests: list[dict[str, Any]] | None = None,
) -> None:
    """Redraw every 2 s until `duration` ends (or the operator exits); with `fault_after`,
    inject the demo fault that many seconds in and keep saying so."""
    started = time.monotonic()
    deadline = started + duration if duration else None
    interactive = sys.stdout.isatty()
    fault_note = ""
    while deadline is None or time.monotonic() < deadline:
        if fault_after is not None and not fault_note and time.monotonic() - started > fault_after:
            fault_note = inject_fault(session, manifests or [])
        screen = status_table(session)
        if fault_note:
            screen += f"\n\nfault: {fault_note}"
        if interactive:
            print("\033[2J\033[H", end="")
        print(time.strftime("%H:%M:%S"), "— Ctrl-C to stop and tear down\n" + screen, flush=True)
        operator = session.live.operator if session.live else None
        if operator is not None and not operator.running():
            say(f"the operator exited:\n{operator.log_tail()}")
            return
        time.sleep(2.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, help="stop after this many seconds")
    parser.add_argument(
        "--fault-after", type=float, default=None, metavar="SECONDS",
        help="then make one decode sim repeat itself (watch the operator drain and replace it)",
    )  # fmt: skip
    parser.add_argument(
        "--trace", type=Path, default=None, metavar="PATH",
        help="replay real sessions (Claude Code session files: a folder or tarball; or "
        "Mooncake's .jsonl) through each fleet instead of the synthetic agents; the view shows "
        "the prefix hit rate the engines achieve beside the bound (an exact LRU over the "
        "fleet's prefill caches)",
    )  # fmt: skip
    parser.add_argument("--trace-rate", type=float, default=0.2,
                        help="--trace: session starts (Mooncake: requests) per second per "
                             "fleet")  # fmt: skip
    args = parser.parse_args(argv)
    if args.trace is not None and not args.trace.exists():
        parser.error(f"--trace {args.trace}: no such file or folder")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    cluster, started = open_cluster()
    session = Session(cluster, started)
    try:
        apply_crds(session.kubectl)
        sim_args = SIM_ARGS if args.trace is None else [
            *SIM_ARGS, "--sim-kv-capacity", str(TRACE_CACHE)]  # fmt: skip
        session.start_live(sim_args)
        # a previous run's namespace may still be terminating: wait for it to go first
        session.kubectl("wait", "--for=delete", f"namespace/{DEMO_NAMESPACE}", "--timeout=120s",
                        check=False)  # fmt: skip
        session.kubectl("create", "namespace", DEMO_NAMESPACE, check=False)
        manifests = demo_manifests()
        for manifest in manifests:
            session.kubectl(
                "apply", "-n", DEMO_NAMESPACE, "-f", "-", stdin=yaml.safe_dump(manifest)
            )
            say(f"applied {manifest['kind']} {manifest['metadata']['name']} in {DEMO_NAMESPACE}")
        via = "entry Service ClusterIP" if session.services else "router pod"
        if args.trace is None:
            session.start_load(manifests)
            say(f"load generator started (coding-agent sessions through each resource's {via})")
        else:
            session.start_replays(manifests, args.trace, args.trace_rate)
        if not session.services:
            net = cluster.network
            say(f"no pod network ({net.reason if net else 'external cluster'}): the entry "
                "Services have no endpoints; traffic goes to router pod IPs")  # fmt: skip
        session.announce_entry(manifests)
        live_view(session, args.duration, args.fault_after, manifests)
    except KeyboardInterrupt:
        print()
    finally:
        session.teardown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
