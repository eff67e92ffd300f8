"""The operator as a real process against the real (local) API server: samples to Ready,
children and arguments, scaling, revision rolls, garbage collection, schema/CEL rejections,
operator-side InvalidSpec, and a restart mid-reconcile.

KWOK nodes advertise 8 GPUs each, so the tests shrink instances (tensorParallel / gpusPerNode)
where the shape under test allows, to fit several fleets on the fake nodes at once.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.fleet.fleetview import apply_crds
from e2e.runtime import chart
from e2e.runtime.operator_process import OperatorProcess
from e2e.waits import pause, wait_for
from tests.paths import ROOT, load_sample

# clusterwide: this module's operator watches every namespace, as the chart's default install
# does; the suite runs it alone among the tests that start operators (conftest.py).
pytestmark = [pytest.mark.e2e, pytest.mark.clusterwide]
Kubectl = Callable[..., str]
READY_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def chart_identity(cluster: Any, kubectl: Kubectl, tmp_path_factory: Any) -> chart.ChartIdentity:
    """The chart's ServiceAccount and RBAC (all namespaces, admission policy on), installed as
    `helm install` would, and a kubeconfig holding its token: the session's operator runs as
    a cluster's operator would, not as the admin."""
    out = tmp_path_factory.mktemp("chart") / "kubeconfig"
    return chart.install_identity(kubectl, cluster.kubeconfig, out)


@pytest.fixture(scope="module")
def operator(kubectl: Kubectl, chart_identity: chart.ChartIdentity) -> Iterator[OperatorProcess]:
    """CRDs installed and established, then one operator process for this module, under the
    chart's identity (stopped when the module ends: it watches every namespace)."""
    apply_crds(kubectl)
    log_path = ROOT / "run" / f"operator-{os.getpid()}.log"
    proc = OperatorProcess(chart_identity.kubeconfig, log_path)
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


@contextlib.contextmanager
def restarted(operator: OperatorProcess, *args: str) -> Iterator[OperatorProcess]:
    """The session's operator restarted with `args`, and restarted as it was afterwards."""
    before = operator.extra_args
    operator.stop()
    operator.extra_args = args
    operator.start()
    try:
        yield operator
    finally:
        operator.stop()
        operator.extra_args = before
        operator.start()


def wait_until(what: str, probe: Callable[[], Any], timeout: float = READY_TIMEOUT_S) -> Any:
    """Poll `probe` until it returns something truthy; fail with `what` on timeout."""
    try:
        return wait_for(what, probe, timeout, interval=0.5)
    except TimeoutError as exc:
        pytest.fail(str(exc))


def get_json(kubectl: Kubectl, *args: str) -> Any:
    out = kubectl("get", *args, "-o", "json", check=False)
    return json.loads(out) if out.strip() else None


def apply(kubectl: Kubectl, namespace: str, manifest: dict[str, Any]) -> None:
    kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(manifest))


