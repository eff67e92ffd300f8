"""Fast checks of the local-stack harness that need no cluster and no Go build.

They guard the bookkeeping that makes ``make cluster-up`` / ``cluster-down`` safe: one source of
versions, processes identified by pid *and* start time, idempotent stop, crash reports that name
the component, refusal to start twice, and the manifests handed to KWOK and LWS.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import e2e.cluster.manifests as manifests
import e2e.cluster.procs as procs
import e2e.cluster.stack as cluster
from e2e.cluster.bins import BUILD_SCRIPT, VERSIONS_FILE, read_versions, resolve


def test_versions_file_is_the_single_source_for_shell_and_python() -> None:
    """Regression: build-bins.sh and bins.py disagree on a version (binaries built, not found)."""
    shell = subprocess.run(
        ["bash", "-c", f"set -a && source {VERSIONS_FILE} && env"],
        capture_output=True,
        text=True,
        check=True,
    )
    env = dict(line.split("=", 1) for line in shell.stdout.splitlines() if "=" in line)
    versions = read_versions()
    assert versions, "versions.env parsed to nothing"
    for key, value in versions.items():
        assert env[key] == value
    assert str(VERSIONS_FILE.name) in BUILD_SCRIPT.read_text()


def test_bin_paths_follow_cas_bin_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Regression: the cache root ignores CAS_BIN_DIR, so CI's cached binaries are not reused."""
    monkeypatch.setenv("CAS_BIN_DIR", str(tmp_path))
    bins = resolve()
    k8s = read_versions()["KUBERNETES_VERSION"]
    assert bins.kube_apiserver == tmp_path / f"kubernetes-{k8s}" / "kube-apiserver"
    assert "kube_apiserver" in bins.missing()


def _sleeper(tmp_path: Path, seconds: int = 30) -> procs.ProcRecord:
    return procs.spawn("sleeper", ["/bin/sleep", str(seconds)], tmp_path / "logs")


def test_stop_is_exact_and_idempotent(tmp_path: Path) -> None:
    """Regression: stop() signals a pid whose process is gone, or reports success twice."""
    rec = _sleeper(tmp_path)
    assert procs.is_running(rec)
    assert procs.stop(rec).startswith("stopped sleeper")
    assert not procs.is_running(rec)
    assert "already exited" in procs.stop(rec)


def test_stop_together_waits_for_the_slowest_not_the_sum(tmp_path: Path) -> None:
    """Regression: a fleet's teardown stopped its processes one after another, so routers that
    sit out their SIGTERM grace cost 5 s each (a stack's close took 8 s on average, 18 s at
    worst). Three processes that ignore SIGTERM, one already gone: all are SIGKILLed after one
    grace, and each is reported."""
    ignore_term = "import signal as s, time; s.signal(s.SIGTERM, s.SIG_IGN); time.sleep(60)"
    stubborn = [sys.executable, "-c", ignore_term]
    recs = [procs.spawn(f"stubborn{i}", stubborn, tmp_path / "logs") for i in range(3)]
    gone = _sleeper(tmp_path)
    procs.stop(gone)
    time.sleep(0.3)  # the interpreters install their handler
    started = time.monotonic()
    said = procs.stop_together([*recs, gone], grace_s=1.0)
    took = time.monotonic() - started
    assert took < 2.5, f"stopping took {took:.1f} s: one grace after another"
    assert [line.split()[0] for line in said] == ["killed", "killed", "killed", "sleeper"], said
    assert not any(procs.is_running(r) for r in recs)


def test_reused_pid_is_not_ours(tmp_path: Path) -> None:
    """Regression: a recorded pid reused by another process would be killed by `down`."""
    rec = _sleeper(tmp_path)
    try:
        impostor = procs.ProcRecord(
            name=rec.name, pid=rec.pid, exe=rec.exe, start_ticks=rec.start_ticks + 1, log=rec.log
        )
        assert not procs.is_running(impostor)
        assert "already exited" in procs.stop(impostor)
        assert procs.is_running(rec), "stop() of a non-matching record signalled the process"
    finally:
        procs.stop(rec)


