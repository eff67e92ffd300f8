"""Argo CD on the local stack, as processes: an optional part of it, started by the GitOps e2e
module (``e2e/tests/test_gitops_argocd.py``) with :func:`argocd_running`.

Data flow: the pinned Argo CD build (:mod:`e2e.cluster.bins`: one binary, each component named
by the ``argv[0]`` it is started under), Debian's ``redis-server`` and git's own daemon ->

1. Argo CD's CRDs (Application, AppProject; copied from its module's ``manifests/crds/`` by
   ``build-bins.sh``) applied server-side and awaited;
2. in ``namespace``, Argo CD's own namespace (a namespaced install): ``argocd-cm`` as Argo CD's
   installs ship it (``manifests/base/config/argocd-cm.yaml``: its default
   ``ignoreResourceUpdates`` and exclusions) plus the operator's health check for
   CodingAgentServing (``charts/cas-operator/argocd/``, the entry docs/architecture.md gives),
   ``argocd-secret``, the ``default`` AppProject, and the cluster
   Secret for ``https://kubernetes.default.svc`` limited to that namespace, so the controller
   caches and manages that namespace only;
3. processes, each started by :func:`e2e.cluster.procs.spawn` and recorded in
   ``<run_dir>/state.json`` as it starts: ``redis-server`` and ``git-daemon`` (serving
   ``<run_dir>/repos`` at ``git://127.0.0.1:<port>/``) on loopback, ``argocd-repo-server`` and
   ``argocd-application-controller`` (the admin kubeconfig; with ``ARGOCD_FAKE_IN_CLUSTER`` its
   in-cluster server is that kubeconfig's API server, as in Argo CD's own local development).

Ownership: :meth:`ArgoCD.stop` stops exactly the recorded pids, in reverse order. The CRDs are
cluster-wide and stay (they are the same for every run); the namespace, the Applications and
what they sync belong to the caller. Logs: ``<run_dir>/logs/<component>.log``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster import bins as binmod
from e2e.cluster import procs
from e2e.cluster.api import condition
from e2e.cluster.stack import ClusterError, ClusterHandle, free_ports, http_ok, run_kubectl
from e2e.paths import REPO_ROOT, write_json
from e2e.waits import record

HEALTH_CHECK = (
    REPO_ROOT / "charts/cas-operator/argocd/serving.cas.dev/CodingAgentServing/health.lua"
)
HEALTH_KEY = "resource.customizations.health.serving.cas.dev_CodingAgentServing"
IN_CLUSTER = "https://kubernetes.default.svc"
PART_OF = {"app.kubernetes.io/part-of": "argocd"}  # Argo CD reads only settings labelled so
CRDS = ("applications.argoproj.io", "appprojects.argoproj.io")
FIELD_MANAGER = "cas-e2e-argocd"
PORT_NAMES = ("redis", "git", "repo_server", "repo_metrics", "controller_metrics")
START_TIMEOUT_S = 60.0
STATE_FILE = "state.json"


class ArgoCDMissing(RuntimeError):
    """Something Argo CD needs here is not installed (the message says what and how)."""


def missing() -> str | None:
    """Why Argo CD cannot run here (a binary, Redis or git is missing), else None."""
    b = binmod.resolve()
    if not (b.argocd_controller.exists() and b.argocd_manifests.exists()):
        return f"Argo CD is not built ({b.argocd_controller}); run {binmod.BUILD_SCRIPT}"
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (make sysdeps: Debian's redis-server)"
    if shutil.which("git") is None:
        return "git is not installed"
    return None


@dataclass
class ArgoCD:
    """A started Argo CD: its run folder, namespace, loopback ports and process records."""

    run_dir: Path
    namespace: str
    ports: dict[str, int]
    records: list[procs.ProcRecord] = field(default_factory=list)

    @property
    def repos(self) -> Path:
        """The folder the git daemon serves: a bare repository ``<repos>/x.git`` is
        ``repo_url("x.git")``."""
        return self.run_dir / "repos"

    def repo_url(self, name: str) -> str:
        return f"git://127.0.0.1:{self.ports['git']}/{name}"

    def save(self) -> None:
        write_json(
            self.run_dir / STATE_FILE,
            {"namespace": self.namespace, "ports": self.ports,
             "processes": [r.to_json() for r in self.records]},
        )  # fmt: skip

    def crashed(self) -> list[procs.ProcRecord]:
        return [r for r in self.records if not procs.is_running(r)]

    def crash_report(self) -> str:
        return "\n\n".join(
            f"{r.name} (pid {r.pid}) exited; last lines of {r.log}:\n{procs.log_tail(r)}"
            for r in self.crashed()
        )

    def log_tail(self, name: str, lines: int = 20) -> str:
        rec = next((r for r in self.records if r.name == name), None)
        return procs.log_tail(rec, lines) if rec is not None else ""

    def stop(self) -> list[str]:
        """Stop every recorded process, last started first; idempotent."""
        return [procs.stop(rec) for rec in reversed(self.records)]


# -- the objects Argo CD reads -----------------------------------------------------------------


def config_objects(
    namespace: str, shipped_cm: dict[str, Any], health_lua: str
) -> list[dict[str, Any]]:
    """argocd-cm (as shipped, plus the health check), argocd-secret, the default AppProject and
    the in-cluster cluster Secret limited to ``namespace`` (pure)."""
    cluster_config = {"tlsClientConfig": {"insecure": False}}
    cm = {**shipped_cm, "metadata": {**shipped_cm["metadata"], "namespace": namespace}}
    cm["data"] = {**(shipped_cm.get("data") or {}), HEALTH_KEY: health_lua}
    return [
        cm,
        {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
         "metadata": {"name": "argocd-secret", "namespace": namespace, "labels": PART_OF},
         "stringData": {"server.secretkey": base64.b64encode(secrets.token_bytes(32)).decode()}},
        {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
         "metadata": {"name": "cluster-in-cluster", "namespace": namespace,
                      "labels": {**PART_OF, "argocd.argoproj.io/secret-type": "cluster"}},
         "stringData": {"name": "in-cluster", "server": IN_CLUSTER, "namespaces": namespace,
                        "clusterResources": "false", "config": json.dumps(cluster_config)}},
        {"apiVersion": "argoproj.io/v1alpha1", "kind": "AppProject",
         "metadata": {"name": "default", "namespace": namespace},
         "spec": {"sourceRepos": ["*"],
                  "destinations": [{"server": IN_CLUSTER, "namespace": namespace}]}},
    ]  # fmt: skip


def _apply(kubectl: Callable[..., str], objects: list[dict[str, Any]]) -> None:
    kubectl("apply", "--server-side", "--force-conflicts", f"--field-manager={FIELD_MANAGER}",
            "-f", "-", stdin=yaml.safe_dump_all(objects), timeout=180)  # fmt: skip


def install_crds(kubectl: Callable[..., str], crd_dir: Path) -> None:
    """Argo CD's Application and AppProject CRDs as shipped, then Established."""
    objects = [
        doc for path in sorted(crd_dir.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text()) if doc
    ]  # fmt: skip
    _apply(kubectl, objects)
    deadline = time.monotonic() + START_TIMEOUT_S
    for name in CRDS:  # (`kubectl wait` fails on a CRD whose status is not written yet)
        while condition(json.loads(kubectl("get", f"crd/{name}", "-o", "json")),
                        "Established") != "True":  # fmt: skip
            if time.monotonic() > deadline:
                raise ClusterError(f"CRD {name} not Established after {START_TIMEOUT_S:.0f}s")
            time.sleep(0.5)