def condition(cas: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for cond in ((cas or {}).get("status") or {}).get("conditions", []):
        if cond["type"] == type_:
            return dict(cond)
    return {}


def wait_ready(kubectl: Kubectl, namespace: str, name: str) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        cas = get_json(kubectl, "cas", name, "-n", namespace)
        ready = condition(cas, "Ready")
        generation = (cas or {}).get("metadata", {}).get("generation")
        if ready.get("status") == "True" and ready.get("observedGeneration") == generation:
            return cas
        return None

    result: dict[str, Any] = wait_until(f"{namespace}/{name} Ready", probe)
    return result


def children(kubectl: Kubectl, namespace: str, kind: str, name: str) -> list[dict[str, Any]]:
    data = get_json(kubectl, kind, "-n", namespace, "-l", f"cas.dev/name={name}")
    return list((data or {}).get("items", []))


def small(sample: str, **spec_patch: Any) -> dict[str, Any]:
    """A sample with its spec sections patched (deep-merged one level)."""
    manifest = copy.deepcopy(load_sample(sample))
    for key, value in spec_patch.items():
        if isinstance(value, dict) and isinstance(manifest["spec"].get(key), dict):
            manifest["spec"][key] = {**manifest["spec"][key], **value}
        else:
            manifest["spec"][key] = value
    return manifest


def args_of(deployment: dict[str, Any]) -> list[str]:
    return list(deployment["spec"]["template"]["spec"]["containers"][0]["args"])


def test_minimal_sample_becomes_ready_with_every_child(
    operator: OperatorProcess, kubectl: Kubectl, namespace: str
) -> None:
    """Regression: the smallest spec must reconcile into pools, router, Services, PDBs, RBAC."""
    manifest = small("minimal.yaml", prefill={"tensorParallel": 1}, decode={"tensorParallel": 1})
    apply(kubectl, namespace, manifest)
    cas = wait_ready(kubectl, namespace, "minimal")
    status = cas["status"]
    assert status["observedGeneration"] == cas["metadata"]["generation"]
    assert status["prefill"]["readyReplicas"] == 1 and status["decode"]["readyReplicas"] == 1
    revision = status["revision"]
    deployments = {d["metadata"]["name"] for d in children(kubectl, namespace, "deploy", "minimal")}
    assert deployments == {
        f"minimal-prefill-{revision}",
        f"minimal-decode-{revision}",
        f"minimal-router-{revision}",
    }
    services = {s["metadata"]["name"] for s in children(kubectl, namespace, "svc", "minimal")}
    assert services == {"minimal", f"minimal-prefill-{revision}", f"minimal-decode-{revision}"}
    assert len(children(kubectl, namespace, "pdb", "minimal")) == 3  # both pools and the router
    for kind in ("serviceaccount", "role", "rolebinding", "configmap"):
        assert children(kubectl, namespace, kind, "minimal"), kind
    pods = children(kubectl, namespace, "pods", "minimal")
    roles = sorted(p["metadata"]["labels"]["cas.dev/role"] for p in pods)
    assert roles == ["decode", "prefill", "router", "router"]  # routers: 2 by default
    assert operator.running(), operator.log_tail()


def test_a_git_apply_after_the_operator_reconciled_shows_no_drift(
    operator: OperatorProcess, kubectl: Kubectl, namespace: str
) -> None:
    """GitOps contract (issue 16): once the operator reconciled a resource (its status, kopf's
    annotations, a rollout action it consumed), a server-side dry-run diff of what Git holds,
    under Argo CD's field manager, shows nothing: the operator never writes a field Git owns
    (spec, labels, the annotations in Git)."""
    manifest = small("minimal.yaml", prefill={"tensorParallel": 1}, decode={"tensorParallel": 1})
    manifest["metadata"]["labels"] = {"app.kubernetes.io/instance": "fleet-app"}  # Argo CD's
    manifest["spec"]["rollout"] = {"strategy": "Canary", "steps": [{"weight": 25}]}
    as_git = ["--server-side", "--field-manager=argocd-controller", "-n", namespace, "-f", "-"]
    kubectl("apply", *as_git, stdin=yaml.safe_dump(manifest))
    wait_ready(kubectl, namespace, "minimal")
    kubectl("annotate", "cas", "minimal", "-n", namespace, "cas.dev/rollout-action=skip")

    def consumed() -> bool:
        cas = get_json(kubectl, "cas", "minimal", "-n", namespace)
        return "cas.dev/rollout-action" not in (cas["metadata"].get("annotations") or {})

    wait_until("the rollout action consumed", consumed, 60)
    drift = kubectl("diff", *as_git, stdin=yaml.safe_dump(manifest), check=False)
    assert drift.strip() == "", drift
    for kind in ("deploy", "svc", "pdb", "configmap"):  # Argo CD's tracking stays on the parent
        for child in children(kubectl, namespace, kind, "minimal"):
            assert "app.kubernetes.io/instance" not in child["metadata"]["labels"], child


def test_glm5_sample_plans_layersplit_and_flags(
    operator: OperatorProcess, kubectl: Kubectl, namespace: str
) -> None:
    """The long-context sample (shrunk to 1+1 instances): CP/LayerSplit, HiCache, NEXTN and
    guard flags reach the pods and the layout reaches the status."""
    manifest = small("glm5-long-context.yaml", prefill={"replicas": 1}, decode={"replicas": 1})
    del manifest["spec"]["model"]["pvcName"]
    apply(kubectl, namespace, manifest)
    cas = wait_ready(kubectl, namespace, "glm5-agents")
    layout = cas["status"]["layerSplit"]
    assert layout["layersPerRank"] == [20, 20, 19, 19]
    assert layout["kvBytesPerTokenPerRank"] < layout["kvBytesPerTokenPerRankReplicated"]
    deployments = {
        d["metadata"]["labels"]["cas.dev/role"]: d
        for d in children(kubectl, namespace, "deploy", "glm5-agents")
    }
    prefill, decode = args_of(deployments["prefill"]), args_of(deployments["decode"])
    assert "--enable-dsa-cache-layer-split" in prefill and "--attn-cp-size" in prefill
    assert "--enable-hierarchical-cache" in prefill and "--speculative-algorithm" in decode
    assert decode[decode.index("--cas-guard-enabled") + 1] == "true"
    template = deployments["prefill"]["spec"]["template"]
    assert template["metadata"]["annotations"]["sglang.ai/bootstrap-port"] == "8998"
    # Recommend mode (issue 19): the planner's P:D and prefill shape, replicas untouched
    ratio = cas["status"]["ratio"]
    assert ratio["current"] == "1:1" and ratio["replicasOwner"] == "spec"
    shape = ratio["prefillShape"]
    assert (shape["current"]["contextParallel"], shape["current"]["layerSplit"]) == (4, True)
    assert shape["recommended"]["gpus"] <= 64 and shape["recommended"]["ttftP90Seconds"] > 0


def test_multinode_instances_are_lws_groups(
    operator: OperatorProcess, kubectl: Kubectl, namespace: str
) -> None:
    """Regression: TP wider than a node must become a LeaderWorkerSet whose group pods run."""
    manifest = small(
        "multinode-decode.yaml",
        prefill={"replicas": 1, "tensorParallel": 1},
        decode={"replicas": 1, "tensorParallel": 2, "gpusPerNode": 1},
    )
    apply(kubectl, namespace, manifest)
    cas = wait_ready(kubectl, namespace, "wide-decode")
    (lws,) = children(kubectl, namespace, "leaderworkersets", "wide-decode")
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert lws["metadata"]["name"] == f"wide-decode-decode-{cas['status']['revision']}"
    decode_pods = [
        p
        for p in children(kubectl, namespace, "pods", "wide-decode")
        if p["metadata"]["labels"].get("cas.dev/role") == "decode"
    ]
    assert len(decode_pods) == 2
    serving = [p for p in decode_pods if p["metadata"]["labels"].get("cas.dev/serving") == "true"]
    assert len(serving) == 1  # only the leader is in the router's rotation


def test_scaling_a_pool_converges_without_a_new_revision(
    operator: OperatorProcess, kubectl: Kubectl, namespace: str
) -> None:
    """Regression: replica changes must scale in place, never restart engines (new revision)."""
    manifest = small("minimal.yaml", prefill={"tensorParallel": 1}, decode={"tensorParallel": 1})
    apply(kubectl, namespace, manifest)
    revision = wait_ready(kubectl, namespace, "minimal")["status"]["revision"]
    kubectl(
        "patch", "cas", "minimal", "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": {"decode": {"replicas": 3}}}),
    )  # fmt: skip
    cas = wait_ready(kubectl, namespace, "minimal")
    assert cas["status"]["decode"]["readyReplicas"] == 3
    assert cas["status"]["revision"] == revision
    # prefill.replicas is unset, so it follows decode through ratio 1:1
    assert cas["status"]["ratio"]["current"] == "3:3"
    assert cas["status"]["prefill"]["readyReplicas"] == 3


