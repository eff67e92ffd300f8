"""Fixtures for end-to-end tests against a real Kubernetes control plane.

Which cluster (session-scoped ``cluster`` fixture), in this order:
1. ``CAS_KUBECONFIG`` set: that cluster (kind, k3d, a real one); nothing is started or stopped.
2. ``make cluster-up`` already running (``run/cluster`` or ``$CAS_RUN_DIR``): reused, left up.
3. Otherwise a private stack is started in ``run/pytest-<pid>/`` and stopped after the session.
   Missing binaries skip the e2e tests with the reason, unless ``CI`` is set: then they fail.

Per test: ``namespace`` (created, default service account awaited, deleted afterwards) and
``kubectl`` (the pinned kubectl bound to the cluster's kubeconfig).

Under pytest-xdist (``make test`` runs ``-n``): the controller names one run folder
(``$CAS_E2E_SHARED_RUN``, ``run/pytest-<controller pid>``) before its workers start; the first
worker that needs a cluster starts it there under a file lock, the others reuse it, and the
controller stops it when the run ends. One cluster, one pod network, every worker's namespaces
side by side. ``clusterwide`` tests (an operator watching every namespace) run first, on one
worker (the root ``conftest.py`` orders and groups them); until they are done, a test that
starts an operator of its own (it needs ``crds``) waits, so no namespace ever has two operators.

This folder is the package ``e2e.tests`` (it has an ``__init__.py``): pytest imports its modules
as ``e2e.tests.<name>`` with the repository root on ``sys.path``, so they never clash with
same-named test modules elsewhere, and ``e2e`` is always the harness package beside it.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

from e2e.cluster.bins import BUILD_SCRIPT, resolve
from e2e.cluster.stack import ClusterError, ClusterHandle, load_cluster, start_cluster
from e2e.fleet.fleetview import rest_get
from e2e.fleet.livestack import LiveStack, MakeLiveStack
from e2e.paths import REPO_ROOT

Kubectl = Callable[..., str]
NAMESPACE_READY_TIMEOUT_S = 30.0
SHARED_RUN_ENV = "CAS_E2E_SHARED_RUN"  # the xdist controller's run folder, for its workers
CLUSTERWIDE_DONE = "clusterwide.done"  # written in that folder once the clusterwide tests ended
CLUSTERWIDE_WAIT_S = 1200.0  # a worker lost mid-group must not hang the run forever
_SHARED_RUN = pytest.StashKey[Path]()
_CLUSTERWIDE_PENDING = pytest.StashKey[bool]()


def in_ci() -> bool:
    """True when the ``CI`` environment variable says so (GitHub, GitLab and most CIs set it)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _external_cluster(kubeconfig: str) -> ClusterHandle:
    """A handle for a user-provided cluster: no processes, kubectl from the cache or PATH."""
    pinned = resolve().kubectl
    kubectl = pinned if pinned.exists() else shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("CAS_KUBECONFIG is set but no kubectl was found (build it: make bins)")
    path = Path(kubeconfig).expanduser().resolve()
    return ClusterHandle(run_dir=path.parent, kubeconfig=path, ports={}, kubectl_path=Path(kubectl))


def _remove_stopped_runs(parent: Path, keep: Path | None = None) -> None:
    """Delete the run folders of earlier pytest sessions whose stacks no longer run (a session
    still running elsewhere keeps its folder; the latest logs stay until the next session)."""
    for run_dir in parent.glob("pytest-*"):
        if run_dir == keep or not run_dir.is_dir():
            continue
        handle = ClusterHandle.load(run_dir)
        if handle is None or not handle.running():
            # Its pod network, if it died before teardown, is removed by the next start
            # (e2e.cluster.podnet.reclaim_leftovers), whichever checkout it was made from.
            shutil.rmtree(run_dir, ignore_errors=True)


def _is_xdist_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))


