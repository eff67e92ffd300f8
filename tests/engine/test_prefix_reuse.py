"""The prefix reuse tracker (cas_engine.prefixreuse), its metrics and its adapters' logic.

Guards: keys that follow token prefixes exactly, reuse times from a bounded ghost map that
outlives the cache, a sampled estimate that matches the exact one, a token-weighted histogram
that survives prometheus-client's multiprocess mode (SGLang's), the sim engine exporting what
the operator reads, and the SGLang hook's decisions on a stand-in scheduler class."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from array import array
from enum import Enum
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cas_engine.prefixreuse import ReuseMetrics, ReuseTracker, block_keys
from cas_engine.sglang.prefix_reuse import (
    PrefixReusePatchError,
    check_targets,
    install_prefix_reuse,
    prompt_tokens,
)

REPO = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, s.labels.get("le", ""))] = s.value
    return out


def test_keys_are_equal_exactly_as_far_as_the_token_prefixes_are() -> None:
    rng = np.random.default_rng(1)
    a = rng.integers(0, 150_000, 64 * 10 + 30)
    b = a.copy()
    b[64 * 6 + 5] += 1  # a change inside block 6
    ka, kb = block_keys(a, 64), block_keys(b, 64)
    assert len(ka) == 10  # the partial last block has no key
    assert (ka[:6] == kb[:6]).all() and (ka[6:] != kb[6:]).all()
    shifted = block_keys(np.concatenate([[7], a]), 64)
    assert not set(shifted.tolist()) & set(ka.tolist())  # same blocks, other prefix
    assert (block_keys(list(a), 64) == ka).all()  # lists and arrays alike


def test_reuse_times_come_from_the_ghost_and_first_sight_is_counted() -> None:
    clock = Clock()
    tracker = ReuseTracker(sample_rate=1, clock=clock)
    prompt = np.arange(64 * 4)
    first = tracker.observe(prompt)
    assert first.reuse_s == () and first.first_seen_tokens == 4 * 64 and not first.returning
    clock.now += 30.0
    longer = tracker.observe(np.arange(64 * 6 + 10))
    assert longer.reuse_s == (30.0,) * 4 and longer.first_seen_tokens == 2 * 64
    assert longer.request_tokens == 6 * 64 and longer.prompt_tokens == 64 * 6 + 10
    assert longer.returning


def test_the_ghost_is_bounded_and_forgets_the_oldest() -> None:
    """A block referenced before more than `ghost_entries` tracked blocks counts as first
    seen again: the bound on memory is a bound on the longest reuse the engine reports."""
    clock = Clock()
    tracker = ReuseTracker(sample_rate=1, ghost_entries=8, clock=clock)
    old = np.arange(64 * 4)
    tracker.observe(old)
    tracker.observe(np.arange(64 * 4) + 10**6)  # 4 other blocks: 8 in the ghost
    assert tracker.observe(old).reuse_s != ()
    for k in range(3):
        tracker.observe(np.arange(64 * 4) + (k + 2) * 10**6)
    assert len(tracker) == 8 and tracker.observe(old).reuse_s == ()


def test_sampling_estimates_the_exact_histogram() -> None:
    """1 in 16 blocks tracked, each weighing 16 blocks: the reused and first-seen tokens of a
    multi-turn workload within 10% of tracking every block."""
    rng = np.random.default_rng(3)
    clock = Clock()
    exact = ReuseTracker(sample_rate=1, clock=clock)
    sampled = ReuseTracker(sample_rate=16, clock=clock)
    totals = {"exact": [0, 0], "sampled": [0, 0]}
    sessions = [rng.integers(0, 150_000, 64 * 40) for _ in range(30)]
    for _ in range(12):
        for k, s in enumerate(sessions):
            sessions[k] = np.concatenate([s, rng.integers(0, 150_000, int(rng.integers(64, 3000)))])
            clock.now += float(rng.exponential(5.0))
            for name, tracker in (("exact", exact), ("sampled", sampled)):
                r = tracker.observe(sessions[k])
                totals[name][0] += len(r.reuse_s) * r.block_tokens
                totals[name][1] += r.first_seen_tokens
    for i in range(2):
        assert totals["sampled"][i] == pytest.approx(totals["exact"][i], rel=0.10)


def test_metrics_count_tokens_not_requests() -> None:
    registry = CollectorRegistry()
    clock = Clock()
    tracker = ReuseTracker(sample_rate=1, clock=clock, metrics=ReuseMetrics(registry))
    tracker.observe(np.arange(64 * 3))
    clock.now += 12.0
    tracker.observe(np.arange(64 * 5 + 1))
    got = _samples(registry)
    assert got[("cas_prefix_reuse_seconds_bucket", "10.0")] == 0.0
    assert got[("cas_prefix_reuse_seconds_bucket", "15.0")] == 3 * 64
    assert got[("cas_prefix_reuse_seconds_bucket", "+Inf")] == 3 * 64
    assert got[("cas_prefix_reuse_seconds_sum", "")] == 12.0 * 3 * 64
    assert got[("cas_prefix_first_seen_tokens_total", "")] == 5 * 64
    assert got[("cas_prefix_requests_total", "")] == 2
    assert got[("cas_prefix_request_tokens_total", "")] == 8 * 64
    assert got[("cas_prefix_request_token_squares_total", "")] == (3 * 64) ** 2 + (5 * 64) ** 2
    assert got[("cas_prefix_returning_prompt_tokens_total", "")] == 5 * 64 + 1


MULTIPROCESS = """
import numpy as np
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from cas_engine.prefixreuse import ReuseMetrics, ReuseTracker
clock = iter([0.0, 7.0])
metrics = ReuseMetrics(CollectorRegistry())
tracker = ReuseTracker(sample_rate=1, clock=lambda: next(clock), metrics=metrics)
tracker.observe(np.arange(64 * 2))
tracker.observe(np.arange(64 * 2))
registry = CollectorRegistry()
multiprocess.MultiProcessCollector(registry)
print(generate_latest(registry).decode())
"""


def test_the_weighted_histogram_survives_multiprocess_mode(tmp_path: Path) -> None:
    """SGLang serves /metrics from prometheus-client's multiprocess files: the weighted
    bucket values (tokens) must come out of them as written."""
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "engine"), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MULTIPROCESS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    ).stdout
    assert 'cas_prefix_reuse_seconds_bucket{le="7.5"} 128.0' in out, out
    assert 'cas_prefix_reuse_seconds_bucket{le="5.0"} 0.0' in out, out
    assert "cas_prefix_first_seen_tokens_total 128.0" in out, out


async def test_the_sim_engine_exports_the_reuse_metrics() -> None:
    """The sim worker tracks every prompt it prefills, as a real prefill does: a second turn
    over the first one's prompt comes back as reused tokens on /metrics."""
    from aiohttp.test_utils import TestClient, TestServer

    from cas_engine.sim.config import parse_args
    from cas_engine.sim.server import SimServer
    from cas_engine.sim.worker import SimWorker

    cfg = parse_args(["--sim-speedup", "50"])
    worker = SimWorker(cfg)
    worker.reuse.sample_rate = 1  # every block, so a short prompt is measured exactly
    await worker.start()
    try:
        async with TestClient(TestServer(SimServer(cfg, worker).app())) as client:
            prompt = "x" * 4096
            for text in (prompt, prompt + " more"):
                r = await client.post("/v1/completions", json={"prompt": text, "max_tokens": 4})
                assert r.status == 200
            metrics = await (await client.get("/metrics")).text()
    finally:
        await worker.stop()
    got = {
        (s.name, s.labels.get("le", "")): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
    }
    assert got[("cas_prefix_requests_total", "")] == 2
    reused = got[("cas_prefix_reuse_seconds_bucket", "+Inf")]
    assert 0 < reused <= got[("cas_prefix_first_seen_tokens_total", "")]  # turn 1 all new


