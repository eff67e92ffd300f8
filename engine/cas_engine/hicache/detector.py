"""Run-time detector of index-cache reads that happen before their layer finished loading.

Data flow: HiCache loads a batch's KV (and the sparse-attention indexer cache) from host memory
layer by layer on a load stream/thread; the forward pass reads layer L's index cache on another.
Three events reach the detector, from whichever threads own them:

- :meth:`ReadBeforeReadyDetector.begin_load` when a new load (one batch) starts: all layers
  become not-ready;
- :meth:`~ReadBeforeReadyDetector.mark_ready` when layer L's load has completed (the loader;
  on CUDA: the load event of L has completed, i.e. ``event.query()`` is true);
- :meth:`~ReadBeforeReadyDetector.mark_waited` when the reader has ordered itself after layer
  L's load (on CPU it blocked until ready; on CUDA the forward stream waits on the load event,
  so the read is ordered even though the host does not block);
- :meth:`~ReadBeforeReadyDetector.record_read` when the reader reads layer L's index cache.

A read of a layer that is neither ready nor waited for is a read-before-ready: counted per
layer and in ``cas_hicache_read_before_ready_total``. The detector owns only its flags; it
never blocks the reader. Thread-safe (one lock; every call is O(1)).
"""

from __future__ import annotations

import logging
import threading

import numpy as np
from prometheus_client import CollectorRegistry, Counter

logger = logging.getLogger("cas_engine.hicache")


def create_read_counter(registry: CollectorRegistry) -> Counter:
    """The detector's metric, registered on the registry ``/metrics`` serves."""
    return Counter(
        "cas_hicache_read_before_ready_total",
        "Index-cache reads of a layer whose HiCache load had not completed nor been waited for",
        registry=registry,
    )


class ReadBeforeReadyDetector:
    """Per-layer ready/waited flags for the current load and violation counts."""

    def __init__(self, num_layers: int, *, counter: Counter | None = None) -> None:
        if num_layers <= 0:
            raise ValueError("num_layers must be > 0")
        self.num_layers = num_layers
        self._counter = counter
        self._lock = threading.Lock()
        self._ready = np.ones(num_layers, dtype=bool)  # nothing loading yet: all usable
        self._waited = np.zeros(num_layers, dtype=bool)
        self.reads = np.zeros(num_layers, dtype=np.int64)
        self.violations = np.zeros(num_layers, dtype=np.int64)
        self.loads = 0

    def begin_load(self) -> None:
        """A new layer-wise load starts: every layer is not ready until marked."""
        with self._lock:
            self._ready[:] = False
            self._waited[:] = False
            self.loads += 1

    def mark_ready(self, layer: int) -> None:
        with self._lock:
            self._ready[layer] = True

    def mark_waited(self, layer: int) -> None:
        with self._lock:
            self._waited[layer] = True

    def record_read(self, layer: int) -> bool:
        """Record one read of ``layer``; return False (and count it) if it was not ordered."""
        with self._lock:
            self.reads[layer] += 1
            ok = bool(self._ready[layer] or self._waited[layer])
            if not ok:
                self.violations[layer] += 1
        if not ok:
            if self._counter is not None:
                self._counter.inc()
            logger.error(
                "hicache read-before-ready: layer %d read before its load completed", layer
            )
        return ok

    @property
    def total_violations(self) -> int:
        return int(self.violations.sum())

    def violated_layers(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(self.violations)]
