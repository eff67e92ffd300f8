"""Pod-removal paths under load: ``python bench/lifecycle.py [--out FILE]``.

One fleet of the minimal sample (sims as the engine pods, the real SGLang router in PD mode,
the operator as its own process: e2e/fleet/livestack.py) takes a bounded coding-agent load
through its entry Service's ClusterIP (kube-proxy on the local stack's pod network): a few
agents in a loop, streaming and non-streaming, long generations (`ignore_eos`, so every answer
must hold exactly the tokens asked for). Then each path runs in turn, and waits until the
fleet has converged (status at the new counts, nothing draining, one revision left):

- ``operator upgrade``: the fleet was made by an older build (``e2e.runtime.older_operator``,
  which renders the engine pods differently); it is replaced by this build, which must hold
  the running revision (``status.heldRevision``) and restart no engine pod (``restarted``);
- ``decode 4 -> 2`` and ``prefill 3 -> 1``: a spec change;
- ``kubectl scale 2 -> 1``: the scale subresource (decode);
- ``engine change``: a new revision; the old one leaves the entry point, then goes;
- ``operator restart mid-drain``: ``kubectl scale`` 1 -> 2, then 2 -> 1, and the operator is
  SIGKILLed while a decode is Retiring and started again.

Per path: requests sent while it ran, failed (an HTTP error or no answer), cut (an answer or a
stream that ended short of its tokens), retried (a connection that closed or was refused
before the request went out, retried once as the OpenAI SDK does; a second such error is a
failure), and the seconds until converged. Prints a table and
writes ``bench/results/lifecycle.json``: a list of ``{path, sent, failed, cut, seconds}``.
- ``node drain (evictions)``: ``kubectl drain`` of the node a decode runs on (the Eviction API,
  the pools' PodDisruptionBudgets honoured); its pod leaves every router, finishes what it
  runs (preStop) and is replaced on another node.

Cluster: the running ``make cluster-up`` stack, or a private one (bench/anomaly.py's helper).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.anomaly import _cluster, _kubectl, create_namespace
from e2e.fleet.fleetview import NAME, Kubectl, apply_crds, cas_status
from e2e.fleet.livestack import LiveStack, probed_by_runner
from e2e.paths import REPO_ROOT
from e2e.waits import wait_for

SIM_ARGS = ["--sim-speedup", "4", "--log-level", "warning"]
TOKENS = (300, 1500)  # short and long generations, alternating per agent
TIMEOUT = aiohttp.ClientTimeout(total=300)


@dataclass
class Request:
    started: float
    ended: float = 0.0
    failed: bool = False
    cut: bool = False
    retried: bool = False  # a connection that closed before the request went out, retried
    error: str = ""


@dataclass
class Load:
    """The agents' requests; every one recorded with its outcome."""

    url: str
    agents: int = 4
    done: list[Request] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            await asyncio.gather(*(self._agent(session, a) for a in range(self.agents)))

    async def _agent(self, session: aiohttp.ClientSession, agent: int) -> None:
        step = 0
        while not self.stop.is_set() and step < 10_000:
            step += 1
            tokens, stream = TOKENS[step % 2], (agent + step) % 2 == 0
            request = Request(time.monotonic())
            prompt = f"agent {agent} step {step}"
            try:
                try:
                    got = await self._one(session, prompt, tokens, stream)
                except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
                    # Not answered: a kept-alive connection the server closed as the client
                    # reused it (a reset, or a disconnect before any response), or a refused
                    # connect. The OpenAI SDK retries these connection errors (max_retries=2);
                    # so does this client, once, and counts it.
                    request.retried, request.error = True, f"retried: {exc!r}"[:200]
                    got = await self._one(session, prompt, tokens, stream)
                request.cut = got != tokens
                request.error = (
                    f"{got} of {tokens} tokens (stream: {stream})" if request.cut else ""
                )
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                request.failed, request.error = True, f"{exc!r}"[:200]
            request.ended = time.monotonic()
            self.done.append(request)
            if request.failed:
                await asyncio.sleep(0.5)

    async def _one(
        self, session: aiohttp.ClientSession, prompt: str, tokens: int, stream: bool
    ) -> int:
        """Tokens received (raises on an HTTP error)."""
        body = {"model": "sim", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": tokens, "ignore_eos": True, "stream": stream}  # fmt: skip
        if stream:
            body["stream_options"] = {"include_usage": True}
        async with session.post(f"{self.url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}: {(await resp.text())[:150]}")
            if not stream:
                return int((await resp.json())["usage"]["completion_tokens"])
            usage, finished = 0, False
            async for raw in resp.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    finished = True
                elif line.startswith("data: "):
                    usage = (json.loads(line[6:]).get("usage") or {}).get(
                        "completion_tokens", usage
                    )
            return int(usage) if finished else -1

    def between(self, start: float, end: float) -> list[Request]:
        return [r for r in self.done if start <= r.started < end or start <= r.ended < end]


def sample(prefill: int, decode: int) -> dict[str, Any]:
    cas: dict[str, Any] = yaml.safe_load((REPO_ROOT / "config/samples/minimal.yaml").read_text())
    cas["spec"]["prefill"] = {"replicas": prefill}
    cas["spec"]["decode"] = {"replicas": decode}
    cas["spec"]["engine"] = {"drainSeconds": 120}
    return cas


def converged(kubectl: Kubectl, namespace: str, prefill: int, decode: int) -> bool:
    status = cas_status(kubectl, namespace)
    pods = json.loads(kubectl("get", "pods", "-n", namespace, "-l",
                              f"cas.dev/name={NAME},app.kubernetes.io/name=cas-engine",
                              "-o", "json"))["items"]  # fmt: skip
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    ready = next((c for c in status.get("conditions", []) if c["type"] == "Ready"), {})
    progressing = next((c for c in status.get("conditions", []) if c["type"] == "Progressing"), {})
    return (
        ready.get("status") == "True"
        and progressing.get("status") == "False"
        and not status.get("draining")
        and (status.get("prefill") or {}).get("readyReplicas") == prefill
        and (status.get("decode") or {}).get("readyReplicas") == decode
        and len(live) == prefill + decode
    )


def patch(kubectl: Kubectl, namespace: str, spec: dict[str, Any]) -> None:
    kubectl("patch", "cas", NAME, "-n", namespace, "--type=merge",
            "-p", json.dumps({"spec": spec}))  # fmt: skip


def scale(kubectl: Kubectl, namespace: str, replicas: int) -> None:
    kubectl("scale", "cas", NAME, "-n", namespace, f"--replicas={replicas}")


async def restart_mid_drain(kubectl: Kubectl, namespace: str, stack: LiveStack) -> None:
    scale(kubectl, namespace, 2)
    await asyncio.to_thread(wait_for, "2 decodes", lambda: converged(kubectl, namespace, 1, 2), 180)
    scale(kubectl, namespace, 1)

    def retiring() -> bool:
        draining = cas_status(kubectl, namespace).get("draining") or []
        return any(d.get("state") in ("Retiring", "Released") for d in draining)

    await asyncio.to_thread(wait_for, "a decode out of rotation for the scale-down", retiring, 90)
    assert stack.operator is not None
    stack.operator.kill()
    await asyncio.sleep(3)
    stack.operator.start()


def drain_node(kubectl: Kubectl, namespace: str) -> None:
    """`kubectl drain` of the node one decode pod runs on (Eviction API, PDBs honoured), as an
    admin takes a node down for maintenance; the node is uncordoned once it is empty."""
    pods = json.loads(
        kubectl(
            "get",
            "pods",
            "-n",
            namespace,
            "-l",
            f"cas.dev/name={NAME},cas.dev/role=decode",
            "-o",
            "json",
        )
    )["items"]
    node = sorted(p["spec"]["nodeName"] for p in pods
                  if not p["metadata"].get("deletionTimestamp"))[0]  # fmt: skip
    print(f"[bench] draining node {node}", flush=True)
    kubectl("drain", node, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=300s",
            timeout=320)  # fmt: skip
    kubectl("uncordon", node)


def engine_pod_uids(kubectl: Kubectl, namespace: str) -> set[str]:
    pods = json.loads(kubectl("get", "pods", "-n", namespace, "-l",
                              f"cas.dev/name={NAME},app.kubernetes.io/name=cas-engine",
                              "-o", "json"))["items"]  # fmt: skip
    return {p["metadata"]["uid"] for p in pods if not p["metadata"].get("deletionTimestamp")}


async def upgrade_operator(kubectl: Kubectl, namespace: str, stack: LiveStack) -> None:
    """The fleet was made by an older build (`e2e.runtime.older_operator`, which renders the
    engine pods with one env var more): stop it and start this build, as a chart upgrade does."""
    assert stack.operator is not None
    assert stack.operator.module != "cas_operator", "the fleet must be made by the older build"
    assert not held(kubectl, namespace), "the older build already holds a revision"
    stack.operator.stop()
    stack.operator.module = "cas_operator"
    stack.operator.start()


def held(kubectl: Kubectl, namespace: str) -> bool:
    """The operator keeps the running revision and says what it would roll to."""
    return "heldRevision" in cas_status(kubectl, namespace)


async def run_paths(kubectl: Kubectl, namespace: str, stack: LiveStack, load: Load,
                    grace: float, only: str | None = None) -> list[dict[str, Any]]:  # fmt: skip
    engine_env = [{"name": "CAS_BENCH_ROLL", "value": "2"}]

    async def act(step: Callable[[], None]) -> None:
        await asyncio.to_thread(step)

    paths: list[tuple[str, Callable[[], Awaitable[None]], tuple[int, int]]] = [
        ("operator upgrade", lambda: upgrade_operator(kubectl, namespace, stack), (3, 4)),
        ("decode 4 -> 2", lambda: act(lambda: patch(kubectl, namespace,
                                                    {"decode": {"replicas": 2}})), (3, 2)),
        ("prefill 3 -> 1", lambda: act(lambda: patch(kubectl, namespace,
                                                     {"prefill": {"replicas": 1}})), (1, 2)),
        ("node drain (evictions)", lambda: act(lambda: drain_node(kubectl, namespace)), (1, 2)),
        ("kubectl scale 2 -> 1", lambda: act(lambda: scale(kubectl, namespace, 1)), (1, 1)),
        ("engine change", lambda: act(lambda: patch(kubectl, namespace, {"engine": {
            "drainSeconds": 120, "env": engine_env}})), (1, 1)),
        ("operator restart mid-drain", lambda: restart_mid_drain(kubectl, namespace, stack),
         (1, 1)),
    ]  # fmt: skip
    results = []
    for name, start, (prefill, decode) in paths:
        if only is not None and only not in name:
            continue
        print(f"[bench] path: {name}", flush=True)
        upgrade = name == "operator upgrade"
        pods_before = engine_pod_uids(kubectl, namespace)
        began = time.monotonic()
        await start()
        await asyncio.to_thread(wait_for, f"{name} converged",
                                lambda p=prefill, d=decode, u=upgrade: converged(
                                    kubectl, namespace, p, d) and (not u or held(
                                        kubectl, namespace)),
                                grace + 240)  # fmt: skip
        seconds = time.monotonic() - began
        await asyncio.sleep(5)  # requests sent just before convergence finish
        seen = load.between(began, time.monotonic())
        results.append({"path": name, "sent": len(seen),
                        "failed": sum(r.failed for r in seen), "cut": sum(r.cut for r in seen),
                        "retried": sum(r.retried for r in seen),
                        "seconds": round(seconds, 1),
                        "errors": sorted({r.error for r in seen if r.error})[:5]})  # fmt: skip
        if upgrade:  # engine pods the new build replaced (target 0: it holds the revision)
            results[-1]["restarted"] = len(pods_before - engine_pod_uids(kubectl, namespace))
        print(f"[bench] {results[-1]}", flush=True)
    return results


# The counts the fleet starts at when `--only` names a path (a key in the path's name).
START = {"upgrade": (3, 4), "decode": (3, 4), "prefill": (3, 2), "drain": (1, 2),
         "kubectl": (1, 2), "engine": (1, 1), "restart": (1, 1)}  # fmt: skip


def start_counts(only: str | None) -> tuple[int, int]:
    return next((v for k, v in START.items() if only and k in only), START["upgrade"])


async def live(
    kubeconfig: Path, kubectl_exe: Path | None, run: Path, only: str | None = None
) -> list[dict[str, Any]]:
    kubectl = _kubectl(kubeconfig, kubectl_exe)
    namespace = f"bench-lifecycle-{uuid.uuid4().hex[:6]}"
    await asyncio.to_thread(apply_crds, kubectl)
    await asyncio.to_thread(create_namespace, kubectl, namespace)
    # The first path, "operator upgrade", needs the fleet made by an older build.
    older = only is None or "upgrade" in only
    module = "e2e.runtime.older_operator" if older else "cas_operator"
    stack = LiveStack(kubeconfig, namespace, run / "live", sim_args=SIM_ARGS,
                      scrape_interval_s=2.0, operator_args=("-n", namespace),
                      operator_module=module)  # fmt: skip
    traffic: asyncio.Task[None] | None = None
    load: Load | None = None
    try:
        stack.start(log=lambda line: print(f"[live] {line}", flush=True))
        prefill, decode = start_counts(only)
        cas = sample(prefill, decode)
        kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(probed_by_runner(cas)))
        await asyncio.to_thread(wait_for, "the fleet", lambda: converged(
            kubectl, namespace, prefill, decode), 240)  # fmt: skip
        ip = kubectl("get", "service", NAME, "-n", namespace, "-o", "jsonpath={.spec.clusterIP}")
        load = Load(f"http://{ip}")
        traffic = asyncio.create_task(load.run())
        # kube-proxy programs the new Service's ClusterIP a few seconds after it has endpoints:
        # the paths start once requests succeed through it.
        await asyncio.to_thread(wait_for, "traffic through the entry Service",
                                lambda: sum(not r.failed for r in load.done) >= 8, 120)  # fmt: skip
        return await run_paths(kubectl, namespace, stack, load,
                               float(cas["spec"]["engine"]["drainSeconds"]), only)  # fmt: skip
    finally:
        if stack.operator is not None:  # what the operator did, for a path that failed
            kept = Path("bench/results/lifecycle-operator.log")
            kept.parent.mkdir(parents=True, exist_ok=True)
            kept.write_text(stack.operator.log_path.read_text(errors="replace"))
        if load is not None:
            load.stop.set()
        if traffic is not None:
            await traffic
        stack.close(log=lambda line: print(f"[live] {line}", flush=True))
        kubectl("delete", "namespace", namespace, "--wait=false", "--ignore-not-found",
                check=False)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/lifecycle.py")
    p.add_argument("--out", type=Path, default=Path("bench/results/lifecycle.json"))
    p.add_argument("--only", help="run only the path whose name contains this (e.g. engine)")
    args = p.parse_args(argv)
    with _cluster() as (kubeconfig, kubectl_exe), tempfile.TemporaryDirectory() as tmp:
        results = asyncio.run(live(kubeconfig, kubectl_exe, Path(tmp), args.only))
    print(f"\n{'path':<28} {'sent':>5} {'failed':>6} {'cut':>4} {'retried':>7} {'seconds':>8}")
    for r in results:
        print(f"{r['path']:<28} {r['sent']:>5} {r['failed']:>6} {r['cut']:>4} {r['retried']:>7} "
              f"{r['seconds']:>8}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    ok = all(r["failed"] == 0 and r["cut"] == 0 and not r.get("restarted") for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
