"""Ownership of children (`reconcile.ownership`): the operator never writes or deletes an
object under a child's name that its resource does not control (issue 41, item 5). The real
API server's answers (the uid precondition, garbage collection) are in
e2e/tests/test_child_ownership.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from cas_operator.api import constants as c
from cas_operator.kube import Kube, NotTheSameObject
from cas_operator.reconcile import ownership
from cas_operator.reconcile.core import reconcile
from cas_operator.reconcile.status import ObservedWorkload, find_condition
from tests.fakes import MemoryKube

OWNER = "owner-uid"
SPEC = {"model": {"name": "glm-5"}}


def run(kube: MemoryKube, spec: dict[str, Any] = SPEC, **extra: Any) -> Any:
    """One full pass of resource ns/demo (uid OWNER)."""
    extra.setdefault("full_apply", True)
    return reconcile(
        kube,  # type: ignore[arg-type]
        name="demo", namespace="ns", uid=OWNER, generation=1, raw_spec=spec, **extra,
    )  # fmt: skip


def users_service(name: str = "demo", **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "ns", "uid": "users-uid", **meta},
        "spec": {"selector": {"app": "users-own"}, "ports": [{"port": 5432}]},
    }


def test_an_object_in_the_way_is_left_unchanged_and_named_in_degraded() -> None:
    """Regression (issue 41): server-side apply with force overwrote a user's Service `demo`
    with the entry Service of the resource `demo`, and its owner reference then let the
    garbage collector delete the user's Service with the resource."""
    kube = MemoryKube()
    kube.objects[("Service", "demo")] = users_service()
    outcome = run(kube)
    assert kube.objects[("Service", "demo")] == users_service()  # not one field changed
    assert ("Service", "demo") not in kube.applies
    degraded = find_condition(outcome.status, c.COND_DEGRADED)
    assert degraded["status"] == "True" and degraded["reason"] == c.REASON_NOT_OWNED, degraded
    assert "Service demo exists and is not this resource's" in degraded["message"], degraded
    assert "no controller owner reference" in degraded["message"], degraded
    assert outcome.failed >= 1  # the spec handler tries again (the object may be removed)
    assert ("Deployment", "demo-router-" + outcome.status["revision"]) in kube.applies


def test_an_object_another_controller_owns_is_left_unchanged() -> None:
    """An object controlled by someone else (another resource of the same name made it, a
    Deployment's ReplicaSet, ...) is not this resource's either, and its controller is named."""
    kube = MemoryKube()
    other = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "web", "uid": "u2",
             "controller": True}  # fmt: skip
    kube.objects[("Service", "demo")] = users_service(ownerReferences=[other])
    outcome = run(kube)
    assert ("Service", "demo") not in kube.applies
    degraded = find_condition(outcome.status, c.COND_DEGRADED)
    assert "its controller is Deployment web" in degraded["message"], degraded


def test_a_known_child_costs_no_get_and_is_applied_with_its_uid_as_a_precondition() -> None:
    """The apply path is hot (docs/development.md, Operator scale): a child is read once per
    process, before its first apply, then applied with its uid; no pass after the first adds
    a request."""
    kube = MemoryKube()
    run(kube)
    first_gets = len(kube.gets)
    applied = len(kube.applies)
    assert first_gets >= applied - 1  # one GET per child (the keys Secret is read anyway)
    kube.gets.clear()
    run(kube)
    assert [g for g in kube.gets if g[0] != "Secret"] == []
    assert len(ownership.KNOWN) >= applied


def test_a_child_replaced_by_someone_else_between_passes_is_not_overwritten() -> None:
    """A child this process applied before is deleted and made again by someone else: the
    uid precondition refuses the apply, the new object is read, and it is left alone."""
    kube = MemoryKube()
    run(kube)
    kube.objects[("Service", "demo")] = users_service()
    outcome = run(kube)
    assert kube.objects[("Service", "demo")] == users_service()
    degraded = find_condition(outcome.status, c.COND_DEGRADED)
    assert degraded["reason"] == c.REASON_NOT_OWNED and "Service demo" in degraded["message"]


