"""The SGLang HiCache detector wrappers, on replicas of SGLang 0.5.23's counter and reader.

``ReplicaCounter`` / ``ReplicaIndexKeyCache`` have the method names and behaviour of
``LayerDoneCounter`` and ``IndexKeyCache`` (the reader waits on the pool's counter, as in
0.5.23, or not, as the bug did); events are stubs whose completion the test controls.
"""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from cas_engine.sglang.hicache_check import install_read_detector

LAYERS = 4


class StubEvent:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


class ReplicaCounter:
    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.events = [
            SimpleNamespace(
                load_events=[StubEvent() for _ in range(num_layers)], wait=lambda i: None
            )
            for _ in range(3)
        ]
        self.consumer_index = -1

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index

    def wait_until(self, threshold: int) -> None:
        if self.consumer_index < 0:
            return
        self.events[self.consumer_index].wait(threshold)


def _reader_classes(wait_in_getter: bool):
    class ReplicaIndexKeyCache:
        def __init__(self, pool) -> None:
            self.pool = pool
            self.buffer = [f"layer{i}" for i in range(LAYERS)]

        def get_local_buffer(self, layer_id: int):
            if wait_in_getter and self.pool.layer_transfer_counter is not None:
                self.pool.layer_transfer_counter.wait_until(layer_id - self.pool.start_layer)
            return self.buffer[layer_id - self.pool.start_layer]

    class Counter(ReplicaCounter):
        pass

    return Counter, ReplicaIndexKeyCache


def _forward(wait_in_getter: bool, complete: set[int], start_layer: int = 0):
    reg = CollectorRegistry()
    counter_cls, reader_cls = _reader_classes(wait_in_getter)
    patch = install_read_detector(registry=reg, counter_cls=counter_cls, read_cls=reader_cls)
    try:
        counter = counter_cls(LAYERS)
        pool = SimpleNamespace(start_layer=start_layer, layer_transfer_counter=counter)
        reader = reader_cls(pool)
        counter.set_consumer(1)
        for layer in complete:
            counter.events[1].load_events[layer].done = True
        got = [reader.get_local_buffer(start_layer + i) for i in range(LAYERS)]
        assert got == [f"layer{i}" for i in range(LAYERS)]  # reads are unchanged
        return patch.detector, reg.get_sample_value("cas_hicache_read_before_ready_total")
    finally:
        patch.uninstall()


def test_getter_with_per_layer_wait_is_never_flagged() -> None:
    """Regression: 0.5.23's waiting getter must read clean even while loads are in flight."""
    det, metric = _forward(wait_in_getter=True, complete=set())
    assert det is not None and det.total_violations == 0 and metric == 0


def test_getter_without_wait_is_flagged_for_incomplete_layers_only() -> None:
    """Regression: the pre-0.5.11 bug (no wait) is caught exactly on layers still loading."""
    det, metric = _forward(wait_in_getter=False, complete={0, 1}, start_layer=10)
    assert det is not None and det.violated_layers() == [2, 3] and metric == 2


def test_reads_with_no_load_in_flight_are_fine() -> None:
    """Regression: without HiCache activity (consumer_index < 0) nothing is flagged."""
    reg = CollectorRegistry()
    counter_cls, reader_cls = _reader_classes(wait_in_getter=False)
    patch = install_read_detector(registry=reg, counter_cls=counter_cls, read_cls=reader_cls)
    try:
        counter = counter_cls(LAYERS)
        reader = reader_cls(SimpleNamespace(start_layer=0, layer_transfer_counter=counter))
        counter.set_consumer(-1)
        reader.get_local_buffer(0)
        assert patch.detector is not None and patch.detector.total_violations == 0
    finally:
        patch.uninstall()
    assert reader_cls.get_local_buffer is patch.originals[(reader_cls, "get_local_buffer")]