def test_engine_change_rolls_a_new_revision_and_retires_the_old(
    operator: OperatorProcess, kubectl: Kubectl, namespace: str
) -> None:
    """Regression: both roles move to the new revision; the old pools go only after."""
    manifest = small("minimal.yaml", prefill={"tensorParallel": 1}, decode={"tensorParallel": 1})
    # KWOK's pods export no metrics: the old revision's work is unknown, so it goes after the
    # drain grace (0 here) and the 15 s a reading needs after it left the entry point.
    manifest["spec"]["engine"] = {"drainSeconds": 0}
    apply(kubectl, namespace, manifest)
    old = wait_ready(kubectl, namespace, "minimal")["status"]["revision"]
    manifest["spec"]["engine"] = {"image": "cas-engine:next", "drainSeconds": 0}
    apply(kubectl, namespace, manifest)
    cas = wait_ready(kubectl, namespace, "minimal")
    new = cas["status"]["revision"]
    assert new != old

    def only_new_revision() -> bool:
        revisions = {
            d["metadata"]["labels"]["cas.dev/revision"]
            for d in children(kubectl, namespace, "deploy", "minimal")
        }
        return revisions == {new}

    wait_until("old revision retired", only_new_revision, timeout=90)
    for deployment in children(kubectl, namespace, "deploy", "minimal"):
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert container["image"] == "cas-engine:next"


def test_delete_garbage_collects_children(
    operator: OperatorProcess, kubectl: Kubectl, namespace: str
) -> None:
    manifest = small("minimal.yaml", prefill={"tensorParallel": 1}, decode={"tensorParallel": 1})
    apply(kubectl, namespace, manifest)
    wait_ready(kubectl, namespace, "minimal")
    kubectl("delete", "cas", "minimal", "-n", namespace, "--wait=true", "--timeout=60s")

    def gone() -> bool:
        return not any(
            children(kubectl, namespace, kind, "minimal")
            for kind in ("deploy", "svc", "pdb", "configmap", "serviceaccount")
        )

    wait_until("children garbage-collected", gone, timeout=60)


