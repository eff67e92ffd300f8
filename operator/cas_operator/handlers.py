"""kopf registrations only: each body hands the event to `passes.Passes` or the fleet tick.

- create, spec update, resume: one pass that applies everything (an invalid spec raises
  `PermanentError` once, after its Degraded/InvalidSpec status is written: no retry storm);
- a change of a child workload (Deployment, LeaderWorkerSet): queue one refresh of its owner;
- a prefill pod deleted: `prefillgone.act.record_prefill_end` records its confirmed end in the
  resource's prefill-gone ConfigMap, which decode pods read;
- at start-up, one fleet-wide loop (`fleet_tick.FleetTick`, every TICK_SECONDS): the anomaly
  and autoscale loops over every resource; its findings reach the passes in memory. Every
  SAFETY_NET_SECONDS the same loop queues a refresh of every resource as a safety net (a full
  apply every FULL_APPLY_SECONDS). Not a kopf timer: kopf puts its finalizer on every object a
  timer serves, so a resource deleted while no operator runs (uninstalled, scaled to zero)
  would never go, nor its namespace; nothing here needs a finalizer.
Workloads are read from watch-fed kopf indexes (async index functions: they run on kopf's
loop, never behind a handler in its executor), not listed.
The operator's state lives in two objects created here: `PASSES` and (at start-up) the fleet
tick; the API client and the metrics source are created lazily so importing needs no cluster.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import time
from typing import Any

import kopf

from cas_operator.api import constants as c
from cas_operator.api.limits import OperatorLimits
from cas_operator.fleet_tick import FleetTick
from cas_operator.kube import Kube, process_identity
from cas_operator.leader import LeaderElection
from cas_operator.metrics import GUARD_TICK_SECONDS, LEADER
from cas_operator.observe.prometheus import PrometheusSource
from cas_operator.observe.scrape import ScrapeSource
from cas_operator.observe.types import MetricsSource
from cas_operator.passes import Key, Passes, key_of
from cas_operator.prefillgone.act import record_prefill_end
from cas_operator.reconcile.status import ObservedWorkload, is_true

SAFETY_NET_SECONDS = 30.0  # a refresh of every resource; child events drive status
TICK_SECONDS = 5.0  # the fleet tick's period (one tick covers every resource)
FULL_APPLY_SECONDS = 300.0
# A spec pass whose applies failed is retried by kopf after 2, 4, 8 ... at most 30 s: a refusal
# is often brief (a just-installed CRD that the API server's admission has not mapped yet,
# an API server restart); the 30 s timer alone left a new fleet without children for a minute.
APPLY_RETRY_FIRST_S, APPLY_RETRY_MAX_S = 2.0, 30.0
PROMETHEUS_URL_ENV = "CAS_PROMETHEUS_URL"
CHILD_LABELS = {c.LABEL_MANAGED_BY: c.MANAGED_BY}
PREFILL_POD_LABELS = {**CHILD_LABELS, c.LABEL_ROLE: c.ROLE_PREFILL}


@functools.cache
def kube() -> Kube:
    """One shared client, created on first use."""
    return Kube()


@functools.cache
def metrics_source() -> MetricsSource:
    """Prometheus when CAS_PROMETHEUS_URL is set (production), else direct pod scrapes."""
    url = os.environ.get(PROMETHEUS_URL_ENV)
    return PrometheusSource(url) if url else ScrapeSource()


PASSES = Passes(kube, limits=OperatorLimits.from_env())
_tasks: list[asyncio.Task[None]] = []


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


@kopf.on.create(c.GROUP, c.VERSION, c.PLURAL)
@kopf.on.update(c.GROUP, c.VERSION, c.PLURAL, field="spec")
@kopf.on.resume(c.GROUP, c.VERSION, c.PLURAL)
def on_spec(
    body: kopf.Body,
    meta: kopf.Meta,
    spec: kopf.Spec,
    status: kopf.Status,
    logger: kopf.Logger,
    reason: str,
    **kwargs: Any,
) -> None:
    """Apply everything for the current spec; an invalid spec is reported once, not retried.

    On resume (operator start), a resource whose status says it was Ready at its current
    generation gets a light pass (workloads by spec-hash) and its full re-apply is spread over
    the next FULL_APPLY_SECONDS: a restart at N resources must not send N x 12 applies at once.
    """
    settled = reason == kopf.Reason.RESUME and in_sync(meta, status)
    if settled:
        PASSES.last_full_apply[str(meta["uid"])] = time.monotonic() - random.uniform(
            0.0, FULL_APPLY_SECONDS
        )
    key = key_of(meta)
    indexes = (kwargs["deployment_index"], kwargs["lws_index"])  # populated before handlers run
    outcome = PASSES.run(
        meta,
        spec,
        status,
        full=not settled,
        trigger="resume" if settled else "spec",
        observe=lambda: indexed_workloads(key, *indexes),
    )
    assert outcome is not None  # a spec pass waits for its turn
    PASSES.post(dict(body), outcome.events)
    if outcome.applied:
        logger.info("applied %d children", outcome.applied)
    if outcome.invalid is not None:
        PASSES.post(dict(body), [("Warning", c.REASON_INVALID_SPEC, str(outcome.invalid))])
        raise kopf.PermanentError(f"invalid spec: {outcome.invalid}")
    if outcome.failed:  # status says ApplyFailed with the server's answer; try again soon
        delay = min(APPLY_RETRY_MAX_S, APPLY_RETRY_FIRST_S * 2 ** int(kwargs.get("retry") or 0))
        raise kopf.TemporaryError(f"{outcome.failed} children not applied", delay=delay)


def in_sync(meta: Any, status: Any) -> bool:
    """The status was written for the current generation and says Ready."""
    current = dict(status or {})
    return current.get("observedGeneration") == meta.get("generation") and is_true(
        current, c.COND_READY
    )


@kopf.index(c.GROUP, c.VERSION, c.PLURAL)
async def serving_index(
    namespace: str | None, name: str | None, body: kopf.Body, **_: Any
) -> dict[tuple[str | None, str | None], dict[str, Any]]:
    """The latest copy of each resource, so a child's event finds its owner without a GET."""
    return {(namespace, name): dict(body)}


