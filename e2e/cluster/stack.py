"""The local Kubernetes stack as processes: ``python -m e2e.cluster up|down|status``.

Data flow (``up``): pinned binaries (:mod:`e2e.cluster.bins`) + fresh certificates
(:mod:`e2e.cluster.pki`) -> etcd -> kube-apiserver -> kube-controller-manager, kube-scheduler ->
KWOK + fake GPU nodes (:mod:`e2e.cluster.manifests`) -> kube-proxy -> LWS CRDs, LWS controller
and its webhooks -> Gateway API CRDs, Traefik (the Gateway API implementation) and the shared
Gateway ``default/cas-gateway`` (kube-proxy and the Gateway with the pod network only). Before
any process, the pod network (:mod:`e2e.cluster.podnet`: one network namespace per node, or
loopback mode where that is impossible) is made and recorded in ``<run>/podnet.json``; ``down``
removes exactly what it made. Every process is started detached by :mod:`e2e.cluster.procs`;
their records, ports and the admin kubeconfig path are written to ``<run>/state.json`` as each
starts, so ``down`` (from any process) stops exactly those pids, even after a failed ``up``.
``<run>`` is ``$CAS_RUN_DIR`` or ``run/cluster`` in the repository; logs are in
``<run>/logs/<component>.log``.

Importable: :func:`start_cluster` returns a :class:`ClusterHandle` (``.kubeconfig``, ``.stop()``,
``.crashed()``); :func:`load_cluster` finds a running one.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cas_engine.sim.fleet import free_port
from e2e.cluster import bins as binmod
from e2e.cluster import manifests, pki, podnet, procs
from e2e.cluster.api import Api, ApiError, condition, raw_get
from e2e.paths import REPO_ROOT, write_json

SERVICE_CIDR = podnet.SERVICE_CIDR  # blackholed on the host (see e2e.cluster.podnet)
CONTROLLER_THROUGHPUT = ("--kube-api-qps=200", "--kube-api-burst=400")
# The fake nodes renew their Leases every quarter of this (KWOK's rule, as a kubelet's). At 40 s,
# 24 nodes made 144 Lease writes a minute (KWOK's own CPU for them: 0.7 s a minute, 0.17 s at
# 240 s); no test is about a node going silent, so they renew once a minute and the node
# lifecycle controller waits a grace to match (it would otherwise taint every node NotReady).
NODE_LEASE_S = 240
NODE_MONITOR = ("--node-monitor-period=30s", f"--node-monitor-grace-period={NODE_LEASE_S + 60}s")
SERVICE_IP = podnet.SERVICE_IP
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
STATE_FILE = "state.json"
LWS_CRD = "leaderworkersets.leaderworkerset.x-k8s.io"
CRD_APPLY_TIMEOUT_S = 180
PORT_NAMES = (
    "etcd",
    "etcd_peer",
    "apiserver",
    "controller_manager",
    "scheduler",
    "lws_webhook",
    "lws_health",
    "kube_proxy_healthz",
    "kube_proxy_metrics",
    "gateway_web",
    "gateway_ping",
)
# The Gateway API implementation (Traefik, a host process) and the one shared Gateway it serves:
# HTTPRoutes of any namespace attach to it with parentRefs [{namespace: default, name: ...}].
GATEWAY_CLASS = "cas-traefik"
GATEWAY_CONTROLLER = "traefik.io/gateway-controller"
GATEWAY_NAMESPACE = "default"
GATEWAY_NAME = "cas-gateway"
GATEWAY_CRDS = ("gatewayclasses", "gateways", "httproutes", "referencegrants")


class ClusterError(RuntimeError):
    """The stack could not be started, or a component crashed (the message names it)."""


class AlreadyRunning(ClusterError):
    """``up`` found the processes of a previous ``up`` in this run folder still alive."""


def default_run_dir() -> Path:
    """``$CAS_RUN_DIR`` or ``<repo>/run/cluster`` (ignored by git)."""
    override = os.environ.get("CAS_RUN_DIR")
    return Path(override).expanduser().resolve() if override else REPO_ROOT / "run" / "cluster"


@dataclass
class ClusterHandle:
    """A started (or found) stack: its run folder, kubeconfig and process records."""

    run_dir: Path
    kubeconfig: Path
    ports: dict[str, int]
    records: list[procs.ProcRecord] = field(default_factory=list)
    kubectl_path: Path | None = None

    @property
    def gateway_url(self) -> str | None:
        """``http://<host side>:<port>`` of the shared Gateway (None without the pod network)."""
        net = self.network
        if net is None or not net.enabled or "gateway_web" not in self.ports:
            return None
        return f"http://{net.host_ip}:{self.ports['gateway_web']}"

    @property
    def audit_log(self) -> Path:
        """The API server's audit log: every service account's request (see ``audit_policy``)."""
        return self.run_dir / "audit.log"

    @property
    def network(self) -> podnet.PodNetwork | None:
        """The pod network recorded in the run folder (None for an external cluster)."""
        return podnet.PodNetwork.load(self.run_dir)

    # -- persistence ---------------------------------------------------------------------------
    def save(self) -> None:
        """Write ``state.json`` (atomically), so another process can find and stop the stack."""
        state = {
            "kubeconfig": str(self.kubeconfig),
            "ports": self.ports,
            "kubectl": str(self.kubectl_path or ""),
            "processes": [r.to_json() for r in self.records],
        }
        write_json(self.run_dir / STATE_FILE, state)

    @classmethod
    def load(cls, run_dir: Path) -> ClusterHandle | None:
        """The handle recorded in ``run_dir``, or None when nothing is recorded there."""
        path = run_dir / STATE_FILE
        if not path.exists():
            return None
        state = json.loads(path.read_text())
        return cls(
            run_dir=run_dir,
            kubeconfig=Path(state["kubeconfig"]),
            ports={k: int(v) for k, v in state["ports"].items()},
            records=[procs.ProcRecord.from_json(p) for p in state["processes"]],
            kubectl_path=Path(state["kubectl"]) if state.get("kubectl") else None,
        )

    # -- inspection ----------------------------------------------------------------------------
    def running(self) -> list[procs.ProcRecord]:
        return [r for r in self.records if procs.is_running(r)]

    def crashed(self) -> list[procs.ProcRecord]:
        """Recorded processes that are no longer running (each is a crash while up)."""
        return [r for r in self.records if not procs.is_running(r)]

    def crash_report(self) -> str:
        """One paragraph per crashed component: its name, pid, exit status and log tail."""
        parts = []
        for rec in self.crashed():
            code = procs.exit_code(rec)
            status = f"exit status {code}" if code is not None else "not running"
            parts.append(
                f"{rec.name} (pid {rec.pid}) {status}; last lines of {rec.log}:\n"
                f"{procs.log_tail(rec)}"
            )
        return "\n\n".join(parts)

    def kubectl(self, *args: str, timeout: float = 60, check: bool = True) -> str:
        """Run the pinned kubectl against this cluster; return stdout."""
        return run_kubectl(self.kubectl_path, self.kubeconfig, *args, timeout=timeout, check=check)

    # -- teardown ------------------------------------------------------------------------------
    def stop(self) -> list[str]:
        """Stop every recorded process (reverse start order); idempotent. Returns messages."""
        messages = [procs.stop(rec) for rec in reversed(self.records)]
        net = self.network
        if net is not None:
            messages += [f"removed {what}" for what in net.teardown()]
        state = self.run_dir / STATE_FILE
        if state.exists():
            state.replace(self.run_dir / "state.stopped.json")
        return messages


