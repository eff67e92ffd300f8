"""Race reproduction benchmark (``make bench-race``): bad requests per 10,000 by reclaim mode.

Phase 1 runs Immediate, Upstream and Strict side by side at the same offered load
(``--requests`` each) so their throughput and corruption compare directly. Phase 2 runs Strict
alone over ``--strict-requests`` (default 100,000), which must show zero corrupted requests.
Prints one table and writes JSON (default ``bench/results/race.json``). Real KV bytes move
between processes through mooncake's transfer engine over TCP on loopback (``--transport shm``
for the shared-memory fallback). Exit status 1 if Strict corrupted anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as a script: the harness lives next to it, in bench/

from bench.race_harness import (  # noqa: E402
    RaceParams,
    RaceResult,
    run_race,
    steady_throughput,
)
from cas_engine.kvfence import ReclaimMode  # noqa: E402
from cas_engine.kvfence.transport import Transport, mooncake_available  # noqa: E402

COLUMNS = (
    "phase",
    "mode",
    "requests",
    "completed",
    "aborted",
    "bad",
    "bad/10k",
    "95% CI",
    "thr rps",
    "steady rps",
    "bursts",
    "reuse p50 ms",
    "reuse p99 ms",
    "ack->reuse p99 ms",
    "q peak",
    "wall s",
)
MODES = (ReclaimMode.IMMEDIATE, ReclaimMode.UPSTREAM, ReclaimMode.STRICT)
Run = tuple[str, RaceParams, RaceResult]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20_000, help="per mode, side by side")
    ap.add_argument("--strict-requests", type=int, default=100_000)
    ap.add_argument("--rate", type=float, default=600.0, help="offered requests per second")
    ap.add_argument("--stall-prob", type=float, default=RaceParams.stall_prob)
    ap.add_argument("--transport", choices=[t.value for t in Transport], default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="side-by-side rounds (medians)")
    ap.add_argument("--json", type=Path, default=Path("bench/results/race.json"))
    return ap.parse_args(argv)


def row(phase: str, res: RaceResult) -> list[str]:
    lo, hi = res.bad_per_10k_ci95
    return [
        phase,
        res.mode,
        str(res.admitted),
        str(res.completed),
        str(res.aborted),
        str(res.bad),
        f"{res.bad_per_10k:.2f}",
        f"[{lo:.2f}, {hi:.2f}]",
        f"{res.throughput_rps:.0f}",
        f"{steady_throughput(res)[0]:.0f}",
        str(steady_throughput(res)[1]),
        f"{res.abort_to_reuse_p50_ms:.1f}",
        f"{res.abort_to_reuse_p99_ms:.1f}",
        f"{res.ack_to_reuse_p99_ms:.1f}",
        str(res.quarantine_peak_pages),
        f"{res.wall_s:.1f}",
    ]


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    print("  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths, strict=True)))
    for r in rows:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))


def run_all(base: RaceParams, args: argparse.Namespace) -> list[Run]:
    """Side-by-side rounds (modes interleaved), then the long Strict run."""
    runs: list[Run] = []
    for rnd in range(args.repeats):
        for mode in MODES:
            params = replace(base, mode=mode, requests=args.requests, seed=base.seed + rnd)
            res = run_race(params)
            runs.append((f"side-by-side {rnd + 1}", params, res))
            print(
                f"  round {rnd + 1} {mode.value}: {res.wall_s:.1f} s", file=sys.stderr, flush=True
            )
    if args.strict_requests:
        params = replace(base, mode=ReclaimMode.STRICT, requests=args.strict_requests)
        runs.append(("strict-long", params, run_race(params)))
    return runs


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def summarise(runs: list[Run]) -> dict[str, float | int]:
    """Median per-round Strict/Immediate ratios and the total of Strict's corrupted requests."""
    rounds: dict[str, dict[str, RaceResult]] = {}
    for phase, _, res in runs:
        if phase.startswith("side-by-side"):
            rounds.setdefault(phase, {})[res.mode] = res
    thr = [
        _ratio(r["Strict"].throughput_rps, r["Immediate"].throughput_rps) for r in rounds.values()
    ]
    steady = [
        _ratio(steady_throughput(r["Strict"])[0], steady_throughput(r["Immediate"])[0])
        for r in rounds.values()
    ]
    return {
        "strict_over_immediate_throughput": statistics.median(thr) if thr else 0.0,
        "strict_over_immediate_steady_throughput": statistics.median(steady) if steady else 0.0,
        "strict_bad_total": sum(res.bad for _, _, res in runs if res.mode == "Strict"),
        "strict_requests_total": sum(res.completed for _, _, res in runs if res.mode == "Strict"),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ok, why = mooncake_available()
    transport = (
        Transport(args.transport)
        if args.transport
        else (Transport.MOONCAKE if ok else Transport.SHM)
    )
    if transport is Transport.MOONCAKE and not ok:
        print(f"mooncake unavailable: {why}", file=sys.stderr)
        return 2
    if transport is Transport.SHM and not args.transport:
        print(f"mooncake unavailable ({why}); falling back to shared memory", file=sys.stderr)
    base = RaceParams(
        transport=transport,
        arrival_rate=args.rate,
        stall_prob=args.stall_prob,
        seed=args.seed,
        max_wall_s=max(120.0, 4 * args.strict_requests / args.rate),
    )
    started = time.monotonic()
    runs = run_all(base, args)
    print(
        f"\nrace reproduction, transport={transport.value}, offered {args.rate:.0f} req/s, "
        f"budget {base.budget_s * 1e3:.0f} ms, upstream timer "
        f"{base.upstream_timeout_s * 1e3:.0f} ms (scaled from 30 s)"
    )
    print_table([row(phase, res) for phase, _, res in runs])
    summary = summarise(runs)
    print(
        f"Strict/Immediate median over {args.repeats} side-by-side round(s): throughput "
        f"{summary['strict_over_immediate_throughput']:.3f}, steady throughput (burst seconds "
        f"excluded) {summary['strict_over_immediate_steady_throughput']:.3f}; "
        f"Strict corrupted requests: {summary['strict_bad_total']}; "
        f"total {time.monotonic() - started:.0f} s"
    )
    payload = {
        "transport": transport.value,
        **summary,
        "runs": [{"phase": ph, "params": p.to_json(), "result": asdict(r)} for ph, p, r in runs],
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.json}")
    return 1 if summary["strict_bad_total"] else 0


if __name__ == "__main__":
    sys.exit(main())
