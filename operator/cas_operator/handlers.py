"""kopf registrations only: every entry point calls the same level-based `reconcile`.

- create, spec update, resume: apply everything (an invalid spec raises `PermanentError`
  once, after its Degraded/InvalidSpec status is patched: no retry storm);
- a change of a child workload (Deployment, LeaderWorkerSet): queue one re-observation of its
  owner (coalesced while queued; REFRESH_WORKERS), re-apply a drifted workload, write status if it
  changed (so Ready follows pods within seconds, not a timer period);
- a timer: queues the same re-observation as a safety net, a full apply every
  FULL_APPLY_SECONDS;
- one fleet-wide loop started at start-up, every GUARD_SECONDS: the anomaly loop and Auto mode
  (`fleet_guard.FleetGuard`: one pod LIST per namespace, then observe -> decide -> act per
  resource), which writes only `status.anomaly`, `status.draining` and `status.autoscaler`
  and hands its findings to the passes in memory (`measured_for`), queueing a pass when they
  change; `reconcile` folds them into the pools and conditions.
Workloads are read from watch-fed kopf indexes (async index functions: they run on kopf's
loop, never behind a handler in its executor), not listed; a pass's own applies are read from
the server's answers, and a workload missing from the index is only re-created once the index
had time to catch up or after a DELETED event (`_may_create`). Passes
of one resource are serialized and each writes its own status (`_pass`), so an older pass can
never land its answer over a newer one.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import kopf

from cas_operator.api import constants as c
from cas_operator.fleet_guard import FleetGuard
from cas_operator.kube import Kube
from cas_operator.metrics import (
    GUARD_TICK_SECONDS,
    RECONCILE_ERRORS,
    RECONCILE_SECONDS,
    REFRESH_WAIT_SECONDS,
    STATUS_WRITES,
)
from cas_operator.observe.prometheus import PrometheusSource
from cas_operator.observe.scrape import ScrapeSource
from cas_operator.observe.types import MetricsSource
from cas_operator.reconcile import Measured, Outcome, reconcile
from cas_operator.status import ObservedWorkload, Status, status_patch

TIMER_SECONDS = 30.0  # a safety net: child events drive status
GUARD_SECONDS = 5.0  # the anomaly loop's period (one tick covers every resource)
FULL_APPLY_SECONDS = 300.0
# A workload missing from the watch-fed index this soon after our own apply is one the watch
# has not delivered yet, not one someone deleted (that arrives as a DELETED event).
INDEX_SETTLE_SECONDS = 30.0
SPEC_TRIGGERS = ("spec", "resume")
# A refresh is one status PATCH (I/O-bound): enough workers that Ready writes do not queue
# behind each other while a burst of creates keeps the API server busy.
REFRESH_WORKERS = 12
OWNED_STATUS_KEYS = ("observedGeneration", "revision", "conditions", "prefill", "decode",
                     "ratio", "layerSplit", "gpus")  # fmt: skip
PROMETHEUS_URL_ENV = "CAS_PROMETHEUS_URL"
CHILD_LABELS = {c.LABEL_MANAGED_BY: c.MANAGED_BY}

_lock = threading.Lock()
_kube: Kube | None = None
_source: MetricsSource | None = None
_last_full_apply: dict[str, float] = {}
_applied_at: dict[str, float] = {}  # uid -> when a pass of ours last applied a child
_child_deleted: set[tuple[str, str]] = set()  # owners that lost a workload since their last pass
_guard_task: list[asyncio.Task[None]] = []
_fleet_guard: FleetGuard | None = None
_indexes: list[kopf.Index[Any, Any]] = []  # serving, deployment, LWS (set at start-up)
_owner_locks: dict[tuple[str, str], threading.Lock] = {}
_written: dict[str, Status] = {}  # uid -> the owned status keys as we last wrote them
_dirty: set[tuple[str, str]] = set()  # owners with a status refresh queued
_rerun: set[tuple[str, str]] = set()  # owners whose running pass must queue one more
_full_due: set[tuple[str, str]] = set()  # owners whose next refresh is a full apply
_refresh_pool = ThreadPoolExecutor(max_workers=REFRESH_WORKERS, thread_name_prefix="refresh")


def kube() -> Kube:
    """One shared client, created lazily so importing this module needs no cluster."""
    global _kube
    with _lock:
        if _kube is None:
            _kube = Kube()
        return _kube


def metrics_source() -> MetricsSource:
    """Prometheus when CAS_PROMETHEUS_URL is set (production), else direct pod scrapes."""
    global _source
    with _lock:
        if _source is None:
            url = os.environ.get(PROMETHEUS_URL_ENV)
            _source = PrometheusSource(url) if url else ScrapeSource()
        return _source


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def owned(status: Any, keys: tuple[str, ...]) -> Status:
    return {k: v for k, v in dict(status or {}).items() if k in keys}


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="cas.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="cas.dev", key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = 16
    # kopf waits this long for the watch to deliver its own annotation patch before it acts on
    # an older copy; at the default 5 s a loaded API server's watch lag made it run the create
    # handler a second time (bench-operator N=200: 421 spec passes for 200 creates).
    settings.persistence.consistency_timeout = 60.0
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300


def _owner_lock(key: tuple[str, str]) -> threading.Lock:
    with _lock:
        return _owner_locks.setdefault(key, threading.Lock())


def _pass(
    meta: Any,
    spec: Any,
    status: Any,
    *,
    full: bool,
    trigger: str,
    observe: Callable[[], list[ObservedWorkload]] | None = None,
    wait: bool = True,
) -> Outcome | None:
    """One reconcile pass for one owner, its status written here; returns the outcome, or
    None when `wait` is False and another pass of this owner is running: that pass then
    queues a refresh when it ends, so a refresh worker never idles behind a slow create
    (measured at N=200: refreshes queued behind 3 s creates left resources NotReady 2 min).

    Passes of one owner are serialized and each writes the status it computed before the next
    starts (kopf's own status patch would land after the handler returned, possibly over a
    newer pass's answer). Since every child change queues a pass that starts after it, the
    last write reflects the last change. `observe` reads the workloads (the watch-fed indexes)
    inside the lock; None lists them. The anomaly loop's latest findings come from its memory
    (`measured_for`), not from the event's status copy, which may predate them. The diff
    baseline is the status we last wrote (the event's copy may predate it); full passes diff
    against the object itself, which repairs a status changed by anyone else.
    """
    key = (str(meta["namespace"]), str(meta["name"]))
    lock = _owner_lock(key)
    if wait:
        lock.acquire()
    else:
        with _lock:  # atomic with the holder's release-and-check below: no request is lost
            if not lock.acquire(blocking=False):
                _rerun.add(key)
                return None
    try:
        return _locked_pass(meta, spec, status, full=full, trigger=trigger, observe=observe)
    finally:
        with _lock:
            again = key in _rerun
            _rerun.discard(key)
            lock.release()
        if again:
            _queue_refresh(key)


def _locked_pass(
    meta: Any,
    spec: Any,
    status: Any,
    *,
    full: bool,
    trigger: str,
    observe: Callable[[], list[ObservedWorkload]] | None,
) -> Outcome:
    """The body of `_pass`, run while holding the owner's lock."""
    uid, name, namespace = str(meta["uid"]), str(meta["name"]), str(meta["namespace"])
    current = dict(status or {})
    measured = (
        _fleet_guard.measured_for(uid, current)
        if _fleet_guard is not None
        else Measured(anomaly=current.get("anomaly"))
    )
    started = time.monotonic()
    with _lock:
        deleted = (namespace, name) in _child_deleted
        _child_deleted.discard((namespace, name))
    outcome = reconcile(
        kube(),
        name=name,
        namespace=namespace,
        uid=uid,
        generation=int(meta.get("generation", 0)),
        raw_spec=dict(spec),
        full_apply=full,
        anomaly=measured.anomaly,
        observed=observe() if observe is not None else None,
        measured=measured,
        apply_missing=_may_create(uid, trigger, deleted, started),
    )
    RECONCILE_SECONDS.labels(trigger).observe(time.monotonic() - started)
    if full:
        _last_full_apply[uid] = time.monotonic()
    if outcome.applied or trigger in SPEC_TRIGGERS:
        _applied_at[uid] = time.monotonic()
    degraded = outcome.status["conditions"][2]
    if degraded["status"] == "True":
        RECONCILE_ERRORS.labels(degraded["reason"]).inc()
    baseline = owned(status, OWNED_STATUS_KEYS)
    if not full:
        baseline = _written.get(uid, baseline)
    changes = status_patch(baseline, outcome.status, now_rfc3339())
    if changes:
        kube().patch_status(c.KIND, namespace, name, changes)
        _written[uid] = {**baseline, **changes}
        STATUS_WRITES.inc()
    return outcome


def _may_create(uid: str, trigger: str, deleted: bool, now: float) -> bool:
    """Whether a pass may create workloads missing from the index. Spec and resume passes
    create what is missing; other passes only after this process's spec or resume pass (a
    refresh queued by the anomaly loop ran before the create handler and duplicated its
    applies) and once a workload was deleted or the index had time to catch up."""
    if trigger in SPEC_TRIGGERS:
        return True
    last = _applied_at.get(uid)
    return last is not None and (deleted or now - last >= INDEX_SETTLE_SECONDS)


def _post(body: Any, events: list[tuple[str, str, str]]) -> None:
    for event_type, reason, message in events:
        kopf.event(body, type=event_type, reason=reason, message=message)


@kopf.on.create(c.GROUP, c.VERSION, c.PLURAL)
@kopf.on.update(c.GROUP, c.VERSION, c.PLURAL, field="spec")
@kopf.on.resume(c.GROUP, c.VERSION, c.PLURAL)
def on_spec(
    body: kopf.Body, meta: kopf.Meta, spec: kopf.Spec, status: kopf.Status, logger: kopf.Logger,
    reason: str, **kwargs: Any,
) -> None:  # fmt: skip
    """Apply everything for the current spec; an invalid spec is reported once, not retried.

    On resume (operator start), a resource whose status says it was Ready at its current
    generation gets a light pass (workloads by spec-hash) and its full re-apply is spread over
    the next FULL_APPLY_SECONDS: a restart at N resources must not send N x 12 applies at once.
    """
    settled = reason == kopf.Reason.RESUME and in_sync(meta, status)
    if settled:
        _last_full_apply[str(meta["uid"])] = time.monotonic() - random.uniform(
            0.0, FULL_APPLY_SECONDS
        )
    owner = (str(meta["namespace"]), str(meta["name"]))
    indexes = (kwargs["deployment_index"], kwargs["lws_index"])  # populated before handlers run
    outcome = _pass(
        meta, spec, status, full=not settled, trigger="resume" if settled else "spec",
        observe=lambda: indexed_workloads(owner, *indexes),
    )  # fmt: skip
    assert outcome is not None  # a spec pass waits for its turn
    _post(body, outcome.events)
    if outcome.applied:
        logger.info("applied %d children", outcome.applied)
    if outcome.invalid is not None:
        kopf.event(body, type="Warning", reason=c.REASON_INVALID_SPEC, message=str(outcome.invalid))
        raise kopf.PermanentError(f"invalid spec: {outcome.invalid}")


def in_sync(meta: Any, status: Any) -> bool:
    """The status was written for the current generation and says Ready."""
    current = dict(status or {})
    if current.get("observedGeneration") != meta.get("generation"):
        return False
    return any(cd.get("type") == c.COND_READY and cd.get("status") == "True"
               for cd in current.get("conditions", []))  # fmt: skip


@kopf.timer(c.GROUP, c.VERSION, c.PLURAL, interval=TIMER_SECONDS, initial_delay=TIMER_SECONDS)
async def on_timer(meta: kopf.Meta, **_: Any) -> None:
    """Safety net: queue a re-observation (re-applies drifted workloads), a full apply every
    FULL_APPLY_SECONDS. Async and only queueing, like the child events: a sync timer held one
    of kopf's executor threads per pass, and kopf runs sync index functions on that executor."""
    last = _last_full_apply.get(str(meta["uid"]))  # None: its create/resume pass is pending
    full = last is not None and time.monotonic() - last > FULL_APPLY_SECONDS
    _queue_refresh((str(meta["namespace"]), str(meta["name"])), full=full)


@kopf.index(c.GROUP, c.VERSION, c.PLURAL)
async def serving_index(
    namespace: str | None, name: str | None, body: kopf.Body, **_: Any
) -> dict[tuple[str | None, str | None], dict[str, Any]]:
    """The latest copy of each resource, so a child's event finds its owner without a GET."""
    return {(namespace, name): dict(body)}


def _workload_entry(
    kind: str, namespace: str | None, labels: kopf.Labels, body: kopf.Body
) -> dict[tuple[str, str], ObservedWorkload]:
    owner = labels.get(c.LABEL_NAME)
    if owner is None or namespace is None:
        return {}
    return {(namespace, owner): ObservedWorkload.from_object({**dict(body), "kind": kind})}


@kopf.index("apps", "v1", "deployments", labels=CHILD_LABELS)
async def deployment_index(
    namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[tuple[str, str], ObservedWorkload]:
    """Our Deployments by owner, as the watch last saw them (a reconcile reads them, no LIST).

    Index functions are async so kopf runs them on its event loop: as sync functions they
    queued in kopf's executor behind create handlers waiting on the API server, and the index
    lagged the watch by 30-70 s at N=200 (Ready followed the pods as late)."""
    return _workload_entry("Deployment", namespace, labels, body)


@kopf.index("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", labels=CHILD_LABELS)
async def lws_index(
    namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[tuple[str, str], ObservedWorkload]:
    """Our LeaderWorkerSets by owner, as the watch last saw them."""
    return _workload_entry("LeaderWorkerSet", namespace, labels, body)


def indexed_workloads(
    key: tuple[str, str], *indexes: kopf.Index[Any, Any]
) -> list[ObservedWorkload]:
    """Every indexed workload of one owner (kopf keeps the indexes current from the watches)."""
    return [w for index in indexes for w in index.get(key, [])]


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS)
@kopf.on.event("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", labels=CHILD_LABELS)
async def on_child_event(labels: kopf.Labels, namespace: str | None, **kwargs: Any) -> None:
    """A child workload changed: queue one refresh of its owner (coalesced while queued).

    Async on purpose: it only queues, so it runs on kopf's event loop instead of waiting for a
    thread of kopf's executor behind timer passes (measured: seconds at N=200)."""
    owner_name = labels.get(c.LABEL_NAME)
    if kwargs.get("type") is None or owner_name is None or namespace is None:
        return  # kopf's initial listing: resume and the timer cover it
    if kwargs["type"] == "DELETED":  # the pass re-creates it if it is still wanted
        with _lock:
            _child_deleted.add((namespace, owner_name))
    _queue_refresh((namespace, owner_name))


def _queue_refresh(key: tuple[str, str], full: bool = False) -> None:
    """Queue one pass of a resource on the refresh pool (coalesced while queued); `full` asks
    for a full apply (kept until a pass of that owner runs)."""
    with _lock:
        if full:
            _full_due.add(key)
        if key in _dirty or not _indexes:
            return
        _dirty.add(key)
    # kopf's context (its event poster) must travel with the work, or kopf.event fails there.
    _refresh_pool.submit(
        contextvars.copy_context().run, _refresh_owner, key, tuple(_indexes), time.monotonic()
    )


def _refresh_owner(
    key: tuple[str, str], indexes: tuple[kopf.Index[Any, Any], ...], queued: float
) -> None:
    """Re-observe one resource after its children changed (or its timer fired) and write
    status if it changed; a full pass when one is due.

    The key leaves the dirty set before the pass, so a change during the pass queues another.
    The workloads come from the watch-fed indexes (kopf updates them before this was queued).
    """
    with _lock:
        _dirty.discard(key)
        full = key in _full_due
        _full_due.discard(key)
    REFRESH_WAIT_SECONDS.observe(time.monotonic() - queued)
    namespace, name = key
    index, *workload_indexes = indexes
    try:
        for owner in index.get(key, []):
            if not _alive_if_children_deleted(key, owner):
                continue
            outcome = _pass(
                owner["metadata"], owner.get("spec", {}), owner.get("status"),
                full=full, trigger="timer" if full else "refresh",
                observe=lambda: indexed_workloads(key, *workload_indexes), wait=False,
            )  # fmt: skip
            if outcome is None and full:  # the running pass re-queues; keep the full apply due
                with _lock:
                    _full_due.add(key)
            if outcome is not None:
                _post(owner, outcome.events)
    except Exception:  # the timer retries; a refresh must never kill the pool
        logging.getLogger(__name__).exception("status refresh of %s/%s failed", namespace, name)


def _alive_if_children_deleted(key: tuple[str, str], owner: dict[str, Any]) -> bool:
    """A child's DELETED event lets the next pass re-create it; but the garbage collector
    deletes children because their owner is gone, and the index may still hold the owner: one
    GET says whether it (this incarnation) still exists and is not being deleted."""
    with _lock:
        if key not in _child_deleted:
            return True
    found = kube().get(c.KIND, *key)
    meta = (found or {}).get("metadata", {})
    if meta.get("uid") == owner["metadata"].get("uid") and not meta.get("deletionTimestamp"):
        return True
    with _lock:
        _child_deleted.discard(key)
    return False


@kopf.on.startup()
async def start_fleet_guard(**kwargs: Any) -> None:
    """Start the anomaly loop: every GUARD_SECONDS one `FleetGuard.tick` over every resource
    (in a thread; kopf's context is copied so events can be posted from it)."""
    global _fleet_guard
    _indexes.extend((kwargs["serving_index"], kwargs["deployment_index"], kwargs["lws_index"]))
    _fleet_guard = FleetGuard(kube(), metrics_source, _post_event, on_change=_measured_changed)
    _guard_task.append(asyncio.create_task(_guard_loop(_fleet_guard, kwargs["serving_index"])))


def _measured_changed(resource: dict[str, Any]) -> None:
    """The anomaly loop measured new load or Auto stepped: re-plan the resource now."""
    meta = resource["metadata"]
    _queue_refresh((str(meta["namespace"]), str(meta["name"])))


@kopf.on.cleanup()
async def stop_fleet_guard(**_: Any) -> None:
    for task in _guard_task:
        task.cancel()


async def _guard_loop(guard: FleetGuard, index: kopf.Index[Any, Any]) -> None:
    while True:
        # A period, not a pause: a tick that took long (a large fleet) is followed at once,
        # after a breath for the event loop.
        await asyncio.sleep(max(1.0, GUARD_SECONDS - guard.last_tick_seconds))
        resources = [body for key in list(index) for body in index.get(key, [])]
        try:
            await asyncio.to_thread(guard.tick, resources)  # copies the context
        except Exception:  # a failed tick (e.g. API outage) is retried next period
            logging.getLogger(__name__).exception("anomaly tick failed")
        GUARD_TICK_SECONDS.observe(guard.last_tick_seconds)


def _post_event(body: dict[str, Any], event: tuple[str, str, str]) -> None:
    kube().post_event(body, *event)


@kopf.on.delete(c.GROUP, c.VERSION, c.PLURAL, optional=True)
def on_delete(meta: kopf.Meta, **_: Any) -> None:
    """Children go with their owner reference; only forget our bookkeeping (no finalizer)."""
    uid = str(meta["uid"])
    _last_full_apply.pop(uid, None)  # the fleet guard forgets its state on its next tick
    _applied_at.pop(uid, None)
    _written.pop(uid, None)
    with _lock:
        _child_deleted.discard((str(meta["namespace"]), str(meta["name"])))
        _owner_locks.pop((str(meta["namespace"]), str(meta["name"])), None)
