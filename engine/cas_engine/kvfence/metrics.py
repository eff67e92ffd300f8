"""Prometheus metrics of the KV fence (all names prefixed ``cas_kv_``).

One :class:`KvFenceMetrics` is created per process and shared by that process's ledger and
trackers; it registers into the registry it is given (the engine passes
``prometheus_client.REGISTRY``; tests pass a fresh ``CollectorRegistry`` so they never collide).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

RECLAIM_OUTCOMES = ("acked", "peer_closed", "prefill_gone", "timer", "immediate")
IGNORED_REASONS = ("stale", "duplicate", "unknown_room", "unknown_rank")

_WAIT_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)


class KvFenceMetrics:
    """Counters, gauges and the wait histogram; ``registry=None`` keeps them private."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.registry = reg
        self.quarantined_slots = Gauge(
            "cas_kv_quarantined_slots",
            "KV slots of aborted rooms waiting for proof that no write can land in them",
            registry=reg,
        )
        self.reclaim_wait = Histogram(
            "cas_kv_reclaim_wait_seconds",
            "Seconds from abort to the slots' return to the free pool",
            buckets=_WAIT_BUCKETS,
            registry=reg,
        )
        self.reclaims = Counter(
            "cas_kv_reclaims",
            "Aborted rooms whose slots returned to the free pool, by outcome",
            ["outcome"],
            registry=reg,
        )
        self.poisoned = Counter(
            "cas_kv_poisoned_transfers",
            "Prefill transfers that failed or timed out; they never acknowledge an abort",
            registry=reg,
        )
        self.unhealthy = Gauge(
            "cas_kv_unhealthy_by_quarantine",
            "1 while quarantined slots exceed the quarantine budget",
            registry=reg,
        )
        self.ignored = Counter(
            "cas_kv_ignored_messages", "Fence messages ignored, by reason", ["reason"], registry=reg
        )
        self.skipped_chunks = Counter(
            "cas_kv_skipped_chunks",
            "Queued prefill write chunks skipped because the room aborted",
            registry=reg,
        )
        self.pinned_rooms = Gauge(
            "cas_kv_pinned_source_rooms",
            "Prefill rooms whose source pages are pinned by outstanding writes",
            registry=reg,
        )
        for outcome in RECLAIM_OUTCOMES:
            self.reclaims.labels(outcome=outcome)
        for reason in IGNORED_REASONS:
            self.ignored.labels(reason=reason)
