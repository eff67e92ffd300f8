"""Ownership of children: the operator writes an object only when it carries this resource's
controller owner reference, or when it does not exist yet.

Server-side apply with force takes over any object under the name it applies, whoever made it,
and the owner reference it adds then lets the garbage collector delete that object with the
resource: a resource named `demo` would overwrite a user's Service `demo` and delete it later.
So a child is applied in one of two ways:
- known to be ours (this process applied it, or the watch-fed workload index shows it with our
  controller reference): server-side apply with `metadata.uid` set to its uid, which the API
  server takes as a precondition (`Kube.apply`: an object deleted or made again by someone else
  in the meantime is refused, nothing is written, and the next step below decides);
- not known: one GET, then `judge` (pure): absent -> apply (creates it), ours -> apply with its
  uid, anyone else's -> `NotOwned` (nothing written; the pass reports `Degraded:
  ChildNotOwned` naming the object, and asks again on later passes).
So the apply path adds one GET per child per process lifetime, not per pass; the workloads,
which the refresh passes re-apply, come from the index with their owner. Between a GET that
finds nothing and the apply that creates, another client could create the object: that window
(one round trip) is the one left.

Ownership: `KNOWN` (object keys -> owner and object uid) is this module's, shared by every pass
(guarded by a lock); `forget_owner` drops a deleted resource's entries.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from cas_operator.api import constants as c
from cas_operator.kube import Kube, NotTheSameObject
from cas_operator.types import Manifest

Key = tuple[str, str, str]  # kind, namespace, name


class NotOwned(Exception):
    """An object under a child's name exists and is not this resource's: left as it is."""

    def __init__(self, kind: str, name: str, why: str) -> None:
        super().__init__(
            f"{kind} {name} exists and is not this resource's ({why}): left unchanged; "
            "delete or rename it, or rename the resource"
        )
        self.kind, self.name = kind, name


def controller_of(obj: Manifest) -> dict[str, Any] | None:
    """The ownerReference marked `controller: true`, if any."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return next((ref for ref in refs if ref.get("controller")), None)


def controller_uid(obj: Manifest) -> str | None:
    ref = controller_of(obj)
    return str(ref["uid"]) if ref is not None and ref.get("uid") else None


@dataclass(frozen=True)
class Ownership:
    """What a GET found under a child's name: nothing, ours (its uid), or someone else's."""

    uid: str | None = None  # the existing object's uid; None: nothing there
    foreign: str = ""  # why it is not ours ("" when it is, or when nothing is there)


def judge(existing: Manifest | None, owner_uid: str) -> Ownership:
    """Whether the object found under a child's name may be written by the resource of
    `owner_uid` (pure)."""
    if existing is None:
        return Ownership()
    uid = str(existing["metadata"].get("uid") or "")
    ref = controller_of(existing)
    if ref is None:
        return Ownership(uid, "it has no controller owner reference")
    if ref.get("uid") == owner_uid and ref.get("kind") == c.KIND:
        return Ownership(uid)
    return Ownership(uid, f"its controller is {ref.get('kind')} {ref.get('name')}")


class Known:
    """Children known to be owned: (kind, namespace, name) -> (owner uid, object uid)."""

    def __init__(self) -> None:
        self._entries: dict[Key, tuple[str, str]] = {}
        self._lock = threading.Lock()

    def uid(self, key: Key, owner_uid: str) -> str | None:
        with self._lock:
            found = self._entries.get(key)
        return found[1] if found is not None and found[0] == owner_uid else None

    def remember(self, key: Key, owner_uid: str, uid: str) -> None:
        with self._lock:
            self._entries[key] = (owner_uid, uid)

    def forget(self, key: Key) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def forget_owner(self, owner_uid: str) -> None:
        with self._lock:
            for key in [k for k, v in self._entries.items() if v[0] == owner_uid]:
                del self._entries[key]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


KNOWN = Known()


def key_of(manifest: Manifest) -> Key:
    meta = manifest["metadata"]
    return (manifest["kind"], meta["namespace"], meta["name"])


