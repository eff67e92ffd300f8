"""Candidate changes to `router.admission: Auto`, measured on the planner benchmark's scenarios
before any goes into the product (`python -m bench.admission_variants`; not part of make test).

For each variant (`bench.planner.AdmissionVariant`; `product` is the code as it is), each
scenario and each seed, runs the planner behind the variant's admission (`ours`: sglang-router's
rate; `ours-smg`: smg's rate and bound on requests in flight) on the quick scenarios and
reports goodput, the output shift's and the rebalance's goodput after the shift as a share of
the ready pools' capacity (the planner's model, as `bench.planner.after_shift`), and how often
the fleet's admission limit changed after warm-up: each change is a new router template, so a
roll of the routers.

Usage: python -m bench.admission_variants [--seeds 1,2,3] [--method ours-smg]
       [--only SCENARIO ...] [--out bench/results/admission_variants.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from bench.planner import PRODUCT, AdmissionVariant, _run, scenarios

VARIANTS: dict[str, AdmissionVariant] = {
    "product": PRODUCT,  # the request shape held within a 10% band
    "band-5%": AdmissionVariant(shape_band=0.05),
    "band-20%": AdmissionVariant(shape_band=0.20),
    # smg's bound with a prefill allowance of 0.75 s or 1 s of the rate, not the TTFT target
    "allow-0.75s": AdmissionVariant(prefill_allowance_s=0.75),
    "allow-1.0s": AdmissionVariant(prefill_allowance_s=1.0),
    "headroom-0.9": AdmissionVariant(headroom=0.9),
    "headroom-0.8": AdmissionVariant(headroom=0.8),
    # sglang-router 0.3.2 (`--method ours`) as sized before issue 41, as it behaves and as this
    # bench took it
    "032-rate": AdmissionVariant(router_032="rate"),
    "032-pure-bucket": AdmissionVariant(router_032="pure-bucket"),
}


def _one(job: tuple[str, str, str, int]) -> dict[str, Any]:
    name, scenario, method, seed = job
    sc = next(s for s in scenarios(True) if s.name == scenario)
    g = _run(sc, method, None, seed, VARIANTS[name])
    row: dict[str, Any] = {
        "variant": name,
        "scenario": scenario,
        "seed": seed,
        "goodput_rps": g["goodput_rps"],
        "limit_changes": g["limit_changes"],
    }
    if "after_shift" in g:
        row["share_after_shift"] = g["after_shift"]["share_of_model_capacity"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--method", default="ours-smg", choices=("ours", "ours-smg", "ours-operator"))
    ap.add_argument("--variant", action="append", default=[], choices=sorted(VARIANTS))
    ap.add_argument("--only", action="append", default=[], help="scenario (repeatable)")
    ap.add_argument("--workers", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--out", default="bench/results/admission_variants.json")
    args = ap.parse_args()
    names = args.variant or list(VARIANTS)
    scs = args.only or [s.name for s in scenarios(True)]
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = [(v, s, args.method, seed) for v in names for s in scs for seed in seeds]
    with ProcessPoolExecutor(args.workers) as pool:
        rows = list(pool.map(_one, jobs))
    print(f"{args.method}, quick scenarios, seeds {args.seeds}: goodput req/s per seed (median)")
    for v in names:
        print(f"\n{v}")
        for s in scs:
            mine = [r for r in rows if r["variant"] == v and r["scenario"] == s]
            good = [r["goodput_rps"] for r in mine]
            each = " / ".join(f"{x:.2f}" for x in good)
            line = f"  {s:30s} {each} ({statistics.median(good):.2f})"
            shares = [r["share_after_shift"] for r in mine if "share_after_shift" in r]
            if shares:
                line += f"; after the shift {' / '.join(f'{x:.2f}' for x in shares)}"
            changes = [r["limit_changes"] for r in mine]
            line += f"; limit changes {' / '.join(f'{x:.0f}' for x in changes)}"
            print(line)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump({"method": args.method, "seeds": seeds, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
