"""Pure builders: golden manifests for the samples, and one test per SGLang flag family."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import yaml

from cas_operator.api import constants as c
from cas_operator.api.models import parse_spec
from cas_operator.desired.build import build_plan
from cas_operator.desired.plan import Plan
from cas_operator.desired.resources import build_all
from cas_operator.desired.resources.engine_args import engine_args, engine_env
from cas_operator.desired.resources.meta import Owner
from cas_operator.desired.resources.router import router_args
from cas_operator.reconcile.core import apply_tier
from cas_operator.render import PLACEHOLDER_UID, render
from tests.paths import ROOT, load_sample

GOLDEN = ROOT / "tests" / "unit" / "golden"
SAMPLE_FILES = ["minimal.yaml", "glm5-long-context.yaml", "multinode-decode.yaml"]
WORKLOADS = ("Deployment", "LeaderWorkerSet")
OWNER_UID = PLACEHOLDER_UID  # what `cas-operator render` prints


def plan_sample(name: str) -> tuple[Owner, Plan]:
    raw = load_sample(name)
    owner = Owner(raw["metadata"]["name"], "default", OWNER_UID)
    return owner, build_plan(owner.name, owner.namespace, parse_spec(raw["spec"]))


def plan_of(**spec: Any) -> Plan:
    raw: dict[str, Any] = {"model": {"name": "zai-org/GLM-5-FP8"}, **spec}
    return build_plan("demo", "ns", parse_spec(raw))


def flag(args: list[str], name: str) -> str | None:
    """The value after a flag, or None when absent."""
    return args[args.index(name) + 1] if name in args else None


@pytest.mark.parametrize("sample_file", SAMPLE_FILES)
def test_golden_manifests(sample_file: str) -> None:
    """Regression: any change to a built manifest shows up as a reviewed golden-file diff.
    The children come from `render.render`, the code behind `cas-operator render`.

    Regenerate with UPDATE_GOLDEN=1 after reviewing the change by eye.
    """
    rendered = yaml.safe_dump_all(render(load_sample(sample_file)), sort_keys=True)
    golden = GOLDEN / sample_file
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(rendered)
    assert golden.exists(), "run with UPDATE_GOLDEN=1 once and review the file"
    assert rendered == golden.read_text()


def test_sample_revisions_are_pinned() -> None:
    """Regression: an operator change that renders the engine pods differently gives every
    fleet a new revision (issue 15: one added spec field changed all of them). Fleets with
    `rollout.onOperatorUpgrade: Hold` (the default) keep running as they are; those with `Roll`
    restart every engine. So a diff here is a release note: say which and why, then regenerate
    with UPDATE_GOLDEN=1. Nothing else (replicas, the router, Services) may move these."""
    got = {name: plan_sample(name)[1].revision for name in SAMPLE_FILES}
    golden = GOLDEN / "revisions.json"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
    assert got == json.loads(golden.read_text())


@pytest.mark.parametrize("sample_file", SAMPLE_FILES)
def test_every_child_is_owned_labelled_and_hashed(sample_file: str) -> None:
    """Regression: children without a controller owner reference leak on delete; children with
    the parent's labels would be adopted by Argo CD's tracking."""
    owner, plan = plan_sample(sample_file)
    for manifest in build_all(owner, plan):
        meta = manifest["metadata"]
        (ref,) = meta["ownerReferences"]
        assert ref["controller"] is True and ref["uid"] == OWNER_UID and ref["kind"] == c.KIND
        assert meta["labels"][c.LABEL_MANAGED_BY] == c.MANAGED_BY
        assert meta["labels"][c.LABEL_NAME] == owner.name
        assert "app.kubernetes.io/instance" not in meta["labels"]
        assert len(meta["annotations"][c.ANNOTATION_SPEC_HASH]) == 16
        assert len(meta["name"]) <= 63


def test_a_rolebinding_is_applied_after_its_role_and_before_the_router() -> None:
    """Regression (issue 17, operator under the chart's token): Role and RoleBinding went out
    in one parallel batch; without the `bind` verb the API server checks the Role exists, so a
    RoleBinding that won the race was refused (404) and the router lost its pod reads."""
    owner, plan = plan_sample("minimal.yaml")
    tier = {(m["kind"], m["metadata"]["name"]): apply_tier(m) for m in build_all(owner, plan)}
    role = next(t for (kind, _), t in tier.items() if kind == "Role")
    binding = next(t for (kind, _), t in tier.items() if kind == "RoleBinding")
    router = max(t for (kind, _), t in tier.items() if kind == "Deployment")
    assert role < binding < router


def test_apply_order_puts_router_last_and_rbac_first() -> None:
    owner, plan = plan_sample("minimal.yaml")
    kinds = [m["kind"] for m in build_all(owner, plan)]
    assert kinds[:3] == ["ServiceAccount", "Role", "RoleBinding"]
    assert kinds.index("Deployment") > kinds.index("PodDisruptionBudget")
    assert kinds[-2:] == ["Deployment", "Service"]


def test_single_node_pools_are_deployments_multi_node_are_lws() -> None:
    """Regression: TP16 on 8-GPU nodes must be a LeaderWorkerSet of size 2, leader serving."""
    owner, plan = plan_sample("multinode-decode.yaml")
    by_name = {m["metadata"]["name"]: m for m in build_all(owner, plan) if m["kind"] in WORKLOADS}
    prefill = by_name[plan.prefill.workload_name]
    decode = by_name[plan.decode.workload_name]
    assert prefill["kind"] == "Deployment"
    assert decode["kind"] == "LeaderWorkerSet"
    template = decode["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2
    leader, worker = template["leaderTemplate"], template["workerTemplate"]
    assert leader["metadata"]["labels"][c.LABEL_SERVING] == "true"
    assert c.LABEL_SERVING not in worker["metadata"]["labels"]
    assert "readinessProbe" not in worker["spec"]["containers"][0]
    args = worker["spec"]["containers"][0]["args"]
    assert flag(args, "--nnodes") == "2"
    assert flag(args, "--node-rank") == "$(LWS_WORKER_INDEX)"
    assert flag(args, "--dist-init-addr") == f"$(LWS_LEADER_ADDRESS):{c.DIST_INIT_PORT}"
    gpu = worker["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert gpu == "8"


def test_disaggregation_flags_and_bootstrap_annotation() -> None:
    plan = plan_of()
    prefill, decode = engine_args(plan, plan.prefill), engine_args(plan, plan.decode)
    assert flag(prefill, "--disaggregation-mode") == "prefill"
    assert flag(decode, "--disaggregation-mode") == "decode"
    assert flag(prefill, "--disaggregation-transfer-backend") == "mooncake"
    assert flag(prefill, "--disaggregation-bootstrap-port") == str(c.BOOTSTRAP_PORT)
    assert "--disaggregation-bootstrap-port" not in decode
    owner = Owner("demo", "ns", OWNER_UID)
    by_name = {m["metadata"]["name"]: m for m in build_all(owner, plan) if m["kind"] in WORKLOADS}
    prefill_pod = by_name[plan.prefill.workload_name]["spec"]["template"]
    decode_pod = by_name[plan.decode.workload_name]["spec"]["template"]
    assert prefill_pod["metadata"]["annotations"][c.ANNOTATION_BOOTSTRAP_PORT] == "8998"
    assert c.ANNOTATION_BOOTSTRAP_PORT not in decode_pod["metadata"]["annotations"]


def test_server_flags_and_probes() -> None:
    plan = plan_of(model={"name": "m", "path": "/models/m", "servedModelName": "coder"})
    args = engine_args(plan, plan.decode)
    assert flag(args, "--model-path") == "/models/m"
    assert flag(args, "--served-model-name") == "coder"
    assert flag(args, "--port") == str(c.ENGINE_PORT) and "--enable-metrics" in args
    manifests = build_all(Owner("demo", "ns", OWNER_UID), plan)
    (decode,) = [
        m
        for m in manifests
        if m["metadata"]["name"] == plan.decode.workload_name and m["kind"] == "Deployment"
    ]
    container = decode["spec"]["template"]["spec"]["containers"][0]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"


def test_parallel_flags_cp_and_layersplit_only_on_prefill() -> None:
    """Regression: LayerSplit flags on decode would crash it; CP flags need cp > 1."""
    plan = plan_of(prefill={"contextParallel": 4})
    prefill, decode = engine_args(plan, plan.prefill), engine_args(plan, plan.decode)
    assert flag(prefill, "--tp-size") == "8" and flag(decode, "--tp-size") == "8"
    assert flag(prefill, "--attn-cp-size") == "4"
    assert flag(prefill, "--cp-strategy") == "interleave"  # SGLang refuses CP without one
    assert "--cp-strategy" not in decode
    assert "--enable-prefill-cp" in prefill and "--enable-dsa-cache-layer-split" in prefill
    assert "--attn-cp-size" not in decode and "--enable-dsa-cache-layer-split" not in decode
    off = plan_of(prefill={"contextParallel": 4, "layerSplit": False})
    assert "--enable-dsa-cache-layer-split" not in engine_args(off, off.prefill)
    plain = plan_of()
    assert "--attn-cp-size" not in engine_args(plain, plain.prefill)


def test_hicache_flags() -> None:
    assert "--enable-hierarchical-cache" not in engine_args(plan_of(), plan_of().decode)
    plan = plan_of(hicache={"enabled": True, "hostMemoryRatio": 2.5, "storageBackend": "mooncake"})
    args = engine_args(plan, plan.prefill)
    assert "--enable-hierarchical-cache" in args
    assert flag(args, "--hicache-ratio") == "2.5"
    assert flag(args, "--hicache-storage-backend") == "mooncake"
    assert flag(args, "--hicache-write-policy") == "write_through"
    local = plan_of(hicache={"enabled": True, "hostMemoryRatio": 2})
    assert flag(engine_args(local, local.prefill), "--hicache-ratio") == "2"
    assert "--hicache-storage-backend" not in engine_args(local, local.prefill)
    # Regression: SGLang disables the radix cache on PD decode and then refuses HiCache.
    assert "--enable-hierarchical-cache" not in engine_args(plan, plan.decode)


def test_speculative_flags() -> None:
    plan = plan_of(
        engine={"speculative": {"algorithm": "EAGLE", "draftModelPath": "/d", "numSteps": 5}}
    )
    args = engine_args(plan, plan.decode)
    assert flag(args, "--speculative-algorithm") == "EAGLE"
    assert flag(args, "--speculative-draft-model-path") == "/d"
    assert flag(args, "--speculative-num-steps") == "5"
    assert flag(args, "--speculative-eagle-topk") == "1"
    assert flag(args, "--speculative-num-draft-tokens") == "4"
    nextn = plan_of(engine={"speculative": {"algorithm": "NEXTN"}})
    assert "--speculative-draft-model-path" not in engine_args(nextn, nextn.decode)
    assert "--speculative-algorithm" not in engine_args(plan_of(), plan_of().decode)


def test_cas_flags_reclaim_and_guard() -> None:
    """Regression: the guard needs speculative stats; its thresholds come from anomalyGuard."""
    plan = plan_of(
        engine={"speculative": {"algorithm": "NEXTN"}, "kvReclaim": "Upstream"},
        anomalyGuard={"minGeneratedTokens": 64, "minAcceptLength": 1.5, "maxAcceptRate": 0.9},
    )
    decode, prefill = engine_args(plan, plan.decode), engine_args(plan, plan.prefill)
    assert flag(decode, "--cas-kv-reclaim") == "upstream"
    assert flag(prefill, "--cas-kv-reclaim") == "upstream"
    assert flag(decode, "--cas-guard-enabled") == "true"
    assert not any(arg.startswith("--cas-guard") for arg in prefill)
    assert flag(decode, "--cas-guard-min-generated-tokens") == "64"
    assert flag(decode, "--cas-guard-min-accept-length") == "1.5"
    assert flag(decode, "--cas-guard-max-accept-rate") == "0.9"
    no_spec = plan_of()
    assert flag(engine_args(no_spec, no_spec.decode), "--cas-guard-enabled") == "false"
    assert flag(engine_args(no_spec, no_spec.decode), "--cas-kv-reclaim") == "strict"


def test_user_args_come_last_and_env_carries_prefill_budget() -> None:
    plan = plan_of(
        engine={"args": ["--max-running-requests", "64"], "env": [{"name": "X", "value": "1"}]},
        prefill={"timeoutSeconds": 45},
    )
    args = engine_args(plan, plan.decode)
    assert args[-2:] == ["--max-running-requests", "64"]
    env = {e["name"]: e.get("value") for e in engine_env(plan)}
    assert env["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] == "45"
    assert env["SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"] == "45"
    assert env["X"] == "1"


def test_router_discovers_its_revision_in_pd_mode() -> None:
    """Regression: a router selecting by role only would pair prefill and decode pods of
    different revisions during a roll."""
    plan = plan_of(router={"policy": "round_robin", "retries": 5})
    args = router_args(plan)
    assert "--pd-disaggregation" in args and "--service-discovery" in args
    prefill_sel = args[args.index("--prefill-selector") + 1 : args.index("--decode-selector")]
    assert f"{c.LABEL_REVISION}={plan.revision}" in prefill_sel
    assert f"{c.LABEL_ROLE}=prefill" in prefill_sel and f"{c.LABEL_SERVING}=true" in prefill_sel
    assert flag(args, "--policy") == "round_robin"
    # the router counts attempts (its --disable-retries is max retries 1): 5 retries, 6 attempts;
    # measured against the real router in tests/engine/test_sim_router.py
    assert flag(args, "--retry-max-retries") == "6"
    assert flag(args, "--service-discovery-namespace") == "ns"
    assert "--disable-retries" in router_args(plan_of(router={"retries": 0}))


def test_workload_selector_excludes_serving_label() -> None:
    """Regression: with `serving` in the selector, a drain would orphan the pod instead of
    taking it out of rotation."""
    owner = Owner("demo", "ns", OWNER_UID)
    plan = plan_of()
    for manifest in build_all(owner, plan):
        if manifest["kind"] == "Deployment":
            assert c.LABEL_SERVING not in manifest["spec"]["selector"]["matchLabels"]


def test_pod_metadata_reaches_every_pod_and_the_operators_keys_win() -> None:
    """Users need their own pod labels and annotations (cost allocation, mesh injection,
    log routing); a key the operator sets itself must not be overridden, and the user is
    told which were dropped."""
    plan = plan_of(
        podMetadata={
            "labels": {"team": "agents", "cas.dev/role": "decode", "app.kubernetes.io/name": "x"},
            "annotations": {"sidecar.istio.io/inject": "false", "prometheus.io/port": "1"},
        }
    )
    templates = [m["spec"]["template"] for m in build_all(Owner("demo", "ns", "u"), plan)
                 if m["kind"] == "Deployment"]  # fmt: skip
    assert len(templates) == 3  # prefill, decode, router
    for template in templates:
        meta = template["metadata"]
        assert meta["labels"]["team"] == "agents"
        assert meta["labels"]["app.kubernetes.io/name"] in (c.APP_ENGINE, c.APP_ROUTER)
        assert meta["annotations"]["sidecar.istio.io/inject"] == "false"
        assert meta["annotations"]["prometheus.io/port"] != "1"
    roles = sorted(t["metadata"]["labels"]["cas.dev/role"] for t in templates)
    assert roles == ["decode", "prefill", "router"]
    assert plan.warnings == (
        "spec.podMetadata.labels.app.kubernetes.io/name: the operator sets this key; dropped",
        "spec.podMetadata.labels.cas.dev/role: the operator sets this key; dropped",
        "spec.podMetadata.annotations.prometheus.io/port: the operator sets this key; dropped",
    )
    assert plan_of().warnings == ()


def test_router_pods_have_a_disruption_budget_of_their_revision() -> None:
    """A node drain must not take every router of a revision at once."""
    plan = plan_of(router={"replicas": 2})
    pdbs = [m for m in build_all(Owner("demo", "ns", "u"), plan)
            if m["kind"] == "PodDisruptionBudget"]  # fmt: skip
    router = [p for p in pdbs if p["metadata"]["labels"][c.LABEL_ROLE] == c.ROLE_ROUTER]
    assert len(pdbs) == 3 and len(router) == 1
    (pdb,) = router
    assert pdb["metadata"]["name"] == plan.router_name
    assert pdb["metadata"]["labels"][c.LABEL_REVISION] == plan.revision  # retired with it
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == {
        c.LABEL_NAME: "demo", c.LABEL_ROLE: c.ROLE_ROUTER, c.LABEL_REVISION: plan.revision,
    }  # fmt: skip


def test_router_pods_keep_accepting_until_their_endpoint_is_gone() -> None:
    """Regression (issue 15): a deleted router pod got SIGTERM at once and stopped accepting
    while kube-proxy and the gateway still sent it new connections. A preStop sleep holds it
    until its endpoint has left the entry Service; the grace covers the sleep and the drain."""
    plan = plan_of(router={"replicas": 2})
    manifests = build_all(Owner("demo", "ns", "u"), plan)
    (router,) = [m for m in manifests if m["metadata"]["name"] == plan.router_name
                 and m["kind"] == "Deployment"]  # fmt: skip
    pod = router["spec"]["template"]["spec"]
    sleep = pod["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert sleep >= 2
    assert pod["terminationGracePeriodSeconds"] == plan.spec.engine.drain_seconds + 30 + sleep


def test_engine_pods_wait_for_requests_in_flight_before_they_stop() -> None:
    """Regression (issue 15): a deleted engine pod got SIGTERM at once and cut its requests.
    Serving pods run cas_engine.prestop on their own port; an LWS worker waits on its leader;
    the grace period covers the wait plus SGLang's shutdown."""
    plan = plan_of(engine={"drainSeconds": 900}, decode={"tensorParallel": 16})
    workloads = [m for m in build_all(Owner("demo", "ns", "u"), plan) if m["kind"] in WORKLOADS]
    by_role = {m["metadata"]["labels"][c.LABEL_ROLE]: m for m in workloads}
    prefill = by_role[c.ROLE_PREFILL]["spec"]["template"]["spec"]
    assert prefill["terminationGracePeriodSeconds"] == 930
    hook = prefill["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert hook == ["python3", "-m", "cas_engine.prestop", "--port", str(c.ENGINE_PORT),
                    "--grace", "900"]  # fmt: skip
    lws = by_role[c.ROLE_DECODE]["spec"]["leaderWorkerTemplate"]
    leader = lws["leaderTemplate"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]
    assert leader["command"] == hook
    worker = lws["workerTemplate"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]
    assert worker["command"][:2] == ["sh", "-c"]
    assert '--host "$LWS_LEADER_ADDRESS"' in worker["command"][2]
    assert worker["command"][2].endswith("--grace 900")
    assert lws["workerTemplate"]["spec"]["terminationGracePeriodSeconds"] == 930
    default = plan_of()
    engines = [
        m["spec"]["template"]["spec"]
        for m in build_all(Owner("d", "ns", "u"), default)
        if m["kind"] == "Deployment" and m["metadata"]["labels"][c.LABEL_ROLE] != "router"
    ]
    assert [p["terminationGracePeriodSeconds"] for p in engines] == [630, 630]


def pod_specs(plan: Plan) -> dict[str, dict[str, Any]]:
    """Pod spec by workload name (an LWS: its leader's and its worker's)."""
    found: dict[str, dict[str, Any]] = {}
    for m in build_all(Owner("demo", "ns", "uid-1"), plan):
        spec = m.get("spec", {})
        if "template" in spec:
            found[m["metadata"]["name"]] = spec["template"]["spec"]
        for part in ("leaderTemplate", "workerTemplate"):
            if part in spec.get("leaderWorkerTemplate", {}):
                found[f"{m['metadata']['name']}/{part}"] = spec["leaderWorkerTemplate"][part][
                    "spec"
                ]
    return found


@pytest.mark.parametrize("sample_file", SAMPLE_FILES)
def test_every_pod_meets_the_restricted_pod_security_level(sample_file: str) -> None:
    """Regression (issue 17): engine and router pods ran as the image's user (root in the
    SGLang image) with every default capability. The API server's own Pod Security admission
    is checked in e2e/tests/test_operator_core.py."""
    _, plan = plan_sample(sample_file)
    for name, spec in pod_specs(plan).items():
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] and pod["runAsUser"] != 0, name
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for container in spec["containers"]:
            ctx = container["securityContext"]
            assert ctx == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
        engine = "router" not in name
        assert spec.get("automountServiceAccountToken", True) is not engine, (
            name
        )  # router: discovery
        if engine:
            assert {"name": "HOME", "value": "/tmp"} in spec["containers"][0]["env"]
            shm = next(v for v in spec["volumes"] if v["name"] == "shm")
            assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}


def test_rdma_opt_in_adds_only_ipc_lock_and_the_device_resource() -> None:
    plan = plan_of(engine={"rdma": {"resource": "rdma/roce", "count": 2}})
    for name, spec in pod_specs(plan).items():
        (container,) = spec["containers"]
        if "router" in name:
            assert "add" not in container["securityContext"]["capabilities"]
            continue
        assert container["securityContext"]["capabilities"] == {
            "drop": ["ALL"],
            "add": ["IPC_LOCK"],
        }
        assert container["resources"]["limits"]["rdma/roce"] == "2"
        assert container["resources"]["requests"]["rdma/roce"] == "2"
