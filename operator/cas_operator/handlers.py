"""kopf registrations only: every entry point calls the same level-based `reconcile`.

- create, spec update, resume: apply everything (an invalid spec raises `PermanentError`
  once, after its Degraded/InvalidSpec status is patched: no retry storm);
- a change of a child workload (Deployment, LeaderWorkerSet): queue one re-observation of its
  owner (coalesced while queued; 4 workers), re-apply a drifted workload, write status if it
  changed (so Ready follows pods within seconds, not a timer period);
- a timer: the same re-observation as a safety net, plus a full apply every FULL_APPLY_SECONDS;
- a second timer: the anomaly loop (observe -> decide -> act, `drain.guard_tick`), which writes
  only `status.anomaly` and `status.draining`; `reconcile` folds those into the conditions.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import kopf
from pydantic import ValidationError

from cas_operator.api import constants as c
from cas_operator.api.models import parse_spec
from cas_operator.drain import LoopState, TickResult, guard_tick
from cas_operator.kube import Kube
from cas_operator.metrics import RECONCILE_ERRORS, RECONCILE_SECONDS, STATUS_WRITES
from cas_operator.observe.prometheus import PrometheusSource
from cas_operator.observe.scrape import ScrapeSource
from cas_operator.observe.types import MetricsSource
from cas_operator.planning.anomaly import PoolCounts, ScaleBounds
from cas_operator.reconcile import Outcome, reconcile
from cas_operator.status import Status, status_patch

TIMER_SECONDS = 30.0  # a safety net: child events drive status
GUARD_SECONDS = 10.0
FULL_APPLY_SECONDS = 300.0
OWNED_STATUS_KEYS = ("observedGeneration", "revision", "conditions", "prefill", "decode",
                     "ratio", "layerSplit", "gpus")  # fmt: skip
ANOMALY_STATUS_KEYS = ("anomaly", "draining")
PROMETHEUS_URL_ENV = "CAS_PROMETHEUS_URL"
CHILD_LABELS = {c.LABEL_MANAGED_BY: c.MANAGED_BY}

_lock = threading.Lock()
_kube: Kube | None = None
_source: MetricsSource | None = None
_last_full_apply: dict[str, float] = {}
_guard_state: dict[str, LoopState] = {}
_dirty: set[tuple[str, str]] = set()  # owners with a status refresh queued
_refresh_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="refresh")


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
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300


def _reconcile(
    meta: Any, spec: Any, status: Any, *, full: bool, trigger: str
) -> tuple[Outcome, Status]:
    """One reconcile pass and the status to write (empty when nothing changed)."""
    uid = str(meta["uid"])
    started = time.monotonic()
    outcome = reconcile(
        kube(),
        name=str(meta["name"]),
        namespace=str(meta["namespace"]),
        uid=uid,
        generation=int(meta.get("generation", 0)),
        raw_spec=dict(spec),
        full_apply=full,
        anomaly=dict(status or {}).get("anomaly"),
    )
    RECONCILE_SECONDS.labels(trigger).observe(time.monotonic() - started)
    if full:
        _last_full_apply[uid] = time.monotonic()
    degraded = outcome.status["conditions"][2]
    if degraded["status"] == "True":
        RECONCILE_ERRORS.labels(degraded["reason"]).inc()
    changes = status_patch(owned(status, OWNED_STATUS_KEYS), outcome.status, now_rfc3339())
    if changes:
        STATUS_WRITES.inc()
    return outcome, changes


def _post(body: Any, events: list[tuple[str, str, str]]) -> None:
    for event_type, reason, message in events:
        kopf.event(body, type=event_type, reason=reason, message=message)


@kopf.on.create(c.GROUP, c.VERSION, c.PLURAL)
@kopf.on.update(c.GROUP, c.VERSION, c.PLURAL, field="spec")
@kopf.on.resume(c.GROUP, c.VERSION, c.PLURAL)
def on_spec(
    body: kopf.Body, meta: kopf.Meta, spec: kopf.Spec, status: kopf.Status, patch: kopf.Patch,
    logger: kopf.Logger, **_: Any,
) -> None:  # fmt: skip
    """Apply everything for the current spec; an invalid spec is reported once, not retried."""
    outcome, changes = _reconcile(meta, spec, status, full=True, trigger="spec")
    for key, value in changes.items():
        patch.status[key] = value
    _post(body, outcome.events)
    if outcome.applied:
        logger.info("applied %d children", outcome.applied)
    if outcome.invalid is not None:
        kopf.event(body, type="Warning", reason=c.REASON_INVALID_SPEC, message=str(outcome.invalid))
        raise kopf.PermanentError(f"invalid spec: {outcome.invalid}")


@kopf.timer(c.GROUP, c.VERSION, c.PLURAL, interval=TIMER_SECONDS, initial_delay=TIMER_SECONDS)
def on_timer(
    body: kopf.Body, meta: kopf.Meta, spec: kopf.Spec, status: kopf.Status, patch: kopf.Patch,
    **_: Any,
) -> None:  # fmt: skip
    """Safety net: re-observe, re-apply drifted workloads, full apply every few minutes."""
    full = time.monotonic() - _last_full_apply.get(str(meta["uid"]), 0.0) > FULL_APPLY_SECONDS
    outcome, changes = _reconcile(meta, spec, status, full=full, trigger="timer")
    for key, value in changes.items():
        patch.status[key] = value
    _post(body, outcome.events)


@kopf.index(c.GROUP, c.VERSION, c.PLURAL)
def serving_index(
    namespace: str | None, name: str | None, body: kopf.Body, **_: Any
) -> dict[tuple[str | None, str | None], dict[str, Any]]:
    """The latest copy of each resource, so a child's event finds its owner without a GET."""
    return {(namespace, name): dict(body)}


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS)
@kopf.on.event("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", labels=CHILD_LABELS)
def on_child_event(labels: kopf.Labels, namespace: str | None, **kwargs: Any) -> None:
    """A child workload changed: queue one refresh of its owner (coalesced while queued)."""
    owner_name = labels.get(c.LABEL_NAME)
    if kwargs.get("type") is None or owner_name is None or namespace is None:
        return  # kopf's initial listing: resume and the timer cover it
    key = (namespace, owner_name)
    with _lock:
        if key in _dirty:
            return
        _dirty.add(key)
    _refresh_pool.submit(_refresh_owner, key, kwargs["serving_index"])


