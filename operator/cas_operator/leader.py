"""Leader election on a coordination.k8s.io/v1 Lease: two operator replicas never act at once.

Data flow: `LeaderElection.acquire()` blocks the operator's start (a kopf startup handler, so
kopf watches nothing before it returns) until this process holds the Lease; then `keep()`
renews it every `renew_seconds` on a thread and calls `on_lost` (the operator exits: a process
that may have lost its lease must never act again) when it could not renew for
`duration_seconds`. Writes carry the Lease's resourceVersion, so of two candidates taking an
expired Lease at once exactly one succeeds (the API server answers the other 409).
`next_step` decides (pure); `LeaderElection` does the I/O through `Kube`.
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
from cas_operator.types import Manifest, parse_time

log = logging.getLogger(__name__)


class Step(Enum):
    CREATE = "create"  # no Lease yet
    RENEW = "renew"  # ours
    TAKE = "take"  # someone else's, expired
    WAIT = "wait"  # someone else's, live


def next_step(lease: Manifest | None, identity: str, now: float) -> Step:
    """What a candidate does with the Lease as read (pure)."""
    if lease is None:
        return Step.CREATE
    spec = lease.get("spec") or {}
    holder = spec.get("holderIdentity")
    if holder == identity:
        return Step.RENEW
    renewed = parse_time(spec.get("renewTime") or spec.get("acquireTime"))
    duration = float(spec.get("leaseDurationSeconds") or 0)
    if not holder or renewed is None or now >= renewed + duration:
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
    renew_seconds: float = 5.0
    _stop: threading.Event = field(default_factory=threading.Event)

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

    def try_lead(self, now: float | None = None) -> bool:
        """One attempt to hold or renew the Lease; True while this process holds it."""
        return self.attempt(now) is None

    def attempt(self, now: float | None = None) -> Step | None:
        """One attempt; None when this process holds the Lease now, else the step that did
        not get it (WAIT: another holds it; the others: another wrote it first)."""
        now = time.time() if now is None else now
        lease = self.kube.get("Lease", self.namespace, self.name)
        step = next_step(lease, self.identity, now)
        if step == Step.WAIT:
            return step
        body = self.body(lease, step, now)
        if step == Step.CREATE:
            written = self.kube.create("Lease", self.namespace, body)
        else:
            written = self.kube.replace("Lease", self.namespace, self.name, body)
        return None if written is not None else step

    def acquire(self) -> None:
        """Block until this process holds the Lease."""
        announced = False
        while not self._stop.is_set():
            try:
                if self.try_lead():
                    log.info("leading: Lease %s/%s is ours", self.namespace, self.name)
                    return
            except Exception as exc:  # the API server may be briefly unreachable
                log.warning("leader election: %s", exc)
            if not announced:
                log.info("standing by: Lease %s/%s is held by another", self.namespace, self.name)
                announced = True
            self._stop.wait(self.renew_seconds)

    def keep(self, on_lost: Callable[[], None]) -> threading.Thread:
        """Renew on a thread; `on_lost()` once renewals failed for `duration_seconds`."""

        def renew() -> None:
            last = time.monotonic()
            while not self._stop.wait(self.renew_seconds):
                missed: Step | None = Step.RENEW
                try:
                    missed = self.attempt()
                except Exception as exc:
                    log.warning("leader election: renewal failed: %s", exc)
                if missed is None:
                    last = time.monotonic()
                    continue
                taken = missed in (Step.WAIT, Step.TAKE)  # another holds or took it
                if taken or time.monotonic() - last >= self.duration_seconds:
                    log.critical("lost Lease %s/%s: stopping", self.namespace, self.name)
                    on_lost()
                    return

        thread = threading.Thread(target=renew, name="lease", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()
