"""Unit tests of the KV fence state machines (cas_engine.kvfence): ledger, tracker, messages."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from cas_engine.kvfence import (
    AbortNotice,
    KvFenceMetrics,
    ReclaimAck,
    ReclaimLedger,
    ReclaimMode,
    WriteTracker,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_ledger(
    mode: ReclaimMode = ReclaimMode.STRICT, **kw: object
) -> tuple[ReclaimLedger, FakeClock, CollectorRegistry]:
    reg = CollectorRegistry()
    clock = FakeClock()
    ledger = ReclaimLedger(mode=mode, metrics=KvFenceMetrics(reg), clock=clock, **kw)  # type: ignore[arg-type]
    return ledger, clock, reg


def sample(reg: CollectorRegistry, name: str, **labels: str) -> float:
    value = reg.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


# ---- ledger --------------------------------------------------------------------------------------


def test_strict_abort_waits_for_every_rank_then_releases() -> None:
    """Guards Bug 1: an aborted room's slots must not return before all ranks acknowledged."""
    ledger, clock, reg = make_ledger()
    lease = ledger.track(7, [1, 2, 3], ranks=[0, 1])
    ab = ledger.abort(7)
    assert ab.notice == AbortNotice(7, lease.generation)
    assert ab.released == ()
    assert ledger.quarantined_slots == 3
    assert sample(reg, "cas_kv_quarantined_slots") == 3
    assert ledger.on_ack(ReclaimAck(7, lease.generation, 0)) == []
    clock.now += 2.5
    (rec,) = ledger.on_ack(ReclaimAck(7, lease.generation, 1))
    assert rec.slots == (1, 2, 3) and rec.outcome == "acked" and rec.wait_s == pytest.approx(2.5)
    assert ledger.quarantined_slots == 0
    assert sample(reg, "cas_kv_reclaims_total", outcome="acked") == 1
    assert sample(reg, "cas_kv_reclaim_wait_seconds_count") == 1


def test_strict_never_releases_on_timer() -> None:
    """Guards the upstream hole: a stalled ack must keep the slots quarantined forever."""
    ledger, clock, _ = make_ledger(upstream_timeout_s=30.0)
    ledger.track(1, [5], ranks=[0])
    ledger.abort(1)
    clock.now += 3600
    assert ledger.poll() == []
    assert ledger.quarantined_slots == 1


def test_upstream_releases_on_timer() -> None:
    """Models SGLang 0.5.23: the slot comes back after the timeout without any ack."""
    ledger, clock, reg = make_ledger(ReclaimMode.UPSTREAM, upstream_timeout_s=30.0)
    ledger.track(1, [5], ranks=[0])
    ledger.abort(1)
    clock.now += 29.9
    assert ledger.poll() == []
    clock.now += 0.2
    (rec,) = ledger.poll()
    assert rec.outcome == "timer" and rec.slots == (5,)
    assert sample(reg, "cas_kv_reclaims_total", outcome="timer") == 1


def test_immediate_releases_at_abort() -> None:
    """The unfixed mode frees at once (the race reproduction depends on this)."""
    ledger, _, reg = make_ledger(ReclaimMode.IMMEDIATE)
    ledger.track(1, [5, 6], ranks=[0])
    ab = ledger.abort(1)
    assert [r.slots for r in ab.released] == [(5, 6)]
    assert ab.notice is not None
    assert sample(reg, "cas_kv_reclaims_total", outcome="immediate") == 1


def test_abort_after_transfer_done_frees_at_once() -> None:
    """A completed transfer cannot land again: no quarantine, no reclaim counted."""
    ledger, _, reg = make_ledger()
    ledger.track(1, [5], ranks=[0, 1])
    ledger.transfer_done(1)
    ab = ledger.abort(1)
    assert ab.notice is None and [r.outcome for r in ab.released] == ["finished"]
    assert ledger.quarantined_slots == 0
    assert sample(reg, "cas_kv_reclaims_total", outcome="acked") == 0


def test_finish_requires_done() -> None:
    """finish() on an ACTIVE room would skip the fence; it must refuse."""
    ledger, _, _ = make_ledger()
    ledger.track(1, [5], ranks=[0])
    with pytest.raises(RuntimeError):
        ledger.finish(1)
    ledger.transfer_done(1)
    assert ledger.finish(1).slots == (5,)


