"""Every router command line the operator renders is taken by that router's own argument parser
and validation: sglang-router 0.3.2 and smg 1.13 (`router.implementation`), on CPU.

Regression guarded: router flags were checked only against our model of the router; smg gives
`--max-concurrent-requests` a second meaning (a bound on requests in flight, measured in
docs/results/smg-1.13-evaluation.md), so the burst the operator renders for sglang-router would
have capped an smg router's in-flight requests at a few seconds of its rate, and with no limit
smg would still bound them by its host-derived default.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from cas_operator.api import constants as c
from cas_operator.api.models import parse_spec
from cas_operator.desired.admission import ROUTER_032_REFILL, admission_for
from cas_operator.desired.build import build_plan
from cas_operator.desired.resources.router import ROUTER_COMMANDS, router_args
from cas_operator.reconcile.status import admission_status
from tests.paths import load_sample

IMPLEMENTATIONS = ("sglang-router", "smg")
SAMPLES = ("minimal.yaml", "glm5-long-context.yaml", "multinode-decode.yaml")
KEY = "k" * 32  # what the kubelet puts in the container's env from the keys Secret


def rendered(spec: dict[str, Any], implementation: str) -> tuple[list[str], list[str]]:
    """(command, args) of the router container, env references resolved as a kubelet does."""
    spec = {**spec, "router": {**spec.get("router", {}), "implementation": implementation}}
    plan = build_plan("demo", "ns", parse_spec(spec))
    args = [re.sub(r"\$\([A-Z_]+\)", KEY, a) for a in router_args(plan)]
    return ROUTER_COMMANDS[plan.spec.router.implementation], args


def parsed(command: list[str], args: list[str]) -> Any:
    """The router's own parse and validation of `args`, as its launcher does before starting."""
    module = command[-1]
    if module == "smg.launch_router":
        from smg.launch_router import parse_router_args
    else:
        from sglang_router.launch_router import parse_router_args
    router = parse_router_args(args)
    if module == "smg.launch_router" and router.selected_discovery_provider():
        router.enable_igw = True  # what smg's launch_router does with discovery on
    router._validate_router_args()
    return router


GLM5: dict[str, Any] = {
    "model": {"name": "zai-org/GLM-5-FP8"},
    "prefill": {"replicas": 2},
    "decode": {"replicas": 2},
}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("sample", SAMPLES)
def test_every_sample_parses_in_the_router_it_names(sample: str, implementation: str) -> None:
    command, args = rendered(load_sample(sample)["spec"], implementation)
    router = parsed(command, args)
    assert router.pd_disaggregation and router.service_discovery
    assert router.port == c.ROUTER_PORT and router.prometheus_port == c.ROUTER_METRICS_PORT
    assert "cas.dev/serving" in router.prefill_selector
    assert router.prefill_selector["cas.dev/role"] == "prefill"
    assert router.decode_selector["cas.dev/role"] == "decode"
    assert KEY in str(router.control_plane_api_keys)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_admission_reaches_the_router_as_it_reads_it(implementation: str) -> None:
    """Each router gets what `Admission.limits` says, and status says what it got. smg: the
    rate, and as its size (its burst and its bound in flight) what the pools hold, not 5 s of
    the rate. sglang-router 0.3.2, whose bucket gets a token back when a response ends
    (tests/engine/test_router_admission_real.py): the same size and a refill of 1, the least it
    takes (regression, issue 41 item 10: it got the rate as its refill and 5 s of it as its
    size, and let in flight grow by the rate each second the fleet was saturated)."""
    plan = build_plan(
        "demo", "ns", parse_spec({**GLM5, "router": {"implementation": implementation}})
    )
    admission = admission_for(plan)
    assert admission is not None
    router = parsed(*rendered(GLM5, implementation))
    assert router.queue_size == 0  # beyond the limit: 429 at once
    assert router.max_concurrent_requests == admission.router_in_flight
    assert admission.router_in_flight > admission.router_burst
    refill = admission.router_rps if implementation == "smg" else ROUTER_032_REFILL
    assert router.rate_limit_tokens_per_second == refill
    per_router = admission_status(plan)["perRouter"]
    assert per_router["requestsPerSecond"] == router.rate_limit_tokens_per_second
    assert per_router["burst"] == router.max_concurrent_requests  # the burst it applies


def test_smg_without_a_limit_is_told_so() -> None:
    """smg's default is a bound derived from the host (about 4,096 in flight); Off means none."""
    off = {**GLM5, "router": {"admission": {"mode": "Off"}}}
    assert parsed(*rendered(off, "smg")).max_concurrent_requests == 0
    assert parsed(*rendered(off, "sglang-router")).rate_limit_tokens_per_second is None


POLICIES = {  # what each implementation's --policy takes, of the schema's values
    "sglang-router": ("cache_aware", "round_robin", "power_of_two", "random", "manual"),
    "smg": ("cache_aware", "round_robin", "power_of_two", "random", "manual",
            "consistent_hashing"),
}  # fmt: skip


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_every_policy_reaches_the_router_and_keyed_ones_read_the_session_id(
    implementation: str,
) -> None:
    """Regression (issue 40): the routers' policies that keep a coding-agent session on one
    prefill by its session id (manual; smg's consistent_hashing) could not be chosen, and the
    default, cache_aware, kept sessions on their prefill no better than random with
    sglang-router 0.3.2 in PD mode (docs/traffic.md). Unset, the policy is the
    implementation's best measured one; smg reads the session id from Claude Code's own
    header too; decodes stay round robin under a keyed policy."""
    for policy in POLICIES[implementation]:
        spec = {**GLM5, "router": {"policy": policy}}
        router = parsed(*rendered(spec, implementation))
        assert str(router.policy) == policy, (policy, router.policy)
        headers = getattr(router, "routing_key_headers", None)
        keyed = policy in ("manual", "consistent_hashing")
        if implementation == "smg" and keyed:
            assert headers == ["x-smg-routing-key", "x-claude-code-session-id"], headers
        # decodes hold no prefix: round robin, so a retry reaches another decode
        assert str(router.decode_policy) == ("round_robin" if keyed else "None"), policy
    default = parsed(*rendered(GLM5, implementation)).policy
    assert default == {"sglang-router": "manual", "smg": "consistent_hashing"}[implementation]