def remember_observed(objects: Iterable[tuple[str, str, str, str | None, str | None]]) -> None:
    """Seed `KNOWN` from what a watch or a LIST showed: (kind, namespace, name, uid, controller
    uid) of each object; those without both uids are skipped."""
    for kind, namespace, name, uid, owner in objects:
        if uid and owner:
            KNOWN.remember((kind, namespace, name), owner, uid)


def apply_owned(kube: Kube, manifest: Manifest) -> Manifest:
    """Server-side apply of a child whose manifest carries its owner's controller reference,
    only over an object that reference already controls (or none); raises `NotOwned`."""
    owner_uid = controller_uid(manifest)
    if owner_uid is None:
        raise ValueError(f"{manifest['kind']} {manifest['metadata']['name']}: no controller")
    key = key_of(manifest)
    uid = KNOWN.uid(key, owner_uid)
    if uid is not None:
        try:
            return _applied(kube, manifest, key, owner_uid, uid)
        except NotTheSameObject:
            KNOWN.forget(key)  # deleted, or made again by someone: ask the API server
    found = judge(kube.get(key[0], key[1], key[2]), owner_uid)
    if found.foreign:
        raise NotOwned(key[0], key[2], found.foreign)
    return _applied(kube, manifest, key, owner_uid, found.uid)


def _applied(kube: Kube, manifest: Manifest, key: Key, owner_uid: str, uid: str | None) -> Manifest:
    answer = kube.apply(manifest, uid=uid)
    made = (answer or {}).get("metadata", {}).get("uid") if isinstance(answer, dict) else None
    if made:
        KNOWN.remember(key, owner_uid, str(made))
    return answer


def service_accounts_named(manifest: Manifest) -> list[str]:
    """The ServiceAccounts of its own namespace a child hands out (pure): its pod templates'
    `serviceAccountName` (a pod runs with that account's token), a RoleBinding's subjects."""
    spec = manifest.get("spec") or {}
    if manifest["kind"] == "RoleBinding":
        namespace = manifest["metadata"]["namespace"]
        return [
            s["name"]
            for s in manifest.get("subjects") or []
            if s.get("kind") == "ServiceAccount" and s.get("namespace", namespace) == namespace
        ]
    lws = spec.get("leaderWorkerTemplate") or {}
    templates = [spec.get("template"), lws.get("leaderTemplate"), lws.get("workerTemplate")]
    names = {((t or {}).get("spec") or {}).get("serviceAccountName") for t in templates}
    return sorted(n for n in names if n)


def foreign_account(kube: Kube, manifest: Manifest) -> str:
    """Why a child must not be applied because it hands out a ServiceAccount this resource
    does not control ("" when it may): a RoleBinding would grant a user's account the
    router's rights, a router pod would run with a user's token. A GET only for an account
    not known as owned (once per process)."""
    owner_uid = controller_uid(manifest) or ""
    namespace = manifest["metadata"]["namespace"]
    for name in service_accounts_named(manifest):
        key = ("ServiceAccount", namespace, name)
        if KNOWN.uid(key, owner_uid) is not None:
            continue
        found = judge(kube.get(*key), owner_uid)
        if found.uid is None:  # its own apply failed (and says why): no account, no token
            continue
        if found.foreign:
            return f"it names ServiceAccount {name}, which is not this resource's"
        KNOWN.remember(key, owner_uid, found.uid)
    return ""


def delete_owned(kube: Kube, kind: str, namespace: str, name: str, owner_uid: str) -> bool:
    """Delete a child by name only when it is this resource's (the uid a precondition);
    True when it was deleted, False when nothing was there or it is someone else's."""
    key = (kind, namespace, name)
    uid = KNOWN.uid(key, owner_uid)
    if uid is None:
        found = judge(kube.get(kind, namespace, name), owner_uid)
        if found.uid is None or found.foreign:
            return False
        uid = found.uid
    kube.delete(kind, namespace, name, uid=uid)
    KNOWN.forget(key)
    return True
