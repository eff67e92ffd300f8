"""Leader election on a coordination.k8s.io/v1 Lease: the holder stops acting before any
standby may take over, whatever the API server or the network does meanwhile.

Timeline (defaults; every time is this process's monotonic clock, never a wall clock compared
with another host's):
- the holder renews every `retry_seconds` (2 s). A renewal started at t that succeeds keeps
  it leading until t + `renew_deadline_seconds` (10 s). Past that without a newer success,
  `leading()` is False, so `Kube` sends no write (`Kube.may_write`), and a watchdog thread
  (not the renew thread, which may sit in a call) calls `on_lost` (the operator exits at once).
  Each Lease call times out at that deadline, so a hung API server never holds a renewal past
  it; the holder also stops as soon as it reads another holder;
- a standby takes the Lease only once it has seen the same record (holder, renewTime,
  resourceVersion) unchanged for `duration_seconds` (15 s, or the Lease's own if longer), by
  its own clock, as client-go does. The holder's last successful write came after that
  renewal started, so the earliest takeover is t + 15 s: 5 s after the holder stopped.
Writes carry the Lease's resourceVersion, so of two candidates taking it at once exactly one
succeeds (the API server answers the other 409).

Not `kubernetes.leaderelection` (client 37.0.3, checked in its source): its Lease calls have no
timeout (a hung renewal blocks past its renew deadline), its deadlines read `time.time()`, and
it has no "still leading" to gate writes with.

What the gate does not cover: kopf's own requests (its annotations on the resource, its
events), which end when the process exits at the deadline; and a request sent before the
deadline that the network delivers more than 5 s late (Kubernetes has no fencing token).

`next_step` and `observe` decide (pure); `LeaderElection` does the I/O through its own `Kube`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import Enum
from typing import Any

from cas_operator.kube import Kube
from cas_operator.types import Manifest

log = logging.getLogger(__name__)
STANDBY_CALL_TIMEOUT_S = 10.0  # a standby's Lease calls (it acts on nothing)


class Step(Enum):
    CREATE = "create"  # no Lease yet
    RENEW = "renew"  # ours
    TAKE = "take"  # someone else's, unchanged for the Lease duration (or released)
    WAIT = "wait"  # someone else's, live


@dataclass(frozen=True)
class Seen:
    """A Lease record as this process saw it, and since when (its monotonic clock)."""

    record: tuple[str, str, str]  # holder, renewTime, resourceVersion
    since: float


def observe(lease: Manifest | None, seen: Seen | None, now: float) -> Seen | None:
    """The record `lease` holds, first seen at `now` unless `seen` already had it (pure)."""
    if lease is None:
        return None
    spec = lease.get("spec") or {}
    record = (
        str(spec.get("holderIdentity") or ""),
        str(spec.get("renewTime") or ""),
        str((lease.get("metadata") or {}).get("resourceVersion") or ""),
    )
    return seen if seen is not None and seen.record == record else Seen(record, now)


def next_step(
    lease: Manifest | None, identity: str, seen: Seen | None, now: float, duration: float
) -> Step:
    """What a candidate does with the Lease as read (pure): take another's only once its
    record has not changed for the Lease duration by this process's clock."""
    if lease is None:
        return Step.CREATE
    spec = lease.get("spec") or {}
    holder = spec.get("holderIdentity")
    if holder == identity:
        return Step.RENEW
    if not holder:
        return Step.TAKE
    duration = max(duration, float(spec.get("leaseDurationSeconds") or 0))
    if seen is not None and now - seen.since >= duration:
        return Step.TAKE
    return Step.WAIT


