"""`engine.env` may not set the engine layer's own variables (issue 41, item 11).

Regression: `engine.env: [{name: CAS_HICACHE_CHECK, value: "off"}]` was accepted, and the
launcher (flags > env > default; the operator renders no `--cas-hicache-check`) then skipped
the HiCache load-use check the engine image exists to enforce. The same held for
`CAS_KV_RECLAIM`, `CAS_ENGINE_PATCHES`, `CAS_GUARD_*`, `SGLANG_PLUGINS`... Every variable
cas_engine reads (found in its source, `tests/env_reads.py`) is refused by the operator's
validation, naming the field, and by the CRD's CEL rule (the API server's verdict:
e2e/tests/test_operator_core.py SCHEMA_REJECTIONS).
"""

from __future__ import annotations

from typing import Any

import pytest

from cas_engine.launch import plan_launch
from cas_operator.api import constants as c
from cas_operator.api.crdgen import build_crd
from cas_operator.desired.build import plan_raw
from cas_operator.desired.plan import InvalidSpec
from cas_operator.desired.resources.engine_args import engine_args
from tests.env_reads import EnvReads, package_dir, reads_under

HICACHE = {"model": {"name": "glm-5"}, "hicache": {"enabled": True}}


def engine_layer_reads() -> EnvReads:
    """What cas_engine reads or sets in an engine pod: everything but `sim/`, the CPU
    stand-in of the local stack, which never runs in a user's pod."""
    root = package_dir("cas_engine")
    assert root is not None
    return reads_under(p for p in root.rglob("*.py") if "sim" not in p.relative_to(root).parts)


def refusal(name: str) -> str:
    """The operator's error for `engine.env: [{name: ...}]`; '' when accepted."""
    spec: dict[str, Any] = {**HICACHE, "engine": {"env": [{"name": name, "value": "x"}]}}
    try:
        plan_raw("demo", "ns", spec)
    except InvalidSpec as err:
        return str(err)
    return ""


def test_the_launcher_takes_the_hicache_check_from_the_environment() -> None:
    """Why it matters: the prefill pod's command line has no --cas-hicache-check, so the
    environment decides, and `off` skips the check."""
    plan = plan_raw("demo", "ns", HICACHE)
    env = {"CAS_HICACHE_CHECK": "off", c.ENV_ENGINE_ADMIN_KEY: "k"}  # the key: the pod's Secret
    launch = plan_launch(engine_args(plan, plan.prefill), env=env)
    assert launch.hicache_enabled and launch.hicache_check == "off"


def test_engine_env_cannot_switch_off_the_hicache_check() -> None:
    assert "spec.engine.env[0].name: CAS_HICACHE_CHECK is reserved" in refusal("CAS_HICACHE_CHECK")


def test_every_variable_the_engine_layer_reads_is_reserved() -> None:
    reads = engine_layer_reads()
    assert {"CAS_HICACHE_CHECK", "CAS_KV_RECLAIM"} <= reads.names  # the scan works
    assert reads.prefixes == {c.ENGINE_LAYER_ENV_PREFIX}
    names = sorted(reads.names | {p + "ENABLED" for p in reads.prefixes})
    accepted = [name for name in names if "is reserved" not in refusal(name)]
    assert accepted == []


@pytest.mark.parametrize("name", ["CAS_DEMO_BUILD", "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"])
def test_other_variables_stay_open(name: str) -> None:
    assert refusal(name) == ""


def test_the_crd_rule_names_every_reserved_variable() -> None:
    """The CEL rule is generated from the same constants (the API server runs it in e2e)."""
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rules = schema["properties"]["spec"]["properties"]["engine"]["x-kubernetes-validations"]
    rule = next(r["rule"] for r in rules if r.get("fieldPath") == ".env")
    for name in c.RESERVED_ENGINE_ENV:
        assert f"'{name}'" in rule
    for prefix in c.RESERVED_ENGINE_ENV_PREFIXES:
        assert f"'{prefix}'" in rule