def test_crash_report_names_component_and_log(tmp_path: Path) -> None:
    """Regression: a crashed component surfaces as an anonymous timeout instead of its log."""
    rec = procs.spawn(
        "kube-fake", ["/bin/sh", "-c", "echo boom-from-fake; exit 3"], tmp_path / "logs"
    )
    handle = cluster.ClusterHandle(
        run_dir=tmp_path, kubeconfig=tmp_path / "kubeconfig", ports={}, records=[rec]
    )
    deadline = time.monotonic() + 10
    while not handle.crashed() and time.monotonic() < deadline:
        time.sleep(0.05)
    report = handle.crash_report()
    assert "kube-fake" in report
    assert "exit status 3" in report
    assert "boom-from-fake" in report


def test_up_twice_refuses_and_down_twice_is_clear(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: a second `up` starts a second stack over the first; `down` on nothing errors."""
    rec = _sleeper(tmp_path)
    handle = cluster.ClusterHandle(
        run_dir=tmp_path, kubeconfig=tmp_path / "kubeconfig", ports={"etcd": 1}, records=[rec]
    )
    handle.save()
    try:
        with pytest.raises(cluster.AlreadyRunning):
            cluster.start_cluster(tmp_path)
        assert cluster.load_cluster(tmp_path) is not None
    finally:
        assert cluster.cmd_down(tmp_path) == 0
    assert not procs.is_running(rec)
    assert cluster.cmd_down(tmp_path) == 0
    out = capsys.readouterr().out
    assert "stopped sleeper" in out
    assert "not running" in out
    assert cluster.cmd_status(tmp_path) == 1


def test_gpu_nodes_have_distinct_loopback_pod_cidrs() -> None:
    """Regression: overlapping pod CIDRs would give two pods the same loopback IP."""
    shape = manifests.NodeShape(count=4)
    nodes = manifests.gpu_nodes(shape, kubelet_version="v1.37.2")
    cidrs = [ipaddress.IPv4Network(n["spec"]["podCIDR"]) for n in nodes]
    loopback = ipaddress.IPv4Network("127.0.0.0/8")
    assert all(c.subnet_of(loopback) for c in cidrs)
    assert all(not a.overlaps(b) for i, a in enumerate(cidrs) for b in cidrs[i + 1 :])
    for node in nodes:
        assert node["status"]["allocatable"][manifests.GPU_RESOURCE] == str(shape.gpus)
        assert node["metadata"]["labels"][manifests.KWOK_NODE_LABEL] == "kwok"


def test_lws_webhooks_point_at_loopback_with_patches(tmp_path: Path) -> None:
    """Regression: LWS pod webhooks without their objectSelector (every pod in the cluster would
    need the LWS controller), or still pointing at an in-cluster Service that does not exist."""
    hook = {
        "admissionReviewVersions": ["v1"],
        "clientConfig": {
            "service": {"name": "s", "namespace": "system", "path": "/mutate--v1-pod"}
        },
        "name": "mpod.kb.io",
        "sideEffects": "None",
    }
    selected = {
        **hook,
        "objectSelector": {"matchExpressions": [{"key": "x", "operator": "Exists"}]},
    }
    (tmp_path / "manifests.yaml").write_text(
        yaml.safe_dump_all(
            [
                {
                    "apiVersion": "admissionregistration.k8s.io/v1",
                    "kind": "MutatingWebhookConfiguration",
                    "metadata": {"name": "mutating-webhook-configuration"},
                    "webhooks": [hook],
                }
            ]
        )
    )
    (tmp_path / "mutating-patch.yaml").write_text(
        yaml.safe_dump([{"op": "replace", "path": "/webhooks/0", "value": selected}])
    )
    docs = manifests.lws_webhooks(tmp_path, port=12345, ca_pem=b"PEM")
    (out,) = docs[0]["webhooks"]
    assert out["objectSelector"] == selected["objectSelector"]
    assert out["clientConfig"]["url"] == "https://127.0.0.1:12345/mutate--v1-pod"
    assert base64.b64decode(out["clientConfig"]["caBundle"]) == b"PEM"
    assert docs[0]["metadata"]["name"].startswith("lws-")


def test_cli_status_without_cluster_exits_1(tmp_path: Path) -> None:
    """Regression: `python -m e2e.cluster status` crashes instead of saying nothing runs."""
    proc = subprocess.run(
        [sys.executable, "-m", "e2e.cluster", "status", "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=cluster.REPO_ROOT,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    assert "not running" in proc.stdout


def _fake_bin_dir(root: Path, broken: str) -> None:
    """A CAS_BIN_DIR where every binary exists; ``broken`` exits 1 at once, the others sleep."""
    bins = resolve(root)
    for name in (
        "kube_apiserver",
        "kube_controller_manager",
        "kube_scheduler",
        "kubectl",
        "kube_proxy",
        "etcd",
        "kwok",
        "lws_controller",
        "traefik",
        "helm",
    ):
        path = getattr(bins, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        body = "echo fatal: $0 cannot start >&2; exit 1" if name == broken else "exec sleep 30"
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    for folder in (bins.kwok_stages, bins.lws_crds, bins.lws_webhook, bins.gateway_crds):
        folder.mkdir(parents=True, exist_ok=True)


def test_component_crash_at_start_is_named_and_cleaned_up(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Regression: a component dying during `up` shows as a generic timeout after a minute, or
    leaves the components started before it running."""
    monkeypatch.setenv("CAS_BIN_DIR", str(tmp_path / "bin"))
    # Loopback mode: this is about crash reporting, and a live cluster may hold the pod ranges.
    monkeypatch.setenv("CAS_POD_NETWORK", "loopback")
    _fake_bin_dir(tmp_path / "bin", broken="etcd")
    run_dir = tmp_path / "run"
    started = time.monotonic()
    with pytest.raises(cluster.ClusterError) as err:
        cluster.start_cluster(run_dir)
    assert time.monotonic() - started < 20
    message = str(err.value)
    assert "etcd" in message
    assert "fatal:" in message and "cannot start" in message
    assert cluster.load_cluster(run_dir) is None


@pytest.mark.parametrize("ci", ["", "true"])
def test_missing_binaries_skip_locally_but_fail_in_ci(tmp_path: Path, ci: str) -> None:
    """Regression: CI silently skipping every e2e test because the build step did not run."""
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "CAS_BIN_DIR": str(tmp_path / "no-bins"),
        "CAS_RUN_DIR": str(tmp_path / "no-run"),
        "CI": ci,
    }
    target = "e2e/tests/test_cluster.py::test_kwok_nodes_ready_with_gpus"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", target],
        capture_output=True,
        text=True,
        cwd=cluster.REPO_ROOT,
        env=env,
        timeout=60,
        check=False,
    )
    if ci:
        assert proc.returncode != 0, proc.stdout
        assert "CI is set, so not skipping" in proc.stdout
    else:
        assert proc.returncode == 0, proc.stdout
        assert "1 skipped" in proc.stdout
        assert "make bins" in proc.stdout


