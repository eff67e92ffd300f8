"""The operator's own bounds (api.limits): a GPU cap per resource set by the installer.

Regression guarded (issue 15): nothing but a resource's own (optional) gpuBudget bounded how
many GPUs one resource could take; a platform team had no cap of its own.
"""

from __future__ import annotations

from typing import Any

import pytest

from cas_operator.api import constants as c
from cas_operator.api.limits import MAX_GPUS_ENV, OperatorLimits
from cas_operator.api.models import parse_spec
from cas_operator.desired.build import build_plan
from cas_operator.desired.plan import InvalidSpec
from cas_operator.reconcile.status import find_condition
from tests.fakes import MemoryKube
from tests.unit.test_reconcile import run

CAP16 = OperatorLimits(max_gpus_per_resource=16)


def plan(limits: OperatorLimits, **spec: Any) -> Any:
    return build_plan("x", "ns", parse_spec({"model": {"name": "glm-5"}, **spec}), limits=limits)


def test_limits_come_from_the_environment_and_refuse_nonsense() -> None:
    assert OperatorLimits.from_env({}) == OperatorLimits()
    assert OperatorLimits.from_env({MAX_GPUS_ENV: " 64 "}).max_gpus_per_resource == 64
    for bad in ("0", "-3", "lots", "1.5"):
        with pytest.raises(ValueError, match=MAX_GPUS_ENV):
            OperatorLimits.from_env({MAX_GPUS_ENV: bad})


def test_a_fixed_fleet_over_the_cap_is_refused_naming_what_sets_its_replicas() -> None:
    assert plan(CAP16).prefill.gpus + plan(CAP16).decode.gpus == 16  # 1:1 at TP8 fits
    with pytest.raises(InvalidSpec, match=r"spec\.decode\.replicas: 2:2 needs 32 GPUs, above"):
        plan(CAP16, decode={"replicas": 2})
    with pytest.raises(InvalidSpec, match=r"spec\.ratio\.decode: 1:2 needs 24 GPUs"):
        plan(CAP16, ratio={"prefill": 1, "decode": 2})
    assert plan(OperatorLimits(), decode={"replicas": 2}).decode.replicas == 2  # no cap


def test_auto_needs_a_budget_within_the_cap() -> None:
    """Auto grows up to gpuBudget, so that is what must fit."""
    with pytest.raises(InvalidSpec, match=r"spec\.ratio\.gpuBudget: 64 is above this operator"):
        plan(CAP16, ratio={"mode": "Auto", "gpuBudget": 64})
    assert plan(CAP16, ratio={"mode": "Auto", "gpuBudget": 16}).revision


def test_the_pass_reports_the_cap_and_applies_nothing() -> None:
    kube = MemoryKube()
    outcome = run(kube, {"model": {"name": "glm-5"}, "decode": {"replicas": 3}}, limits=CAP16)
    degraded = find_condition(outcome.status, c.COND_DEGRADED)
    assert degraded["reason"] == c.REASON_INVALID_SPEC and "cap of 16" in degraded["message"]
    assert kube.applies == []


def test_the_metrics_scraper_namespaces_come_from_the_environment() -> None:
    """Issue 41, item 2: where the fleets' NetworkPolicies admit Prometheus from is the
    installer's setting (`--metrics-scraper-namespace`, the chart's metricsScraperNamespaces);
    a value that is not a namespace name is refused at start, never read as "every"."""
    from cas_operator.api.limits import SCRAPER_NAMESPACES_ENV

    assert OperatorLimits.from_env({}).scraper_namespaces == ()
    found = OperatorLimits.from_env({SCRAPER_NAMESPACES_ENV: " monitoring, obs,monitoring,"})
    assert found.scraper_namespaces == ("monitoring", "obs")
    for bad in ("*", "Monitoring", "a b", "-x"):
        with pytest.raises(ValueError, match=SCRAPER_NAMESPACES_ENV):
            OperatorLimits.from_env({SCRAPER_NAMESPACES_ENV: bad})
