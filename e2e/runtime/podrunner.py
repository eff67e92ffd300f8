"""Run the sim engine for every engine pod bound to a (KWOK) node, at the pod's own IP.

KWOK only pretends to run containers; this runner makes engine pods real processes. Each
`sync()` (level-based, one pass):
1. lists pods (any callable returning pod dicts; :func:`kube_pod_lister` reads the API server);
2. for each runnable pod - bound to a node, podIP inside `networks` (default 127.0.0.0/8, the
   fake nodes' pod CIDRs in loopback mode; with `network` set in netns mode, the pod CIDR of
   :mod:`e2e.cluster.podnet`, and the process runs inside its node's network namespace with the
   pod IP added there), not terminating, with a container whose command runs
   ``cas_engine.launch_server`` or ``cas_engine.sim`` - ensures one ``python -m cas_engine.sim``
   runs with the container's args ($(VAR) expanded from its env: literal values, and keys of
   Secrets by ``secretKeyRef`` through ``secrets``, as a kubelet resolves them: once, when it
   starts the process, so a running pod is never stopped because a Secret read failed; a pod
   whose Secret or key is missing is not started, as a kubelet leaves it in
   CreateContainerConfigError), bound to the pod IP and its
   ``http`` container port (a configMap volume the container mounts is projected, with
   ``configmaps`` and ``volume_root`` set, into ``volume_root/<pod uid>/<volume>`` and every arg
   under its mountPath points there: the files are rewritten from the ConfigMap each pass, as a
   kubelet refreshes a projected ConfigMap, sooner); with ``kubeconfig`` set, router pods (a
   container running ``sglang_router.launch_router`` or ``smg.launch_router``) run too, as that
   real router with the container's args (``--host`` and ``--prometheus-host`` set to the pod
   IP) and Kubernetes discovery against this API server (``KUBECONFIG``), so
   ``http://<router pod IP>:8000`` is a router replica as in a real cluster (the operator
   deregisters draining workers there); a process that exited is restarted after
   ``restart_backoff_s``;
3. stops (SIGTERM, by recorded pid) the processes of pods that went away or were replaced
   (a new pod UID under the same name); as a kubelet does, it first runs the container's
   ``cas_engine.prestop`` preStop hook (at the pod IP, in the pod's namespace), in the
   background and bounded by the pod's ``terminationGracePeriodSeconds``, so a deleted pod
   finishes its requests in flight before its process stops (an LWS worker's hook waits on its
   leader, at the leader pod's IP: :func:`prestop_for`); a preStop ``sleep`` action (the
   router's) delays the SIGTERM by its seconds, within the same grace (other hooks are not
   run);
4. rewrites the Prometheus file_sd targets (:func:`e2e.runtime.prometheus.write_file_sd`) for pods
   annotated ``prometheus.io/scrape: "true"``, labelled namespace/pod/role;
5. with ``patch_status`` set, plays the kubelet's readiness prober for pods that opt in (the
   toleration :data:`e2e.cluster.manifests.READINESS_TOLERATION_KEY`, which KWOK leaves not Ready):
   it GETs the engine container's readinessProbe at the pod IP (within its timeoutSeconds, 1 by
   default as for a kubelet; in the background, a probe per pod at a time) and patches the pod's
   Ready and ContainersReady conditions to match (Ready on the first success, not Ready after
   the probe's failureThreshold failures in a row or at once when the process is gone), so the
   router's Kubernetes discovery and the pool controllers only count a pod that answers, as in
   a cluster;
6. with ``delete_pod`` set, removes a deleted opted-in pod's object once its processes stopped,
   after writing its containers terminated (:func:`terminated_patch`), as a kubelet does: the
   operator's prefill-gone loop trusts only such an end.
Ownership: the runner owns the processes it started (records in memory) and the sd file.

``python -m e2e.runtime.podrunner --kubeconfig PATH [--routers] [--sd-file F]
[--sim-arg=--sim-speedup=20]``
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import shlex
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e.cluster import procs
from e2e.cluster.manifests import PROBED_READINESS, READINESS_TOLERATION_KEY
from e2e.cluster.podnet import PodNetwork, load_for_kubeconfig
from e2e.paths import REPO_ROOT  # where ROUTER_SHIM's package lives
from e2e.runtime.prometheus import write_file_sd
from e2e.runtime.router_shim import ROUTER_LAUNCHERS

Pod = dict[str, Any]
LAUNCHERS = ("cas_engine.launch_server", "cas_engine.sim")
ROUTER_SHIM = "e2e.runtime.router_shim"  # the router, minus its process renaming (see that module)
ROUTER_HOST_FLAGS = ("--host", "--prometheus-host")
LOOPBACK = ipaddress.IPv4Network("127.0.0.0/8")
DEFAULT_PORT = 30000
DEFAULT_GRACE_S = 30.0  # Kubernetes' terminationGracePeriodSeconds default
PRESTOP_MODULE = ("python3", "-m", "cas_engine.prestop")
_SHELL_VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")  # $NAME, ${NAME}
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
# (namespace, Secret name) -> its decoded keys, or None when it does not exist
SecretReader = Callable[[str, str], dict[str, str] | None]
# (namespace, ConfigMap name) -> its data, or None when it does not exist
ConfigMapReader = Callable[[str, str], dict[str, str] | None]


class _Unresolvable(Exception):
    """A container's env names a Secret or key that does not exist (the pod cannot start)."""


