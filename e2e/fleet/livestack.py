"""The running half of the local stack for one namespace: sims, routers, Prometheus, operator.

Used by `make run` (:mod:`e2e.demo.run_local`) and the operator-process anomaly tests. Data flow:

1. a :class:`~e2e.runtime.podrunner.PodRunner` (thread, one pass a second) turns every engine pod of
   ``namespace`` into a ``cas_engine.sim`` process at the pod IP and every router pod into the
   real SGLang router at the router pod IP (Kubernetes discovery against this API server), and
   writes the Prometheus file_sd targets;
2. Prometheus (Debian's binary; optional) scrapes those targets every ``scrape_interval_s``;
3. ``python -m cas_operator`` runs as a process
   (:class:`~e2e.runtime.operator_process.OperatorProcess`) under the Helm chart's ServiceAccount
   token (:mod:`e2e.runtime.chart`; namespaced Roles when it watches one namespace), with
   ``CAS_PROMETHEUS_URL`` pointing at
   that Prometheus (else it scrapes pods directly); its anomaly loop deregisters draining pods from
   ``http://<router pod IP>:8000``, which is where the runner put the router.

The runner also plays the kubelet's readiness prober for engine pods that opt in (see
:func:`probed_by_runner`): KWOK leaves them not Ready until their sim answers its readinessProbe,
so a replacement pod joins the router and the pools' ready counts only once it serves. The
sims answer /health as slowly as SGLang (:data:`SGLANG_HEALTH`).

Ownership: the stack owns the runner thread and the processes the runner started, Prometheus and
the operator; :meth:`LiveStack.close` stops them in reverse order. The namespace, the custom
resources and the cluster belong to the caller.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml

from cas_operator.api import constants as c
from cas_operator.desired.resources.meta import stable_hash
from e2e.cluster.bins import resolve
from e2e.cluster.manifests import READINESS_TOLERATION
from e2e.cluster.podnet import load_for_kubeconfig
from e2e.cluster.stack import run_kubectl
from e2e.runtime.chart import (
    ChartIdentity,
    Refusals,
    audit_events,
    install_identity,
    refusals,
    remove_cluster_scoped,
)
from e2e.runtime.operator_process import OperatorProcess
from e2e.runtime.podrunner import (
    ROUTER_SHIM,
    PodRunner,
    http_probe,
    kube_configmap_reader,
    kube_pod_deleter,
    kube_pod_lister,
    kube_secret_reader,
    kube_status_patcher,
)
from e2e.runtime.prometheus import (
    PrometheusHandle,
    file_sd_scrape_config,
    prometheus_binary,
    start_prometheus,
    static_scrape_config,
    write_file_sd,
)

Pod = dict[str, Any]


def probed_by_runner(manifest: dict[str, Any]) -> dict[str, Any]:
    """A copy of a CodingAgentServing whose prefill, decode and router pods carry
    READINESS_TOLERATION (:mod:`e2e.cluster.manifests`): the local stack's KWOK then leaves
    them not Ready and the pod runner sets Ready from their readinessProbe (pure; a taint no
    node carries, so scheduling is unchanged). The runner must run routers (``kubeconfig``)."""
    out = copy.deepcopy(manifest)
    for role in ("prefill", "decode", "router"):
        tolerations = out["spec"].setdefault(role, {}).setdefault("tolerations", [])
        if READINESS_TOLERATION not in tolerations:
            tolerations.append(dict(READINESS_TOLERATION))
    return out


def _stamp(line: str) -> str:
    return f"{time.strftime('%H:%M:%S')} {line}"


# The engine the operator renders for is SGLang, whose /health answers after a little over a
# second (tests/engine/test_health_probe_sglang_real.py): the sims of operator-made pods do so
# too, so a probe or router check that gives up sooner fails here as it would in a cluster.
SGLANG_HEALTH = ("--sim-health-delay", "1.0")


@dataclass
class LiveStack:
    """See the module docstring. Call :meth:`start` once and :meth:`close` always."""

    kubeconfig: Path
    namespace: str
    run_dir: Path  # sims' logs, the runner's log, the targets file, Prometheus' TSDB
    sim_args: list[str] = field(default_factory=lambda: ["--sim-speedup", "20"])
    scrape_interval_s: float = 5.0
    operator_log: Path | None = None  # default: <run_dir>/operator.log
    operator_args: tuple[str, ...] = ()  # e.g. ("-n", namespace): watch this namespace only
    metrics_port: int = 0
    operator_module: str = "cas_operator"  # e2e.runtime.older_operator: an older build
    audit_log: Path | None = None  # set: resource_live fails on a refused request (see there)
    # The operator runs under the Helm chart's ServiceAccount token (e2e.runtime.chart), not as
    # the admin: namespaced values for ``-n`` (a Role in that namespace), else all namespaces.
    identity: ChartIdentity | None = None
    runner: PodRunner | None = None
    prometheus: PrometheusHandle | None = None
    operator: OperatorProcess | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self, *, use_prometheus: bool = True, log: Callable[[str], None] = print) -> None:
        """Runner thread, then Prometheus (when wanted and installed), then the operator."""
        self.run_dir = self.run_dir.resolve()  # Prometheus reads file_sd paths from its own dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        sd_file = self.run_dir / "targets.json"
        write_file_sd(sd_file, [])
        self.runner = PodRunner(
            kube_pod_lister(self.kubeconfig, self.namespace), self.run_dir / "pods", sd_file,
            extra_args=[*self.sim_args, *SGLANG_HEALTH], restart_backoff_s=2.0,
            kubeconfig=self.kubeconfig.resolve(),
            patch_status=kube_status_patcher(self.kubeconfig),
            delete_pod=kube_pod_deleter(self.kubeconfig),
            network=load_for_kubeconfig(self.kubeconfig),
            secrets=kube_secret_reader(self.kubeconfig),
            configmaps=kube_configmap_reader(self.kubeconfig),
            volume_root=self.run_dir / "volumes",
        )  # fmt: skip
        self._thread = threading.Thread(target=self._run_pods, name="podrunner", daemon=True)
        self._thread.start()
        log(f"pod runner started: sims and SGLang routers for {self.namespace}")
        env: dict[str, str] = {}
        if use_prometheus and prometheus_binary() is not None:
            jobs = [file_sd_scrape_config(sd_file, self.scrape_interval_s)]
            if self.metrics_port:  # the operator's own metrics (the dashboard's fleet panels)
                operator = (f"127.0.0.1:{self.metrics_port}", {"component": "cas-operator"})
                jobs.append(static_scrape_config([operator], self.scrape_interval_s))
            self.prometheus = start_prometheus(
                self.run_dir / "prometheus", jobs, interval_s=self.scrape_interval_s
            )
            env["CAS_PROMETHEUS_URL"] = self.prometheus.url
            log(f"prometheus ready at {self.prometheus.url}")
        elif use_prometheus:
            log("prometheus not installed (apt-get install prometheus): direct pod scrapes")
        self.identity = self._install_identity()
        log(f"operator identity: {self.identity.username} (the chart's RBAC)")
        self.operator = OperatorProcess(
            self.identity.kubeconfig, self.operator_log or self.run_dir / "operator.log",
            metrics_port=self.metrics_port, extra_args=self.operator_args, env=env,
            module=self.operator_module,
        )  # fmt: skip
        self.operator.start()
        log(f"operator started (log: {self.operator.log_path})")

    def _install_identity(self) -> ChartIdentity:
        """The chart's identity for this stack: watching only ``self.namespace`` when the
        operator is told ``-n`` (released into that namespace, a release name of its own so
        cluster-scoped objects never collide), else all namespaces (release cas-operator)."""
        kubectl = functools.partial(run_kubectl, resolve().kubectl, self.kubeconfig)
        out = self.run_dir / "operator-kubeconfig"
        if "-n" not in self.operator_args and "--namespace" not in self.operator_args:
            return install_identity(kubectl, self.kubeconfig, out)
        release, values = self._namespaced_release()
        return install_identity(
            kubectl, self.kubeconfig, out, release=release, namespace=self.namespace, values=values
        )

    def _namespaced_release(self) -> tuple[str, dict[str, Any]]:
        """The release name and values of the chart identity watching only this namespace."""
        return f"cas-op-{stable_hash(self.namespace)}", {"watchNamespaces": [self.namespace]}

    def _remove_identity(self) -> None:
        """A namespaced identity's cluster-scoped objects (admission policies and bindings) go
        with the stack: the namespace takes the rest, and each policy left behind is evaluated
        on every matching request the API server takes for the rest of the cluster's life."""
        if self.identity is None or self.identity.namespace != self.namespace:
            return  # the all-namespaces release (cas-operator) is shared; it stays
        release, values = self._namespaced_release()
        kubectl = functools.partial(run_kubectl, resolve().kubectl, self.kubeconfig)
        remove_cluster_scoped(kubectl, release, self.namespace, values)

    def refusals(self) -> Refusals | None:
        """What the API server refused the operator, from ``audit_log`` (None: not audited)."""
        if self.identity is None or self.audit_log is None:
            return None
        return refusals(audit_events(self.audit_log, self.identity.username))

    def _run_pods(self) -> None:
        """The runner's loop, its actions appended to <run_dir>/podrunner.log."""
        assert self.runner is not None
        with (self.run_dir / "podrunner.log").open("a") as out:
            try:
                while not self._stop.is_set():
                    try:
                        lines = self.runner.sync()
                    except Exception as exc:  # API hiccup: report, retry next pass
                        lines = [f"sync failed: {exc}"]
                    for line in lines:
                        print(_stamp(line), file=out, flush=True)
                    self._stop.wait(1.0)
            finally:
                for line in self.runner.stop_all():
                    print(_stamp(line), file=out, flush=True)

    def summary(self) -> str:
        """One line: what runs (sims, routers) and where Prometheus is."""
        running = list(self.runner.running.copy().values()) if self.runner else []
        routers = sum(ROUTER_SHIM in r.launch.argv for r in running)
        prom = self.prometheus.url if self.prometheus else "off (the operator scrapes pods)"
        return (f"pod runner: {len(running) - routers} sims, {routers} SGLang routers; "
                f"prometheus: {prom}; logs: {self.run_dir}")  # fmt: skip

    def close(self, log: Callable[[str], None] = print) -> None:
        """Stop the operator, the runner's processes and Prometheus (each at most once). The
        operator gets SIGTERM first; its graceful stop overlaps the runner's."""
        if self.operator is not None and self.operator.running():
            log("stopping the operator")
            self.operator.terminate()
        if self._thread is not None:
            log("stopping the sims and routers")
            self._stop.set()
            self._thread.join(60)
            self._thread = None
        if self.operator is not None:
            self.operator.wait_stopped()
        if self.prometheus is not None:
            log(self.prometheus.stop())
            self.prometheus = None
        self._remove_identity()


