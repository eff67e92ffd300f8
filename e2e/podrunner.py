"""Run the sim engine for every engine pod bound to a (KWOK) node, at the pod's own IP.

KWOK only pretends to run containers; this runner makes engine pods real processes. Each
`sync()` (level-based, one pass):
1. lists pods (any callable returning pod dicts; :func:`kube_pod_lister` reads the API server);
2. for each runnable pod - bound to a node, podIP inside `networks` (default 127.0.0.0/8, the
   fake nodes' pod CIDRs), not terminating, with a container whose command runs
   ``cas_engine.launch_server`` or ``cas_engine.sim`` - ensures one ``python -m cas_engine.sim``
   runs with the container's args ($(VAR) expanded from its env), bound to the pod IP and its
   ``http`` container port; with ``kubeconfig`` set, router pods (a container running
   ``sglang_router.launch_router``) run too, as the real SGLang router with the container's
   args (``--host`` and ``--prometheus-host`` set to the pod IP) and Kubernetes discovery
   against this API server (``KUBECONFIG``), so ``http://<router pod IP>:8000`` is a router
   replica as in a real cluster (the operator deregisters draining workers there);
   a process that exited is restarted after ``restart_backoff_s``;
3. stops (SIGTERM, by recorded pid) the processes of pods that went away or were replaced
   (a new pod UID under the same name);
4. rewrites the Prometheus file_sd targets (:func:`e2e.prometheus.write_file_sd`) for pods
   annotated ``prometheus.io/scrape: "true"``, labelled namespace/pod/role.
Ownership: the runner owns the processes it started (records in memory) and the sd file.

``python -m e2e.podrunner --kubeconfig PATH [--routers] [--sd-file F] [--sim-arg=--sim-speedup=20]``
"""

from __future__ import annotations

import argparse
import ipaddress
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e import procs
from e2e.prometheus import write_file_sd

Pod = dict[str, Any]
LAUNCHERS = ("cas_engine.launch_server", "cas_engine.sim")
ROUTER_LAUNCHER = "sglang_router.launch_router"
ROUTER_SHIM = "e2e.router_shim"  # the router, minus its process renaming (see that module)
REPO_ROOT = Path(__file__).resolve().parent.parent  # where ROUTER_SHIM's package lives
ROUTER_HOST_FLAGS = ("--host", "--prometheus-host")
LOOPBACK = ipaddress.IPv4Network("127.0.0.0/8")
DEFAULT_PORT = 30000
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass(frozen=True)
class Launch:
    """What to run for one pod; equal Launches mean the running process is still right."""

    uid: str
    name: str
    namespace: str
    ip: str
    port: int
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]


def _container_running(pod: Pod, launchers: tuple[str, ...]) -> dict[str, Any] | None:
    for container in pod.get("spec", {}).get("containers", []):
        command = " ".join(container.get("command", []) + container.get("args", [])[:1])
        if any(launcher in command for launcher in launchers):
            return dict(container)
    return None


def _engine_container(pod: Pod) -> dict[str, Any] | None:
    return _container_running(pod, LAUNCHERS)


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion (unknown variables stay as written)."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), arg)


def _http_port(container: dict[str, Any]) -> int:
    for port in container.get("ports", []):
        if port.get("name") == "http":
            return int(port["containerPort"])
    return DEFAULT_PORT


