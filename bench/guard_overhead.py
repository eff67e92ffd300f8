"""Per-verify-step overhead of the quality gate at batch sizes 1, 64 and 256.

What it measures: one ``GuardMonitor.observe`` call per verify step of a batch whose requests
are all past ``min_generated_tokens`` (the judging path runs for every request), fed
(a) numpy arrays and (b) Python lists (what the SGLang patch hands over: SGLang already holds
per-request accepted counts as a list). Each configuration runs ``--repeats`` times with
``--steps`` steps; the table shows the median over repeats of the median step time, and the
JSON keeps every repeat. Target: under 200 us at batch 256 (1% of a 20 ms decode step).

Run: ``.venv/bin/python bench/guard_overhead.py [--out bench/results/guard_overhead.json]``
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

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


def _time_steps(batch: int, steps: int, as_lists: bool, seed: int) -> list[float]:
    """Seconds per observe() call for ``steps`` healthy steps (no trips)."""
    cfg = GuardConfig()
    mon, slots = _prepared_monitor(batch, cfg)
    rng = np.random.default_rng(seed)
    acc = rng.integers(1, 3, size=(steps, batch)).astype(np.float64)  # healthy: 1..2 of 3
    prop = np.full(batch, 3.0)
    feeds = [
        (slots.tolist(), a.tolist(), prop.tolist()) if as_lists else (slots, a, prop) for a in acc
    ]
    out = []
    for s, a, p in feeds:
        t0 = time.perf_counter()
        trips = mon.observe(s, a, p)
        out.append(time.perf_counter() - t0)
        if trips:
            raise RuntimeError("benchmark stream tripped the gate; it must stay healthy")
    return out


def run(batches: list[int], steps: int, repeats: int) -> dict[str, object]:
    rows = []
    for batch in batches:
        for as_lists in (False, True):
            medians = [
                statistics.median(_time_steps(batch, steps, as_lists, seed=r)) * 1e6
                for r in range(repeats)
            ]
            rows.append(
                {
                    "batch": batch,
                    "input": "lists" if as_lists else "numpy",
                    "median_us": statistics.median(medians),
                    "per_request_ns": statistics.median(medians) * 1e3 / batch,
                    "repeat_medians_us": medians,
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
    print(f"{'batch':>6} {'input':>6} {'median us/step':>15} {'ns/request':>11}")
    for r in result["rows"]:  # type: ignore[union-attr]
        print(
            f"{r['batch']:>6} {r['input']:>6} {r['median_us']:>15.1f} {r['per_request_ns']:>11.0f}"
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