def test_stale_duplicate_unknown_acks_are_ignored_and_counted() -> None:
    """Messages from an older generation must not release a newer one; nothing may raise."""
    ledger, _, reg = make_ledger()
    old = ledger.track(3, [1], ranks=[0, 1])
    ledger.abort(3)
    ledger.on_ack(ReclaimAck(3, old.generation, 0))
    assert ledger.on_ack(ReclaimAck(3, old.generation, 0)) == []  # duplicate
    assert ledger.on_ack(ReclaimAck(3, old.generation, 9)) == []  # foreign rank
    new = ledger.track(3, [2], ranks=[0, 1])  # room id reused by a retry
    assert ledger.on_ack(ReclaimAck(3, new.generation, 0)) == []  # ack before abort: stale
    assert ledger.on_ack(ReclaimAck(999, 1, 0)) == []  # unknown room
    assert ledger.quarantined_slots == 1
    (rec,) = ledger.on_ack(ReclaimAck(3, old.generation, 1))
    assert rec.generation == old.generation and rec.slots == (1,)
    assert ledger.on_ack(ReclaimAck(3, old.generation, 1)) == []  # late duplicate
    assert ledger.lease(3) is not None and ledger.lease(3).generation == new.generation  # type: ignore[union-attr]
    assert sample(reg, "cas_kv_ignored_messages_total", reason="duplicate") == 2
    assert sample(reg, "cas_kv_ignored_messages_total", reason="unknown_rank") == 1
    assert sample(reg, "cas_kv_ignored_messages_total", reason="stale") == 1
    assert sample(reg, "cas_kv_ignored_messages_total", reason="unknown_room") == 1


def test_dead_peer_keeps_quarantine_until_endpoint_closed() -> None:
    """Heartbeat death alone proves nothing; only the closed endpoint releases."""
    ledger, _, reg = make_ledger(quarantine_budget_slots=1)
    lease = ledger.track(1, [1, 2], ranks=[0, 1])
    ledger.abort(1)
    ledger.on_ack(ReclaimAck(1, lease.generation, 0))
    ledger.on_peer_dead(1)
    assert ledger.quarantined_slots == 2
    ok, reason = ledger.health()
    assert not ok and "budget 1" in reason and "dead: [1]" in reason
    assert sample(reg, "cas_kv_unhealthy_by_quarantine") == 1
    (rec,) = ledger.on_peer_closed(1)
    assert rec.outcome == "peer_closed"
    assert ledger.health() == (True, "")
    assert sample(reg, "cas_kv_unhealthy_by_quarantine") == 0


def test_room_closed_releases_only_that_room_and_generation() -> None:
    """The operator's confirmation (kvfence.gone_feed) covers single rooms, not a whole rank:
    it releases exactly the named room and generation, whatever acks are missing, counted as
    prefill_gone; a stale generation, an unknown room and a second call release nothing."""
    ledger, clock, reg = make_ledger()
    gone = ledger.track(1, [1, 2], ranks=[0, 1])
    kept = ledger.track(2, [3], ranks=[0, 1])
    ledger.abort(1)
    ledger.abort(2)
    ledger.on_ack(ReclaimAck(1, gone.generation, 0))
    clock.now += 4.0
    assert ledger.on_room_closed(1, gone.generation - 1) == []
    assert ledger.on_room_closed(99, 1) == []
    (rec,) = ledger.on_room_closed(1, gone.generation)
    assert rec.slots == (1, 2) and rec.outcome == "prefill_gone" and rec.wait_s == 4.0
    assert ledger.on_room_closed(1, gone.generation) == []
    assert ledger.is_quarantined(2, kept.generation) and ledger.quarantined_slots == 1
    assert sample(reg, "cas_kv_reclaims_total", outcome="prefill_gone") == 1


def test_closed_rank_not_waited_for_on_later_abort() -> None:
    """A room whose rank closed before the abort only waits for the remaining ranks."""
    ledger, _, _ = make_ledger()
    lease = ledger.track(1, [1], ranks=[0, 1])
    ledger.on_peer_closed(1)
    ab = ledger.abort(1)
    assert ab.released == ()
    (rec,) = ledger.on_ack(ReclaimAck(1, lease.generation, 0))
    assert rec.outcome == "acked"


def test_duplicate_and_unknown_abort_do_not_crash() -> None:
    """Aborting twice or aborting an unknown room is counted, not raised."""
    ledger, _, _ = make_ledger()
    ledger.track(1, [1], ranks=[0])
    ledger.abort(1)
    assert ledger.abort(1).notice is None
    assert ledger.abort(42).notice is None
    assert ledger.ignored == {"duplicate": 1, "unknown_room": 1}


def test_track_rejects_live_room_and_empty_ranks() -> None:
    """Double-booking a room would lose a lease; it is a caller bug and raises."""
    ledger, _, _ = make_ledger()
    ledger.track(1, [1], ranks=[0])
    with pytest.raises(ValueError):
        ledger.track(1, [2], ranks=[0])
    with pytest.raises(ValueError):
        ledger.track(2, [2], ranks=[])