def _env_of(
    container: dict[str, Any], namespace: str, secrets: SecretReader | None
) -> dict[str, str]:
    """The container's env as a kubelet resolves it: values, and secretKeyRef keys when
    `secrets` is given (other sources are left out); raises _Unresolvable for a missing
    Secret or key that is not optional."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
            continue
        ref = (var.get("valueFrom") or {}).get("secretKeyRef")
        if ref is None or secrets is None:
            continue
        value = (secrets(namespace, ref["name"]) or {}).get(ref["key"])
        if value is None and not ref.get("optional"):
            raise _Unresolvable(f"{var['name']}: Secret {ref['name']} key {ref['key']}")
        if value is not None:
            env[var["name"]] = value
    return env


@dataclass(frozen=True)
class Projection:
    """A configMap volume a container mounts, projected to a directory of this machine."""

    mount_path: str
    config_map: str
    directory: str


def projections_for(
    pod: Pod, container: dict[str, Any], root: Path | None
) -> tuple[Projection, ...]:
    """The container's configMap volume mounts, each at `root/<pod uid>/<volume name>`."""
    if root is None:
        return ()
    spec = pod.get("spec") or {}
    maps = {
        v["name"]: v["configMap"]["name"] for v in spec.get("volumes") or [] if "configMap" in v
    }
    uid = str((pod.get("metadata") or {}).get("uid", ""))
    return tuple(
        Projection(m["mountPath"].rstrip("/"), maps[m["name"]], str(root / uid / m["name"]))
        for m in container.get("volumeMounts") or []
        if m.get("name") in maps
    )


def _projected(arg: str, projections: tuple[Projection, ...]) -> str:
    """`arg` with a path under a projected mountPath (alone or after `=`) pointing at its copy."""
    flag, eq, value = arg.rpartition("=") if arg.startswith("--") and "=" in arg else ("", "", arg)
    for p in projections:
        if value == p.mount_path or value.startswith(p.mount_path + "/"):
            return flag + eq + p.directory + value[len(p.mount_path) :]
    return arg


def project(projections: tuple[Projection, ...], namespace: str, read: ConfigMapReader) -> None:
    """Write each projected ConfigMap's keys as files (a key whose value changed is replaced
    atomically; a ConfigMap that does not exist leaves the directory as it is, as an optional
    volume before its ConfigMap exists)."""
    for p in projections:
        data = read(namespace, p.config_map)
        if data is None:
            continue
        directory = Path(p.directory)
        directory.mkdir(parents=True, exist_ok=True)
        for key, value in data.items():
            target = directory / key
            if target.exists() and target.read_text() == value:
                continue
            tmp = directory / f".{key}.tmp"
            tmp.write_text(value)
            os.replace(tmp, target)


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
    prestop: tuple[str, ...] = ()  # the preStop hook's argv (empty: none this runner runs)
    grace_s: float = DEFAULT_GRACE_S  # the pod's terminationGracePeriodSeconds
    prestop_sleep_s: float = 0.0  # a preStop `sleep` action: SIGTERM comes this much later
    projections: tuple[Projection, ...] = ()  # configMap volumes, refreshed every pass


def _container_running(pod: Pod, launchers: tuple[str, ...]) -> dict[str, Any] | None:
    for container in pod.get("spec", {}).get("containers", []):
        command = " ".join(container.get("command", []) + container.get("args", [])[:1])
        if any(launcher in command for launcher in launchers):
            return dict(container)
    return None