def test_a_resource_deleted_while_no_operator_runs_goes_with_its_children(
    operator: OperatorProcess, kubectl: Kubectl, namespace: str
) -> None:
    """Regression (issue 38): a kopf timer put kopf's finalizer on every resource, so one
    deleted while the operator was down (uninstalled first, scaled to zero, a GitOps prune
    racing an operator upgrade) stayed Terminating, and its namespace with it. The resource
    carries no finalizer and goes at once; the garbage collector takes its children."""
    manifest = small("minimal.yaml", prefill={"tensorParallel": 1}, decode={"tensorParallel": 1})
    apply(kubectl, namespace, manifest)
    cas = wait_ready(kubectl, namespace, "minimal")
    assert not cas["metadata"].get("finalizers"), cas["metadata"]["finalizers"]
    operator.stop()
    try:
        kubectl("delete", "cas", "minimal", "-n", namespace, "--wait=true", "--timeout=30s")
        wait_until("children garbage-collected", lambda: not any(
            children(kubectl, namespace, kind, "minimal") for kind in ("deploy", "svc")
        ), timeout=60)  # fmt: skip
    finally:
        operator.start()


def test_a_deleted_pool_is_recreated_from_its_delete_event(
    operator: OperatorProcess, kubectl: Kubectl, namespace: str
) -> None:
    """Guards the DELETED-event path: refreshes no longer create workloads merely missing from
    the watch-fed index (it lags our own applies), so a pool someone deletes must come back
    from its DELETED event, well before the 30 s timer and the index-settle window."""
    manifest = small("minimal.yaml", prefill={"tensorParallel": 1}, decode={"tensorParallel": 1})
    apply(kubectl, namespace, manifest)
    wait_ready(kubectl, namespace, "minimal")
    (decode,) = [d for d in children(kubectl, namespace, "deploy", "minimal")
                 if d["metadata"]["labels"]["cas.dev/role"] == "decode"]  # fmt: skip
    name, uid = decode["metadata"]["name"], decode["metadata"]["uid"]
    kubectl("delete", "deploy", name, "-n", namespace, "--wait=true", "--timeout=60s")
    deleted = time.monotonic()

    def recreated() -> bool:
        found = get_json(kubectl, "deploy", name, "-n", namespace)
        return bool(found) and found["metadata"]["uid"] != uid

    wait_until("the decode Deployment re-created", recreated, timeout=15)
    assert time.monotonic() - deleted < 15  # the timer path would take 23 s or more
    wait_ready(kubectl, namespace, "minimal")


