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
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from cas_engine.kvfence import ReclaimMode
from cas_engine.kvfence.race import RaceParams, RaceResult, run_race
from cas_engine.kvfence.transport import Transport, mooncake_available

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
    "good rps",
    "reuse p50 ms",
    "reuse p99 ms",
    "q peak",
    "wall s",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20_000, help="per mode, side by side")
    ap.add_argument("--strict-requests", type=int, default=100_000)
    ap.add_argument("--rate", type=float, default=600.0, help="offered requests per second")
    ap.add_argument("--stall-prob", type=float, default=RaceParams.stall_prob)
    ap.add_argument("--transport", choices=[t.value for t in Transport], default=None)
    ap.add_argument("--seed", type=int, default=1)
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
        f"{res.goodput_rps:.0f}",
        f"{res.abort_to_reuse_p50_ms:.1f}",
        f"{res.abort_to_reuse_p99_ms:.1f}",
        str(res.quarantine_peak_pages),
        f"{res.wall_s:.1f}",
    ]


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    print("  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths, strict=True)))
    for r in rows:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))


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
    runs: list[tuple[str, RaceParams, RaceResult]] = []
    started = time.monotonic()
    for mode in (ReclaimMode.IMMEDIATE, ReclaimMode.UPSTREAM, ReclaimMode.STRICT):
        params = replace(base, mode=mode, requests=args.requests)
        runs.append(("side-by-side", params, run_race(params)))
        print(f"  {mode.value}: done in {runs[-1][2].wall_s:.1f} s", file=sys.stderr, flush=True)
    if args.strict_requests:
        params = replace(base, mode=ReclaimMode.STRICT, requests=args.strict_requests)
        runs.append(("strict-long", params, run_race(params)))
    print(
        f"\nrace reproduction, transport={transport.value}, offered {args.rate:.0f} req/s, "
        f"budget {base.budget_s * 1e3:.0f} ms, upstream timer "
        f"{base.upstream_timeout_s * 1e3:.0f} ms (scaled from 30 s)"
    )
    print_table([row(phase, res) for phase, _, res in runs])
    by_mode = {res.mode: res for phase, _, res in runs if phase == "side-by-side"}
    ratio = (
        by_mode["Strict"].throughput_rps / by_mode["Immediate"].throughput_rps
        if by_mode["Immediate"].throughput_rps
        else 0.0
    )
    good_ratio = (
        by_mode["Strict"].goodput_rps / by_mode["Immediate"].goodput_rps
        if by_mode["Immediate"].goodput_rps
        else 0.0
    )
    print(
        f"Strict/Immediate throughput {ratio:.3f}, goodput {good_ratio:.3f}; "
        f"total {time.monotonic() - started:.0f} s"
    )
    strict_bad = sum(res.bad for _, _, res in runs if res.mode == "Strict")
    payload = {
        "transport": transport.value,
        "strict_over_immediate_throughput": ratio,
        "strict_over_immediate_goodput": good_ratio,
        "strict_bad_total": strict_bad,
        "runs": [{"phase": ph, "params": p.to_json(), "result": asdict(r)} for ph, p, r in runs],
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.json}")
    return 1 if strict_bad else 0


if __name__ == "__main__":
    sys.exit(main())
