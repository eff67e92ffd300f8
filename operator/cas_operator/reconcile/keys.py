"""The reconcile's keys step: which version of the fleet's keys its pods take, and the copy of
that version, before any pod that takes it by secretKeyRef is applied.

The keys Secret: without `spec.security.keysSecret` the operator creates `<name>-keys` with
random keys (`desired.resources.security.build_keys_secret`) and never rewrites it; with it,
the user's Secret is read by name and checked for both keys. Its content has a version
(`keys_version`, a hash with the resource's uid); the pods take their keys from an immutable
copy of that version (`<name>-keys-<version>`, made here: `build_keys_copy`). A deleted or
replaced Secret is a new version: the plan renders pods that take the new copy, which is a new
revision of routers and engines together (`desired.revision.choose`), while the old revision
keeps the copy its pods started with until it is retired (`reconcile.core.retire_stale` then
deletes a copy nothing runs). A deleted operator-made Secret is made again, with new keys.

What is wrong comes back as a Problem naming the field (Degraded), never as an exception, and
the pods keep the version the status recorded. The Secret is read on full passes and at most
every `RECHECK_SECONDS` otherwise (the operator may not watch Secrets), so new keys roll out
within a refresh or two of being written.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass

from cas_operator.api import constants as c
from cas_operator.api.models import SecuritySpec
from cas_operator.desired.resources.meta import Owner
from cas_operator.desired.resources.security import (
    KEYS,
    build_keys_copy,
    build_keys_secret,
    keys_secret_name,
    keys_version,
)
from cas_operator.kube import Kube
from cas_operator.reconcile.ownership import NotOwned, judge
from cas_operator.reconcile.status import Problem

log = logging.getLogger(__name__)
KEY_BYTES = 32  # 256 bits as hex: no ':' or spaces (the router splits id:name:role:key), no
# leading '-' (a URL-safe key began with one 1 time in 64, and a command-line parser read it
# as a flag)
REQUIRED_KEYS = KEYS
RECHECK_SECONDS = 30.0  # outside full passes, the Secret is read again after this long


@dataclass(frozen=True)
class Checked:
    """A Secret found usable: its name, its version, and when (monotonic seconds)."""

    secret: str
    version: str
    at: float


@dataclass(frozen=True)
class Keys:
    """The keys step's answer: the version the pods take ("": none yet) and what is wrong."""

    version: str = ""
    problem: Problem | None = None


_checked: dict[str, Checked] = {}  # resource uid -> the Secret last found usable
# (namespace, name, version) whose copy this process made or saw (a version names its uid)
_copied: set[tuple[str, str, str]] = set()
_lock = threading.Lock()


def new_key() -> str:
    return secrets.token_hex(KEY_BYTES)


def ensure_keys(
    kube: Kube,
    owner: Owner,
    security: SecuritySpec | None,
    recorded: str,
    *,
    recheck: bool,
    now: float | None = None,
) -> Keys:
    """Make or check the fleet's keys Secret and the copy of its version. `security` is the
    spec's (None: the spec does not parse, and the plan says so); `recorded` the version the
    status says the pods take, kept while the Secret is unusable."""
    if security is None:
        return Keys(recorded)
    now = time.monotonic() if now is None else now
    name = keys_secret_name(owner.name, security)
    with _lock:
        last = _checked.get(owner.uid)
    if not recheck and last and last.secret == name and now - last.at < RECHECK_SECONDS:
        return Keys(last.version)
    try:
        found, problem = _read(kube, owner, security, name)
        if problem is not None or found is None:
            return Keys(recorded, problem)
        version = keys_version(owner.uid, found)
        _copy(kube, owner, version, found)
    except Exception as exc:  # refused (RBAC), unreachable: said in Degraded, retried next pass
        log.warning("keys Secret %s/%s: %s", owner.namespace, name, exc)
        return Keys(recorded, Problem(c.REASON_KEYS_SECRET, f"Secret {name}: {exc}"))
    if recorded and version != recorded:
        log.info("keys of %s/%s: version %s -> %s", owner.namespace, owner.name, recorded, version)
    with _lock:
        _checked[owner.uid] = Checked(name, version, now)
    return Keys(version)


def _read(
    kube: Kube, owner: Owner, security: SecuritySpec, name: str
) -> tuple[dict[str, str] | None, Problem | None]:
    """The keys Secret's content (made now when it is the operator's and missing), or what
    is wrong with it."""
    found = kube.secret_keys(owner.namespace, name)
    if found is None and security.keys_secret is None:
        made = build_keys_secret(owner, new_key)
        if kube.create("Secret", owner.namespace, made) is not None:
            return dict(made["stringData"]), None
        found = kube.secret_keys(owner.namespace, name)  # made by a concurrent pass (409)
    where = "spec.security.keysSecret" if security.keys_secret else "the keys Secret"
    keeps = "the pods keep the keys they have"
    if found is None:
        return None, Problem(
            c.REASON_KEYS_SECRET, f"{where}: Secret {name} does not exist; {keeps}"
        )
    missing = [k for k in REQUIRED_KEYS if not found.get(k)]
    if missing:
        return None, Problem(
            c.REASON_KEYS_SECRET, f"{where}: Secret {name} lacks {', '.join(missing)}; {keeps}"
        )
    return found, None


def _copy(kube: Kube, owner: Owner, version: str, keys: dict[str, str]) -> None:
    """The immutable copy of `version` exists (made now unless this process saw it)."""
    key = (owner.namespace, owner.name, version)
    with _lock:
        if key in _copied:
            return
    copy = build_keys_copy(owner, version, keys)
    if kube.create("Secret", owner.namespace, copy) is None:  # 409: it exists; whose?
        name = copy["metadata"]["name"]
        found = judge(kube.get("Secret", owner.namespace, name), owner.uid)
        if found.foreign:  # the pods would take keys someone else wrote: never
            raise NotOwned("Secret", name, found.foreign)
    with _lock:
        _copied.add(key)


def forget(uid: str) -> None:
    """A deleted resource's state (its Secrets go with it)."""
    with _lock:
        _checked.pop(uid, None)


def forget_copy(namespace: str, name: str, version: str) -> None:
    """A copy was deleted (its version retired): make it again if that version comes back."""
    with _lock:
        _copied.discard((namespace, name, version))
