"""The prefill-gone loop's act half: record a deleted prefill pod in its resource's feed.

Entry point: `record_prefill_end(kube, pod, now)`, called by handlers.py (in a thread) with the
last copy of every deleted prefill pod. It decides (`decide.confirmed_end`), then reads the
resource's `<name>-prefill-gone` ConfigMap, merges (`decide.merge_entries`) and writes it back
with its resourceVersion as a precondition (two prefill pods ending at once both land: a
conflict re-reads). An unconfirmed end of a pod that may still write (a force delete) is a
Warning Event on the resource: the decode KV it may still write stays held, counting against
the quarantine budget; one that never served is only logged.
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
    GoneEntry,
    Unconfirmed,
    confirmed_end,
    feed_text,
    merge_entries,
    parse_feed_text,
)
from cas_operator.types import Manifest

log = logging.getLogger(__name__)
WRITE_ATTEMPTS = 5
REASON_UNCONFIRMED = "PrefillEndUnconfirmed"


@dataclass(frozen=True)
class EndRecord:
    """What `record_prefill_end` did: `recorded` (the entry is in the feed), `unconfirmed`
    (not recorded, why in `detail`), `no_owner` (its resource is gone) or `conflict`."""

    outcome: str
    detail: str = ""


def _configmap(owner: Owner, entries: list[GoneEntry], resource_version: str | None) -> Manifest:
    meta: Manifest = {
        "name": prefill_gone_name(owner.name),
        "namespace": owner.namespace,
        "labels": base_labels(owner.name, c.APP_PREFILL_GONE),
        "ownerReferences": [owner_reference(owner)],
    }
    if resource_version:
        meta["resourceVersion"] = resource_version
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {c.PREFILL_GONE_KEY: feed_text(entries)},
    }


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
        if current is None:
            made = kube.create("ConfigMap", namespace, _configmap(owner, [decision], None))
            if made is not None:
                return EndRecord("recorded", decision.bootstrap)
            continue  # created by a concurrent end: merge into it
        old = parse_feed_text((current.get("data") or {}).get(c.PREFILL_GONE_KEY))
        entries = merge_entries(old, decision, now)
        version = str(current["metadata"].get("resourceVersion", ""))
        if kube.replace("ConfigMap", namespace, name, _configmap(owner, entries, version)):
            return EndRecord("recorded", decision.bootstrap)
    return EndRecord("conflict", f"{WRITE_ATTEMPTS} writes of {namespace}/{name} lost a race")
