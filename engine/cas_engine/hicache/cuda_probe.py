"""The read-before-ready experiment on a GPU: a load stream, a forward stream, per-layer events.

Data flow: :func:`run_cuda_probe` stages ``num_layers`` host tensors (pinned), then on a side
"load" stream, per layer: sleeps ``delay_cycles`` on the GPU (the injected delay), copies the
layer host -> device and records that layer's event. On the current ("forward") stream it reads
every layer, either after ``wait_event`` on that layer's event (the fix) or without it (the
bug), and reports to a :class:`~cas_engine.hicache.detector.ReadBeforeReadyDetector`: a layer
is ready if its event has completed when the read is issued, waited if the forward stream
waits on it. After synchronising it compares what was read with what was loaded. Needs torch
with CUDA; imported lazily by callers.
"""

from __future__ import annotations

from dataclasses import dataclass

from cas_engine.hicache.detector import ReadBeforeReadyDetector


@dataclass(frozen=True)
class ProbeResult:
    violations: int  # reads the detector flagged
    stale_layers: int  # layers whose read returned data other than what was loaded


def run_cuda_probe(
    detector: ReadBeforeReadyDetector,
    *,
    wait: bool,
    elements: int = 1 << 20,
    delay_cycles: int = 20_000_000,
) -> ProbeResult:
    import torch

    n = detector.num_layers
    host = [torch.full((elements,), float(i + 1)).pin_memory() for i in range(n)]
    device = [torch.zeros(elements, device="cuda") for _ in range(n)]
    events = [torch.cuda.Event() for _ in range(n)]
    load_stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    detector.begin_load()
    with torch.cuda.stream(load_stream):
        for i in range(n):
            torch.cuda._sleep(delay_cycles)
            device[i].copy_(host[i], non_blocking=True)
            events[i].record(load_stream)
    reads = []
    forward = torch.cuda.current_stream()
    for i in range(n):
        if events[i].query():
            detector.mark_ready(i)
        if wait:
            forward.wait_event(events[i])
            detector.mark_waited(i)
        detector.record_read(i)
        reads.append(device[i].clone())
    torch.cuda.synchronize()
    stale = sum(int(not torch.all(r == float(i + 1)).item()) for i, r in enumerate(reads))
    return ProbeResult(violations=detector.total_violations, stale_layers=stale)
