"""A CPU stand-in for HiCache's layer-wise load: a loader thread and a per-layer counter.

Data flow: :class:`LayerLoadCounter` plays SGLang's ``LayerDoneCounter`` on CPU: the loader
thread calls :meth:`LayerLoadCounter.complete` after "copying" each layer (with injected
delays), the reader calls :meth:`LayerLoadCounter.wait_until` before reading a layer (the fix)
or does not (the bug). :func:`run_layer_load` starts such a loader and reports completions to
an optional :class:`~cas_engine.hicache.detector.ReadBeforeReadyDetector`. Used by tests and by
the sim engine; every wait is bounded by a timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from cas_engine.hicache.detector import ReadBeforeReadyDetector


class LayerLoadCounter:
    """Layers completed so far in this load; ``wait_until(L)`` blocks until L is done."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._done = 0
        self._cond = threading.Condition()

    def complete(self, layer: int) -> None:
        """Layers complete in order; completing L means 0..L are all loaded."""
        with self._cond:
            self._done = max(self._done, layer + 1)
            self._cond.notify_all()

    def is_ready(self, layer: int) -> bool:
        with self._cond:
            return layer < self._done

    def wait_until(self, layer: int, timeout: float = 5.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: layer < self._done, timeout=timeout):
                raise TimeoutError(f"layer {layer} not loaded within {timeout}s")


def run_layer_load(
    counter: LayerLoadCounter,
    delays_s: Sequence[float],
    *,
    detector: ReadBeforeReadyDetector | None = None,
    hold_last: threading.Event | None = None,
    hold_timeout_s: float = 5.0,
) -> threading.Thread:
    """Start a loader thread that completes layer i after sleeping ``delays_s[i]``.

    ``hold_last`` (optional) keeps the last layer incomplete until it is set (bounded by
    ``hold_timeout_s``), which makes a read of that layer before the wait deterministic.
    """
    if len(delays_s) != counter.num_layers:
        raise ValueError("one delay per layer")
    if detector is not None:
        detector.begin_load()

    def load() -> None:
        for layer, delay in enumerate(delays_s):
            time.sleep(delay)
            if hold_last is not None and layer == counter.num_layers - 1:
                hold_last.wait(hold_timeout_s)
            if detector is not None:
                detector.mark_ready(layer)
            counter.complete(layer)

    thread = threading.Thread(target=load, name="cas-hicache-cpu-loader", daemon=True)
    thread.start()
    return thread
