"""The HiCache detector on SGLang 0.5.23's real LayerDoneCounter and IndexKeyCache (CPU).

The real ``IndexKeyCache`` is built on CPU tensors with a stub pool, the real
``LayerDoneCounter`` with stub events (CUDA events need a GPU). Skipped where SGLang does not
import (it needs torch and SGLang's Python deps; ~20 s to import).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from cas_engine.sglang.hicache_check import install_read_detector
from tests.engine.sglang_real import sglang_import_problem

WHY_NOT = sglang_import_problem(
    "sglang.srt.managers.cache_controller", "sglang.srt.mem_cache.index_key_cache"
)
pytestmark = [pytest.mark.sglang_real, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]

if WHY_NOT is None:
    import torch
    from sglang.srt.managers.cache_controller import LayerDoneCounter
    from sglang.srt.mem_cache.index_key_cache import IndexKeyCache

LAYERS = 3


class StubLoadingEvent:
    """LayerLoadingEvent without CUDA: wait() records, load_events[i].query() is settable."""

    def __init__(self) -> None:
        self.load_events = [SimpleNamespace(done=False) for _ in range(LAYERS)]
        for ev in self.load_events:
            ev.query = lambda ev=ev: ev.done
        self.waited: list[int] = []

    def wait(self, layer: int) -> None:
        self.waited.append(layer)


def _counter() -> LayerDoneCounter:
    counter = object.__new__(LayerDoneCounter)
    counter.num_layers = LAYERS
    counter.num_counters = 3
    counter.events = [StubLoadingEvent() for _ in range(3)]
    counter.producer_index = -1
    counter.consumer_index = -1
    return counter


def _index_key_cache(counter: LayerDoneCounter) -> IndexKeyCache:
    pool = SimpleNamespace(
        page_size=64,
        index_kpool=1,
        index_head_dim=128,
        quant_block_size=128,
        index_page_size=64,
        layer_num=LAYERS,
        skip_topk_layers=[False] * LAYERS,
        index_k_with_scale_buffer_dtype=torch.uint8,
        device="cpu",
        custom_mem_pool=None,
        memory_saver_adapter=SimpleNamespace(region=lambda kind: contextlib.nullcontext()),
        start_layer=0,
        layer_transfer_counter=counter,
    )
    return IndexKeyCache(pool, index_buf_size=128)


def test_real_getter_waits_so_reads_are_never_flagged() -> None:
    """Regression: 0.5.23's IndexKeyCache read waits per layer; the detector must agree."""
    reg = CollectorRegistry()
    patch = install_read_detector(registry=reg)
    try:
        counter = _counter()
        cache = _index_key_cache(counter)
        counter.set_consumer(2)
        for layer in range(LAYERS):
            assert cache.get_local_buffer(layer).dtype == torch.uint8
        assert counter.events[2].waited == list(range(LAYERS))  # SGLang's own wait ran
        assert patch.detector is not None and patch.detector.total_violations == 0
        assert reg.get_sample_value("cas_hicache_read_before_ready_total") == 0
    finally:
        patch.uninstall()


def test_real_getter_with_wait_removed_is_flagged() -> None:
    """Regression: if a read skips the wait (the old bug), the detector counts it."""
    reg = CollectorRegistry()
    patch = install_read_detector(registry=reg)
    original_wait = patch.originals[(LayerDoneCounter, "wait_until")]
    try:
        LayerDoneCounter.wait_until = lambda self, threshold: None  # simulate no wait at all
        counter = _counter()
        cache = _index_key_cache(counter)
        counter.set_consumer(0)
        counter.events[0].load_events[0].done = True
        for layer in range(LAYERS):
            cache.get_local_buffer(layer)
        assert patch.detector is not None and patch.detector.violated_layers() == [1, 2]
    finally:
        patch.uninstall()
    assert LayerDoneCounter.wait_until is original_wait