# -- processes ---------------------------------------------------------------------------------


def _redis_pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class _Starter:
    argocd: ArgoCD
    kubeconfig: Path
    log: Callable[[str], None]

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        rec = procs.spawn(name, argv, self.argocd.run_dir / "logs", env=env)
        self.argocd.records.append(rec)
        self.argocd.save()
        self.log(f"started {name} (pid {rec.pid})")

    def wait(self, what: str, probe: Callable[[], bool]) -> None:
        start = time.monotonic()
        while not probe():
            if self.argocd.crashed():
                raise ClusterError(f"while waiting for {what}:\n{self.argocd.crash_report()}")
            if time.monotonic() - start > START_TIMEOUT_S:
                raise ClusterError(f"timed out after {START_TIMEOUT_S:.0f}s waiting for {what}")
            time.sleep(0.2)
        took = time.monotonic() - start
        record(f"argocd: {what}", took)  # the suite's record of where time goes (e2e.waits)
        self.log(f"{what}: ok after {took:.1f}s")

    def redis(self) -> None:
        port = self.argocd.ports["redis"]
        data = self.argocd.run_dir / "redis"
        data.mkdir(parents=True, exist_ok=True)
        server = shutil.which("redis-server") or "redis-server"
        self.spawn("redis", [server, "--bind", "127.0.0.1", "--port", str(port),
                             "--save", "", "--appendonly", "no", "--dir", str(data),
                             "--protected-mode", "yes", "--loglevel", "warning",
                             # keep argv as started: the harness knows its processes by it
                             "--set-proc-title", "no"])  # fmt: skip
        self.wait("redis PONG", lambda: _redis_pong(port))

    def git_daemon(self) -> None:
        """git's own daemon, read-only, serving every repository under ``repos`` on loopback
        (started as ``git-daemon`` itself, so the recorded pid is the server's)."""
        repos, port = self.argocd.repos, self.argocd.ports["git"]
        repos.mkdir(parents=True, exist_ok=True)
        exec_path = subprocess.run(["git", "--exec-path"], capture_output=True, text=True,
                                   check=True).stdout.strip()  # fmt: skip
        self.spawn("git-daemon", [f"{exec_path}/git-daemon", "--reuseaddr", "--export-all",
                                  "--listen=127.0.0.1", f"--port={port}", "--informative-errors",
                                  f"--base-path={repos}", str(repos)])  # fmt: skip
        self.wait("git daemon listening", lambda: _listening(port))

    def env(self) -> dict[str, str]:
        """What both Argo CD components get: the kubeconfig, paths of their own under the run
        folder (never the shared /tmp defaults: another run's sockets and clones live there)."""
        run = self.argocd.run_dir
        for sub in ("tmp", "tls", "ssh", "gnupg"):
            (run / sub).mkdir(parents=True, exist_ok=True)
        return {
            "KUBECONFIG": str(self.kubeconfig),
            "ARGOCD_FAKE_IN_CLUSTER": "true",
            "TMPDIR": str(run / "tmp"),
            "ARGOCD_ASK_PASS_SOCK": str(run / "askpass.sock"),
            "ARGOCD_TLS_DATA_PATH": str(run / "tls"),
            "ARGOCD_SSH_DATA_PATH": str(run / "ssh"),
            "ARGOCD_GNUPGHOME": str(run / "gnupg"),
            "ARGOCD_GPG_ENABLED": "false",
            "GIT_CONFIG_NOSYSTEM": "1",
        }

    def repo_server(self, exe: Path) -> None:
        """The repo server, with the scripts Argo CD's image puts beside it on PATH (it runs
        ``git-verify-wrapper.sh`` on every revision it reads)."""
        p = self.argocd.ports
        env = self.env()
        env["PATH"] = f"{exe.parent / 'hack'}{os.pathsep}{os.environ.get('PATH', '')}"
        self.spawn("argocd-repo-server", [
            str(exe), "--address=127.0.0.1", f"--port={p['repo_server']}",
            "--metrics-address=127.0.0.1", f"--metrics-port={p['repo_metrics']}",
            f"--redis=127.0.0.1:{p['redis']}", "--disable-tls", "--client-ca-path=",
            "--parallelismlimit=2",
            "--logformat=text", "--loglevel=info",
        ], env=env)  # fmt: skip
        self.wait("argocd-repo-server listening", lambda: _listening(p["repo_server"]))

    def controller(self, exe: Path, app_resync_s: int) -> None:
        p = self.argocd.ports
        self.spawn("argocd-application-controller", [
            str(exe), f"--namespace={self.argocd.namespace}",
            f"--redis=127.0.0.1:{p['redis']}",
            f"--repo-server=127.0.0.1:{p['repo_server']}", "--repo-server-plaintext",
            f"--metrics-port={p['controller_metrics']}",
            f"--app-resync={app_resync_s}", "--app-resync-jitter=0",
            "--status-processors=2", "--operation-processors=2",
            # each managed resource's health (status and message) in the Application's status
            "--persist-resource-health",
            "--logformat=text", "--loglevel=info",
        ], env=self.env())  # fmt: skip
        url = f"http://127.0.0.1:{p['controller_metrics']}/healthz"
        self.wait("argocd-application-controller /healthz", lambda: http_ok(url))


