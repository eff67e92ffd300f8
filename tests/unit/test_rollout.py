"""Loop 4, canary rollouts: the analysis, the state machine and the split (all pure).

Regressions guarded: `rollout.strategy: Canary` was validated and then ignored (a new
revision rolled like Rolling); an analysis with too few requests must pause, never promote;
a failing gate must abort at any time of a step; traffic may move to a step only once the
canary's pools are Ready at that step's size; a restarted operator must resume at the step.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from cas_operator.api.constants import LABEL_REVISION
from cas_operator.api.models import AnalysisSpec, CanaryStep, RolloutSpec, parse_spec
from cas_operator.desired.build import build_plan
from cas_operator.desired.plan import InvalidSpec
from cas_operator.desired.resources.meta import Owner
from cas_operator.desired.resources.traffic import build_traffic
from cas_operator.desired.traffic import (
    MODE_GATEWAY,
    MODE_SERVICE,
    canary_pools,
    router_split,
    split_for,
)
from cas_operator.observe.types import PodSignals
from cas_operator.reconcile.core import gateway_caught_up
from cas_operator.rollout.act import analysis_window
from cas_operator.rollout.analysis import (
    MeasuredPod,
    RevisionMetrics,
    Verdict,
    analyse,
    rate_gate,
)
from cas_operator.rollout.decide import (
    PROMOTION_SETTLE_SECONDS,
    WINDOW_STEP_SECONDS,
    RolloutInputs,
    decide,
)
from cas_operator.rollout.state import Action, Phase, RolloutState

INF = math.inf
STEPS = [CanaryStep(weight=10, pause_seconds=60), CanaryStep(weight=50, pause_seconds=60)]
SPEC = RolloutSpec(strategy="Canary", steps=STEPS, analysis=AnalysisSpec(window_seconds=60))


def decode(requests: float, trips: float = 0.0, ttft: float = 0.5, **kw: float) -> PodSignals:
    """A decode pod's window: `requests` finished and judged, `trips` of them tripped, every
    TTFT at about `ttft` seconds."""
    buckets = ((ttft, requests), (INF, requests))
    return PodSignals(
        checked=requests,
        trips_low_accept=trips,
        trips_high_accept=0.0,
        requests=requests,
        ttft_buckets=buckets,
        itl_buckets=((0.02, requests * 50), (INF, requests * 50)),
        kv_failures=kw.get("kv_failures", 0.0),
    )


def router(responses: float, errors: float | None = 0.0) -> PodSignals:
    return PodSignals(responses=responses, errors_5xx=errors)


def metrics(revision: str, *pods: tuple[str, PodSignals | None]) -> RevisionMetrics:
    measured = [
        MeasuredPod(f"{revision}-{i}", role, signals) for i, (role, signals) in enumerate(pods)
    ]
    return RevisionMetrics.of(revision, measured)


def judged(canary: RevisionMetrics, stable: RevisionMetrics, **spec: float) -> Any:
    return analyse(canary, stable, AnalysisSpec(**spec), window_seconds=60, trip_floor=0.001)


STABLE = metrics("s", ("decode", decode(1000, trips=1)), ("router", router(1000)))


# ---- the analysis ----


def test_a_canary_that_trips_the_gate_fails_with_the_numbers() -> None:
    bad = metrics("c", ("decode", decode(100, trips=8)), ("router", router(100)))
    result = judged(bad, STABLE)
    assert result.verdict == Verdict.FAIL
    assert "gateTrips fail: canary 8/100 (8.00%)" in result.reason


def test_a_healthy_canary_with_enough_requests_passes() -> None:
    good = metrics("c", ("decode", decode(120)), ("router", router(120)))
    assert judged(good, STABLE).verdict == Verdict.PASS


def test_too_few_canary_requests_is_inconclusive_never_a_pass() -> None:
    thin = metrics("c", ("decode", decode(20)), ("router", router(20)))
    result = judged(thin, STABLE)
    assert result.verdict == Verdict.INCONCLUSIVE and "20 canary requests" in result.reason


def test_one_trip_over_a_clean_stable_revision_does_not_fail_the_canary() -> None:
    """The limit never falls below the anomaly guard's threshold: a stable revision with no
    trips must not make a single canary trip a failure."""
    clean = metrics("s", ("decode", decode(1000)), ("router", router(1000)))
    canary = metrics("c", ("decode", decode(500, trips=1)), ("router", router(500)))
    assert judged(canary, clean).verdict == Verdict.PASS


def test_a_slower_canary_fails_the_ttft_gate_only_with_enough_requests() -> None:
    slow = metrics("c", ("decode", decode(200, ttft=2.0)), ("router", router(200)))
    result = judged(slow, STABLE)
    assert result.verdict == Verdict.FAIL and "ttftP90" in result.reason
    thin = metrics("c", ("decode", decode(10, ttft=2.0)), ("router", router(10)))
    assert judged(thin, STABLE).verdict == Verdict.INCONCLUSIVE


def test_router_5xx_and_kv_failures_are_gates() -> None:
    erring = metrics("c", ("decode", decode(200)), ("router", router(200, errors=30)))
    assert "routerErrors" in judged(erring, STABLE).reason
    losing = metrics("c", ("decode", decode(200, kv_failures=12)), ("router", router(200)))
    assert "kvTransferFailures" in judged(losing, STABLE).reason


def test_a_router_without_a_5xx_series_has_no_errors() -> None:
    """The router exports no 5xx series until its first 5xx: that is zero, not unknown."""
    quiet = metrics("c", ("decode", decode(200)), ("router", router(200, errors=None)))
    assert quiet.errors_5xx == 0.0 and judged(quiet, STABLE).verdict == Verdict.PASS


def test_absent_kv_failure_series_read_as_zero_for_a_measured_pod() -> None:
    """SGLang's failure counters are labelled: a decode that never failed exports no series.
    Regression: that read as "not measured" and held every step inconclusive."""
    quiet = replace(decode(200), kv_failures=None)
    canary = metrics("c", ("decode", quiet), ("router", router(200)))
    assert canary.kv_failures == 0.0 and judged(canary, STABLE).verdict == Verdict.PASS


def test_a_canary_pod_without_metrics_makes_the_analysis_inconclusive() -> None:
    blind = metrics(
        "c",
        ("decode", decode(200)),
        ("decode", PodSignals(error="stale")),
        ("router", router(200)),
    )
    result = judged(blind, STABLE)
    assert result.verdict == Verdict.INCONCLUSIVE and "metrics missing for c-1" in result.reason


def test_rate_gate_without_stable_numbers_uses_the_floor() -> None:
    gate = rate_gate("g", (1, 100), (None, None), ratio=2.0, floor=0.05, min_requests=50)
    assert gate.verdict == Verdict.PASS and "(floor)" in gate.limit


# ---- the state machine ----


def stepped(state: RolloutState, now: float, **inputs: Any) -> RolloutState:
    return decide(state, SPEC, RolloutInputs(revision="r2", **inputs), now).state


def passing(requests: float = 200) -> Any:
    good = metrics("c", ("decode", decode(requests)), ("router", router(requests)))
    return judged(good, STABLE)


def test_a_new_revision_starts_a_canary_with_no_traffic() -> None:
    state = RolloutState(stable="r1").adopt("r2")
    assert (state.stable, state.canary, state.step, state.weight) == ("r1", "r2", 0, 0)
    assert state.phase == Phase.PROGRESSING
    assert RolloutState().adopt("r1") == RolloutState(stable="r1")  # the first revision


def test_traffic_moves_to_a_step_only_once_the_canary_is_ready_at_its_size() -> None:
    state = RolloutState(stable="r1").adopt("r2")
    waiting = stepped(state, 100.0, ready_step=None)
    assert waiting.weight == 0 and "waiting for the canary's pools" in waiting.reason
    moved = stepped(waiting, 105.0, ready_step=0)
    assert (moved.weight, moved.step_started) == (10, 105.0)


def test_a_step_holds_then_ends_on_a_passing_analysis() -> None:
    at = replace_state(weight=10, step_started=100.0)
    assert stepped(at, 130.0, ready_step=0, analysis=passing()).step == 0  # holding
    done = stepped(at, 161.0, ready_step=0, analysis=passing())
    assert (done.step, done.weight, done.phase) == (1, 10, Phase.PROGRESSING)


def test_no_analysis_window_reaches_back_before_the_weight_took_effect() -> None:
    """Regression: the first analysis used a whole 15 s window 8 s after the weight moved, so
    it counted the canary routers' own start: their readiness probes answer 503 until their
    engines register, and a healthy canary was aborted on routerErrors 3/32, all of them probe
    answers (the canary e2e test, once in a fresh-clone run)."""
    cas = parse_spec({"model": {"name": "m"}, "rollout": {
        "strategy": "Canary", "steps": [{"weight": 50, "pauseSeconds": 10}],
        "analysis": {"windowSeconds": 60}}})  # fmt: skip
    at = replace_state(weight=50, step_started=100.0)
    assert analysis_window(at, cas, 108.0) is None  # 8 s of traffic: not one window yet
    assert analysis_window(at, cas, 115.0) == WINDOW_STEP_SECONDS
    assert analysis_window(at, cas, 149.0) == 45.0  # whole steps since the weight
    assert analysis_window(at, cas, 400.0) == 60.0  # at most analysis.windowSeconds


def test_a_step_shorter_than_one_window_holds_until_its_first_analysis() -> None:
    """A pauseSeconds below the first window would end the step with no analysis (paused as
    inconclusive): the step holds until the first analysis comes."""
    short = RolloutSpec(strategy="Canary", steps=[CanaryStep(weight=50, pause_seconds=10)],
                        analysis=AnalysisSpec(window_seconds=60))  # fmt: skip
    at = replace_state(weight=50, step_started=100.0)
    held = decide(at, short, RolloutInputs("r2", ready_step=0), 111.0).state
    assert held.phase == Phase.PROGRESSING and held.step == 0, held.reason
    done = decide(at, short, RolloutInputs("r2", ready_step=0, analysis=passing()), 115.0).state
    assert done.step == 1, done.reason


def test_an_inconclusive_analysis_pauses_and_a_later_pass_resumes() -> None:
    at = replace_state(weight=10, step_started=100.0)
    thin = metrics("c", ("decode", decode(5)), ("router", router(5)))
    paused = stepped(at, 161.0, ready_step=0, analysis=judged(thin, STABLE))
    assert paused.phase == Phase.PAUSED and paused.step == 0 and "inconclusive" in paused.reason
    resumed = stepped(paused, 200.0, ready_step=0, analysis=passing())
    assert resumed.step == 1


def test_a_failing_analysis_aborts_at_any_time_of_the_step() -> None:
    at = replace_state(weight=10, step_started=100.0)
    bad = metrics("c", ("decode", decode(40, trips=9)), ("router", router(40)))
    result = decide(at, SPEC, RolloutInputs("r2", ready_step=0, analysis=judged(bad, STABLE)), 110)
    assert result.state.phase == Phase.ABORTED and result.state.weight == 0
    assert result.state.canary is None and result.state.aborted == "r2"
    assert result.events[-1][:2] == ("Warning", "RolloutAborted")
    assert "gateTrips" in result.events[-1][2] and "9/40" in result.events[-1][2]
    # the same spec does not start it again; a retry does
    assert (
        RolloutState.from_status({"rollout": result.state.to_status()}).adopt("r2").phase
        == Phase.ABORTED
    )
    retried = stepped(result.state, 120.0, action=Action.RETRY)
    assert (retried.canary, retried.step, retried.weight) == ("r2", 0, 0)


def test_a_fleet_wide_anomaly_pauses_and_a_canary_anomaly_aborts() -> None:
    at = replace_state(weight=10, step_started=100.0)
    paused = stepped(at, 200.0, ready_step=0, analysis=passing(), fleet_anomaly="3 of 4 pods")
    assert paused.phase == Phase.PAUSED and paused.step == 0
    growing = stepped(replace(paused, step=1), 205.0, ready_step=0, analysis=passing())
    assert growing.phase == Phase.PROGRESSING  # the incident cleared: no longer paused
    aborted = stepped(at, 200.0, ready_step=0, canary_anomaly="canary pods anomalous: x")
    assert aborted.phase == Phase.ABORTED and "canary pods anomalous" in aborted.reason


def test_a_step_paused_until_promoted_waits_for_the_user() -> None:
    spec = RolloutSpec(strategy="Canary", steps=[CanaryStep(weight=20, pause_until_promoted=True)])
    at = replace_state(weight=20, step_started=0.0)
    held = decide(at, spec, RolloutInputs("r2", ready_step=0, analysis=passing()), 9999).state
    assert held.phase == Phase.PAUSED and "until promoted" in held.reason
    promoted = decide(held, spec, RolloutInputs("r2", action=Action.PROMOTE), 10000).state
    assert promoted.phase == Phase.PROMOTING and promoted.step == 1


def test_promotion_grows_the_canary_then_all_traffic_then_makes_it_stable() -> None:
    at = replace_state(weight=50, step_started=0.0, step=2, phase=Phase.PROMOTING)
    waiting = stepped(at, 10.0, ready_step=1)
    assert waiting.weight == 50  # the canary is not Ready at full size yet
    full = stepped(waiting, 15.0, ready_step=2)
    assert full.weight == 100 and full.stable == "r1"
    done = stepped(full, 20.0, ready_step=2)
    assert (done.stable, done.canary, done.phase) == ("r2", None, Phase.STABLE)


def test_a_promotion_keeps_the_gateway_on_the_canary_service_while_stable_settles() -> None:
    """Regression: the pass that promoted moved the HTTPRoute's weight to `<name>-stable` in
    the same apply that changed its selector to the new revision and began retiring the old
    one; until its EndpointSlice (then the Gateway) followed, requests met an empty backend
    ("no available server", 49 of 981 in the canary e2e test). The weight stays on
    `<name>-canary`, which already selects the new revision, and the old revision stays, for
    PROMOTION_SETTLE_SECONDS; then both move, and the state says so in status."""
    full = replace_state(weight=100, step_started=0.0, step=2, phase=Phase.PROMOTING)
    done = stepped(full, 20.0, ready_step=2)
    assert (done.stable, done.replaced, done.promoted_at) == ("r2", "r1", 20.0)
    assert RolloutState.from_status({"rollout": done.to_status()}) == done
    assert done.adopt("r2") == done  # the reconcile's adopt keeps it too
    spec = {**CANARY, "gateway": {"parentRefs": [{"name": "gw"}]}}
    split = split_for(plan_of(spec), done, frozenset({"r1"}))
    assert split.settling and split.keep == {"r1", "r2"} and split.route_weight == 100
    services = {m["metadata"]["name"]: m for m in build_traffic(OWNER, plan_of(spec), split)}
    assert {s["spec"]["selector"][LABEL_REVISION] for n, s in services.items()
            if s["kind"] == "Service"} == {"r2"}  # fmt: skip
    (refs,) = [r["backendRefs"] for r in services["demo"]["spec"]["rules"]]
    assert [r["weight"] for r in refs] == [0, 100]
    still = stepped(done, 20.0 + PROMOTION_SETTLE_SECONDS - 1)
    assert still.replaced == "r1"
    settled = stepped(still, 20.0 + PROMOTION_SETTLE_SECONDS)
    assert settled.replaced is None and settled.stable == "r2"
    after = split_for(plan_of(spec), settled, frozenset({"r1"}))
    assert not after.settling and after.keep == {"r2"} and after.route_weight == 0


def test_skip_and_abort_actions() -> None:
    at = replace_state(weight=10, step_started=100.0)
    assert stepped(at, 101.0, action=Action.SKIP).step == 1
    aborted = stepped(at, 101.0, action=Action.ABORT)
    assert aborted.phase == Phase.ABORTED and aborted.reason == "aborted by the user"


def test_reverting_the_spec_to_the_stable_revision_ends_the_canary() -> None:
    at = replace_state(weight=10, step_started=100.0)
    result = decide(at, SPEC, RolloutInputs("r1"), 200.0)
    assert result.state == RolloutState(stable="r1") and result.events[0][1] == "CanaryEnded"


def test_the_status_round_trip_resumes_at_the_same_step() -> None:
    """A restarted operator reads the state back from status.rollout (times at 1 s)."""
    at = replace_state(weight=50, step_started=1_790_000_000.0, step=1, reason="x")
    assert RolloutState.from_status({"rollout": at.to_status()}) == at
    assert RolloutState.recorded({"servingRevision": "r0"}) == RolloutState(stable="r0")


OWNER = Owner(name="demo", namespace="ns", uid="u1")


def replace_state(**changes: Any) -> RolloutState:
    return replace(RolloutState(stable="r1").adopt("r2"), **changes)


# ---- the split ----


def plan_of(spec: dict[str, Any]) -> Any:
    return build_plan("demo", "ns", parse_spec(spec)).at_revision("r2")


CANARY: dict[str, Any] = {
    "model": {"name": "glm-5"},
    "prefill": {"replicas": 4},
    "decode": {"replicas": 8},
    "rollout": {"strategy": "Canary", "steps": [{"weight": 10}, {"weight": 50}]},
}


def test_canary_pools_follow_the_weight_at_the_plans_ratio_at_least_one_each() -> None:
    plan = plan_of(CANARY)
    assert canary_pools(plan, 10) == (1, 1)
    assert canary_pools(plan, 50) == (2, 4)
    assert canary_pools(plan, 100) == (4, 8)


@pytest.mark.parametrize(
    ("weight", "split"), [(10, (9, 1)), (50, (1, 1)), (25, (3, 1)), (90, (1, 9)), (33, (2, 1))]
)
def test_router_split_is_the_closest_ratio(weight: int, split: tuple[int, int]) -> None:
    assert router_split(weight, 1) == split


def test_router_split_keeps_the_stable_revisions_routers_when_it_can() -> None:
    """Routers are 2 by default (a node drain takes one): a 50% split must not leave the
    stable revision with a single router."""
    assert router_split(50, 2) == (2, 2) and router_split(10, 2) == (9, 1)


def test_without_a_gateway_the_entry_service_spans_both_routers_by_replicas() -> None:
    plan = plan_of(CANARY)
    state = replace_state(weight=10, step_started=1.0)
    split = split_for(plan, state, frozenset())
    assert split.mode == MODE_SERVICE and split.entry is None
    assert (split.stable_sizes.routers, split.current_sizes.routers) == (9, 1)
    assert split.serving == {"r1", "r2"}
    held = split_for(plan, state, frozenset({"r0"}))
    assert held.entry == "r1" and "r0" in held.waiting and held.serving == {"r1"}


def test_with_a_gateway_the_split_is_exact_and_the_entry_stays_stable() -> None:
    spec = {**CANARY, "gateway": {"parentRefs": [{"name": "gw"}]}}
    split = split_for(plan_of(spec), replace_state(weight=10), frozenset())
    assert (
        split.mode == MODE_GATEWAY and split.entry == "r1" and split.precision.startswith("exact")
    )


def test_a_surge_cap_shrinks_the_stable_pools_to_fit_the_canary() -> None:
    spec = {**CANARY, "rollout": {**dict(CANARY["rollout"]), "maxSurgeGpus": 16}}
    plan = plan_of(spec)
    split = split_for(plan, replace_state(step=1), frozenset())
    canary, stable = split.current_sizes, split.stable_sizes
    assert (canary.prefill, canary.decode) == (2, 4)
    assert stable is not None and stable.gpus(plan) + canary.gpus(plan) <= 96 + 16
    assert stable.prefill >= 1 and stable.decode >= 1


def test_an_aborted_canary_builds_nothing_of_its_revision() -> None:
    plan = plan_of(CANARY)
    aborted = replace_state(weight=10).abort("bad")
    split = split_for(plan, aborted, frozenset())
    assert not split.build_current and split.keep == {"r1"} and split.entry == "r1"


def test_bad_rollout_specs_are_refused_with_the_field_named() -> None:
    no_router = {**CANARY, "router": {"replicas": 0}}
    with pytest.raises(InvalidSpec, match=r"router\.replicas"):
        plan_of(no_router)
    tight = {
        **CANARY,
        "ratio": {"gpuBudget": 96},
        "rollout": {**CANARY["rollout"], "maxSurgeGpus": 0},
    }
    plan_of(tight)  # 96 + 0 holds two instances of each role (32 GPUs)
    tiny = {
        **CANARY,
        "prefill": {"replicas": 1},
        "decode": {"replicas": 1},
        "rollout": {**CANARY["rollout"], "maxSurgeGpus": 8},
    }
    with pytest.raises(InvalidSpec, match=r"rollout\.maxSurgeGpus"):
        plan_of(tiny)


def test_a_gpu_budget_alone_caps_both_revisions() -> None:
    """`ratio.gpuBudget` is a budget for the fleet, canary included: without maxSurgeGpus the
    stable pools give up what the canary takes (never more than the budget in total)."""
    plan = plan_of({**CANARY, "ratio": {"gpuBudget": 96}})
    split = split_for(plan, replace_state(step=1), frozenset())
    assert split.stable_sizes is not None
    total = split.stable_sizes.gpus(plan) + split.current_sizes.gpus(plan)
    assert total <= 96 and (split.current_sizes.prefill, split.current_sizes.decode) == (2, 4)
    assert split.stable_sizes.prefill >= 1 and split.stable_sizes.decode >= 1


class RecordingApi:
    def __init__(self) -> None:
        self.patches: list[tuple[str, str, Any]] = []

    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[Any]:
        return []

    def patch(self, kind: str, namespace: str, name: str, patch: Any) -> Any:
        self.patches.append((kind, name, patch))
        return {}


def test_an_action_is_consumed_once_and_refused_on_a_rolling_fleet() -> None:
    """A user's action annotation is removed after the tick that read it (a consumed action
    must not act again); on a fleet that is not Canary it is removed with a Warning, not left
    behind forever."""
    from cas_operator.observe.types import Observation
    from cas_operator.rollout.act import Findings, rollout_tick

    class NoMetrics:
        def observe(self, targets: Any, window: float) -> Observation:
            return Observation()

    annotated = {
        "name": "demo",
        "namespace": "ns",
        "annotations": {"cas.dev/rollout-action": "abort"},
    }
    status = {"revision": "r2", "rollout": {"phase": "Progressing", "stableRevision": "r1",
                                            "canaryRevision": "r2"}}  # fmt: skip
    steps = {"strategy": "Canary", "steps": [{"weight": 10}]}
    canary = parse_spec({"model": {"name": "glm-5"}, "rollout": steps})
    api = RecordingApi()
    result = rollout_tick(api, NoMetrics(), {"metadata": annotated, "status": status}, canary,
                          None, Findings(), 100.0)  # fmt: skip
    assert result.state is not None and result.state.phase == Phase.ABORTED
    removed = {"metadata": {"annotations": {"cas.dev/rollout-action": None}}}
    assert api.patches == [("CodingAgentServing", "demo", removed)]
    rolling = parse_spec({"model": {"name": "glm-5"}})
    api = RecordingApi()
    refused = rollout_tick(api, NoMetrics(), {"metadata": annotated, "status": status}, rolling,
                           None, Findings(), 100.0)  # fmt: skip
    assert refused.state is None and refused.events[0][1] == "RolloutActionRefused"
    assert len(api.patches) == 1


# ---- a fleet without speculative decoding (issue 41, item 9) ----


def unguarded(requests: float) -> PodSignals:
    """A decode pod of a fleet without speculative decoding: its engine's quality gate judges
    nothing and exports no series (`checked` and trips None), everything else is measured."""
    return replace(decode(requests), checked=None, trips_low_accept=None, trips_high_accept=None)


def test_without_speculative_decoding_the_gate_trip_gates_do_not_apply() -> None:
    """Regression (issue 41, item 9): without speculative decoding the engines export no
    quality-gate series, so `gateTrips` (and `anomalyRate`) stayed Inconclusive and every
    canary step of such a fleet (the minimal sample) paused forever. A gate that cannot apply
    is NotApplicable, and the status says why; with the gate running, missing series stay
    inconclusive (metrics missing must never pass)."""
    stable = metrics("s", ("decode", unguarded(1000)), ("router", router(1000)))
    canary = metrics("c", ("decode", unguarded(120)), ("router", router(120)))
    spec = AnalysisSpec(max_anomaly_rate=0.01)
    result = analyse(canary, stable, spec, window_seconds=60, trip_floor=0.001, quality_gate=False)
    assert result.verdict == Verdict.PASS, result.reason
    moot = {g.name: g.to_status() for g in result.gates if g.verdict == Verdict.NOT_APPLICABLE}
    assert set(moot) == {"gateTrips", "anomalyRate"}, result.gates
    assert moot["gateTrips"]["verdict"] == "NotApplicable"
    assert "no speculative decoding" in moot["gateTrips"]["limit"]
    assert "gateTrips, anomalyRate not applicable" in result.reason
    guarded = analyse(canary, stable, spec, window_seconds=60, trip_floor=0.001)
    assert guarded.verdict == Verdict.INCONCLUSIVE and "gateTrips" in guarded.reason


class FleetPods:
    """Both revisions' decode and router pods, as `rollout.act.measure` lists them."""

    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[Any]:
        return [
            {"metadata": {"name": f"{rev}-{role}", "namespace": "ns",
                          "labels": {"cas.dev/role": role, "cas.dev/revision": rev}}}
            for rev in ("r1", "r2") for role in ("decode", "router")
        ]  # fmt: skip

    def patch(self, kind: str, namespace: str, name: str, patch: Any) -> Any:
        return {}


