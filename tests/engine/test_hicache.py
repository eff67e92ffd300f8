"""HiCache load-use ordering: the start-up source check and the read-before-ready detector."""

from __future__ import annotations

import shutil
import textwrap
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from cas_engine.hicache import (
    LayerLoadCounter,
    ReadBeforeReadyDetector,
    check_source_tree,
    create_read_counter,
    run_layer_load,
)
from cas_engine.hicache.source_check import installed_sglang_root

NUM_LAYERS = 6
DELAYS = [0.002] * NUM_LAYERS  # injected per-layer load delay (seconds)

# ---- the run-time detector on CPU ----


def _read_all_layers(counter: LayerLoadCounter, det: ReadBeforeReadyDetector, wait: bool) -> None:
    for layer in range(NUM_LAYERS):
        if wait:
            counter.wait_until(layer, timeout=5.0)
            det.mark_waited(layer)
        det.record_read(layer)


def test_reads_without_wait_are_caught() -> None:
    """Regression: the production bug (indexer reads before the load) must be counted."""
    reg = CollectorRegistry()
    det = ReadBeforeReadyDetector(NUM_LAYERS, counter=create_read_counter(reg))
    counter = LayerLoadCounter(NUM_LAYERS)
    reader_done = threading.Event()
    loader = run_layer_load(counter, DELAYS, detector=det, hold_last=reader_done)
    _read_all_layers(counter, det, wait=False)
    reader_done.set()
    loader.join(timeout=5)
    # the last layer is held back until the reader is done, so at least it was read too early
    assert NUM_LAYERS - 1 in det.violated_layers()
    assert det.total_violations >= 1
    assert reg.get_sample_value("cas_hicache_read_before_ready_total") == det.total_violations
    assert int(det.reads.sum()) == NUM_LAYERS


def test_reads_with_wait_are_not_caught() -> None:
    """Regression: the fix (wait per layer) must never be reported as a violation."""
    reg = CollectorRegistry()
    det = ReadBeforeReadyDetector(NUM_LAYERS, counter=create_read_counter(reg))
    for _ in range(3):  # several loads in a row, each resetting readiness
        counter = LayerLoadCounter(NUM_LAYERS)
        loader = run_layer_load(counter, DELAYS, detector=det)
        _read_all_layers(counter, det, wait=True)
        loader.join(timeout=5)
    assert det.total_violations == 0 and det.loads == 3
    assert reg.get_sample_value("cas_hicache_read_before_ready_total") == 0


def test_reads_after_completion_without_wait_are_fine_and_new_load_resets() -> None:
    """Regression: a read of a layer already loaded is ordered; a new load re-arms the check."""
    det = ReadBeforeReadyDetector(2)
    assert det.record_read(0)  # no load in flight
    det.begin_load()
    det.mark_ready(0)
    assert det.record_read(0) and not det.record_read(1)
    assert det.violated_layers() == [1]


# ---- the start-up source check ----

POOL_OK = """
class KVCache:
    def _wait(self, layer_id):
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer_id - self.start_layer)

class MLATokenToKVPool(KVCache):
    pass

class DSATokenToKVPool(MLATokenToKVPool):
    def get_index_k_with_scale_buffer(self, layer_id):
        return self.index_key_cache.get_local_buffer(layer_id)

    def get_index_k_scale_buffer(self, layer_id, a, b):
        self._wait(layer_id)
        return self.buf[layer_id]
"""
KEY_CACHE_OK = """
class IndexKeyCache:
    def get_local_buffer(self, layer_id):
        if self.pool.layer_transfer_counter is not None:
            self.pool.layer_transfer_counter.wait_until(layer_id)
        return self.buffer[layer_id]
"""


def _tree(tmp_path: Path, pool: str, key_cache: str | None = None) -> Path:
    root = tmp_path / "sglang"
    (root / "srt/mem_cache").mkdir(parents=True)
    (root / "srt/mem_cache/memory_pool.py").write_text(textwrap.dedent(pool))
    if key_cache is not None:
        (root / "srt/mem_cache/index_key_cache.py").write_text(textwrap.dedent(key_cache))
    return root


def test_source_check_accepts_getters_that_wait_directly_or_by_delegation(tmp_path: Path) -> None:
    """Regression: waits reached through self.m() and self.index_key_cache.m() count."""
    verdict = check_source_tree(_tree(tmp_path, POOL_OK, KEY_CACHE_OK), "0.5.23")
    assert verdict.ok, verdict.message
    assert verdict.getters == {
        "DSATokenToKVPool.get_index_k_with_scale_buffer": True,
        "DSATokenToKVPool.get_index_k_scale_buffer": True,
    }