def start_argocd(
    cluster: ClusterHandle,
    namespace: str,
    run_dir: Path,
    *,
    app_resync_s: int = 30,
    log: Callable[[str], None] = print,
) -> ArgoCD:
    """Install Argo CD's CRDs and settings for ``namespace`` and start its processes (see the
    module docstring). Raises :class:`ArgoCDMissing` when it cannot run here, and
    :class:`ClusterError` naming the component on a crash or timeout (what was started is
    stopped again first)."""
    why = missing()
    if why is not None:
        raise ArgoCDMissing(why)
    b = binmod.resolve()
    kubectl = lambda *a, **kw: run_kubectl(cluster.kubectl_path, cluster.kubeconfig, *a, **kw)  # noqa: E731
    install_crds(kubectl, b.argocd_manifests / "crds")
    shipped = yaml.safe_load((b.argocd_manifests / "base/config/argocd-cm.yaml").read_text())
    _apply(kubectl, config_objects(namespace, shipped, HEALTH_CHECK.read_text()))
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    argocd = ArgoCD(run_dir=run_dir, namespace=namespace, ports=free_ports(PORT_NAMES))
    starter = _Starter(argocd, cluster.kubeconfig, log)
    try:
        starter.redis()
        starter.git_daemon()
        starter.repo_server(b.argocd_repo_server)
        starter.controller(b.argocd_controller, app_resync_s)
    except BaseException:
        log("Argo CD start failed; stopping what was started")
        argocd.stop()
        raise
    return argocd


@contextlib.contextmanager
def argocd_running(
    cluster: ClusterHandle, namespace: str, run_dir: Path, **kwargs: Any
) -> Iterator[ArgoCD]:
    """:func:`start_argocd`, stopped however the block ends (log tails printed on a crash)."""
    argocd = start_argocd(cluster, namespace, run_dir, **kwargs)
    try:
        yield argocd
    finally:
        if argocd.crashed():
            print(f"Argo CD crashed:\n{argocd.crash_report()}")
        for line in argocd.stop():
            print(f"[argocd] {line}")
