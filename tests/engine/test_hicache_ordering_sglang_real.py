"""The layer-split prefetch race and the SWA index-getter gap, on SGLang 0.5.23's real code (CPU).

Real: ``maybe_prefetch_next_full_attention_kv`` (the decoder layer's call site),
``LayerSplitDSATokenToKVPool.prefetch_kv_buffer`` / ``get_key_buffer`` /
``_broadcast_tensor_from_owner``, ``LayerDoneCounter`` and ``SWAKVPool``'s getters. Stand-ins:
the HiCache load "stream" is a loader thread that writes layer 1 after an injected delay and
sets that layer's event; ``LayerLoadingEvent.wait`` blocks the host until it is set. Streams
execute on the host in program order, so "enqueued after a wait" means "runs after it": this
models a wait and a read on the *same* stream (what the patch provides), not cross-stream
ordering, which only a GPU shows. This rank (0 of 2) owns layers 0-1, so the prefetch of layer 1
is the owner copying its ``kv_buffer[1]`` into the broadcast scratch.
"""

from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from cas_engine.sglang.hicache_check import install_ordering_patches, install_read_detector
from tests.engine.sglang_real import sglang_import_problem

WHY_NOT = sglang_import_problem(
    "sglang.srt.managers.cache_controller",
    "sglang.srt.mem_cache.dsa_cache_layer_split",
    "sglang.srt.mem_cache.swa_memory_pool",
    "sglang.srt.layers.attention.dsa.utils",
)
pytestmark = [pytest.mark.sglang_real, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]

if WHY_NOT is None:
    import torch
    from sglang.srt.layers.attention.dsa import utils as dsa_utils
    from sglang.srt.managers.cache_controller import LayerDoneCounter
    from sglang.srt.mem_cache import dsa_cache_layer_split as split_mod
    from sglang.srt.mem_cache.dsa_cache_layer_split import LayerSplitDSATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

LAYERS = 4
LOADED = 7.0  # what HiCache writes into layer 1
LOAD_DELAY_S = 0.3


class ThreadLoadingEvent:
    """LayerLoadingEvent on CPU: per-layer threading events set by the loader thread."""

    def __init__(self) -> None:
        self.done = [threading.Event() for _ in range(LAYERS)]
        self.load_events = [SimpleNamespace(query=ev.is_set) for ev in self.done]
        self.waited: list[int] = []

    def wait(self, layer: int) -> None:  # stream.wait_event: later work runs after the load
        self.waited.append(layer)
        assert self.done[layer].wait(timeout=5.0), f"layer {layer} never loaded"


class FakeComm:
    def __init__(self) -> None:
        self.broadcasts = 0

    @contextlib.contextmanager
    def change_state(self, enable: bool):
        yield

    def broadcast(self, tensor, src: int) -> None:  # this rank is the source: nothing to receive
        self.broadcasts += 1


class HostStreams:
    """device_module stand-in: every stream runs on the host, in program order."""

    def current_stream(self):
        return SimpleNamespace(wait_stream=lambda other: None)

    def stream(self, s):
        return contextlib.nullcontext()


@pytest.fixture(autouse=True)
def upstream_classes(monkeypatch):
    """Run on upstream's methods even if the plugin patched them earlier in this process."""
    from cas_engine.sglang.hicache_check import ORIGINAL_ATTR

    for cls, name in [
        (LayerSplitDSATokenToKVPool, "prefetch_kv_buffer"),
        (SWAKVPool, "get_index_k_with_scale_buffer"),
        (SWAKVPool, "get_index_k_scale_buffer"),
    ]:
        original = getattr(cls.__dict__[name], ORIGINAL_ATTR, None)
        if original is not None:
            monkeypatch.setattr(cls, name, original)


def _counter() -> LayerDoneCounter:
    counter = object.__new__(LayerDoneCounter)
    counter.num_layers = LAYERS
    counter.num_counters = 1
    counter.events = [ThreadLoadingEvent()]
    counter.producer_index = 0
    counter.consumer_index = -1
    return counter


def _pool(counter: LayerDoneCounter, dedicated_comm: bool) -> LayerSplitDSATokenToKVPool:
    pool = object.__new__(LayerSplitDSATokenToKVPool)
    pool.layer_shard_rank, pool.layer_shard_size = 0, 2
    pool.layer_num, pool.start_layer = LAYERS, 0
    pool.store_dtype = pool.dtype = torch.float32
    pool.kv_buffer = [
        torch.zeros(8, 1, 4) if i < 2 else torch.zeros(0, 1, 4) for i in range(LAYERS)
    ]
    pool.remote_kv_buffer = torch.zeros(8, 1, 4)
    pool.remote_kv_layer_id = None
    pool.pending_remote_kv_layer_id = None
    pool.pending_remote_kv_broadcast = False
    pool.device_module = HostStreams()
    pool.kv_broadcast_stream = SimpleNamespace(wait_stream=lambda other: None)
    pool.layer_broadcast_comm = FakeComm() if dedicated_comm else None
    pool.layer_transfer_counter = counter
    return pool