def test_a_canary_step_of_a_fleet_without_speculative_decoding_passes_its_analysis() -> None:
    """Regression (issue 41, item 9), through the act step: a step of the minimal sample's
    canary, held past its window with enough requests, ends on its analysis (it paused
    forever: the gate-trip gate never had a verdict); the same fleet with speculative
    decoding, whose decodes export no gate series, still pauses."""
    from cas_operator.observe.types import Observation
    from cas_operator.rollout.act import Findings, rollout_tick

    class Window:
        def observe(self, targets: Any, window: float) -> Observation:
            signals = {"decode": unguarded(200), "router": router(200)}
            return Observation({t.name: signals[t.role] for t in targets})

    steps = {"strategy": "Canary", "steps": [{"weight": 50, "pauseSeconds": 10}, {"weight": 80}],
             "analysis": {"windowSeconds": 15, "minRequests": 10}}  # fmt: skip
    at_step = replace_state(weight=50, step_started=1000.0)
    status = {"revision": "r2", "rollout": at_step.to_status()}
    resource = {"metadata": {"name": "demo", "namespace": "ns"}, "status": status}
    minimal = parse_spec({"model": {"name": "glm-5"}, "rollout": steps})
    result = rollout_tick(FleetPods(), Window(), resource, minimal, None, Findings(), 1060.0)
    assert result.state is not None and (result.state.step, result.state.phase) == (
        1, Phase.PROGRESSING), result.state.reason  # fmt: skip
    gates = {g["name"]: g["verdict"] for g in (result.state.analysis or {})["gates"]}
    assert gates["gateTrips"] == "NotApplicable", gates
    nextn = {"algorithm": "NEXTN", "numSteps": 3, "eagleTopk": 1, "numDraftTokens": 4}
    speculative = parse_spec({"model": {"name": "glm-5"}, "rollout": steps,
                              "engine": {"speculative": nextn}})  # fmt: skip
    held = rollout_tick(FleetPods(), Window(), resource, speculative, None, Findings(), 1060.0)
    assert held.state is not None and held.state.phase == Phase.PAUSED, held.state