def test_kwok_leaves_deleted_probed_pods_to_the_runner_until_their_deadline() -> None:
    """Regression (issue 15): KWOK removed a deleted pod's object at once, so the operator
    never saw it Terminating (no deregistration to test) while its process still drained. A
    pod the runner runs (PROBED_READINESS) now leaves ``pod-delete`` and goes through
    ``pod-delete-at-deadline``, at its deletionTimestamp, unless the runner removed it first."""
    from e2e.cluster.bins import resolve

    config = manifests.kwok_config(resolve().kwok_stages)  # built by `make bins`
    stages = {s["metadata"]["name"]: s for s in yaml.safe_load_all(config)}
    probed = [e for e in stages["pod-delete"]["spec"]["selector"]["matchExpressions"]
              if e.get("values") == [manifests.PROBED_READINESS]]  # fmt: skip
    assert [e["operator"] for e in probed] == ["NotIn"]
    deadline = stages["pod-delete-at-deadline"]["spec"]
    assert deadline["delay"]["durationFrom"] == {"expressionFrom": ".metadata.deletionTimestamp"}
    assert deadline["next"] == {"delete": True}


def test_audit_refusals_tell_rbac_from_admission_and_passing_ones(tmp_path: Path) -> None:
    """The chart tests' zero-refusal claims rest on this sorting: RBAC's 403s (the chart lacks
    a verb) and unknown admission 403s fail them, the two passing causes do not."""
    from e2e.runtime.chart import audit_events, refusals

    def event(user: str, code: int, decision: str, message: str = "") -> str:
        return json.dumps({
            "user": {"username": user}, "verb": "patch",
            "objectRef": {"resource": "pods", "namespace": "ns", "name": "p"},
            "responseStatus": {"code": code, "message": message},
            "annotations": {"authorization.k8s.io/decision": decision},
        })  # fmt: skip

    me = "system:serviceaccount:ops:cas-operator"
    log = tmp_path / "audit.log"
    log.write_text("\n".join([
        event(me, 200, "allow"),
        event(me, 403, "forbid", 'pods "p" is forbidden: User cannot patch'),
        event(me, 403, "allow", "cannot find RESTMapping for APIVersion serving.cas.dev/v1alpha1"),
        event(me, 403, "allow", "new content in namespace ns because it is being terminated"),
        event(me, 403, "allow", "ValidatingAdmissionPolicy 'x' denied request"),
        event("system:serviceaccount:ops:someone-else", 403, "forbid"),
    ]) + "\n")  # fmt: skip
    events = audit_events(log, me)
    assert len(events) == 5
    found = refusals(events)
    assert len(found.rbac) == 1 and "cannot patch" in found.rbac[0]
    assert len(found.passing) == 2
    assert len(found.other) == 1 and "ValidatingAdmissionPolicy" in found.other[0]


