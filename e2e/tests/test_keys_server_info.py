"""No client of a fleet reads its engine admin key, through the OPERATOR PROCESS, the real smg
1.13 router (`router.implementation: smg`) and sims on the local stack.

Regression (issue 41, item 1): the operator put the admin key on every engine's command line
(`--admin-api-key=$(CAS_ENGINE_ADMIN_KEY)`). SGLang 0.5.23 answers `/server_info` and
`/get_server_info` without a key, with `admin_api_key` and `launch_command` in them, and smg
forwards `GET /get_server_info` to a worker: any client of the entry Service read the key that
unlocks the engines' weight updates, LoRA loads and aborts. The sims answer those paths as SGLang
does (the same fields), through the engine layer's redaction (`cas_engine.adminkey.redact`,
which the launcher installs into SGLang: tests/engine/test_admin_key_sglang_real.py).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest
import yaml

from cas_engine.sim.fleet import router_available
from cas_operator.api import constants as c
from e2e.fleet.anomaly_stack import wait_for
from e2e.fleet.fleetview import Kubectl, entry_url_when_serving, role_pods
from e2e.fleet.livestack import MakeLiveStack, resource_live
from e2e.paths import REPO_ROOT as ROOT
from e2e.tests.test_security_operator import keys_of

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not router_available(), reason="sglang-router not installed"),
]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def test_no_client_of_the_entry_service_reads_the_engine_admin_key(
    live_stack: MakeLiveStack, namespace: str, kubectl: Kubectl, crds: None
) -> None:
    cas: dict[str, Any] = yaml.safe_load((ROOT / "config/samples/minimal.yaml").read_text())
    cas["spec"]["router"] = {"implementation": "smg"}
    name = cas["metadata"]["name"]
    stack = live_stack(["--sim-speedup", "20"])
    with resource_live(stack, kubectl, cas, log=lambda s: print(f"[live] {s}")):
        entry = wait_for("the entry Service", lambda: entry_url_when_serving(
            kubectl, namespace, name), 120)  # fmt: skip
        admin = keys_of(kubectl, namespace)[c.KEY_ENGINE_ADMIN]
        # smg forwards this one to a worker: the client gets an engine's server info...
        status, text = get(f"{entry}/get_server_info")
        assert status == 200, text
        info = json.loads(text)
        assert info["admin_api_key"] == "<redacted>", info  # ...with SGLang's key field
        assert admin not in text and admin not in info["launch_command"]
        # the engines themselves, on both paths
        for role in ("prefill", "decode"):
            pod = next(p for p in role_pods(kubectl, namespace, role, name)
                       if p.get("status", {}).get("podIP"))  # fmt: skip
            for path in ("/get_server_info", "/server_info"):
                status, text = get(f"http://{pod['status']['podIP']}:{c.ENGINE_PORT}{path}")
                assert status == 200 and admin not in text, (role, path, text[:300])
                assert json.loads(text)["internal_states"][0]["admin_api_key"] == "<redacted>"
        # no engine's arguments carry the key or its flag: it comes in the environment
        pods = json.loads(kubectl("get", "pods", "-n", namespace, "-o", "json"))["items"]
        args = [a for p in pods for ctr in p["spec"]["containers"] for a in ctr.get("args", [])]
        assert not [a for a in args if a.startswith("--admin-api-key")], args
        assert "--cas-admin-key-env" in args