def pytest_configure(config: pytest.Config) -> None:
    """On the xdist controller: name the one run folder every worker's cluster lives in."""
    if _is_xdist_controller(config) and SHARED_RUN_ENV not in os.environ:
        run_dir = REPO_ROOT / "run" / f"pytest-{os.getpid()}"
        os.environ[SHARED_RUN_ENV] = str(run_dir)  # inherited by the workers it spawns
        config.stash[_SHARED_RUN] = run_dir


def pytest_unconfigure(config: pytest.Config) -> None:
    """On the controller that named the shared run folder: stop the cluster a worker started."""
    run_dir = config.stash.get(_SHARED_RUN, None)
    if run_dir is None:
        return
    os.environ.pop(SHARED_RUN_ENV, None)
    handle = ClusterHandle.load(run_dir)
    if handle is not None and handle.running():
        handle.stop()


def _shared_cluster(run_dir: Path) -> ClusterHandle:
    """The cluster of this xdist run: started by the first worker to ask (under a lock)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(run_dir / "start.lock")):
        running = load_cluster(run_dir)
        if running is not None:
            return running
        _remove_stopped_runs(REPO_ROOT / "run", keep=run_dir)
        try:
            return start_cluster(run_dir, log=lambda msg: print(f"[cluster] {msg}", flush=True))
        except ClusterError as exc:
            pytest.fail(f"local cluster did not start (logs in {run_dir / 'logs'}):\n{exc}")


@pytest.fixture(scope="session")
def cluster() -> Iterator[ClusterHandle]:
    """The cluster every e2e test talks to (see the module docstring for which one)."""
    external = os.environ.get("CAS_KUBECONFIG")
    if external:
        yield _external_cluster(external)
        return
    running = load_cluster()
    if running is not None:
        yield running
        return
    missing = resolve().missing()
    if missing:
        reason = (
            f"local stack binaries missing ({', '.join(missing)}); "
            f"build them with 'make bins' ({BUILD_SCRIPT}) or set CAS_KUBECONFIG"
        )
        if in_ci():
            pytest.fail(f"CI is set, so not skipping: {reason}")
        pytest.skip(reason)
    shared = os.environ.get(SHARED_RUN_ENV)
    if shared:  # an xdist worker: the controller stops it when the run ends
        yield _shared_cluster(Path(shared))
        return
    _remove_stopped_runs(REPO_ROOT / "run")
    run_dir = REPO_ROOT / "run" / f"pytest-{os.getpid()}"
    try:
        handle = start_cluster(run_dir, log=lambda msg: print(f"[cluster] {msg}", flush=True))
    except ClusterError as exc:
        pytest.fail(f"local cluster did not start (logs in {run_dir / 'logs'}):\n{exc}")
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="session")
def kubeconfig(cluster: ClusterHandle) -> Path:
    """Path of the admin kubeconfig of the e2e cluster."""
    return cluster.kubeconfig


@pytest.fixture(scope="session")
def kubectl(cluster: ClusterHandle) -> Kubectl:
    """``kubectl(*args, stdin=None, check=True, timeout=60) -> stdout`` against the cluster."""
    from e2e.cluster.stack import ClusterKubectl

    return ClusterKubectl(cluster.kubectl_path, cluster.kubeconfig)


@pytest.fixture
def live_stack(cluster: ClusterHandle, namespace: str, tmp_path: Path) -> MakeLiveStack:
    """``live_stack(sim_args)``: the live stack for the test namespace as every operator-process
    test runs it: the operator watching only that namespace, under the namespaced chart's
    identity, 2 s scrapes, and the API server's audit log read for refusals at the end of
    ``resource_live``."""

    def make(sim_args: list[str], **extra: Any) -> LiveStack:
        return LiveStack(
            cluster.kubeconfig, namespace, tmp_path / "live", sim_args=sim_args,
            scrape_interval_s=2.0, operator_args=("-n", namespace),
            audit_log=cluster.audit_log, **extra,
        )  # fmt: skip

    return make


def pytest_collection_finish(session: pytest.Session) -> None:
    """Whether this run has clusterwide tests another worker may still be running."""
    session.config.stash[_CLUSTERWIDE_PENDING] = bool(os.environ.get(SHARED_RUN_ENV)) and any(
        item.get_closest_marker("clusterwide") for item in session.items
    )


def _clusterwide_done() -> Path:
    return Path(os.environ[SHARED_RUN_ENV]) / CLUSTERWIDE_DONE


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Under xdist, hold a test that starts an operator of its own (it needs ``crds``) until
    the clusterwide tests have ended: their operator watches every namespace, and two operators
    acting on one fleet is not a state any test means. Waited here, outside the test's timeout.
    The worker running the clusterwide group marks it done after the group's last item."""
    config = item.config
    if (
        config.stash.get(_CLUSTERWIDE_PENDING, False)
        and "crds" in getattr(item, "fixturenames", ())
        and not item.get_closest_marker("clusterwide")
    ):
        done, deadline = _clusterwide_done(), time.monotonic() + CLUSTERWIDE_WAIT_S
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(1.0)
        config.stash[_CLUSTERWIDE_PENDING] = False  # once done, never again in this worker
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last clusterwide item on this worker (its module fixtures are torn down in
    this teardown): tell the other workers."""
    yield
    last = nextitem is None or not nextitem.get_closest_marker("clusterwide")
    if item.get_closest_marker("clusterwide") and last and os.environ.get(SHARED_RUN_ENV):
        _clusterwide_done().parent.mkdir(parents=True, exist_ok=True)
        _clusterwide_done().touch()


@pytest.fixture(scope="session")
def crds(kubectl: Kubectl) -> None:
    """Our CRDs applied (server-side, from crds/) and established, once per session."""
    from e2e.fleet.fleetview import apply_crds

    apply_crds(kubectl)


def _namespace_name(node_name: str) -> str:
    """A DNS-1123 label from the test name plus a random suffix (at most 63 characters)."""
    base = re.sub(r"[^a-z0-9-]+", "-", node_name.lower()).strip("-")[:48].strip("-")
    return f"{base or 'e2e'}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def namespace(
    request: pytest.FixtureRequest, cluster: ClusterHandle, kubectl: Kubectl
) -> Iterator[str]:
    """A fresh namespace for one test, ready for pods (its default service account exists).

    Deleted afterwards without waiting (the namespace controller finishes it in the background).
    A control-plane crash is reported here, by component name and log tail, not as a timeout.
    """
    if cluster.crashed():
        pytest.fail(f"the local cluster has crashed:\n{cluster.crash_report()}")
    name = _namespace_name(request.node.name)
    kubectl("create", "namespace", name)
    deadline = time.monotonic() + NAMESPACE_READY_TIMEOUT_S
    while not kubectl("get", "serviceaccount", "default", "-n", name, "-o", "name", check=False):
        if time.monotonic() > deadline:
            pytest.fail(f"namespace {name}: no default service account after 30s")
        time.sleep(0.2)
    try:
        yield name
    finally:
        kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)
        threading.Thread(target=_reap_pods, args=(kubectl, name), daemon=True).start()


def _reap_pods(kubectl: Kubectl, namespace: str, seconds: float = 90.0) -> None:
    """The kubelet's last step for a namespace being deleted after its test: the pods the pod
    runner ran stay Terminating until their grace deadline (minutes) once that runner has
    stopped, holding their nodes' GPUs from later tests; so they are removed at once
    (grace 0) until the namespace is gone.

    A spawn of kubectl from this thread failed twice in CI runs with `OSError: [Errno 14] Bad
    address` while the main thread spawned processes too; the thread then died and the
    namespace's pods kept their nodes' GPUs. A failed spawn is now tried again on the next
    round instead of ending the reaper."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if rest_get(kubectl, f"/api/v1/namespaces/{namespace}") is None:
                return
            pods = rest_get(kubectl, f"/api/v1/namespaces/{namespace}/pods") or {}
            if pods.get("items"):
                kubectl("delete", "pods", "--all", "-n", namespace, "--force",
                        "--grace-period=0", "--wait=false", "--ignore-not-found",
                        check=False)  # fmt: skip
        except (OSError, ClusterError):
            pass  # the next round tries again
        time.sleep(2.0)