# ---------------------------------------------------------------- the SGLang hook's logic


class Mode(Enum):  # SGLang's DisaggregationMode values (srt/disaggregation/utils.py:150-153)
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


class FakeScheduler:
    """A class shaped like SGLang 0.5.23's Scheduler.handle_generate_request."""

    def __init__(self, mode: Mode) -> None:
        self.disaggregation_mode = mode
        self.handled: list[Any] = []

    def handle_generate_request(self, recv_req: Any, *, mm_input_error: str | None = None) -> None:
        mm_cleanup = None
        self._handle_generate_request(recv_req, mm_cleanup, mm_input_error=mm_input_error)

    def _handle_generate_request(self, recv_req: Any, cleanup: Any, *, mm_input_error: Any) -> None:
        self.handled.append(recv_req)


def _req(ids: Any, embeds: Any = None) -> Any:
    return SimpleNamespace(input_ids=ids, input_embeds=embeds)


def test_prefill_and_plain_schedulers_track_decode_does_not() -> None:
    clock = Clock()
    for mode, tracked in ((Mode.PREFILL, 1), (Mode.NULL, 1), (Mode.DECODE, 0)):

        class Scheduler(FakeScheduler):
            pass

        tracker = ReuseTracker(sample_rate=1, clock=clock)
        patch = install_prefix_reuse(tracker=tracker, cls=Scheduler, reporting_rank=lambda: True)
        scheduler = Scheduler(mode)
        req = _req(array("q", range(64 * 3)))
        scheduler.handle_generate_request(req)
        assert scheduler.handled == [req]  # SGLang still handles every request
        assert len(tracker) == 3 * tracked, mode
        patch.uninstall()
        assert not hasattr(Scheduler.handle_generate_request, "__cas_prefix_reuse_original__")


