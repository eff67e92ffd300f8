"""The revision: a hash of what the engines run, and held across an operator upgrade.

Regression guarded: adding one optional field to the spec (`engine.kvQuarantineRooms`) changed
every fleet's revision, so an operator upgrade rolled every fleet at once (issue 15).
"""

from __future__ import annotations

from typing import Any

import pytest

from cas_operator.api import constants as c
from cas_operator.api.models import OperatorUpgradePolicy, parse_spec
from cas_operator.desired.build import build_plan
from cas_operator.desired.resources import pools
from cas_operator.desired.revision import RevisionRecord, choose, engine_input, engine_revision
from tests.fakes import MemoryKube
from tests.unit.test_reconcile import run

SPECULATIVE = {"speculative": {"algorithm": "EAGLE", "draftModelPath": "/models/draft"}}


def revision(keys: str = "", **overrides: Any) -> str:
    """The revision of a spec whose pods take version `keys` of the keys ("": the Secret)."""
    raw: dict[str, Any] = {"model": {"name": "zai-org/GLM-5-FP8"}, **overrides}
    return build_plan("demo", "ns", parse_spec(raw), keys_version=keys).revision


def test_revision_changes_with_what_either_role_runs_and_nothing_else() -> None:
    """A decode-only engine change rolls prefill too (they exchange KV); scaling, the router
    and operator-side fields never restart engines; a gate setting counts only where the
    engines use it (with speculative decoding)."""
    base = revision()
    assert revision() == base
    assert revision(decode={"tensorParallel": 4}) != base
    assert revision(prefill={"timeoutSeconds": 30}) != base
    assert revision(engine={"image": "other:1"}) != base
    assert revision(prefill={"replicas": 7}, decode={"replicas": 9}) == base
    assert revision(router={"replicas": 3}) == base
    assert revision(anomalyGuard={"maxDrainingPercent": 50}) == base
    assert revision(rollout={"onOperatorUpgrade": "Roll"}) == base
    assert revision(podMetadata={"labels": {"team": "a"}}) != base  # pods restart: a new one
    assert revision(podMetadata={"labels": {"cas.dev/x": "a"}}) == base  # dropped: unused
    assert revision(anomalyGuard={"minAcceptLength": 1.2}) == base  # no speculative: unused
    with_spec = revision(engine=SPECULATIVE)
    assert with_spec != base
    assert revision(engine=SPECULATIVE, anomalyGuard={"minAcceptLength": 1.2}) != with_spec


def test_revision_is_the_rendered_pods_not_the_plans_own_name() -> None:
    plan = build_plan("demo", "ns", parse_spec({"model": {"name": "glm-5"}}))
    assert engine_revision(plan.at_revision("other")) == plan.revision
    assert plan.prefill.workload_name == f"demo-prefill-{plan.revision}"
    assert plan.at_revision("abc").decode.workload_name == "demo-decode-abc"


def test_engine_input_ignores_defaults_written_out_and_fields_an_operator_adds() -> None:
    """The user's engine settings are the same whether a default is written or left out, and
    a field a new operator version adds (here: one the user never set) does not enter."""
    bare = parse_spec({"model": {"name": "glm-5"}})
    spelled = parse_spec({"model": {"name": "glm-5"}, "engine": {"kvQuarantineRooms": 64}})
    assert engine_input(bare) == engine_input(spelled)
    changed = parse_spec({"model": {"name": "glm-5"}, "engine": {"kvQuarantineRooms": 8}})
    assert engine_input(changed) != engine_input(bare)
    scaled = parse_spec({"model": {"name": "glm-5"}, "decode": {"replicas": 9}})
    assert engine_input(scaled) == engine_input(bare)
    empty = parse_spec({"model": {"name": "glm-5"}, "podMetadata": {}})  # a section added later
    assert engine_input(empty) == engine_input(bare)


HOLD, ROLL = OperatorUpgradePolicy.HOLD, OperatorUpgradePolicy.ROLL


@pytest.mark.parametrize(
    ("record", "user_input", "generation", "policy", "runs"),
    [
        (None, "in1", 1, HOLD, "new"),  # first pass
        (RevisionRecord("new", "in1", 1), "in1", 1, HOLD, "new"),  # nothing changed
        (RevisionRecord("old", "in1", 1), "in1", 1, HOLD, "old"),  # operator upgrade: held
        (RevisionRecord("old", "in1", 1), "in1", 2, HOLD, "old"),  # scaled meanwhile: held
        (RevisionRecord("old", "in1", 1), "in2", 2, HOLD, "new"),  # the user changed engines
        (RevisionRecord("old", "in1", 1), "in1", 1, ROLL, "new"),  # the user opted in
        (RevisionRecord("old", "", 4), "in1", 4, HOLD, "old"),  # pre-engineInput status
        (RevisionRecord("old", "", 4), "in1", 5, HOLD, "new"),  # ... and the spec changed
    ],
)
def test_choose_holds_only_while_the_users_engine_settings_are_unchanged(
    record: RevisionRecord | None, user_input: str, generation: int, policy: Any, runs: str
) -> None:
    got = choose(
        record, rendered="new", engine_input=user_input, generation=generation, policy=policy
    )
    assert got == runs