def _engine_container(pod: Pod) -> dict[str, Any] | None:
    return _container_running(pod, LAUNCHERS)


def _served_container(pod: Pod) -> dict[str, Any] | None:
    """The container this runner runs for the pod: an engine's, else a router's."""
    return _engine_container(pod) or _container_running(pod, ROUTER_LAUNCHERS)


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion (unknown variables stay as written)."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), arg)


def _http_port(container: dict[str, Any]) -> int:
    for port in container.get("ports", []):
        if port.get("name") == "http":
            return int(port["containerPort"])
    return DEFAULT_PORT


def prestop_for(
    container: dict[str, Any], python: str, ip: str, env: dict[str, str] | None = None
) -> tuple[str, ...]:
    """The container's cas_engine.prestop hook as this runner runs it: with this Python, and
    at the pod IP (the sim binds that, not 0.0.0.0 as an engine in its own pod does). An LWS
    worker's hook is a shell line that waits on its leader (``sh -c "exec python3 -m
    cas_engine.prestop --host \"$LWS_LEADER_ADDRESS\" ..."``, desired.resources.pools):
    its variables come from the container's `env`, and the leader's address (a DNS name; the
    local stack has no DNS) becomes the leader pod's IP when the hook runs
    (:meth:`PodRunner._stop`)."""
    command = (((container.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get(
        "command"
    ) or []
    if tuple(command[:3]) == PRESTOP_MODULE:
        return (python, *command[1:], "--host", ip)
    if len(command) == 3 and command[:2] == ["sh", "-c"]:
        line = _SHELL_VAR.sub(lambda m: (env or {}).get(m.group(1), ""), command[2])
        words = shlex.split(line.removeprefix("exec "))
        if tuple(words[:3]) == PRESTOP_MODULE:
            return (python, *words[1:])
    return ()


def prestop_sleep_for(container: dict[str, Any]) -> float:
    """Seconds of the container's preStop `sleep` action (0 without one)."""
    sleep = ((container.get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {}
    return float(sleep.get("seconds", 0))


def _grace_of(pod: Pod) -> float:
    return float(pod.get("spec", {}).get("terminationGracePeriodSeconds", DEFAULT_GRACE_S))


def launch_for(
    pod: Pod,
    python: str,
    extra_args: list[str],
    networks: tuple[ipaddress.IPv4Network, ...] = (LOOPBACK,),
    secrets: SecretReader | None = None,
    volume_root: Path | None = None,
) -> Launch | None:
    """The sim command for a runnable pod, or None when the pod is not ours to run (pure but
    for `secrets`): only pods whose IP lies in `networks` (addresses this machine can bind)
    and whose env resolves are run. With `volume_root`, configMap mounts are projected there."""
    meta = pod.get("metadata", {})
    ip = _runnable_ip(pod, networks)
    container = _engine_container(pod) if ip else None
    if ip is None or container is None:
        return None
    try:
        env = _env_of(container, meta.get("namespace", ""), secrets)
    except _Unresolvable:
        return None
    env.update({"POD_NAME": meta.get("name", ""), "POD_IP": ip})
    projections = projections_for(pod, container, volume_root)
    args = [_projected(_expand(a, env), projections) for a in container.get("args", [])]
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
        prestop=prestop_for(container, python, ip, env),
        grace_s=_grace_of(pod),
        prestop_sleep_s=prestop_sleep_for(container),
        projections=projections,
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
    secrets: SecretReader | None = None,
) -> Launch | None:
    """The real SGLang router for a runnable router pod, or None (pure but for `secrets`): the
    container's args with every listen host replaced by the pod IP, discovery through
    `kubeconfig`."""
    meta = pod.get("metadata", {})
    ip = _runnable_ip(pod, networks)
    container = _container_running(pod, ROUTER_LAUNCHERS) if ip else None
    if ip is None or container is None:
        return None
    command = " ".join(container.get("command", []))
    launcher = next((m for m in ROUTER_LAUNCHERS if m in command), ROUTER_LAUNCHERS[0])
    try:
        env = _env_of(container, meta.get("namespace", ""), secrets)
    except _Unresolvable:
        return None
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
        argv=(python, "-m", ROUTER_SHIM, launcher, *args),
        env=tuple(sorted(env.items())),
        grace_s=_grace_of(pod),
        prestop_sleep_s=prestop_sleep_for(container),
    )


def leaves_readiness_to_runner(pod: Pod) -> bool:
    """True when the pod tolerates READINESS_TOLERATION_KEY=PROBED_READINESS (pure): the local
    stack's KWOK then leaves it not Ready and the runner decides."""
    tolerations = pod.get("spec", {}).get("tolerations") or []
    return any(t.get("key") == READINESS_TOLERATION_KEY and t.get("value") == PROBED_READINESS
               for t in tolerations)  # fmt: skip


def readiness_url(launch: Launch, pod: Pod) -> str | None:
    """The URL a kubelet would probe for the pod's readiness (its engine container's
    readinessProbe httpGet, port by name or number, at the pod IP), or None when the container
    has no HTTP readiness probe (then running is ready, as for a kubelet) (pure)."""
    container = _served_container(pod) or {}
    http = (container.get("readinessProbe") or {}).get("httpGet")
    if not http:
        return None
    port = http.get("port", launch.port)
    if isinstance(port, str) and not port.isdigit():
        named = {p.get("name"): p.get("containerPort") for p in container.get("ports", [])}
        port = named.get(port, launch.port)
    path = "/" + str(http.get("path", "/")).lstrip("/")
    return f"http://{launch.ip}:{port}{path}"


def terminated_patch(pod: Pod, now: str | None = None) -> dict[str, Any]:
    """The status a kubelet writes once a deleted pod's containers have stopped (before it
    removes the object): every container terminated, not ready. The operator's prefill-gone
    loop reads it from the pod's last copy."""
    at = now or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    status = pod.get("status") or {}
    known = {s.get("name"): s for s in status.get("containerStatuses") or []}
    statuses = []
    for container in pod.get("spec", {}).get("containers", []):
        old = known.get(container["name"]) or {}
        started = ((old.get("state") or {}).get("running") or {}).get("startedAt", at)
        statuses.append({
            "name": container["name"], "image": container.get("image", ""),
            "imageID": old.get("imageID", ""), "restartCount": old.get("restartCount", 0),
            "ready": False, "started": False,
            "state": {"terminated": {"exitCode": 0, "reason": "Completed",
                                     "startedAt": started, "finishedAt": at}},
        })  # fmt: skip
    conditions = [
        {**cond, "status": "False"} if cond.get("type") in ("Ready", "ContainersReady") else cond
        for cond in status.get("conditions") or []
    ]
    return {"status": {"containerStatuses": statuses, "conditions": conditions}}


def _readiness_setting(pod: Pod, name: str, default: int) -> int:
    """A field of the engine container's readinessProbe, Kubernetes' `default` when unset."""
    probe = (_served_container(pod) or {}).get("readinessProbe") or {}
    return max(1, int(probe.get(name, default)))


def probe_timeout(pod: Pod) -> float:
    """The readinessProbe's timeoutSeconds (Kubernetes' default 1)."""
    return float(_readiness_setting(pod, "timeoutSeconds", 1))


def failure_threshold(pod: Pod) -> int:
    """The readinessProbe's failureThreshold (Kubernetes' default 3)."""
    return _readiness_setting(pod, "failureThreshold", 3)


def readiness_patch(pod: Pod, ready: bool, now: str) -> dict[str, Any] | None:
    """A merge patch of the pod's status that sets Ready, ContainersReady and every container
    status' ``ready`` to `ready` (transition time `now` where a condition changes), or None when
    the pod already says so (pure). Lists are sent whole: a merge patch replaces lists."""
    status = pod.get("status") or {}
    want = "True" if ready else "False"
    conditions, changed = [], False
    for cond in status.get("conditions") or []:
        if cond.get("type") in ("Ready", "ContainersReady") and cond.get("status") != want:
            cond = {**cond, "status": want, "lastTransitionTime": now,
                    "reason": None if ready else "ReadinessProbeFailed"}  # fmt: skip
            changed = True
        conditions.append({k: v for k, v in cond.items() if v is not None})
    containers = []
    for cs in status.get("containerStatuses") or []:
        changed |= bool(cs.get("ready")) != ready
        containers.append({**cs, "ready": ready})
    if not changed:
        return None
    return {"status": {"conditions": conditions, "containerStatuses": containers}}


def _once_per_pass(secrets: SecretReader | None) -> SecretReader | None:
    """`secrets`, each Secret read at most once (one sync pass); a failed read is a missing one."""
    if secrets is None:
        return None
    read = secrets
    seen: dict[tuple[str, str], dict[str, str] | None] = {}

    def cached(namespace: str, name: str) -> dict[str, str] | None:
        if (namespace, name) not in seen:
            try:
                seen[(namespace, name)] = read(namespace, name)
            except Exception:  # the API server did not answer: not started this pass
                seen[(namespace, name)] = None
        return seen[(namespace, name)]

    return cached


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
    # set: probe the readiness of pods that opt in and write it (namespace, name, merge patch)
    patch_status: Callable[[str, str, dict[str, Any]], None] | None = None
    probe: Callable[[str, float], bool] = field(default_factory=lambda: http_probe)  # url, s
    # set (netns mode): pods in its pod CIDR run inside their node's network namespace, with
    # their IP added there; `networks` becomes that CIDR
    network: PodNetwork | None = None
    running: dict[tuple[str, str], _Running] = field(default_factory=dict)
    # by pod uid, pods gone whose preStop hook runs: the engine's record and the hook's
    draining: dict[str, tuple[procs.ProcRecord, procs.ProcRecord]] = field(default_factory=dict)
    _probe_failures: dict[tuple[str, str], int] = field(default_factory=dict)
    # readiness probes in flight: the address probed and its answer to come
    _probing: dict[tuple[str, str], tuple[str, Future[bool]]] = field(default_factory=dict)
    _probe_pool: ThreadPoolExecutor | None = None
    # set: the kubelet's last step for pods KWOK leaves to the runner (PROBED_READINESS): a
    # deleted pod's object goes (namespace, name, uid) once its processes have stopped
    delete_pod: Callable[[str, str, str], None] | None = None
    # set: env from secretKeyRef resolves through it (read once per Secret and pass)
    secrets: SecretReader | None = None
    stopping: set[str] = field(default_factory=set)  # uids whose process is being stopped
    # set (both): configMap volumes of engine pods are projected under volume_root
    configmaps: ConfigMapReader | None = None
    volume_root: Path | None = None
    # (namespace, pod name) -> pod IP as last listed: an LWS worker's preStop reaches its leader
    pod_ips: dict[tuple[str, str], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.network is not None and self.network.enabled:
            self.networks = self.network.networks()

    def sync(self) -> list[str]:
        """One pass; returns what it did (for logs and tests)."""
        actions: list[str] = []
        pods = self.list_pods()
        self.pod_ips = {
            (p["metadata"].get("namespace", ""), p["metadata"].get("name", "")): p["status"][
                "podIP"
            ]
            for p in pods
            if (p.get("status") or {}).get("podIP")
        }
        wanted: dict[tuple[str, str], Launch] = {}
        secrets = _once_per_pass(self.secrets)
        for pod in pods:
            launch = self._launch(pod, None)  # ours and runnable? (no Secret read)
            if launch is None:
                continue
            current = self.running.get((launch.namespace, launch.name))
            if current is not None and current.launch.uid == launch.uid:
                launch = current.launch  # a kubelet resolves env once, when it starts one
            elif secrets is not None:
                launch = self._launch(pod, secrets)
            if launch is not None:
                wanted[(launch.namespace, launch.name)] = launch
        for key in [k for k, r in self.running.items() if wanted.get(k) != r.launch]:
            actions.append(self._stop(key, replaced=key in wanted))
        if self.configmaps is not None:
            read = _once_per_pass(self.configmaps)
            assert read is not None
            for launch in wanted.values():
                project(launch.projections, launch.namespace, read)
        for key, launch in wanted.items():
            actions += self._ensure(key, launch)
        if self.patch_status is not None:
            actions += self._probe_readiness(pods, wanted)
        if self.delete_pod is not None:
            actions += self._finalize_deleted(pods)
        if self.sd_file is not None:
            write_file_sd(self.sd_file, self._scrape_targets(pods, wanted))
        return [a for a in actions if a]

    def _launch(self, pod: Pod, secrets: SecretReader | None) -> Launch | None:
        """What to run for `pod` (an engine's sim, else a router when routers run)."""
        root = self.volume_root if self.configmaps is not None else None
        launch = launch_for(pod, self.python, self.extra_args, self.networks, secrets, root)
        if launch is None and self.kubeconfig is not None:
            launch = router_launch_for(pod, self.python, self.kubeconfig, self.networks, secrets)
        return launch

    def _finalize_deleted(self, pods: list[Pod]) -> list[str]:
        """Delete the objects of terminating pods KWOK leaves to the runner once nothing of
        theirs runs (a kubelet removes a pod after its preStop hook and SIGTERM)."""
        assert self.delete_pod is not None
        busy = self.stopping | set(self.draining) | {r.launch.uid for r in self.running.values()}
        done = []
        for pod in pods:
            meta = pod.get("metadata", {})
            uid = str(meta.get("uid", ""))
            if not meta.get("deletionTimestamp") or not leaves_readiness_to_runner(pod):
                continue
            if uid in busy:
                continue
            if self.patch_status is not None:  # a kubelet reports the end before the removal
                self.patch_status(
                    str(meta.get("namespace", "")), str(meta.get("name", "")), terminated_patch(pod)
                )
            self.delete_pod(str(meta.get("namespace", "")), str(meta.get("name", "")), uid)
            done.append(f"removed {meta.get('namespace')}.{meta.get('name')} (stopped)")
        return done

    def _ensure(self, key: tuple[str, str], launch: Launch) -> list[str]:
        current = self.running.get(key)
        if current is not None and procs.is_running(current.record):
            return []
        now = time.monotonic()
        if current is not None and now - current.started < self.restart_backoff_s:
            return []
        name = f"{launch.namespace}.{launch.name}"
        netns = None
        if self.network is not None and self.network.enabled:
            netns = self.network.add_pod_ip(launch.ip)
        record = procs.spawn(name, list(launch.argv), self.log_dir, env=dict(launch.env),
                             netns=netns)  # fmt: skip
        restarts = current.restarts + 1 if current is not None else 0
        self.running[key] = _Running(launch, record, now, restarts)
        verb = "restarted" if current is not None else "started"
        return [f"{verb} {name} at {launch.ip}:{launch.port} (pid {record.pid})"]

    def _probe_readiness(self, pods: list[Pod], wanted: dict[tuple[str, str], Launch]) -> list[str]:
        """Step 5 of the module docstring; returns what it changed."""
        assert self.patch_status is not None
        actions, seen = [], set()
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        probed = {}
        for pod in pods:
            meta = pod.get("metadata", {})
            if meta.get("deletionTimestamp") or not leaves_readiness_to_runner(pod):
                continue
            probed[(meta.get("namespace", ""), meta.get("name", ""))] = pod
        answers = self._probe_all(probed, wanted)
        for key, pod in probed.items():
            seen.add(key)
            if key in answers and answers[key] is None:
                continue  # its probe has not answered yet: nothing new to say
            ready = self._ready(key, pod, wanted.get(key), answers.get(key))
            patch = None if ready is None else readiness_patch(pod, ready, now)
            if patch is not None:
                self.patch_status(key[0], key[1], patch)
                actions.append(f"{key[0]}.{key[1]} {'Ready' if ready else 'not Ready'}")
        for key in set(self._probe_failures) - seen:
            del self._probe_failures[key]
        return actions

    def _probe_all(
        self, pods: dict[tuple[str, str], Pod], wanted: dict[tuple[str, str], Launch]
    ) -> dict[tuple[str, str], bool | None]:
        """For every pod with a readiness probe and a running process: its probe's answer, or
        None while the probe runs. Probes run in the background, one at a time per pod, as a
        kubelet's probers do; a pass reads what came in (SGLang's /health takes over a second:
        probed inside the pass, every pass would take that long, and the runner's other work
        with it). An answer from another address (the pod replaced) is dropped."""
        answers: dict[tuple[str, str], bool | None] = {}
        for key, pod in pods.items():
            launch, run = wanted.get(key), self.running.get(key)
            url = None if launch is None else readiness_url(launch, pod)
            if url is None or run is None or not procs.is_running(run.record):
                self._probing.pop(key, None)
                continue
            answers[key] = None
            pending = self._probing.get(key)
            if pending is not None and pending[0] == url and not pending[1].done():
                continue
            if pending is not None and pending[0] == url:
                answers[key] = pending[1].result()
            self._probing[key] = (url, self._prober().submit(self.probe, url, probe_timeout(pod)))
        for key in set(self._probing) - set(answers):
            del self._probing[key]
        return answers

    def _prober(self) -> ThreadPoolExecutor:
        if self._probe_pool is None:
            self._probe_pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="probe")
        return self._probe_pool

    def _ready(
        self, key: tuple[str, str], pod: Pod, launch: Launch | None, answered: bool | None
    ) -> bool | None:
        """The readiness a kubelet would report now, given the probe's answer (None: no
        probe), or None while failures stay under the probe's failureThreshold. A pod this
        runner does not run (no engine or router container, or not bound yet) has no process
        to wait for: ready once it has an IP."""
        if launch is None:
            return bool((pod.get("status") or {}).get("podIP"))
        run = self.running.get(key)
        if run is None or not procs.is_running(run.record):
            self._probe_failures[key] = 0
            return False  # the container is gone: not ready at once
        if answered is None or answered:
            self._probe_failures[key] = 0
            return True
        self._probe_failures[key] = self._probe_failures.get(key, 0) + 1
        return False if self._probe_failures[key] >= failure_threshold(pod) else None

    def _netns(self, launch: Launch) -> str | None:
        if self.network is not None and self.network.enabled:
            return self.network.netns_for_ip(launch.ip)
        return None

    def _stop(self, key: tuple[str, str], *, hook: bool = True, replaced: bool = False) -> str:
        """Stop a pod's process; first its preStop hook, in the background, when it has one
        (`hook`) and still runs. A pod without a hook that went away gets SIGTERM and its
        grace in the background; one `replaced` by a new pod of the same name (whose process
        takes the same IP and port) is stopped at once. Returns what it did."""
        run = self.running.pop(key)
        launch = run.launch
        if not hook or not procs.is_running(run.record) or (replaced and not launch.prestop):
            return procs.stop(run.record, grace_s=5.0)
        if not launch.prestop:  # as a kubelet: a preStop sleep, SIGTERM, the rest of the grace
            self.stopping.add(launch.uid)

            def stop() -> None:
                slept = min(launch.prestop_sleep_s, launch.grace_s)
                time.sleep(slept)
                left = max(2.0, launch.grace_s - slept)  # the kubelet gives SIGTERM at least 2 s
                print(f"podrunner: {procs.stop(run.record, grace_s=left)}", flush=True)
                self.stopping.discard(launch.uid)

            threading.Thread(target=stop, daemon=True).start()
            return (
                f"SIGTERM to {launch.namespace}.{launch.name} after {launch.prestop_sleep_s:.0f}s"
                f" (up to {launch.grace_s:.0f}s)"
            )
        name = f"{launch.namespace}.{launch.name}"
        hook = self._at_pod_ip(launch.prestop, launch.namespace)
        record = procs.spawn(f"{name}.prestop", list(hook), self.log_dir,
                             env=dict(launch.env), netns=self._netns(launch))  # fmt: skip
        self.draining[launch.uid] = (run.record, record)
        threading.Thread(
            target=self._stop_after_hook, args=(launch.uid, launch.grace_s), daemon=True
        ).start()
        return f"preStop of {name} runs (up to {launch.grace_s:.0f}s)"

    def _at_pod_ip(self, argv: tuple[str, ...], namespace: str) -> tuple[str, ...]:
        """`argv` with its ``--host`` a pod's DNS name (an LWS leader address: the pod's name
        first) replaced by that pod's IP, as a cluster's DNS would answer; else unchanged."""
        if "--host" not in argv[:-1]:
            return argv
        at = argv.index("--host") + 1
        try:
            ipaddress.ip_address(argv[at])
            return argv
        except ValueError:
            ip = self.pod_ips.get((namespace, argv[at].split(".")[0]))
        return argv if ip is None else (*argv[:at], ip, *argv[at + 1 :])

    def _stop_after_hook(self, uid: str, grace_s: float) -> None:
        """The kubelet's order: the hook runs to its end or the grace period, then SIGTERM."""
        engine, hook = self.draining[uid]
        deadline = time.monotonic() + grace_s
        while procs.is_running(hook) and time.monotonic() < deadline:
            time.sleep(0.2)
        procs.stop(hook, grace_s=1.0)
        left = max(2.0, deadline - time.monotonic())  # the kubelet gives SIGTERM at least 2 s
        print(f"podrunner: {procs.stop(engine, grace_s=left)} after preStop", flush=True)
        self.draining.pop(uid, None)

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
        """Stop every process now (the runner exits): no hooks, and drains cut short."""
        if self._probe_pool is not None:
            self._probe_pool.shutdown(wait=False, cancel_futures=True)
            self._probe_pool, self._probing = None, {}
        records = [run.record for run in self.running.values()]
        records += [rec for engine, hook in self.draining.values() for rec in (hook, engine)]
        self.running.clear()
        return procs.stop_together(records, grace_s=5.0)

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
    core = client.CoreV1Api(load(config_file=str(kubeconfig)))  # type: ignore[no-untyped-call]

    def list_pods() -> list[Pod]:
        # the JSON as sent (no V1Pod models built and turned back into dicts: ~50x the CPU,
        # once a second per runner)
        if namespace:
            answer = core.list_namespaced_pod(
                namespace, _request_timeout=10, _preload_content=False
            )
        else:
            answer = core.list_pod_for_all_namespaces(_request_timeout=10, _preload_content=False)
        pods: list[Pod] = json.loads(answer.data).get("items") or []
        return pods

    return list_pods


def kube_status_patcher(kubeconfig: Path) -> Callable[[str, str, dict[str, Any]], None]:
    """A function that merge-patches one pod's status (the runner's readiness writes)."""
    from kubernetes import client, config

    load = config.new_client_from_config
    core = client.CoreV1Api(load(config_file=str(kubeconfig)))  # type: ignore[no-untyped-call]

    def patch(namespace: str, name: str, body: dict[str, Any]) -> None:
        core.patch_namespaced_pod_status(name, namespace, body, _request_timeout=10,
                                         _content_type="application/merge-patch+json")  # fmt: skip

    return patch


def kube_pod_deleter(kubeconfig: Path) -> Callable[[str, str, str], None]:
    """A function that removes one terminating pod's object (grace 0, its uid a precondition:
    a new pod under the same name is never hit); gone already is fine."""
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException

    load = config.new_client_from_config
    core = client.CoreV1Api(load(config_file=str(kubeconfig)))  # type: ignore[no-untyped-call]

    def delete(namespace: str, name: str, uid: str) -> None:
        body = client.V1DeleteOptions(grace_period_seconds=0,
                                      preconditions=client.V1Preconditions(uid=uid))  # fmt: skip
        try:
            core.delete_namespaced_pod(name, namespace, body=body, _request_timeout=10)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    return delete


def _object_reader(
    kubeconfig: Path, method: str, data_of: Callable[[Any], dict[str, str]]
) -> Callable[[str, str], dict[str, str] | None]:
    """A function that reads one namespaced object's data with CoreV1Api `method` (None when
    it does not exist)."""
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException

    load = config.new_client_from_config
    core = client.CoreV1Api(load(config_file=str(kubeconfig)))  # type: ignore[no-untyped-call]
    get = getattr(core, method)

    def read(namespace: str, name: str) -> dict[str, str] | None:
        try:
            found = get(name, namespace, _request_timeout=10)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return data_of(found)

    return read


def kube_secret_reader(kubeconfig: Path) -> SecretReader:
    """A function that reads one Secret's decoded keys (None when it does not exist)."""
    import base64

    return _object_reader(
        kubeconfig,
        "read_namespaced_secret",
        lambda found: {k: base64.b64decode(v).decode() for k, v in (found.data or {}).items()},
    )


def kube_configmap_reader(kubeconfig: Path) -> ConfigMapReader:
    """A function that reads one ConfigMap's data (None when it does not exist)."""
    return _object_reader(
        kubeconfig, "read_namespaced_config_map", lambda found: dict(found.data or {})
    )


def http_probe(url: str, timeout: float = 1.0) -> bool:
    """True when GET `url` answers 2xx/3xx within `timeout` (a kubelet's HTTP probe)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 200 <= int(resp.status) < 400
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.runtime.podrunner")
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
                       kubeconfig=args.kubeconfig.resolve() if args.routers else None,
                       network=load_for_kubeconfig(args.kubeconfig),
                       patch_status=kube_status_patcher(args.kubeconfig),
                       delete_pod=kube_pod_deleter(args.kubeconfig),
                       secrets=kube_secret_reader(args.kubeconfig),
                       configmaps=kube_configmap_reader(args.kubeconfig),
                       volume_root=args.log_dir / "volumes")  # fmt: skip
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # stop the sims before exiting
    try:
        runner.run(stop, args.interval)
    except KeyboardInterrupt:
        stop.set()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
