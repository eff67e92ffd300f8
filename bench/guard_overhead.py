"""Per-verify-step overhead of the quality gate at batch sizes 1, 64 and 256.

What it measures: one ``GuardMonitor.observe`` call per verify step of a batch whose requests
are all past ``min_generated_tokens`` (the judging path runs for every request), fed
(a) numpy arrays, (b) Python lists, and (c) ``sglang``: the whole SGLang hook,
``GuardAdapter.observe_batch`` over request objects shaped like SGLang's (``rid``,
``kv.req_pool_idx``, ``finished()``) plus ``finish_batch``: both wrappers of the patch.
Each configuration runs ``--repeats`` times with ``--steps`` steps; the table shows the median
over repeats of the median step time, and the JSON keeps every repeat. Target: under 200 us
at batch 256 (1% of a 20 ms decode step).

Run: ``.venv/bin/python bench/guard_overhead.py [--out bench/results/guard_overhead.json]``
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from prometheus_client import CollectorRegistry

from cas_engine.guard import GuardConfig, GuardMetrics, GuardMonitor

TARGET_US_AT_256 = 200.0


def _prepared_monitor(batch: int, cfg: GuardConfig) -> tuple[GuardMonitor, np.ndarray]:
    """A monitor with ``batch`` open requests already past the minimum token count."""
    mon = GuardMonitor(
        cfg, capacity=max(batch, 1) * 2, metrics=GuardMetrics.create(CollectorRegistry(), cfg)
    )
    slots = np.array([mon.allocate(f"r{i}") for i in range(batch)], dtype=np.intp)
    warm = np.full(batch, 2.0)
    for _ in range(cfg.min_generated_tokens // 3 + cfg.window + 1):
        mon.observe(slots, warm, np.full(batch, 3.0))
    return mon, slots


def _time_steps(batch: int, steps: int, as_lists: bool, seed: int) -> tuple[list[float], float]:
    """Seconds per observe() call for ``steps`` healthy steps (no trips)."""
    cfg = GuardConfig()
    mon, slots = _prepared_monitor(batch, cfg)
    rng = np.random.default_rng(seed)
    acc = rng.integers(1, 3, size=(steps, batch)).astype(np.float64)  # healthy: 1..2 of 3
    prop = np.full(batch, 3.0)
    feeds = [
        (slots.tolist(), a.tolist(), prop.tolist()) if as_lists else (slots, a, prop) for a in acc
    ]
    return _measure(mon.observe, feeds)


def _measure(fn: Callable[..., list], args_list: list[tuple]) -> tuple[list[float], float]:
    """(wall seconds per call, mean CPU seconds per call) over ``args_list``; no trips allowed.

    CPU time (``process_time``) is shown beside wall time because on a shared, loaded machine
    wall time includes waiting for a core.
    """
    walls = []
    c0 = time.process_time()
    for args in args_list:
        t0 = time.perf_counter()
        trips = fn(*args)
        walls.append(time.perf_counter() - t0)
        if trips:
            raise RuntimeError("benchmark stream tripped the gate; it must stay healthy")
    return walls, (time.process_time() - c0) / len(args_list)


class _Req:
    """The attributes of SGLang's Req that the hook reads."""

    __slots__ = ("finished_reason", "is_retracted", "kv", "rid", "to_finish")

    def __init__(self, rid: str, slot: int) -> None:
        self.rid, self.is_retracted, self.to_finish = rid, False, None
        self.finished_reason = None
        self.kv = SimpleNamespace(req_pool_idx=slot)

    def finished(self) -> bool:
        return False


def _time_adapter_steps(batch: int, steps: int, seed: int) -> tuple[list[float], float]:
    """Seconds per SGLang-hook call (adapter loop + monitor) for healthy steps."""
    from cas_engine.sglang.guard_patch import GuardAdapter

    cfg = GuardConfig()
    adapter = GuardAdapter(
        config=cfg,
        metrics=GuardMetrics.create(CollectorRegistry(), cfg),
        abort_factory=lambda trip: trip,
        proposed_per_step=lambda: 3,
    )
    proc = SimpleNamespace(req_to_token_pool=SimpleNamespace(size=batch * 2))
    reqs = SimpleNamespace(reqs=[_Req(f"r{i}", i) for i in range(batch)])
    for _ in range(cfg.min_generated_tokens // 3 + cfg.window + 1):
        adapter.observe_batch(
            proc, reqs, SimpleNamespace(num_correct_drafts_per_req_cpu=[2] * batch)
        )
    rng = np.random.default_rng(seed)
    results = [
        SimpleNamespace(num_correct_drafts_per_req_cpu=row.tolist())
        for row in rng.integers(1, 3, size=(steps, batch))
    ]

    def hook(proc: object, batch: object, result: object) -> list:
        trips = adapter.observe_batch(proc, batch, result)  # after _resolve_spec_v2_tokens
        adapter.finish_batch(batch)  # after process_batch_result_decode
        return trips

    return _measure(hook, [(proc, reqs, r) for r in results])


def _time_feed(feed: str, batch: int, steps: int, seed: int) -> tuple[list[float], float]:
    if feed == "sglang":
        return _time_adapter_steps(batch, steps, seed)
    return _time_steps(batch, steps, feed == "lists", seed)


def run(batches: list[int], steps: int, repeats: int) -> dict[str, object]:
    rows = []
    for batch in batches:
        for feed in ("numpy", "lists", "sglang"):
            runs = [_time_feed(feed, batch, steps, r) for r in range(repeats)]
            medians = [statistics.median(walls) * 1e6 for walls, _ in runs]
            cpus = [cpu * 1e6 for _, cpu in runs]
            rows.append(
                {
                    "batch": batch,
                    "input": feed,
                    "median_us": statistics.median(medians),
                    "cpu_us": statistics.median(cpus),
                    "per_request_ns": statistics.median(medians) * 1e3 / batch,
                    "repeat_medians_us": medians,
                    "repeat_cpu_us": cpus,
                }
            )
    at_256 = [r["median_us"] for r in rows if r["batch"] == 256]
    return {
        "benchmark": "guard_overhead",
        "steps": steps,
        "repeats": repeats,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "target_us_at_256": TARGET_US_AT_256,
        "meets_target": bool(at_256) and max(at_256) < TARGET_US_AT_256,
        "rows": rows,
    }


def print_table(result: dict[str, object]) -> None:
    print(f"{'batch':>6} {'input':>7} {'wall us/step':>13} {'cpu us/step':>12} {'ns/request':>11}")
    for r in result["rows"]:  # type: ignore[union-attr]
        print(
            f"{r['batch']:>6} {r['input']:>7} {r['median_us']:>13.1f} {r['cpu_us']:>12.1f} "
            f"{r['per_request_ns']:>11.0f}"
        )
    print(
        f"target < {TARGET_US_AT_256:.0f} us at batch 256: "
        f"{'met' if result['meets_target'] else 'NOT met'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results/guard_overhead.json"))
    args = parser.parse_args()
    result = run(args.batches, args.steps, args.repeats)
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