def test_crds_are_waited_for_even_before_the_api_server_gave_them_conditions() -> None:
    """Regression (fresh-clone CI run 17): `kubectl wait --for=condition=Established` on the CRD
    the API server had only just created failed at once (".status.conditions accessor error:
    <nil>"), which errored the whole clusterwide group. `apply_crds` polls the condition: a CRD
    without conditions yet is "not yet", not an error."""
    from e2e.fleet.fleetview import CRD, apply_crds

    answers = [{}, {"status": {}}, {"status": {"conditions": [{"type": "NamesAccepted",
               "status": "True"}]}}, {"status": {"conditions": [{"type": "Established",
               "status": "True"}]}}]  # fmt: skip
    calls: list[tuple[str, ...]] = []

    def kubectl(*args: str, **_: object) -> str:
        calls.append(args)
        assert args[0] in ("apply", "get"), f"apply_crds ran kubectl {args[0]}"
        return json.dumps(answers.pop(0)) if args[0] == "get" else ""

    apply_crds(kubectl)
    assert answers == [] and calls[-1] == ("get", CRD, "-o", "json")


def test_only_a_kubeconfig_with_embedded_certificates_is_read_directly(tmp_path: Path) -> None:
    """`Api.from_kubeconfig` reads the local stack's kubeconfig (CA and client certificate
    embedded) and declines any other kind (a token here), whose reads then go through kubectl;
    guards against a direct client built without the user's credentials."""
    from e2e.cluster.api import Api

    token = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
             "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
             "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:1",
                                                    "certificate-authority-data": "eA=="}}],
             "users": [{"name": "u", "user": {"token": "t"}}]}  # fmt: skip
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(token))
    assert Api.from_kubeconfig(path) is None


def test_the_api_client_reads_no_environment_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (CI, the e2e namespace reaper's thread): `urlopen` built an opener per
    request and read the proxy variables by iterating os.environ, which raced pytest setting
    and deleting PYTEST_CURRENT_TEST in the main thread; the KeyError killed the reaper. The
    client builds its opener once, without proxies: a request reads no environment."""
    import socket
    import ssl
    import urllib.request

    from e2e.cluster.api import Api, ApiError

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api = Api(f"https://127.0.0.1:{port}", ssl.create_default_context(), timeout=2.0)

    def no_environment() -> dict[str, str]:
        raise AssertionError("a request read the proxy variables")

    monkeypatch.setattr(urllib.request, "getproxies", no_environment)
    with pytest.raises(ApiError) as refused:
        api.get("/api/v1/namespaces/default")
    assert refused.value.status == 0  # connection refused, answered as unreachable
