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
  ``cas_hicache_read_before_ready_total``. Under CP layer split the index cache and the latent
  KV are read through ``LayerSplitDSATokenToKVPool._broadcast_tensor_from_owner`` (the owner
  copies its layer into the scratch buffer and broadcasts it, dsa_cache_layer_split.py:271-302;
  ``LayerSplitIndexKeyCache.get_buffer`` never calls ``get_local_buffer``), so that is wrapped
  too: a broadcast of a layer not ready nor waited for is counted the same way.
  What it proves: ``event.query()`` true means the load of that layer had finished on the GPU
  when the read was enqueued, so that read is safe. What it cannot: a false ``query()`` and no
  wait only means the read was not *ordered* (the GPU may still run it after the copy); a
  ``wait_until`` is credited whichever stream it ran on (a wait on one stream does not order a
  read on another); a CUDA event never recorded answers ``query()`` True, so a read issued
  before the loader even enqueued that layer is missed. Only a GPU run with a stale-data
  comparison (``cas_engine.hicache.cuda_probe``) shows actual stale reads.
- :func:`install_ordering_patches`: on by default in every SGLang process. Closes the two
  load-use gaps the source check finds in 0.5.23 (see
  :data:`cas_engine.hicache.source_check.PATCHED`):

  1. layer-split prefetch: ``DeepseekV2DecoderLayer.forward`` (models/deepseek_v2.py:2830)
     calls ``maybe_prefetch_next_full_attention_kv(batch, L + 1)`` after layer L's attention,
     which calls ``pool.prefetch_kv_buffer(L + 1)`` with no counter
     (layers/attention/dsa/utils.py:323-325). ``prefetch_kv_buffer`` then reads
     ``kv_buffer[L + 1]`` for the owner broadcast without waiting for L + 1's HiCache load: on
     the synchronous path (no dedicated comm, dsa_cache_layer_split.py:484-492) on the current
     stream, which so far waited only up to layer L; on the async path it waits only if a
     counter was passed (:496-497). It records ``remote_kv_layer_id = L + 1`` (or the pending
     broadcast, finalised at :455-458), so the later ``get_key_buffer(L + 1)`` waits (:378)
     and then returns the stale scratch copy. The patch fills in upstream's own hook: the
     async path gets ``(pool.layer_transfer_counter, L + 1 - start_layer)`` (the wait runs on
     the broadcast stream, the forward stream keeps overlapping); the synchronous path waits on
     the current stream before the broadcast.
  2. SWA wrapper index getters: ``SWAKVPool.get_index_k_with_scale_buffer`` and
     ``get_index_k_scale_buffer`` (swa_memory_pool.py:314-324) call the inner DSA pool, whose
     counter the wrapper set to None (:159-163), without ``_wait_for_layer``; the patch adds
     the wrapper's own wait first, as its KV getters do (:206-241).
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
LAYER_SPLIT_MODULE = "sglang.srt.mem_cache.dsa_cache_layer_split"
LAYER_SPLIT_CLASS = "LayerSplitDSATokenToKVPool"
SWA_MODULE = "sglang.srt.mem_cache.swa_memory_pool"
SWA_CLASS = "SWAKVPool"
SWA_INDEX_GETTERS = ("get_index_k_with_scale_buffer", "get_index_k_scale_buffer")
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