def test_reclaim_mode_parse() -> None:
    """The CRD spelling and the enum name both parse; garbage does not."""
    assert ReclaimMode.parse("Strict") is ReclaimMode.STRICT
    assert ReclaimMode.parse("UPSTREAM") is ReclaimMode.UPSTREAM
    with pytest.raises(ValueError):
        ReclaimMode.parse("sometimes")


def test_messages_round_trip() -> None:
    """Transports carry dicts; a round trip must keep room, generation and rank."""
    assert AbortNotice.from_dict(AbortNotice(1, 2, 3).to_dict()) == AbortNotice(1, 2, 3)
    assert ReclaimAck.from_dict(ReclaimAck(1, 2, 3).to_dict()) == ReclaimAck(1, 2, 3)


# ---- tracker -------------------------------------------------------------------------------------


def make_tracker(rank: int = 0) -> tuple[WriteTracker, CollectorRegistry]:
    reg = CollectorRegistry()
    return WriteTracker(rank, metrics=KvFenceMetrics(reg)), reg


def test_tracker_acks_only_when_outstanding_drained() -> None:
    """Guards Bug 1 on the prefill side: no ack while an issued write may still land."""
    tr, reg = make_tracker(rank=2)
    assert tr.begin(5, 1)
    assert tr.try_issue(5, 1) and tr.try_issue(5, 1)
    assert tr.on_abort(AbortNotice(5, 1)) is None
    assert not tr.try_issue(5, 1)  # queued chunk skipped
    assert tr.is_pinned(5, 1)
    assert tr.write_done(5, 1) is None
    assert tr.write_done(5, 1) == ReclaimAck(5, 1, 2)
    assert not tr.is_pinned(5, 1)
    assert sample(reg, "cas_kv_skipped_chunks_total") == 1
    assert sample(reg, "cas_kv_pinned_source_rooms") == 0


def test_tracker_poisoned_never_acks() -> None:
    """A failed/timed-out write may still land: the room must never be acknowledged."""
    tr, reg = make_tracker()
    tr.begin(5, 1)
    tr.try_issue(5, 1)
    assert tr.write_done(5, 1, ok=False) is None
    assert tr.on_abort(AbortNotice(5, 1)) is None
    assert tr.on_abort(AbortNotice(5, 1)) is None
    assert tr.is_pinned(5, 1)
    assert sample(reg, "cas_kv_poisoned_transfers_total") == 1
    assert tr.on_endpoint_closed() == [(5, 1)]
    assert not tr.is_pinned(5, 1)


def test_tracker_abort_before_begin_refuses_late_begin() -> None:
    """An ack for a room never begun must stop that room from being written later."""
    tr, reg = make_tracker()
    assert tr.on_abort(AbortNotice(9, 4)) == ReclaimAck(9, 4, 0)
    assert not tr.begin(9, 4)
    assert tr.unknown_aborts == 1
    assert sample(reg, "cas_kv_ignored_messages_total", reason="unknown_room") == 1


def test_tracker_finished_room_acks_abort_and_unpins() -> None:
    """A sealed room whose writes completed is unpinned; a later abort is acknowledged."""
    tr, _ = make_tracker()
    tr.begin(1, 1)
    tr.try_issue(1, 1)
    tr.seal(1, 1)
    assert tr.is_pinned(1, 1)
    assert tr.write_done(1, 1) is None
    assert not tr.is_pinned(1, 1)
    assert tr.on_abort(AbortNotice(1, 1)) == ReclaimAck(1, 1, 0)
    assert tr.unknown_aborts == 0


def test_tracker_write_done_without_issue_raises() -> None:
    """Unbalanced completion is a transfer-worker bug and must be loud."""
    tr, _ = make_tracker()
    tr.begin(1, 1)
    with pytest.raises(RuntimeError):
        tr.write_done(1, 1)


def test_ledger_and_tracker_share_one_registry() -> None:
    """One metrics object per process serves the ledger and several trackers without clashes."""
    reg = CollectorRegistry()
    metrics = KvFenceMetrics(reg)
    ledger = ReclaimLedger(metrics=metrics)
    trackers = [WriteTracker(r, metrics=metrics) for r in range(2)]
    lease = ledger.track(1, [0], ranks=[0, 1])
    ab = ledger.abort(1)
    assert ab.notice is not None
    released = []
    for tr in trackers:
        ack = tr.on_abort(ab.notice)
        assert ack is not None
        released += ledger.on_ack(ack)
    assert [r.generation for r in released] == [lease.generation]
