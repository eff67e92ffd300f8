"""A router pod turns Ready only once it can route: through the OPERATOR PROCESS, the real
routers (sglang-router 0.3.2 and smg 1.13) and sims on the local stack, where the pod runner
plays the kubelet's readiness prober (it GETs each pod's readinessProbe and writes Ready).

Regression (issue 41, item 7): the router's readinessProbe read `/health`, which both routers
answer 200 as soon as they listen, before their Kubernetes discovery has any worker (their
`/readiness` is 503 until a healthy prefill and decode exist). Every router roll (each change of
the admission limit rolls them), scale-up and drained node's replacement joined the entry
Service early and answered its first requests 503. Here a router is added by a replica change
and requests go to it the moment the API server says it is Ready (a watch, not a poll): every
one succeeds. Probed on `/health`, smg's case fails (6 x 404: with discovery smg answers
`model_not_found` until a worker of the model is registered); 0.3.2's passed here too (its
discovery had the workers by the time the pod runner, a pass after its first answer, wrote
Ready; a kubelet probes at once), so for it the test guards that `/readiness` lets a router
with workers turn Ready at all.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
import yaml

from cas_engine.sim.fleet import router_available
from cas_operator.api import constants as c
from e2e.cluster.stack import ClusterHandle
from e2e.fleet.anomaly_stack import wait_for
from e2e.fleet.fleetview import Kubectl, entry_url_when_serving, role_pods
from e2e.fleet.livestack import MakeLiveStack, resource_live
from e2e.paths import REPO_ROOT as ROOT

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not router_available(), reason="sglang-router not installed"),
]
REQUESTS = 6  # sent one after the other from the moment the new router is Ready


def chat(router: str, model: str) -> int:
    """One short chat request through `router`: its HTTP status (0: no connection)."""
    body = {"model": model, "messages": [{"role": "user", "content": "rename the variable"}],
            "max_tokens": 8}  # fmt: skip
    req = urllib.request.Request(f"{router}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def is_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(x.get("type") == "Ready" and x.get("status") == "True" for x in conditions)


def first_ready_router(
    cluster: ClusterHandle, namespace: str, name: str, known: set[str], ready: threading.Event
) -> dict[str, Any]:
    """Watch the resource's router pods until one not in `known` turns Ready; return it (the
    watch starts before `ready` is set, so no transition is missed)."""
    from kubernetes import client, config, watch

    api = client.CoreV1Api(config.new_client_from_config(config_file=str(cluster.kubeconfig)))  # type: ignore[no-untyped-call]
    selector = f"{c.LABEL_NAME}={name},{c.LABEL_ROLE}={c.ROLE_ROUTER}"
    stream = watch.Watch()  # type: ignore[no-untyped-call]
    ready.set()
    try:
        for event in stream.stream(api.list_namespaced_pod, namespace, label_selector=selector,
                                   timeout_seconds=150):  # fmt: skip
            pod = api.api_client.sanitize_for_serialization(event["object"])
            if pod["metadata"]["name"] not in known and is_ready(pod):
                return dict(pod)
    finally:
        stream.stop()  # type: ignore[no-untyped-call]
    raise AssertionError("no new router pod turned Ready within 150 s")


@pytest.mark.parametrize("implementation", ["sglang-router", "smg"])
def test_a_request_sent_the_moment_a_new_router_is_ready_succeeds(
    live_stack: MakeLiveStack,
    namespace: str,
    kubectl: Kubectl,
    crds: None,
    cluster: ClusterHandle,
    implementation: str,
) -> None:
    cas: dict[str, Any] = yaml.safe_load((ROOT / "config/samples/minimal.yaml").read_text())
    cas["spec"]["router"] = {"implementation": implementation, "replicas": 1}
    name, model = cas["metadata"]["name"], cas["spec"]["model"]["name"]
    stack = live_stack(["--sim-speedup", "20"])
    with resource_live(stack, kubectl, cas, log=lambda s: print(f"[live] {s}")):
        wait_for("the entry Service", lambda: entry_url_when_serving(kubectl, namespace, name),
                 120)  # fmt: skip
        known = {p["metadata"]["name"] for p in role_pods(kubectl, namespace, c.ROLE_ROUTER, name)}
        watching = threading.Event()
        found: list[dict[str, Any]] = []

        def watch() -> None:
            found.append(first_ready_router(cluster, namespace, name, known, watching))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        assert watching.wait(30)
        time.sleep(0.5)  # the watch has connected: its list answers before any change
        patch = {"spec": {"router": {"replicas": 2}}}
        kubectl("patch", "cas", name, "-n", namespace, "--type=merge", "-p", json.dumps(patch))
        watcher.join(160)
        assert found, "no new router turned Ready"
        router = f"http://{found[0]['status']['podIP']}:{c.ROUTER_PORT}"
        answers = [chat(router, model) for _ in range(REQUESTS)]
        probe = found[0]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"]
    assert answers == [200] * REQUESTS, (answers, probe)
