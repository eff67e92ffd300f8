"""The reconcile's keys step: the fleet's keys Secret exists, with both keys, before any pod
that takes them by secretKeyRef is applied (a pod whose Secret is missing never starts).

Without `spec.security.keysSecret` the operator creates `<name>-keys` once, with random keys
(`desired.resources.security.build_keys_secret`), and never updates it: a new key would not
reach running pods, and the router would refuse the operator's deregistrations. With it, the
user's Secret is read by name and checked for both keys; what is wrong comes back as a Problem
naming the field (Degraded), never as an exception. Verified Secrets are remembered per
resource uid, so only full passes read them again.
"""

from __future__ import annotations

import logging
import secrets
import threading

from cas_operator.api import constants as c
from cas_operator.desired.plan import Plan
from cas_operator.desired.resources.meta import Owner
from cas_operator.desired.resources.security import build_keys_secret, keys_secret_name
from cas_operator.kube import Kube
from cas_operator.reconcile.status import Problem

log = logging.getLogger(__name__)
KEY_BYTES = 32  # 256 bits as hex: no ':' or spaces (the router splits id:name:role:key), no
# leading '-' (a URL-safe key began with one 1 time in 64, and a command-line parser read it
# as a flag)
REQUIRED_KEYS = (c.KEY_ROUTER_CONTROL_PLANE, c.KEY_ENGINE_ADMIN)
_verified: dict[str, str] = {}  # resource uid -> the Secret found usable
_lock = threading.Lock()


def new_key() -> str:
    return secrets.token_hex(KEY_BYTES)


def ensure_keys(kube: Kube, owner: Owner, plan: Plan, *, recheck: bool) -> Problem | None:
    """Make or check the fleet's keys Secret; None when it is usable."""
    name = keys_secret_name(plan.name, plan.spec.security)
    with _lock:
        if not recheck and _verified.get(owner.uid) == name:
            return None
    try:
        problem = _check(kube, owner, plan, name)
    except Exception as exc:  # refused (RBAC), unreachable: said in Degraded, retried next pass
        log.warning("keys Secret %s/%s: %s", plan.namespace, name, exc)
        return Problem(c.REASON_KEYS_SECRET, f"Secret {name}: {exc}")
    if problem is None:
        with _lock:
            _verified[owner.uid] = name
    return problem


def _check(kube: Kube, owner: Owner, plan: Plan, name: str) -> Problem | None:
    found = kube.secret_keys(plan.namespace, name)
    if found is None and plan.spec.security.keys_secret is None:
        kube.create("Secret", plan.namespace, build_keys_secret(owner, plan, new_key))
        return None  # made now (or by a concurrent pass: create answers None on 409)
    where = "spec.security.keysSecret" if plan.spec.security.keys_secret else "the keys Secret"
    if found is None:
        return Problem(
            c.REASON_KEYS_SECRET,
            f"{where}: Secret {name} does not exist; router and engine pods wait for it",
        )
    missing = [k for k in REQUIRED_KEYS if not found.get(k)]
    if missing:
        return Problem(
            c.REASON_KEYS_SECRET,
            f"{where}: Secret {name} lacks {', '.join(missing)}; router and engine pods wait "
            "for it",
        )
    return None


def forget(uid: str) -> None:
    """A deleted resource's verification (its Secret goes with it)."""
    with _lock:
        _verified.pop(uid, None)
