"""The pod runner with real sim processes and pods as the API server would list them.

No cluster needed: the pod list is a plain function here (the cluster test feeds it from the API
server). Guards: engine pods not started at their own loopback IP, $(VAR) args not expanded,
processes leaking after their pod is gone or replaced, crashes not restarted, Prometheus
targets that do not follow the running pods, and readiness set before the sim answers (a pod
the router would send requests to while nothing listens) or left set after the sim is gone.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cas_engine.sim.fleet import free_port
from cas_operator.api import constants as c
from e2e.cluster.manifests import READINESS_TOLERATION
from e2e.runtime.podrunner import (
    PodRunner,
    launch_for,
    leaves_readiness_to_runner,
    project,
    readiness_patch,
    readiness_url,
)

IP = "127.10.7.9"


def engine_pod(name: str, uid: str, ip: str | None, port: int, **extra: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name, "namespace": "ns", "uid": uid,
            "labels": {"cas.dev/role": "decode"},
            "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(port)},
            **extra,
        },
        "spec": {
            "nodeName": "kwok-gpu-0",
            "containers": [{
                "name": "engine",
                "command": ["python3", "-m", "cas_engine.launch_server"],
                "args": ["--disaggregation-mode", "null", "--served-model-name", "$(MODEL)",
                         "--host", "0.0.0.0", "--port", str(port)],
                "env": [{"name": "MODEL", "value": "glm-sim"}],
                "ports": [{"name": "http", "containerPort": port}],
            }],
        },
        "status": {"phase": "Running", "podIP": ip},
    }  # fmt: skip


def healthy(ip: str, port: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{ip}:{port}/health", timeout=1) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            time.sleep(0.2)
    return False


def model_of(ip: str, port: int) -> str:
    with urllib.request.urlopen(f"http://{ip}:{port}/v1/models", timeout=5) as resp:
        return str(json.loads(resp.read())["data"][0]["id"])


@pytest.fixture
def runner(tmp_path: Path) -> Iterator[tuple[PodRunner, list[dict[str, Any]]]]:
    pods: list[dict[str, Any]] = []
    r = PodRunner(lambda: pods, tmp_path / "logs", tmp_path / "sd.json",
                  extra_args=["--sim-speedup", "20"], restart_backoff_s=0.5)  # fmt: skip
    try:
        yield r, pods
    finally:
        r.stop_all()


def test_launch_selection_is_pure_and_strict() -> None:
    """Regression: only bound, loopback, live engine pods are run; args keep the pod's values."""
    port = 31000
    ok = launch_for(engine_pod("a", "u1", IP, port), "py", [])
    assert ok is not None and ok.argv[-4:] == ("--host", IP, "--port", str(port))
    assert "glm-sim" in ok.argv and "$(MODEL)" not in ok.argv
    assert launch_for(engine_pod("a", "u1", None, port), "py", []) is None
    assert launch_for(engine_pod("a", "u1", "10.0.0.5", port), "py", []) is None
    gone = engine_pod("a", "u1", IP, port, deletionTimestamp="2026-01-01T00:00:00Z")
    assert launch_for(gone, "py", []) is None
    router = engine_pod("r", "u2", IP, port)
    router["spec"]["containers"][0]["command"] = ["sglang-router"]
    assert launch_for(router, "py", []) is None


