"""HiCache load-use ordering in SGLang 0.5.23: the start-up check and the run-time detector.

- :func:`check_hicache_ordering`: the launcher's start-up check, the source analysis of
  :mod:`cas_engine.hicache.source_check` on the installed SGLang (no import of SGLang).
- :func:`install_read_detector`: off by default (``--cas-hicache-detector``). Wraps three
  methods, all on the forward (consumer) thread of the scheduler process:
  ``LayerDoneCounter.set_consumer`` (a new batch's layer-wise load becomes the one read: the
  detector re-arms), ``LayerDoneCounter.wait_until(L)`` (the forward stream now waits on layer
  L's load event: L is ordered), and ``IndexKeyCache.get_local_buffer(layer_id)`` (every DSA
  index-cache read in 0.5.23 goes through it): after the original returns, a read of a layer
  whose load event has neither completed (``event.query()``) nor been waited for is counted in
  ``cas_hicache_read_before_ready_total``.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from cas_engine.hicache import (
    HiCacheVerdict,
    ReadBeforeReadyDetector,
    check_installed_sglang,
    create_read_counter,
)

logger = logging.getLogger("cas_engine.sglang.hicache")

COUNTER_MODULE = "sglang.srt.managers.cache_controller"
COUNTER_CLASS = "LayerDoneCounter"
READ_MODULE = "sglang.srt.mem_cache.index_key_cache"
READ_CLASS = "IndexKeyCache"
ORIGINAL_ATTR = "__cas_hicache_original__"


def check_hicache_ordering() -> HiCacheVerdict:
    """Start-up verdict for the installed SGLang (see :mod:`cas_engine.hicache.source_check`)."""
    return check_installed_sglang()


@dataclass
class DetectorPatch:
    """Installed wrappers; :attr:`detector` appears at the first load (layer count known)."""

    counter_cls: type
    read_cls: type
    originals: dict[tuple[type, str], Any]
    counter: Any = None
    detector: ReadBeforeReadyDetector | None = None

    def uninstall(self) -> None:
        for (cls, name), fn in self.originals.items():
            setattr(cls, name, fn)


def _layer_ready(counter: Any, layer: int) -> bool:
    """True when no load is in flight for this reader or layer ``layer``'s event completed."""
    if counter is None or counter.consumer_index < 0:
        return True
    return bool(counter.events[counter.consumer_index].load_events[layer].query())


def install_read_detector(
    *,
    registry: CollectorRegistry,
    counter_cls: type | None = None,
    read_cls: type | None = None,
) -> DetectorPatch:
    """Wrap SGLang's layer counter and index-cache read (defaults: the real classes)."""
    counter_cls = counter_cls or getattr(importlib.import_module(COUNTER_MODULE), COUNTER_CLASS)
    read_cls = read_cls or getattr(importlib.import_module(READ_MODULE), READ_CLASS)
    for cls, name in (
        (counter_cls, "set_consumer"),
        (counter_cls, "wait_until"),
        (read_cls, "get_local_buffer"),
    ):
        if not callable(getattr(cls, name, None)):
            raise RuntimeError(
                f"cannot install the hicache detector: {cls.__name__}.{name} missing"
            )
    metric = create_read_counter(registry)
    counter_t: Any = counter_cls
    read_t: Any = read_cls
    set_consumer, wait_until = counter_t.set_consumer, counter_t.wait_until
    get_local_buffer = read_t.get_local_buffer
    patch = DetectorPatch(
        counter_cls,
        read_cls,
        {
            (counter_cls, "set_consumer"): set_consumer,
            (counter_cls, "wait_until"): wait_until,
            (read_cls, "get_local_buffer"): get_local_buffer,
        },
    )

    def _set_consumer(self: Any, index: int) -> Any:
        out = set_consumer(self, index)
        if patch.detector is None:
            patch.detector = ReadBeforeReadyDetector(self.num_layers, counter=metric)
        patch.counter = self
        patch.detector.begin_load()
        return out

    def _wait_until(self: Any, threshold: int) -> Any:
        out = wait_until(self, threshold)
        if patch.detector is not None and self is patch.counter and self.consumer_index >= 0:
            patch.detector.mark_waited(threshold)
        return out

    def _get_local_buffer(self: Any, layer_id: int) -> Any:
        out = get_local_buffer(self, layer_id)
        det = patch.detector
        if det is not None:
            layer = layer_id - self.pool.start_layer
            counter = self.pool.layer_transfer_counter
            if _layer_ready(counter, layer):
                det.mark_ready(layer)
            det.record_read(layer)
        return out

    for (cls, name), original in patch.originals.items():
        wrapper = {
            "set_consumer": _set_consumer,
            "wait_until": _wait_until,
            "get_local_buffer": _get_local_buffer,
        }[name]
        setattr(wrapper, "__wrapped__", original)  # noqa: B010 - typed as a function
        setattr(wrapper, ORIGINAL_ATTR, original)
        setattr(cls, name, wrapper)
    logger.info("cas hicache read-before-ready detector installed")
    return patch
