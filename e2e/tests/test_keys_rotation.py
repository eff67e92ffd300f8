"""Rotating a fleet's keys through the OPERATOR PROCESS on the local stack: the real API server
and Secret, the real SGLang router (0.3.2) in PD mode, sims as the engine pods (their auth is
SGLang's own decision code), traffic through the entry Service throughout.

Regression (issue 41, item 3): a replaced or deleted keys Secret gave new pods new keys while
the running routers kept the old one, and the operator, which read the key from the Secret,
was refused (401) by every old router: a pod it drained stayed in their rotation. Now the
pods of a revision take an immutable copy of one version of the keys; new keys are a new
revision of routers and engines together, which takes over from the old one as any revision
does, and the operator asks each router with the key that router started with.

Here the Secret gets new keys while requests flow; while both revisions run, a decode of the
old one is drained (marked as the anomaly loop marks it): the operator takes it out of the
old router with the old key. The fleet converges on the new keys (the old revision and its
copy of the keys gone), no request fails, and the operator is never refused.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from typing import Any

import pytest
import yaml

from cas_engine.sim.fleet import router_available
from cas_operator.anomaly.drain import drain_marks
from cas_operator.api import constants as c
from e2e.fleet.anomaly_stack import wait_for
from e2e.fleet.fleetview import (
    Kubectl,
    cas_status,
    entry_url_when_serving,
    role_pods,
    router_workers,
)
from e2e.fleet.livestack import MakeLiveStack, resource_live
from e2e.paths import REPO_ROOT as ROOT
from e2e.tests.test_security_operator import keys_of, status_of
from e2e.traffic.recorded import RecordedLoad

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not router_available(), reason="sglang-router not installed"),
]


def pods_of(kubectl: Kubectl, namespace: str, role: str, name: str, revision: str) -> list[Any]:
    return [p for p in role_pods(kubectl, namespace, role, name)
            if p["metadata"]["labels"].get(c.LABEL_REVISION) == revision
            and p.get("status", {}).get("podIP")
            and not p["metadata"].get("deletionTimestamp")]  # fmt: skip


def url_of(pod: dict[str, Any], port: int) -> str:
    return f"http://{pod['status']['podIP']}:{port}"


def revisions(kubectl: Kubectl, namespace: str) -> set[str]:
    found = json.loads(kubectl("get", "deploy", "-n", namespace, "-o", "json"))["items"]
    return {d["metadata"]["labels"].get(c.LABEL_REVISION, "") for d in found}


def test_new_keys_roll_the_fleet_while_drains_and_requests_go_on(
    live_stack: MakeLiveStack, namespace: str, kubectl: Kubectl, crds: None
) -> None:
    cas: dict[str, Any] = yaml.safe_load((ROOT / "config/samples/minimal.yaml").read_text())
    # one GPU per instance: the roll runs both revisions at once on the shared nodes
    cas["spec"]["prefill"] = {"replicas": 1, "tensorParallel": 1}
    cas["spec"]["decode"] = {"replicas": 2, "tensorParallel": 1}
    cas["spec"]["router"] = {"replicas": 1}
    name = cas["metadata"]["name"]
    stack = live_stack(["--sim-speedup", "20"])
    with resource_live(stack, kubectl, cas, log=lambda s: print(f"[live] {s}")):
        entry = wait_for("the entry Service", lambda: entry_url_when_serving(
            kubectl, namespace, name), 120)  # fmt: skip
        first = cas_status(kubectl, namespace, name)
        old_rev, old_version = first["revision"], first["keysVersion"]
        old = keys_of(kubectl, namespace)
        old_router = url_of(pods_of(kubectl, namespace, "router", name, old_rev)[0], c.ROUTER_PORT)
        old_decodes = pods_of(kubectl, namespace, "decode", name, old_rev)
        wait_for("the old router to list both decodes", lambda: {
            url_of(p, c.ENGINE_PORT) for p in old_decodes} <= router_workers(
            old_router, old[c.KEY_ROUTER_CONTROL_PLANE]), 60)  # fmt: skip
        load = RecordedLoad(entry, workers=2, tokens=40, pause_s=0.3).start()
        try:
            new = {k: secrets.token_hex(32) for k in (c.KEY_ROUTER_CONTROL_PLANE,
                                                      c.KEY_ENGINE_ADMIN)}  # fmt: skip
            data = {k: base64.b64encode(v.encode()).decode() for k, v in new.items()}
            kubectl("patch", "secret", f"{name}-keys", "-n", namespace, "--type=merge",
                    "-p", json.dumps({"data": data}))  # fmt: skip
            rolled = wait_for("a revision with the new keys", lambda: (
                s := cas_status(kubectl, namespace, name)).get("keysVersion") != old_version
                and s, 90)  # fmt: skip
            new_rev = rolled["revision"]
            assert new_rev != old_rev
            # both revisions run: drain a decode of the old one as the anomaly loop does
            drained = old_decodes[0]
            marks = {"metadata": drain_marks("rotation test", time.time())}
            kubectl("patch", "pod", drained["metadata"]["name"], "-n", namespace,
                    "--type=merge", "-p", json.dumps(marks))  # fmt: skip
            gone = url_of(drained, c.ENGINE_PORT)
            wait_for("the operator to take the drained decode out of the old router", lambda:
                     gone not in router_workers(old_router, old[c.KEY_ROUTER_CONTROL_PLANE]),
                     30)  # fmt: skip
            assert old_rev in revisions(kubectl, namespace)  # it was done while both ran
            wait_for("the fleet on the new keys alone", lambda: revisions(
                kubectl, namespace) == {new_rev} and cas_status(kubectl, namespace, name).get(
                "servingRevision") == new_rev, 180)  # fmt: skip
            time.sleep(2)
        finally:
            served = load.stop()
        failed = [s for s in served if not s.ok]
        assert served and not failed, failed[:5]
        # the new keys are the ones every surface takes now, the old ones none
        new_router = url_of(pods_of(kubectl, namespace, "router", name, new_rev)[0], c.ROUTER_PORT)
        assert status_of("GET", f"{new_router}/workers", new[c.KEY_ROUTER_CONTROL_PLANE]) == 200
        assert status_of("GET", f"{new_router}/workers", old[c.KEY_ROUTER_CONTROL_PLANE]) == 401
        decode = url_of(pods_of(kubectl, namespace, "decode", name, new_rev)[0], c.ENGINE_PORT)
        assert status_of("POST", f"{decode}/flush_cache", old[c.KEY_ENGINE_ADMIN]) == 401
        assert status_of("POST", f"{decode}/flush_cache", new[c.KEY_ENGINE_ADMIN]) == 200
        # the old keys live nowhere any more: their copy went with their revision
        copies = json.loads(
            kubectl(
                "get",
                "secrets",
                "-n",
                namespace,
                "-l",
                f"{c.LABEL_APP_NAME}={c.APP_KEYS_COPY}",
                "-o",
                "json",
            )
        )
        assert {s["metadata"]["name"] for s in copies["items"]} == {
            f"{name}-keys-{rolled['keysVersion']}"}  # fmt: skip
        pods = kubectl("get", "pods", "-n", namespace, "-o", "json")
        assert all(v not in pods for v in (*old.values(), *new.values()))
        # the operator was never refused by a router (its events and its log)
        events = json.loads(kubectl("get", "events", "-n", namespace, "-o", "json"))["items"]
        refused = [e["message"] for e in events if "HTTP 401" in e.get("message", "")]
        assert refused == [], refused
        assert stack.operator is not None
        assert "HTTP 401" not in stack.operator.log_path.read_text()
