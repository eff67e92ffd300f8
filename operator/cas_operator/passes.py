"""The per-resource pass queue: every reconcile pass of a resource runs and writes status here.

Data flow: handlers.py (spec events, child-workload events, the timer) and the fleet tick
(`Passes.queue` when its findings changed) ask for passes -> a pass runs
`reconcile.core.reconcile` with the resource's watch-fed workloads (`observe`) and the fleet
tick's latest findings (`measured_for`) -> the status it computed is merge-patched here
(`status_patch`: the whole owned status when anything changed, so a condition and its evidence,
e.g. Degraded/FleetWideAnomaly and status.anomaly.fleetWide, always land together) -> its events
go through `Kube.post_event`.
Passes of one resource are serialized and each writes its own status before the next starts
(kopf's own status patch would land after the handler returned, possibly over a newer pass's
answer). A refresh that finds another pass of its resource running asks that pass to queue one
more instead of waiting (a refresh worker never idles behind a slow create). Refreshes are
coalesced while queued and run on `REFRESH_WORKERS` threads.
Ownership: everything below lives in one `Passes` object (created by handlers.py at import):
owner locks, the queued/rerun/full-due sets, when each resource was last applied and fully
applied, the status each was last written with, and which lost a child since its last pass.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from cas_operator.api import constants as c
from cas_operator.api.limits import OperatorLimits
from cas_operator.kube import Kube
from cas_operator.metrics import (
    RECONCILE_ERRORS,
    RECONCILE_SECONDS,
    REFRESH_WAIT_SECONDS,
    STATUS_WRITES,
    forget_fleet,
    record_fleet,
)
from cas_operator.reconcile import keys, ownership
from cas_operator.reconcile.core import Measured, Outcome, reconcile
from cas_operator.reconcile.status import ObservedWorkload, find_condition, status_patch
from cas_operator.types import Manifest, Status, rfc3339

log = logging.getLogger(__name__)
# A workload missing from the watch-fed index this soon after our own apply is one the watch
# has not delivered yet, not one someone deleted (that arrives as a DELETED event).
INDEX_SETTLE_SECONDS = 30.0
SPEC_TRIGGERS = ("spec", "resume")
# A refresh is one status PATCH (I/O-bound): enough workers that Ready writes do not queue
# behind each other while a burst of creates keeps the API server busy.
REFRESH_WORKERS = 12
# The status keys a pass owns: the reconcile's, and the fleet tick's sections it carries.
OWNED_STATUS_KEYS = (
    "observedGeneration",
    "revision",
    "servingRevision",
    "engineInput",
    "keysVersion",
    "heldRevision",
    "warnings",
    "conditions",
    "prefill",
    "decode",
    "ratio",
    "admission",
    "layerSplit",
    "gpus",
    "anomaly",
    "draining",
    "autoscaler",
    "rollout",
)
Key = tuple[str, str]  # (namespace, name)
Observe = Callable[[], list[ObservedWorkload]]


def owned(status: Any, keys: tuple[str, ...] = OWNED_STATUS_KEYS) -> Status:
    return {k: v for k, v in dict(status or {}).items() if k in keys}


def key_of(meta: Any) -> Key:
    return (str(meta["namespace"]), str(meta["name"]))


@dataclass
class Passes:
    """The pass queue of every resource (see the module docstring).

    `kube()` is the shared API client; `measured_for(uid, status)` the fleet tick's latest
    findings of a resource; `lookup(key)` the latest copies of a resource (kopf's index) and
    `workloads(key)` its watch-fed workloads, for refreshes (set once the indexes exist)."""

    kube: Callable[[], Kube]
    limits: OperatorLimits = OperatorLimits()  # the installer's bounds (api.limits)
    measured_for: Callable[[str, Status], Measured] = lambda uid, status: Measured.kept_in(status)
    lookup: Callable[[Key], list[Manifest]] | None = None
    workloads: Callable[[Key], list[ObservedWorkload]] | None = None
    last_full_apply: dict[str, float] = field(default_factory=dict)  # uid -> monotonic
    applied_at: dict[str, float] = field(default_factory=dict)  # uid -> our last apply
    child_deleted: set[Key] = field(default_factory=set)  # lost a workload since last pass
    written: dict[str, Status] = field(default_factory=dict)  # uid -> the status we wrote
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _owner_locks: dict[Key, threading.Lock] = field(default_factory=dict)
    _dirty: set[Key] = field(default_factory=set)  # a refresh is queued
    _rerun: set[Key] = field(default_factory=set)  # the running pass must queue one more
    _full_due: set[Key] = field(default_factory=set)  # the next refresh is a full apply
    _pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(REFRESH_WORKERS, thread_name_prefix="refresh")
    )

    def _owner_lock(self, key: Key) -> threading.Lock:
        with self._lock:
            return self._owner_locks.setdefault(key, threading.Lock())

    def run(
        self,
        meta: Any,
        spec: Any,
        status: Any,
        *,
        full: bool,
        trigger: str,
        observe: Observe | None = None,
        wait: bool = True,
    ) -> Outcome | None:
        """One pass for one resource, its status written here; returns the outcome, or None
        when `wait` is False and another pass of this resource is running (that pass then
        queues a refresh when it ends: measured at N=200, refreshes queued behind 3 s creates
        left resources NotReady 2 min). `observe` reads the workloads inside the lock; None
        lists them."""
        key = key_of(meta)
        lock = self._owner_lock(key)
        if wait:
            lock.acquire()
        else:
            with self._lock:  # atomic with the holder's release-and-check below
                if not lock.acquire(blocking=False):
                    self._rerun.add(key)
                    return None
        try:
            return self.locked_pass(meta, spec, status, full=full, trigger=trigger, observe=observe)
        finally:
            with self._lock:
                again = key in self._rerun
                self._rerun.discard(key)
                lock.release()
            if again:
                self.queue(key)

    def locked_pass(
        self,
        meta: Any,
        spec: Any,
        status: Any,
        *,
        full: bool,
        trigger: str,
        observe: Observe | None,
    ) -> Outcome:
        """The body of `run`, holding the resource's lock. The diff baseline is the status we
        last wrote (the event's copy may predate it); full passes diff against the object
        itself, which repairs a status changed by anyone else."""
        uid, (namespace, name) = str(meta["uid"]), key_of(meta)
        measured = self.measured_for(uid, dict(status or {}))
        started = time.monotonic()
        with self._lock:
            deleted = (namespace, name) in self.child_deleted
            self.child_deleted.discard((namespace, name))
        outcome = reconcile(
            self.kube(),
            name=name,
            namespace=namespace,
            uid=uid,
            generation=int(meta.get("generation", 0)),
            raw_spec=dict(spec),
            full_apply=full,
            observed=observe() if observe is not None else None,
            measured=measured,
            apply_missing=self.may_create(uid, trigger, deleted, started),
            previous=self.written.get(uid) or owned(status),
            limits=self.limits,
        )
        RECONCILE_SECONDS.labels(trigger).observe(time.monotonic() - started)
        if full:
            self.last_full_apply[uid] = time.monotonic()
        if outcome.applied or trigger in SPEC_TRIGGERS:
            self.applied_at[uid] = time.monotonic()
        degraded = find_condition(outcome.status, c.COND_DEGRADED)
        if degraded is not None and degraded["status"] == "True":
            RECONCILE_ERRORS.labels(degraded["reason"]).inc()
        baseline = owned(status)
        if not full:
            baseline = self.written.get(uid, baseline)
        changes = status_patch(baseline, outcome.status, rfc3339())
        if changes:
            self.kube().patch_status(c.KIND, namespace, name, changes)
            self.written[uid] = {**baseline, **changes}
            STATUS_WRITES.inc()
        record_fleet(namespace, name, outcome.status)
        return outcome

    def may_create(self, uid: str, trigger: str, deleted: bool, now: float) -> bool:
        """Whether a pass may create workloads missing from the index. Spec and resume passes
        create what is missing; other passes only after this process's spec or resume pass (a
        refresh queued by the fleet tick ran before the create handler and duplicated its
        applies) and once a workload was deleted or the index had time to catch up."""
        if trigger in SPEC_TRIGGERS:
            return True
        last = self.applied_at.get(uid)
        return last is not None and (deleted or now - last >= INDEX_SETTLE_SECONDS)

    def post(self, body: Manifest, events: list[tuple[str, str, str]]) -> None:
        """A pass's events, through the one event path (a failed post costs nothing else)."""
        for event_type, reason, message in events:
            try:
                self.kube().post_event(body, event_type, reason, message)
            except Exception:
                log.exception("event %s on %s not posted", reason, body["metadata"]["name"])

    def child_changed(self, key: Key, deleted: bool) -> None:
        """A child workload of `key` changed (or was deleted): queue one refresh."""
        if deleted:  # the pass re-creates it if it is still wanted
            with self._lock:
                self.child_deleted.add(key)
        self.queue(key)

    def queue(self, key: Key, full: bool = False) -> None:
        """Queue one pass of a resource (coalesced while queued); `full` asks for a full apply
        (kept until a pass of that resource runs)."""
        with self._lock:
            if full:
                self._full_due.add(key)
            if key in self._dirty or self.lookup is None:
                return
            self._dirty.add(key)
        # kopf's context travels with the work (its loggers read it).
        self._pool.submit(contextvars.copy_context().run, self.refresh, key, time.monotonic())

    def refresh(self, key: Key, queued: float) -> None:
        """Re-observe one resource after its children changed (or its timer fired) and write
        status if it changed; a full pass when one is due. The key leaves the queued set
        before the pass, so a change during the pass queues another."""
        with self._lock:
            self._dirty.discard(key)
            full = key in self._full_due
            self._full_due.discard(key)
        REFRESH_WAIT_SECONDS.observe(time.monotonic() - queued)
        assert self.lookup is not None and self.workloads is not None
        workloads = self.workloads
        try:
            for owner in self.lookup(key):
                if not self._alive_if_children_deleted(key, owner):
                    continue
                outcome = self.run(
                    owner["metadata"],
                    owner.get("spec", {}),
                    owner.get("status"),
                    full=full,
                    trigger="timer" if full else "refresh",
                    observe=lambda: workloads(key),
                    wait=False,
                )
                if outcome is None and full:  # the running pass re-queues; keep it due
                    with self._lock:
                        self._full_due.add(key)
                if outcome is not None:
                    self.post(owner, outcome.events)
        except Exception:  # the timer retries; a refresh must never kill the pool
            log.exception("status refresh of %s/%s failed", *key)

    def _alive_if_children_deleted(self, key: Key, owner: Manifest) -> bool:
        """A child's DELETED event lets the next pass re-create it; but the garbage collector
        deletes children because their owner is gone, and the index may still hold the owner:
        one GET says whether it (this incarnation) still exists and is not being deleted."""
        with self._lock:
            if key not in self.child_deleted:
                return True
        found = self.kube().get(c.KIND, *key)
        meta = (found or {}).get("metadata", {})
        if meta.get("uid") == owner["metadata"].get("uid") and not meta.get("deletionTimestamp"):
            return True
        with self._lock:
            self.child_deleted.discard(key)
        return False

    def forget(self, meta: Any) -> None:
        """The resource is gone: drop its bookkeeping (children go with their owner ref)."""
        uid, key = str(meta["uid"]), key_of(meta)
        for stamps in (self.last_full_apply, self.applied_at, self.written):
            stamps.pop(uid, None)
        keys.forget(uid)
        ownership.KNOWN.forget_owner(uid)
        forget_fleet(*key)
        with self._lock:
            self.child_deleted.discard(key)
            self._owner_locks.pop(key, None)
