"""An engine fleet on the local cluster for anomaly tests and the anomaly benchmark.

Data flow: :class:`AnomalyStack` applies a Deployment of decode engine pods (the labels the
operator's builders set), a :class:`~e2e.runtime.podrunner.PodRunner` (thread) turns each KWOK
pod into a sim process at the pod IP, :class:`LabelRouter` sends chat traffic only to pods labelled
``cas.dev/serving=true`` that answer ``/health`` (as the SGLang router's Kubernetes discovery
does) and retries a failed request on another worker, and :meth:`AnomalyStack.tick` runs one
``anomaly_tick`` (observe -> decide -> act) with the operator's own ``Kube`` client.
Ownership: the stack owns its runner thread, traffic tasks and the sims the runner started;
``close()`` stops them. The namespace and its Deployment belong to the caller.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from kubernetes import config

from cas_engine.sim.fleet import free_port
from cas_operator.anomaly.act import LoopState, TickResult, anomaly_tick
from cas_operator.anomaly.detect import Policy
from cas_operator.anomaly.drain import DrainPolicy
from cas_operator.api import constants as c
from cas_operator.api.models import AnomalyGuardSpec
from cas_operator.desired.resources.pools import PRESTOP, SHUTDOWN_MARGIN_S
from cas_operator.kube import Kube
from cas_operator.observe import MetricsSource, ScrapeSource
from cas_operator.routers import HttpRouters, RouterEndpoint, Routers
from e2e.cluster.manifests import READINESS_TOLERATION
from e2e.cluster.podnet import load_for_kubeconfig
from e2e.runtime.podrunner import PodRunner, kube_pod_deleter, kube_pod_lister, kube_status_patcher
from e2e.traffic.simload import REPETITION_MARK
from e2e.waits import wait_for

NAME = "anomaly-demo"
SELECTOR = {c.LABEL_NAME: NAME, c.LABEL_APP_NAME: c.APP_ENGINE}
TIMEOUT = aiohttp.ClientTimeout(total=30)
Event = tuple[str, str, str]


def deployment(replicas: int, drain_seconds: int | None = None) -> dict[str, Any]:
    """Decode engine pods in null (non-PD) mode, labelled, annotated and probed like the
    operator's; Ready only once their sim answers (the runner probes: READINESS_TOLERATION).
    `drain_seconds`: the operator's preStop hook and grace period too."""
    labels = {**SELECTOR, c.LABEL_ROLE: c.ROLE_DECODE}
    manifest = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": f"{NAME}-decode", "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {
                    "labels": {**labels, c.LABEL_SERVING: "true"},
                    "annotations": {"prometheus.io/scrape": "true",
                                    "prometheus.io/port": str(c.ENGINE_PORT)},
                },
                "spec": {"tolerations": [READINESS_TOLERATION], "containers": [{
                    "name": "engine",
                    "image": "cas.local/sim:none",
                    "command": ["python3", "-m", "cas_engine.launch_server"],
                    "args": ["--disaggregation-mode", "null", "--served-model-name", "sim",
                             "--host", "0.0.0.0", "--port", str(c.ENGINE_PORT)],
                    "ports": [{"name": "http", "containerPort": c.ENGINE_PORT}],
                    "readinessProbe": {"httpGet": {"path": "/health", "port": "http"},
                                       "periodSeconds": 5, "failureThreshold": 3},
                }]},
            },
        },
    }  # fmt: skip
    if drain_seconds is not None:
        pod = manifest["spec"]["template"]["spec"]
        pod["terminationGracePeriodSeconds"] = drain_seconds + SHUTDOWN_MARGIN_S
        pod["containers"][0]["lifecycle"] = {"preStop": {"exec": {"command": [
            *PRESTOP, "--port", str(c.ENGINE_PORT), "--grace", str(drain_seconds)]}}}  # fmt: skip
    return manifest


def lone_pod(name: str, sim_fault: str) -> dict[str, Any]:
    """One engine pod as `deployment`'s template makes them, without a controller, its sim
    started with `sim_fault` (e.g. ``hang=1``: /health silent, so the pod stays not Ready)."""
    template = deployment(1)["spec"]["template"]
    spec = template["spec"]
    spec["containers"][0]["args"] += ["--sim-fault", sim_fault]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {**template["metadata"], "name": name}, "spec": spec}  # fmt: skip