SCHEMA_REJECTIONS = [
    ({"prefill": {"tensorParallel": 8, "contextParallel": 3}}, "contextParallel must divide"),
    ({"prefill": {"layerSplit": True}}, "layerSplit requires contextParallel > 1"),
    ({"prefill": {"contextParallel": 2, "layerSplit": True}}, "requires a model with a DSA"),
    (
        {
            "model": {"name": "zai-org/GLM-5-FP8"},
            "prefill": {"tensorParallel": 16, "contextParallel": 2},
        },
        "must be at most 8 with contextParallel > 1",
    ),
    (
        {"model": {"name": "deepseek-ai/DeepSeek-V3"}, "prefill": {"contextParallel": 2}},
        "must equal tensorParallel for an MLA model",
    ),
    ({"decode": {"tensorParallel": 12}}, "multiple of gpusPerNode"),
    ({"ratio": {"min": 3, "max": 1}}, "ratio.min must be <= max"),
    ({"ratio": {"mode": "Auto"}}, "ratio.gpuBudget is required in Auto mode"),
    ({"workload": {"requestRate": 1e9}}, "spec.workload.requestRate"),
    ({"workload": {"avgInputTokens": 10**9}}, "spec.workload.avgInputTokens"),
    ({"engine": {"kvReclaim": "Sometimes"}}, "spec.engine.kvReclaim"),
    ({"engine": {"speculative": {"algorithm": "EAGLE"}}}, "draftModelPath is required"),
    ({"anomalyGuard": {"maxAcceptRate": 1.5}}, "spec.anomalyGuard.maxAcceptRate"),
    ({"prefill": {"tensorParallel": 0}}, "spec.prefill.tensorParallel"),
    ({"rollout": {"strategy": "Canary"}}, "rollout.steps must list at least one step"),
    ({"decode": {"bogusField": 1}}, "bogusField"),
    ({"engine": {"args": ["--tp-size", "4"]}}, "engine.args must not set a flag the operator"),
    ({"engine": {"args": ["--cas-guard-enabled=false"]}}, "engine.args must not set a flag"),
    ({"engine": {"env": [{"name": "LWS_LEADER_ADDRESS", "value": "x"}]}}, "engine.env must not"),
    # the engine layer's own variables (issue 41 item 11): the HiCache check, the gate, plugins
    ({"engine": {"env": [{"name": "CAS_HICACHE_CHECK", "value": "off"}]}}, "spec.engine.env: "),
    ({"engine": {"env": [{"name": "CAS_GUARD_ENABLED", "value": "0"}]}}, "the engine layer"),
    ({"engine": {"env": [{"name": "SGLANG_PLUGINS", "value": " "}]}}, "the engine layer"),
    # env.valueFrom takes only what an engine needs, one source, never beside a value
    (
        {"engine": {"env": [{"name": "X", "valueFrom": {"resourceFieldRef": {"resource": "a"}}}]}},
        "resourceFieldRef",
    ),
    (
        {
            "engine": {
                "env": [{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels"}}}]
            }
        },
        "spec.engine.env[0].valueFrom.fieldRef.fieldPath",
    ),
    (
        {
            "engine": {
                "env": [
                    {
                        "name": "X",
                        "value": "v",
                        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                    }
                ]
            }
        },
        "an env var has value or valueFrom, not both",
    ),
    (
        {"engine": {"env": [{"name": "X", "valueFrom": {}}]}},
        "valueFrom takes exactly one of",
    ),
    ({"security": {"keysSecret": "Not_A_Name"}}, "spec.security.keysSecret"),
    # smg's policy on the router that has none (issue 40)
    ({"router": {"policy": "consistent_hashing"}}, "needs router.implementation smg"),
    (
        {
            "security": {
                "networkPolicy": {"clientsFrom": [{"cidr": "10.0.0.0/8", "podLabels": {"a": "b"}}]}
            }
        },
        "a network peer is either cidr or pod/namespace labels",
    ),
    # fields copied into children, checked as the child's API checks them (issue 41 item 12)
    (
        {"gateway": {"parentRefs": [{"name": "gw"}], "hostnames": ["-bad-host-"]}},
        "spec.gateway.hostnames[0]",
    ),
    ({"podMetadata": {"labels": {"bad key!": "v"}}}, "spec.podMetadata.labels: "),
    ({"podMetadata": {"labels": {"team": "bad value!"}}}, "spec.podMetadata.labels.team"),
    ({"podMetadata": {"annotations": {"bad key!": "v"}}}, "spec.podMetadata.annotations: "),
    (
        {"security": {"networkPolicy": {"clientsFrom": [{"cidr": "300.0.0.0/8"}]}}},
        "spec.security.networkPolicy.clientsFrom[0].cidr",
    ),
]


@pytest.mark.parametrize(("patch", "message"), SCHEMA_REJECTIONS)
def test_api_server_rejects_invalid_specs_naming_the_field(
    operator: OperatorProcess, cluster: Any, namespace: str, patch: dict[str, Any], message: str
) -> None:
    """Regression: what the schema and CEL can reject must fail at `kubectl apply`."""
    manifest = small("minimal.yaml", **patch)
    result = subprocess.run(
        [str(cluster.kubectl_path), "--kubeconfig", str(cluster.kubeconfig),
         "apply", "-n", namespace, "-f", "-"],
        input=yaml.safe_dump(manifest), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode != 0, result.stdout
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("name", "message"),
    [("a" * 40, "at most 32 characters"), ("9fleet", "must be a DNS-1035 label")],
)
def test_a_name_children_cannot_carry_is_rejected(
    operator: OperatorProcess, cluster: Any, kubectl: Kubectl, namespace: str, name: str,
    message: str,
) -> None:  # fmt: skip
    """Regression: the name becomes Service names ("9fleet" is a valid object name but not a
    Service name, so every pass failed to apply); refused at apply instead."""
    manifest = small("minimal.yaml")
    manifest["metadata"]["name"] = name
    result = subprocess.run(
        [str(cluster.kubectl_path), "--kubeconfig", str(cluster.kubeconfig),
         "apply", "-n", namespace, "-f", "-"],
        input=yaml.safe_dump(manifest), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert get_json(kubectl, "cas", name, "-n", namespace) is None


def test_operator_reports_invalid_spec_once(
    operator: OperatorProcess, kubectl: Kubectl, namespace: str
) -> None:
    """Regression: a spec the schema accepts but the planner cannot (LayerSplit over more
    context-parallel ranks than layers) must end in Degraded/InvalidSpec naming the field, not
    a retry loop."""
    manifest = small(
        "minimal.yaml", model={"name": "zai-org/GLM-5-FP8", "numLayers": 2},
        prefill={"contextParallel": 4},
    )  # fmt: skip
    apply(kubectl, namespace, manifest)

    def degraded() -> dict[str, Any] | None:
        cond = condition(get_json(kubectl, "cas", "minimal", "-n", namespace), "Degraded")
        return cond if cond.get("reason") == "InvalidSpec" else None

    cond = wait_until("Degraded/InvalidSpec", degraded, timeout=60)
    assert cond["status"] == "True" and "prefill.contextParallel" in cond["message"]
    assert not children(kubectl, namespace, "deploy", "minimal")
    pause(12, "a guard tick and more: the condition stays, nothing is created")
    assert degraded() is not None and not children(kubectl, namespace, "deploy", "minimal")
    assert operator.running(), operator.log_tail()


def test_operator_killed_mid_reconcile_converges_without_duplicates(
    operator: OperatorProcess, kubectl: Kubectl, namespace: str
) -> None:
    """Regression: a restart must neither duplicate nor orphan children (level-based, SSA)."""
    manifest = small("minimal.yaml", prefill={"tensorParallel": 1}, decode={"tensorParallel": 1})
    apply(kubectl, namespace, manifest)
    wait_until(
        "first child created",
        lambda: children(kubectl, namespace, "serviceaccount", "minimal"),
        timeout=30,
    )
    operator.kill()
    operator.start()
    cas = wait_ready(kubectl, namespace, "minimal")
    revision = cas["status"]["revision"]
    names = [d["metadata"]["name"] for d in children(kubectl, namespace, "deploy", "minimal")]
    assert sorted(names) == sorted(
        f"minimal-{role}-{revision}" for role in ("prefill", "decode", "router")
    )
    uid = cas["metadata"]["uid"]
    for kind in ("deploy", "svc", "pdb", "configmap", "serviceaccount", "role", "rolebinding"):
        for obj in children(kubectl, namespace, kind, "minimal"):
            (ref,) = obj["metadata"]["ownerReferences"]
            assert ref["uid"] == uid and ref["controller"] is True


def _old_operator_pass(kubeconfig: Any, namespace: str, name: str) -> str:
    """What an older operator version did: reconcile `name` once, rendering the engine pods
    with one env var more (this test's stand-in for any rendering change), and write the
    status as a pass does. Returns the revision it made."""
    from kubernetes import config

    from cas_operator.api import constants as c
    from cas_operator.desired.resources import pools
    from cas_operator.kube import Kube
    from cas_operator.reconcile.core import reconcile
    from cas_operator.reconcile.status import status_patch
    from cas_operator.types import rfc3339

    kube = Kube(config.new_client_from_config(config_file=str(kubeconfig)))  # type: ignore[no-untyped-call]
    obj = kube.get(c.KIND, namespace, name)
    assert obj is not None
    real_env = pools.engine_env
    pools.engine_env = lambda plan: [*real_env(plan), {"name": "CAS_OLD_OPERATOR", "value": "1"}]
    try:
        outcome = reconcile(
            kube,
            name=name,
            namespace=namespace,
            uid=obj["metadata"]["uid"],
            generation=obj["metadata"]["generation"],
            raw_spec=obj["spec"],
            full_apply=True,
        )
    finally:
        pools.engine_env = real_env
    kube.patch_status(c.KIND, namespace, name, status_patch({}, outcome.status, rfc3339()))
    return str(outcome.status["revision"])


def test_an_operator_upgrade_restarts_no_engine_until_the_user_opts_in(
    operator: OperatorProcess, kubectl: Kubectl, namespace: str, kubeconfig: Any
) -> None:
    """Regression (issue 15): an operator version that renders the same spec differently gave
    every fleet a new revision, so upgrading the operator rolled every fleet at once. The new
    version must keep the running workloads' templates (no new ReplicaSet), still scale them,
    say what it holds, and roll only on `rollout.onOperatorUpgrade: Roll`."""
    manifest = small("minimal.yaml", prefill={"tensorParallel": 1}, decode={"tensorParallel": 1})
    manifest["spec"]["engine"] = {"drainSeconds": 0}  # KWOK pods: no metrics, work unknown
    operator.stop()
    try:
        apply(kubectl, namespace, manifest)
        old = _old_operator_pass(kubeconfig, namespace, "minimal")
    finally:
        operator.start()

    def ready_when(what: str, test: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            cas = wait_ready(kubectl, namespace, "minimal")
            return cas if test(cas["status"]) else None

        found: dict[str, Any] = wait_until(what, probe)
        return found

    cas = ready_when("the new operator holding the old revision", lambda s: "heldRevision" in s)
    assert cas["status"]["revision"] == old
    rendered = cas["status"]["heldRevision"]["revision"]
    assert rendered != old

    def replica_sets() -> dict[str, str]:
        return {
            rs["metadata"]["name"]: rs["metadata"]["labels"]["cas.dev/role"]
            for rs in children(kubectl, namespace, "rs", "minimal")
        }

    def old_templates() -> bool:
        deployments = children(kubectl, namespace, "deploy", "minimal")
        engines = [d for d in deployments if d["metadata"]["labels"]["cas.dev/role"] != "router"]
        env = [
            e["name"]
            for d in engines
            for e in d["spec"]["template"]["spec"]["containers"][0]["env"]
        ]
        return len(engines) == 2 and env.count("CAS_OLD_OPERATOR") == 2

    sets = replica_sets()
    assert old_templates() and len(sets) == 3, sets
    events = kubectl("get", "events", "-n", namespace, "--field-selector",
                     "reason=OperatorUpgradeHeld", "-o", "name")  # fmt: skip
    assert events.strip(), "no OperatorUpgradeHeld event"

    kubectl("patch", "cas", "minimal", "-n", namespace, "--type=merge",
            "-p", json.dumps({"spec": {"decode": {"replicas": 2}}}))  # fmt: skip
    cas = ready_when("decode scaled to 2", lambda s: s["decode"]["readyReplicas"] == 2)
    assert cas["status"]["revision"] == old and old_templates()
    assert replica_sets() == sets  # scaled in place: no ReplicaSet of a new template

    kubectl("patch", "cas", "minimal", "-n", namespace, "--type=merge",
            "-p", json.dumps({"spec": {"rollout": {"onOperatorUpgrade": "Roll"}}}))  # fmt: skip
    cas = ready_when("rolled to the new rendering", lambda s: s["revision"] == rendered)
    assert cas["status"].get("heldRevision") is None
    wait_until(
        "old revision retired",
        lambda: {d["metadata"]["labels"]["cas.dev/revision"]
                 for d in children(kubectl, namespace, "deploy", "minimal")} == {rendered},
        timeout=90,
    )  # fmt: skip
    assert not old_templates()


def test_pod_metadata_reaches_running_pods_and_dropped_keys_are_reported(
    operator: OperatorProcess, kubectl: Kubectl, namespace: str
) -> None:
    """`spec.podMetadata` through the real API server and controllers: every engine and
    router pod carries the user's label; a key the operator owns is dropped and reported."""
    manifest = small(
        "minimal.yaml",
        prefill={"tensorParallel": 1},
        decode={"tensorParallel": 1},
        podMetadata={"labels": {"team": "agents", "cas.dev/serving": "false"}},
    )
    apply(kubectl, namespace, manifest)
    cas = wait_ready(kubectl, namespace, "minimal")
    assert cas["status"]["warnings"] == [
        "spec.podMetadata.labels.cas.dev/serving: the operator sets this key; dropped"
    ]
    pods = children(kubectl, namespace, "pod", "minimal")
    roles = sorted(p["metadata"]["labels"]["cas.dev/role"] for p in pods)
    assert roles == ["decode", "prefill", "router", "router"], roles
    assert all(p["metadata"]["labels"]["team"] == "agents" for p in pods)
    engines = [p for p in pods if p["metadata"]["labels"]["cas.dev/role"] != "router"]
    assert all(p["metadata"]["labels"]["cas.dev/serving"] == "true" for p in engines)
    events = kubectl("get", "events", "-n", namespace, "--field-selector",
                     "reason=SpecWarning", "-o", "name")  # fmt: skip
    assert events.strip(), "no SpecWarning event"


def test_the_operators_gpu_cap_refuses_a_resource_over_it(
    operator: OperatorProcess, kubectl: Kubectl, namespace: str
) -> None:
    """`cas-operator --max-gpus-per-resource`: a resource planning more GPUs is reported
    (Degraded/InvalidSpec naming the field and the cap) and gets no workloads."""
    with restarted(operator, "--max-gpus-per-resource", "16"):
        apply(kubectl, namespace, small("minimal.yaml", decode={"replicas": 2}))

        def refused() -> dict[str, Any]:
            return condition(get_json(kubectl, "cas", "minimal", "-n", namespace), "Degraded")

        degraded = wait_until("Degraded for the cap", lambda: "cap of 16" in
                              refused().get("message", "") and refused())  # fmt: skip
        assert degraded["reason"] == "InvalidSpec", degraded
        assert "spec.decode.replicas: 2:2 needs 32 GPUs" in degraded["message"], degraded
        assert children(kubectl, namespace, "deploy", "minimal") == []


@pytest.mark.parametrize("sample", ["minimal.yaml", "multinode-decode.yaml"])
def test_pods_are_admitted_in_a_namespace_that_enforces_restricted(
    operator: OperatorProcess, kubectl: Kubectl, namespace: str, sample: str
) -> None:
    """Regression (issue 17): engine and router pods ran as root with the default
    capabilities; the API server's own Pod Security admission refused them in a namespace
    enforcing "restricted". With `engine.rdma` (IPC_LOCK) it still refuses, with the reason."""
    kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted",
            "pod-security.kubernetes.io/enforce-version=latest")  # fmt: skip
    apply(kubectl, namespace, small(sample))
    wait_ready(kubectl, namespace, load_sample(sample)["metadata"]["name"])
    pods = json.loads(kubectl("get", "pods", "-n", namespace, "-o", "json"))["items"]
    roles = {p["metadata"]["labels"]["cas.dev/role"] for p in pods}
    assert roles == {"prefill", "decode", "router"}, roles
    if sample != "minimal.yaml":
        return
    kubectl("delete", "cas", "--all", "-n", namespace, "--wait=true", timeout=120)
    apply(kubectl, namespace, small(sample, engine={"rdma": {"resource": "rdma/hca"}}))

    def refused() -> str:
        out = kubectl("get", "events", "-n", namespace, "--field-selector", "reason=FailedCreate",
                      "-o", "jsonpath={.items[*].message}")  # fmt: skip
        return out if "violates PodSecurity" in out else ""

    assert "IPC_LOCK" in wait_until("RDMA pods refused by Pod Security", refused)


def test_two_operators_with_leader_election_never_act_at_once(
    operator: OperatorProcess,
    chart_identity: chart.ChartIdentity,
    kubectl: Kubectl,
    namespace: str,
    tmp_path: Path,
) -> None:
    """Regression (issue 17): two replicas of the operator both acted (both drained, both
    applied). With --leader-elect only the Lease holder acts; the standby takes over when the
    holder dies (SIGKILL: no release), within the Lease duration, and carries on. The Lease
    lives in the operator's namespace, where the chart grants it."""
    elect = ("--leader-elect", "--leader-elect-namespace", chart_identity.namespace,
             "--leader-elect-name", namespace, "-n", namespace)  # fmt: skip
    first, second = (OperatorProcess(operator.kubeconfig, tmp_path / f"{n}.log", extra_args=elect)
                     for n in ("first", "second"))  # fmt: skip
    with restarted(operator, "-n", "default"):  # the session's operator leaves this namespace
        first.start()
        try:
            wait_until("first to lead", lambda: "leading: Lease" in first.log_tail(200), 60)
            second.start()
            wait_until("second to stand by", lambda: "standing by" in second.log_tail(200), 60)
            apply(kubectl, namespace, small("minimal.yaml"))
            wait_ready(kubectl, namespace, "minimal")
            assert "re-applying" not in second.log_tail(400) and "applied" not in second.log_tail(
                400
            ), second.log_tail(40)
            first.kill()
            patch = {"spec": {"decode": {"replicas": 2}}}
            kubectl("patch", "cas", "minimal", "-n", namespace, "--type=merge",
                    "-p", json.dumps(patch))  # fmt: skip
            wait_until("second to lead", lambda: "leading: Lease" in second.log_tail(200), 60)
            cas = wait_until("the change applied by the new leader", lambda: (
                c := get_json(kubectl, "cas", "minimal", "-n", namespace)
            )["status"].get("decode", {}).get("readyReplicas") == 2 and c)  # fmt: skip
            assert cas["status"]["decode"]["replicas"] == 2
        finally:
            first.stop()
            second.stop()


def test_the_session_operator_met_no_refusal_under_the_charts_identity(
    operator: OperatorProcess, cluster: Any, chart_identity: chart.ChartIdentity
) -> None:
    """Regression (issue 17): the chart's RBAC was written by hand and never exercised; a verb
    the operator uses and the chart lacks shows up only on a real cluster, as 403s. The
    session's operator ran this module's tests (defined above: pytest runs them first) under
    the chart's token; the audit log holds its requests, RBAC refused none, and no admission
    refused one but for the passing reasons in `chart.PASSING_REFUSALS`."""
    events = chart.audit_events(cluster.audit_log, chart_identity.username)
    resources = {e.get("objectRef", {}).get("resource") for e in events}
    assert {"codingagentservings", "deployments", "pods"} <= resources, sorted(map(str, resources))
    refused = chart.refusals(events)
    assert refused.rbac == [] and refused.other == [], (refused, operator.log_tail(40))