def _workload_entry(
    kind: str, namespace: str | None, labels: kopf.Labels, body: kopf.Body
) -> dict[Key, ObservedWorkload]:
    owner = labels.get(c.LABEL_NAME)
    if owner is None or namespace is None:
        return {}
    return {(namespace, owner): ObservedWorkload.from_object({**dict(body), "kind": kind})}


@kopf.index("apps", "v1", "deployments", labels=CHILD_LABELS)
async def deployment_index(
    namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Key, ObservedWorkload]:
    """Our Deployments by owner, as the watch last saw them (a reconcile reads them, no LIST).

    Index functions are async so kopf runs them on its event loop: as sync functions they
    queued in kopf's executor behind create handlers waiting on the API server, and the index
    lagged the watch by 30-70 s at N=200 (Ready followed the pods as late)."""
    return _workload_entry("Deployment", namespace, labels, body)


@kopf.index("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", labels=CHILD_LABELS)
async def lws_index(
    namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Key, ObservedWorkload]:
    """Our LeaderWorkerSets by owner, as the watch last saw them."""
    return _workload_entry("LeaderWorkerSet", namespace, labels, body)


def indexed_workloads(key: Key, *indexes: kopf.Index[Any, Any]) -> list[ObservedWorkload]:
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
    PASSES.child_changed((namespace, owner_name), deleted=kwargs["type"] == "DELETED")


@kopf.on.event("", "v1", "pods", labels=PREFILL_POD_LABELS)
async def on_prefill_pod_event(body: kopf.Body, **kwargs: Any) -> None:
    """A prefill pod's object went away: record in its resource's prefill-gone feed whether the
    kubelet confirmed its end (decode then frees the KV that pod can no longer write)."""
    if kwargs.get("type") != "DELETED":
        return
    record = await asyncio.to_thread(record_prefill_end, kube(), dict(body), time.time())
    logging.getLogger(__name__).info(
        "prefill pod %s/%s gone: %s %s",
        body.get("metadata", {}).get("namespace"),
        body.get("metadata", {}).get("name"),
        record.outcome,
        record.detail,
    )


