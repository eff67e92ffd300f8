"""The fleet's keys: the keys Secret made once by the reconcile, or the user's checked; pods take
an immutable copy of one version of it by secretKeyRef, and new keys roll out as a revision
(the real router and SGLang refusing a request without them, and a rotation with the operator's
deregistrations throughout: e2e/tests)."""

from __future__ import annotations

from typing import Any

from cas_operator.api import constants as c
from cas_operator.desired.build import plan_raw
from cas_operator.desired.resources import build_all
from cas_operator.desired.resources.meta import Owner
from cas_operator.reconcile import keys
from cas_operator.reconcile.core import Measured, observe, reconcile
from cas_operator.reconcile.status import find_condition
from cas_operator.scaledown.decide import RevisionLoad
from tests.fakes import MemoryKube

SPEC: dict[str, Any] = {"model": {"name": "glm-5"}}


def run(
    kube: MemoryKube,
    spec: dict[str, Any],
    uid: str,
    full: bool = True,
    previous: dict[str, Any] | None = None,
    idle: bool = False,
    later: float = 0.0,
) -> Any:
    """One pass; `idle`: the fleet tick found the older revisions without work."""
    older = ()
    if idle and previous is not None:
        older = tuple(RevisionLoad(r, 0) for r in {w.revision for w in observe(kube, "ns", "demo")}
                      if r != previous.get("revision"))  # fmt: skip
    return reconcile(
        kube,  # type: ignore[arg-type]
        name="demo",
        namespace="ns",
        uid=uid,
        generation=1,
        raw_spec=spec,
        full_apply=full,
        previous=previous,
        measured=Measured(older=older),
        now=1_000_000.0 + later,
    )


def degraded(outcome: Any) -> dict[str, Any]:
    return dict(find_condition(outcome.status, c.COND_DEGRADED))


def copies(kube: MemoryKube) -> dict[str, dict[str, str]]:
    """The keys copies by name: their keys."""
    return {
        name: dict(o["stringData"])
        for (kind, name), o in kube.objects.items()
        if kind == "Secret" and o["metadata"]["labels"].get(c.LABEL_APP_NAME) == c.APP_KEYS_COPY
    }


def test_the_first_pass_makes_random_keys_once_and_later_passes_keep_them() -> None:
    """Regression guard: a Secret rewritten by a later pass would give the operator a key the
    running router never saw (every deregistration refused with 401). The pods' copy of the
    keys is made with it, immutable, once."""
    kube = MemoryKube()
    first = run(kube, SPEC, "uid-made")
    secret = kube.objects[("Secret", "demo-keys")]
    made = dict(secret["stringData"])
    assert set(made) == {c.KEY_ROUTER_CONTROL_PLANE, c.KEY_ENGINE_ADMIN}
    assert len(set(made.values())) == 2 and all(len(v) >= 40 for v in made.values())
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-made"
    version = first.status["keysVersion"]
    copy = kube.objects[("Secret", f"demo-keys-{version}")]
    assert copy["immutable"] is True and copy["stringData"] == made
    assert copy["metadata"]["ownerReferences"][0]["uid"] == "uid-made"
    run(kube, SPEC, "uid-made", full=True)
    run(kube, SPEC, "uid-made", full=False)
    assert kube.created == [("Secret", "demo-keys"), ("Secret", f"demo-keys-{version}")]
    assert kube.objects[("Secret", "demo-keys")]["stringData"] == made
    other = MemoryKube()
    run(other, {**SPEC}, "uid-other")
    assert other.objects[("Secret", "demo-keys")]["stringData"] != made  # random, not derived


