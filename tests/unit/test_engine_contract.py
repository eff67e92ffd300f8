"""Contract between the operator's pod arguments and the engine launcher that parses them."""

from __future__ import annotations

from typing import Any

import pytest

from cas_engine.launch import plan_launch
from cas_operator.api.models import parse_spec
from cas_operator.desired.build import build_plan
from cas_operator.desired.resources.engine_args import engine_args
from tests.paths import load_sample


@pytest.mark.parametrize("sample", ["minimal.yaml", "glm5-long-context.yaml"])
def test_launcher_accepts_the_operators_arguments(sample: str) -> None:
    """Regression: a renamed `--cas-*` flag on either side makes every engine pod exit 2."""
    raw: dict[str, Any] = load_sample(sample)
    plan = build_plan("x", "ns", parse_spec(raw["spec"]))
    guard = plan.spec.anomaly_guard
    for pool in plan.pools:
        # the kubelet sets the admin key's variable from the keys Secret (engine_env)
        launch = plan_launch(engine_args(plan, pool), env={"CAS_ENGINE_ADMIN_KEY": "k"})
        assert launch.admin_key == "k"  # taken from the variable the pod names
        assert launch.kv_reclaim == "strict"
        assert not any(arg.startswith("--cas-") for arg in launch.sglang_argv)
        assert "--disaggregation-mode" in launch.sglang_argv
        if pool.role == "decode" and plan.spec.engine.speculative is not None:
            assert launch.guard.enabled
            assert launch.guard.min_generated_tokens == guard.min_generated_tokens
            assert launch.guard.min_accept_length == guard.min_accept_length
            assert launch.guard.max_accept_rate == guard.max_accept_rate


def test_guard_disabled_without_speculative_decoding() -> None:
    plan = build_plan("x", "ns", parse_spec({"model": {"name": "glm-5"}}))
    launch = plan_launch(engine_args(plan, plan.decode), env={"CAS_ENGINE_ADMIN_KEY": "k"})
    assert launch.guard.enabled is False
