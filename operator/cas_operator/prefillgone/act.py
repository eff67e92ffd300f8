"""The prefill-gone loop's act half: record a deleted prefill pod in its resource's feed.

Entry point: `record_prefill_end(kube, pod, now)`, called by handlers.py (in a thread) with the
last copy of every deleted prefill pod. It decides (`decide.confirmed_end`), then reads the
resource's `<name>-prefill-gone` ConfigMap, merges (`decide.merge_entries`; a LeaderWorkerSet
group's pod joins the pending members, and a group whose pods have all ended becomes one entry,
`decide.complete_groups`) and writes it back with its resourceVersion as a precondition (two
prefill pods ending at once both land: a conflict re-reads). An unconfirmed end of a pod that
may still write (a force delete) is a Warning Event on the resource: the decode KV it may still
write stays held, counting against the quarantine budget; one that never served is only logged.
Ownership: the ConfigMap's data is this module's alone; it is owned by (and deleted with) the
resource.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from cas_operator.api import constants as c
from cas_operator.desired.resources.meta import Owner, base_labels, owner_reference
from cas_operator.desired.resources.pools import prefill_gone_name
from cas_operator.kube import Kube
from cas_operator.prefillgone.decide import (
    FeedUpdate,
    GoneEntry,
    GroupMember,
    Unconfirmed,
    confirmed_end,
    feed_text,
    parse_feed_text,
    parse_pending_text,
    pending_text,
    updated_feed,
)
from cas_operator.reconcile.ownership import judge
from cas_operator.types import Manifest

log = logging.getLogger(__name__)
WRITE_ATTEMPTS = 5
REASON_UNCONFIRMED = "PrefillEndUnconfirmed"


@dataclass(frozen=True)
class EndRecord:
    """What `record_prefill_end` did: `recorded` (the entry is in the feed), `pending` (a
    group's pod, waiting for the rest of its group), `unconfirmed` (not recorded, why in
    `detail`), `no_owner` (its resource is gone), `not_owned` (a ConfigMap of the feed's name
    that the resource does not control: left alone) or `conflict`."""

    outcome: str
    detail: str = ""


def _configmap(
    owner: Owner,
    entries: list[GoneEntry],
    pending: list[GroupMember],
    resource_version: str | None,
) -> Manifest:
    meta: Manifest = {
        "name": prefill_gone_name(owner.name),
        "namespace": owner.namespace,
        "labels": base_labels(owner.name, c.APP_PREFILL_GONE),
        "ownerReferences": [owner_reference(owner)],
    }
    if resource_version:
        meta["resourceVersion"] = resource_version
    data = {c.PREFILL_GONE_KEY: feed_text(entries)}
    if pending:
        data[c.PREFILL_GONE_PENDING_KEY] = pending_text(pending)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def _record(update: FeedUpdate, end: GoneEntry | GroupMember) -> EndRecord:
    if update.ended:
        return EndRecord("recorded", ", ".join(e.bootstrap for e in update.ended))
    assert isinstance(end, GroupMember)
    waiting = sum(1 for m in update.pending if m.group == end.group)
    return EndRecord("pending", f"{waiting} of {end.size} pods of its group ended")


def record_prefill_end(kube: Kube, pod: Manifest, now: float) -> EndRecord:
    meta = pod.get("metadata") or {}
    namespace, cas_name = meta.get("namespace", ""), (meta.get("labels") or {}).get(c.LABEL_NAME)
    if not namespace or not cas_name:
        return EndRecord("no_owner", "the pod names no CodingAgentServing")
    resource = kube.get(c.KIND, namespace, cas_name)
    if resource is None:
        return EndRecord("no_owner", f"{namespace}/{cas_name} is gone")
    decision = confirmed_end(pod)
    if isinstance(decision, Unconfirmed):
        message = f"prefill pod {decision.pod} ended unconfirmed: {decision.reason}"
        log.warning("%s", message)
        if decision.alarm:  # a pending pod deleted in a scale-down is no news
            kube.post_event(resource, "Warning", REASON_UNCONFIRMED, message)
        return EndRecord("unconfirmed", decision.reason)
    owner = Owner(cas_name, namespace, str(resource["metadata"]["uid"]))
    name = prefill_gone_name(cas_name)
    for _ in range(WRITE_ATTEMPTS):
        current = kube.get("ConfigMap", namespace, name)
        foreign = judge(current, owner.uid).foreign
        if foreign:  # a user's ConfigMap of that name: never written (reconcile.ownership)
            log.warning("ConfigMap %s/%s is not %s's (%s): not written", namespace, name,
                        cas_name, foreign)  # fmt: skip
            return EndRecord("not_owned", f"ConfigMap {name}: {foreign}")
        data = (current or {}).get("data") or {}
        update = updated_feed(
            parse_feed_text(data.get(c.PREFILL_GONE_KEY)),
            parse_pending_text(data.get(c.PREFILL_GONE_PENDING_KEY)),
            decision,
            now,
        )
        if current is None:
            made = kube.create(
                "ConfigMap", namespace, _configmap(owner, update.entries, update.pending, None)
            )
            if made is not None:
                return _record(update, decision)
            continue  # created by a concurrent end: merge into it
        version = str(current["metadata"].get("resourceVersion", ""))
        manifest = _configmap(owner, update.entries, update.pending, version)
        if kube.replace("ConfigMap", namespace, name, manifest):
            return _record(update, decision)
    return EndRecord("conflict", f"{WRITE_ATTEMPTS} writes of {namespace}/{name} lost a race")
