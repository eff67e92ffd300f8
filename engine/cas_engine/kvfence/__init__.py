"""KV fence: strict reclaim of KV slots after aborts in prefill/decode disaggregation.

The race (DESIGN.md, Bug 1): decode aborts a request whose prefill missed its budget and reuses
its KV slots while the prefill's write for the old request is still in flight; the write lands in
the new request's KV. The fence makes reuse wait for proof that no old write can land.

Pure Python, engine-agnostic, no GPU, no threads, no clock of its own. API (all of it)::

    from cas_engine.kvfence import (ReclaimMode, ReclaimLedger, WriteTracker, AbortNotice,
                                    ReclaimAck, KvFenceMetrics)

    metrics = KvFenceMetrics(registry)          # one per process; registry=None keeps it private

    # decode side (owns nothing but bookkeeping; YOU own the free pool)
    ledger = ReclaimLedger(mode=ReclaimMode.STRICT, quarantine_budget_slots=4096,
                           upstream_timeout_s=30.0, metrics=metrics, clock=time.monotonic)
    lease = ledger.track(room, slots, ranks)    # -> Lease(room, generation, slots, ranks, ...)
    ledger.transfer_done(room)                  # all ranks reported the KV transfer complete
    ledger.finish(room) -> Reclaim              # normal end of a DONE room: free reclaim.slots
    ab = ledger.abort(room) -> Abort            # send ab.notice to every rank in ab.ranks;
                                                # free the slots of every Reclaim in ab.released
    ledger.on_ack(ack) -> list[Reclaim]         # free what it returns
    ledger.on_peer_dead(rank)                   # heartbeat failure: releases nothing
    ledger.on_peer_closed(rank) -> list[Reclaim]  # transport confirmed the endpoint closed
                                                # (source: kvfence.peer_probe.PeerProber)
    ledger.on_room_closed(room, generation) -> list[Reclaim]  # that room's writers are gone
                                                # (source: kvfence.gone_feed, the operator)
    ledger.poll() -> list[Reclaim]              # UPSTREAM's timer release; no-op otherwise
    ledger.health() -> (ok, reason)             # False when quarantine exceeds the budget
    ledger.quarantined_slots, ledger.quarantine_peak, ledger.quarantined_rooms

    # prefill side, one per rank
    tracker = WriteTracker(rank, metrics=metrics)
    tracker.begin(room, gen) -> bool            # pins source pages; False: aborted already
    tracker.try_issue(room, gen) -> bool        # before each chunk; False: skip it
    tracker.write_done(room, gen, ok=True) -> ReclaimAck | None   # send the ack if not None
    tracker.seal(room, gen) -> ReclaimAck | None  # all chunks posted
    tracker.on_abort(notice) -> ReclaimAck | None                 # send the ack if not None
    tracker.on_endpoint_closed()                # decode endpoint gone: unpin everything
    tracker.is_pinned(room, gen) -> bool        # source pages must stay untouched while True

Modes: IMMEDIATE frees on abort (no fix), UPSTREAM frees on ack or after the timeout (SGLang
0.5.23), STRICT frees only on acks from every rank of that generation or on a dead peer's
confirmed endpoint close. Stale, duplicate and unknown messages are ignored and counted
(``cas_kv_ignored_messages_total{reason}``), never raised.
"""

from cas_engine.kvfence.ledger import Abort, Lease, LeaseState, Reclaim, ReclaimLedger
from cas_engine.kvfence.messages import AbortNotice, ReclaimAck, ReclaimMode
from cas_engine.kvfence.metrics import KvFenceMetrics
from cas_engine.kvfence.tracker import WriteTracker

__all__ = [
    "Abort",
    "AbortNotice",
    "KvFenceMetrics",
    "Lease",
    "LeaseState",
    "Reclaim",
    "ReclaimAck",
    "ReclaimLedger",
    "ReclaimMode",
    "WriteTracker",
]