def test_secret_keys_reach_the_args_as_a_kubelet_resolves_them() -> None:
    """Regression guard: the operator's pods take their admin key by secretKeyRef and
    `$(CAS_ENGINE_ADMIN_KEY)`; a runner that left it unresolved would start the sim with the
    literal text as its key, and one that started a pod whose Secret is missing would run
    what a kubelet refuses (CreateContainerConfigError)."""
    pod = engine_pod("a", "u1", IP, 31000)
    container = pod["spec"]["containers"][0]
    container["args"] += ["--admin-api-key", "$(KEY)"]
    container["env"].append(
        {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "demo-keys", "key": "admin"}}}
    )
    asked: list[tuple[str, str]] = []

    def secrets(namespace: str, name: str) -> dict[str, str] | None:
        asked.append((namespace, name))
        return {"admin": "s3cret"} if name == "demo-keys" else None

    launch = launch_for(pod, "py", [], secrets=secrets)
    assert launch is not None and asked == [("ns", "demo-keys")]
    flag = launch.argv.index("--admin-api-key")
    assert launch.argv[flag + 1] == "s3cret" and ("KEY", "s3cret") in launch.env
    container["env"][-1]["valueFrom"]["secretKeyRef"]["name"] = "gone"
    assert launch_for(pod, "py", [], secrets=secrets) is None
    container["env"][-1]["valueFrom"]["secretKeyRef"]["optional"] = True
    optional = launch_for(pod, "py", [], secrets=secrets)
    assert optional is not None and "KEY" not in dict(optional.env)


def test_a_configmap_volume_reaches_the_sim_as_a_kubelet_projects_it(tmp_path: Path) -> None:
    """Regression guard (issue 13): strict decode pods read the operator's prefill-gone feed
    from a mounted ConfigMap (`--cas-prefill-gone-file /etc/cas/prefill-gone/prefills.json`);
    a runner that passed that path through started the sim on a file that never exists here,
    so the channel's last hop was never played on the local stack. The path now points at a
    per-pod copy that follows the ConfigMap; a ConfigMap not yet created leaves it absent, as
    an optional volume does."""
    pod = engine_pod("d", "u7", IP, 31000)
    pod["spec"]["volumes"] = [
        {"name": "prefill-gone", "configMap": {"name": "demo-prefill-gone", "optional": True}}
    ]
    container = pod["spec"]["containers"][0]
    container["volumeMounts"] = [{"name": "prefill-gone", "mountPath": "/etc/cas/prefill-gone"}]
    container["args"] += ["--cas-prefill-gone-file", "/etc/cas/prefill-gone/prefills.json",
                          "--other=/etc/cas/prefill-gone/x"]  # fmt: skip
    launch = launch_for(pod, "py", [], volume_root=tmp_path)
    assert launch is not None
    copy = tmp_path / "u7" / "prefill-gone"
    flag = launch.argv.index("--cas-prefill-gone-file")
    assert launch.argv[flag + 1] == str(copy / "prefills.json")
    assert f"--other={copy}/x" in launch.argv
    data: dict[str, dict[str, str]] = {}
    project(launch.projections, "ns", lambda ns, name: data.get(f"{ns}/{name}"))
    assert not (copy / "prefills.json").exists()
    data["ns/demo-prefill-gone"] = {"prefills.json": '{"version": 1, "prefills": []}'}
    project(launch.projections, "ns", lambda ns, name: data.get(f"{ns}/{name}"))
    assert json.loads((copy / "prefills.json").read_text()) == {"version": 1, "prefills": []}
    data["ns/demo-prefill-gone"]["prefills.json"] = "changed"
    project(launch.projections, "ns", lambda ns, name: data.get(f"{ns}/{name}"))
    assert (copy / "prefills.json").read_text() == "changed"
    assert launch_for(pod, "py", []).argv[flag + 1].startswith("/etc/cas")  # type: ignore[union-attr]