# -- small utilities ---------------------------------------------------------------------------


def free_ports(names: tuple[str, ...]) -> dict[str, int]:
    """Distinct free TCP ports on 127.0.0.1, one per name, outside the kernel's ephemeral
    range (`cas_engine.sim.fleet.free_port` says why)."""
    ports: dict[str, int] = {}
    while len(ports) < len(names):
        port = free_port()
        if port not in ports.values():
            ports[names[len(ports)]] = port
    return ports


def run_kubectl(
    kubectl: Path | None,
    kubeconfig: Path,
    *args: str,
    timeout: float = 60,
    check: bool = True,
    stdin: str | None = None,
) -> str:
    """``kubectl --kubeconfig <kubeconfig> <args>``; raise ClusterError with stderr on failure."""
    exe = str(kubectl) if kubectl else (shutil.which("kubectl") or "kubectl")
    proc = subprocess.run(
        [exe, "--kubeconfig", str(kubeconfig), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and proc.returncode != 0:
        raise ClusterError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


@dataclass
class ClusterKubectl:
    """``kubectl(*args, stdin=None, check=True, timeout=60) -> stdout`` against one cluster,
    and :meth:`rest_get`, a read straight from its API server.

    Tests poll a lot (a fleet's pods, its status), and each kubectl process costs ~55 ms of
    CPU (start, kubeconfig, discovery cache) on a 2-core machine where the suite is CPU-bound;
    a GET over one kept TLS context costs a few. Writes and everything a user would type stay
    kubectl."""

    kubectl_path: Path | None
    kubeconfig: Path
    _api: Api | None = field(default=None, init=False, repr=False)
    _api_tried: bool = field(default=False, init=False, repr=False)

    def __call__(
        self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 60
    ) -> str:
        return run_kubectl(
            self.kubectl_path, self.kubeconfig, *args, stdin=stdin, check=check, timeout=timeout
        )

    def rest_get(self, path: str) -> dict[str, Any] | None:
        """The JSON at API path ``path`` (``/api/v1/namespaces/x/pods?labelSelector=...``), or
        None when it does not exist; ``kubectl get --raw`` where the kubeconfig is not one the
        harness can read (:meth:`Api.from_kubeconfig`)."""
        if not self._api_tried:
            self._api, self._api_tried = Api.from_kubeconfig(self.kubeconfig), True
        if self._api is None:
            return raw_get(self, path)
        try:
            return self._api.get(path)
        except ApiError as exc:
            raise ClusterError(f"GET {path}: {exc}") from None


def wait_for(
    what: str,
    probe: Callable[[], bool],
    *,
    timeout: float,
    handle: ClusterHandle,
    interval: float = 0.25,
) -> float:
    """Poll ``probe`` until true; fail fast (naming it) if a recorded process crashes meanwhile.

    Returns the seconds waited; raises :class:`ClusterError` on timeout.
    """
    start = time.monotonic()
    deadline = start + timeout
    while True:
        if handle.crashed():
            raise ClusterError(f"while waiting for {what}:\n{handle.crash_report()}")
        try:
            if probe():
                return time.monotonic() - start
        except (OSError, ClusterError, ApiError, subprocess.TimeoutExpired):
            pass
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def http_ok(url: str, ctx: ssl.SSLContext | None = None, timeout: float = 2.0) -> bool:
    """True when GET ``url`` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=ctx) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


def insecure_ctx() -> ssl.SSLContext:
    """TLS context for health probes of self-signed loopback endpoints."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def admin_ctx(p: pki.PKI) -> ssl.SSLContext:
    """TLS context that trusts our CA and presents the admin client certificate."""
    ctx = ssl.create_default_context(cafile=str(p.ca_crt))
    ctx.load_cert_chain(str(p.admin_crt), str(p.admin_key))
    return ctx


def write_kubeconfig(path: Path, server: str, p: pki.PKI) -> None:
    """An admin kubeconfig with the CA and client certificate embedded (portable file)."""
    import base64

    def b64(f: Path) -> str:
        return base64.b64encode(f.read_bytes()).decode()

    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "cas-local",
                "cluster": {"server": server, "certificate-authority-data": b64(p.ca_crt)},
            }
        ],
        "users": [
            {
                "name": "cas-admin",
                "user": {
                    "client-certificate-data": b64(p.admin_crt),
                    "client-key-data": b64(p.admin_key),
                },
            }
        ],
        "contexts": [
            {"name": "cas-local", "context": {"cluster": "cas-local", "user": "cas-admin"}}
        ],
        "current-context": "cas-local",
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    path.chmod(0o600)