def test_other_ranks_embeds_and_failed_multimodal_inputs_are_not_tracked() -> None:
    class Scheduler(FakeScheduler):
        pass

    tracker = ReuseTracker(sample_rate=1)
    install_prefix_reuse(tracker=tracker, cls=Scheduler, reporting_rank=lambda: False)
    Scheduler(Mode.PREFILL).handle_generate_request(_req(array("q", range(640))))
    assert len(tracker) == 0  # a second TP rank: the first one counts

    class Scheduler2(FakeScheduler):
        pass

    install_prefix_reuse(tracker=tracker, cls=Scheduler2, reporting_rank=lambda: True)
    s = Scheduler2(Mode.PREFILL)
    s.handle_generate_request(_req(None, embeds=[[0.0]]))
    s.handle_generate_request(_req(array("q", range(640))), mm_input_error="bad image")
    assert len(tracker) == 0 and len(s.handled) == 2


def test_a_tracking_error_never_reaches_sglang() -> None:
    class Scheduler(FakeScheduler):
        pass

    patch = install_prefix_reuse(tracker=ReuseTracker(), cls=Scheduler, reporting_rank=lambda: True)
    s = Scheduler(Mode.PREFILL)
    s.handle_generate_request(_req(object()))  # not token ids
    assert len(s.handled) == 1 and patch.adapter.errors == 1


def test_changed_targets_are_refused() -> None:
    class NoHook:
        pass

    class OtherParams:
        def handle_generate_request(self, req: Any) -> None:
            self._handle_generate_request(req, None, mm_input_error=None)

    class NotHandedOn(FakeScheduler):
        def handle_generate_request(self, recv_req: Any, *, mm_input_error: Any = None) -> None:
            return None

    assert check_targets(NoHook) == ["NoHook.handle_generate_request is missing"]
    assert "expected parameters" in check_targets(OtherParams)[0]
    assert any("no longer contains" in p for p in check_targets(NotHandedOn))
    with pytest.raises(PrefixReusePatchError):
        install_prefix_reuse(tracker=ReuseTracker(), cls=NotHandedOn)

    class Twice(FakeScheduler):
        pass

    install_prefix_reuse(tracker=ReuseTracker(), cls=Twice, reporting_rank=lambda: True)
    assert check_targets(Twice) == ["Twice.handle_generate_request is already patched"]


def test_prompt_tokens_reads_sglangs_array_without_a_copy() -> None:
    ids = array("q", [5, 6, 7])
    view = prompt_tokens(_req(ids))
    assert view is not None and view.tolist() == [5, 6, 7]
    ids[0] = 9
    assert view[0] == 9  # the same buffer
    assert prompt_tokens(_req([1, 2])).tolist() == [1, 2]  # type: ignore[union-attr]
    assert prompt_tokens(_req(None)) is None
