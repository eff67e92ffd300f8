"""The whole loop on the local stack: real API server, KWOK pods made real by the pod runner,
`guard_tick` (observe -> decide -> act) with the operator's own `Kube` client.

A Deployment of three decode engine pods carries the labels the operator's builders set; the
pod runner starts a sim at each pod IP; a client discovers workers by the `cas.dev/serving`
label (as the router does) and retries a failed request on another worker. One pod's sim gets a
repetition fault: the loop must take it out of rotation (label removed, annotations set), wait
for it to idle, delete it, and the Deployment's replacement must come up serving - with no
failed client request and no other pod touched.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes import config

from cas_operator.api import constants as c
from cas_operator.api.models import AnomalyGuardSpec
from cas_operator.drain import ANNOTATION_DRAINING_SINCE, DrainPolicy, LoopState, guard_tick
from cas_operator.kube import Kube
from cas_operator.observe import ScrapeSource
from cas_operator.planning.anomaly import Policy
from e2e.podrunner import PodRunner, kube_pod_lister
from e2e.simload import REPETITION_MARK, set_fault

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(240)]
NAME = "anomaly-demo"
SELECTOR = {c.LABEL_NAME: NAME, c.LABEL_APP_NAME: c.APP_ENGINE}
TIMEOUT = aiohttp.ClientTimeout(total=30)


def deployment(replicas: int) -> dict[str, Any]:
    labels = {**SELECTOR, c.LABEL_ROLE: c.ROLE_DECODE}
    return {
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
                "spec": {"containers": [{
                    "name": "engine",
                    "image": "cas.local/sim:none",
                    "command": ["python3", "-m", "cas_engine.launch_server"],
                    "args": ["--disaggregation-mode", "null", "--served-model-name", "sim",
                             "--host", "0.0.0.0", "--port", str(c.ENGINE_PORT)],
                    "ports": [{"name": "http", "containerPort": c.ENGINE_PORT}],
                }]},
            },
        },
    }  # fmt: skip


def sims_up(urls: list[str]) -> bool:
    try:
        for url in urls:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
                if resp.status != 200:
                    return False
    except OSError:
        return False
    return True


class LabelRouter:
    """A client that routes like the SGLang router's Kubernetes discovery: only to pods with
    `cas.dev/serving=true` (list refreshed every 0.5 s), retrying elsewhere on 5xx/errors."""

    def __init__(self, kube: Kube, namespace: str) -> None:
        self.kube, self.namespace = kube, namespace
        self.workers: list[str] = []
        self.ok = 0
        self.failures: list[str] = []

    def refresh(self) -> None:
        """Labelled pods whose engine answers /health (the router health-checks new workers;
        KWOK marks pods Ready before their sim listens)."""
        pods = self.kube.list("Pod", self.namespace, {**SELECTOR, c.LABEL_SERVING: "true"})
        urls = [
            f"http://{p['status']['podIP']}:{c.ENGINE_PORT}"
            for p in pods
            if p.get("status", {}).get("podIP") and not p["metadata"].get("deletionTimestamp")
        ]
        self.workers = [u for u in urls if u in self.workers or sims_up([u])]

    async def discover(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.to_thread(self.refresh)
            await asyncio.sleep(0.5)

    async def one(self, session: aiohttp.ClientSession, i: int) -> None:
        """One request; on a 5xx or a connection error, retried on another worker."""
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
                    await self.one(session, w * 100000 + i)

            await asyncio.gather(*[worker(w) for w in range(concurrency)])


def wait_for(what: str, probe: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.fixture
def runner(kubeconfig: Path, namespace: str, tmp_path: Path) -> Iterator[PodRunner]:
    r = PodRunner(kube_pod_lister(kubeconfig, namespace), tmp_path / "sims",
                  extra_args=["--sim-speedup", "40"], restart_backoff_s=2.0)  # fmt: skip
    stop = threading.Event()
    thread = threading.Thread(target=r.run, args=(stop, 0.5), daemon=True)
    thread.start()
    try:
        yield r
    finally:
        stop.set()
        thread.join(30)


def serving_ready(kube: Kube, namespace: str, count: int) -> list[dict[str, Any]] | None:
    pods = kube.list("Pod", namespace, {**SELECTOR, c.LABEL_SERVING: "true"})
    live = [p for p in pods if p.get("status", {}).get("podIP")
            and not p["metadata"].get("deletionTimestamp")]  # fmt: skip
    return live if len(live) == count else None


async def test_faulty_pod_is_drained_and_replaced_without_failed_requests(
    kubeconfig: Path, namespace: str, kubectl: Callable[..., str], runner: PodRunner
) -> None:
    """Regression: the act step against a real API server - the bad pod leaves rotation (and
    only it), is deleted once idle, its controller's replacement serves, no client fails."""
    import yaml

    kube = Kube(config.new_client_from_config(config_file=str(kubeconfig)))
    kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(deployment(3)))
    pods = await asyncio.to_thread(
        wait_for, "3 serving pods", lambda: serving_ready(kube, namespace, 3), 90
    )
    urls = [f"http://{p['status']['podIP']}:{c.ENGINE_PORT}" for p in pods]
    await asyncio.to_thread(wait_for, "sims healthy", lambda: sims_up(urls), 60)

    router, stop = LabelRouter(kube, namespace), asyncio.Event()
    tasks = [asyncio.create_task(router.discover(stop)), asyncio.create_task(router.traffic(stop))]
    bad = pods[1]["metadata"]["name"]
    await set_fault(urls[1], {"repetition": 0.5})
    onset = time.monotonic()
    source, state = ScrapeSource(timeout_seconds=2.0), LoopState()
    spec = AnomalyGuardSpec(window_seconds=60)
    policy = Policy(min_checked=10, cooldown_seconds=0)
    drain_policy = DrainPolicy(min_wait_seconds=3, grace_seconds=30)
    events: list[tuple[str, str, str]] = []
    out_of_rotation = deleted = None
    try:
        while time.monotonic() - onset < 120 and deleted is None:
            await asyncio.sleep(1.0)
            result = await asyncio.to_thread(
                guard_tick, kube, source, name=NAME, namespace=namespace, spec=spec,
                state=state, now=time.time(), policy=policy, drain_policy=drain_policy,
            )  # fmt: skip
            events += result.events
            names = {e[1] for e in result.events}
            if "PodDraining" in names and out_of_rotation is None:
                out_of_rotation = time.monotonic() - onset
            if "PodReplaced" in names:
                deleted = time.monotonic() - onset
        assert out_of_rotation is not None and deleted is not None, events
        fresh = await asyncio.to_thread(
            wait_for, "replacement serving", lambda: serving_ready(kube, namespace, 3), 60
        )
        fresh_urls = [f"http://{p['status']['podIP']}:{c.ENGINE_PORT}" for p in fresh]
        await asyncio.to_thread(wait_for, "replacement sim", lambda: sims_up(fresh_urls), 60)
        replaced = time.monotonic() - onset
        await asyncio.sleep(2.0)  # traffic over the new pod too
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    print(f"\nanomaly: out of rotation {out_of_rotation:.1f}s, deleted {deleted:.1f}s, "
          f"replacement serving {replaced:.1f}s after onset; {router.ok} requests ok")  # fmt: skip
    drained = [e for e in events if e[1] == "PodDraining"]
    assert len(drained) == 1 and bad in drained[0][2], events
    assert bad not in {p["metadata"]["name"] for p in fresh}
    assert all(ANNOTATION_DRAINING_SINCE not in (p["metadata"].get("annotations") or {})
               for p in fresh)  # fmt: skip
    assert router.failures == [] and router.ok > 0, router.failures[:3]