def test_runner_follows_pods(runner: tuple[PodRunner, list[dict[str, Any]]]) -> None:
    """Regression: a pod's sim must come up at the pod IP with its args, be restarted after a
    crash, be replaced when the pod is replaced, and stop when the pod goes away."""
    r, pods = runner
    port = free_port(IP)
    pods.append(engine_pod("d0", "uid-1", IP, port))
    assert any("started ns.d0" in a for a in r.sync())
    assert healthy(IP, port) and model_of(IP, port) == "glm-sim"
    assert r.sd_file is not None
    sd = json.loads(r.sd_file.read_text())
    assert sd == [{"targets": [f"{IP}:{port}"],
                   "labels": {"namespace": "ns", "pod": "d0", "role": "decode"}}]  # fmt: skip

    first = r.running[("ns", "d0")].record
    os.kill(first.pid, signal.SIGKILL)  # a crash of the process this runner started
    deadline = time.monotonic() + 10
    actions: list[str] = []
    while time.monotonic() < deadline and not any("restarted" in a for a in actions):
        time.sleep(0.3)
        actions += r.sync()
    assert any("restarted ns.d0" in a for a in actions) and healthy(IP, port)

    pods[0] = engine_pod("d0", "uid-2", IP, port)  # same name, new pod
    replaced = r.sync()
    assert any("stopped" in a for a in replaced) and any("started ns.d0" in a for a in replaced)
    assert healthy(IP, port)

    pods.clear()  # gone: SIGTERM, then its grace in the background (as a kubelet)
    assert any("SIGTERM to ns.d0" in a for a in r.sync())
    deadline = time.monotonic() + 10
    while r.stopping and time.monotonic() < deadline:
        time.sleep(0.1)
    assert r.running == {} and not r.stopping and not healthy(IP, port, timeout=1.0)
    assert r.sd_file is not None and json.loads(r.sd_file.read_text()) == []


def probed_pod(name: str, uid: str, port: int) -> dict[str, Any]:
    """An engine pod that leaves its readiness to the runner, as KWOK leaves it: not Ready."""
    pod = engine_pod(name, uid, IP, port)
    pod["spec"]["tolerations"] = [READINESS_TOLERATION]
    pod["spec"]["containers"][0]["readinessProbe"] = {
        "httpGet": {"path": "/health", "port": "http"}, "failureThreshold": 3}  # fmt: skip
    pod["status"]["conditions"] = [{"type": "Ready", "status": "False"},
                                   {"type": "ContainersReady", "status": "False"}]  # fmt: skip
    pod["status"]["containerStatuses"] = [{"name": "engine", "ready": False, "image": "x"}]
    return pod


def test_readiness_probe_target_and_patch_are_pure() -> None:
    """Regression: only pods that opt in are probed, at their readinessProbe (named port
    resolved) on the pod IP; the patch flips Ready, ContainersReady and container readiness
    together and is None when the pod already says so (no write per pass)."""
    port = 31001
    plain = engine_pod("a", "u1", IP, port)
    launch = launch_for(plain, "py", [])
    assert launch is not None and not leaves_readiness_to_runner(plain)
    assert readiness_url(launch, plain) is None  # no probe: running is ready, as in a kubelet
    pod = probed_pod("a", "u1", port)
    assert leaves_readiness_to_runner(pod)
    assert readiness_url(launch, pod) == f"http://{IP}:{port}/health"
    patch = readiness_patch(pod, True, "2026-11-30T00:00:00Z")
    assert patch is not None
    conds = {c["type"]: c["status"] for c in patch["status"]["conditions"]}
    assert conds == {"Ready": "True", "ContainersReady": "True"}
    assert patch["status"]["containerStatuses"] == [{"name": "engine", "ready": True, "image": "x"}]
    assert readiness_patch(pod, False, "2026-11-30T00:00:00Z") is None


def test_runner_sets_readiness_only_while_the_sim_answers(tmp_path: Path) -> None:
    """Regression: a replacement pod was Ready (KWOK) before its sim listened, the router sent it
    a request and the client got a 502. Ready must be written only after the probe answers, and
    taken back at once when the process is gone; pods that do not opt in are never written."""
    port = free_port(IP)
    pod, plain = probed_pod("d0", "uid-1", port), engine_pod("p0", "uid-2", "127.10.7.10", port)
    writes: list[tuple[str, bool, bool]] = []  # (pod, ready, did the sim answer at that moment)

    def patch_status(namespace: str, name: str, body: dict[str, Any]) -> None:
        ready = body["status"]["containerStatuses"][0]["ready"]
        writes.append((name, ready, healthy(IP, port, timeout=0.2)))
        pod["status"].update(body["status"])  # what the API server would now list

    r = PodRunner(lambda: [pod, plain], tmp_path / "logs", patch_status=patch_status,
                  restart_backoff_s=30.0)  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not writes:
            r.sync()
            time.sleep(0.2)
        assert writes == [("d0", True, True)]
        r.sync()
        assert len(writes) == 1  # level-based: nothing to write while it stays Ready
        os.kill(r.running[("ns", "d0")].record.pid, signal.SIGKILL)
        time.sleep(0.3)
        r.sync()  # the process is gone (no restart within the backoff): not Ready at once
        assert writes[1:] == [("d0", False, False)]
    finally:
        r.stop_all()


