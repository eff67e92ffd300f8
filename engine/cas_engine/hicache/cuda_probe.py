"""The read-before-ready experiment on a GPU: a load stream, a forward stream, per-layer events.

Data flow: :func:`run_cuda_probe` stages ``num_layers`` host tensors (pinned), then on a side
"load" stream, per layer: sleeps ``delay_cycles`` on the GPU (the injected delay), copies the
layer host -> device and records that layer's event. On the current ("forward") stream it reads
every layer, either after ``wait_event`` on that layer's event (the fix) or without it (the
bug), and reports to a :class:`~cas_engine.hicache.detector.ReadBeforeReadyDetector`: a layer
is ready if its event has completed when the read is issued, waited if the forward stream
waits on it. After synchronising it compares what was read with what was loaded.

:class:`CudaLoadProbe` is the same experiment with its buffers, events and load stream kept
across trials (``tools/gpu_check.py`` runs hundreds of them): :meth:`CudaLoadProbe.trial` says
which layers the detector flagged and which reads returned stale data, and
:meth:`CudaLoadProbe.timed_pass` times each layer's (wait +) read on the forward stream with
CUDA events, to measure what the per-layer wait costs. Needs torch with CUDA; imported lazily
by callers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from cas_engine.hicache.detector import ReadBeforeReadyDetector

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ProbeResult:
    violations: int  # reads the detector flagged
    stale_layers: int  # layers whose read returned data other than what was loaded
    flagged: tuple[int, ...] = ()  # the layers the detector flagged in this trial
    stale: tuple[int, ...] = ()  # the layers whose read was stale in this trial


@dataclass(frozen=True)
class LayerTiming:
    """One forward pass over every layer, timed with CUDA events on the forward stream."""

    gpu_us: tuple[float, ...]  # per layer: from before the (optional) wait to after the read
    host_us_per_layer: float  # host time to issue one layer's (wait +) read, mean of the pass
    span_us: float  # forward stream: first layer's start to last layer's end


class CudaLoadProbe:
    """Pinned host layers, device layers, per-layer load events and a load stream, reused.

    Host layer ``i`` holds the value ``i + 1``. Every trial zeroes the device layers first, so
    a read that is not ordered after layer ``i``'s copy sees zeros or a partial copy.
    """

    def __init__(self, num_layers: int, elements: int = 1 << 20) -> None:
        import torch

        if num_layers <= 0 or elements <= 0:
            raise ValueError("num_layers and elements must be > 0")
        self.num_layers = num_layers
        self.elements = elements
        self.host = [torch.full((elements,), float(i + 1)).pin_memory() for i in range(num_layers)]
        self.device = [torch.zeros(elements, device="cuda") for _ in range(num_layers)]
        self.events = [torch.cuda.Event() for _ in range(num_layers)]
        self.load_stream = torch.cuda.Stream()
        torch.cuda.synchronize()

    def _reset(self) -> None:
        import torch

        for layer in self.device:
            layer.zero_()
        torch.cuda.synchronize()

    def _enqueue_load(self, delay_cycles: int) -> None:
        import torch

        with torch.cuda.stream(self.load_stream):
            for i in range(self.num_layers):
                if delay_cycles > 0:
                    torch.cuda._sleep(delay_cycles)
                self.device[i].copy_(self.host[i], non_blocking=True)
                self.events[i].record(self.load_stream)

    def _stale(self, reads: list[torch.Tensor]) -> tuple[int, ...]:
        import torch

        good = torch.stack([torch.all(r == float(i + 1)) for i, r in enumerate(reads)]).tolist()
        return tuple(i for i, ok in enumerate(good) if not ok)

    def trial(
        self, detector: ReadBeforeReadyDetector, *, wait: bool, delay_cycles: int = 20_000_000
    ) -> ProbeResult:
        """One load and one read of every layer; ``violations`` counts this trial's only."""
        import torch

        if detector.num_layers != self.num_layers:
            raise ValueError("detector and probe must have the same number of layers")
        self._reset()
        before = detector.violations.copy()
        detector.begin_load()
        self._enqueue_load(delay_cycles)
        forward = torch.cuda.current_stream()
        reads = []
        for i in range(self.num_layers):
            if self.events[i].query():
                detector.mark_ready(i)
            if wait:
                forward.wait_event(self.events[i])
                detector.mark_waited(i)
            detector.record_read(i)
            reads.append(self.device[i].clone())
        torch.cuda.synchronize()
        stale = self._stale(reads)
        new = detector.violations - before
        return ProbeResult(
            violations=int(new.sum()),
            stale_layers=len(stale),
            flagged=tuple(int(i) for i in np.flatnonzero(new)),
            stale=stale,
        )

    def timed_pass(self, *, wait: bool, overlap: bool) -> LayerTiming:
        """Time every layer's (wait +) read on the forward stream with CUDA events.

        ``overlap=False``: the loads completed before the pass, so the wait finds its event
        done (its own cost). ``overlap=True``: the loads (no injected delay) are enqueued just
        before the pass, so the wait also holds the forward stream until the copy has landed.
        """
        import torch

        n = self.num_layers
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        self._reset()
        self._enqueue_load(0)
        if not overlap:
            torch.cuda.synchronize()
        forward = torch.cuda.current_stream()
        reads = []
        t0 = time.perf_counter()
        for i in range(n):
            starts[i].record(forward)
            if wait:
                forward.wait_event(self.events[i])
            reads.append(self.device[i].clone())
            ends[i].record(forward)
        host_s = time.perf_counter() - t0
        torch.cuda.synchronize()
        return LayerTiming(
            gpu_us=tuple(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True)),
            host_us_per_layer=host_s * 1e6 / n,
            span_us=starts[0].elapsed_time(ends[-1]) * 1e3,
        )

    def measure_delay_us(self, delay_cycles: int) -> float:
        """GPU time of one injected delay (``torch.cuda._sleep``) on the load stream."""
        import torch

        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.load_stream):
            start.record(self.load_stream)
            torch.cuda._sleep(delay_cycles)
            end.record(self.load_stream)
        torch.cuda.synchronize()
        return float(start.elapsed_time(end) * 1e3)


def run_cuda_probe(
    detector: ReadBeforeReadyDetector,
    *,
    wait: bool,
    elements: int = 1 << 20,
    delay_cycles: int = 20_000_000,
) -> ProbeResult:
    """One trial on fresh buffers; ``violations`` is the detector's total."""
    probe = CudaLoadProbe(detector.num_layers, elements)
    result = probe.trial(detector, wait=wait, delay_cycles=delay_cycles)
    return replace(result, violations=detector.total_violations)