def test_pods_take_the_keys_by_reference_and_never_hold_them() -> None:
    kube = MemoryKube()
    version = run(kube, SPEC, "uid-ref").status["keysVersion"]
    made = kube.objects[("Secret", "demo-keys")]["stringData"]
    plan = plan_raw("demo", "ns", SPEC, keys_version=version)
    text = str(build_all(Owner("demo", "ns", "uid-ref"), plan))
    assert all(value not in text for value in made.values())
    for manifest in build_all(Owner("demo", "ns", "uid-ref"), plan):
        if manifest["kind"] != "Deployment":
            continue
        assert manifest["metadata"]["labels"][c.LABEL_KEYS] == version
        container = manifest["spec"]["template"]["spec"]["containers"][0]
        refs = {
            e["name"]: e["valueFrom"]["secretKeyRef"]
            for e in container["env"]
            if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]
        }
        router = manifest["metadata"]["labels"][c.LABEL_ROLE] == c.ROLE_ROUTER
        var, key = (
            (c.ENV_ROUTER_CONTROL_PLANE_KEY, c.KEY_ROUTER_CONTROL_PLANE)
            if router
            else (c.ENV_ENGINE_ADMIN_KEY, c.KEY_ENGINE_ADMIN)
        )
        assert refs == {var: {"name": f"demo-keys-{version}", "key": key}}
        if router:  # the router reads its keys from its arguments only (its --help)
            assert any(f"$({var})" in a for a in container["args"])
            pod_labels = manifest["spec"]["template"]["metadata"]["labels"]
            assert pod_labels[c.LABEL_KEYS] == version  # the operator asks it with its key
        else:  # the engine from the variable (SGLang would publish its arguments: issue 41)
            args = container["args"]
            assert args[args.index("--cas-admin-key-env") + 1] == var
            assert not any(f"$({var})" in a for a in args)


def workloads(kube: MemoryKube) -> dict[str, str]:
    """Deployment name -> the keys version its pods take."""
    return {
        name: o["metadata"]["labels"].get(c.LABEL_KEYS, "")
        for (kind, name), o in kube.objects.items()
        if kind == "Deployment"
    }


def test_new_keys_roll_routers_and_engines_together_and_the_old_copy_goes_with_them() -> None:
    """Regression (issue 41, item 3): a replaced (or deleted) keys Secret gave new pods new
    keys while the running routers kept the old one, and the operator, reading the Secret,
    was refused (401) by every old router. Now the pods of a revision take one version's copy:
    new keys are a new revision of routers and engines together (after a pass that rechecks
    the Secret), the old revision keeps its copy (and its routers their key) until it is
    retired, and its copy goes with it."""
    kube = MemoryKube()
    first = run(kube, SPEC, "uid-rot")
    old_version, old_revision = first.status["keysVersion"], first.status["revision"]
    kube.objects[("Secret", "demo-keys")]["stringData"] = {
        c.KEY_ROUTER_CONTROL_PLANE: "r" * 64,
        c.KEY_ENGINE_ADMIN: "e" * 64,
    }
    rolled = run(kube, SPEC, "uid-rot", previous=first.status)
    new_version, new_revision = rolled.status["keysVersion"], rolled.status["revision"]
    assert new_version != old_version and new_revision != old_revision
    assert copies(kube)[f"demo-keys-{new_version}"][c.KEY_ENGINE_ADMIN] == "e" * 64
    assert workloads(kube) == {
        f"demo-{role}-{revision}": version
        for role in ("prefill", "decode", "router")
        for revision, version in ((old_revision, old_version), (new_revision, new_version))
    }
    # the new revision Ready, the old one idle: retired, and its copy with it
    retired = run(kube, SPEC, "uid-rot", previous=rolled.status, idle=True)
    retired = run(kube, SPEC, "uid-rot", previous=retired.status, idle=True, later=600)
    retired = run(kube, SPEC, "uid-rot", previous=retired.status, idle=True, later=605)
    assert set(workloads(kube).values()) == {new_version}
    assert set(copies(kube)) == {f"demo-keys-{new_version}"}
    assert ("Secret", f"demo-keys-{old_version}") in kube.deleted


def test_a_deleted_operator_secret_is_made_again_with_new_keys_that_roll_out() -> None:
    kube = MemoryKube()
    first = run(kube, SPEC, "uid-gone")
    old = dict(kube.objects.pop(("Secret", "demo-keys"))["stringData"])
    again = run(kube, SPEC, "uid-gone", previous=first.status)
    assert kube.objects[("Secret", "demo-keys")]["stringData"] != old
    assert again.status["keysVersion"] != first.status["keysVersion"]
    assert again.status["revision"] != first.status["revision"]