def test_a_probe_gives_up_after_its_timeout_as_a_kubelets_does(tmp_path: Path) -> None:
    """Regression (engine probes without `timeoutSeconds`): the runner gave every probe one
    second whatever the pod said, and the sims answered /health at once, so a pod whose probe
    gives up before SGLang's /health answers (a little over a second) turned Ready here and
    never in a cluster. Against a sim as slow as SGLang, the kubelet's default of 1 s keeps the
    pod not Ready past its failureThreshold; the operator's timeout makes it Ready."""
    port = free_port(IP)
    pods = [probed_pod("d0", "uid-1", port)]
    writes: list[tuple[str, bool]] = []

    def patch_status(namespace: str, name: str, body: dict[str, Any]) -> None:
        writes.append((name, body["status"]["containerStatuses"][0]["ready"]))
        pods[0]["status"].update(body["status"])

    r = PodRunner(lambda: pods, tmp_path / "logs", patch_status=patch_status,
                  extra_args=["--sim-health-delay", "1.2"], restart_backoff_s=30.0)  # fmt: skip
    try:
        r.sync()
        deadline = time.monotonic() + 20
        while not healthy(IP, port, timeout=3.0) and time.monotonic() < deadline:
            time.sleep(0.2)
        failures = time.monotonic() + 6.0  # probes of 1 s, one after another: past the threshold
        while time.monotonic() < failures:
            r.sync()
            time.sleep(0.2)
        assert writes == [], writes  # never Ready with 1 s (KWOK's not Ready stays)
        probe = pods[0]["spec"]["containers"][0]["readinessProbe"]
        probe["timeoutSeconds"] = c.ENGINE_HEALTH_TIMEOUT_SECONDS  # what the operator renders
        deadline = time.monotonic() + 10
        while not writes and time.monotonic() < deadline:
            r.sync()
            time.sleep(0.2)
        assert writes == [("d0", True)], writes
    finally:
        r.stop_all()


def _with_prestop(pod: dict[str, Any], grace: int) -> dict[str, Any]:
    """The hook and grace the operator renders (desired.resources.pools._lifecycle)."""
    container = pod["spec"]["containers"][0]
    port = str(container["ports"][0]["containerPort"])
    hook = ["python3", "-m", "cas_engine.prestop", "--port", port, "--grace", str(grace)]
    container["lifecycle"] = {"preStop": {"exec": {"command": hook}}}
    pod["spec"]["terminationGracePeriodSeconds"] = grace + 2
    return pod


def _long_request(ip: str, port: int, done: dict[str, Any], tokens: int = 300) -> None:
    """One chat request of `tokens` tokens (at speedup 1, 300 take about 2 s)."""
    body = {
        "model": "glm-sim",
        "messages": [{"role": "user", "content": "refactor"}],
        "max_tokens": tokens,
        "ignore_eos": True,
    }  # fmt: skip (speedup 1: several seconds)
    url = f"http://{ip}:{port}/v1/chat/completions"
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            done["tokens"] = json.loads(resp.read())["usage"]["completion_tokens"]
    except Exception as exc:  # a cut connection: OSError, IncompleteRead, a torn body
        done["error"] = repr(exc)
    done["at"] = time.monotonic()


