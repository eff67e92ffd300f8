"""The P:D planner on real Claude Code sessions (``make bench-planner``; issue 39, part 3).

Usage: python -m bench.planner_traces [--sessions PATH] [--mooncake PATH] [--quick]
[--only NAME] [--router NAME] [--window SECONDS] [--out bench/results/planner-traces.json]
(PATH: a folder of Claude Code session files or their tarball; default
../shared/traces/claude-code-sessions.tar.gz).

Data flow: the sessions (`bench.fleetsim.sessions.load_sessions`: real requests with their
input and output tokens, think times and prompt block ids) -> per scenario an overlay of
session starts (`TraceScenario`: Poisson at a live-session count, a ramp, or starts shaped
like Mooncake's hour of real arrivals), sessions placed in a seeded order
(`bench.traces.placement_order`), those started before the run joining in steady state ->
`bench.fleetsim` replays them in closed loop (each next request its think time after the
answer) on a 256-GPU fleet, its prefill instances caching real blocks per instance as the
fleet's router (``--router``, `ROUTERS`; default smg's consistent hashing on the session id)
routes them, and exporting the prompt reuse times their engines
would (`Metrics.reuse`) -> the methods below on the same traffic -> goodput per method, the
planner's predicted hit rate against the simulator's, and LayerSplit against replicated CP
and CP 1 by context length.

Methods (as `bench.planner`'s): ``fixed-1:1``; ``best-fixed`` (the split best on the middle
load level, used on every scenario); ``mean-based``; ``ours``: the operator's Auto as it runs,
fed only what the operator measures (`RatioPlannerPolicy.operator_inputs`: the measured rate
and request shape, the measured hit rate once settled, and the engines' reuse-time
histogram, from which the model draws its hit-rate curve), behind the product's admission;
``exhaustive``: every static split simulated (stride, then the best one's neighbourhood); and
where the load moves for good (the ramp, the Mooncake-shaped surge) ``online-bound``: the
clairvoyant switch from the split best before the middle of the measured window to the one
best after it (each read from the exhaustive runs' per-window goodput, the switch simulated
with its neighbours), at the middle, or the best static split where no switch serves more; and
``exhaustive-admitted``: the exhaustive split behind the admission ours runs behind (the
static splits run without it), so a shortfall of ours splits into the planner's and the
admission's.

The hit-rate check: at every tick after warm-up, the model's hit rate (`model.evaluate`,
unscaled by any measured hit rate) for the ready prefill pool at the window's measured rate,
request shape and reuse histogram, against the hit rate the simulator measured in that window
(cached over prompt tokens); the means over the ticks, for ours and for the exhaustive split.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.fleetsim import FleetConfig
from bench.fleetsim.engine import ROUTINGS, Routing, SimResult, Simulator
from bench.fleetsim.sessions import (
    Placement,
    SessionTraffic,
    SimSession,
    load_sessions,
    mean_duration,
    requests_per_session_second,
)
from bench.planner import SLO, SPEC, run_start
from bench.traces import (
    mooncake_arrivals,
    placement_order,
    poisson_starts,
    ramp_starts,
    shaped_starts,
)
from cas_operator.api.models import WorkloadSpec
from cas_operator.autoscale import profiles as pf
from cas_operator.autoscale.model import (
    InstanceProfile,
    ObservedSignals,
    WorkloadInputs,
    evaluate,
)
from cas_operator.autoscale.reuse import quantized_profile
from cas_operator.desired.recommend import planner_workload

DEFAULT_SESSIONS = "../shared/traces/claude-code-sessions.tar.gz"
MOONCAKE_FILE = "mooncake-conversation.jsonl"  # read from beside the sessions by default
CONTEXT_EDGES = (0, 40_000, 80_000, 120_000, 200_000, math.inf)  # prompt tokens
PUBLISHED_LAYERSPLIT = {40_000: 0.10, 120_000: 1.32}  # production report: +10% .. +132%
LAYOUTS = {"cp1": (1, False), "cp4": (4, False), "cp4-layersplit": (4, True)}
# The routers a fleet can sit behind (``--router``): how it picks a prefill instance, and
# whether its admission bounds the requests in flight (smg) or is sglang-router 0.3.2's
# bucket (`bench.planner.with_admission`). The default is what docs/traffic.md recommends for
# real coding-agent traffic: smg with its default keyed policy.
ROUTERS: dict[str, tuple[Routing, bool]] = {
    "smg/consistent_hashing": (ROUTINGS["consistent_hashing"], True),
    "sglang-router/manual": (ROUTINGS["manual"], False),
    "sglang-router/cache_aware": (ROUTINGS["cache_aware"], False),
}
DEFAULT_ROUTER = "smg/consistent_hashing"


@dataclass(frozen=True)
class Paths:
    sessions: str
    mooncake: str
    limit: int | None = None  # the first N sessions only (tests)


@dataclass(frozen=True)
class TraceScenario:
    """One real-session load: ``live`` sessions in steady state at the start (Little's law
    on the sessions' own durations), then session starts over the run: ``poisson`` at the
    steady rate, ``ramp`` from it to ``factor`` times it, or ``mooncake``: Mooncake's hour of
    arrivals mapped onto the run at ``factor`` times the steady rate on average."""

    name: str
    live: float
    starts: str = "poisson"
    factor: float = 1.0
    budget: int = 256
    duration_s: float = 3600.0
    warmup_s: float = 900.0
    moves: bool = False  # the load moves for good: an online bound is computed
    router: str = DEFAULT_ROUTER  # a key of `ROUTERS`: every method's fleet sits behind it
    window_s: float = FleetConfig.metric_window_s  # the metrics window the policies read

    @property
    def middle_s(self) -> float:
        """Where the clairvoyant switch moves: the middle of the measured window."""
        return (self.warmup_s + self.duration_s) / 2.0

    def profiles(self, layout: str = "cp1") -> tuple[InstanceProfile, InstanceProfile]:
        cp, split = LAYOUTS[layout]
        p = replace(pf.prefill_profile(SPEC, cp=cp, layer_split=split), pod_start_s=600.0)
        d = replace(pf.decode_profile(SPEC), pod_start_s=600.0)
        return p, d


def scenarios(
    quick: bool, router: str = DEFAULT_ROUTER, window_s: float = FleetConfig.metric_window_s
) -> list[TraceScenario]:
    """Three stationary load levels, a ramp and a Mooncake-shaped surge of session starts,
    every fleet behind ``router``, its policies reading metrics over ``window_s``."""
    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}: one of {', '.join(ROUTERS)}")
    dur, warm = (2400.0, 600.0) if quick else (3600.0, 900.0)

    def scenario(
        name: str, live: float, starts: str = "poisson", factor: float = 1.0
    ) -> TraceScenario:
        moves = starts != "poisson"
        return TraceScenario(name, live, starts, factor, 256, dur, warm, moves, router, window_s)

    levels = {"low": 1000.0, "mid": 1600.0, "high": 2200.0}
    out = [scenario(f"real-{k}", v) for k, v in levels.items()]
    out.append(scenario("real-ramp", levels["low"], "ramp", 6.0))
    out.append(scenario("real-mooncake", levels["mid"], "mooncake", 3.0))
    return out


def sessions_of(paths: Paths) -> tuple[SimSession, ...]:
    return load_sessions(paths.sessions, 1.0, paths.limit)


def placements(sc: TraceScenario, paths: Paths, seed: int) -> list[Placement]:
    """Session starts (before 0: the steady state the run starts in) and which session each
    one replays."""
    sessions = sessions_of(paths)
    rate = sc.live / mean_duration(sessions)
    before = max(s.duration_s for s in sessions)
    starts = [poisson_starts(rate, before, seed, start_s=-before)]
    if sc.starts == "poisson":
        starts.append(poisson_starts(rate, sc.duration_s, seed + 1))
    elif sc.starts == "ramp":
        starts.append(ramp_starts(rate, rate * sc.factor, sc.duration_s, seed + 1))
    elif sc.starts == "mooncake":
        arrivals = _mooncake(paths.mooncake)
        starts.append(shaped_starts(arrivals, rate * sc.factor, sc.duration_s, seed + 1))
    else:
        raise ValueError(sc.starts)
    times = np.concatenate(starts)
    order = placement_order(len(sessions), len(times), seed)
    return [Placement(float(t), i) for t, i in zip(times, order, strict=True)]


@functools.cache
def _mooncake(path: str) -> np.ndarray:
    return mooncake_arrivals(path)


@functools.cache
def trace_means(paths: Paths) -> tuple[float, float, float]:
    """(prompt tokens per request, output tokens per request, requests per second per live
    session) of the sessions, on their own clock."""
    ss = sessions_of(paths)
    inp = float(np.mean(np.concatenate([s.input_tokens for s in ss])))
    out = float(np.mean(np.concatenate([s.output_tokens for s in ss])))
    return inp, out, requests_per_session_second(ss)


def declared(sc: TraceScenario, paths: Paths) -> WorkloadInputs:
    """What a user running these agents would write in the resource's workload fields: the
    mean prompt and answer of their sessions, the request rate of the steady load, a 90% hit
    rate."""
    inp, out, per_session = trace_means(paths)
    return WorkloadInputs(
        request_rate=sc.live * per_session,
        avg_input_tokens=inp,
        avg_output_tokens=out,
        prefix_cache_hit_rate=0.9,
    )


def workload_fields(sc: TraceScenario, paths: Paths) -> WorkloadSpec:
    d = declared(sc, paths)
    return WorkloadSpec.model_validate(
        {
            "avgInputTokens": int(d.avg_input_tokens),
            "avgOutputTokens": int(d.avg_output_tokens),
            "prefixCacheHitRate": d.prefix_cache_hit_rate,
        }
    )


# ---------------------------------------------------------------- one run


def run(
    sc: TraceScenario,
    method: str,
    split: tuple[int, int] | None,
    seed: int,
    paths: Paths,
    layout: str = "cp1",
) -> dict[str, Any]:
    """One simulation of ``sc`` under ``method`` (`bench.planner.run_start`: ``fixed``,
    ``fixed-admitted``, ``switch`` at the middle, ``ours`` fed what the operator measures behind
    the router's admission, ``mean-based``); ``split`` is the static one or (before, after)
    prefill counts (``switch``)."""
    p, d = sc.profiles(layout)
    n = sc.budget // 8
    start = run_start(
        method,
        split,
        (p, d),
        declared(sc, paths),
        sc.budget,
        switch_at=sc.middle_s,
        in_flight_bound=ROUTERS[sc.router][1],
        operator_inputs=workload_fields(sc, paths),
        metric_window_s=sc.window_s,
    )
    n_p, n_d = start.n_prefill, start.n_decode
    cfg = FleetConfig(
        prefill=p,
        decode=d,
        n_prefill=n_p,
        n_decode=n_d,
        max_prefill=n,
        max_decode=n,
        duration_s=sc.duration_s,
        warmup_s=sc.warmup_s,
        seed=seed,
        admission=start.admission,
        routing=ROUTERS[sc.router][0],
        metric_window_s=sc.window_s,
    )
    traffic = SessionTraffic(sessions_of(paths), placements(sc, paths, seed))
    t0 = time.perf_counter()
    res = Simulator(cfg, policy=start.policy, sessions=traffic).run()
    g: dict[str, Any] = res.goodput(SLO.ttft_s, SLO.itl_ms)
    end = res.series[-1] if res.series else {"prefill": n_p, "decode": n_d}
    g.update(
        wall_s=time.perf_counter() - t0,
        peak_gpus=float(res.peak_gpus),
        scale_actions=float(res.scale_actions),
        start=f"{n_p}P:{n_d}D",
        end=f"{end['prefill']:.0f}P:{end['decode']:.0f}D",
        shed=float(res.shed),
        windows=windows(res, sc),
        contexts=by_context(res),
        hit_check=hit_check(res, sc, paths, p, d),
    )
    return g


def _good(res: SimResult, t0: float, t1: float) -> float:
    m = (res.arrival >= t0) & (res.arrival < t1)
    ok = (res.ttft[m] <= SLO.ttft_s) & (res.itl[m] * 1000.0 <= SLO.itl_ms)
    return float(ok.sum()) / max(t1 - t0, 1e-9)


def windows(res: SimResult, sc: TraceScenario) -> dict[str, float]:
    """Goodput before and after the middle of the measured window."""
    return {
        "before_middle_rps": _good(res, sc.warmup_s, sc.middle_s),
        "after_middle_rps": _good(res, sc.middle_s, sc.duration_s),
    }


def by_context(res: SimResult) -> list[dict[str, float]]:
    """Per prompt-length bucket after warm-up: requests, goodput, SLO attainment, hit rate,
    TTFT p90."""
    m = res.arrival >= res.warmup_s
    span = max(res.duration_s - res.warmup_s, 1e-9)
    rows = []
    for lo, hi in itertools.pairwise(CONTEXT_EDGES):
        b = m & (res.input_tokens >= lo) & (res.input_tokens < hi)
        ok = (res.ttft[b] <= SLO.ttft_s) & (res.itl[b] * 1000.0 <= SLO.itl_ms)
        n = int(b.sum())
        rows.append(
            {
                "from_tokens": float(lo),
                "to_tokens": float(hi),
                "requests": float(n),
                "goodput_rps": float(ok.sum()) / span,
                "attainment": float(ok.mean()) if n else 0.0,
                "hit_rate": float(res.cached_tokens[b].sum() / max(res.input_tokens[b].sum(), 1)),
                "ttft_p90_s": float(np.quantile(res.ttft[b], 0.9)) if n else math.nan,
            }
        )
    return rows


def hit_check(
    res: SimResult, sc: TraceScenario, paths: Paths, p: InstanceProfile, d: InstanceProfile
) -> dict[str, float]:
    """The model's hit rate against the simulator's, tick by tick after warm-up (module doc)."""
    spec = workload_fields(sc, paths)
    predicted, measured = [], []
    for row, profile in zip(res.series, res.reuse, strict=True):
        if row["t"] < sc.warmup_s or profile is None or row["arrival_rate"] <= 0:
            continue
        seen = ObservedSignals(
            avg_input_tokens=row["avg_input_tokens"] or None,
            avg_output_tokens=row["avg_output_tokens"] or None,
            reuse=quantized_profile(profile),
        )
        wl = planner_workload(spec, row["arrival_rate"], seen)
        n_p, n_d = int(row["ready_prefill"]), max(int(row["ready_decode"]), 1)
        predicted.append(evaluate(wl, SLO, p, d, max(n_p, 1), n_d).hit_rate)
        measured.append(row["hit_rate"])
    if not predicted:
        return {"predicted": math.nan, "measured": math.nan, "error": math.nan, "ticks": 0.0}
    pred, meas = float(np.mean(predicted)), float(np.mean(measured))
    return {
        "predicted": pred,
        "measured": meas,
        "error": pred - meas,
        "mean_abs_tick_error": float(np.mean(np.abs(np.subtract(predicted, measured)))),
        "ticks": float(len(predicted)),
    }


# ---------------------------------------------------------------- searches


def exhaustive(
    pool: ProcessPoolExecutor,
    sc: TraceScenario,
    seed: int,
    stride: int,
    paths: Paths,
    layout: str = "cp1",
) -> tuple[int, dict[int, dict[str, Any]]]:
    """Every static split at ``stride``, then the best one's neighbourhood: (best prefill
    count, every run by prefill count)."""
    n = sc.budget // 8
    splits = list(range(1, n, stride))
    scores = _runs(pool, sc, splits, seed, paths, layout)
    best = max(scores, key=lambda k: scores[k]["goodput_rps"])
    near = [
        k
        for k in range(max(1, best - stride + 1), min(n - 1, best + stride - 1) + 1)
        if k not in scores
    ]
    scores.update(_runs(pool, sc, near, seed, paths, layout))
    return max(scores, key=lambda k: scores[k]["goodput_rps"]), scores


def _runs(
    pool: ProcessPoolExecutor,
    sc: TraceScenario,
    splits: list[int],
    seed: int,
    paths: Paths,
    layout: str,
) -> dict[int, dict[str, Any]]:
    n = sc.budget // 8
    futs = {k: pool.submit(run, sc, "fixed", (k, n - k), seed, paths, layout) for k in splits}
    return {k: f.result() for k, f in futs.items()}


def online_bound(
    pool: ProcessPoolExecutor,
    sc: TraceScenario,
    seed: int,
    paths: Paths,
    scores: dict[int, dict[str, Any]],
) -> dict[str, Any]:
    """The clairvoyant switch (module doc): the split best before the middle, then the one
    best after it (read from the exhaustive runs), and that switch's neighbours, simulated;
    the best of them, or the best static split when none of them serves more (a clairvoyant
    planner need not move: on the Mooncake-shaped surge the switch served 8.26 req/s and the
    best static split 8.36)."""
    before = max(scores, key=lambda k: scores[k]["windows"]["before_middle_rps"])
    after = max(scores, key=lambda k: scores[k]["windows"]["after_middle_rps"])
    n = sc.budget // 8
    candidates = {(before, a) for a in range(max(1, after - 1), min(n - 1, after + 1) + 1)}
    futs = {c: pool.submit(run, sc, "switch", c, seed, paths) for c in sorted(candidates)}
    (b, a), f = max(futs.items(), key=lambda kv: kv[1].result()["goodput_rps"])
    static = max(scores, key=lambda k: scores[k]["goodput_rps"])
    if scores[static]["goodput_rps"] > f.result()["goodput_rps"]:  # not switching is better
        return {**scores[static], "switch": f"none: {static}P:{n - static}D throughout"}
    return {**f.result(), "switch": f"{b}P:{n - b}D -> {a}P:{n - a}D"}


# ---------------------------------------------------------------- the benchmark


def run_bench(
    quick: bool,
    seed: int,
    workers: int,
    paths: Paths,
    only: tuple[str, ...] = (),
    partial: str | None = None,
    router: str = DEFAULT_ROUTER,
    window_s: float = FleetConfig.metric_window_s,
) -> dict[str, Any]:
    """Every scenario (or those in ``only``) and the LayerSplit comparison, behind ``router``,
    the policies reading metrics over ``window_s``; the result so far is written to
    ``partial`` after each scenario."""
    scs = scenarios(quick, router, window_s)
    stride = 4 if quick else 2
    out: dict[str, Any] = {
        "slo": {"ttft_p90_s": SLO.ttft_s, "itl_ms": SLO.itl_ms},
        "router": router,
        "metric_window_s": window_s,
        "seed": seed,
        "sessions": Path(paths.sessions).name,
        "scenarios": {},
    }
    sessions_of(paths)  # loaded once, before the workers fork
    with ProcessPoolExecutor(max_workers=workers) as pool:
        mid = next(s for s in scs if s.name == "real-mid")
        mid_best, mid_scores = exhaustive(pool, mid, seed, stride, paths)
        for sc in scs:
            if only and sc.name not in only:
                continue
            n = sc.budget // 8
            best, scores = (
                (mid_best, mid_scores) if sc is mid else exhaustive(pool, sc, seed, stride, paths)
            )
            jobs = {
                "fixed-1:1": pool.submit(run, sc, "fixed", (n // 2, n - n // 2), seed, paths),
                "best-fixed": pool.submit(run, sc, "fixed", (mid_best, n - mid_best), seed, paths),
                "mean-based": pool.submit(run, sc, "mean-based", None, seed, paths),
                "ours": pool.submit(run, sc, "ours", None, seed, paths),
                "exhaustive-admitted": pool.submit(
                    run, sc, "fixed-admitted", (best, n - best), seed, paths
                ),
            }
            rows = {k: f.result() for k, f in jobs.items()}
            rows["exhaustive"] = scores[best]
            if sc.moves:
                rows["online-bound"] = online_bound(pool, sc, seed, paths, scores)
            out["scenarios"][sc.name] = {
                "live_sessions": sc.live,
                "starts": sc.starts,
                "factor": sc.factor,
                "budget": sc.budget,
                "declared_rate": declared(sc, paths).request_rate,
                "exhaustive_split": f"{best}P:{n - best}D",
                "exhaustive_curve": {
                    f"{k}P:{n - k}D": v["goodput_rps"] for k, v in sorted(scores.items())
                },
                "methods": rows,
            }
            print(f"  done {sc.name}", file=sys.stderr, flush=True)
            if partial:
                _write(partial, out)
        out["layersplit"] = layersplit(pool, scs, seed, paths, out["scenarios"], only)
    return out


def layersplit(
    pool: ProcessPoolExecutor,
    scs: list[TraceScenario],
    seed: int,
    paths: Paths,
    done: dict[str, Any],
    only: tuple[str, ...],
) -> dict[str, Any]:
    """CP 4 with LayerSplit, CP 4 replicated and CP 1 on the stationary loads, each at the
    split exhaustive found for CP 1 (equal GPUs, equal split): goodput and hit rate by prompt
    length."""
    out: dict[str, Any] = {}
    for sc in scs:
        if sc.moves or (only and sc.name not in only) or sc.name not in done:
            continue
        n = sc.budget // 8
        k = int(done[sc.name]["exhaustive_split"].split("P")[0])
        futs = {
            layout: pool.submit(run, sc, "fixed", (k, n - k), seed, paths, layout)
            for layout in LAYOUTS
        }
        out[sc.name] = {
            "split": f"{k}P:{n - k}D",
            "layouts": {
                layout: {
                    key: f.result()[key]
                    for key in ("goodput_rps", "attainment", "hit_rate", "ttft_p90_s", "contexts")
                }
                for layout, f in futs.items()
            },
        }
    return out


# ---------------------------------------------------------------- report


def table(result: dict[str, Any]) -> str:
    lines = [
        "| scenario | method | goodput req/s | of exhaustive | of online bound | SLO attainment "
        "| hit rate: predicted / simulated | P:D start -> end |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, sc in result["scenarios"].items():
        m = sc["methods"]
        ex = m["exhaustive"]["goodput_rps"]
        bound = m.get("online-bound", {}).get("goodput_rps")
        for method, r in m.items():
            hc = r["hit_check"]
            lines.append(
                f"| {name} | {method} | {r['goodput_rps']:.2f} | {_share(r['goodput_rps'], ex)} "
                f"| {_share(r['goodput_rps'], bound) if bound else '-'} | {r['attainment']:.1%} "
                f"| {hc['predicted']:.3f} / {hc['measured']:.3f} "
                f"| {r.get('switch') or r['start'] + ' -> ' + r['end']} |"
            )
    return "\n".join(lines)


def layersplit_table(result: dict[str, Any]) -> str:
    lines = [
        "| scenario | prompt tokens | CP1: goodput, hit | CP4: goodput, hit | CP4 LayerSplit: "
        "goodput, hit | LayerSplit vs CP4 | LayerSplit vs CP1 | published |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in result.get("layersplit", {}).items():
        lay = s["layouts"]
        for k, bucket in enumerate(lay["cp1"]["contexts"]):
            cells = [lay[x]["contexts"][k] for x in LAYOUTS]
            rep, one, ls = cells[1]["goodput_rps"], cells[0]["goodput_rps"], cells[2]["goodput_rps"]
            hi = bucket["to_tokens"]
            pub = next(
                (v for at, v in PUBLISHED_LAYERSPLIT.items() if bucket["from_tokens"] < at <= hi),
                None,
            )
            pub_note = "" if pub is None else f"{pub:+.0%}"
            lines.append(
                f"| {name} ({s['split']}) | {_bucket(bucket)} | "
                + " | ".join(f"{c['goodput_rps']:.2f}, {c['hit_rate']:.2f}" for c in cells)
                + f" | {_gain(ls, rep)} | {_gain(ls, one)} | {pub_note} |"
            )
        tot = [lay[x] for x in LAYOUTS]
        lines.append(
            f"| {name} ({s['split']}) | all | "
            + " | ".join(f"{t['goodput_rps']:.2f}, {t['hit_rate']:.2f}" for t in tot)
            + f" | {_gain(tot[2]['goodput_rps'], tot[1]['goodput_rps'])} "
            f"| {_gain(tot[2]['goodput_rps'], tot[0]['goodput_rps'])} |  |"
        )
    return "\n".join(lines)


def _bucket(b: dict[str, float]) -> str:
    lo, hi = b["from_tokens"], b["to_tokens"]
    return f"{lo / 1000:.0f}K+" if math.isinf(hi) else f"{lo / 1000:.0f}-{hi / 1000:.0f}K"


def _gain(a: float, b: float) -> str:
    return f"{a / b - 1.0:+.0%}" if b > 0 else "n/a"


def _share(value: float, of: float | None) -> str:
    return f"{value / of:.0%}" if of else "n/a"


def criteria(result: dict[str, Any]) -> list[str]:
    """Ours against the issue's bars: >= 95% of exhaustive (of the online bound where the
    load moves), >= every static split where it is stationary, and the predicted hit rate
    within 0.05 of the simulator's; and against the exhaustive split behind the admission ours
    runs behind, which tells the planner's share of a shortfall from the admission's."""
    lines = []
    for name, sc in result["scenarios"].items():
        m = sc["methods"]
        ours = m["ours"]["goodput_rps"]
        ref_name = "online-bound" if "online-bound" in m else "exhaustive"
        ref = m[ref_name]["goodput_rps"]
        statics = {k: m[k]["goodput_rps"] for k in ("fixed-1:1", "best-fixed")}
        hc = m["ours"]["hit_check"]
        line = f"{name}: ours {ours:.2f} = {_share(ours, ref)} of {ref_name} ({ref:.2f})"
        if "exhaustive-admitted" in m:
            held = m["exhaustive-admitted"]["goodput_rps"]
            line += (
                f", {_share(ours, held)} of the exhaustive split behind its admission ({held:.2f})"
            )
        if "online-bound" not in m:
            beaten = [k for k, v in statics.items() if v > ours]
            # the two named static splits; the exhaustive one is the share above
            line += (
                "; >= fixed-1:1 and best-fixed" if not beaten else f"; below {', '.join(beaten)}"
            )
        line += (
            f"; hit rate predicted {hc['predicted']:.3f} vs simulated {hc['measured']:.3f} "
            f"({hc['error']:+.3f})"
        )
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.planner_traces", description=__doc__)
    ap.add_argument("--sessions", default=DEFAULT_SESSIONS, help="folder or tarball of sessions")
    ap.add_argument(
        "--mooncake", help="Mooncake arrivals (JSONL; default: beside the sessions' path)"
    )
    ap.add_argument("--quick", action="store_true", help="40-minute runs, exhaustive stride 4")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--limit", type=int, help="replay only the first N sessions")
    ap.add_argument("--only", action="append", default=[], help="this scenario only (repeat)")
    ap.add_argument(
        "--router", default=DEFAULT_ROUTER, choices=sorted(ROUTERS), help="the fleet's router"
    )
    ap.add_argument(
        "--window",
        type=float,
        default=FleetConfig.metric_window_s,
        help="the metrics window the policies read, seconds (the operator's default: 300)",
    )
    ap.add_argument("--out", default="bench/results/planner-traces.json")
    args = ap.parse_args(argv)
    mooncake = args.mooncake or str(Path(args.sessions).parent / MOONCAKE_FILE)
    paths = Paths(args.sessions, mooncake, args.limit)
    t0 = time.perf_counter()
    result = run_bench(
        args.quick,
        args.seed,
        args.workers,
        paths,
        tuple(args.only),
        args.out,
        args.router,
        args.window,
    )
    print(table(result))
    result["criteria"] = criteria(result)
    print("\n".join(result["criteria"]))
    print(layersplit_table(result))
    result["wall_s"] = time.perf_counter() - t0
    _write(args.out, result)
    print(f"\nwrote {args.out} in {result['wall_s']:.0f}s")
    return 0


def _write(path: str, result: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1, default=float)


if __name__ == "__main__":
    sys.exit(main())
