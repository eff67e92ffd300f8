"""Which instances a scale-down removes, and when each may go (pure).

Input: a pool's desired count and its live instances (`Instance`: one per engine pod or LWS
leader of the current revision, with its work and retire state read from the pod). Output: a
`RetireStep`: the instances to take out of rotation (`mark`), those now idle enough to give to
the workload's controller (`release`), those no longer to remove because the desired count rose
(`restore`), and `keep`, the count the workload may shrink to after this step. The state lives
on the pods (`anomaly.drain` annotations, states Retiring and Released), so a restarted operator
resumes from what it observes; `scaledown.act` reads and writes them.

An older revision is retired the same way, as a whole (`retire_revision`): once the current one
is Ready the entry Service stops sending to its router, and its children go once its engines
are idle (`RevisionLoad`, measured by the fleet tick) or the drain grace is over.

Rules: a Deployment pool retires the instances with the least work (running + queued requests +
KV transfers in flight; unknown work last), keeping the ones already retiring, so a choice is not
redone every tick; an LWS pool retires its highest group indices (its leader StatefulSet
removes those). An instance is released once it is idle for a reading taken after its marks
(`min_wait_seconds`), or when its work is known and `max_wait_seconds` (the engine's drain
grace; its preStop hook still lets it finish) is over; one whose work is unknown waits, except
one that is not Ready (no Service or router sends to it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cas_operator.anomaly.drain import STATE_RELEASED, STATE_RETIRING


@dataclass(frozen=True)
class Instance:
    """One live engine instance of a pool, as the pods record it."""

    name: str
    work: float | None  # running + queued + KV transfers in flight; None: not measured
    ready: bool = True
    state: str | None = None  # STATE_RETIRING / STATE_RELEASED, else None
    retiring_since: float | None = None
    group_index: int | None = None  # LWS group (None: a Deployment pod)
    drained_by_anomaly: bool = False  # out of rotation for another reason: not a candidate

    @property
    def retiring(self) -> bool:
        return self.state in (STATE_RETIRING, STATE_RELEASED)


@dataclass(frozen=True)
class RetirePolicy:
    min_wait_seconds: float = 15.0  # the router sees the label go; a scrape postdates it
    max_wait_seconds: float = 600.0  # the engine's drainSeconds


@dataclass(frozen=True)
class RetireStep:
    keep: int
    mark: tuple[str, ...] = ()
    release: tuple[str, ...] = ()
    restore: tuple[str, ...] = ()


def _least_work_first(instance: Instance) -> tuple[bool, bool, float, str]:
    unknown = instance.work is None
    return (instance.ready, unknown, instance.work or 0.0, instance.name)


def to_retire(desired: int, instances: Sequence[Instance]) -> list[Instance]:
    """The instances that should be retiring for the pool to reach `desired`."""
    excess = max(0, len(instances) - desired)
    if any(i.group_index is not None for i in instances):
        by_index = sorted(instances, key=lambda i: (i.group_index or 0, i.name), reverse=True)
        return by_index[:excess]
    retiring = sorted(
        (i for i in instances if i.retiring),
        key=lambda i: (i.state != STATE_RELEASED, i.retiring_since or 0.0, i.name),
    )
    fresh = sorted(
        (i for i in instances if not i.retiring and not i.drained_by_anomaly),
        key=_least_work_first,
    )
    return (retiring + fresh)[:excess]


def may_release(instance: Instance, now: float, policy: RetirePolicy) -> bool:
    """Whether a retiring instance can be handed to its controller for removal."""
    waited = now - (instance.retiring_since if instance.retiring_since is not None else now)
    if waited < policy.min_wait_seconds:
        return False
    if not instance.ready:
        return True
    if instance.work is None:
        return False
    return instance.work <= 0 or waited >= policy.max_wait_seconds


def retire_step(
    desired: int, instances: Sequence[Instance], now: float, policy: RetirePolicy
) -> RetireStep:
    """One tick of a pool's scale-down (see the module docstring)."""
    chosen = to_retire(desired, instances)
    names = {i.name for i in chosen}
    mark = tuple(i.name for i in chosen if not i.retiring)
    restore = tuple(i.name for i in instances if i.retiring and i.name not in names)
    release = tuple(
        i.name for i in chosen if i.state == STATE_RETIRING and may_release(i, now, policy)
    )
    released = sum(1 for i in chosen if i.state == STATE_RELEASED) + len(release)
    return RetireStep(len(instances) - released, mark, release, restore)


def replicas_to_apply(desired: int, observed: int | None, floor: PoolFloor | None) -> int:
    """The count the reconcile applies to a workload: the desired one, except that a
    scale-down goes only as far as released instances allow (`floor`, the fleet tick's last
    finding). A finding that saw fewer instances than the workload has now predates its
    newest pods (a scale-up a moment ago): it says nothing about them, so the workload keeps
    what it has until the next tick, as without a finding."""
    if observed is None or desired >= observed:
        return desired
    if floor is None or floor.live < observed:
        return observed
    return max(desired, min(observed, floor.keep))


@dataclass(frozen=True)
class PoolFloor:
    """The fleet tick's finding for one pool: of the `live` instances it saw, the workload
    may shrink to `keep` (the others are released)."""

    revision: str
    role: str
    keep: int
    live: int


@dataclass(frozen=True)
class RevisionLoad:
    """The fleet tick's reading of an older revision's engines: the work of its Ready
    instances (None: one of them is not measured; not-Ready ones receive nothing)."""

    revision: str
    work: float | None


@dataclass(frozen=True)
class RevisionRetire:
    delete: bool
    progress: str


def retire_revision(
    since: float, work: float | None, now: float, policy: RetirePolicy
) -> RevisionRetire:
    """Whether an older revision's children may go, `since` the entry Service stopped
    sending to its router, with its engines' `work`."""
    waited = now - since
    if waited < policy.min_wait_seconds:
        return RevisionRetire(False, f"out of the entry point for {waited:.0f}s")
    if work is not None and work <= 0:
        return RevisionRetire(True, "its engines are idle")
    if waited >= policy.max_wait_seconds:
        return RevisionRetire(True, "drain grace over; preStop hooks hold what still runs")
    left = "unknown requests" if work is None else f"{work:.0f} requests"
    return RevisionRetire(False, f"{left} in flight, out of the entry point for {waited:.0f}s")
