"""GitOps with the REAL Argo CD: its application controller and repo server (built from Argo CD's
Go module, e2e/cluster/argocd.py) sync a fleet from a git repository served on loopback, while
the operator process, the sims and the real SGLang routers run it (the live stack) under load
through the Gateway. Every step is asserted from the Application's own status: sync status and
revision, health, the CodingAgentServing's health message (the operator's health check run by
Argo CD's own Lua VM), and the last sync operation.

Regressions guarded (issue 42): the GitOps contract was shown only by emulation (health.lua
under Lua 5.1 in Python, an apply under Argo CD's field manager with `kubectl diff`); nothing
showed that Argo CD's own diff, normalizers, server-side diff, health aggregation, sync and
pruning agree with what the operator writes. Here:

1. sync: Progressing, then Synced and Healthy once the fleet is Ready; the Application manages
   what git holds, and no child carries its tracking annotation or label;
2. an engine change under the canary strategy: Progressing, Suspended while its step waits for
   `kubectl cas rollout promote`, Healthy after; a bad canary: Degraded with the operator's
   reason (RolloutAborted); its revert removes `engine.args` from git, which client-side diff
   does not see (Synced at the revert, the fleet still Degraded), and with ServerSideDiff=true
   (as docs/architecture.md's Application has it) the revert is applied and the fleet Healthy;
3. an invalid spec: refused by the API server, Argo CD names the refusal, the live resource
   and its children unchanged; a revert heals it;
4. self-heal: a `kubectl edit` of a field git owns is reverted by Argo CD; the operator's own
   writes (status, kopf's annotations, children, the rollout action's annotation, Auto's
   replica counts, which a starved prefill makes it change) never make the Application
   OutOfSync: every sample of the whole run (twice a second) that is not Synced lies between
   a commit or the edit and its sync, with client-side diff (steps 1-2), then with
   ServerSideDiff (steps 3-4). Checked to fail: an operator that dropped Argo CD's tracking
   annotation when it consumed a rollout action;
5. prune: removing the fleet from git deletes it and every child.

One Application through all steps (about 2.5 minutes with its setup), the fleet in instances of
one GPU.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from cas_engine.sim.fleet import router_available
from e2e.cluster import argocd as argocd_stack
from e2e.cluster.stack import ClusterHandle, gateway_host
from e2e.fleet.canaryview import answers, canary_sample, rollout
from e2e.fleet.fleetview import ENGINE_PORT, NAME, Kubectl, role_pods
from e2e.fleet.gitops import (
    COMPARE_OPTIONS,
    AppRecorder,
    AppState,
    FleetRepo,
    app_reader,
    application,
    refresh,
)
from e2e.fleet.livestack import LiveStack, MakeLiveStack, probed_by_runner
from e2e.traffic.recorded import RecordedLoad
from e2e.traffic.simload import LoadStats, set_fault, steady_traffic
from e2e.waits import wait_for

SIM_ARGS = ["--sim-speedup", "20"]
APP = "fleets"
FLEET_PATH = "fleet"
FLEET_FILE = f"{FLEET_PATH}/{NAME}.yaml"
# Argo CD's automated sync never prunes an Application down to nothing (allowEmpty: false), so
# the repository holds one more resource: removing the fleet from git then prunes it.
NOTES_FILE = f"{FLEET_PATH}/notes.yaml"
CHILD_KINDS = "deployments,services,httproutes,poddisruptionbudgets,networkpolicies,configmaps"
POLL_S = 0.5
AUTO_TIMEOUT_S = 150.0
LONG_PROMPT = "def handler(request):\n    return route(request)\n" * 400  # ~4.8K tokens
REFUSAL = "spec.rollout.steps[0].pauseUntilPromoted"  # the API server's words (CEL)
TRACKING_ANNOTATION = "argocd.argoproj.io/tracking-id"
TRACKING_LABEL = "app.kubernetes.io/instance"
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not router_available(), reason="sglang-router not installed"),
]


def fleet(namespace: str) -> dict[str, Any]:
    """The fleet in git: the canary sample through the Gateway, one step at 50% held until
    promoted, in Auto mode (the operator owns the pools' replicas: none in git), instances of
    one GPU (the shared cluster's GPUs stay for other tests), its pods' readiness left to the
    pod runner."""
    cas = canary_sample(gateway=True, steps=[{"weight": 50, "pauseUntilPromoted": True}],
                        host=gateway_host(namespace), windowSeconds=15, minRequests=10)  # fmt: skip
    cas["spec"]["ratio"] = {"mode": "Auto", "prefill": 1, "decode": 1, "min": 0.5, "max": 2.0,
                            "gpuBudget": 8}  # fmt: skip
    cas["spec"]["prefill"] = {"tensorParallel": 1}
    cas["spec"]["decode"] = {"tensorParallel": 1}
    return probed_by_runner(cas)


def notes() -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "fleet-notes"},
            "data": {"owner": "the coding agents team"}}  # fmt: skip


def with_engine(cas: dict[str, Any], **engine: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(cas))
    out["spec"]["engine"] = {**out["spec"]["engine"], **engine}
    return out


class Run:
    """One Application's life: its repository, the waits on its status, the windows in which
    it may be OutOfSync (a commit or an edit until it is synced again), the step timings."""

    def __init__(
        self, kubectl: Kubectl, namespace: str, repo: FleetRepo, argocd: argocd_stack.ArgoCD,
        read: Callable[[], AppState],
    ) -> None:  # fmt: skip
        self.kubectl, self.namespace, self.repo, self.argocd = kubectl, namespace, repo, argocd
        self.read = read
        self.recorder = AppRecorder(read, interval_s=POLL_S)
        self.drift: list[tuple[float, float]] = []
        self.timings: dict[str, float] = {}

    def state(self) -> AppState:
        return self.read()

    def until(self, what: str, ok: Callable[[AppState], bool], timeout: float) -> AppState:
        """Poll the Application until ``ok`` of its state (every state read joins the
        record); AssertionError with the last state, the fleet's rollout and the controller's
        log tail on timeout."""
        last: list[AppState] = []

        def probe() -> AppState | None:
            if self.argocd.crashed():
                pytest.fail(f"Argo CD crashed:\n{self.argocd.crash_report()}")
            try:
                state = self.read()
            except ApiException:  # not there yet, an API hiccup
                return None
            self.recorder.states.append(state)
            last[:] = [state]
            return state if ok(state) else None

        try:
            found: AppState = wait_for(what, probe, timeout, interval=POLL_S)
        except TimeoutError as exc:
            tail = self.argocd.log_tail("argocd-application-controller", 8)
            fleet = self.kubectl("get", "cas", NAME, "-n", self.namespace, "-o",
                                 "jsonpath={.status.rollout}", check=False)  # fmt: skip
            raise AssertionError(
                f"{exc}; last: {last[0].brief() if last else None}\n"
                f"status.rollout: {fleet}\ncontroller:\n{tail}"
            ) from exc
        return found

    def push(self, message: str, files: dict[str, Any | None]) -> str:
        sha = self.repo.commit(message, files)
        refresh(self.kubectl, self.namespace, APP)
        return sha

    def revert(self, sha: str) -> str:
        reverted = self.repo.revert(sha)
        refresh(self.kubectl, self.namespace, APP)
        return reverted

    @contextmanager
    def may_drift(self) -> Iterator[None]:
        """A window in which the Application may be OutOfSync (its end is when the block's
        waits saw it synced again)."""
        start = time.monotonic()
        try:
            yield
        finally:
            self.drift.append((start, time.monotonic()))

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        yield
        self.timings[name] = time.monotonic() - start
        print(f"[gitops] {name}: {self.timings[name]:.1f}s; {self.state().brief()}")

    def unexplained_drift(self, since: float) -> list[AppState]:
        """Samples since ``since`` that were not Synced outside every allowed window."""
        return [s for s in self.recorder.since(since) if s.sync != "Synced"
                and not any(a - 1.0 <= s.at <= b + 1.0 for a, b in self.drift)]  # fmt: skip


def synced_at(sha: str) -> Callable[[AppState], bool]:
    return lambda s: s.sync == "Synced" and s.revision == sha


def kubectl_cas(cluster: ClusterHandle, *args: str) -> str:
    """The `kubectl cas` plugin as a user runs it (its console script's module)."""
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    argv = [sys.executable, "-m", "cas_operator.kubectl_cas", *args]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, check=True)
    return done.stdout


def kubectl_edit(cluster: ClusterHandle, namespace: str, sed: str) -> None:
    """`kubectl edit` of the fleet, its editor a sed script (as a user's editor saves); kubectl
    runs an editor command with spaces through the shell, the file's path appended."""
    assert cluster.kubectl_path is not None
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "KUBE_EDITOR": f"sed -i '{sed}'"}
    argv = [str(cluster.kubectl_path), "edit", "cas", NAME, "-n", namespace]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0 and "edited" in done.stdout, (done.stdout, done.stderr)


def children(kubectl: Kubectl, namespace: str) -> list[str]:
    out = kubectl("get", CHILD_KINDS, "-n", namespace, "-l", f"cas.dev/name={NAME}", "-o", "name")
    return sorted(out.split())


def child_objects(kubectl: Kubectl, namespace: str) -> list[dict[str, Any]]:
    out = kubectl("get", CHILD_KINDS, "-n", namespace, "-l", f"cas.dev/name={NAME}", "-o", "json")
    items: list[dict[str, Any]] = json.loads(out)["items"]
    return items


def live_cas(kubectl: Kubectl, namespace: str) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(kubectl("get", "cas", NAME, "-n", namespace, "-o", "json"))
    return found


@contextmanager
def live(stack: LiveStack) -> Iterator[LiveStack]:
    """The live stack without a resource (Argo CD applies it); closed however the block ends,
    and only when the block passed: the operator met no refusal under the chart's token."""
    try:
        stack.start(log=lambda s: print(f"[live] {s}"))
        yield stack
        refused = stack.refusals()
        if refused is not None:
            assert refused.rbac == [] and refused.other == [], refused
    finally:
        stack.close(log=lambda s: print(f"[live] {s}"))
        if stack.operator is not None:
            print(f"operator log tail:\n{stack.operator.log_tail(15)}")


def test_argo_cd_syncs_a_fleet_through_its_lifecycle(
    live_stack: MakeLiveStack, namespace: str, kubectl: Kubectl, cluster: ClusterHandle,
    crds: None, tmp_path: Path,
) -> None:  # fmt: skip
    why = argocd_stack.missing()
    if why is not None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI is set, so not skipping: {why}")
        pytest.skip(why)
    gateway = cluster.gateway_url
    assert gateway is not None, "the local stack runs no Gateway (pod network off?)"
    began = time.monotonic()
    with (
        live(live_stack(SIM_ARGS)),
        argocd_stack.argocd_running(cluster, namespace, tmp_path / "argocd",
                                    log=lambda s: print(f"[argocd] {s}")) as argocd,
    ):  # fmt: skip
        repo = FleetRepo(argocd.repos, tmp_path / "work")
        repo.init()
        read = app_reader(cluster.kubeconfig, namespace, APP)
        run = Run(kubectl, namespace, repo, argocd, read)
        spec = fleet(namespace)
        first = repo.commit("a fleet", {FLEET_FILE: spec, NOTES_FILE: notes()})
        app = application(APP, namespace, argocd.repo_url(repo.name), FLEET_PATH,
                          server_side_diff=False)  # fmt: skip
        started = time.monotonic()
        try:
            with run.step("1 sync to Healthy"), run.may_drift():
                kubectl("apply", "-f", "-", stdin=yaml.safe_dump(app))
                run.recorder.start()
                run.until("Synced at the first commit", synced_at(first), 60)
                healthy = run.until(
                    "Healthy once the fleet is Ready",
                    lambda s: synced_at(first)(s) and s.health == "Healthy",
                    240,  # its pods may wait for GPUs that other tests' pods hold
                )
            seen = [s for s in run.recorder.since(started) if s.revision == first]
            assert any(s.health == "Progressing" and s.resource_health == "Progressing"
                       for s in seen), [s.brief() for s in seen]  # fmt: skip
            assert healthy.resource_health == "Healthy" and "ready" in healthy.message, healthy
            assert healthy.operation == "Succeeded", healthy
            # Argo CD manages what git holds, never the operator's children: they carry neither
            # its tracking annotation (Argo CD 3's default) nor its tracking label
            assert sorted(healthy.resources) == [
                f"CodingAgentServing/{NAME}",
                "ConfigMap/fleet-notes",
            ], healthy.resources
            for child in child_objects(kubectl, namespace):
                meta = child["metadata"]
                assert TRACKING_ANNOTATION not in (meta.get("annotations") or {}), meta
                assert TRACKING_LABEL not in (meta.get("labels") or {}), meta

            # answers of at least anomalyGuard.minGeneratedTokens (128): the gate judges them
            load = RecordedLoad(
                gateway, workers=3, tokens=160, host=gateway_host(namespace)
            ).start()
            try:
                steps_2_to_5(run, cluster, kubectl, namespace, spec, gateway)
            finally:
                load.stop()
        finally:
            run.recorder.stop()
    total = time.monotonic() - began
    print(f"[gitops] total {total:.0f}s: " + ", ".join(
        f"{k} {v:.0f}s" for k, v in run.timings.items()))  # fmt: skip


def steps_2_to_5(
    run: Run, cluster: ClusterHandle, kubectl: Kubectl, namespace: str, spec: dict[str, Any],
    gateway: str,
) -> None:  # fmt: skip
    host = gateway_host(namespace)
    wait_for("the Gateway to reach the fleet", lambda: answers(gateway, host), 90)
    build2 = canary_promoted(run, cluster, kubectl, namespace, spec)
    bad_canary_reverted(run, kubectl, namespace, build2)
    # every sample under client-side diff, the Application's creation included
    unexplained = run.unexplained_drift(0.0)
    assert unexplained == [], [s.brief() for s in unexplained]
    server_side_from = time.monotonic()
    invalid_spec_refused(run, kubectl, namespace, build2)
    kubectl_edit_reverted(run, cluster, kubectl, namespace)
    auto_grows_the_prefill_pool(run, kubectl, namespace, gateway)
    unexplained = run.unexplained_drift(server_side_from)
    assert unexplained == [], [s.brief() for s in unexplained]
    pruned(run, kubectl, namespace)


def canary_promoted(
    run: Run, cluster: ClusterHandle, kubectl: Kubectl, namespace: str, spec: dict[str, Any]
) -> dict[str, Any]:
    """Step 2: an engine change rolls as a canary: Progressing, Suspended while its step waits
    for `kubectl cas rollout promote` (which sets the ignored annotation), Healthy after."""
    build2 = with_engine(spec, env=[{"name": "CAS_DEMO_BUILD", "value": "2"}])
    stable = rollout(kubectl, namespace)["stableRevision"]
    with run.step("2a canary to Suspended"):
        with run.may_drift():
            sha = run.push("engine build 2", {FLEET_FILE: build2})
            run.until("Synced at the engine change", synced_at(sha), 60)
        pushed = time.monotonic()
        paused = run.until(
            "Suspended while the step waits to be promoted",
            lambda s: synced_at(sha)(s) and s.health == "Suspended",
            150,
        )
    assert paused.message.startswith("canary rollout paused:"), paused
    assert "paused until promoted" in paused.message, paused
    seen = [s.health for s in run.recorder.since(pushed) if s.revision == sha]
    assert "Progressing" in seen and seen.index("Progressing") < seen.index("Suspended"), seen
    with run.step("2b promoted to Healthy"):
        kubectl_cas(cluster, "rollout", "promote", NAME, "-n", namespace)
        done = run.until(
            "Healthy after promotion", lambda s: synced_at(sha)(s) and s.health == "Healthy", 180
        )
    promoted = rollout(kubectl, namespace)
    assert promoted["stableRevision"] not in ("", stable) and promoted["phase"] == "Stable"
    assert done.resource_health == "Healthy", done
    return build2


def bad_canary_reverted(run: Run, kubectl: Kubectl, namespace: str, build2: dict[str, Any]) -> None:
    """Step 2: a corrupting canary is Degraded with the operator's reason; its revert removes
    `engine.args` from git, which Argo CD's client-side diff does not see once it applies
    server-side (no last-applied annotation): Synced at the revert, the fleet unchanged and
    still Degraded. With ServerSideDiff=true (as docs/architecture.md's Application has it) the
    revert is applied and the fleet is Healthy again; the rest of the run keeps it on."""
    stable = rollout(kubectl, namespace)["stableRevision"]
    bad = with_engine(build2, args=["--sim-fault", "decode_corruption=0.5"])
    with run.step("2c bad canary to Degraded"):
        with run.may_drift():
            bad_sha = run.push("engine: a corrupting build", {FLEET_FILE: bad})
            run.until("Synced at the bad canary", synced_at(bad_sha), 60)
        degraded = run.until(
            "Degraded by the aborted canary",
            lambda s: synced_at(bad_sha)(s) and s.health == "Degraded",
            180,
        )
    assert degraded.message.startswith("RolloutAborted: "), degraded
    assert "analysis failed" in degraded.message or "canary anomaly" in degraded.message
    with run.step("2d revert, client-side diff"), run.may_drift():
        reverted = run.revert(bad_sha)
        blind = run.until("Synced at the revert", synced_at(reverted), 60)
        assert blind.health == "Degraded" and blind.operation_revision == bad_sha, blind
        assert "args" in live_cas(kubectl, namespace)["spec"]["engine"]
    with run.step("2e revert, server-side diff: Healthy"), run.may_drift():
        kubectl("annotate", "applications.argoproj.io", APP, "-n", namespace,
                f"{COMPARE_OPTIONS}=ServerSideDiff=true", "--overwrite")  # fmt: skip
        refresh(kubectl, namespace, APP)
        healed = run.until(
            "the revert applied and Healthy",
            lambda s: synced_at(reverted)(s) and s.operation_revision == reverted
            and s.health == "Healthy", 120,
        )  # fmt: skip
    assert "args" not in live_cas(kubectl, namespace)["spec"]["engine"]
    assert healed.message.startswith("AllPoolsReady"), healed
    assert rollout(kubectl, namespace)["stableRevision"] == stable


def invalid_spec_refused(
    run: Run, kubectl: Kubectl, namespace: str, current: dict[str, Any]
) -> None:
    """Step 3: a spec the API server refuses (a step with two pauses): Argo CD names the
    refusal, the live resource and its children stay as they were, a revert is Synced."""
    before, owned = live_cas(kubectl, namespace), children(kubectl, namespace)
    invalid = json.loads(json.dumps(current))
    invalid["spec"]["rollout"]["steps"] = [{"weight": 50, "pauseSeconds": 10,
                                            "pauseUntilPromoted": True}]  # fmt: skip
    with run.step("3 invalid spec refused, reverted"), run.may_drift():
        bad_sha = run.push("rollout: a step with two pauses", {FLEET_FILE: invalid})
        refused = run.until(
            "Argo CD to show the refusal",
            lambda s: s.revision == bad_sha and REFUSAL in " ".join(s.said()),
            90,
        )
        assert refused.sync != "Synced", refused
        after = live_cas(kubectl, namespace)
        assert after["metadata"]["generation"] == before["metadata"]["generation"]
        assert after["spec"] == before["spec"]
        assert children(kubectl, namespace) == owned
        fixed = run.revert(bad_sha)
        run.until(
            "Synced and Healthy after the revert",
            lambda s: synced_at(fixed)(s) and s.health == "Healthy" and not s.conditions,
            90,
        )
    print(f"[gitops] the refusal as Argo CD shows it: {refused.said()}")


def kubectl_edit_reverted(
    run: Run, cluster: ClusterHandle, kubectl: Kubectl, namespace: str
) -> None:
    """Step 4: self-heal reverts a `kubectl edit` of a field git owns."""

    def min_requests() -> int:
        return int(live_cas(kubectl, namespace)["spec"]["rollout"]["analysis"]["minRequests"])

    head = run.repo.git("rev-parse", "HEAD")
    with run.step("4 kubectl edit reverted"), run.may_drift():
        edited_at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        kubectl_edit(cluster, namespace, "s/minRequests: 10$/minRequests: 11/")
        healed = run.until(
            "Argo CD to revert the edit",
            lambda s: synced_at(head)(s) and s.operation_automated
            and s.operation_started >= edited_at and s.operation == "Succeeded"
            and min_requests() == 10, 60,
        )  # fmt: skip
        # the edit was a new generation: Progressing until the operator observed the next
        run.until("Healthy again", lambda s: synced_at(head)(s) and s.health == "Healthy", 60)
    assert healed.operation_automated and healed.operation_revision == head, healed


def auto_grows_the_prefill_pool(run: Run, kubectl: Kubectl, namespace: str, gateway: str) -> None:
    """Step 4: Auto's replica counts live on the children, never in git: a starved prefill
    (the sim 40x slower, long prompts) makes the operator add a prefill instance while the
    Application stays Synced (the caller checks every sample)."""
    (prefill,) = [p for p in role_pods(kubectl, namespace, "prefill") if p["status"].get("podIP")]
    asyncio.run(set_fault(f"http://{prefill['status']['podIP']}:{ENGINE_PORT}",
                          {"slow_prefill": 40}))  # fmt: skip
    stop, stats = threading.Event(), LoadStats()

    def long_prompts() -> None:
        async def run_load() -> None:
            done = asyncio.Event()
            task = asyncio.create_task(steady_traffic(
                gateway, done, stats, concurrency=8, max_tokens=20, max_requests=5_000,
                prompt_body=LONG_PROMPT, host=gateway_host(namespace)))  # fmt: skip
            await asyncio.to_thread(stop.wait)
            done.set()
            await task

        asyncio.run(run_load())

    load = threading.Thread(target=long_prompts, name="long-prompts", daemon=True)
    load.start()
    try:
        with run.step("4 Auto adds a prefill, Synced"):
            run.until("Auto to add a prefill instance",
                      lambda s: s.sync == "Synced" and auto_counts(kubectl, namespace)[0] >= 2,
                      AUTO_TIMEOUT_S)  # fmt: skip
            wait_for("the prefill Deployment at 2", lambda: prefill_replicas(kubectl, namespace)
                     == 2, 30)  # fmt: skip
    finally:
        stop.set()
        load.join(60)
    status = live_cas(kubectl, namespace)
    assert status["status"]["ratio"]["replicasOwner"] == "operator (Auto)", status["status"]
    assert "replicas" not in status["spec"]["prefill"], status["spec"]
    print(f"[gitops] Auto: {status['status'].get('autoscaler')}; load: {stats.ok} ok of "
          f"{stats.sent}")  # fmt: skip


def prefill_replicas(kubectl: Kubectl, namespace: str) -> int:
    """Replicas of the resource's prefill Deployments together (what Auto writes)."""
    out = kubectl("get", "deployments", "-n", namespace, "-l",
                  f"cas.dev/name={NAME},cas.dev/role=prefill", "-o", "json")  # fmt: skip
    return sum(int(d["spec"].get("replicas", 0)) for d in json.loads(out)["items"])


def auto_counts(kubectl: Kubectl, namespace: str) -> tuple[int, int]:
    """(prefill, decode) instances Auto decided, from the status."""
    auto = live_cas(kubectl, namespace).get("status", {}).get("autoscaler") or {}
    return int(auto.get("prefill", 0)), int(auto.get("decode", 0))


def pruned(run: Run, kubectl: Kubectl, namespace: str) -> None:
    """Step 5: removing the fleet from git deletes it and, through their owner references,
    every child."""
    with run.step("5 pruned"), run.may_drift():
        gone = run.push("retire the fleet", {FLEET_FILE: None})
        done = run.until(
            "Synced without the fleet",
            lambda s: synced_at(gone)(s) and s.operation == "Succeeded"
            and s.operation_revision == gone, 90,
        )  # fmt: skip
        wait_for("the fleet and its children deleted", lambda: not kubectl(
            "get", "cas", NAME, "-n", namespace, "--ignore-not-found", "-o", "name").strip()
            and not children(kubectl, namespace), 90)  # fmt: skip
    assert done.resources == ("ConfigMap/fleet-notes",), done
    assert any(f"CodingAgentServing/{NAME} Pruned" in r for r in done.operation_results), done
