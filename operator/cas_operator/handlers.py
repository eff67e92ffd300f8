"""kopf registrations only: every entry point calls the same level-based `reconcile`.

Create, spec update and resume apply everything; a timer re-observes the children, applies a
workload only when its spec-hash drifted, re-applies everything every FULL_APPLY_SECONDS, and
writes status only when it changed. An invalid spec raises `PermanentError` (no retry storm)
after its Degraded/InvalidSpec status is patched.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime
from typing import Any

import kopf

from cas_operator.api import constants as c
from cas_operator.kube import Kube
from cas_operator.metrics import RECONCILE_ERRORS, RECONCILE_SECONDS, STATUS_WRITES
from cas_operator.reconcile import Outcome, reconcile
from cas_operator.status import status_patch

TIMER_SECONDS = 5.0
FULL_APPLY_SECONDS = 300.0
OWNED_STATUS_KEYS = ("observedGeneration", "revision", "conditions", "prefill", "decode",
                     "ratio", "layerSplit", "gpus")  # fmt: skip

_kube: Kube | None = None
_kube_lock = threading.Lock()
_last_full_apply: dict[str, float] = {}


def kube() -> Kube:
    """One shared client, created lazily so importing this module needs no cluster."""
    global _kube
    with _kube_lock:
        if _kube is None:
            _kube = Kube()
        return _kube


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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


def _run(
    *,
    body: kopf.Body,
    meta: kopf.Meta,
    spec: kopf.Spec,
    status: kopf.Status,
    patch: kopf.Patch,
    logger: logging.Logger | kopf.Logger,
    full: bool,
) -> Outcome:
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
    )
    RECONCILE_SECONDS.labels("full" if full else "timer").observe(time.monotonic() - started)
    if full:
        _last_full_apply[uid] = time.monotonic()
    degraded = outcome.status["conditions"][2]
    if degraded["status"] == "True":
        RECONCILE_ERRORS.labels(degraded["reason"]).inc()
    old = {k: v for k, v in dict(status).items() if k in OWNED_STATUS_KEYS}
    changes = status_patch(old, outcome.status, now_rfc3339())
    if changes:
        STATUS_WRITES.inc()
    for key, value in changes.items():
        patch.status[key] = value
    for event_type, reason, message in outcome.events:
        kopf.event(body, type=event_type, reason=reason, message=message)
    if outcome.applied:
        logger.info("applied %d children", outcome.applied)
    return outcome


@kopf.on.create(c.GROUP, c.VERSION, c.PLURAL)
@kopf.on.update(c.GROUP, c.VERSION, c.PLURAL, field="spec")
@kopf.on.resume(c.GROUP, c.VERSION, c.PLURAL)
def on_spec(
    body: kopf.Body,
    meta: kopf.Meta,
    spec: kopf.Spec,
    status: kopf.Status,
    patch: kopf.Patch,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    """Apply everything for the current spec; an invalid spec is reported once, not retried."""
    outcome = _run(
        body=body, meta=meta, spec=spec, status=status, patch=patch, logger=logger, full=True
    )
    if outcome.invalid is not None:
        kopf.event(body, type="Warning", reason=c.REASON_INVALID_SPEC, message=str(outcome.invalid))
        raise kopf.PermanentError(f"invalid spec: {outcome.invalid}")


@kopf.timer(c.GROUP, c.VERSION, c.PLURAL, interval=TIMER_SECONDS, initial_delay=TIMER_SECONDS)
def on_timer(
    body: kopf.Body,
    meta: kopf.Meta,
    spec: kopf.Spec,
    status: kopf.Status,
    patch: kopf.Patch,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    """Re-observe: status from children, drifted workloads re-applied, periodic full apply."""
    last = _last_full_apply.get(str(meta["uid"]), 0.0)
    full = time.monotonic() - last > FULL_APPLY_SECONDS
    _run(body=body, meta=meta, spec=spec, status=status, patch=patch, logger=logger, full=full)


@kopf.on.delete(c.GROUP, c.VERSION, c.PLURAL, optional=True)
def on_delete(meta: kopf.Meta, **_: Any) -> None:
    """Children go with their owner reference; only forget our bookkeeping (no finalizer)."""
    _last_full_apply.pop(str(meta["uid"]), None)