def test_a_child_deleted_between_passes_is_made_again() -> None:
    """A known child someone deleted: the uid precondition fails, the GET finds nothing, and
    the apply creates it again (drift repaired, as before)."""
    kube = MemoryKube()
    run(kube)
    del kube.objects[("Service", "demo")]
    outcome = run(kube)
    assert ("Service", "demo") in kube.objects
    assert find_condition(outcome.status, c.COND_DEGRADED)["status"] == "False"


def test_workloads_seen_by_the_watch_need_no_get_after_a_restart() -> None:
    """A restarted process knows no child, but the workloads it re-applies on refresh passes
    come from the watch-fed index with their owner: no GET for them."""
    kube = MemoryKube()
    first = run(kube)
    ownership.KNOWN.clear()  # a new process
    observed = [
        ObservedWorkload.from_object({**obj, "kind": kind})
        for (kind, _), obj in kube.objects.items()
        if kind == "Deployment"
    ]
    drifted = observed[0]
    kube.objects[("Deployment", drifted.name)]["metadata"]["annotations"][
        c.ANNOTATION_SPEC_HASH
    ] = "edited"
    observed[0] = ObservedWorkload.from_object(
        {**kube.objects[("Deployment", drifted.name)], "kind": "Deployment"}
    )
    kube.gets.clear()
    kube.applies.clear()
    run(kube, full_apply=False, observed=observed, previous=first.status)
    assert kube.applies == [("Deployment", drifted.name)]
    assert [g for g in kube.gets if g[0] == "Deployment"] == []


def test_a_workload_labelled_like_ours_but_not_owned_is_not_counted_or_touched() -> None:
    """A Deployment with the fleet's labels that the resource does not control (copied by
    hand, made by another tool) is not one of its workloads: not counted as ready, not scaled,
    not deleted when its revision retires."""
    kube = MemoryKube()
    outcome = run(kube)
    name = f"demo-decode-{outcome.status['revision']}"
    foreign = json.loads(json.dumps(kube.objects[("Deployment", name)]))
    foreign["metadata"]["ownerReferences"] = []
    foreign["metadata"]["uid"] = "users-uid"
    kube.objects[("Deployment", name)] = foreign
    ownership.KNOWN.clear()
    observed = [ObservedWorkload.from_object({**foreign, "kind": "Deployment"})]
    assert ownership.KNOWN.uid(("Deployment", "ns", name), OWNER) is None
    again = run(kube, observed=observed, previous=outcome.status)
    assert kube.objects[("Deployment", name)] == foreign
    degraded = find_condition(again.status, c.COND_DEGRADED)
    assert degraded["reason"] == c.REASON_NOT_OWNED and name in degraded["message"]


def test_a_feature_turned_off_deletes_only_its_own_objects() -> None:
    """`security.networkPolicy.enabled: false` deletes the fleet's NetworkPolicies by name:
    one of that name the resource does not control stays."""
    kube = MemoryKube()
    first = run(kube)
    meta = {"name": "demo-engines", "namespace": "ns", "uid": "users-uid"}
    theirs = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta}
    kube.objects[("NetworkPolicy", "demo-engines")] = theirs
    off = {**SPEC, "security": {"networkPolicy": {"enabled": False}}}
    run(kube, off, previous=first.status)
    assert kube.objects[("NetworkPolicy", "demo-engines")] == theirs
    assert ("NetworkPolicy", "demo-router") not in kube.objects  # ours went


@pytest.mark.parametrize(
    ("existing", "expected"),
    [
        (None, ownership.Ownership()),
        ({"metadata": {"uid": "x"}}, ownership.Ownership("x", "it has no controller owner reference")),  # noqa: E501
        (
            {"metadata": {"uid": "x", "ownerReferences": [
                {"kind": c.KIND, "name": "demo", "uid": OWNER, "controller": True}]}},
            ownership.Ownership("x"),
        ),
        (
            {"metadata": {"uid": "x", "ownerReferences": [
                {"kind": c.KIND, "name": "demo", "uid": OWNER, "controller": False}]}},
            ownership.Ownership("x", "it has no controller owner reference"),
        ),
        (
            {"metadata": {"uid": "x", "ownerReferences": [
                {"kind": c.KIND, "name": "demo", "uid": "older", "controller": True}]}},
            ownership.Ownership("x", f"its controller is {c.KIND} demo"),
        ),
    ],
)  # fmt: skip
def test_judge(existing: dict[str, Any] | None, expected: ownership.Ownership) -> None:
    """Only a controller reference to this very resource (its uid) makes an object ours; a
    resource of the same name deleted and made again is another owner."""
    assert ownership.judge(existing, OWNER) == expected