def micro_time(at: float) -> str:
    """A Lease's MicroTime (RFC 3339 with microseconds, UTC)."""
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class LeaderElection:
    kube: Kube
    namespace: str
    name: str
    identity: str
    duration_seconds: float = 15.0
    renew_deadline_seconds: float = 10.0
    retry_seconds: float = 2.0
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time  # only for the times written into the Lease
    _stop: threading.Event = field(default_factory=threading.Event)
    _seen: Seen | None = None
    _leading_until: float = float("-inf")  # monotonic; leading while clock() is before it
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if not self.retry_seconds < self.renew_deadline_seconds < self.duration_seconds:
            raise ValueError("need retry < renew deadline < lease duration")

    def leading(self) -> bool:
        """Whether this process may act now (the gate `Kube.may_write` reads)."""
        return self.clock() < self._leading_until

    def body(self, lease: Manifest | None, step: Step, now: float) -> Manifest:
        spec: dict[str, Any] = dict((lease or {}).get("spec") or {})
        if step != Step.RENEW:
            spec["acquireTime"] = micro_time(now)
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (
                1 if step == Step.TAKE else 0
            )
        spec.update(
            holderIdentity=self.identity,
            leaseDurationSeconds=int(self.duration_seconds),
            renewTime=micro_time(now),
        )
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if lease is not None:
            meta["resourceVersion"] = lease["metadata"]["resourceVersion"]
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": meta,
            "spec": spec,
        }

    def attempt(self) -> Step | None:
        """One attempt to take or renew; None when this process holds the Lease now (leading
        until this attempt's start + the renew deadline), else the step that did not get it
        (WAIT: another holds it; the others: another wrote it first)."""
        started = self.clock()
        left = self._leading_until - started
        timeout = left if left > 0 else STANDBY_CALL_TIMEOUT_S
        kube = self.kube.with_timeout(timeout)
        lease = kube.get("Lease", self.namespace, self.name)
        self._seen = observe(lease, self._seen, self.clock())
        step = next_step(lease, self.identity, self._seen, self.clock(), self.duration_seconds)
        if step == Step.WAIT:
            return step
        body = self.body(lease, step, self.wall())
        if step == Step.CREATE:
            written = kube.create("Lease", self.namespace, body)
        else:
            written = kube.replace("Lease", self.namespace, self.name, body)
        if written is None:
            return step
        with self._lock:
            self._leading_until = max(self._leading_until, started + self.renew_deadline_seconds)
        return None

    def acquire(self) -> None:
        """Block until this process holds the Lease."""
        announced = False
        while not self._stop.is_set():
            try:
                if self.attempt() is None:
                    log.info("leading: Lease %s/%s is ours", self.namespace, self.name)
                    return
            except Exception as exc:  # the API server may be briefly unreachable
                log.warning("leader election: %s", exc)
            if not announced:
                log.info("standing by: Lease %s/%s is held by another", self.namespace, self.name)
                announced = True
            self._stop.wait(self.retry_seconds)

    def keep(self, on_lost: Callable[[], None]) -> list[threading.Thread]:
        """Renew on one thread; a watchdog on another calls `on_lost()` once the renew
        deadline passed without a renewal, or at once when another took the Lease."""
        lost = threading.Event()

        def lose(why: str) -> None:
            if not lost.is_set():
                lost.set()
                log.critical("lost Lease %s/%s (%s): stopping", self.namespace, self.name, why)
                on_lost()

        def renew() -> None:
            while not self._stop.wait(self.retry_seconds) and not lost.is_set():
                try:
                    missed = self.attempt()
                except Exception as exc:
                    log.warning("leader election: renewal failed: %s", exc)
                    continue
                if missed in (Step.WAIT, Step.TAKE):
                    lose("another holds it")
                    return

        def watchdog() -> None:
            while not self._stop.is_set() and not lost.is_set():
                left = self._leading_until - self.clock()
                if left <= 0:
                    lose(f"not renewed within {self.renew_deadline_seconds:g} s")
                    return
                self._stop.wait(left)

        threads = [
            threading.Thread(target=renew, name="lease-renew", daemon=True),
            threading.Thread(target=watchdog, name="lease-watchdog", daemon=True),
        ]
        for thread in threads:
            thread.start()
        return threads

    def stop(self) -> None:
        self._stop.set()