def test_source_check_names_the_getter_that_does_not_wait(tmp_path: Path) -> None:
    """Regression: an SGLang without the per-layer wait must make the launcher refuse."""
    no_wait = KEY_CACHE_OK.replace("self.pool.layer_transfer_counter.wait_until(layer_id)", "pass")
    verdict = check_source_tree(_tree(tmp_path, POOL_OK, no_wait), "0.5.23")
    assert not verdict.ok
    assert verdict.getters["DSATokenToKVPool.get_index_k_with_scale_buffer"] is False
    assert "get_index_k_with_scale_buffer" in verdict.message and "0.5.11" in verdict.message


def test_source_check_refuses_when_no_dsa_pool_exists(tmp_path: Path) -> None:
    """Regression: a layout we cannot analyse is a failure, never a silent pass."""
    verdict = check_source_tree(_tree(tmp_path, "class KVCache:\n    pass\n"), "0.5.23")
    assert not verdict.ok and "no DSA/NSA" in verdict.message


def test_source_check_refuses_old_version_even_if_source_looks_fine(tmp_path: Path) -> None:
    """Regression: the version floor is enforced alongside the source evidence."""
    verdict = check_source_tree(_tree(tmp_path, POOL_OK, KEY_CACHE_OK), "0.5.10")
    assert not verdict.ok and "0.5.10" in verdict.message


def _real_sglang_root() -> Path:
    root = installed_sglang_root()
    if root is None or not (root / "srt/mem_cache/memory_pool.py").is_file():
        pytest.skip("sglang source not installed")
    return root


def test_source_check_passes_on_installed_sglang() -> None:
    """Regression: the pinned SGLang must pass, or the launcher would refuse HiCache."""
    from cas_engine.hicache import check_installed_sglang

    _real_sglang_root()
    verdict = check_installed_sglang()
    assert verdict.ok, verdict.message
    assert any(name.startswith("DSATokenToKVPool.") for name in verdict.getters)


def test_source_check_fails_on_installed_sglang_with_wait_removed(tmp_path: Path) -> None:
    """Regression: removing the real wait from the real source must flip the verdict."""
    root = _real_sglang_root()
    copy = tmp_path / "sglang"
    for rel in ("srt/mem_cache/memory_pool.py", "srt/mem_cache/index_key_cache.py"):
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        if (root / rel).is_file():
            shutil.copy(root / rel, copy / rel)
    key_cache = copy / "srt/mem_cache/index_key_cache.py"
    text = key_cache.read_text()
    assert "layer_transfer_counter.wait_until" in text
    key_cache.write_text(
        text.replace("layer_transfer_counter.wait_until", "layer_transfer_counter.query")
    )
    verdict = check_source_tree(copy, "0.5.23")
    assert not verdict.ok
    assert verdict.getters["DSATokenToKVPool.get_index_k_with_scale_buffer"] is False


# ---- the same experiment on CUDA ----


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs torch with CUDA")
@pytest.mark.parametrize("wait", [False, True])
def test_cuda_streams_read_before_ready(wait: bool) -> None:
    """Regression: on real streams, reads without wait_event are caught and read stale data."""
    from cas_engine.hicache.cuda_probe import run_cuda_probe

    result = run_cuda_probe(ReadBeforeReadyDetector(4), wait=wait)
    if wait:
        assert (result.violations, result.stale_layers) == (0, 0)
    else:
        assert result.violations >= 1 and result.stale_layers >= 1


# ---- the source check on mutated copies of the real source (a check that can fail) ----


def _real_sources() -> dict[str, str]:
    from cas_engine.hicache.source_check import read_sources

    sources = read_sources(_real_sglang_root())
    if len(sources) < 8:
        pytest.skip("sglang source incomplete")
    return sources


def _mutate(sources: dict[str, str], rel: str, old: str, new: str) -> dict[str, str]:
    assert sources[rel].count(old) == 1, f"mutation anchor not unique in {rel}: {old!r}"
    return {**sources, rel: sources[rel].replace(old, new)}


LS = "srt/mem_cache/dsa_cache_layer_split.py"
LS_INDEX_WAIT = """        if self.pool.layer_transfer_counter is not None:
            self.pool.layer_transfer_counter.wait_until(
                layer_id - self.pool.start_layer
            )
        return self.get_broadcastable_buffer(layer_id)"""
LS_KV_WAIT = """        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer_id - self.start_layer)

        kv_buffer = self._get_broadcastable_kv_buffer(layer_id)
        if self.store_dtype != self.dtype:
            return kv_buffer.view(self.dtype)"""


