"""Decode side of the KV fence: the reclaim ledger.

Ownership: the decode engine owns its KV slot allocator; the ledger owns only the bookkeeping of
which room (request) holds which slots at which generation, and decides WHEN an aborted room's
slots may go back to the allocator. Every method that can free slots returns the
:class:`Reclaim` records; the caller puts ``reclaim.slots`` back into its free pool. The ledger
never touches the allocator and never reads a clock except through the injected ``clock``.

Lifecycle of a room (one :class:`Lease` per room and generation)::

    track() -> ACTIVE --transfer_done()--> DONE --finish()--> slots returned (normal end)
                 |                          |
                 | abort()                  | abort(): transfer complete, slots returned
                 v
            QUARANTINED --acks from every rank / peer endpoint closed--> slots returned
                        --UPSTREAM only: poll() after the timeout--> slots returned (unsafe)

Single-threaded: call it from one thread (the engine's scheduler loop) or under one lock.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from cas_engine.kvfence.messages import AbortNotice, ReclaimAck, ReclaimMode
from cas_engine.kvfence.metrics import KvFenceMetrics

log = logging.getLogger(__name__)

_RECENT_CAPACITY = 8192


class LeaseState(enum.Enum):
    ACTIVE = "active"  # KV transfer into the slots may be in progress
    DONE = "done"  # every rank reported its transfer complete; decode owns the slots
    QUARANTINED = "quarantined"  # aborted while writes could still land


@dataclass(slots=True)
class Lease:
    """The slots of one room at one generation and which prefill ranks may write into them."""

    room: int
    generation: int
    slots: tuple[int, ...]
    ranks: frozenset[int]
    state: LeaseState = LeaseState.ACTIVE
    pending: set[int] = field(default_factory=set)  # ranks whose ack is still needed
    closed: set[int] = field(default_factory=set)  # ranks whose endpoint is confirmed closed
    aborted_at: float | None = None


@dataclass(frozen=True, slots=True)
class Reclaim:
    """Slots handed back to the caller's free pool, and why.

    ``outcome``: ``acked``, ``peer_closed``, ``prefill_gone`` (the operator confirmed the
    writer's pod ended), ``timer``, ``immediate`` (aborted rooms) or
    ``finished`` (normal end, or an abort after the transfer had completed).
    """

    room: int
    generation: int
    slots: tuple[int, ...]
    outcome: str
    wait_s: float


@dataclass(frozen=True, slots=True)
class Abort:
    """Result of :meth:`ReclaimLedger.abort`: the notice to send to each rank, freed slots."""

    notice: AbortNotice | None
    ranks: frozenset[int]
    released: tuple[Reclaim, ...]


class ReclaimLedger:
    """Decides when an aborted room's KV slots may be reused (see the module docstring)."""

    def __init__(
        self,
        *,
        mode: ReclaimMode = ReclaimMode.STRICT,
        quarantine_budget_slots: int | None = None,
        upstream_timeout_s: float = 30.0,
        metrics: KvFenceMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.mode = mode
        self.quarantine_budget_slots = quarantine_budget_slots
        self.upstream_timeout_s = upstream_timeout_s
        self.metrics = metrics if metrics is not None else KvFenceMetrics()
        self._clock = clock
        self._next_generation = 1
        self._live: dict[int, Lease] = {}
        self._quarantine: dict[tuple[int, int], Lease] = {}
        self._recent: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._dead_ranks: set[int] = set()
        self.quarantined_slots = 0
        self.quarantine_peak = 0
        self.ignored: dict[str, int] = {}

    # ---- room lifecycle (called by the decode scheduler) -------------------------------------

    def track(self, room: int, slots: Iterable[int], ranks: Iterable[int]) -> Lease:
        """Record that ``room`` holds ``slots`` written by prefill ``ranks``; new generation."""
        if room in self._live:
            raise ValueError(
                f"room {room} is already live at generation {self._live[room].generation}"
            )
        lease = Lease(
            room=room, generation=self._next_generation, slots=tuple(slots), ranks=frozenset(ranks)
        )
        if not lease.ranks:
            raise ValueError("a lease needs at least one prefill rank")
        self._next_generation += 1
        self._live[room] = lease
        return lease

    def transfer_done(self, room: int) -> None:
        """Every rank reported the room's KV transfer complete: no write of it can land any more."""
        lease = self._live.get(room)
        if lease is None:
            self._ignore("unknown_room", f"transfer_done for unknown room {room}")
            return
        lease.state = LeaseState.DONE

    def finish(self, room: int) -> Reclaim:
        """Normal end of a DONE room: its slots go back at once."""
        lease = self._live.get(room)
        if lease is None or lease.state is not LeaseState.DONE:
            raise RuntimeError(
                f"finish() needs a DONE room; room {room} is "
                f"{lease.state.value if lease else 'unknown'}; use abort()"
            )
        return self._release_live(lease, "finished")

    def abort(self, room: int) -> Abort:
        """Abort ``room``: returns the notice for its ranks and any slots that are free at once."""
        lease = self._live.get(room)
        if lease is None:
            return self._abort_unlive(room)
        notice = AbortNotice(room=room, generation=lease.generation)
        if lease.state is LeaseState.DONE:
            return Abort(None, lease.ranks, (self._release_live(lease, "finished"),))
        if self.mode is ReclaimMode.IMMEDIATE:
            return Abort(notice, lease.ranks, (self._release_live(lease, "immediate"),))
        del self._live[room]
        lease.state = LeaseState.QUARANTINED
        lease.aborted_at = self._clock()
        lease.pending = set(lease.ranks - lease.closed)
        self._quarantine[(room, lease.generation)] = lease
        self._set_quarantined(self.quarantined_slots + len(lease.slots))
        released = self._maybe_release(lease, "peer_closed")
        return Abort(notice, lease.ranks, tuple(released))

    # ---- messages and transport events -------------------------------------------------------

    def on_ack(self, ack: ReclaimAck) -> list[Reclaim]:
        """A rank acknowledged an abort; release the room once every pending rank has."""
        key = (ack.room, ack.generation)
        lease = self._quarantine.get(key)
        if lease is None:
            self._ignore(self._classify_missing(key), f"ack {ack}")
            return []
        if ack.rank not in lease.ranks:
            self._ignore("unknown_rank", f"ack {ack} from a rank outside {sorted(lease.ranks)}")
            return []
        if ack.rank not in lease.pending:
            self._ignore("duplicate", f"ack {ack}")
            return []
        lease.pending.discard(ack.rank)
        return self._maybe_release(lease, "acked")

    def on_peer_dead(self, rank: int) -> None:
        """Heartbeat says ``rank`` is dead. Nothing is released: its writes may still land."""
        self._dead_ranks.add(rank)
        log.warning(
            "prefill rank %s declared dead; its rooms stay quarantined until its "
            "endpoint is confirmed closed",
            rank,
        )

    def on_peer_closed(self, rank: int) -> list[Reclaim]:
        """The transport confirmed ``rank``'s endpoint closed: none of its writes can land."""
        self._dead_ranks.discard(rank)
        for lease in self._live.values():
            if rank in lease.ranks:
                lease.closed.add(rank)
        released: list[Reclaim] = []
        for lease in list(self._quarantine.values()):
            if rank in lease.pending:
                lease.closed.add(rank)
                lease.pending.discard(rank)
                released.extend(self._maybe_release(lease, "peer_closed"))
        return released

    def on_room_closed(self, room: int, generation: int) -> list[Reclaim]:
        """Every writer of this one room is confirmed gone (e.g. the operator saw its prefill
        pod's containers terminate): release it whatever acks are missing."""
        lease = self._quarantine.get((room, generation))
        if lease is None:
            return []
        lease.closed |= lease.pending
        lease.pending.clear()
        return self._maybe_release(lease, "prefill_gone")

    def poll(self) -> list[Reclaim]:
        """Periodic tick. UPSTREAM releases rooms quarantined past the timeout; others nothing."""
        if self.mode is not ReclaimMode.UPSTREAM:
            return []
        now = self._clock()
        released: list[Reclaim] = []
        for lease in list(self._quarantine.values()):
            assert lease.aborted_at is not None
            if now - lease.aborted_at >= self.upstream_timeout_s:
                released.append(self._release_quarantined(lease, "timer"))
        return released

    # ---- observation ---------------------------------------------------------------------------

    def health(self) -> tuple[bool, str]:
        """``(False, reason)`` while quarantined slots exceed the budget, else ``(True, "")``."""
        budget = self.quarantine_budget_slots
        if budget is None or self.quarantined_slots <= budget:
            return True, ""
        waiting: set[int] = set()
        for lease in self._quarantine.values():
            waiting |= lease.pending
        dead = sorted(waiting & self._dead_ranks)
        reason = (
            f"KV quarantine {self.quarantined_slots} slots exceeds budget {budget} "
            f"({len(self._quarantine)} aborted rooms waiting on prefill ranks "
            f"{sorted(waiting)}; dead: {dead}); reuse is not provably safe, drain this pod"
        )
        return False, reason

    @property
    def quarantined_rooms(self) -> int:
        return len(self._quarantine)

    @property
    def live_rooms(self) -> int:
        return len(self._live)

    def lease(self, room: int) -> Lease | None:
        """The live (ACTIVE or DONE) lease of ``room``, if any."""
        return self._live.get(room)

    def quarantined(self) -> list[Lease]:
        return list(self._quarantine.values())

    def is_quarantined(self, room: int, generation: int) -> bool:
        """Whether ``room`` at ``generation`` is still waiting in quarantine."""
        return (room, generation) in self._quarantine

    # ---- internals -----------------------------------------------------------------------------

    def _abort_unlive(self, room: int) -> Abort:
        if any(key[0] == room for key in self._quarantine):
            self._ignore("duplicate", f"abort of already quarantined room {room}")
        else:
            self._ignore("unknown_room", f"abort of unknown room {room}")
        return Abort(None, frozenset(), ())

    def _maybe_release(self, lease: Lease, outcome: str) -> list[Reclaim]:
        if lease.pending:
            return []
        return [self._release_quarantined(lease, outcome)]

    def _release_quarantined(self, lease: Lease, outcome: str) -> Reclaim:
        del self._quarantine[(lease.room, lease.generation)]
        self._set_quarantined(self.quarantined_slots - len(lease.slots))
        assert lease.aborted_at is not None
        wait = max(0.0, self._clock() - lease.aborted_at)
        self.metrics.reclaims.labels(outcome=outcome).inc()
        self.metrics.reclaim_wait.observe(wait)
        self._remember(lease)
        return Reclaim(lease.room, lease.generation, lease.slots, outcome, wait)

    def _release_live(self, lease: Lease, outcome: str) -> Reclaim:
        del self._live[lease.room]
        if outcome != "finished":
            self.metrics.reclaims.labels(outcome=outcome).inc()
            self.metrics.reclaim_wait.observe(0.0)
        self._remember(lease)
        return Reclaim(lease.room, lease.generation, lease.slots, outcome, 0.0)

    def _remember(self, lease: Lease) -> None:
        self._recent[(lease.room, lease.generation)] = None
        while len(self._recent) > _RECENT_CAPACITY:
            self._recent.popitem(last=False)

    def _classify_missing(self, key: tuple[int, int]) -> str:
        if key in self._recent:
            return "duplicate"
        live = self._live.get(key[0])
        if live is not None or any(k[0] == key[0] for k in self._quarantine):
            return "stale"
        return "unknown_room"

    def _set_quarantined(self, slots: int) -> None:
        delta = slots - self.quarantined_slots
        self.quarantined_slots = slots
        self.quarantine_peak = max(self.quarantine_peak, slots)
        self.metrics.quarantined_slots.inc(delta)
        self.metrics.unhealthy.set(0.0 if self.health()[0] else 1.0)

    def _ignore(self, reason: str, what: str) -> None:
        self.ignored[reason] = self.ignored.get(reason, 0) + 1
        self.metrics.ignored.labels(reason=reason).inc()
        log.info("kvfence ledger ignored %s (%s)", what, reason)