def _refresh_owner(key: tuple[str, str], index: kopf.Index[Any, Any]) -> None:
    """Re-observe one resource after its children changed and write status if it changed.

    The key leaves the dirty set before the pass, so a change during the pass queues another.
    """
    with _lock:
        _dirty.discard(key)
    namespace, name = key
    try:
        for owner in index.get(key, []):
            outcome, changes = _reconcile(
                owner["metadata"], owner.get("spec", {}), owner.get("status"),
                full=False, trigger="child",
            )  # fmt: skip
            if outcome.invalid is None and changes:
                kube().patch_status(c.KIND, namespace, name, changes)
            _post(owner, outcome.events)
    except Exception:  # the timer retries; a refresh must never kill the pool
        logging.getLogger(__name__).exception("status refresh of %s/%s failed", namespace, name)


@kopf.timer(c.GROUP, c.VERSION, c.PLURAL, interval=GUARD_SECONDS, initial_delay=GUARD_SECONDS)
def on_guard_timer(
    body: kopf.Body, meta: kopf.Meta, spec: kopf.Spec, status: kopf.Status, patch: kopf.Patch,
    **_: Any,
) -> None:  # fmt: skip
    """The anomaly loop for one resource: drains, fleet-wide incidents, pressure hints."""
    try:
        parsed = parse_spec(dict(spec))
    except ValidationError:
        return  # the spec handlers report it
    current = dict(status or {})
    result = guard_tick(
        kube(),
        metrics_source(),
        name=str(meta["name"]),
        namespace=str(meta["namespace"]),
        spec=parsed.anomaly_guard,
        state=_guard_state.setdefault(str(meta["uid"]), LoopState()),
        now=time.time(),
        counts=pool_counts(current),
        bounds=ScaleBounds(parsed.ratio.min, parsed.ratio.max, parsed.ratio.gpu_budget),
    )
    _post(body, result.events)
    desired = anomaly_status(result)
    for key, value in desired.items():
        if current.get(key) != value:
            patch.status[key] = value


def pool_counts(status: Status) -> PoolCounts | None:
    """Desired and ready instances per pool from our own status (None before the first pass)."""
    prefill, decode = status.get("prefill"), status.get("decode")
    if not prefill or not decode:
        return None
    return PoolCounts(
        prefill=int(prefill["replicas"]),
        decode=int(decode["replicas"]),
        prefill_ready=int(prefill.get("readyReplicas", 0)),
        decode_ready=int(decode.get("readyReplicas", 0)),
        prefill_gpus=int(prefill.get("gpusPerInstance", 1)),
        decode_gpus=int(decode.get("gpusPerInstance", 1)),
    )


def anomaly_status(result: TickResult) -> Status:
    """`status.anomaly` and `status.draining` from one tick (the conditions derive from them)."""
    rates = {role: rate for role, rate in result.pool_rate.items() if rate is not None}
    worst = max(rates.values(), default=None)
    anomaly: dict[str, Any] = {
        "rate": f"{worst:.3%}" if worst is not None else "n/a",
        "pools": {role: round(rate, 6) for role, rate in rates.items()},
        "fleetWide": result.degraded,
        "signalUnavailable": result.unavailable,
    }
    if result.scale is not None:
        hint = result.scale.hint
        anomaly["pressure"] = {
            "note": result.scale.note,
            "suggested": f"{hint.prefill}:{hint.decode}" if hint else None,
        }
    return {"anomaly": anomaly, "draining": result.draining}


@kopf.on.delete(c.GROUP, c.VERSION, c.PLURAL, optional=True)
def on_delete(meta: kopf.Meta, **_: Any) -> None:
    """Children go with their owner reference; only forget our bookkeeping (no finalizer)."""
    uid = str(meta["uid"])
    _last_full_apply.pop(uid, None)
    _guard_state.pop(uid, None)