def launch_for(
    pod: Pod,
    python: str,
    extra_args: list[str],
    networks: tuple[ipaddress.IPv4Network, ...] = (LOOPBACK,),
) -> Launch | None:
    """The sim command for a runnable pod, or None when the pod is not ours to run (pure):
    only pods whose IP lies in `networks` (addresses this machine can bind) are run."""
    meta = pod.get("metadata", {})
    ip = _runnable_ip(pod, networks)
    container = _engine_container(pod) if ip else None
    if ip is None or container is None:
        return None
    env = {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}
    env.update({"POD_NAME": meta.get("name", ""), "POD_IP": ip})
    args = [_expand(a, env) for a in container.get("args", [])]
    port = _http_port(container)
    argv = (python, "-m", "cas_engine.sim", *args, *extra_args,
            "--host", ip, "--port", str(port))  # fmt: skip
    return Launch(
        uid=meta.get("uid", ""),
        name=meta.get("name", ""),
        namespace=meta.get("namespace", ""),
        ip=ip,
        port=port,
        argv=argv,
        env=tuple(sorted(env.items())),
    )


def _runnable_ip(pod: Pod, networks: tuple[ipaddress.IPv4Network, ...]) -> str | None:
    """The pod's IP when it is bound, alive and its IP lies in `networks`; else None."""
    meta, status = pod.get("metadata", {}), pod.get("status", {})
    ip = status.get("podIP")
    if meta.get("deletionTimestamp") or not pod.get("spec", {}).get("nodeName") or not ip:
        return None
    if status.get("phase") in ("Succeeded", "Failed"):
        return None
    try:
        if not any(ipaddress.ip_address(ip) in net for net in networks):
            return None
    except ValueError:
        return None
    return str(ip)


def router_launch_for(
    pod: Pod,
    python: str,
    kubeconfig: Path,
    networks: tuple[ipaddress.IPv4Network, ...] = (LOOPBACK,),
) -> Launch | None:
    """The real SGLang router for a runnable router pod, or None (pure): the container's args
    with every listen host replaced by the pod IP, discovery through `kubeconfig`."""
    meta = pod.get("metadata", {})
    ip = _runnable_ip(pod, networks)
    container = _container_running(pod, (ROUTER_LAUNCHER,)) if ip else None
    if ip is None or container is None:
        return None
    env = {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}
    env.update({"POD_NAME": meta.get("name", ""), "POD_IP": ip, "KUBECONFIG": str(kubeconfig),
                "PYTHONPATH": str(REPO_ROOT)})  # fmt: skip
    args = [_expand(a, env) for a in container.get("args", [])]
    for i, arg in enumerate(args[:-1]):
        if arg in ROUTER_HOST_FLAGS:
            args[i + 1] = ip
    port = _http_port(container)
    return Launch(
        uid=meta.get("uid", ""),
        name=meta.get("name", ""),
        namespace=meta.get("namespace", ""),
        ip=ip,
        port=port,
        argv=(python, "-m", ROUTER_SHIM, *args),
        env=tuple(sorted(env.items())),
    )


@dataclass
class _Running:
    launch: Launch
    record: procs.ProcRecord
    started: float
    restarts: int = 0