def test_record_reads_the_status_the_pass_writes() -> None:
    assert RevisionRecord.from_status({}) is None
    assert RevisionRecord.from_status({"conditions": []}) is None
    record = RevisionRecord.from_status(
        {"revision": "r1", "observedGeneration": 3, "heldRevision": {"revision": "r2"}}
    )
    assert record == RevisionRecord("r1", "", 3, "r2")


# -- the act half: an operator upgrade against the fake API ------------------------------------

SPEC: dict[str, Any] = {"model": {"name": "glm-5"}}


def _pass(kube: MemoryKube, spec: dict[str, Any], generation: int, status: dict[str, Any]) -> Any:
    return run(kube, spec, generation=generation, previous=status)


def _workloads(kube: MemoryKube) -> dict[str, Any]:
    return {n: o for (k, n), o in kube.objects.items() if k == "Deployment"}


def test_an_operator_upgrade_leaves_running_engines_alone_until_the_user_opts_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An older operator rendered one env var more; the new one holds its revision (no
    template applied, even in a full pass), scales it, says so once, and rolls on `Roll`."""
    real_env = pools.engine_env
    kube = MemoryKube()
    monkeypatch.setattr(pools, "engine_env", lambda plan: [*real_env(plan), {"name": "OLD"}])
    old = _pass(kube, SPEC, 1, {})
    old_rev = old.status["revision"]
    monkeypatch.setattr(pools, "engine_env", real_env)
    before = {n: o["spec"]["template"] for n, o in _workloads(kube).items()}
    kube.applies.clear()

    held = _pass(kube, SPEC, 1, old.status)
    assert held.status["revision"] == old_rev
    keys = held.status["keysVersion"]
    assert held.status["heldRevision"]["revision"] == revision(keys, model={"name": "glm-5"})
    assert [e[1] for e in held.events] == [c.REASON_OPERATOR_UPGRADE_HELD]
    assert not [a for a in kube.applies if a[0] == "Deployment"], kube.applies
    assert {n: o["spec"]["template"] for n, o in _workloads(kube).items()} == before
    assert _pass(kube, SPEC, 1, held.status).events == []  # said once

    scaled = {**SPEC, "decode": {"replicas": 5}}
    again = _pass(kube, scaled, 2, held.status)
    assert again.status["revision"] == old_rev
    assert _workloads(kube)[f"demo-decode-{old_rev}"]["spec"]["replicas"] == 5
    assert ("Deployment", f"demo-decode-{old_rev}") in kube.patches
    assert {n: o["spec"]["template"] for n, o in _workloads(kube).items()} == before

    opted = {**scaled, "rollout": {"onOperatorUpgrade": "Roll"}}
    rolled = _pass(kube, opted, 3, again.status)
    new_rev = rolled.status["revision"]
    assert new_rev != old_rev and rolled.status["heldRevision"] is None
    assert f"demo-decode-{new_rev}" in _workloads(kube)


def test_an_engine_change_after_an_upgrade_rolls_to_the_new_rendering(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_env = pools.engine_env
    kube = MemoryKube()
    monkeypatch.setattr(pools, "engine_env", lambda plan: [*real_env(plan), {"name": "OLD"}])
    old = _pass(kube, SPEC, 1, {})
    monkeypatch.setattr(pools, "engine_env", real_env)
    held = _pass(kube, SPEC, 1, old.status)
    assert held.status["revision"] == old.status["revision"]
    changed = {**SPEC, "engine": {"image": "cas-engine:next"}}
    rolled = _pass(kube, changed, 2, held.status)
    keys = held.status["keysVersion"]
    want = revision(keys, model={"name": "glm-5"}, engine=changed["engine"])
    assert rolled.status["revision"] == want
    assert rolled.status["heldRevision"] is None


def test_dropped_pod_metadata_is_in_status_and_said_once() -> None:
    kube = MemoryKube()
    spec = {**SPEC, "podMetadata": {"labels": {"cas.dev/serving": "true"}}}
    first = _pass(kube, spec, 1, {})
    assert first.status["warnings"] == [
        "spec.podMetadata.labels.cas.dev/serving: the operator sets this key; dropped"
    ]
    assert [e[1] for e in first.events] == [c.REASON_SPEC_WARNING]
    assert _pass(kube, spec, 1, first.status).events == []
    assert _pass(kube, SPEC, 2, first.status).status["warnings"] is None