class _Routes:
    """A Kube seam holding one HTTPRoute (only `get` is used)."""

    def __init__(self, route: dict[str, Any] | None) -> None:
        self.route = route

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        assert (kind, name) == ("HTTPRoute", "demo")
        return self.route


def test_old_routers_wait_until_the_gateway_reports_the_routes_generation() -> None:
    """Regression: a retiring revision's routers were deleted 15 s after the weights left
    them, while Traefik (under the parallel suite) still sent them requests, which their
    shutdown answered 502. They go once every parent reports the route's generation."""
    plan = plan_of({**CANARY, "gateway": {"parentRefs": [{"name": "gw"}]}})

    def route(*observed: int) -> dict[str, Any]:
        parents = [{"conditions": [{"type": "Accepted", "observedGeneration": g}]}
                   for g in observed]  # fmt: skip
        return {"metadata": {"generation": 4}, "status": {"parents": parents}}

    assert not gateway_caught_up(_Routes(route(3)), plan)  # type: ignore[arg-type]
    assert not gateway_caught_up(_Routes(route(4, 3)), plan)  # type: ignore[arg-type]
    assert not gateway_caught_up(_Routes(route()), plan)  # type: ignore[arg-type]
    assert gateway_caught_up(_Routes(route(4)), plan)  # type: ignore[arg-type]
    assert gateway_caught_up(_Routes(route(4, 5)), plan)  # type: ignore[arg-type]
    assert gateway_caught_up(_Routes(None), plan)  # type: ignore[arg-type]
    assert gateway_caught_up(_Routes(route(0)), plan_of(CANARY))  # type: ignore[arg-type]