@dataclass
class PodRunner:
    """Keeps one sim process per runnable pod; see the module docstring."""

    list_pods: Callable[[], list[Pod]]
    log_dir: Path
    sd_file: Path | None = None
    python: str = sys.executable
    extra_args: list[str] = field(default_factory=list)
    restart_backoff_s: float = 5.0
    networks: tuple[ipaddress.IPv4Network, ...] = (LOOPBACK,)
    kubeconfig: Path | None = None  # set: router pods run as real SGLang routers too
    running: dict[tuple[str, str], _Running] = field(default_factory=dict)

    def sync(self) -> list[str]:
        """One pass; returns what it did (for logs and tests)."""
        actions: list[str] = []
        pods = self.list_pods()
        wanted: dict[tuple[str, str], Launch] = {}
        for pod in pods:
            launch = launch_for(pod, self.python, self.extra_args, self.networks)
            if launch is None and self.kubeconfig is not None:
                launch = router_launch_for(pod, self.python, self.kubeconfig, self.networks)
            if launch is not None:
                wanted[(launch.namespace, launch.name)] = launch
        for key in [k for k, r in self.running.items() if wanted.get(k) != r.launch]:
            actions.append(self._stop(key))
        for key, launch in wanted.items():
            actions += self._ensure(key, launch)
        if self.sd_file is not None:
            write_file_sd(self.sd_file, self._scrape_targets(pods, wanted))
        return [a for a in actions if a]

    def _ensure(self, key: tuple[str, str], launch: Launch) -> list[str]:
        current = self.running.get(key)
        if current is not None and procs.is_running(current.record):
            return []
        now = time.monotonic()
        if current is not None and now - current.started < self.restart_backoff_s:
            return []
        name = f"{launch.namespace}.{launch.name}"
        record = procs.spawn(name, list(launch.argv), self.log_dir, env=dict(launch.env))
        restarts = current.restarts + 1 if current is not None else 0
        self.running[key] = _Running(launch, record, now, restarts)
        verb = "restarted" if current is not None else "started"
        return [f"{verb} {name} at {launch.ip}:{launch.port} (pid {record.pid})"]

    def _stop(self, key: tuple[str, str]) -> str:
        run = self.running.pop(key)
        return procs.stop(run.record, grace_s=5.0)

    def _scrape_targets(
        self, pods: list[Pod], wanted: dict[tuple[str, str], Launch]
    ) -> list[tuple[str, dict[str, str]]]:
        out = []
        for pod in pods:
            meta = pod.get("metadata", {})
            launch = wanted.get((meta.get("namespace", ""), meta.get("name", "")))
            annotations = meta.get("annotations") or {}
            if launch is None or annotations.get("prometheus.io/scrape") != "true":
                continue
            port = annotations.get("prometheus.io/port", str(launch.port))
            labels = {"namespace": launch.namespace, "pod": launch.name,
                      "role": (meta.get("labels") or {}).get("cas.dev/role", "")}  # fmt: skip
            out.append((f"{launch.ip}:{port}", labels))
        return out

    def stop_all(self) -> list[str]:
        return [self._stop(k) for k in list(self.running)]

    def run(self, stop: threading.Event, interval_s: float = 1.0) -> None:
        """sync() every `interval_s` until `stop` is set; then stop every process."""
        try:
            while not stop.is_set():
                try:
                    for line in self.sync():
                        print(f"podrunner: {line}", flush=True)
                except Exception as exc:  # API hiccup: report and try again next pass
                    print(f"podrunner: sync failed: {exc}", flush=True)
                stop.wait(interval_s)
        finally:
            self.stop_all()


def kube_pod_lister(kubeconfig: Path, namespace: str | None = None) -> Callable[[], list[Pod]]:
    """Pods of the cluster (or of one namespace) as plain dicts, camelCase as the API sends."""
    from kubernetes import client, config

    load = config.new_client_from_config
    api_client = load(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
    core = client.CoreV1Api(api_client)

    def list_pods() -> list[Pod]:
        if namespace:
            answer = core.list_namespaced_pod(namespace, _request_timeout=10)
        else:
            answer = core.list_pod_for_all_namespaces(_request_timeout=10)
        pods: list[Pod] = api_client.sanitize_for_serialization(answer).get("items", [])
        return pods

    return list_pods


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.podrunner")
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--namespace", default=None, help="only this namespace (default: all)")
    parser.add_argument("--log-dir", type=Path, default=Path("run/podrunner"))
    parser.add_argument("--sd-file", type=Path, default=None)
    parser.add_argument("--sim-arg", action="append", default=[], help="extra sim argument")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--routers", action="store_true", help="run router pods too")
    args = parser.parse_args(argv)
    lister = kube_pod_lister(args.kubeconfig, args.namespace)
    runner = PodRunner(lister, args.log_dir, args.sd_file, extra_args=args.sim_arg,
                       kubeconfig=args.kubeconfig.resolve() if args.routers else None)  # fmt: skip
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # stop the sims before exiting
    try:
        runner.run(stop, args.interval)
    except KeyboardInterrupt:
        stop.set()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