class MakeLiveStack(Protocol):
    """A test's factory of its namespace's LiveStack, given the sims' arguments and any other
    LiveStack field (the `live_stack` fixture in e2e/tests/conftest.py)."""

    def __call__(self, sim_args: list[str], **extra: Any) -> LiveStack: ...


http_ok = http_probe  # "does GET `url` answer 2xx within the timeout", for the stack's users


def router_url(pods: list[Pod], name: str) -> str | None:
    """``http://<router pod IP>:8000`` of the resource's first live router pod in `pods`."""
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        labels = pod["metadata"].get("labels") or {}
        ip = (pod.get("status") or {}).get("podIP")
        if (labels.get(c.LABEL_NAME) == name and labels.get(c.LABEL_ROLE) == c.ROLE_ROUTER
                and ip and not pod["metadata"].get("deletionTimestamp")):  # fmt: skip
            return f"http://{ip}:{c.ROUTER_PORT}"
    return None


@contextlib.contextmanager
def resource_live(
    stack: LiveStack,
    kubectl: Callable[..., str],
    manifest: dict[str, Any],
    log: Callable[[str], None] = print,
) -> Iterator[str]:
    """Start `stack`, apply `manifest` (one CodingAgentServing, its pools' readiness left to the
    runner: :func:`probed_by_runner`) in its namespace and yield the
    URL of the resource's router pod once it has an IP; the stack is closed (operator log tail
    printed) however the block ends. Waiting for the pools to serve is the caller's part."""
    from e2e.fleet.fleetview import role_pods
    from e2e.waits import record, wait_for

    name, namespace = manifest["metadata"]["name"], stack.namespace
    try:
        started = time.monotonic()
        stack.start(log=log)
        record("live stack start (runner, Prometheus, operator)", time.monotonic() - started)
        kubectl("apply", "-n", namespace, "-f", "-",
                stdin=yaml.safe_dump(probed_by_runner(manifest)))  # fmt: skip
        yield wait_for(
            "router pod",
            lambda: router_url(role_pods(kubectl, namespace, c.ROLE_ROUTER, name), name),
            60,
        )
        # Only when the block passed: the operator's whole run, under the chart's token, met
        # no RBAC refusal and no admission refusal but the passing ones (e2e.runtime.chart).
        refused = stack.refusals()
        if refused is not None:
            assert refused.rbac == [] and refused.other == [], refused
    finally:
        closing = time.monotonic()
        stack.close(log=log)
        record("live stack close", time.monotonic() - closing)
        if stack.operator is not None:
            log(f"operator log tail:\n{stack.operator.log_tail(15)}")