def test_real_source_passes_with_cas_patches_and_names_the_upstream_gaps() -> None:
    """Regression: 0.5.23 passes only thanks to our patches; without them exactly 3 gaps."""
    from cas_engine.hicache.source_check import check_sources

    sources = _real_sources()
    verdict = check_sources(sources, "0.5.23")
    assert verdict.ok, verdict.message
    assert {
        "LayerSplitDSATokenToKVPool",
        "PageInterleaveDSATokenToKVPool",
        "SWAKVPool",
        "DeepSeekV4TokenToKVPool",
        "HiSparseDSATokenToKVPool",
    } <= set(verdict.pools)
    assert verdict.getters["LayerSplitDSATokenToKVPool.get_broadcastable_index_k_with_scale_buffer"]
    bare = check_sources(sources, "0.5.23", patched={})
    assert not bare.ok
    assert sorted(k for k, ok in bare.getters.items() if not ok) == [
        "LayerSplitDSATokenToKVPool.prefetch_kv_buffer",
        "SWAKVPool.get_index_k_scale_buffer",
        "SWAKVPool.get_index_k_with_scale_buffer",
    ]
    assert (
        "dsa_cache_layer_split.py:282"
        in bare.problems["LayerSplitDSATokenToKVPool.prefetch_kv_buffer"]
    )


def test_layer_split_index_getter_with_wait_moved_after_the_read_fails() -> None:
    """Regression: the wait after the owner broadcast (the read) must be caught."""
    from cas_engine.hicache.source_check import check_sources

    moved = LS_INDEX_WAIT.replace(
        "        return self.get_broadcastable_buffer(layer_id)", ""
    ).replace(
        "        if self.pool",
        "        buf = self.get_broadcastable_buffer(layer_id)\n        if self.pool",
    )
    verdict = check_sources(
        _mutate(_real_sources(), LS, LS_INDEX_WAIT, moved + "\n        return buf")
    )
    assert not verdict.ok
    bad = sorted(k for k, ok in verdict.getters.items() if not ok)
    assert "LayerSplitDSATokenToKVPool.get_broadcastable_index_k_with_scale_buffer" in bad
    assert "LayerSplitDSATokenToKVPool.get_index_k_scale_buffer" in bad


def test_layer_split_kv_getter_with_wait_removed_fails() -> None:
    """Regression: get_key_buffer without its wait (the broadcast reads first) must fail."""
    from cas_engine.hicache.source_check import check_sources

    removed = LS_KV_WAIT.split("\n", 2)[2]
    verdict = check_sources(_mutate(_real_sources(), LS, LS_KV_WAIT, removed))
    assert verdict.getters["LayerSplitDSATokenToKVPool.get_key_buffer"] is False
    assert not verdict.ok


def test_dsv4_and_page_interleave_without_their_waits_fail() -> None:
    """Regression: the DSV4 wrapper's wait and the page-interleave gather's wait are both seen."""
    from cas_engine.hicache.source_check import check_sources

    sources = _real_sources()
    dsv4 = _mutate(
        sources,
        "srt/mem_cache/deepseek_v4_memory_pool.py",
        "            self.layer_transfer_counter.wait_until(layer_id - self.start_layer)\n\n"
        "    def get_attention_compress_states",
        "            pass\n\n    def get_attention_compress_states",
    )
    verdict = check_sources(dsv4)
    assert verdict.getters["DeepSeekV4TokenToKVPool.get_index_k_with_scale_buffer"] is False
    pi = _mutate(
        sources,
        "srt/mem_cache/page_interleave_pool.py",
        "                self.layer_transfer_counter.wait_until(local_layer)",
        "                pass",
    )
    verdict = check_sources(pi)
    assert verdict.getters["PageInterleaveDSATokenToKVPool._prefetch_layer"] is False
    assert verdict.getters["PageInterleaveDSATokenToKVPool.get_key_buffer"] is False


def test_upstream_style_fixes_pass_without_cas_patches() -> None:
    """Regression: an SGLang that fixes the gaps itself passes with no patch credited."""
    from cas_engine.hicache.source_check import check_sources

    sources = _mutate(
        _real_sources(),
        LS,
        "        if self.remote_kv_layer_id == layer_id:\n"
        "            return\n        if self.pending",
        "        if self.layer_transfer_counter is not None:\n"
        "            self.layer_transfer_counter.wait_until(layer_id - self.start_layer)\n"
        "        if self.remote_kv_layer_id == layer_id:\n"
        "            return\n        if self.pending",
    )
    swa = "srt/mem_cache/swa_memory_pool.py"
    for name in (
        "get_index_k_with_scale_buffer(self, layer_id: int) -> torch.Tensor:",
        "get_index_k_scale_buffer(self, layer_id: int, *args, **kwargs):",
    ):
        sources = _mutate(sources, swa, name, name + "\n        self._wait_for_layer(layer_id)")
    verdict = check_sources(sources, "0.5.23", patched={})
    assert verdict.ok, verdict.message