def _start_load(pool, counter) -> threading.Thread:
    """Layer 0 is resident; layer 1 lands LOAD_DELAY_S later (the injected delay)."""
    events = counter.events[0]
    events.done[0].set()
    counter.set_consumer(0)

    def load() -> None:
        time.sleep(LOAD_DELAY_S)
        pool.kv_buffer[1].fill_(LOADED)
        events.done[1].set()

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    return thread


def _layer0_then_prefetch(monkeypatch, dedicated_comm: bool):
    counter = _counter()
    pool = _pool(counter, dedicated_comm)
    monkeypatch.setattr(
        split_mod,
        "get_parallel",
        lambda: SimpleNamespace(
            attn_cp_group=SimpleNamespace(pynccl_comm=FakeComm(), cpu_group=None)
        ),
    )
    monkeypatch.setattr(dsa_utils, "dsa_use_prefill_cp", lambda batch: True)
    monkeypatch.setattr(dsa_utils, "get_token_to_kv_pool", lambda: pool)
    loader = _start_load(pool, counter)
    pool.get_key_buffer(0)  # layer 0's attention: waits for layer 0 only
    dsa_utils.maybe_prefetch_next_full_attention_kv(object(), 1)  # deepseek_v2.py:2830
    read = pool.get_key_buffer(1).clone()  # layer 1's attention: waits for layer 1, then reads
    loader.join(timeout=5)
    return counter, pool, read


@pytest.mark.parametrize("dedicated_comm", [False, True], ids=["sync-path", "async-path"])
def test_upstream_prefetch_reads_layer_before_its_load(monkeypatch, dedicated_comm: bool) -> None:
    """Regression: the race is real in 0.5.23; the wait in get_key_buffer(1) comes too late."""
    counter, pool, read = _layer0_then_prefetch(monkeypatch, dedicated_comm)
    assert counter.events[0].waited == [0, 1]  # get_key_buffer(1) did wait...
    assert pool.kv_buffer[1].eq(LOADED).all()  # ...and the load did land...
    assert read.eq(0).all()  # ...but the prefetched scratch copy is the stale one it returns


@pytest.mark.parametrize("dedicated_comm", [False, True], ids=["sync-path", "async-path"])
def test_patched_prefetch_waits_for_the_layer_it_reads(monkeypatch, dedicated_comm: bool) -> None:
    """Regression: with the cas patch the prefetch of L+1 waits for L+1's load and reads it."""
    patch = install_ordering_patches()
    try:
        counter, _pool, read = _layer0_then_prefetch(monkeypatch, dedicated_comm)
    finally:
        patch.uninstall()
    assert read.eq(LOADED).all()
    assert counter.events[0].waited[:2] == [0, 1]  # the prefetch's wait for layer 1
    assert (
        LayerSplitDSATokenToKVPool.prefetch_kv_buffer
        is patch.originals[(LayerSplitDSATokenToKVPool, "prefetch_kv_buffer")]
    )


@pytest.mark.parametrize("patched", [False, True])
def test_detector_counts_the_layer_split_prefetch_race(monkeypatch, patched: bool) -> None:
    """Regression: the detector sees the layer-split broadcast (it bypasses get_local_buffer)."""
    reg = CollectorRegistry()
    det_patch = install_read_detector(registry=reg)
    order = install_ordering_patches() if patched else None
    try:
        _layer0_then_prefetch(monkeypatch, dedicated_comm=False)
    finally:
        if order is not None:
            order.uninstall()
        det_patch.uninstall()
    det = det_patch.detector
    assert det is not None and int(det.reads.sum()) >= 2
    assert det.violated_layers() == ([] if patched else [1])
    assert reg.get_sample_value("cas_hicache_read_before_ready_total") == (0 if patched else 1)


def _swa_pool(counter: LayerDoneCounter, reads: list[str]) -> SWAKVPool:
    events = counter.events[0]

    def inner_read(layer_id: int, *args):
        reads.append("read" if events.done[layer_id].is_set() else "stale-read")
        return torch.zeros(1)

    pool = object.__new__(SWAKVPool)
    pool.layers_mapping = {i: (i, False) for i in range(LAYERS)}
    pool.start_layer = 0
    pool.layer_transfer_counter = counter
    pool.full_kv_pool = SimpleNamespace(
        get_index_k_with_scale_buffer=inner_read, get_index_k_scale_buffer=inner_read
    )
    return pool


@pytest.mark.parametrize("patched", [False, True])
def test_swa_index_getters_wait_only_when_patched(patched: bool) -> None:
    """Regression: SWAKVPool's index getters skip the wait in 0.5.23; the patch adds it."""
    counter = _counter()
    reads: list[str] = []
    pool = _swa_pool(counter, reads)
    counter.set_consumer(0)
    threading.Timer(0.1, counter.events[0].done[2].set).start()
    patch = install_ordering_patches() if patched else None
    try:
        pool.get_index_k_with_scale_buffer(2)
        pool.get_index_k_scale_buffer(2, None, None, 0, 0)
    finally:
        if patch is not None:
            patch.uninstall()
    assert reads == (["read", "read"] if patched else ["stale-read", "stale-read"])
    assert counter.events[0].waited == ([2, 2] if patched else [])