def _serving_a_request(
    r: PodRunner, pods: list[dict[str, Any]], name: str, *, grace: int, tokens: int
) -> tuple[int, threading.Thread, dict[str, Any]]:
    """An engine pod with the operator's preStop hook, run by `r`, with a request of `tokens`
    tokens running on it: its port, the client thread and what the client records."""
    port = free_port(IP)
    pods.append(_with_prestop(engine_pod(name, f"uid-{name}", IP, port), grace=grace))
    r.sync()
    assert healthy(IP, port)
    done: dict[str, Any] = {}
    client = threading.Thread(target=_long_request, args=(IP, port, done, tokens))
    client.start()
    time.sleep(0.5)  # the request is running
    return port, client, done


def _when_stopped(r: PodRunner, timeout: float = 60.0) -> float:
    """When the runner signalled the last draining engine (its hook ended or timed out)."""
    deadline = time.monotonic() + timeout
    while r.draining and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not r.draining, "the preStop never ended"
    return time.monotonic()


def test_a_deleted_pod_finishes_its_request_in_flight_before_its_process_stops(
    tmp_path: Path,
) -> None:
    """Regression (issue 15): the runner, standing in for the kubelet, stopped a deleted pod's
    process at once. With the operator's preStop hook it must run the hook first (in the
    background: other pods keep being synced), so the request in flight completes."""
    pods: list[dict[str, Any]] = []
    r = PodRunner(lambda: pods, tmp_path / "logs", restart_backoff_s=0.5)
    try:
        port, client, done = _serving_a_request(r, pods, "d0", grace=60, tokens=300)
        pods.clear()  # the pod is deleted
        deleted = time.monotonic()
        assert any("preStop of ns.d0 runs (up to 62s)" in a for a in r.sync())
        stopped = _when_stopped(r)
        client.join(timeout=60)
        assert done.get("tokens") == 300, done  # completed, not cut
        assert done["at"] - deleted > 0.5, "the request ended before the pod was deleted"
        assert stopped >= done["at"], "the engine was signalled while its request ran"
        assert not healthy(IP, port, timeout=1.0)  # and then it stopped
    finally:
        r.stop_all()


def test_the_hook_is_bounded_by_the_pods_grace_period(tmp_path: Path) -> None:
    pods: list[dict[str, Any]] = []
    r = PodRunner(lambda: pods, tmp_path / "logs", restart_backoff_s=0.5)
    try:
        _, client, done = _serving_a_request(r, pods, "d1", grace=1, tokens=6000)
        pods.clear()
        started = time.monotonic()
        r.sync()
        stopped = _when_stopped(r)
        client.join(timeout=60)
        assert 0.5 < stopped - started < 10, stopped - started  # ~grace, then SIGTERM
        assert "error" in done or stopped < done["at"], done  # signalled while it still ran
        assert done.get("tokens", 0) < 6000, done  # and cut: the grace is the bound
    finally:
        r.stop_all()


def test_a_running_pod_is_not_stopped_when_its_secret_cannot_be_read(tmp_path: Path) -> None:
    """Regression (CI, stop 26): the runner re-read every pod's Secret on each sync and
    stopped a running pod when the read failed (a loaded API server), so the router and
    engines of a fleet restarted again and again. A kubelet resolves env once, at start."""
    port = free_port(IP)
    pod = engine_pod("k", "uk", IP, port)
    container = pod["spec"]["containers"][0]
    container["args"] += ["--admin-api-key", "$(KEY)"]
    container["env"].append(
        {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "demo-keys", "key": "admin"}}}
    )
    reads = {"ok": True, "count": 0}

    def secrets(namespace: str, name: str) -> dict[str, str] | None:
        reads["count"] += 1
        if not reads["ok"]:
            raise OSError("the API server did not answer")
        return {"admin": "s3cret"}

    r = PodRunner(lambda: [pod], tmp_path / "logs", extra_args=["--sim-speedup", "20"],
                  secrets=secrets)  # fmt: skip
    try:
        r.sync()
        assert healthy(IP, port)
        started = r.running[("ns", "k")].record.pid
        reads["ok"], before = False, reads["count"]
        for _ in range(3):
            r.sync()
        assert r.running[("ns", "k")].record.pid == started and healthy(IP, port, 2)
        assert reads["count"] == before  # nothing read for a pod that runs
    finally:
        r.stop_all()
