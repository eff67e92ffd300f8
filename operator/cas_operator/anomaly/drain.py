"""The drain state machine of the anomaly loop (pure): what a pod out of rotation needs next.

Drain, as the pods record it:

    in rotation --start_drain--> Draining --running == 0, or grace over--> Replace: evicted
    (label cas.dev/serving=true)  (label removed; annotations |    with a known count    (its
                                   draining-since, drain-reason) |                  controller
                                                                 |                  makes a new pod)
                                                                 +-----> Drain: Held (state
                                                                          annotation), evicted
                                                                          after hold_seconds
Removal goes through the Eviction API (PodDisruptionBudgets hold; uid precondition); a pod
whose running count is unknown is never removed on the grace timer alone.
Every step is re-derived from the pods each tick (level-based), so a restarted operator
resumes drains in progress from what it observes, never from memory. This module reads pods
(`view_of`, `draining_since`) and decides (`next_step`, `draining_status`);
`anomaly.act` writes. A multi-node instance (LeaderWorkerSet group) is judged and drained as
its leader pod (`is_group_worker` marks the others).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from cas_operator.api import constants as c
from cas_operator.api.models import GuardAction
from cas_operator.observe.types import Observation, PodSignals, PodView
from cas_operator.types import Manifest, parse_time, rfc3339

ANNOTATION_DRAINING_SINCE: Final = "cas.dev/draining-since"

ANNOTATION_DRAIN_REASON: Final = "cas.dev/drain-reason"

ANNOTATION_DRAIN_STATE: Final = "cas.dev/drain-state"

ANNOTATION_EVICTION_BLOCKED: Final = "cas.dev/eviction-blocked"
STATE_DRAINING: Final = "Draining"

STATE_HELD: Final = "Held"

# A scale-down's instances (`cas_operator.scaledown` owns them; the anomaly drain leaves them
# alone): out of rotation until idle, then released to the workload's controller to remove.
STATE_RETIRING: Final = "Retiring"

STATE_RELEASED: Final = "Released"

RETIRE_STATES: Final = (STATE_RETIRING, STATE_RELEASED)


@dataclass(frozen=True)
class DrainPolicy:
    """How long a drain waits: at least `min_wait_seconds` (the router must see the label go and
    a scrape must postdate it, so "0 running" is not a reading from before the drain), at most
    `grace_seconds` for running requests to finish; Drain holds a pod `hold_seconds`."""

    min_wait_seconds: float = 15.0
    grace_seconds: float = 120.0
    hold_seconds: float = 3600.0


def drain_marks(reason: str, now: float) -> Manifest:
    """The metadata that takes a pod out of rotation: the serving label removed, and why and
    since when (a merge patch; `start_drain` sends it, the tick mirrors it on its copy)."""
    return {
        "labels": {c.LABEL_SERVING: None},
        "annotations": {
            ANNOTATION_DRAINING_SINCE: rfc3339(now),
            ANNOTATION_DRAIN_REASON: reason,
            ANNOTATION_DRAIN_STATE: STATE_DRAINING,
        },
    }


def _meta(pod: Manifest) -> dict[str, Any]:
    meta: dict[str, Any] = pod.get("metadata", {})
    return meta


def is_ready(pod: Manifest) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(cd.get("type") == "Ready" and cd.get("status") == "True" for cd in conditions)


def drain_state(pod: Manifest) -> str:
    """The drain state a pod out of rotation records (Draining when unset)."""
    state: str = _meta(pod).get("annotations", {}).get(ANNOTATION_DRAIN_STATE, STATE_DRAINING)
    return state


def draining_since(pod: Manifest) -> float | None:
    return parse_time(_meta(pod).get("annotations", {}).get(ANNOTATION_DRAINING_SINCE))


def is_group_worker(pod: Manifest) -> bool:
    """A non-leader pod of a multi-node (LeaderWorkerSet) instance."""
    index = _meta(pod).get("labels", {}).get(c.LWS_WORKER_INDEX_LABEL)
    return index is not None and index != "0"


def view_of(pod: Manifest, signals: PodSignals | None) -> PodView:
    meta = _meta(pod)
    return PodView(
        name=meta["name"],
        role=meta.get("labels", {}).get(c.LABEL_ROLE, ""),
        ready=is_ready(pod),
        serving=meta.get("labels", {}).get(c.LABEL_SERVING) == "true",
        draining_since=draining_since(pod),
        signals=signals,
    )


def next_step(
    pod: Manifest, running: float | None, action: GuardAction, now: float, policy: DrainPolicy
) -> str:
    """What a draining pod needs now: "wait", "hold", "delete" or "none" (pure).

    A pod whose running count is unknown (`running` None: its metrics are missing) is never
    removed on the grace timer alone: it waits, out of rotation, until a reading says 0 or
    shows what it runs (then the grace bounds the wait as usual)."""
    since = draining_since(pod)
    if since is None:
        return "none"
    state = drain_state(pod)
    if state in RETIRE_STATES:
        return "none"  # a scale-down's: the workload's controller removes it
    if state == STATE_HELD:
        return "delete" if now - since >= policy.hold_seconds else "none"
    if now - since < policy.min_wait_seconds:
        return "wait"
    if running is None:
        return "wait"
    if running > 0 and now - since < policy.grace_seconds:
        return "wait"
    return "hold" if action == GuardAction.DRAIN else "delete"


def _held(pod: Manifest) -> bool:
    return bool(_meta(pod).get("annotations", {}).get(ANNOTATION_DRAIN_STATE) == STATE_HELD)


def _drained_why(running: float | None) -> str:
    return "no running requests" if running == 0 else "grace period over"


def draining_status(pods: list[Manifest], observation: Observation) -> list[dict[str, Any]]:
    """`status.draining`: one entry per pod out of rotation by us, oldest first."""
    entries = []
    for pod in pods:
        meta = _meta(pod)
        ann = meta.get("annotations", {})
        if ANNOTATION_DRAINING_SINCE not in ann:
            continue
        signals = observation.signals.get(meta["name"])
        entry: dict[str, Any] = {
            "pod": meta["name"],
            "role": meta.get("labels", {}).get(c.LABEL_ROLE, ""),
            "reason": ann.get(ANNOTATION_DRAIN_REASON, ""),
            "since": ann[ANNOTATION_DRAINING_SINCE],
            "state": ann.get(ANNOTATION_DRAIN_STATE, STATE_DRAINING),
        }
        if signals is not None and signals.error is None and signals.running is not None:
            entry["runningRequests"] = int(signals.running)
        else:
            entry["stalled"] = "running requests unknown: not removed until they are measured"
        if ANNOTATION_EVICTION_BLOCKED in ann:
            entry["evictionBlockedSince"] = ann[ANNOTATION_EVICTION_BLOCKED]
        entries.append(entry)
    return sorted(entries, key=lambda e: (e["since"], e["pod"]))