async def lead() -> None:
    """With leader election on, wait until this process holds the Lease (kopf starts no
    watch before the startup handlers return), then keep it: every write of the operator's
    client is gated on it (`Kube.may_write`), and the process exits when it is lost."""
    where = os.environ.get(c.LEADER_ELECTION_ENV)
    if not where:
        return
    namespace, _, name = where.partition("/")
    # Its own client object (same connections): Lease calls carry their own timeouts, and
    # the gate below must not refuse the renewals themselves.
    election = LeaderElection(
        Kube(kube().api), namespace, name or "cas-operator", process_identity()
    )
    await asyncio.to_thread(election.acquire)
    kube().may_write = election.leading
    LEADER.set(1)
    election.keep(on_lost=lambda: os._exit(1))


@kopf.on.startup()
async def start_fleet_tick(**kwargs: Any) -> None:
    """Hold the Lease (leader election), wire the passes to the indexes and start the fleet
    tick every TICK_SECONDS."""
    await lead()
    serving, deployments, lws = (
        kwargs[k] for k in ("serving_index", "deployment_index", "lws_index")
    )
    PASSES.lookup = lambda key: list(serving.get(key, []))
    PASSES.workloads = lambda key: indexed_workloads(key, deployments, lws)
    tick = FleetTick(kube(), metrics_source, _post_event, on_change=_measured_changed)
    PASSES.measured_for = tick.measured_for
    _tasks.append(asyncio.create_task(_tick_loop(tick, serving)))


def _measured_changed(resource: dict[str, Any]) -> None:
    """The fleet tick's findings changed: a pass writes them (and re-plans) now."""
    PASSES.queue(key_of(resource["metadata"]))


def _post_event(body: dict[str, Any], event: tuple[str, str, str]) -> None:
    kube().post_event(body, *event)


@kopf.on.cleanup()
async def stop_fleet_tick(**_: Any) -> None:
    for task in _tasks:
        task.cancel()


def queue_safety_net(resources: list[dict[str, Any]], now: float) -> None:
    """Queue a refresh of every resource (re-applies drifted workloads), a full apply where the
    last one is FULL_APPLY_SECONDS old. Only queueing, on the event loop: a pass runs on the
    passes' own workers."""
    for body in resources:
        meta = body["metadata"]
        last = PASSES.last_full_apply.get(str(meta["uid"]))  # None: its create/resume is pending
        PASSES.queue(key_of(meta), full=last is not None and now - last > FULL_APPLY_SECONDS)


async def _tick_loop(tick: FleetTick, index: kopf.Index[Any, Any]) -> None:
    safety_net_at = time.monotonic() + SAFETY_NET_SECONDS
    while True:
        # A period, not a pause: a tick that took long (a large fleet) is followed at once,
        # after a breath for the event loop.
        await asyncio.sleep(max(1.0, TICK_SECONDS - tick.last_tick_seconds))
        resources = [body for key in list(index) for body in index.get(key, [])]
        if (now := time.monotonic()) >= safety_net_at:
            safety_net_at = now + SAFETY_NET_SECONDS
            queue_safety_net(resources, now)
        try:
            await asyncio.to_thread(tick.tick, resources)  # copies the context
        except Exception:  # a failed tick (e.g. API outage) is retried next period
            logging.getLogger(__name__).exception("fleet tick failed")
        GUARD_TICK_SECONDS.observe(tick.last_tick_seconds)


@kopf.on.delete(c.GROUP, c.VERSION, c.PLURAL, optional=True)
def on_delete(meta: kopf.Meta, **_: Any) -> None:
    """Children go with their owner reference; only forget our bookkeeping (no finalizer)."""
    PASSES.forget(meta)