def sims_up(urls: list[str]) -> bool:
    """Every URL answers /health with 200."""
    try:
        for url in urls:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
                if resp.status != 200:
                    return False
    except OSError:
        return False
    return True


def stop_process(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM, then SIGKILL after `grace_s`, as a kubelet ends a container: the router (0.3.2)
    usually exits in ~3 s, but once took longer than 10 s under a loaded machine (its
    Kubernetes discovery watch), which failed the test's teardown though the test passed."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def url_of(pod: dict[str, Any]) -> str:
    return f"http://{pod['status']['podIP']}:{c.ENGINE_PORT}"


def live_serving(kube: Kube, namespace: str) -> list[dict[str, Any]]:
    """Pods labelled serving that have an IP and are not being deleted."""
    pods = kube.list("Pod", namespace, {**SELECTOR, c.LABEL_SERVING: "true"})
    return [p for p in pods if p.get("status", {}).get("podIP")
            and not p["metadata"].get("deletionTimestamp")]  # fmt: skip


class LabelRouter:
    """Routes like the SGLang router's Kubernetes discovery: only to labelled, healthy pods
    (list refreshed every 0.5 s); a 5xx or connection error is retried on another worker."""

    def __init__(self, kube: Kube, namespace: str) -> None:
        self.kube, self.namespace = kube, namespace
        self.workers: list[str] = []
        self.ok = 0
        self.failures: list[str] = []

    def refresh(self) -> None:
        urls = [url_of(p) for p in live_serving(self.kube, self.namespace)]
        self.workers = [u for u in urls if u in self.workers or sims_up([u])]

    async def discover(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.to_thread(self.refresh)
            await asyncio.sleep(0.5)

    async def one(self, session: aiohttp.ClientSession, i: int) -> None:
        body = {"model": "sim", "max_tokens": 200,
                "messages": [{"role": "user", "content": f"agent step {i}"}]}  # fmt: skip
        errors = []
        for url in random.sample(self.workers, k=len(self.workers)):
            try:
                async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                    text = await resp.text()
            except (aiohttp.ClientError, TimeoutError) as exc:
                errors.append(repr(exc))
                continue
            if resp.status == 200 and REPETITION_MARK not in text:
                self.ok += 1
                return
            errors.append(f"{resp.status} from {url}")
        self.failures.append("; ".join(errors) or "no worker")

    async def traffic(self, stop: asyncio.Event, concurrency: int = 6) -> None:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:

            async def worker(w: int) -> None:
                i = 0
                while not self.workers and not stop.is_set():
                    await asyncio.sleep(0.2)
                while not stop.is_set():
                    i += 1
                    await self.one(session, w * 1_000_000 + i)

            await asyncio.gather(*[worker(w) for w in range(concurrency)])


@dataclass
class AnomalyStack:
    """See the module docstring. Build with :meth:`start`; always :meth:`close`."""

    kube: Kube
    namespace: str
    runner: PodRunner
    spec: AnomalyGuardSpec = field(default_factory=lambda: AnomalyGuardSpec(window_seconds=60))
    policy: Policy = field(default_factory=lambda: Policy(min_checked=10, cooldown_seconds=0))
    drain_policy: DrainPolicy = field(
        default_factory=lambda: DrainPolicy(min_wait_seconds=3, grace_seconds=30)
    )
    state: LoopState = field(default_factory=LoopState)
    source: MetricsSource = field(default_factory=lambda: ScrapeSource(timeout_seconds=2.0))
    events: list[Event] = field(default_factory=list)
    router: LabelRouter | None = None
    routers: Routers | None = None  # what anomaly_tick deregisters draining pods from
    _router_proc: subprocess.Popen[bytes] | None = None
    _stop_runner: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _stop_traffic: asyncio.Event | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        kubeconfig: Path,
        namespace: str,
        log_dir: Path,
        speedup: float = 40.0,
        sd_file: Path | None = None,
    ) -> AnomalyStack:
        """Start the pod runner (writing Prometheus targets to `sd_file` when given)."""
        api_client = config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
        kube = Kube(api_client)
        runner = PodRunner(kube_pod_lister(kubeconfig, namespace), log_dir, sd_file,
                           extra_args=["--sim-speedup", f"{speedup:g}"],
                           restart_backoff_s=2.0,
                           patch_status=kube_status_patcher(kubeconfig),
                           delete_pod=kube_pod_deleter(kubeconfig),
                           network=load_for_kubeconfig(kubeconfig))  # fmt: skip
        stack = cls(kube=kube, namespace=namespace, runner=runner)
        stack._thread = threading.Thread(
            target=runner.run, args=(stack._stop_runner, 0.5), daemon=True
        )
        stack._thread.start()
        return stack

    def deploy(
        self,
        kubectl: Callable[..., str],
        replicas: int,
        timeout: float = 90,
        drain_seconds: int | None = None,
    ) -> list[str]:
        """Apply the Deployment; wait until `replicas` pods serve with healthy sims; URLs."""
        body = yaml.safe_dump(deployment(replicas, drain_seconds))
        kubectl("apply", "-n", self.namespace, "-f", "-", stdin=body)
        return self.wait_serving(replicas, timeout)

    def serving(self) -> list[dict[str, Any]]:
        return live_serving(self.kube, self.namespace)

    def wait_serving(self, count: int, timeout: float) -> list[str]:
        pods = wait_for(f"{count} serving pods", lambda: len(self.serving()) == count and
                        self.serving(), timeout)  # fmt: skip
        urls = [url_of(p) for p in pods]
        wait_for("sims healthy", lambda: sims_up(urls), timeout)
        return urls

    def pod_names(self, urls: list[str]) -> dict[str, str]:
        """URL -> pod name of the serving pods."""
        return {url_of(p): p["metadata"]["name"] for p in self.serving() if url_of(p) in urls}

    def start_sglang_router(self, kubeconfig: Path, log_dir: Path) -> str:
        """The real SGLang router with Kubernetes discovery of serving pods (KUBECONFIG from
        the local cluster); `routers` then points anomaly_tick at it. Returns its URL."""
        port = free_port()
        argv = [sys.executable, "-m", "cas_engine.sim.router_launch",
                "sglang_router.launch_router", "--host", "127.0.0.1",
                "--port", str(port), "--prometheus-port", str(free_port()),
                "--service-discovery", "--selector", *[f"{k}={v}" for k, v in SELECTOR.items()],
                f"{c.LABEL_SERVING}=true", "--service-discovery-namespace", self.namespace,
                "--service-discovery-port", str(c.ENGINE_PORT), "--policy", "round_robin",
                "--log-level", "info"]  # fmt: skip
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(log_dir / "router.log", "wb") as log:
            self._router_proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "KUBECONFIG": str(kubeconfig)},
            )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        self.routers = HttpRouters(lambda: [RouterEndpoint(url)])
        return url

    async def start_traffic(self, concurrency: int = 6) -> LabelRouter:
        self.router, self._stop_traffic = LabelRouter(self.kube, self.namespace), asyncio.Event()
        self._tasks = [
            asyncio.create_task(self.router.discover(self._stop_traffic)),
            asyncio.create_task(self.router.traffic(self._stop_traffic, concurrency)),
        ]
        await asyncio.to_thread(wait_for, "traffic", lambda: self.router and self.router.ok, 30)
        return self.router

    async def stop_traffic(self) -> None:
        if self._stop_traffic is not None:
            self._stop_traffic.set()
            await asyncio.gather(*self._tasks)
            self._tasks = []

    async def tick(self) -> TickResult:
        """One anomaly_tick at wall-clock now; its events are also kept in `events`."""
        result = await asyncio.to_thread(
            anomaly_tick, self.kube, self.source, name=NAME, namespace=self.namespace,
            spec=self.spec, state=self.state, now=time.time(), policy=self.policy,
            drain_policy=self.drain_policy, routers=self.routers,
        )  # fmt: skip
        self.events += result.events
        return result

    async def tick_until(
        self, done: Callable[[TickResult], bool], timeout: float, every: float = 1.0
    ) -> TickResult | None:
        """Tick every `every` s until `done(result)`; None after `timeout`."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            await asyncio.sleep(every)
            result = await self.tick()
            if done(result):
                return result
        return None

    async def close(self) -> None:
        await self.stop_traffic()
        if self._router_proc is not None:
            await asyncio.to_thread(stop_process, self._router_proc, 10.0)
        self._stop_runner.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
