"""The fleet's keys Secret: made once by the reconcile, or the user's checked; pods take it by
secretKeyRef (the real router and SGLang refusing a request without it: e2e/tests)."""

from __future__ import annotations

from typing import Any

from cas_operator.api import constants as c
from cas_operator.desired.build import plan_raw
from cas_operator.desired.resources import build_all
from cas_operator.desired.resources.meta import Owner
from cas_operator.reconcile import keys
from cas_operator.reconcile.core import reconcile
from cas_operator.reconcile.status import find_condition
from tests.fakes import MemoryKube

SPEC: dict[str, Any] = {"model": {"name": "glm-5"}}


def run(kube: MemoryKube, spec: dict[str, Any], uid: str, full: bool = True) -> Any:
    return reconcile(
        kube,  # type: ignore[arg-type]
        name="demo",
        namespace="ns",
        uid=uid,
        generation=1,
        raw_spec=spec,
        full_apply=full,
    )


def degraded(outcome: Any) -> dict[str, Any]:
    return dict(find_condition(outcome.status, c.COND_DEGRADED))


def test_the_first_pass_makes_random_keys_once_and_later_passes_keep_them() -> None:
    """Regression guard: a Secret rewritten by a later pass would give the operator a key the
    running router never saw (every deregistration refused with 401)."""
    kube = MemoryKube()
    run(kube, SPEC, "uid-made")
    secret = kube.objects[("Secret", "demo-keys")]
    made = dict(secret["stringData"])
    assert set(made) == {c.KEY_ROUTER_CONTROL_PLANE, c.KEY_ENGINE_ADMIN}
    assert len(set(made.values())) == 2 and all(len(v) >= 40 for v in made.values())
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-made"
    run(kube, SPEC, "uid-made", full=True)
    run(kube, SPEC, "uid-made", full=False)
    assert kube.created == [("Secret", "demo-keys")]
    assert kube.objects[("Secret", "demo-keys")]["stringData"] == made
    other = MemoryKube()
    run(other, {**SPEC}, "uid-other")
    assert other.objects[("Secret", "demo-keys")]["stringData"] != made  # random, not derived


def test_pods_take_the_keys_by_reference_and_never_hold_them() -> None:
    kube = MemoryKube()
    run(kube, SPEC, "uid-ref")
    made = kube.objects[("Secret", "demo-keys")]["stringData"]
    plan = plan_raw("demo", "ns", SPEC)
    text = str(build_all(Owner("demo", "ns", "uid-ref"), plan))
    assert all(value not in text for value in made.values())
    for manifest in build_all(Owner("demo", "ns", "uid-ref"), plan):
        if manifest["kind"] != "Deployment":
            continue
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
        assert refs == {var: {"name": "demo-keys", "key": key}}
        if router:  # the router reads its keys from its arguments only (its --help)
            assert any(f"$({var})" in a for a in container["args"])
        else:  # the engine from the variable (SGLang would publish its arguments: issue 41)
            args = container["args"]
            assert args[args.index("--cas-admin-key-env") + 1] == var
            assert not any(f"$({var})" in a for a in args)


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
    assert degraded(run(kube, spec, "uid-named"))["status"] == "False"
    assert kube.created == []


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