def test_a_named_secret_is_read_not_made_and_a_missing_one_is_reported_by_field() -> None:
    spec = {**SPEC, "security": {"keysSecret": "team-keys"}}
    kube = MemoryKube()
    outcome = run(kube, spec, "uid-named")
    cond = degraded(outcome)
    assert cond["status"] == "True" and cond["reason"] == c.REASON_KEYS_SECRET
    assert "spec.security.keysSecret" in cond["message"] and "team-keys" in cond["message"]
    assert kube.created == []
    kube.objects[("Secret", "team-keys")] = {
        "metadata": {"name": "team-keys"},
        "stringData": {c.KEY_ROUTER_CONTROL_PLANE: "r"},
    }
    cond = degraded(run(kube, spec, "uid-named"))
    assert cond["status"] == "True" and c.KEY_ENGINE_ADMIN in cond["message"]
    kube.objects[("Secret", "team-keys")]["stringData"][c.KEY_ENGINE_ADMIN] = "e"
    good = run(kube, spec, "uid-named")
    assert degraded(good)["status"] == "False"
    version = good.status["keysVersion"]
    assert kube.created == [("Secret", f"demo-keys-{version}")]  # the copy only
    # the user's Secret deleted: Degraded, and the pods keep the version they run
    del kube.objects[("Secret", "team-keys")]
    kept = run(kube, spec, "uid-named", previous=good.status)
    assert degraded(kept)["status"] == "True" and "keep" in degraded(kept)["message"]
    assert kept.status["keysVersion"] == version
    assert kept.status["revision"] == good.status["revision"]


class RefusingKube(MemoryKube):
    def secret_keys(self, namespace: str, name: str) -> dict[str, str] | None:
        raise RuntimeError('secrets "demo-keys" is forbidden')


def test_a_refused_read_is_degraded_not_a_crash_and_is_retried() -> None:
    kube = RefusingKube()
    cond = degraded(run(kube, SPEC, "uid-refused", full=False))
    assert cond["status"] == "True" and "forbidden" in cond["message"]
    # not remembered as verified: the next pass asks again
    cond = degraded(run(kube, SPEC, "uid-refused", full=False))
    assert cond["status"] == "True"
    keys.forget("uid-refused")


def test_made_keys_never_start_with_a_dash_and_never_hold_the_routers_separator() -> None:
    """Regression: keys were URL-safe base64, which begins with '-' one time in 64; the engine's
    argument parser then read `--admin-api-key -…` as a missing value and the pod never
    started. Made keys are hex now, and the flag is rendered as one `--flag=value` word."""
    made = [keys.new_key() for _ in range(2000)]
    assert all(k[0] != "-" and ":" not in k and len(k) == 2 * keys.KEY_BYTES for k in made)
    assert len(set(made)) == len(made)


def test_a_copy_name_taken_by_someone_else_is_never_handed_to_the_pods() -> None:
    """The pods take their keys from `<name>-keys-<version>`: an object under that name that
    is not this resource's (issue 41, item 5's rule) leaves the pods on the keys they run."""
    kube = MemoryKube()
    first = run(kube, SPEC, "uid-taken")
    new = {c.KEY_ROUTER_CONTROL_PLANE: "r" * 64, c.KEY_ENGINE_ADMIN: "e" * 64}
    kube.objects[("Secret", "demo-keys")]["stringData"] = new
    version = keys.keys_version("uid-taken", new)
    kube.objects[("Secret", f"demo-keys-{version}")] = {
        "metadata": {"name": f"demo-keys-{version}", "uid": "x"},
        "stringData": {c.KEY_ROUTER_CONTROL_PLANE: "mine", c.KEY_ENGINE_ADMIN: "mine"},
    }
    kept = run(kube, SPEC, "uid-taken", previous=first.status)
    cond = degraded(kept)
    assert cond["status"] == "True" and f"demo-keys-{version}" in cond["message"]
    assert kept.status["keysVersion"] == first.status["keysVersion"]
    assert kept.status["revision"] == first.status["revision"]