def _load(module: str, name: str) -> type:
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def install_read_detector(
    *,
    registry: CollectorRegistry,
    counter_cls: type | None = None,
    read_cls: type | None = None,
    layer_split_cls: type | None = None,
) -> DetectorPatch:
    """Wrap SGLang's layer counter, index-cache read and layer-split broadcast.

    Defaults: the real classes. ``layer_split_cls`` is wrapped only when given or importable.
    """
    counter_cls = counter_cls or _load(COUNTER_MODULE, COUNTER_CLASS)
    read_cls = read_cls or _load(READ_MODULE, READ_CLASS)
    if layer_split_cls is None:
        try:
            layer_split_cls = _load(LAYER_SPLIT_MODULE, LAYER_SPLIT_CLASS)
        except (ImportError, AttributeError) as exc:
            logger.warning("hicache detector: layer-split pool not covered: %s", exc)
    targets = [
        (counter_cls, "set_consumer"),
        (counter_cls, "wait_until"),
        (read_cls, "get_local_buffer"),
    ]
    if layer_split_cls is not None:
        targets.append((layer_split_cls, "_broadcast_tensor_from_owner"))
    for cls, name in targets:
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
        counter_cls, read_cls, {(cls, name): getattr(cls, name) for cls, name in targets}
    )
    broadcast = (
        patch.originals.get((layer_split_cls, "_broadcast_tensor_from_owner"))
        if layer_split_cls is not None
        else None
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

    def _broadcast_tensor_from_owner(
        self: Any, tensor: Any, layer_id: int, *a: Any, **kw: Any
    ) -> Any:
        # record before the call: the owner's copy and the broadcast are enqueued inside it
        det = patch.detector
        if det is not None:
            layer = layer_id - self.start_layer
            if _layer_ready(self.layer_transfer_counter, layer):
                det.mark_ready(layer)
            det.record_read(layer)
        assert broadcast is not None
        return broadcast(self, tensor, layer_id, *a, **kw)

    for (cls, name), original in patch.originals.items():
        wrapper = {
            "set_consumer": _set_consumer,
            "wait_until": _wait_until,
            "get_local_buffer": _get_local_buffer,
            "_broadcast_tensor_from_owner": _broadcast_tensor_from_owner,
        }[name]
        setattr(wrapper, "__wrapped__", original)  # noqa: B010 - typed as a function
        setattr(wrapper, ORIGINAL_ATTR, original)
        setattr(cls, name, wrapper)
    logger.info("cas hicache read-before-ready detector installed")
    return patch


@dataclass
class OrderingPatch:
    """The installed load-use ordering fixes; :meth:`uninstall` restores upstream."""

    originals: dict[tuple[type, str], Any]

    def uninstall(self) -> None:
        for (cls, name), fn in self.originals.items():
            setattr(cls, name, fn)


def _wrap(cls: type, name: str, wrapper: Any, originals: dict[tuple[type, str], Any]) -> None:
    original = cls.__dict__[name]
    setattr(wrapper, "__wrapped__", original)  # noqa: B010
    setattr(wrapper, ORIGINAL_ATTR, original)
    originals[(cls, name)] = original
    setattr(cls, name, wrapper)


def patch_layer_split_prefetch(cls: type, originals: dict[tuple[type, str], Any]) -> None:
    """Make ``prefetch_kv_buffer(L)`` wait for layer L's HiCache load before reading it."""
    original = cls.__dict__.get("prefetch_kv_buffer")
    if original is None or getattr(original, ORIGINAL_ATTR, None) is not None:
        raise RuntimeError(f"{cls.__name__}.prefetch_kv_buffer missing or already patched")

    def prefetch_kv_buffer(
        self: Any,
        layer_id: int,
        layer_transfer_counter: Any = None,
        layer_transfer_idx: int | None = None,
    ) -> Any:
        counter = self.layer_transfer_counter
        if counter is not None and layer_transfer_counter is None:
            local = layer_id - self.start_layer
            if self.layer_broadcast_comm is None:
                # synchronous path (dsa_cache_layer_split.py:484-492): the owner's copy and the
                # broadcast run on the current stream, so order that stream after the load
                counter.wait_until(local)
            else:
                # async path: upstream's own hook waits on the broadcast stream (:496-497)
                layer_transfer_counter, layer_transfer_idx = counter, local
        return original(self, layer_id, layer_transfer_counter, layer_transfer_idx)

    _wrap(cls, "prefetch_kv_buffer", prefetch_kv_buffer, originals)


def patch_swa_index_getters(cls: type, originals: dict[tuple[type, str], Any]) -> None:
    """Make ``SWAKVPool``'s index getters wait like its KV getters (``_wait_for_layer``)."""
    if not callable(getattr(cls, "_wait_for_layer", None)):
        raise RuntimeError(f"{cls.__name__}._wait_for_layer missing")
    for name in SWA_INDEX_GETTERS:
        original = cls.__dict__.get(name)
        if original is None or getattr(original, ORIGINAL_ATTR, None) is not None:
            raise RuntimeError(f"{cls.__name__}.{name} missing or already patched")

        def getter(self: Any, layer_id: int, *args: Any, __fn: Any = original, **kw: Any) -> Any:
            self._wait_for_layer(layer_id)
            return __fn(self, layer_id, *args, **kw)

        _wrap(cls, name, getter, originals)


def install_ordering_patches(
    *, layer_split_cls: type | None = None, swa_cls: type | None = None
) -> OrderingPatch:
    """Install both fixes on the real classes (or the given ones); a second call is a no-op."""
    layer_split_cls = layer_split_cls or _load(LAYER_SPLIT_MODULE, LAYER_SPLIT_CLASS)
    swa_cls = swa_cls or _load(SWA_MODULE, SWA_CLASS)
    originals: dict[tuple[type, str], Any] = {}
    installed = getattr(layer_split_cls.__dict__.get("prefetch_kv_buffer"), ORIGINAL_ATTR, None)
    if installed is not None:
        return OrderingPatch({})  # already installed in this process (the plugin ran)
    try:
        patch_layer_split_prefetch(layer_split_cls, originals)
        patch_swa_index_getters(swa_cls, originals)
    except BaseException:
        OrderingPatch(originals).uninstall()
        raise
    logger.info("cas hicache load-use ordering patches installed (layer-split prefetch, SWA)")
    return OrderingPatch(originals)
