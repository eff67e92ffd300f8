"""Metadata shared by every child: labels, owner reference, spec-hash annotation (and the one
stable hash the revision uses too)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from cas_operator.api import constants as c

Manifest = dict[str, Any]


def stable_hash(data: Any, length: int = 8) -> str:
    """Hex digest of canonical JSON; the same data always gives the same hash."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


@dataclass(frozen=True)
class Owner:
    """The CodingAgentServing that owns the children (its uid makes the owner reference)."""

    name: str
    namespace: str
    uid: str


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": f"{c.GROUP}/{c.VERSION}",
        "kind": c.KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def base_labels(name: str, app: str, role: str | None = None) -> dict[str, str]:
    """Labels of every child. Never the parent's labels (Argo CD tracking must not leak)."""
    labels = {c.LABEL_APP_NAME: app, c.LABEL_MANAGED_BY: c.MANAGED_BY, c.LABEL_NAME: name}
    if role:
        labels[c.LABEL_ROLE] = role
    return labels


def selector_labels(name: str, role: str, revision: str) -> dict[str, str]:
    """Immutable workload selector: name, role, revision (never `serving`, which drains flip)."""
    return {c.LABEL_NAME: name, c.LABEL_ROLE: role, c.LABEL_REVISION: revision}


# Pod metadata keys the operator owns: a user's `podMetadata` never overrides them.
OPERATOR_KEY_PREFIX = "cas.dev/"
OPERATOR_LABELS = frozenset({c.LABEL_APP_NAME, c.LABEL_MANAGED_BY})
OPERATOR_ANNOTATIONS = frozenset(
    {"prometheus.io/scrape", "prometheus.io/port", c.ANNOTATION_BOOTSTRAP_PORT}
)


def is_operator_key(key: str, kind: str) -> bool:
    """Whether a pod `labels` / `annotations` key is the operator's."""
    ours = OPERATOR_LABELS if kind == "labels" else OPERATOR_ANNOTATIONS
    return key.startswith(OPERATOR_KEY_PREFIX) or key in ours


def with_user_keys(ours: dict[str, str], user: dict[str, str] | None, kind: str) -> dict[str, str]:
    """Pod `labels` or `annotations`: the user's (`spec.podMetadata`) under the operator's."""
    kept = {k: v for k, v in (user or {}).items() if not is_operator_key(k, kind)}
    return {**kept, **ours}


def dropped_user_keys(user: dict[str, str] | None, kind: str) -> list[str]:
    """The user's keys that `with_user_keys` drops, as `spec.podMetadata.<kind>.<key>`."""
    return [f"spec.podMetadata.{kind}.{k}" for k in sorted(user or {}) if is_operator_key(k, kind)]


def metadata(
    owner: Owner,
    name: str,
    labels: dict[str, str],
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels,
        "ownerReferences": [owner_reference(owner)],
    }
    if annotations:
        meta["annotations"] = annotations
    return meta


def with_spec_hash(manifest: Manifest) -> Manifest:
    """Stamp the manifest's own hash so an unchanged child can be skipped without a diff."""
    digest = stable_hash(manifest, length=16)
    manifest["metadata"].setdefault("annotations", {})[c.ANNOTATION_SPEC_HASH] = digest
    return manifest
