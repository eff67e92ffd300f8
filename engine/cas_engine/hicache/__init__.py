"""HiCache load-use ordering: a start-up source check and a run-time read-before-ready detector.

HiCache swaps KV (and the DSA indexer cache) from host memory to the GPU layer by layer on a
load stream; the sparse-attention indexer on the forward stream must not read layer L's index
cache before that layer's load has completed (the production bug: garbled output under load).

- :mod:`~cas_engine.hicache.source_check`: verifies, without importing SGLang, that the
  installed version's DSA/NSA index-cache getters wait on the layer transfer counter (upstream
  since 0.5.11); the launcher refuses ``--enable-hierarchical-cache`` when it does not.
- :mod:`~cas_engine.hicache.detector`: per-layer ready / waited / read flags, counting reads
  that were not ordered after the load in ``cas_hicache_read_before_ready_total``.
- :mod:`~cas_engine.hicache.cpu_loader`: a CPU loader thread and layer counter (tests, sim).
- :mod:`~cas_engine.hicache.cuda_probe`: the same with CUDA streams and events (GPU only).
"""

from cas_engine.hicache.cpu_loader import LayerLoadCounter, run_layer_load
from cas_engine.hicache.detector import ReadBeforeReadyDetector, create_read_counter
from cas_engine.hicache.source_check import (
    MIN_SGLANG_VERSION,
    HiCacheVerdict,
    check_installed_sglang,
    check_source_tree,
)

__all__ = [
    "MIN_SGLANG_VERSION",
    "HiCacheVerdict",
    "LayerLoadCounter",
    "ReadBeforeReadyDetector",
    "check_installed_sglang",
    "check_source_tree",
    "create_read_counter",
    "run_layer_load",
]
