"""Property tests of the KV fence over random interleavings (hypothesis).

The model drives one decode ledger, a free-slot pool and two prefill ranks (one WriteTracker
each) and keeps every in-flight write explicitly: a write is issued into a slot, may land at any
later step, may fail (then it is "poisoned": it may STILL land later, as an RDMA write after a
timeout can) and disappears only when it lands or its rank's endpoint is closed. Messages travel
on a FIFO channel decode -> rank and an unordered, duplicating inbox rank -> decode.

Invariant (DESIGN.md Bug 1): no slot is handed to a new request while a write of an older
generation can still land in it, and no write ever lands in a slot owned by another lease.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cas_engine.kvfence import (
    AbortNotice,
    LeaseState,
    ReclaimAck,
    ReclaimLedger,
    ReclaimMode,
    WriteTracker,
)

RANKS = (0, 1)
NUM_SLOTS = 6
# Repeated names weight the draw toward the common steps; rare ones appear once.
OPS = (
    "admit",
    "admit",
    "prefill_recv",
    "prefill_recv",
    "issue",
    "issue",
    "land",
    "land",
    "decode_recv",
    "decode_recv",
    "abort",
    "abort",
    "finish",
    "fail",
    "zombie_land",
    "tick",
    "kill",
)


@dataclass(frozen=True)
class Write:
    rank: int
    room: int
    gen: int
    slot: int


@dataclass
class FenceModel:
    """Interpreter of op lists; ``violations`` counts breaches of the invariant."""

    mode: ReclaimMode
    now: float = 0.0
    free: list[int] = field(default_factory=lambda: list(range(NUM_SLOTS)))
    owner: dict[int, tuple[int, int]] = field(default_factory=dict)
    inflight: list[Write] = field(default_factory=list)
    zombies: list[Write] = field(default_factory=list)
    chunks: dict[tuple[int, int, int], list[int]] = field(default_factory=dict)
    aborted_seen: set[tuple[int, int, int]] = field(default_factory=set)
    channels: dict[int, deque[tuple]] = field(default_factory=dict)
    inbox: list[tuple] = field(default_factory=list)
    dones: dict[tuple[int, int], set[int]] = field(default_factory=dict)
    used_rooms: list[int] = field(default_factory=list)
    violations: int = 0

    def __post_init__(self) -> None:
        self.ledger = ReclaimLedger(mode=self.mode, upstream_timeout_s=30.0, clock=lambda: self.now)
        self.trackers = {r: WriteTracker(r) for r in RANKS}
        self.channels = {r: deque() for r in RANKS}

    # ---- decode side ---------------------------------------------------------------------------

    def admit(self, a: int, b: int) -> None:
        n = 1 + a % 3
        if len(self.free) < n:
            return
        reusable = [r for r in self.used_rooms if self.ledger.lease(r) is None]
        room = reusable[b % len(reusable)] if reusable and b % 4 == 0 else len(self.used_rooms)
        self.used_rooms.append(room)
        slots = [self.free.pop() for _ in range(n)]  # LIFO: just-freed slots first
        landing = {w.slot for w in self.inflight + self.zombies}
        self.violations += sum(1 for s in slots if s in landing)
        ranks = list(RANKS) if b % 3 == 0 else [RANKS[b % 2]]
        lease = self.ledger.track(room, slots, ranks)
        for s in slots:
            self.owner[s] = (room, lease.generation)
        for r in ranks:
            self.channels[r].append(("begin", room, lease.generation, slots))

    def release(self, reclaims) -> None:  # type: ignore[no-untyped-def]
        for rec in reclaims:
            for s in rec.slots:
                assert s not in self.free, f"double free of slot {s}"
                assert self.owner.get(s) == (rec.room, rec.generation)
                del self.owner[s]
                self.free.append(s)

    def abort(self, a: int, b: int) -> None:
        live = sorted(r for r in set(self.used_rooms) if self.ledger.lease(r) is not None)
        if not live:
            return
        ab = self.ledger.abort(live[a % len(live)])
        self.release(ab.released)
        if ab.notice is not None:
            for r in ab.ranks:
                self.channels[r].append(("abort", ab.notice))

    def finish(self, a: int, b: int) -> None:
        done = sorted(
            r
            for r in set(self.used_rooms)
            if (lease := self.ledger.lease(r)) and lease.state is LeaseState.DONE
        )
        if done:
            self.release([self.ledger.finish(done[a % len(done)])])

    def decode_recv(self, a: int, b: int) -> None:
        if not self.inbox:
            return
        msg = self.inbox[a % len(self.inbox)]
        if b % 5:
            self.inbox.remove(msg)  # else: stays, so it is delivered again (duplicate)
        if msg[0] == "ack":
            self.release(self.ledger.on_ack(msg[1]))
            return
        _, rank, room, gen = msg
        self.dones.setdefault((room, gen), set()).add(rank)
        lease = self.ledger.lease(room)
        if (
            lease
            and lease.generation == gen
            and lease.state is LeaseState.ACTIVE
            and lease.ranks <= self.dones[(room, gen)]
        ):
            self.ledger.transfer_done(room)

    def tick(self, a: int, b: int) -> None:
        self.now += 31.0
        self.release(self.ledger.poll())

    # ---- prefill side --------------------------------------------------------------------------

    def prefill_recv(self, a: int, b: int) -> None:
        ready = [r for r in RANKS if self.channels[r]]
        if not ready:
            return
        rank = ready[a % len(ready)]
        msg = self.channels[rank].popleft()
        tracker = self.trackers[rank]
        if msg[0] == "begin":
            _, room, gen, slots = msg
            if tracker.begin(room, gen):
                self.chunks[(rank, room, gen)] = list(slots)
            return
        notice: AbortNotice = msg[1]
        self.aborted_seen.add((rank, notice.room, notice.generation))
        self._send(tracker.on_abort(notice), rank, notice.room, notice.generation)

    def issue(self, a: int, b: int) -> None:
        keys = sorted(self.chunks)
        if not keys:
            return
        key = keys[a % len(keys)]
        rank, room, gen = key
        slot = self.chunks[key].pop(0)
        tracker = self.trackers[rank]
        if tracker.try_issue(room, gen):
            self.inflight.append(Write(rank, room, gen, slot))
        if not self.chunks[key] or not tracker.is_pinned(room, gen):
            del self.chunks[key]
            self._send(tracker.seal(room, gen), rank, room, gen)

    def land(self, a: int, b: int) -> None:
        if not self.inflight:
            return
        w = self.inflight.pop(a % len(self.inflight))
        self._check_landing(w)
        self._send(self.trackers[w.rank].write_done(w.room, w.gen, ok=True), w.rank, w.room, w.gen)

    def fail(self, a: int, b: int) -> None:
        if not self.inflight:
            return
        w = self.inflight.pop(a % len(self.inflight))
        self.zombies.append(w)  # a failed write may still land
        assert self.trackers[w.rank].write_done(w.room, w.gen, ok=False) is None

    def zombie_land(self, a: int, b: int) -> None:
        if self.zombies:
            self._check_landing(self.zombies.pop(a % len(self.zombies)))

    def kill(self, a: int, b: int) -> None:
        """Heartbeat failure, then the transport confirms the endpoint closed."""
        rank = RANKS[a % len(RANKS)]
        self.ledger.on_peer_dead(rank)
        if b % 2:  # death alone must release nothing
            return
        self.inflight = [w for w in self.inflight if w.rank != rank]
        self.zombies = [w for w in self.zombies if w.rank != rank]
        self.channels[rank].clear()
        self.chunks = {k: v for k, v in self.chunks.items() if k[0] != rank}
        self.trackers[rank].on_endpoint_closed()
        self.release(self.ledger.on_peer_closed(rank))

    # ---- helpers -------------------------------------------------------------------------------

    def _send(self, ack: ReclaimAck | None, rank: int, room: int, gen: int) -> None:
        if ack is not None:
            self.inbox.append(("ack", ack))
        elif (
            not self.trackers[rank].is_pinned(room, gen)
            and (rank, room, gen) not in self.aborted_seen
            and (rank, room, gen) not in self.chunks
        ):
            self.inbox.append(("done", rank, room, gen))

    def _check_landing(self, w: Write) -> None:
        holder = self.owner.get(w.slot)
        if holder is not None and holder != (w.room, w.gen):
            self.violations += 1

    def run(self, ops: list[tuple[str, int, int]]) -> int:
        for name, a, b in ops:
            getattr(self, name)(a, b)
        return self.violations

    def drain(self) -> None:
        """Deliver and complete everything that can complete (bounded)."""
        for _ in range(500):
            progressed = False
            while any(self.channels.values()):
                self.prefill_recv(0, 0)
                progressed = True
            while self.chunks:
                self.issue(0, 0)
                progressed = True
            while self.inflight:
                self.land(0, 0)
                progressed = True
            while self.inbox:
                self.decode_recv(0, 1)
                progressed = True
            if not progressed:
                return


op_lists = st.lists(
    st.tuples(st.sampled_from(OPS), st.integers(0, 11), st.integers(0, 11)), max_size=120
)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(op_lists)
def test_strict_never_reuses_a_slot_an_old_write_can_land_in(ops) -> None:  # type: ignore[no-untyped-def]
    """Guards Bug 1 under Strict for every interleaving hypothesis finds."""
    model = FenceModel(ReclaimMode.STRICT)
    assert model.run(ops) == 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(op_lists)
def test_strict_liveness_only_poisoned_rooms_stay_quarantined(ops) -> None:  # type: ignore[no-untyped-def]
    """Strict must not leak: once everything is delivered, only rooms with a poisoned write
    (which may still land) stay quarantined, and closing those peers frees the rest."""
    model = FenceModel(ReclaimMode.STRICT)
    model.run(ops)
    model.drain()
    poisoned_ranks = {w.rank for w in model.zombies}
    for lease in model.ledger.quarantined():
        assert lease.pending & (
            poisoned_ranks | {r for r in RANKS if model.trackers[r].pinned_rooms}
        ), lease
    for r in RANKS:
        model.kill(r, 0)
    model.drain()
    assert model.ledger.quarantined_slots == 0
    assert model.violations == 0


def random_ops(rng: random.Random, length: int = 60) -> list[tuple[str, int, int]]:
    return [(rng.choice(OPS), rng.randrange(12), rng.randrange(12)) for _ in range(length)]


def violating_runs(mode: ReclaimMode, *, seed: int = 7, tries: int = 400) -> int:
    """Seeded random search (no shrinking, so it is fast and deterministic)."""
    rng = random.Random(seed)
    return sum(FenceModel(mode).run(random_ops(rng)) > 0 for _ in range(tries))


def test_seeded_search_strict_clean_immediate_and_upstream_corrupt() -> None:
    """The model must be able to fail: on the same seeded interleavings Immediate and Upstream
    reuse slots under in-flight writes, Strict never does."""
    assert violating_runs(ReclaimMode.IMMEDIATE) > 0
    assert violating_runs(ReclaimMode.UPSTREAM) > 0
    assert violating_runs(ReclaimMode.STRICT) == 0


def test_known_interleaving_abort_with_write_in_flight() -> None:
    """Hand-written production sequence: abort while a write is in flight, admit, write lands."""
    ops = [
        ("admit", 0, 1),
        ("prefill_recv", 1, 0),
        ("issue", 1, 0),
        ("abort", 0, 0),
        ("admit", 0, 1),
        ("land", 0, 0),
    ]
    assert FenceModel(ReclaimMode.IMMEDIATE).run(ops) >= 1
    strict = FenceModel(ReclaimMode.STRICT)
    assert strict.run(ops) == 0
    assert strict.ledger.quarantined_slots == 1


def test_invariant_checker_catches_a_tracker_that_acks_early(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Mutation check of the model: a prefill tracker that acknowledges an abort while its write
    is still outstanding must be caught, even with a Strict ledger."""
    honest = WriteTracker.on_abort

    def eager(self: WriteTracker, notice: AbortNotice) -> ReclaimAck | None:
        return honest(self, notice) or ReclaimAck(notice.room, notice.generation, self.rank)

    monkeypatch.setattr(WriteTracker, "on_abort", eager)
    assert violating_runs(ReclaimMode.STRICT) > 0


def test_invariant_checker_catches_release_on_peer_death(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Mutation check: a ledger that releases on heartbeat death (before the endpoint is
    confirmed closed) must be caught."""
    honest = ReclaimLedger.on_peer_dead

    def hasty(self: ReclaimLedger, rank: int) -> None:
        honest(self, rank)
        self.on_peer_closed(rank)  # released slots are dropped: the model still sees reuse

    monkeypatch.setattr(ReclaimLedger, "on_peer_dead", hasty)
    assert violating_runs(ReclaimMode.STRICT, tries=600) > 0