def test_kube_turns_a_uid_precondition_failure_into_not_the_same_object() -> None:
    """The API server's answers to an apply naming a uid (seen on the local stack, v1.37):
    409 "uid mismatch ... no existing object was found" when none is there, 422 "metadata.uid
    ... field is immutable" when another is; any other 409 stays an ApiException."""
    kube = Kube.__new__(Kube)
    manifest = {"kind": "Service", "metadata": {"name": "x", "namespace": "ns"}}
    gone = (409, "Operation cannot be fulfilled on services \"x\": uid mismatch: the provided "
            "object specified uid u1, and no existing object was found")  # fmt: skip
    other = (422, 'Service "x" is invalid: metadata.uid: Invalid value: "u1": field is immutable')
    sent: list[Any] = []
    for (status, message), expected in ((gone, NotTheSameObject), (other, NotTheSameObject),
                                        ((409, "conflict"), ApiException)):  # fmt: skip

        def refuse(*_: Any, answer: str = message, code: int = status, **kw: Any) -> Any:
            sent.append(kw["body"])
            raise ApiException(status=code, reason="", body=json.dumps({"message": answer}))

        kube._call = refuse  # type: ignore[method-assign]
        with pytest.raises(expected):
            kube.apply(manifest, uid="u1")
    assert all(body["metadata"]["uid"] == "u1" for body in sent)
    assert "uid" not in manifest["metadata"]  # the caller's manifest is not changed


def test_a_users_service_account_is_neither_bound_nor_run_as() -> None:
    """The router's ServiceAccount `<name>-router` exists and is a user's: the resource must
    not grant it the router's Role (a RoleBinding naming it) nor run router pods with its
    token; both wait, named in Degraded."""
    kube = MemoryKube()
    meta = {"name": "demo-router", "namespace": "ns", "uid": "users-uid"}
    users = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta}
    kube.objects[("ServiceAccount", "demo-router")] = users
    outcome = run(kube)
    router = f"demo-router-{outcome.status['revision']}"
    assert ("RoleBinding", "demo-router") not in kube.objects
    assert ("Deployment", router) not in kube.objects
    message = find_condition(outcome.status, c.COND_DEGRADED)["message"]
    assert f"Deployment {router} not applied: it names ServiceAccount demo-router" in message
    assert "RoleBinding demo-router not applied" in message
    assert ("Deployment", f"demo-decode-{outcome.status['revision']}") in kube.objects


def test_the_accounts_a_child_hands_out() -> None:
    """Pod templates of Deployments and both LeaderWorkerSet templates, RoleBinding subjects
    of the child's namespace; engine pods name none (no token)."""
    pod = {"spec": {"serviceAccountName": "r"}}
    templates = {"leaderTemplate": pod, "workerTemplate": {}}
    lws = {"kind": "LeaderWorkerSet", "metadata": {"namespace": "ns"},
           "spec": {"leaderWorkerTemplate": templates}}  # fmt: skip
    binding = {"kind": "RoleBinding", "metadata": {"namespace": "ns"}, "subjects": [
        {"kind": "ServiceAccount", "name": "a"}, {"kind": "ServiceAccount", "name": "b",
        "namespace": "other"}, {"kind": "User", "name": "u"}]}  # fmt: skip
    assert ownership.service_accounts_named(lws) == ["r"]
    assert ownership.service_accounts_named(binding) == ["a"]
    engine = {"kind": "Deployment", "metadata": {"namespace": "ns"}, "spec": {"template": {}}}
    assert ownership.service_accounts_named(engine) == []