# -- the start sequence ------------------------------------------------------------------------


@dataclass
class _Starter:
    """Carries what every start step needs; each step appends records and saves the state."""

    handle: ClusterHandle
    bins: binmod.Bins
    pki: pki.PKI
    net: podnet.PodNetwork
    log: Callable[[str], None]
    timings: dict[str, float] = field(default_factory=dict)
    first_node: str = ""

    @property
    def run_dir(self) -> Path:
        return self.handle.run_dir

    @property
    def ports(self) -> dict[str, int]:
        return self.handle.ports

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        rec = procs.spawn(name, argv, self.run_dir / "logs", env=env)
        self.handle.records.append(rec)
        self.handle.save()
        self.log(f"started {name} (pid {rec.pid})")

    def wait(self, what: str, probe: Callable[[], bool], timeout: float) -> None:
        took = wait_for(what, probe, timeout=timeout, handle=self.handle)
        self.timings[what] = took
        self.log(f"{what}: ok after {took:.1f}s")

    @property
    def api(self) -> Api:
        return Api(f"https://{self.net.api_host}:{self.ports['apiserver']}", admin_ctx(self.pki))

    # -- components ----------------------------------------------------------------------------
    def etcd(self) -> None:
        data = self.run_dir / "etcd-data"
        shutil.rmtree(data, ignore_errors=True)
        client = f"http://127.0.0.1:{self.ports['etcd']}"
        peer = f"http://127.0.0.1:{self.ports['etcd_peer']}"
        self.spawn(
            "etcd",
            [
                str(self.bins.etcd),
                "--name=cas",
                f"--data-dir={data}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=cas={peer}",
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
        )
        self.wait("etcd health", lambda: http_ok(f"{client}/health"), timeout=30)

    def audit_policy(self) -> Path:
        """Audit every request of a service account outside kube-system (one event, at
        completion, no bodies): the chart-identity tests read the operator's answers (403s)
        from the log; nothing else. The controllers' own accounts (kube-system) made 97% of
        the events, a cost the API server paid on every request for nothing."""
        path = self.run_dir / "audit-policy.yaml"
        policy = {
            "apiVersion": "audit.k8s.io/v1",
            "kind": "Policy",
            "omitStages": ["RequestReceived", "ResponseStarted"],
            "rules": [
                {"level": "None", "userGroups": ["system:serviceaccounts:kube-system"]},
                {"level": "Metadata", "userGroups": ["system:serviceaccounts"]},
                {"level": "None"},
            ],
        }
        path.write_text(yaml.safe_dump(policy, sort_keys=False))
        return path

    def apiserver(self) -> None:
        p, port = self.pki, self.ports["apiserver"]
        self.spawn(
            "kube-apiserver",
            [
                str(self.bins.kube_apiserver),
                f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
                f"--bind-address={self.net.api_host}",
                f"--advertise-address={self.net.api_host}",
                f"--secure-port={port}",
                f"--cert-dir={self.run_dir / 'apiserver-certs'}",
                f"--tls-cert-file={p.apiserver_crt}",
                f"--tls-private-key-file={p.apiserver_key}",
                f"--client-ca-file={p.ca_crt}",
                f"--service-account-key-file={p.sa_pub}",
                f"--service-account-signing-key-file={p.sa_key}",
                f"--service-account-issuer={SA_ISSUER}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                "--allow-privileged=true",
                "--profiling=false",
                "--endpoint-reconciler-type=none",
                # blockOwnerDeletion on a child needs update on its owner's finalizers, as on
                # clusters that enable this plugin (the chart's RBAC is tested against it).
                "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
                f"--audit-policy-file={self.audit_policy()}",
                f"--audit-log-path={self.handle.audit_log}",
                "--audit-log-format=json",
                "--audit-log-maxsize=200",
                "--audit-log-maxbackup=1",
            ],
        )
        ctx = admin_ctx(p)
        self.wait(
            "kube-apiserver /readyz",
            lambda: http_ok(f"https://{self.net.api_host}:{port}/readyz", ctx),
            timeout=90,
        )

    def controllers(self) -> None:
        """kube-controller-manager (all controllers, incl. GC) and kube-scheduler."""
        p, kc = self.pki, str(self.handle.kubeconfig)
        common = [
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1",
            "--leader-elect=false",
        ]
        self.spawn(
            "kube-controller-manager",
            [
                str(self.bins.kube_controller_manager),
                *common,
                f"--secure-port={self.ports['controller_manager']}",
                f"--cert-dir={self.run_dir / 'kcm-certs'}",
                "--controllers=*",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={p.sa_key}",
                f"--root-ca-file={p.ca_crt}",
                f"--cluster-signing-cert-file={p.ca_crt}",
                f"--cluster-signing-key-file={p.ca_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                # Client rate limits of a production-sized control plane, not the defaults
                # (20 QPS and 5 workers throttle rollouts of hundreds of Deployments).
                *CONTROLLER_THROUGHPUT,
                "--concurrent-deployment-syncs=20",
                "--concurrent-replicaset-syncs=20",
                *NODE_MONITOR,
            ],
        )
        self.spawn(
            "kube-scheduler",
            [
                str(self.bins.kube_scheduler),
                *common,
                *CONTROLLER_THROUGHPUT,
                f"--secure-port={self.ports['scheduler']}",
                f"--cert-dir={self.run_dir / 'scheduler-certs'}",
            ],
        )
        ctx = insecure_ctx()
        for name in ("controller_manager", "scheduler"):
            url = f"https://127.0.0.1:{self.ports[name]}/healthz"
            self.wait(
                f"{name.replace('_', '-')} /healthz", functools.partial(http_ok, url, ctx), 60
            )

    def kwok_and_nodes(self, shape: manifests.NodeShape) -> None:
        """KWOK managing nodes labelled type=kwok, then the nodes themselves, then Ready."""
        config = self.run_dir / "kwok.yaml"
        config.write_text(manifests.kwok_config(self.bins.kwok_stages))
        self.spawn(
            "kwok",
            [
                str(self.bins.kwok),
                f"--kubeconfig={self.handle.kubeconfig}",
                f"--config={config}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-label-selector="
                f"{manifests.KWOK_NODE_LABEL}={manifests.KWOK_NODE_LABEL_VALUE}",
                f"--node-lease-duration-seconds={NODE_LEASE_S}",
                "--node-port=0",
            ],
        )
        version = binmod.read_versions()["KUBERNETES_VERSION"]
        self.first_node = f"{shape.name_prefix}-0"
        api = self.api
        nodes = manifests.gpu_nodes(shape, kubelet_version=version, pod_cidr=self.net.node_cidr)
        for node in nodes:
            api.create("/api/v1/nodes", node)
        self.wait(f"{shape.count} KWOK nodes Ready", lambda: self._nodes_ready(shape.count), 60)

    def _nodes_ready(self, count: int) -> bool:
        selector = f"{manifests.KWOK_NODE_LABEL}%3D{manifests.KWOK_NODE_LABEL_VALUE}"
        nodes = self.api.request("GET", f"/api/v1/nodes?labelSelector={selector}")["items"]
        return sum(condition(n, "Ready") == "True" for n in nodes) >= count

    def kube_proxy(self) -> None:
        """kube-proxy in nftables mode for the host namespace (netns mode only): ClusterIPs are
        DNATed to endpoints for host processes (output hook) and for pods, whose node namespaces
        route the Service CIDR to the host (prerouting hook). NodePorts only on the host side
        address of the pod network; conntrack sysctls left as they are."""
        if not self.net.enabled:
            return
        self.net.made.kube_proxy = True  # from here on, teardown removes its nft tables
        self.net.save()
        self.spawn(
            "kube-proxy",
            [
                str(self.bins.kube_proxy),
                f"--kubeconfig={self.handle.kubeconfig}",
                "--proxy-mode=nftables",
                f"--cluster-cidr={podnet.POD_CIDR}",
                # A node that exists (kube-proxy waits for its own Node object): the first one.
                f"--hostname-override={self.first_node}",
                f"--bind-address={podnet.HOST_IP}",
                f"--nodeport-addresses={podnet.HOST_IP}/32",
                f"--healthz-bind-address=127.0.0.1:{self.ports['kube_proxy_healthz']}",
                f"--metrics-bind-address=127.0.0.1:{self.ports['kube_proxy_metrics']}",
                "--conntrack-max-per-core=0",
                "--conntrack-tcp-timeout-established=0",
                "--conntrack-tcp-timeout-close-wait=0",
                *CONTROLLER_THROUGHPUT,
                "--v=1",
            ],
        )
        url = f"http://127.0.0.1:{self.ports['kube_proxy_healthz']}/healthz"
        self.wait("kube-proxy /healthz", lambda: http_ok(url), timeout=60)

    def gateway(self) -> None:
        """Gateway API CRDs (standard channel), Traefik's Kubernetes Gateway provider as a host
        process, a GatewayClass for it and the shared Gateway (netns mode only: the Gateway
        routes to Service endpoints, pod IPs). Its HTTP entry point listens on the host side
        address, so hosts and pods reach it; the ping endpoint on loopback is its health."""
        if not self.net.enabled:
            return
        api = Api(self.api.server, self.api.ctx, timeout=CRD_APPLY_TIMEOUT_S)
        for path in sorted(self.bins.gateway_crds.glob("*.yaml")):
            for crd in yaml.safe_load_all(path.read_text()):
                if crd:
                    api.create_or_apply(
                        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd
                    )
        for plural in GATEWAY_CRDS:
            name = f"{plural}.gateway.networking.k8s.io"
            self.wait(f"CRD {name} established",
                      functools.partial(self._crd_established, name), 60)  # fmt: skip
        web, ping = self.ports["gateway_web"], self.ports["gateway_ping"]
        self.spawn(
            "traefik",
            [
                str(self.bins.traefik),
                f"--entryPoints.web.address={self.net.host_ip}:{web}",
                f"--entryPoints.ping.address=127.0.0.1:{ping}",
                "--ping=true",
                "--ping.entryPoint=ping",
                "--providers.kubernetesgateway=true",
                f"--providers.kubernetesgateway.statusAddress.ip={self.net.host_ip}",
                "--providers.kubernetesgateway.throttleDuration=0s",
                "--global.checkNewVersion=false",
                "--global.sendAnonymousUsage=false",
                "--log.level=INFO",
            ],
            env={"KUBECONFIG": str(self.handle.kubeconfig)},
        )
        self.wait("traefik /ping", lambda: http_ok(f"http://127.0.0.1:{ping}/ping"), 60)
        api.apply(
            f"/apis/gateway.networking.k8s.io/v1/gatewayclasses/{GATEWAY_CLASS}",
            {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass",
             "metadata": {"name": GATEWAY_CLASS},
             "spec": {"controllerName": GATEWAY_CONTROLLER}},
        )  # fmt: skip
        gateway_path = (f"/apis/gateway.networking.k8s.io/v1/namespaces/{GATEWAY_NAMESPACE}"
                        f"/gateways/{GATEWAY_NAME}")  # fmt: skip
        api.apply(
            gateway_path,
            {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
             "metadata": {"name": GATEWAY_NAME, "namespace": GATEWAY_NAMESPACE},
             "spec": {"gatewayClassName": GATEWAY_CLASS,
                      "listeners": [{"name": "http", "protocol": "HTTP", "port": web,
                                     "allowedRoutes": {"namespaces": {"from": "All"}}}]}},
        )  # fmt: skip
        self.wait(
            f"Gateway {GATEWAY_NAME} Programmed",
            lambda: condition(self.api.get(gateway_path) or {}, "Programmed") == "True",
            60,
        )

    def _crd_established(self, name: str) -> bool:
        crd = self.api.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
        return condition(crd or {}, "Established") == "True"

    def lws_crds(self) -> None:
        """Create the LWS CRDs as shipped (server-side apply over an existing one)."""
        api = Api(self.api.server, self.api.ctx, timeout=CRD_APPLY_TIMEOUT_S)
        for path in sorted(self.bins.lws_crds.glob("*.yaml")):
            for crd in yaml.safe_load_all(path.read_text()):
                if crd:
                    api.create_or_apply(
                        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd
                    )

    def lws(self) -> None:
        """The LWS controller with its webhook server on loopback, then its webhooks."""
        self.wait("LWS CRD established", self._lws_crd_established, timeout=60)
        config = self.run_dir / "lws-config.yaml"
        config.write_text(
            manifests.lws_config(
                webhook_port=self.ports["lws_webhook"],
                cert_dir=self.pki.webhook_dir,
                health_port=self.ports["lws_health"],
            )
        )
        self.spawn(
            "lws-controller",
            [
                str(self.bins.lws_controller),
                f"--config={config}",
                f"--kubeconfig={self.handle.kubeconfig}",
            ],
            env={"KUBECONFIG": str(self.handle.kubeconfig)},
        )
        self.wait(
            "lws-controller /readyz",
            lambda: http_ok(f"http://127.0.0.1:{self.ports['lws_health']}/readyz"),
            timeout=60,
        )
        self.wait("lws webhook server", lambda: _port_open(self.ports["lws_webhook"]), 30)
        hooks = manifests.lws_webhooks(
            self.bins.lws_webhook,
            port=self.ports["lws_webhook"],
            ca_pem=self.pki.ca_crt.read_bytes(),
        )
        api = self.api
        for hook in hooks:
            plural = hook["kind"].lower() + "s"
            name = hook["metadata"]["name"]
            api.apply(f"/apis/admissionregistration.k8s.io/v1/{plural}/{name}", hook)

    def _lws_crd_established(self) -> bool:
        crd = self.api.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{LWS_CRD}")
        return condition(crd, "Established") == "True"

    def default_service_account(self) -> None:
        """The serviceaccount controller has made ``default/default`` (pods need it)."""
        path = "/api/v1/namespaces/default/serviceaccounts/default"
        self.wait("default service account", lambda: self.api.get(path) is not None, 60)


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def load_cluster(run_dir: Path | None = None) -> ClusterHandle | None:
    """The stack recorded in ``run_dir`` when all its processes still run; else None."""
    handle = ClusterHandle.load(run_dir or default_run_dir())
    if handle is None or handle.crashed():
        return None
    return handle


def start_cluster(
    run_dir: Path | None = None,
    *,
    shape: manifests.NodeShape | None = None,
    log: Callable[[str], None] | None = None,
) -> ClusterHandle:
    """Start the whole stack in ``run_dir`` and return once it is ready.

    Raises :class:`AlreadyRunning` when a previous start there is still alive (some of it), and
    :class:`ClusterError` naming the component on a crash or timeout; in that case everything
    started so far is stopped again before raising.
    """
    run_dir = (run_dir or default_run_dir()).resolve()
    say = log or (lambda _msg: None)
    previous = ClusterHandle.load(run_dir)
    if previous is not None and previous.running() and previous.crashed():
        names = ", ".join(r.name for r in previous.crashed())
        raise ClusterError(
            f"the local cluster in {run_dir} is partly running ({names} crashed); "
            "run 'python -m e2e.cluster down' first"
        )
    if previous is not None and previous.running():
        raise AlreadyRunning(
            f"the local cluster in {run_dir} is already running (kubeconfig: {previous.kubeconfig})"
        )
    bins = binmod.resolve()
    missing = bins.missing()
    if missing:
        raise ClusterError(f"missing binaries: {', '.join(missing)}; run {binmod.BUILD_SCRIPT}")
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("logs", "pki"):
        shutil.rmtree(run_dir / stale, ignore_errors=True)
    handle = ClusterHandle(
        run_dir=run_dir,
        kubeconfig=run_dir / "kubeconfig",
        ports=free_ports(PORT_NAMES),
        kubectl_path=bins.kubectl,
    )
    started = time.monotonic()
    shape = shape or manifests.NodeShape()
    handle.save()
    try:
        net = podnet.make(run_dir, shape.count, log=say)
    except podnet.PodNetError as exc:
        raise ClusterError(str(exc)) from exc
    keys = pki.make_pki(run_dir / "pki", service_ip=SERVICE_IP, extra_ips=[net.api_host])
    server = f"https://{net.api_host}:{handle.ports['apiserver']}"
    write_kubeconfig(handle.kubeconfig, server, keys)
    handle.save()
    starter = _Starter(handle=handle, bins=bins, pki=keys, net=net, log=say)
    try:
        starter.etcd()
        starter.apiserver()
        # The LWS CRDs are large (over 600 KB each): apply them while the rest starts.
        with ThreadPoolExecutor(max_workers=1) as pool:
            crds = pool.submit(starter.lws_crds)
            starter.controllers()
            starter.kwok_and_nodes(shape)
            starter.kube_proxy()
            crds.result(timeout=CRD_APPLY_TIMEOUT_S)
        starter.lws()
        starter.default_service_account()
        starter.gateway()
    except BaseException:
        say("start failed; stopping what was started")
        handle.stop()
        raise
    say(f"cluster ready in {time.monotonic() - started:.1f}s; kubeconfig: {handle.kubeconfig}")
    return handle


# -- command line ------------------------------------------------------------------------------


def _print(msg: str) -> None:
    print(f"cluster: {msg}", flush=True)


def cmd_up(run_dir: Path) -> int:
    if os.environ.get("CAS_KUBECONFIG"):
        _print(f"CAS_KUBECONFIG is set; using {os.environ['CAS_KUBECONFIG']}, nothing to start")
        return 0
    try:
        handle = start_cluster(run_dir, log=_print)
    except AlreadyRunning as exc:
        _print(str(exc))
        return 0
    except ClusterError as exc:
        _print(f"FAILED: {exc}")
        _print(f"logs: {run_dir / 'logs'}")
        return 1
    _print(f"export KUBECONFIG={handle.kubeconfig}")
    return 0


def cmd_down(run_dir: Path) -> int:
    handle = ClusterHandle.load(run_dir)
    if handle is None:
        _print(f"not running (nothing recorded in {run_dir})")
        return 0
    for msg in handle.stop():
        _print(msg)
    return 0


def cmd_status(run_dir: Path) -> int:
    """Exit 0 when every process runs, 1 when not started, 2 when something crashed."""
    handle = ClusterHandle.load(run_dir)
    if handle is None:
        _print(f"not running (nothing recorded in {run_dir})")
        return 1
    for rec in handle.records:
        state = "running" if procs.is_running(rec) else "NOT RUNNING"
        _print(f"{rec.name:<24} pid {rec.pid:<8} {state}")
    if handle.crashed():
        _print("crashed:\n" + handle.crash_report())
        _print(f"run 'python -m e2e.cluster down' to clean up ({run_dir})")
        return 2
    _print(f"kubeconfig: {handle.kubeconfig}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument(
        "--run-dir", type=Path, default=None, help="default: $CAS_RUN_DIR or run/cluster"
    )
    args = parser.parse_args(argv)
    run_dir = (args.run_dir or default_run_dir()).resolve()
    commands: dict[str, Callable[[Path], int]] = {
        "up": cmd_up,
        "down": cmd_down,
        "status": cmd_status,
    }
    return commands[args.command](run_dir)


__all__ = ["AlreadyRunning", "ClusterError", "ClusterHandle", "load_cluster", "start_cluster"]

if __name__ == "__main__":
    sys.exit(main())


def gateway_host(namespace: str) -> str:
    """The hostname a test's fleet is served under on the shared Gateway. Every test's
    HTTPRoute attaches to the one Gateway of the local stack: without a hostname each matches
    every request, and a test's load reached other tests' fleets (their faulty canaries,
    their retiring routers) whenever two gateway tests ran at once."""
    return f"{namespace}.e2e.test"
